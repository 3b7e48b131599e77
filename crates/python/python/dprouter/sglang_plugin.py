"""dprouter in SGLang's own data-parallel dispatch (the ``sglang.srt.plugins`` entry point).

With ``DPROUTER_POLICY`` set (a policy spec, as ``dprouter serve --policy`` takes it: ``cache_aware``,
``prefix_match``, ``cache_aware:prefill_tokens_per_s=12000``), an ``AFTER`` hook on
``DataParallelController.__init__`` replaces the controller's ``dispatching`` (the method its
``dispatching_with_trace`` calls for every request but health checks) with a :class:`dprouter.Router`'s pick:

- a request that names its rank (``routed_dp_rank``) goes through SGLang's own ``maybe_external_dp_rank_routing``:
  the same semantics and the same ``ValueError("DP rank N is not active.")``;
- the others go to the rank the router picks among the active ones (``_active_workers`` with ``status`` true: an
  inactive rank is skipped, elastic EP's changing set followed), keyed on ``input_ids`` in the cache namespace of
  ``extra_key``, ``cache_salt`` and the LoRA adapter, with ``routing_key`` as a session hint and
  ``bootstrap_room`` for ``follow_bootstrap_room``, and sent with SGLang's ``sock_send`` (the request unchanged,
  so it stays encodable by pickle and msgpack alike);
- the router learns each rank's load from SGLang's load snapshots (read at most every 20 ms, as SGLang's own
  ``refresh_load_budget``; they carry the uncached tokens waiting, so ``cache_aware`` sees each rank's prefill
  queue). The schedulers publish snapshots under ``--load-balance-method total_requests`` or ``total_tokens``:
  keep one of those. The controller never sees a request finish, so no ticket is kept;
- with ``--kv-events-config`` (a ``zmq`` publisher), the router follows each rank's KV events (SGLang's rule: rank
  r publishes at the endpoint's port + r; it binds a wildcard host, or when ``bind`` says so, and the router
  connects to it on loopback; otherwise the router binds where it connects), through the gateway's bounded ZMTP
  reader in a background thread: ``cache_aware`` then knows what each rank holds (precise mode);
- prefill/decode disaggregation (``disaggregation_mode`` other than ``null``) keeps SGLang's dispatch.

Without ``DPROUTER_POLICY`` nothing changes; on an SGLang whose hook points differ, a warning is logged and
routing is left to SGLang; a failing pick falls back to SGLang's own method for that request. ``SGLANG_PLUGINS``
(SGLang's whitelist) must name ``dprouter`` when it is set.
"""

from __future__ import annotations

import json
import logging
import os
import time

logger = logging.getLogger("dprouter.sglang")

ENV = "DPROUTER_POLICY"
MODULE = "sglang.srt.managers.data_parallel_controller"
TARGET = MODULE + ".DataParallelController.__init__"
# What the hook uses of the controller (an SGLang without them is left alone).
METHODS = ("dispatching_with_trace", "maybe_external_dp_rank_routing")
REFRESH_S = 0.02

_registered = False


def _namespace(req) -> str | None:
    """The cache namespace: SGLang keys its radix cache on `extra_key` (and `cache_salt`) and the LoRA adapter."""
    parts = {
        "extra": getattr(req, "extra_key", None),
        "salt": getattr(req, "cache_salt", None),
        "lora": getattr(req, "lora_name", None) or getattr(req, "lora_id", None),
    }
    if all(v is None for v in parts.values()):
        return None
    return "|".join(f"{k}={v}" for k, v in parts.items())


class Routing:
    """One controller's dispatch through a Router."""

    def __init__(self, controller, policy: str):
        from ._dprouter import Router

        self.controller = controller
        self.router = Router(policy, len(controller.workers))
        self.original = controller.dispatching
        self.last_refresh = 0.0
        self.failures = 0

    def refresh_loads(self) -> None:
        now = time.perf_counter()
        reader = getattr(self.controller, "load_snapshot_reader", None)
        if reader is None or now - self.last_refresh < REFRESH_S:
            return
        self.last_refresh = now
        for s in reader.read_all():
            if 0 <= s.dp_rank < self.router.num_ranks:
                self.router.report_load(
                    s.dp_rank,
                    running=s.num_running_reqs,
                    waiting=s.num_waiting_reqs,
                    tokens=s.num_total_tokens,
                    waiting_tokens=s.num_waiting_uncached_tokens,
                    timestamp=int(s.timestamp * 1e6),
                )

    def dispatch(self, req) -> None:
        ctl = self.controller
        if ctl.maybe_external_dp_rank_routing(req):
            return
        try:
            self.refresh_loads()
            eligible = [r for r in ctl._active_workers if ctl.status[r] and ctl.workers[r] is not None]
            if not eligible:
                # SGLang's own method says what is wrong.
                return self.original(req)
            pick = self.router.pick(
                req.input_ids if req.input_ids is not None else (),
                bootstrap_room=getattr(req, "bootstrap_room", None),
                session=getattr(req, "routing_key", None),
                cache_namespace=_namespace(req),
                eligible=eligible,
            )
        except Exception as e:  # noqa: BLE001 - never fail a request for the router's sake
            self.failures += 1
            if self.failures == 1:
                logger.warning("dprouter: pick failed (%s): SGLang's own method dispatches this request", e)
            return self.original(req)
        # Looked up at call time: SGLang's sender (pickle or msgpack, as SGLANG_USE_PICKLE_IPC says).
        import sys

        sys.modules[MODULE].sock_send(ctl.workers[pick.rank], req)


def kv_event_sources(controller, ranks: int) -> list[tuple[int, str, bool, str]]:
    """(rank, endpoint, bind, topic) of each rank's KV event publisher, from the controller's
    ``--kv-events-config``: empty without a ``zmq`` publisher on ``tcp://``."""
    raw = getattr(getattr(controller, "server_args", None), "kv_events_config", None)
    if not raw:
        return []
    config = json.loads(raw) if isinstance(raw, str) else dict(raw)
    if config.get("publisher", "null") != "zmq":
        return []
    endpoint = config.get("endpoint") or "tcp://*:5557"
    if not endpoint.startswith("tcp://") or ":" not in endpoint[len("tcp://") :]:
        logger.warning("dprouter: KV events at %s are not tcp://host:port: not followed", endpoint)
        return []
    host, port = endpoint[len("tcp://") :].rsplit(":", 1)
    wildcard = host in ("*", "0.0.0.0", "::", "[::]")
    publisher_binds = config.get("bind")
    if publisher_binds is None:
        publisher_binds = wildcard
    topic = config.get("topic") or ""
    sources = []
    for rank in range(ranks):
        at = int(port) + rank
        if publisher_binds:
            sources.append((rank, f"tcp://{'127.0.0.1' if wildcard else host}:{at}", False, topic))
        else:
            sources.append((rank, f"tcp://{host}:{at}", True, topic))
    return sources


def install(controller, policy: str) -> Routing | None:
    """Puts a Router in `controller`'s dispatch (what the hook does after `__init__`); returns it, or None when the
    controller keeps SGLang's dispatch (prefill/decode disaggregation). Installing twice keeps the first."""
    existing = controller.__dict__.get("_dprouter")
    if existing is not None:
        return existing
    mode = getattr(getattr(controller, "server_args", None), "disaggregation_mode", "null")
    if mode not in (None, "null"):
        logger.info("dprouter: disaggregation mode %s: SGLang's own dispatch", mode)
        return None
    routing = Routing(controller, policy)
    for rank, endpoint, bind, topic in kv_event_sources(controller, routing.router.num_ranks):
        routing.router.follow_kv_events(rank, endpoint, bind=bind, topic=topic)
    controller._dprouter = routing
    controller.dispatching = routing.dispatch
    logger.info("dprouter: SGLang's DP controller routes with %s over %d ranks", policy, routing.router.num_ranks)
    return routing


def register() -> None:
    """Registers the hook when ``DPROUTER_POLICY`` is set (SGLang's `load_plugins()` calls this)."""
    global _registered
    policy = os.environ.get(ENV, "").strip()
    if not policy or _registered:
        return
    from ._dprouter import Router

    # A wrong spec is the user's error: refuse to start rather than route some other way.
    Router(policy, 2)
    try:
        import importlib

        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        controller = importlib.import_module(MODULE).DataParallelController
    except Exception as e:  # noqa: BLE001 - any import failure leaves SGLang as it is
        logger.warning("dprouter: SGLang's DP controller cannot be imported (%s): routing left to SGLang", e)
        return
    missing = [m for m in METHODS if not callable(getattr(controller, m, None))]
    if missing or not hasattr(controller, "__init__"):
        logger.warning(
            "dprouter: SGLang's DataParallelController lacks %s: routing left to SGLang", ", ".join(missing)
        )
        return

    def after_init(result, controller, *args, **kwargs):
        install(controller, policy)
        return result

    after_init.__qualname__ = "dprouter.sglang_plugin.after_init"
    HookRegistry.register(TARGET, after_init, HookType.AFTER)
    _registered = True
