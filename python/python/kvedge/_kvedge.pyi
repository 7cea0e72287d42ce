"""Type stubs of the native module ``kvedge._kvedge``; ``stubtest`` checks
them against the built module."""

from os import PathLike
from typing import Any, Dict, Optional, Sequence, Tuple, Union, final

from typing_extensions import Self

__all__ = [
    "BlockHashes",
    "NativeClient",
    "Publisher",
    "Selection",
    "block_hashes",
    "hash_blocks",
    "status_code",
]

@final
class Selection:
    worker_id: Optional[int]
    dp_rank: Optional[int]
    endpoint: str
    provider: Optional[str]
    device_blocks: int
    host_blocks: int
    disk_blocks: int
    cost: Optional[float]
    policy: Optional[str]
    rule: Optional[str]
    request_id: int
    explain: Optional[dict[str, Any]]
    @property
    def overlap_blocks(self) -> Tuple[int, int, int]: ...
    def __new__(
        cls,
        *,
        worker_id: Optional[int],
        dp_rank: Optional[int],
        endpoint: str,
        provider: Optional[str] = None,
        device_blocks: int = 0,
        host_blocks: int = 0,
        disk_blocks: int = 0,
        cost: Optional[float] = None,
        policy: Optional[str] = None,
        rule: Optional[str] = None,
        request_id: int = 0,
        explain: Optional[dict[str, Any]] = None,
    ) -> Self: ...

@final
class BlockHashes:
    """A prompt's block hashes held natively (read by select without conversion)."""
    def __new__(cls, hashes: Sequence[int]) -> Self: ...
    def __len__(self) -> int: ...
    def __getitem__(self, index: int, /) -> int: ...
    def to_list(self) -> list[int]: ...

@final
class NativeClient:
    def __new__(cls, query_socket: Union[str, PathLike[str]], timeout: Optional[float] = 10.0) -> Self: ...
    def select(
        self,
        model: str,
        *,
        tokens: Optional[Sequence[int]] = None,
        hashes: Union[Sequence[int], BlockHashes, None] = None,
        prompt_tokens: Optional[int] = None,
        tenant: Optional[str] = None,
        tags: Optional[Sequence[str]] = None,
        headers: Optional[Sequence[Tuple[str, str]]] = None,
        session: Optional[str] = None,
        role: str = "aggregated",
        priority: int = 0,
        dry_run: bool = False,
        trigger: str = "user",
        parent_session: Optional[str] = None,
        final_turn: bool = False,
        target: Optional[Tuple[int, int]] = None,
        tolerations: Optional[Sequence[str]] = None,
    ) -> Selection: ...
    def prefill_done(self, request_id: int) -> None: ...
    def finish(self, request_id: int) -> None: ...
    def abort(self, request_id: int) -> None: ...
    def attach_rings(self) -> bool: ...
    @property
    def rings_attached(self) -> bool: ...
    def close(self) -> None: ...

@final
class Publisher:
    def __new__(
        cls,
        control_socket: Union[str, PathLike[str]],
        worker_id: int,
        model: str,
        *,
        dp_rank: int = 0,
        role: str = "aggregated",
        block_size: int = 16,
        kv_blocks: Tuple[int, int, int] = (0, 0, 0),
        endpoint: str = "",
        timeout: float = 5.0,
        labels: Optional[Dict[str, str]] = None,
        taints: Optional[Sequence[str]] = None,
    ) -> Self: ...
    def stored(
        self,
        *,
        hashes: Optional[Sequence[int]] = None,
        tokens: Optional[Sequence[int]] = None,
        tier: str = "device",
        parent: Optional[int] = None,
        lora: Optional[str] = None,
        namespace: Optional[str] = None,
    ) -> bool: ...
    def removed(self, hashes: Sequence[int], *, tier: str = "device") -> bool: ...
    def cleared(self, tier: Optional[str] = None) -> bool: ...
    def load(
        self,
        *,
        active_requests: int = 0,
        waiting_requests: int = 0,
        active_prefill_tokens: int = 0,
        active_decode_blocks: int = 0,
        kv_used_blocks: int = 0,
        kv_total_blocks: int = 0,
        timestamp_ns: int = 0,
    ) -> bool: ...
    def heartbeat(self, timestamp_ns: int = 0) -> bool: ...
    def poll(self) -> Optional[int]: ...
    def begin_snapshot(self, snapshot_id: int) -> bool: ...
    def end_snapshot(self) -> bool: ...
    def tick(self) -> Optional[Tuple[str, Optional[int]]]: ...
    @property
    def registered(self) -> bool: ...
    @property
    def dropped(self) -> int: ...

def hash_blocks(
    tokens: Sequence[int], block_size: int, lora: Optional[str] = None, namespace: Optional[str] = None
) -> list[int]: ...

def block_hashes(
    tokens: Sequence[int], block_size: int, lora: Optional[str] = None, namespace: Optional[str] = None
) -> BlockHashes: ...

def status_code(name: str) -> Optional[int]: ...
