"""The example OpenAI-compatible proxy, in front of a fake engine that
streams over real HTTP the way an OpenAI-compatible server does (server-sent
events), with a real daemon choosing the worker."""

from __future__ import annotations

import asyncio
import http.server
import json
import pathlib
import sys
import threading
import time
from typing import Iterator, Tuple

import httpx
import pytest

import kvedge
from conftest import Daemon, wait_for

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
import openai_proxy  # noqa: E402


class FakeEngine(http.server.BaseHTTPRequestHandler):
    """Answers /v1/completions with three SSE chunks, the first after
    100 ms (its "prefill"), and records what it was sent."""

    received: list = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        FakeEngine.received.append((self.path, body))
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        time.sleep(0.1)
        for word in ("Hello", " world", "[DONE]"):
            data = word if word == "[DONE]" else json.dumps({"choices": [{"text": word}]})
            self.wfile.write(f"data: {data}\n\n".encode())
            self.wfile.flush()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake_engine() -> Iterator[Tuple[str, http.server.HTTPServer]]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeEngine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", server
    server.shutdown()


def test_the_proxy_routes_streams_and_reports_prefill_done_and_finish(
    daemon: Daemon, fake_engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _ = fake_engine
    # A proxy named in the environment (nothing listens there) is not used
    # for the engines: they are this node's.
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")
    engine = kvedge.Publisher(daemon.control, 1, "m", block_size=16, endpoint=url)
    prompt = "You are a helpful assistant. " * 80  # 2,320 bytes
    with kvedge.Client(daemon.dir) as c:
        wait_for(lambda: c.stats()["workers"] == 1, "the engine")
        prior = c.workers()[0]["prefill_tokens_per_second"]

    async def main() -> None:
        proxy = openai_proxy.Proxy(str(daemon.dir))
        transport = httpx.ASGITransport(app=proxy)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            r = await client.post("/v1/completions", json={"model": "m", "prompt": prompt, "stream": True})
            assert r.status_code == 200, r.text
            assert r.headers["x-kvedge-worker"] == "1"
            assert "Hello" in r.text and "[DONE]" in r.text
            chat = {"model": "m", "messages": [{"role": "user", "content": prompt}], "stream": True}
            r = await client.post("/v1/chat/completions", json=chat, headers={"x-session-id": "s1"})
            assert r.status_code == 200 and "[DONE]" in r.text
            # Errors never reach a worker.
            r = await client.post("/v1/completions", json={"model": "nobody", "prompt": "x"})
            assert r.status_code == 503 and "nobody" in r.json()["error"]["message"]
            r = await client.post("/v1/completions", content=b"not json")
            assert r.status_code == 400
            r = await client.get("/v1/models")
            assert r.status_code == 404
        await proxy.kvedge.close()

    asyncio.run(main())
    assert [p for p, _ in FakeEngine.received] == ["/v1/completions", "/v1/chat/completions"]
    assert FakeEngine.received[0][1]["prompt"] == prompt
    with kvedge.Client(daemon.dir) as c:
        # finish released the reservation; prefill_done taught the speed
        # (2,320 tokens of work in about 100 ms, not the 10,000/s prior).
        assert c.stats()["reservations"] == 0
        learned = c.workers()[0]["prefill_tokens_per_second"]
        assert learned != prior, (prior, learned)
    del engine
