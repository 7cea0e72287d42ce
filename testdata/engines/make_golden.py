"""Writes the golden KV-event payloads the bridge's tests decode.

Each file is one ZeroMQ payload, encoded by msgspec exactly as the engines
encode theirs: the structures below follow the field order and options of
vLLM's `vllm/distributed/kv_events.py` (older releases: events as positional
arrays; newer: events as maps tagged by "type") and SGLang's
`sglang/srt/disaggregation/kv_events.py` (the batch's third field is the
attention-DP rank). Run with `python3 make_golden.py` in this directory;
the output is deterministic.
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional, Union

import msgspec

# --- vLLM, positional events (array_like), as released before mid-2026 ---


class ArrayBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(ArrayEvent):
    block_hashes: list[Union[int, bytes]]
    parent_block_hash: Union[int, bytes, None]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str] = None
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None


class BlockRemoved(ArrayEvent):
    block_hashes: list[Union[int, bytes]]
    medium: Optional[str]
    group_idx: Optional[int] = None


class AllBlocksCleared(ArrayEvent):
    pass


# A newer engine's event with fields this decoder has never heard of.
class FutureStored(ArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Any]]
    group_idx: Optional[int]
    kv_cache_spec_kind: Optional[str]
    kv_cache_spec_sliding_window: Optional[int]
    some_future_field: list[int]
    another: dict[str, int]


# --- vLLM, events as maps (the layout after mid-2026) ---


class MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class MapBlockStored(MapEvent, tag="BlockStored"):
    block_hashes: list[Union[int, bytes]]
    parent_block_hash: Union[int, bytes, None] = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: Optional[int] = None
    medium: Optional[str] = None
    lora_name: Optional[str] = None
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    brand_new_field: Optional[dict[str, Any]] = None


# The map layout's events as vLLM 0.32 declares them: the fields without a
# default are written even when None (omit_defaults drops defaults only).
class MapBlockStoredV032(MapEvent, tag="BlockStored"):
    block_hashes: list[Union[int, bytes]]
    parent_block_hash: Union[int, bytes, None]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]
    lora_name: Optional[str]
    extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
    group_idx: Optional[int] = None
    kv_cache_spec_kind: Optional[str] = None
    kv_cache_spec_sliding_window: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None
    session_id: Optional[str] = None


class MapBlockRemovedV032(MapEvent, tag="BlockRemoved"):
    block_hashes: list[Union[int, bytes]]
    medium: Optional[str]
    group_idx: Optional[int] = None
    locality: Optional[str] = None
    ownership: Optional[str] = None


class MapBlockRemoved(MapEvent, tag="BlockRemoved"):
    block_hashes: list[Union[int, bytes]]
    medium: Optional[str] = None
    group_idx: Optional[int] = None


class MapAllBlocksCleared(MapEvent, tag="AllBlocksCleared"):
    pass


# --- SGLang: the batch names its third field attn_dp_rank ---


class SglBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    attn_dp_rank: Optional[int] = None


class SglStored(ArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None


class SglRemoved(ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str] = None


# --- SGLang, events as maps (releases from late 2026): a salt by name, the
# host tier as CPU_PINNED, a shared pool as EXTERNAL ---


class SglMapStored(MapEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str] = None
    cache_salt: Optional[str] = None
    session_id: Optional[str] = None
    lora_name: Optional[str] = None


class SglMapRemoved(MapEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Optional[str] = None


def digest(n: int) -> bytes:
    """A 32-byte hash whose last 8 bytes are `n` (as vLLM's sha256 hashes are
    read: their low 64 bits)."""
    return hashlib.sha256(str(n).encode()).digest()[:24] + n.to_bytes(8, "big")


TS = 1767225600.25
BIG = 2**64 - 5  # above 2^63: msgpack uint64
TOKENS = list(range(100, 132))  # two blocks of 16

enc = msgspec.msgpack.Encoder()
files = {
    # Array layout, integer hashes: stored two blocks, removed one, cleared.
    "vllm_array_int.msgpack": ArrayBatch(
        TS,
        [
            BlockStored([BIG, 7], None, TOKENS, 16, None, "GPU"),
            BlockStored([9], 7, list(range(132, 148)), 16, None, "CPU"),
            BlockRemoved([7], "GPU"),
            AllBlocksCleared(),
        ],
        0,
    ),
    # Map layout, 32-byte digests, an unknown field, no rank.
    "vllm_map_bytes.msgpack": ArrayBatch(
        TS,
        [
            MapBlockStored([digest(BIG), digest(7)], None, TOKENS, 16, medium="GPU",
                           brand_new_field={"x": [1, 2, 3]}),
            MapBlockRemoved([digest(7)], "GPU"),
            MapAllBlocksCleared(),
        ],
    ),
    # Map layout as vLLM 0.32 writes it, integer hashes: stored two blocks,
    # a child on the host, removed one, cleared (what kvedge's mock engine
    # writes, byte for byte).
    "vllm_map_int.msgpack": ArrayBatch(
        TS,
        [
            MapBlockStoredV032([BIG, 7], None, TOKENS, 16, None, "GPU", None),
            MapBlockStoredV032([9], 7, list(range(132, 148)), 16, None, "CPU", None),
            MapBlockRemovedV032([7], "GPU"),
            MapAllBlocksCleared(),
        ],
        0,
    ),
    # LoRA by name and a cache salt on the first block (map layout), then a
    # child on disk storage.
    "vllm_lora_salt.msgpack": ArrayBatch(
        TS,
        [
            MapBlockStored([11, 12], None, TOKENS, 16, medium="GPU", lora_name="adapter-a",
                           extra_keys=[("adapter-a", "tenant-salt"), ("adapter-a",)]),
            MapBlockStored([13], 12, list(range(132, 148)), 16, medium="STORAGE",
                           lora_name="adapter-a", extra_keys=[("adapter-a",)]),
        ],
        1,
    ),
    # Positional events with trailing fields a future release might add, a
    # multimodal block, another KV cache group, and an unknown event type.
    "vllm_future.msgpack": ArrayBatch(
        TS,
        [
            FutureStored([21, 22], None, TOKENS, 16, None, "GPU", None, None, 0, "full", None,
                         [1, 2], {"k": 1}),
            BlockStored([31], None, list(range(16)), 16, None, "GPU", None,
                        [("mm-hash-0", 0)]),
            BlockStored([41], None, list(range(16)), 16, None, "GPU", group_idx=1),
            msgspec.Raw(enc.encode(["BlockMovedToMars", 1, 2])),
        ],
        0,
    ),
    # SGLang: attn_dp_rank, no medium.
    "sglang.msgpack": SglBatch(
        TS,
        [SglStored([BIG, 7], None, TOKENS, 16, None), SglRemoved([BIG])],
        3,
    ),
    # SGLang, map layout: a salted request's two blocks, its next block
    # (the salt named again, as SGLang does on every event of the request)
    # offloaded to host memory, a block in a pool shared by all engines,
    # and an eviction from the host tier.
    "sglang_map.msgpack": SglBatch(
        TS,
        [
            SglMapStored([-5, 7], None, TOKENS, 16, None, "GPU", cache_salt="tenant-salt",
                         session_id="s-1"),
            SglMapStored([8], 7, list(range(132, 148)), 16, None, "CPU_PINNED",
                         cache_salt="tenant-salt"),
            SglMapStored([9], None, list(range(16)), 16, None, "EXTERNAL"),
            SglMapRemoved([8], "CPU_PINNED"),
        ],
        0,
    ),
}

for name, batch in files.items():
    with open(name, "wb") as f:
        f.write(enc.encode(batch))
    print(name)
