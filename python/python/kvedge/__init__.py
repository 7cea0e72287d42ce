"""kvedge for Python: ask the kvedge routing daemon which worker should serve a
request, and publish an engine's KV-cache events to it.

- ``Client`` / ``AsyncClient``: ``select`` (binary protocol, or shared-memory
  query channels after ``attach_rings``), ``prefill_done``, ``finish``,
  ``workers``, ``stats``; ``select(..., explain=True)`` and the prompt
  ``text`` go over the JSON protocol, the only one that carries them.
- ``hash_blocks``: the sequence hashes engines and the daemon compute.
- ``Publisher``: an engine's registration and its stored / removed /
  cleared / load events.

Errors are ``KvedgeError`` subclasses (``kvedge.errors``) with the daemon's
``status`` name and ``code`` (None when the daemon was not reached).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, TypeVar, Union

from ._kvedge import (
    BlockHashes,
    NativeClient,
    Publisher,
    Selection,
    block_hashes,
    hash_blocks,
)
from .errors import (
    BadRequest,
    DaemonUnavailable,
    KvedgeError,
    NoWorker,
    Refused,
    Rejected,
    TooManyRequests,
    UnknownRequest,
    status_error,
    unavailable,
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

_T = TypeVar("_T")

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
            raise unavailable(f"{path}: {e}") from None
        self._reader = self._sock.makefile("rb")

    def ask(self, request: Mapping[str, Any]) -> Dict[str, Any]:
        line = json.dumps(request, separators=(",", ":")).encode() + b"\n"
        try:
            self._sock.sendall(line)
            reply = self._reader.readline()
        except OSError as e:
            raise unavailable(str(e)) from None
        if not reply:
            raise unavailable("the daemon closed the connection")
        answer = json.loads(reply)
        if not isinstance(answer, dict):
            raise unavailable("the daemon's answer is not a JSON object")
        error = answer.get("error")
        if isinstance(error, dict):
            raise status_error(str(error.get("code")), str(error.get("message")))
        return answer

    def close(self) -> None:
        self._reader.close()
        self._sock.close()


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
        tokens: Optional[Sequence[int]] = None,
        hashes: Union[Sequence[int], BlockHashes, None] = None,
        prompt_tokens: Optional[int] = None,
        tenant: Optional[str] = None,
        tags: Optional[Sequence[str]] = None,
        headers: Optional[Mapping[str, str]] = None,
        session: Optional[str] = None,
        role: str = "aggregated",
        priority: int = 0,
        dry_run: bool = False,
        explain: bool = False,
        text: Optional[str] = None,
        trigger: str = "user",
        parent_session: Optional[str] = None,
        final_turn: bool = False,
        target: Optional[Tuple[int, int]] = None,
        tolerations: Optional[Sequence[str]] = None,
    ) -> Selection:
        """Chooses a worker for a request for ``model``. Exactly one of
        ``tokens`` and ``hashes`` (a list of ints, or a ``BlockHashes`` from
        ``block_hashes``, which is read without conversion). With
        ``explain`` or ``text`` the request goes over the JSON protocol and
        the answer also names the policy and the rule.

        ``trigger`` (``"user"``, ``"tool"`` or ``"other"``: what started
        this turn), ``parent_session`` and ``final_turn`` (the session's
        last turn: its binding ends) describe ``session`` and need it.
        ``target``, a ``(worker_id, dp_rank)``, serves the request on
        exactly that worker, with no policy. ``tolerations`` names the
        engines' taints the request tolerates (``"key"`` or ``"key=value"``)."""
        if not explain and text is None:
            return self._native.select(
                model,
                tokens=tokens,
                hashes=hashes,
                prompt_tokens=prompt_tokens,
                tenant=tenant,
                tags=tags,
                headers=list(headers.items()) if headers is not None else None,
                session=session,
                role=role,
                priority=priority,
                dry_run=dry_run,
                trigger=trigger,
                parent_session=parent_session,
                final_turn=final_turn,
                target=target,
                tolerations=tolerations,
            )
        if (tokens is None) == (hashes is None):
            raise ValueError("give exactly one of tokens and hashes")
        request: Dict[str, Any] = {"op": "select", "model": model, "role": role}
        if tokens is not None:
            request["tokens"] = list(tokens)
        elif hashes is not None:
            request["hashes"] = hashes.to_list() if isinstance(hashes, BlockHashes) else list(hashes)
        optional = {
            "prompt_tokens": prompt_tokens,
            "tenant": tenant,
            "tags": list(tags) if tags else None,
            "headers": dict(headers) if headers else None,
            "session": session,
            "priority": priority or None,
            "dry_run": dry_run or None,
            "explain": explain or None,
            "text": text,
            "trigger": trigger if trigger != "user" else None,
            "parent_session": parent_session,
            "final": final_turn or None,
            "target": {"worker_id": target[0], "dp_rank": target[1]} if target is not None else None,
            "tolerations": list(tolerations) if tolerations else None,
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

    def abort(self, request_id: int) -> None:
        """The request was never served: its dispatch failed before a
        response stream. It leaves the worker's projected load, and its
        session's binding goes back to what it was before its select."""
        self._native.abort(request_id)

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

    async def _call(self, call: Callable[[Client], _T]) -> _T:
        if self._closed:
            raise unavailable("the client is closed")
        loop = asyncio.get_running_loop()
        async with self._slots:

            def run() -> _T:
                c = self._client()
                try:
                    result = call(c)
                except DaemonUnavailable:
                    c.close()
                    raise
                except BaseException:
                    self._idle.append(c)
                    raise
                self._idle.append(c)
                return result

            return await loop.run_in_executor(None, run)

    async def select(
        self,
        model: str,
        *,
        tokens: Optional[Sequence[int]] = None,
        hashes: Union[Sequence[int], BlockHashes, None] = None,
        prompt_tokens: Optional[int] = None,
        tenant: Optional[str] = None,
        tags: Optional[Sequence[str]] = None,
        headers: Optional[Mapping[str, str]] = None,
        session: Optional[str] = None,
        role: str = "aggregated",
        priority: int = 0,
        dry_run: bool = False,
        explain: bool = False,
        text: Optional[str] = None,
        trigger: str = "user",
        parent_session: Optional[str] = None,
        final_turn: bool = False,
        target: Optional[Tuple[int, int]] = None,
        tolerations: Optional[Sequence[str]] = None,
    ) -> Selection:
        """Client.select, as a coroutine."""
        return await self._call(
            lambda c: c.select(
                model,
                tokens=tokens,
                hashes=hashes,
                prompt_tokens=prompt_tokens,
                tenant=tenant,
                tags=tags,
                headers=headers,
                session=session,
                role=role,
                priority=priority,
                dry_run=dry_run,
                explain=explain,
                text=text,
                trigger=trigger,
                parent_session=parent_session,
                final_turn=final_turn,
                target=target,
                tolerations=tolerations,
            )
        )

    async def prefill_done(self, request_id: int) -> None:
        await self._call(lambda c: c.prefill_done(request_id))

    async def finish(self, request_id: int) -> None:
        await self._call(lambda c: c.finish(request_id))

    async def abort(self, request_id: int) -> None:
        await self._call(lambda c: c.abort(request_id))

    async def workers(self) -> List[Dict[str, Any]]:
        return await self._call(lambda c: c.workers())

    async def stats(self) -> Dict[str, Any]:
        return await self._call(lambda c: c.stats())

    async def close(self) -> None:
        self._closed = True
        while self._idle:
            self._idle.pop().close()
