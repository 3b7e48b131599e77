"""A KV event publisher as vLLM writes one (pyzmq, and msgspec structs that mirror vLLM's `kv_events.py`:
positional arrays, tagged events), to check the gateway's subscriber against an independent implementation.

Usage: python3 kv_publisher.py [--connect ENDPOINT]. It binds a PUB and a ROUTER (replay) socket on free loopback
ports (with `--connect`, the PUB connects to ENDPOINT instead, where the subscriber binds, as vLLM's does for an
endpoint without `*`) and prints `pub ENDPOINT replay ENDPOINT`, then obeys one command per line on standard input:

- `script`: publishes batches 0 to 5 (see below), skipping batch 3 on the live socket (a gap the replay fills);
- `restart`: closes both sockets, binds the same ports again and publishes batches 0 and 1 of a new life (a
  restarted engine), 1.5 s apart;
- `garbage`: publishes a truncated batch, a batch with an unknown event type, then BlockStored G[0:16];
- `stop`: closes both sockets (the engine is gone);
- `start`: opens them again as before (a restarted engine) and publishes nothing;
- `quit`.

After each command it prints `done`. The batches (block size 4; token ids given by `tokens(seed, n)`):
0. BlockStored A[0:32], integer hashes, no parent
1. BlockStored A[32:64], parent: A's last block
2. BlockStored B[0:48], bytes hashes, no parent
3. BlockStored C[0:32] (replayed only)
4. BlockRemoved B's last four blocks
5. BlockStored D[0:32] with a parent nobody announced (an orphan)
After a restart: 0. BlockStored E[0:16]; 1. BlockStored F[0:16].
"""
import sys
import time
from typing import Optional, Union

import msgspec
import zmq

ExternalBlockHash = Union[bytes, int]


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class of the cache events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: Optional[ExternalBlockHash]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


BLOCK = 4
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def tokens(seed, n):
    return [(seed * 7919 + i * 31) % 150000 for i in range(n)]


def stored(hashes, parent, ids):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=ids, block_size=BLOCK, lora_id=None, medium="GPU")


def script():
    a, b, c, d = tokens(1, 64), tokens(2, 48), tokens(3, 32), tokens(4, 32)
    a_hashes = list(range(100, 116))
    b_hashes = [f"b{i}".encode() for i in range(12)]
    return [
        [stored(a_hashes[:8], None, a[:32])],
        [stored(a_hashes[8:], a_hashes[7], a[32:])],
        [stored(b_hashes, None, b)],
        [stored(list(range(300, 308)), None, c)],
        [BlockRemoved(block_hashes=b_hashes[8:], medium="GPU")],
        [stored(list(range(400, 408)), 999_999, d)],
    ]


class Publisher:
    def __init__(self, ctx, pub_port=0, replay_port=0, connect=None):
        # XPUB: a PUB (the same wire protocol to subscribers) that also tells when a subscriber arrives, so the
        # script's live batches are not published before anyone listens.
        self.pub = ctx.socket(zmq.XPUB)
        self.replay = ctx.socket(zmq.ROUTER)
        for s in (self.pub, self.replay):
            s.setsockopt(zmq.LINGER, 0)
        # The replay socket first: a subscriber that sees the publisher asks it for a replay at once, and a replay
        # refused because its socket was not bound yet left a restart unnoticed (an engine binds both at start).
        self.replay_port = self.bind(self.replay, replay_port)
        if connect:
            self.pub.connect(connect)
            self.pub_port = int(connect.rsplit(":", 1)[1])
        else:
            self.pub_port = self.bind(self.pub, pub_port)
        self.buffer = []
        self.seq = 0

    @staticmethod
    def bind(socket, port):
        if port:
            socket.bind(f"tcp://127.0.0.1:{port}")
            return port
        return socket.bind_to_random_port("tcp://127.0.0.1")

    def wait_for_subscriber(self, timeout=10.0):
        if self.pub.poll(int(timeout * 1000)):
            self.pub.recv()

    def publish(self, events, live=True, payload=None):
        if payload is None:
            payload = msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0))
        seq = self.seq.to_bytes(8, "big")
        self.buffer.append((seq, payload))
        if live:
            self.pub.send_multipart((b"", seq, payload))
        self.seq += 1

    def serve_replays(self):
        while not self.replay.closed and self.replay.poll(0):
            client, _, start = self.replay.recv_multipart()
            start = int.from_bytes(start, "big")
            for seq, payload in self.buffer:
                if int.from_bytes(seq, "big") >= start:
                    self.replay.send_multipart((client, b"", seq, payload))
            self.replay.send_multipart((client, b"", END_SEQ, b""))

    def close(self):
        self.pub.close(0)
        self.replay.close(0)


def main():
    connect = sys.argv[2] if sys.argv[1:2] == ["--connect"] else None
    ctx = zmq.Context()
    publisher = Publisher(ctx, connect=connect)
    print(f"pub tcp://127.0.0.1:{publisher.pub_port} replay tcp://127.0.0.1:{publisher.replay_port}", flush=True)
    poller = zmq.Poller()
    poller.register(publisher.replay, zmq.POLLIN)
    while True:
        # Answer replays while waiting for the next command.
        line = None
        while line is None:
            publisher.serve_replays()
            ready, _, _ = select([sys.stdin], 0.02)
            if ready:
                line = sys.stdin.readline().strip()
        if line == "script":
            publisher.wait_for_subscriber()
            for i, events in enumerate(script()):
                publisher.publish(events, live=i != 3)
                time.sleep(0.05)
        elif line == "restart":
            ports = publisher.pub_port, publisher.replay_port
            publisher.close()
            time.sleep(0.2)
            publisher = Publisher(ctx, *ports, connect)
            time.sleep(0.5)
            publisher.publish([stored(list(range(500, 504)), None, tokens(5, 16))])
            # A subscriber still reconnecting misses batch 0 live; batch 1 tells it of the restart, and the
            # replay gives it batch 0.
            deadline = time.time() + 1.5
            while time.time() < deadline:
                publisher.serve_replays()
                time.sleep(0.02)
            publisher.publish([stored(list(range(600, 604)), None, tokens(6, 16))])
        elif line == "garbage":
            good = msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=[stored([1], None, tokens(8, 4))]))
            publisher.publish(None, payload=good[: len(good) // 2])
            time.sleep(0.05)
            publisher.publish(None, payload=msgspec.msgpack.encode([time.time(), [["BlockMoved", [1]]], 0]))
            time.sleep(0.05)
            publisher.publish([stored(list(range(700, 704)), None, tokens(7, 16))])
        elif line == "stop":
            publisher.close()
        elif line == "start":
            publisher = Publisher(ctx, publisher.pub_port, publisher.replay_port, connect)
        elif line in ("quit", ""):
            publisher.close()
            return
        print("done", flush=True)


def select(streams, timeout):
    import select as _select

    return _select.select(streams, [], [], timeout)


if __name__ == "__main__":
    main()
