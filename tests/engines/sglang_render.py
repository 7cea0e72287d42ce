"""Token ids of chat requests as SGLang's OpenAI server computes them, for
the real-engine suite to hold kvedge's `engine: sglang` rendering to.

No SGLang server runs on CPU from PyPI, and its chat-serving module does
not import without GPU-side packages, so this runs SGLang's own code for
the plain Jinja-template path: the functions and methods of
`sglang/srt/entrypoints/openai/serving_chat.py` that prepare, render and
encode a chat (`_apply_jinja_template` and what it calls) are taken from
the installed package's source and run on a stand-in for the serving
object, configured as a server started with a model's template and no
tool or reasoning parser. Only the choice of tools the caller makes
(`_process_messages`, with no tool-call parser) is restated here.

Reads JSON lines on stdin: {"template": PATH, "model": DIR, "request":
BODY}; answers {"ids": [...]} or {"error": ...} on a line each.
"""

import ast
import copy
import json
import logging
import sys
from collections import OrderedDict
from enum import Enum
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

import jinja2
import orjson
import sglang
from sglang.srt.entrypoints.openai.parallel_prompt_encode import (
    encode_prompt_segments,
    parallel_prompt_encode,
)
from sglang.srt.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    MessageProcessingResult,
)
from sglang.srt.parser.jinja_template_utils import (
    MEDIA_URL_PART_TYPES,
    detect_jinja_template_content_format,
    jinja_template_may_reorder_tool_results,
    process_content_for_template_format,
)
from sglang.srt.parser.python_chat_template import render_chat_segments
from sglang.srt.parser.response_template import ResponseTemplateReasoningDetector
from transformers import AutoTokenizer

SOURCE = Path(sglang.__file__).parent / "srt/entrypoints/openai/serving_chat.py"
FUNCTIONS = {"normalize_tool_content", "parse_tool_call_arguments", "normalize_assistant_tool_call_arguments"}
METHODS = {
    "_apply_jinja_template",
    "_handle_last_assistant_message",
    "_append_assistant_prefix_to_prompt_ids",
    "_render_and_encode_chat_template",
    "_canonicalize_tool_message_order",
    "_sort_tool_message_run",
}


class ThinkingMode(str, Enum):
    CHAT = "chat"
    THINKING = "thinking"


def sglang_code():
    """SGLang's functions and methods, compiled from its source."""
    tree = ast.parse(SOURCE.read_text())
    body = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in FUNCTIONS:
            body.append(node)
        elif isinstance(node, ast.ClassDef) and node.name == "OpenAIServingChat":
            body.extend(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name in METHODS)
    found = {n.name for n in body}
    missing = (FUNCTIONS | METHODS) - found
    if missing:
        raise SystemExit(f"not in SGLang's source: {sorted(missing)}")
    namespace = {
        "copy": copy,
        "json": json,
        "orjson": orjson,
        "jinja2": jinja2,
        "logger": logging.getLogger("sglang"),
        "Any": Any,
        "Dict": Dict,
        "List": List,
        "Optional": Optional,
        "OrderedDict": OrderedDict,
        "ThinkingMode": ThinkingMode,
        "ChatCompletionRequest": ChatCompletionRequest,
        "MessageProcessingResult": MessageProcessingResult,
        "process_content_for_template_format": process_content_for_template_format,
        "render_chat_segments": render_chat_segments,
        "ResponseTemplateReasoningDetector": ResponseTemplateReasoningDetector,
        "encode_prompt_segments": encode_prompt_segments,
        "parallel_prompt_encode": parallel_prompt_encode,
        "_CHAT_TEMPLATE_CLIENT_ERRORS": (jinja2.TemplateError, TypeError),
        "_CHAT_TEMPLATE_CACHE_MAX_SIZE": 128,
        "MEDIA_URL_PART_TYPES": MEDIA_URL_PART_TYPES,
        "__name__": "sglang_serving_chat_excerpt",
    }
    module = ast.Module(body=[ast.parse("from __future__ import annotations").body[0], *body], type_ignores=[])
    exec(compile(module, str(SOURCE), "exec"), namespace)
    return namespace


CODE = sglang_code()


# The methods as a class, so that class and static methods work as theirs.
Serving = type("Serving", (), {name: CODE[name] for name in METHODS})


def serving(template, model):
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = template
    s = Serving()
    s.template_manager = SimpleNamespace(
        jinja_template_content_format=detect_jinja_template_content_format(template),
        jinja_template_may_reorder_tool_results=jinja_template_may_reorder_tool_results(template),
        reasoning_config=None,
        python_chat_template=None,
        chat_template_name=None,
    )
    s.tokenizer_manager = SimpleNamespace(tokenizer=tok)
    s.chat_encoding_spec = None
    s._encoding_adapter = None
    s.is_minimax_m3 = False
    s._reasoning_detector = None
    s._tokenizer_auto_adds_specials = len(tok.encode("")) > 0
    s._prompt_text_round_trip_is_lossy = False
    s._chat_template_cache = OrderedDict()
    s._thinking_requested = lambda request: False
    s._encode_messages = lambda *args, **kwargs: None
    return s


def tools_for(request):
    """`_process_messages`' choice of tools, with no tool-call parser."""
    if not request.tools or request.tool_choice == "none":
        return None
    if not isinstance(request.tool_choice, str):
        return [t.model_dump() for t in request.tools if t.function.name == request.tool_choice.function.name] or None
    return [t.model_dump() for t in request.tools]


servers = {}
for line in sys.stdin:
    job = json.loads(line)
    try:
        template = Path(job["template"]).read_text(encoding="utf-8")
        key = (job["template"], job["model"])
        if key not in servers:
            servers[key] = serving(template, job["model"])
        request = ChatCompletionRequest.model_validate(job["request"])
        result = servers[key]._apply_jinja_template(request, tools_for(request), False)
        answer = {"ids": list(result.prompt_ids)}
    except Exception as e:  # the request's or the template's refusal
        answer = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(answer), flush=True)
