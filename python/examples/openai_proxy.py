"""A small OpenAI-compatible proxy that routes through kvedge.

For each POST to /v1/completions or /v1/chat/completions it asks the kvedge
daemon which worker should serve the request, forwards the request to that
worker's endpoint, streams the answer back, and tells the daemon when the
first token came out (``prefill_done``: it also teaches the daemon the
worker's prefill speed) and when the request finished (``finish``). A
client that goes away mid-stream still finishes its reservation.

It is a plain ASGI application (no framework) over httpx, so any ASGI
server runs it::

    pip install kvedge httpx uvicorn
    KVEDGE_RUNTIME_DIR=/run/kvedge KVEDGE_TOKENIZER=/models/llama/tokenizer.json \\
        uvicorn openai_proxy:app --port 8080

Routing on prefixes needs the token ids the engines hash: give the model's
``tokenizer.json`` (KVEDGE_TOKENIZER, read with the ``tokenizers`` package)
or send token ids as the prompt. Without either the proxy falls back to the
prompt's UTF-8 bytes, which spreads load correctly but finds no prefix the
engines published.
"""

from __future__ import annotations

import json
import os
from typing import Any, Awaitable, Callable, Dict, List, Optional

import httpx

import kvedge

Scope = Dict[str, Any]
Receive = Callable[[], Awaitable[Dict[str, Any]]]
Send = Callable[[Dict[str, Any]], Awaitable[None]]


def byte_tokens(text: str) -> List[int]:
    return list(text.encode())


def load_tokenizer(path: Optional[str]) -> Callable[[str], List[int]]:
    if not path:
        return byte_tokens
    from tokenizers import Tokenizer  # the model's own tokenizer.json

    tokenizer = Tokenizer.from_file(path)
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids


def prompt_tokens(body: Dict[str, Any], tokenize: Callable[[str], List[int]]) -> List[int]:
    if "messages" in body:
        # A stand-in for the model's chat template: the messages in order.
        text = "".join(f"<|{m.get('role', '')}|>{m.get('content', '')}" for m in body["messages"])
        return tokenize(text)
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return prompt
    if isinstance(prompt, list):
        prompt = "".join(str(p) for p in prompt)
    return tokenize(str(prompt))


class Proxy:
    """The ASGI application."""

    def __init__(
        self,
        runtime_dir: str,
        tokenize: Callable[[str], List[int]] = byte_tokens,
        http: Optional[httpx.AsyncClient] = None,
    ) -> None:
        self.kvedge = kvedge.AsyncClient(runtime_dir, rings=True)
        self.tokenize = tokenize
        # trust_env=False: the engines are this node's; an HTTP_PROXY set
        # in the environment (for model downloads, say) must not carry
        # their traffic.
        self.http = http or httpx.AsyncClient(timeout=None, trust_env=False)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await self.kvedge.close()
                    await self.http.aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path = scope["path"]
        if scope["method"] != "POST" or path not in ("/v1/completions", "/v1/chat/completions"):
            return await respond(send, 404, {"error": {"message": f"no route for {scope['method']} {path}"}})
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        try:
            body = json.loads(raw)
            model = body["model"]
        except (ValueError, KeyError, TypeError):
            return await respond(send, 400, {"error": {"message": "the body must be JSON with a model"}})
        headers = {k.decode().lower(): v.decode() for k, v in scope.get("headers", [])}
        try:
            choice = await self.kvedge.select(
                model,
                tokens=prompt_tokens(body, self.tokenize),
                session=headers.get("x-session-id"),
                tenant=headers.get("x-tenant"),
            )
        except kvedge.NoWorker as e:
            return await respond(send, 503, {"error": {"message": str(e)}})
        except kvedge.KvedgeError as e:
            return await respond(send, 502, {"error": {"message": str(e)}})
        await self.forward(choice, path, raw, send)

    async def forward(self, choice: kvedge.Selection, path: str, raw: bytes, send: Send) -> None:
        url = choice.endpoint.rstrip("/") + path
        first = True
        try:
            async with self.http.stream(
                "POST", url, content=raw, headers={"content-type": "application/json"}
            ) as upstream:
                await send(
                    {
                        "type": "http.response.start",
                        "status": upstream.status_code,
                        "headers": [
                            (b"content-type", upstream.headers.get("content-type", "application/json").encode()),
                            (b"x-kvedge-worker", str(choice.worker_id).encode()),
                        ],
                    }
                )
                async for chunk in upstream.aiter_raw():
                    if first and chunk:
                        # The first bytes of the answer: the prefill is done.
                        first = False
                        await self.kvedge.prefill_done(choice.request_id)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b""})
        except httpx.HTTPError as e:
            await respond(send, 502, {"error": {"message": f"worker {choice.worker_id}: {e}"}})
        finally:
            # (No prefill_done when no byte came back: its timing would
            # teach the daemon a speed the worker never had.)
            try:
                await self.kvedge.finish(choice.request_id)
            except kvedge.KvedgeError:
                pass  # expired or the daemon restarted: nothing to release


async def respond(send: Send, status: int, body: Dict[str, Any]) -> None:
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": payload})


def app_from_env() -> Proxy:
    return Proxy(
        os.environ.get("KVEDGE_RUNTIME_DIR", kvedge.DEFAULT_RUNTIME_DIR),
        load_tokenizer(os.environ.get("KVEDGE_TOKENIZER")),
    )


# For `uvicorn openai_proxy:app`; nothing connects until the first request.
app = app_from_env()
