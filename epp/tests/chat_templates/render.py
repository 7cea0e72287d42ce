"""Renders chat templates as transformers' apply_chat_template does.

Reads one JSON object per line on stdin, {"template": ..., "context": ...},
and writes one JSON line per input: {"text": ...} or {"error": ...}.
"""

import json
import sys
from datetime import datetime

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format):
    return datetime.now().strftime(format)


env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
env.filters["tojson"] = tojson
env.globals["raise_exception"] = raise_exception
env.globals["strftime_now"] = strftime_now

for line in sys.stdin:
    job = json.loads(line)
    try:
        text = env.from_string(job["template"]).render(**job["context"])
        print(json.dumps({"text": text}), flush=True)
    except Exception as e:  # noqa: BLE001 - the error goes back to the test
        print(json.dumps({"error": str(e)}), flush=True)
