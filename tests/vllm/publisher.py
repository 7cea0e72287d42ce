"""vLLM's own KV-event publisher (`vllm.distributed.kv_events`), driven
without a GPU: the code a vLLM engine runs to publish, with its replay
socket, fed from stdin.

Usage: python publisher.py --events tcp://*:PORT --replay tcp://*:PORT
       [--block-size 16] [--topic kv-events]
Each stdin line is a JSON list of token ids: their full blocks are published
as one BlockStored batch, chained and hashed as vLLM hashes them (sha256
digests of the parent and the block's tokens). "published N" is printed
once the batch is handed to the publisher's thread. The line "restart"
shuts the publisher down and starts a new one on the same sockets, as an
engine restarted within milliseconds would (sequence numbers from 0, an
empty replay buffer); "restarted" is printed. EOF shuts it down.
"""

import argparse
import hashlib
import json
import sys
import time

from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--events", required=True)
    p.add_argument("--replay", required=True)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--topic", default="kv-events")
    a = p.parse_args()

    def start() -> ZmqEventPublisher:
        return ZmqEventPublisher(
            data_parallel_rank=0, endpoint=a.events, replay_endpoint=a.replay, topic=a.topic
        )

    pub = start()
    print("ready", flush=True)
    n = 0
    for line in sys.stdin:
        if line.strip() == "restart":
            pub.shutdown()
            pub = start()
            print("restarted", flush=True)
            continue
        tokens = json.loads(line)
        bs = a.block_size
        blocks = [tokens[i : i + bs] for i in range(0, len(tokens) - bs + 1, bs)]
        hashes, parent = [], None
        for b in blocks:
            h = hashlib.sha256(repr((parent, tuple(b))).encode()).digest()
            hashes.append(h)
            parent = h
        event = BlockStored(
            block_hashes=hashes,
            parent_block_hash=None,
            token_ids=[t for b in blocks for t in b],
            block_size=bs,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )
        pub.publish(KVEventBatch(ts=time.time(), events=[event]))
        n += 1
        print(f"published {n}", flush=True)
    pub.shutdown()


if __name__ == "__main__":
    main()
