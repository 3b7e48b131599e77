"""dprouter in vLLM's own data-parallel dispatch (the ``vllm.general_plugins`` entry point).

With ``DPROUTER_POLICY`` set (a policy spec, as ``dprouter serve --policy`` takes it: ``cache_aware``,
``prefix_match``, ``cache_aware:prefill_tokens_per_s=12000``), the rank of every request that does not name one is
picked by a :class:`dprouter.Router` in ``DPLBAsyncMPClient.get_core_engine_for_request``: the request's
``data_parallel_rank`` is set to the pick, and vLLM's own accounting (requests in flight per engine, aborts, session
affinity) goes on as for a request that named its rank. ``process_engine_outputs`` feeds the router each request's
first token with its cached tokens (vLLM's ``PrefillStats``) and its finish. Without ``DPROUTER_POLICY`` nothing
changes; on a vLLM whose hook points differ, a warning is logged and routing is left to vLLM.

vLLM loads general plugins in every process, several times: :func:`register` is idempotent and cheap. With several
API servers (``--api-server-count``) each has its own client and its own ``Router``: each learns only from the
requests it routes.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("dprouter.vllm")

ENV = "DPROUTER_POLICY"
_PATCHED = "_dprouter_patched"


def _namespace(request) -> str | None:
    """The cache namespace of a request: its ``cache_salt`` and its LoRA adapter (blocks are not shared across them)."""
    salt = getattr(request, "cache_salt", None)
    lora = getattr(request, "lora_request", None)
    lora_name = getattr(lora, "lora_name", None) if lora is not None else None
    if salt is None and lora_name is None:
        return None
    return f"salt={salt}|lora={lora_name}"


class _State:
    """One DP client's router (created with the client's first request, when the number of engines is known)."""

    def __init__(self, policy: str, num_ranks: int):
        from ._dprouter import Router

        self.router = Router(policy, num_ranks)
        self.failures = 0


def _state(client, policy: str) -> _State:
    state = client.__dict__.get("_dprouter")
    if state is None or state.router.num_ranks != len(client.core_engines):
        state = _State(policy, len(client.core_engines))
        client.__dict__["_dprouter"] = state
    return state


def _hooks(cls) -> tuple | None:
    """The original hook points of ``DPLBAsyncMPClient``, if they are the ones this plugin knows."""
    choose = cls.__dict__.get("get_core_engine_for_request")
    outputs = cls.__dict__.get("process_engine_outputs")
    if not callable(choose) or not isinstance(outputs, staticmethod):
        return None
    return choose, outputs.__func__


def register() -> None:
    """Puts the router in vLLM's DP client when ``DPROUTER_POLICY`` is set."""
    policy = os.environ.get(ENV, "").strip()
    if not policy:
        return
    from ._dprouter import Router

    # A wrong spec is the user's error: refuse to start rather than route some other way.
    Router(policy, 2)
    try:
        from vllm.v1.engine import core_client
    except Exception as e:  # noqa: BLE001 - any import failure leaves vLLM as it is
        logger.warning("dprouter: vLLM's DP client cannot be imported (%s): routing left to vLLM", e)
        return
    cls = getattr(core_client, "DPLBAsyncMPClient", None)
    if cls is None:
        logger.warning("dprouter: this vLLM has no DPLBAsyncMPClient: routing left to vLLM")
        return
    if cls.__dict__.get(_PATCHED):
        return
    hooks = _hooks(cls)
    if hooks is None:
        logger.warning(
            "dprouter: DPLBAsyncMPClient's hook points differ from the ones dprouter knows: routing left to vLLM"
        )
        return
    choose, process_outputs = hooks

    def get_core_engine_for_request(self, request):
        if (
            request.data_parallel_rank is None
            and request.request_id not in self.reqs_in_flight
            and getattr(request, "pooling_params", None) is None
        ):
            state = _state(self, policy)
            try:
                pick = state.router.pick(
                    request.prompt_token_ids or (),
                    request_id=request.request_id,
                    cache_namespace=_namespace(request),
                )
                request.data_parallel_rank = pick.rank
            except Exception as e:  # noqa: BLE001 - never fail a request for the router's sake
                state.failures += 1
                if state.failures == 1:
                    logger.warning("dprouter: pick failed (%s): vLLM chooses this request's engine", e)
        return choose(self, request)

    async def process_engine_outputs(self, outputs):
        await process_outputs(self, outputs)
        state = self.__dict__.get("_dprouter")
        if state is None:
            return
        router = state.router
        for output in outputs.outputs:
            stats = getattr(output, "prefill_stats", None)
            if stats is not None:
                router.first_token(
                    output.request_id,
                    prompt_tokens=stats.num_prompt_tokens,
                    cached_tokens=stats.num_cached_tokens,
                )
            if output.finish_reason is not None:
                router.finish(output.request_id)
        for request_id in outputs.finished_requests or ():
            router.finish(request_id)

    get_core_engine_for_request.__wrapped__ = choose
    cls.get_core_engine_for_request = get_core_engine_for_request
    cls.process_engine_outputs = staticmethod(process_engine_outputs)
    setattr(cls, _PATCHED, True)
    logger.info("dprouter: vLLM's DP client routes with %s", policy)
