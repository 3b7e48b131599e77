"""The SGLang plugin (`dprouter.sglang_plugin`) in SGLang's released package (0.5.23), on CPU.

As SGLang's own controller tests do, each case loads the plugin through SGLang's `load_plugins()`, builds a
`DataParallelController` with `__new__` and the attributes its dispatch reads (no scheduler processes: each rank's
socket records what SGLang's `sock_send` sends it), applies the hook registered on `__init__`, and sends real
`TokenizedGenerateReqInput`s through the controller's real `dispatching_with_trace`. What is not SGLang's own:
`sgl_kernel` is stubbed (`maybe_stub_sgl_kernel()`, SGLang's test utility: its CUDA kernels cannot load here),
the ranks' sockets record instead of sending, and the load snapshot reader returns the snapshots a case gives.
The plugin patches SGLang's classes for the whole process, so each case runs in a Python of its own. Skipped
where SGLang is not installed (`scripts/vllm_engine.py install-sglang` installs it for these tests).
"""

import os
import subprocess
import sys
import textwrap
import unittest
from importlib.util import find_spec

PRELUDE = """
import array, logging, pickle
from types import SimpleNamespace
logging.basicConfig(level=logging.WARNING)
from sglang.test.test_utils import maybe_stub_sgl_kernel
maybe_stub_sgl_kernel()
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
import sglang.srt.managers.data_parallel_controller as dpc
from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.managers.load_snapshot import LoadSnapshot
from sglang.srt.sampling.sampling_params import SamplingParams

TARGET = "sglang.srt.managers.data_parallel_controller.DataParallelController.__init__"
# Kept in a dict: SGLang's registry rebinds every module-level name bound to the original `__init__`.
saved = {"init": dpc.DataParallelController.__init__}
load_plugins()

class Socket:
    "A rank's socket: records what SGLang's sock_send sends (send_pyobj with pickle IPC, send with msgpack)."
    def __init__(self):
        self.sent = []
    def send_pyobj(self, obj, flags=0, protocol=None):
        self.sent.append(obj)
    def send(self, data, flags=0):
        self.sent.append(data)

class Snapshots:
    def __init__(self):
        self.now = []
    def read_all(self):
        return list(self.now)

def controller(ranks, mode="null"):
    ctl = dpc.DataParallelController.__new__(dpc.DataParallelController)
    ctl.workers = [Socket() for _ in range(ranks)]
    ctl.status = [True] * ranks
    ctl._active_workers = list(range(ranks))
    ctl.round_robin_counter = 0
    ctl.health_round_robin_counter = 0
    ctl.load_balance_method = dpc.LoadBalanceMethod.TOTAL_TOKENS
    ctl.dp_budget = dpc.DPBudget(ranks)
    ctl.refresh_load_budget_on_dispatch = True
    ctl._last_refresh_time = 0.0
    ctl.load_snapshot_reader = Snapshots()
    ctl.dispatching = ctl.total_tokens_scheduler
    ctl.server_args = SimpleNamespace(disaggregation_mode=mode)
    # What `__init__` ends with: the hooks registered on it.
    for _, hook, _ in HookRegistry._hooks[TARGET]:
        hook(None, ctl)
    return ctl

def request(rid, ids, **fields):
    return TokenizedGenerateReqInput(
        rid=rid, input_text=None, input_ids=array.array("q", ids), input_embeds=None, mm_inputs=None,
        token_type_ids=None, sampling_params=SamplingParams(), return_logprob=False, logprob_start_len=-1,
        top_logprobs_num=0, token_ids_logprob=None, stream=False, **fields)

def rank_of(ctl, rid):
    "The rank whose socket got request `rid`."
    found = [r for r, s in enumerate(ctl.workers) for x in s.sent if getattr(x, "rid", None) == rid]
    assert len(found) == 1, (rid, found)
    return found[0]

def run(seed, length):
    return [(seed * 7919 + i * 2654435761) % 151936 for i in range(length)]
"""


def python(code, **env):
    """Runs PRELUDE and `code` in a fresh Python with `env` added; returns its output."""
    environment = {k: v for k, v in os.environ.items() if k not in ("DPROUTER_POLICY", "SGLANG_PLUGINS")}
    environment.update(env)
    out = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if out.returncode != 0:
        raise AssertionError(f"the check failed:\n{out.stdout}\n{out.stderr}")
    return out.stdout + out.stderr


@unittest.skipIf(find_spec("sglang") is None, "SGLang is not installed beside this Python")
class InSglang(unittest.TestCase):
    def test_cache_aware_in_sglangs_controller(self):
        python(
            """
            hooks = HookRegistry._hooks[TARGET]
            assert [h.__qualname__ for _, h, _ in hooks] == ["dprouter.sglang_plugin.after_init"], hooks
            assert dpc.DataParallelController.__init__ is not saved["init"], "the hook was not applied"

            # Same-prefix requests gather on one rank.
            ctl = controller(4)
            system = run(1, 4096)
            for i in range(8):
                ctl.dispatching_with_trace(request(f"s{i}", system + run(100 + i, 50)))
            ranks = {rank_of(ctl, f"s{i}") for i in range(8)}
            assert len(ranks) == 1, ranks
            home = ranks.pop()

            # The load snapshots. A rank reporting a long prefill queue (400,000 uncached tokens waiting) gets no
            # new prefix: without snapshots the same eight prompts spread over every rank, that one too.
            import time

            def loaded(ctl, rank):
                now = time.time()
                ctl.load_snapshot_reader.now = [
                    LoadSnapshot(timestamp=now, dp_rank=r, num_running_reqs=8 if r == rank else 0,
                                 num_waiting_reqs=40 if r == rank else 0,
                                 num_waiting_uncached_tokens=400_000 if r == rank else 0,
                                 num_total_tokens=500_000 if r == rank else 0)
                    for r in range(4)
                ]
                # SGLang's refresh reads them at most every 20 ms; so does the plugin.
                time.sleep(0.03)

            control = controller(4)
            for i in range(8):
                control.dispatching_with_trace(request(f"n{i}", run(500 + i, 2000)))
            spread = [rank_of(control, f"n{i}") for i in range(8)]
            busy = spread[0]
            ctl2 = controller(4)
            loaded(ctl2, busy)
            for i in range(8):
                ctl2.dispatching_with_trace(request(f"n{i}", run(500 + i, 2000)))
            moved = [rank_of(ctl2, f"n{i}") for i in range(8)]
            assert busy not in moved, (busy, spread, moved)
            # And requests on a prefix the loaded rank holds go elsewhere too, where they went home before.
            loaded(ctl, home)
            for i in range(4):
                ctl.dispatching_with_trace(request(f"h{i}", system + run(200 + i, 50)))
            away = [rank_of(ctl, f"h{i}") for i in range(4)]
            assert home not in away, (home, away)

            # A named rank wins; a bad one raises SGLang's own error.
            ctl.dispatching_with_trace(request("pinned", system, routed_dp_rank=(home + 1) % 4))
            assert rank_of(ctl, "pinned") == (home + 1) % 4
            try:
                ctl.dispatching_with_trace(request("bad", system, routed_dp_rank=9))
            except ValueError as e:
                assert str(e) == "DP rank 9 is not active.", e
            else:
                raise AssertionError("a bad routed_dp_rank was accepted")

            # An inactive rank is skipped, and named, refused.
            ctl = controller(4)
            ctl.status[2] = False
            ctl._active_workers = [0, 1, 3]
            for i in range(40):
                ctl.dispatching_with_trace(request(f"a{i}", run(1000 + i, 300)))
            assert not ctl.workers[2].sent and all(s.sent for r, s in enumerate(ctl.workers) if r != 2)
            try:
                ctl.dispatching_with_trace(request("to2", system, routed_dp_rank=2))
            except ValueError as e:
                assert str(e) == "DP rank 2 is not active.", e
            else:
                raise AssertionError("an inactive rank was accepted")

            # The request goes out as SGLang sends it: unchanged, picklable.
            sent = ctl.workers[0].sent[0]
            assert pickle.loads(pickle.dumps(sent)).input_ids == sent.input_ids

            # Prefill/decode disaggregation keeps SGLang's dispatch.
            ctl = controller(4, mode="prefill")
            assert ctl.dispatching == ctl.total_tokens_scheduler and "_dprouter" not in ctl.__dict__
            """,
            DPROUTER_POLICY="cache_aware",
        )

    def test_prefix_match_with_msgpack_ipc(self):
        python(
            """
            import dprouter
            from sglang.srt.managers.io_struct import msgpack_decode
            ctl = controller(8)
            ids = run(3, 5000)
            ctl.dispatching_with_trace(request("x", ids))
            # msgpack IPC (SGLANG_USE_PICKLE_IPC=false): the bytes decode to the same request.
            rank = next(r for r, s in enumerate(ctl.workers) if s.sent)
            assert rank == dprouter.prefix_match_rank(ids, 8), rank
            got = msgpack_decode(ctl.workers[rank].sent[0])
            assert got.rid == "x" and list(got.input_ids) == ids
            """,
            DPROUTER_POLICY="prefix_match",
            SGLANG_USE_PICKLE_IPC="false",
        )

    def test_the_ranks_kv_events_make_cache_aware_precise(self):
        python(
            """
            import json, socket, time
            from sglang.srt.disaggregation.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                base = s.getsockname()[1]
            # SGLang's own publisher for rank 2, bound on loopback at base + 2 (SGLang's port-per-rank rule), and
            # the controller's --kv-events-config naming the base.
            config = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{base}", "bind": True, "topic": "kv"}
            ctl = dpc.DataParallelController.__new__(dpc.DataParallelController)
            ctl.server_args = SimpleNamespace(disaggregation_mode="null", kv_events_config=json.dumps(config))
            ctl2 = controller(4)
            ctl.__dict__.update({k: v for k, v in ctl2.__dict__.items() if k not in ("server_args", "_dprouter", "dispatching")})
            ctl.dispatching = ctl.total_tokens_scheduler
            for _, hook, _ in HookRegistry._hooks[TARGET]:
                hook(None, ctl)
            router = ctl._dprouter.router
            status = router.kv_event_status()
            assert [(s["rank"], s["endpoint"], s["bind"]) for s in status] == [
                (r, f"tcp://127.0.0.1:{base + r}", False) for r in range(4)], status

            tokens = run(21, 640)
            cold = router.best_rank(tokens).rank
            rank = (cold + 1) % 4
            publisher = ZmqEventPublisher(rank, endpoint=f"tcp://127.0.0.1:{base}", topic="kv", bind=True)
            deadline = time.monotonic() + 20
            while router.kv_event_status()[rank]["batches"] == 0:
                assert time.monotonic() < deadline, router.kv_event_status()
                # One-token pages, as SGLang's radix cache stores them.
                publisher.publish(KVEventBatch(ts=time.time(), events=[BlockStored(
                    block_hashes=list(range(1, 641)), parent_block_hash=None, token_ids=tokens, block_size=1,
                    lora_id=None)]))
                time.sleep(0.1)
            ctl.dispatching_with_trace(request("warm", tokens + [1, 2, 3]))
            assert rank_of(ctl, "warm") == rank, (rank, cold)
            hit = router.best_rank(tokens + [4])
            assert (hit.rank, hit.branch, hit.predicted_cached_tokens) == (rank, "hit", 640), hit
            publisher.shutdown()
            """,
            DPROUTER_POLICY="cache_aware",
        )

    def test_nothing_changes_without_dprouter_policy_or_outside_the_whitelist(self):
        for env in ({}, {"DPROUTER_POLICY": "cache_aware", "SGLANG_PLUGINS": "someone_else"}):
            python(
                """
                assert not HookRegistry._hooks.get(TARGET), HookRegistry._hooks.get(TARGET)
                assert dpc.DataParallelController.__init__ is saved["init"]
                ctl = controller(2)
                assert ctl.dispatching == ctl.total_tokens_scheduler
                """,
                **env,
            )

    def test_an_sglang_whose_hook_points_differ_is_left_alone(self):
        out = python(
            """
            # Another SGLang, as the plugin sees it: no maybe_external_dp_rank_routing.
            from dprouter import sglang_plugin
            HookRegistry.reset()
            del dpc.DataParallelController.maybe_external_dp_rank_routing
            sglang_plugin._registered = False
            sglang_plugin.register()
            assert not HookRegistry._hooks.get(TARGET)
            """,
            DPROUTER_POLICY="cache_aware",
        )
        self.assertIn("lacks maybe_external_dp_rank_routing", out)


if __name__ == "__main__":
    unittest.main()
