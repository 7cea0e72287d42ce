"""The reference for epp/tests/chat_corpus.rs: chats rendered by transformers'
own apply_chat_template, handed over the way vLLM's OpenAI server hands
them (tools with every field, tool-call arguments as objects, content as a
list of text parts when the template loops over it, only the
chat_template_kwargs the template reads), and the text tokenized as vLLM
tokenizes a chat: without adding special tokens.

Reads JSON lines on stdin, answers one JSON line each:
  {"op": "tokenizers", "dir": D, "specials": [...], "text": T}
      trains a byte-level BPE and a SentencePiece-style (Metaspace, byte
      fallback) tokenizer on T, with `specials` as special tokens, and
      writes D/byte_level.json and D/sentencepiece.json
  {"template": PATH, "tokenizer": PATH, "bos": B, "eos": E, "request": R}
      R is a chat completion request's body as a client sends it;
      answers {"text": ..., "ids": [...]} or {"error": ...}
  {"op": "parts", "template": PATH}
      whether the template loops over a message's content: {"parts": bool}
"""

import json
import os
import sys

import jinja2.meta
from jinja2 import nodes
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from transformers.utils.chat_template_utils import _compile_jinja_template


def make_tokenizers(d, specials, text):
    byte_level = Tokenizer(models.BPE())
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.decoder = decoders.ByteLevel()
    byte_level.train_from_iterator(
        [text],
        trainers.BpeTrainer(
            vocab_size=1200,
            show_progress=False,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    byte_level.save(os.path.join(d, "byte_level.json"))

    sentencepiece = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    sentencepiece.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    sentencepiece.decoder = decoders.Metaspace(prepend_scheme="first")
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    sentencepiece.train_from_iterator(
        [text],
        trainers.BpeTrainer(
            vocab_size=1400, show_progress=False, special_tokens=["<unk>"] + specials + byte_tokens
        ),
    )
    sentencepiece.save(os.path.join(d, "sentencepiece.json"))


def unwrap(node):
    """The node a filter, a test or a slice is applied to."""
    while True:
        if isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
            node = node.node
        else:
            return node


def key_of(node):
    if isinstance(node, nodes.Getattr):
        return node.attr
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const):
        return node.arg.value
    return None


def loops_over_content(source):
    """Whether a loop runs over a message's content (on the syntax tree)."""
    ast = _compile_jinja_template(source).environment.parse(source)
    lists = {"messages"}
    for _ in range(4):
        for a in ast.find_all(nodes.Assign):
            base = unwrap(a.node)
            if isinstance(a.target, nodes.Name) and isinstance(base, nodes.Name) and base.name in lists:
                lists.add(a.target.name)
    messages = set()
    for f in ast.find_all(nodes.For):
        base = unwrap(f.iter)
        if isinstance(f.target, nodes.Name) and isinstance(base, nodes.Name) and base.name in lists:
            messages.add(f.target.name)
    for f in ast.find_all(nodes.For):
        it = unwrap(f.iter)
        if key_of(it) == "content" and isinstance(it.node, nodes.Name) and it.node.name in messages:
            return True
        if isinstance(it, nodes.Name) and it.name == "content":
            return True
    return False


def as_vllm_hands_it(request, source):
    parts = loops_over_content(source)
    conversation = []
    for m in request["messages"]:
        content = m.get("content")
        texts = [content] if isinstance(content, str) else [p["text"] for p in content or []]
        out = {"role": m["role"]}
        if parts and m["role"] != "tool":
            out["content"] = [{"type": "text", "text": t} for t in texts]
        else:
            out["content"] = "\n".join(texts)
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                # As the OpenAI SDK's typed dicts order a tool call.
                args = c["function"].get("arguments")
                function = {
                    "arguments": json.loads(args) if isinstance(args, str) and args else (args or {}),
                    "name": c["function"]["name"],
                }
                calls.append({"id": c["id"], "function": function, "type": c.get("type", "function")})
            out["tool_calls"] = calls
        if "tool_call_id" in m:
            out["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
        conversation.append(out)
    tools = None
    if request.get("tools") is not None:
        tools = [
            {
                "type": t.get("type", "function"),
                "function": {
                    "name": t["function"]["name"],
                    "description": t["function"].get("description"),
                    "parameters": t["function"].get("parameters"),
                },
            }
            for t in request["tools"]
        ]
    ast = _compile_jinja_template(source).environment.parse(source)
    read = jinja2.meta.find_undeclared_variables(ast)
    kwargs = {k: v for k, v in (request.get("chat_template_kwargs") or {}).items() if k in read}
    return conversation, tools, kwargs


def render(job):
    source = open(job["template"], encoding="utf-8").read()
    tok = PreTrainedTokenizerFast(
        tokenizer_file=job["tokenizer"], bos_token=job["bos"], eos_token=job["eos"]
    )
    request = job["request"]
    conversation, tools, kwargs = as_vllm_hands_it(request, source)
    text = tok.apply_chat_template(
        conversation,
        tools=tools,
        documents=request.get("documents"),
        chat_template=source,
        add_generation_prompt=request.get("add_generation_prompt", True),
        continue_final_message=request.get("continue_final_message", False),
        tokenize=False,
        **kwargs,
    )
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return {"text": text, "ids": ids}


for line in sys.stdin:
    job = json.loads(line)
    if job.get("op") == "tokenizers":
        make_tokenizers(job["dir"], job["specials"], job["text"])
        print(json.dumps({"ok": True}), flush=True)
        continue
    if job.get("op") == "parts":
        source = open(job["template"], encoding="utf-8").read()
        print(json.dumps({"parts": loops_over_content(source)}), flush=True)
        continue
    try:
        answer = render(job)
    except Exception as e:  # the template's own refusals included
        answer = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(answer, ensure_ascii=False), flush=True)
