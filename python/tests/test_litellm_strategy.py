"""kvedge as LiteLLM's routing strategy: a real LiteLLM Router calling real
HTTP servers that answer as OpenAI-compatible engines, with a real daemon
choosing between them."""

from __future__ import annotations

import asyncio
import http.server
import os
import json
import pathlib
import sys
import threading
import warnings

import pytest

import kvedge
from conftest import Daemon, wait_for

# The cost map ships with LiteLLM; do not fetch it (no network needed).
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
litellm = pytest.importorskip("litellm")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
from litellm_strategy import KvedgeRoutingStrategy  # noqa: E402
from openai_proxy import byte_tokens  # noqa: E402


class Engine(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        port = self.server.server_address[1]
        out = json.dumps(
            {
                "id": "c",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": f"engine {port}"}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        ).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: object) -> None:
        pass


def test_litellm_sends_each_call_where_kvedge_finds_its_prefix(daemon: Daemon) -> None:
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), Engine) for _ in range(2)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    try:
        urls = [f"http://127.0.0.1:{s.server_address[1]}/v1" for s in servers]
        engines = [kvedge.Publisher(daemon.control, i + 1, "m", endpoint=u) for i, u in enumerate(urls)]
        conversations = [
            [{"role": "system", "content": f"You are assistant number {i}. " * 20}, {"role": "user", "content": "hi"}]
            for i in range(2)
        ]
        # Engine i holds conversation i's prompt.
        for e, conv in zip(engines, conversations):
            text = "".join(f"<|{m['role']}|>{m['content']}" for m in conv)
            assert e.stored(tokens=byte_tokens(text))
        with kvedge.Client(daemon.dir) as c:
            wait_for(lambda: c.stats()["index_entries"] > 0 and c.stats()["workers"] == 2, "the engines")
        router = litellm.Router(
            model_list=[
                {"model_name": "m", "litellm_params": {"model": "openai/m", "api_base": u, "api_key": "-"}}
                for u in urls
            ]
        )
        router.set_custom_routing_strategy(KvedgeRoutingStrategy(router, str(daemon.dir)))

        async def main() -> None:
            for _ in range(3):
                for i, conv in enumerate(conversations):
                    r = await router.acompletion(model="m", messages=conv)
                    assert r.choices[0].message.content == f"engine {servers[i].server_address[1]}"

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            asyncio.run(main())
        del engines
    finally:
        for s in servers:
            s.shutdown()
