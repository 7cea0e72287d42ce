"""Type stubs of the kvedge package (see __init__.py)."""

import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

from ._kvedge import (
    BadRequest as BadRequest,
    BlockHashes as BlockHashes,
    DaemonUnavailable as DaemonUnavailable,
    KvedgeError as KvedgeError,
    NoWorker as NoWorker,
    Publisher as Publisher,
    Refused as Refused,
    Rejected as Rejected,
    Selection as Selection,
    TooManyRequests as TooManyRequests,
    UnknownRequest as UnknownRequest,
    block_hashes as block_hashes,
    hash_blocks as hash_blocks,
)

DEFAULT_RUNTIME_DIR: str

class Client:
    def __init__(self, runtime_dir: Union[str, "os.PathLike[str]"] = ..., timeout: Optional[float] = 10.0) -> None: ...
    def __enter__(self) -> "Client": ...
    def __exit__(self, *exc: object) -> None: ...
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
    ) -> Selection: ...
    def prefill_done(self, request_id: int) -> None: ...
    def finish(self, request_id: int) -> None: ...
    def attach_rings(self) -> bool: ...
    @property
    def rings_attached(self) -> bool: ...
    def workers(self) -> List[Dict[str, Any]]: ...
    def stats(self) -> Dict[str, Any]: ...
    def close(self) -> None: ...

class AsyncClient:
    def __init__(
        self,
        runtime_dir: Union[str, "os.PathLike[str]"] = ...,
        timeout: Optional[float] = 10.0,
        connections: int = 8,
        rings: bool = False,
    ) -> None: ...
    async def __aenter__(self) -> "AsyncClient": ...
    async def __aexit__(self, *exc: object) -> None: ...
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
    ) -> Selection: ...
    async def prefill_done(self, request_id: int) -> None: ...
    async def finish(self, request_id: int) -> None: ...
    async def workers(self) -> List[Dict[str, Any]]: ...
    async def stats(self) -> Dict[str, Any]: ...
    async def close(self) -> None: ...
