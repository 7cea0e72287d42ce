"""An engine's own KV-event publisher, driven without a GPU: vLLM's
`vllm.distributed.kv_events` or SGLang's `sglang.srt.disaggregation.kv_events`,
the code each engine runs to publish (with its replay socket), fed from stdin.

Usage: python publisher.py --engine vllm|sglang --events tcp://*:PORT
       --replay tcp://*:PORT [--block-size 16] [--topic kv-events]

Each stdin line is a JSON list of token ids, or an object
{"tokens": [...], "medium": "CPU_PINNED", "cache_salt": "s", "parent": [...]}
(`parent`: the tokens of the chain before these, already published; the
medium defaults to GPU): the
tokens' full blocks are published as one BlockStored batch, hashed and
chained as the engine does (vLLM: sha256 digests; SGLang: signed 64-bit
integers). {"remove": [...], "medium": ..., "parent": [...]} publishes a BlockRemoved of those
tokens' blocks. "published N" is printed once the batch is handed to the
publisher's thread. The line "restart" shuts the publisher down and starts
a new one on the same sockets, as an engine restarted within milliseconds
would (sequence numbers from 0, an empty replay buffer); "restarted" is
printed. EOF shuts it down.
"""

import argparse
import hashlib
import json
import sys
import time

import zmq


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--engine", choices=["vllm", "sglang"], default="vllm")
    p.add_argument("--events", required=True)
    p.add_argument("--replay", required=True)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--topic", default="kv-events")
    a = p.parse_args()
    bs = a.block_size

    # The two engines' modules differ in the rank's name, the hashes'
    # type and where a salt goes.
    if a.engine == "vllm":
        from vllm.distributed.kv_events import (
            BlockRemoved,
            BlockStored,
            KVEventBatch,
            ZmqEventPublisher,
        )

        rank = {"data_parallel_rank": 0}

        def digest(parent, block, salt):
            return hashlib.sha256(repr((parent, tuple(block), salt)).encode()).digest()

        def salted(n, parent, salt):
            # Among the first block's extra keys.
            first = salt is not None and parent is None
            return {"lora_name": None, "extra_keys": [(salt,)] + [None] * (n - 1) if first else None}

    else:
        from sglang.srt.disaggregation.kv_events import (
            BlockRemoved,
            BlockStored,
            KVEventBatch,
            ZmqEventPublisher,
        )

        rank = {"attn_dp_rank": 0}

        def digest(parent, block, salt):
            d = hashlib.sha256(repr((parent, tuple(block), salt)).encode()).digest()
            return int.from_bytes(d[:8], "big", signed=True)

        def salted(n, parent, salt):
            # Named on every event of a salted request.
            return {"cache_salt": salt}

    def start():
        return ZmqEventPublisher(
            **rank, endpoint=a.events, replay_endpoint=a.replay, topic=a.topic
        )

    def stored(hashes, parent, tokens, medium, salt):
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=bs,
            lora_id=None,
            medium=medium,
            **salted(len(hashes), parent, salt),
        )

    def chain(tokens, salt, parent=None):
        blocks = [tokens[i : i + bs] for i in range(0, len(tokens) - bs + 1, bs)]
        hashes = []
        for b in blocks:
            parent = digest(parent, b, salt)
            hashes.append(parent)
        return hashes, [t for b in blocks for t in b]

    pub = start()
    print("ready", flush=True)
    n = 0
    for line in sys.stdin:
        if line.strip() == "restart":
            pub.shutdown()
            # The closed sockets' ports are released by ZeroMQ's I/O thread
            # a moment later.
            for attempt in range(100):
                try:
                    pub = start()
                    break
                except zmq.ZMQError:
                    if attempt == 99:
                        raise
                    time.sleep(0.01)
            print("restarted", flush=True)
            continue
        msg = json.loads(line)
        if isinstance(msg, list):
            msg = {"tokens": msg}
        medium = msg.get("medium", "GPU")
        salt = msg.get("cache_salt")
        parent_hashes, _ = chain(msg.get("parent", []), salt)
        parent = parent_hashes[-1] if parent_hashes else None
        if "remove" in msg:
            hashes, _ = chain(msg["remove"], salt, parent)
            event = BlockRemoved(block_hashes=hashes, medium=medium)
        else:
            hashes, tokens = chain(msg["tokens"], salt, parent)
            event = stored(hashes, parent, tokens, medium, salt)
        pub.publish(KVEventBatch(ts=time.time(), events=[event]))
        n += 1
        print(f"published {n}", flush=True)
    pub.shutdown()


if __name__ == "__main__":
    main()
