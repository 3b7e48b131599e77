"""The `dprouter` package's Router, from Python: the API, token id inputs, errors, and parity with the core.

Run by `tests/python_package.rs` (with the wheel built from this clone on PYTHONPATH):
`python -m unittest discover -s crates/python/tests`.
"""

import array
import json
import socket
import struct
import sys
import threading
import time
import unittest
from importlib.util import find_spec
from pathlib import Path

import dprouter
from dprouter import _dprouter

TESTDATA = Path(__file__).resolve().parents[2] / "core" / "testdata"

try:
    import numpy
except ImportError:  # the tests run with vLLM's Python, which has numpy; plain Pythons skip these
    numpy = None


def run(seed, length):
    """A run of token ids, as the core's scripted test computes it."""
    return [(seed * 7919 + i * 2654435761) % 151936 for i in range(length)]


def prompt(runs):
    return [t for seed, length in runs for t in run(seed, length)]


class RouterApi(unittest.TestCase):
    def test_a_router_is_built_from_a_policy_spec(self):
        router = dprouter.Router("cache_aware:prefill_tokens_per_s=12000", 8)
        self.assertEqual((router.policy, router.num_ranks, router.tickets), ("cache_aware", 8, 0))
        self.assertEqual(repr(router), "Router(policy='cache_aware', num_ranks=8)")

    def test_bad_specs_and_ranks_are_value_errors_with_the_cores_messages(self):
        with self.assertRaises(dprouter.PolicyError) as e:
            dprouter.Router("cache_aware:block_tokens=0", 4)
        self.assertIn("block_tokens", str(e.exception))
        self.assertIsInstance(e.exception, ValueError)
        with self.assertRaises(dprouter.PolicyError):
            dprouter.Router("nope", 4)
        with self.assertRaises(dprouter.RankError):
            dprouter.Router("round_robin", 0)
        with self.assertRaises(dprouter.DprouterError):
            dprouter.Router("round_robin", 2, ticket_ttl_s=float("nan"))
        router = dprouter.Router("round_robin", 4)
        with self.assertRaises(dprouter.RankError) as e:
            router.pick([1], routed_rank=4)
        self.assertEqual(str(e.exception), "DP rank 4 is out of range: there are 4 ranks (0..4)")
        router.set_active(1, False)
        with self.assertRaises(dprouter.RankError) as e:
            router.pick([1], routed_rank=1)
        self.assertEqual(str(e.exception), "DP rank 1 is not active (the endpoint is down)")
        with self.assertRaises(dprouter.RankError):
            router.pick([1], eligible=[])
        with self.assertRaises(dprouter.RankError):
            router.report_load(7, running=1)
        with self.assertRaises(dprouter.RankError):
            router.is_active(-1)
        with self.assertRaises(dprouter.DprouterError):
            dprouter.Router("follow_bootstrap_room", 2).pick([1])
        with self.assertRaises(TypeError):
            router.pick([1], unknown=1)

    def test_token_ids_are_checked(self):
        router = dprouter.Router("prefix_match", 4)
        for bad in ([-1], [2**32], ["a"], [1.5], "text", 5):
            with self.assertRaises(dprouter.DprouterError, msg=repr(bad)):
                router.pick(bad)
        # A buffer's ids are checked too, the first one out of range named; the router is unchanged after.
        for bad, named in (
            (array.array("q", [7, 2**32, -1]), 2**32),
            (array.array("q", [1] * 1000 + [-3]), -3),
            (array.array("i", [5, -1]), -1),
        ):
            with self.assertRaisesRegex(dprouter.DprouterError, f"token id {named} is not in", msg=repr(bad)):
                router.pick(bad)
        self.assertEqual(router.pick(array.array("q", [2**32 - 1])).rank, router.pick([2**32 - 1]).rank)

    def test_token_ids_come_as_lists_or_integer_buffers(self):
        ids = run(3, 5000)
        expected = dprouter.prefix_match_rank(ids, 64)
        inputs = [ids, tuple(ids), array.array("q", ids), array.array("i", ids), array.array("I", ids)]
        if numpy is not None:
            inputs += [
                numpy.array(ids, dtype=numpy.int64),
                numpy.array(ids, dtype=numpy.int32),
                numpy.repeat(numpy.array(ids, dtype=numpy.int64), 2)[::2],  # strided: read through the buffer protocol
            ]
        for given in inputs:
            self.assertEqual(dprouter.prefix_match_rank(given, 64), expected, type(given))
            router = dprouter.Router("prefix_match", 64)
            self.assertEqual(router.pick(given).rank, expected, type(given))

    def test_lists_read_in_place_give_the_ids_the_api_gives(self):
        # CPython 3.11 to 3.14 have the layouts the in-place reader was checked against at import.
        if sys.implementation.name == "cpython" and (3, 11) <= sys.version_info[:2] <= (3, 14):
            self.assertTrue(_dprouter._lists_read_in_place)

        class Int(int):
            pass

        class List(list):
            pass

        base = run(7, 100)  # short prompts: prefix_match hashes them whole
        edges = [0, 1, 255, 256, 257, 65535, 151935, 2**29, 2**30 - 1]  # one 30-bit digit: read in place
        declined = [2**30, 2**31, 2**32 - 1, True, Int(5)]  # the API reads these: more digits, a bool, a subclass
        if numpy is not None:
            declined.append(numpy.int64(42))
        cases = [base + edges, edges + base, [int(str(v)) for v in base]]
        cases += [base[:50] + [d] + base[50:] for d in declined]
        cases += [List(base + edges), [], [0], [2**30 - 1]]
        for ids in cases:
            expected = dprouter.prefix_match_rank(array.array("I", ids), 4096)
            self.assertEqual(dprouter.prefix_match_rank(ids, 4096), expected, repr(ids[:3]))
            router = dprouter.Router("prefix_match", 4096)
            self.assertEqual(router.pick(ids).rank, expected)

    def test_feedback_releases_the_load(self):
        router = dprouter.Router("total_requests", 2)
        first = router.pick([1, 2, 3], request_id="a")
        self.assertEqual(router.in_flight()[first.rank], 1)
        self.assertTrue(router.first_token("a", prompt_tokens=3, cached_tokens=0))
        self.assertTrue(router.finish("a"))
        self.assertFalse(router.finish("a"))
        self.assertEqual(router.in_flight(), [0, 0])
        router.pick([1], request_id="b")
        self.assertTrue(router.abort("b"))
        self.assertFalse(router.first_token("zzz"))
        self.assertEqual(router.tickets, 0)

    def test_tickets_are_bounded(self):
        router = dprouter.Router("total_requests", 2, max_tickets=10, ticket_ttl_s=1.0)
        for i in range(50):
            router.pick([1], request_id=f"r{i}", now_us=0)
        self.assertEqual(router.tickets, 10)
        router.pick([1], request_id="late", now_us=5_000_000)
        self.assertEqual((router.tickets, sum(router.in_flight())), (1, 1))

    def test_same_prefix_requests_gather_and_best_rank_records_nothing(self):
        system = run(1, 4096)
        for policy in ("prefix_match", "prefix_affinity", "cache_aware"):
            router = dprouter.Router(policy, 8)
            ranks = {router.pick(system + run(100 + i, 50)).rank for i in range(8)}
            self.assertEqual(len(ranks), 1, policy)
        router = dprouter.Router("cache_aware", 8)
        cold = router.best_rank(system)
        self.assertEqual(cold.branch, "cold")
        self.assertEqual(router.best_rank(system), cold)
        picked = router.pick(system, request_id="a")
        router.finish("a")
        hit = router.best_rank(system + [7])
        self.assertEqual((hit.rank, hit.branch), (picked.rank, "hit"))
        self.assertGreaterEqual(hit.predicted_cached_tokens, 4000)

    def test_cache_namespaces_do_not_share_a_prefix(self):
        router = dprouter.Router("cache_aware", 8)
        system = run(1, 2000)
        router.pick(system, request_id="a", cache_namespace="salt-a")
        router.finish("a")
        self.assertEqual(router.best_rank(system, cache_namespace="salt-a").branch, "hit")
        self.assertEqual(router.best_rank(system, cache_namespace="salt-b").branch, "cold")
        self.assertEqual(router.best_rank(system).branch, "cold")

    def test_kv_events_from_a_rank(self):
        router = dprouter.Router("cache_aware:block_tokens=16", 2)
        self.assertEqual(router.apply_kv_events(1, 0, b"\xc1"), "undecodable")
        with self.assertRaises(dprouter.RankError):
            router.apply_kv_events(2, 0, b"")

    def test_calls_from_several_threads(self):
        router = dprouter.Router("cache_aware", 4)
        errors = []

        def work(t):
            try:
                for i in range(200):
                    router.pick(run(t, 300), request_id=f"{t}-{i}")
                    router.finish(f"{t}-{i}", prompt_tokens=300, cached_tokens=256)
            except Exception as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual((errors, router.tickets, sum(router.in_flight())), ([], 0, 0))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stored_batch(ts, first_hash, tokens, block=16):
    """A KV event batch storing `tokens` in blocks of `block` (vLLM's positional encoding), as msgpack."""
    import msgspec

    hashes = list(range(first_hash, first_hash + len(tokens) // block))
    return msgspec.msgpack.encode([ts, [["BlockStored", hashes, None, tokens, block, None]]])


def wait_for(condition, what, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@unittest.skipIf(find_spec("zmq") is None or find_spec("msgspec") is None, "needs pyzmq and msgspec (vLLM's Python)")
class KvEventFeeds(unittest.TestCase):
    """`Router.follow_kv_events` against pyzmq publishers (libzmq), in both socket shapes, and a hostile peer."""

    def check_precise(self, bind_router):
        import zmq

        port = free_port()
        router = dprouter.Router("cache_aware:block_tokens=16", 2)
        context = zmq.Context()
        pub = context.socket(zmq.PUB)
        try:
            if bind_router:
                router.follow_kv_events(1, f"tcp://127.0.0.1:{port}", bind=True, topic="kv")
                pub.connect(f"tcp://127.0.0.1:{port}")
            else:
                pub.bind(f"tcp://127.0.0.1:{port}")
                router.follow_kv_events(1, f"tcp://127.0.0.1:{port}", topic="kv")
            tokens = run(9, 64)
            seq = 0

            def delivered():
                nonlocal seq
                # A subscription takes a moment to reach the publisher: send until a batch is applied.
                pub.send_multipart([b"kv", seq.to_bytes(8, "big"), stored_batch(1.0 + seq, 100, tokens)])
                seq += 1
                return router.kv_event_status()[0]["batches"] > 0

            wait_for(delivered, "a batch")
            status = router.kv_event_status()[0]
            self.assertEqual((status["rank"], status["connected"], status["bind"]), (1, True, bind_router))
            hit = router.best_rank(tokens + [5, 6, 7])
            self.assertEqual((hit.rank, hit.branch, hit.predicted_cached_tokens), (1, "hit", 64))
            # Other topics are not delivered.
            pub.send_multipart([b"other", (10**6).to_bytes(8, "big"), b"\xc1"])
            time.sleep(0.3)
            self.assertEqual(router.kv_event_status()[0]["decode_errors"], 0)
        finally:
            pub.close(linger=0)
            context.term()

    def test_a_publisher_that_binds(self):
        self.check_precise(bind_router=False)

    def test_a_publisher_that_connects(self):
        self.check_precise(bind_router=True)

    def test_a_hostile_publisher_ends_its_connection_not_the_process(self):
        # A ZMTP 3 greeting and READY, then a frame declaring a petabyte (the `zeromq` crate aborted on this).
        greeting = bytes([0xFF] + [0] * 7 + [1, 0x7F, 3, 0]) + b"NULL" + bytes(16) + bytes([0]) + bytes(31)
        ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 3) + b"PUB"
        command = bytes([0x04, len(ready)]) + ready
        huge = bytes([0x02]) + struct.pack(">Q", 1 << 50)
        server = socket.create_server(("127.0.0.1", 0))
        port = server.getsockname()[1]
        connections = []

        def serve():
            for _ in range(2):
                conn, _ = server.accept()
                connections.append(conn)
                conn.sendall(greeting + command + huge)

        threading.Thread(target=serve, daemon=True).start()
        router = dprouter.Router("cache_aware", 2)
        router.follow_kv_events(0, f"tcp://127.0.0.1:{port}")
        wait_for(lambda: router.kv_event_status()[0]["frame_errors"] >= 2, "two refused messages")
        # Still routing, and the feed tried again after the first.
        self.assertEqual(router.pick([1, 2, 3]).branch, "cold")
        server.close()
        for conn in connections:
            conn.close()


class Parity(unittest.TestCase):
    def test_prefix_match_vectors(self):
        # The vectors of token prompts (the text ones are the gateway's: engines route token ids).
        lines = [line for line in (TESTDATA / "prefix_match.jsonl").read_text().splitlines() if "input_ids" in line]
        self.assertGreater(len(lines), 40)
        for line in lines:
            v = json.loads(line)
            self.assertEqual(dprouter.prefix_match_rank(v["input_ids"], v["dp_size"]), v["rank"], line[:80])
            router = dprouter.Router("prefix_match", v["dp_size"])
            self.assertEqual(router.pick(array.array("q", v["input_ids"])).rank, v["rank"])

    def test_the_scripted_run_gives_the_cores_outcomes(self):
        """The core's `dp_router::tests::scripted` recorded these outcomes driving the same operations in Rust."""
        router = None
        picks = 0
        for n, line in enumerate((TESTDATA / "dp_router_script.jsonl").read_text().splitlines(), 1):
            op = json.loads(line)
            kind = op["op"]
            got = None
            if kind == "router":
                router = dprouter.Router(op["policy"], op["num_ranks"])
            elif kind in ("pick", "best_rank"):
                kwargs = {"routed_rank": op.get("routed_rank"), "now_us": op["now_us"]}
                if kind == "pick":
                    p = router.pick(prompt(op["prompt"]), request_id=op["id"], **kwargs)
                    picks += 1
                else:
                    p = router.best_rank(prompt(op["prompt"]), **kwargs)
                got = [p.rank, p.branch, p.predicted_cached_tokens]
            elif kind == "first_token":
                got = router.first_token(
                    op["id"], now_us=op["now_us"], prompt_tokens=op["prompt_tokens"], cached_tokens=op["cached_tokens"]
                )
            elif kind == "finish":
                got = router.finish(op["id"])
            elif kind == "abort":
                got = router.abort(op["id"])
            elif kind == "report_load":
                got = router.report_load(
                    op["rank"], running=op["running"], waiting=op["waiting"], tokens=op["tokens"],
                    waiting_tokens=op.get("waiting_tokens"), timestamp=op["timestamp"],
                )
            elif kind == "set_active":
                router.set_active(op["rank"], op["active"])
            else:
                self.fail(f"unknown op {kind}")
            self.assertEqual(got, op.get("expect"), f"line {n}: {line[:160]}")
        self.assertEqual(picks, 120)


if __name__ == "__main__":
    unittest.main()
