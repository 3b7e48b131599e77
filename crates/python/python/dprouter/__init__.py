"""dprouter's routing policies for an engine's own data-parallel dispatch.

``Router`` picks a DP rank for each request with one of dprouter's policies (``prefix_match``, ``prefix_affinity``,
``cache_aware``, and SGLang's ``round_robin``, ``total_requests``, ``total_tokens``, ``follow_bootstrap_room``),
learning from the engine's feedback (first tokens, finishes with cached tokens, load reports, KV events). The
``vllm_plugin`` module puts it in vLLM's DP client when ``DPROUTER_POLICY`` is set; nothing changes otherwise.
"""

from ._dprouter import (
    DprouterError,
    Pick,
    PolicyError,
    RankError,
    Router,
    __version__,
    prefix_match_rank,
)

__all__ = [
    "DprouterError",
    "Pick",
    "PolicyError",
    "RankError",
    "Router",
    "__version__",
    "prefix_match_rank",
]
