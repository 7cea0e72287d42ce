"""kvedge for Python: ask the kvedge routing daemon which worker should serve a
request, and publish an engine's KV-cache events to it.

- ``Client`` / ``AsyncClient``: ``select`` (binary protocol, or shared-memory
  query channels after ``attach_rings``), ``prefill_done``, ``finish``,
  ``workers``, ``stats``; ``select(..., explain=True)`` and the prompt
  ``text`` go over the JSON protocol, the only one that carries them.
- ``hash_blocks``: the sequence hashes engines and the daemon compute.
- ``Publisher``: an engine's registration and its stored / removed /
  cleared / load events.

Errors are ``KvedgeError`` subclasses with the daemon's ``status`` name and
``code`` (None when the daemon was not reached).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
from typing import Any, Dict, List, Mapping, Optional, Sequence

from ._kvedge import (
    BadRequest,
    BlockHashes,
    DaemonUnavailable,
    KvedgeError,
    NativeClient,
    NoWorker,
    Publisher,
    Refused,
    Rejected,
    Selection,
    TooManyRequests,
    UnknownRequest,
    block_hashes,
    hash_blocks,
)

__all__ = [
    "AsyncClient",
    "BadRequest",
    "BlockHashes",
    "Client",
    "DaemonUnavailable",
    "KvedgeError",
    "NoWorker",
    "Publisher",
    "Refused",
    "Rejected",
    "Selection",
    "TooManyRequests",
    "UnknownRequest",
    "block_hashes",
    "hash_blocks",
]

DEFAULT_RUNTIME_DIR = "/run/kvedge"

# The protocol's status names and codes (the JSON protocol sends the name,
# the binary one the code); the tests check they match the native client's.
_STATUS_CODES = {
    "bad_request": 1,
    "no_worker": 2,
    "rejected": 3,
    "no_rule": 4,
    "unknown_request": 5,
    "frame_too_large": 6,
    "unsupported_version": 7,
    "unknown_op": 8,
    "too_many_requests": 9,
    "rings_unavailable": 10,
    "too_many_connections": 11,
    "not_permitted": 12,
    "reload_failed": 13,
}

_STATUS_ERRORS = {
    "bad_request": BadRequest,
    "no_worker": NoWorker,
    "rejected": Rejected,
    "no_rule": Rejected,
    "unknown_request": UnknownRequest,
    "too_many_requests": TooManyRequests,
}


def _status_error(status: str, message: str) -> KvedgeError:
    err = _STATUS_ERRORS.get(status, Refused)(message)
    err.status = status
    err.code = _STATUS_CODES.get(status)
    return err


def _unavailable(message: str) -> DaemonUnavailable:
    err = DaemonUnavailable(f"kvedge daemon: {message}")
    err.status = None
    err.code = None
    return err


class _JsonConnection:
    """One JSON-lines connection to ``query.sock`` (for what the binary
    protocol does not carry: explain, the prompt text, workers, stats)."""

    def __init__(self, path: str, timeout: Optional[float]) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(path)
        except OSError as e:
            self._sock.close()
            raise _unavailable(f"{path}: {e}") from None
        self._reader = self._sock.makefile("rb")

    def ask(self, request: Mapping[str, Any]) -> Dict[str, Any]:
        line = json.dumps(request, separators=(",", ":")).encode() + b"\n"
        try:
            self._sock.sendall(line)
            reply = self._reader.readline()
        except OSError as e:
            raise _unavailable(str(e)) from None
        if not reply:
            raise _unavailable("the daemon closed the connection")
        answer = json.loads(reply)
        error = answer.get("error")
        if isinstance(error, dict):
            raise _status_error(str(error.get("code")), str(error.get("message")))
        return answer

    def close(self) -> None:
        self._reader.close()
        self._sock.close()


_SELECT_ARGS = {
    "tokens",
    "hashes",
    "prompt_tokens",
    "tenant",
    "tags",
    "headers",
    "session",
    "role",
    "priority",
    "dry_run",
}


def _selection_from_json(answer: Mapping[str, Any]) -> Selection:
    overlap = answer.get("overlap_blocks") or {}
    return Selection(
        worker_id=answer.get("worker_id"),
        dp_rank=answer.get("dp_rank"),
        endpoint=answer.get("endpoint") or "",
        provider=answer.get("provider"),
        device_blocks=overlap.get("device", 0),
        host_blocks=overlap.get("host", 0),
        disk_blocks=overlap.get("disk", 0),
        cost=answer.get("cost"),
        policy=answer.get("policy"),
        rule=answer.get("rule"),
        request_id=answer.get("request_id", 0),
        explain=answer.get("explain"),
    )


class Client:
    """A blocking client of the daemon whose runtime directory (holding
    ``query.sock``) is ``runtime_dir``. Not for concurrent use from several
    threads at once (each call locks); use one per thread, or AsyncClient.
    """

    def __init__(self, runtime_dir: "os.PathLike[str] | str" = DEFAULT_RUNTIME_DIR, timeout: Optional[float] = 10.0) -> None:
        self._path = os.path.join(os.fspath(runtime_dir), "query.sock")
        self._timeout = timeout
        self._native = NativeClient(self._path, timeout)
        self._json: Optional[_JsonConnection] = None
        self._json_lock = threading.Lock()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ask_json(self, request: Mapping[str, Any]) -> Dict[str, Any]:
        with self._json_lock:
            if self._json is None:
                self._json = _JsonConnection(self._path, self._timeout)
            try:
                return self._json.ask(request)
            except DaemonUnavailable:
                self._json.close()
                self._json = None
                raise

    def select(
        self,
        model: str,
        *,
        explain: bool = False,
        text: Optional[str] = None,
        **kwargs: Any,
    ) -> Selection:
        """Chooses a worker: ``select(model, *, tokens=None, hashes=None,
        prompt_tokens=None, tenant=None, tags=None, headers=None,
        session=None, role="aggregated", priority=0, dry_run=False,
        explain=False, text=None)``. Exactly one of ``tokens`` and
        ``hashes`` (a list of ints, or a ``BlockHashes`` from
        ``block_hashes``, which is read without conversion). With
        ``explain`` or ``text`` the request goes over the JSON protocol and
        the answer also names the policy and the rule."""
        if not explain and text is None:
            headers = kwargs.get("headers")
            if headers is not None and not isinstance(headers, list):
                kwargs["headers"] = list(headers.items())
            return self._native.select(model, **kwargs)
        unknown = set(kwargs) - _SELECT_ARGS
        if unknown:
            raise TypeError(f"select() got unexpected keyword arguments {sorted(unknown)}")
        tokens, hashes = kwargs.get("tokens"), kwargs.get("hashes")
        if (tokens is None) == (hashes is None):
            raise ValueError("give exactly one of tokens and hashes")
        request: Dict[str, Any] = {"op": "select", "model": model, "role": kwargs.get("role", "aggregated")}
        if tokens is not None:
            request["tokens"] = list(tokens)
        else:
            request["hashes"] = list(hashes)
        headers = kwargs.get("headers")
        optional = {
            "prompt_tokens": kwargs.get("prompt_tokens"),
            "tenant": kwargs.get("tenant"),
            "tags": list(kwargs["tags"]) if kwargs.get("tags") else None,
            "headers": dict(headers) if headers else None,
            "session": kwargs.get("session"),
            "priority": kwargs.get("priority") or None,
            "dry_run": kwargs.get("dry_run") or None,
            "explain": explain or None,
            "text": text,
        }
        request.update({k: v for k, v in optional.items() if v is not None})
        return _selection_from_json(self._ask_json(request))

    def prefill_done(self, request_id: int) -> None:
        """The request's first token came out: its prefill leaves the
        worker's projected load, and the daemon learns the worker's speed."""
        self._native.prefill_done(request_id)

    def finish(self, request_id: int) -> None:
        """The request finished: it leaves the worker's projected load."""
        self._native.finish(request_id)

    def attach_rings(self) -> bool:
        """Moves selects onto a shared-memory query channel; False (still
        fully usable over the socket) when the daemon offers none."""
        return self._native.attach_rings()

    @property
    def rings_attached(self) -> bool:
        return self._native.rings_attached

    def workers(self) -> List[Dict[str, Any]]:
        """Every registered worker with its state, load and index counts."""
        return list(self._ask_json({"op": "workers"})["workers"])

    def stats(self) -> Dict[str, Any]:
        """The daemon's counters."""
        answer = self._ask_json({"op": "stats"})
        return dict(answer)

    def close(self) -> None:
        self._native.close()
        with self._json_lock:
            if self._json is not None:
                self._json.close()
                self._json = None


class AsyncClient:
    """The same calls as Client, as coroutines that never block the event
    loop: each runs on a worker thread with a connection of its own from a
    small pool (at most ``connections``), and the native calls release the
    GIL while they wait on the daemon."""

    def __init__(
        self,
        runtime_dir: "os.PathLike[str] | str" = DEFAULT_RUNTIME_DIR,
        timeout: Optional[float] = 10.0,
        connections: int = 8,
        rings: bool = False,
    ) -> None:
        if connections < 1:
            raise ValueError("connections must be at least 1")
        self._dir = os.fspath(runtime_dir)
        self._timeout = timeout
        self._rings = rings
        self._idle: List[Client] = []
        self._slots = asyncio.Semaphore(connections)
        self._closed = False

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _client(self) -> Client:
        if self._idle:
            return self._idle.pop()
        c = Client(self._dir, self._timeout)
        if self._rings:
            c.attach_rings()
        return c

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise _unavailable("the client is closed")
        loop = asyncio.get_running_loop()
        async with self._slots:

            def run() -> Any:
                c = self._client()
                try:
                    result = getattr(c, method)(*args, **kwargs)
                except DaemonUnavailable:
                    c.close()
                    raise
                except BaseException:
                    self._idle.append(c)
                    raise
                self._idle.append(c)
                return result

            return await loop.run_in_executor(None, run)

    async def select(self, model: str, **kwargs: Any) -> Selection:
        return await self._call("select", model, **kwargs)

    async def prefill_done(self, request_id: int) -> None:
        await self._call("prefill_done", request_id)

    async def finish(self, request_id: int) -> None:
        await self._call("finish", request_id)

    async def workers(self) -> List[Dict[str, Any]]:
        return await self._call("workers")

    async def stats(self) -> Dict[str, Any]:
        return await self._call("stats")

    async def close(self) -> None:
        self._closed = True
        while self._idle:
            self._idle.pop().close()
