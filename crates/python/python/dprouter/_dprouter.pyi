from collections.abc import Iterable, Sequence
from typing import Literal

from typing_extensions import Buffer

__version__: str

TokenIds = Buffer | Iterable[int]
"""A list of ints, or any buffer of 32- or 64-bit integers (``array('q')``, ``array('i')``, a numpy array)."""

Branch = Literal["override", "turn", "least_loaded", "hashed", "fallback", "empty", "affine", "spill", "hit", "cold"]

class DprouterError(ValueError):
    """A call was refused: a bad policy, rank or argument."""

class PolicyError(DprouterError):
    """The policy spec is not valid."""

class RankError(DprouterError):
    """A rank is out of range or not active, or no rank may take the request."""

class Pick:
    @property
    def rank(self) -> int: ...
    @property
    def branch(self) -> Branch: ...
    @property
    def predicted_cached_tokens(self) -> int: ...

class Router:
    def __init__(
        self, policy: str, num_ranks: int, *, max_tickets: int = 100_000, ticket_ttl_s: float = 1800.0
    ) -> None: ...
    def pick(
        self,
        token_ids: TokenIds,
        *,
        request_id: str | None = None,
        routed_rank: int | None = None,
        bootstrap_room: int | None = None,
        session: str | None = None,
        cache_namespace: str | None = None,
        eligible: Sequence[int] | None = None,
        now_us: int | None = None,
    ) -> Pick: ...
    def best_rank(
        self,
        token_ids: TokenIds,
        *,
        routed_rank: int | None = None,
        bootstrap_room: int | None = None,
        session: str | None = None,
        cache_namespace: str | None = None,
        eligible: Sequence[int] | None = None,
        now_us: int | None = None,
    ) -> Pick: ...
    def first_token(
        self,
        request_id: str,
        *,
        now_us: int | None = None,
        prompt_tokens: int | None = None,
        cached_tokens: int | None = None,
    ) -> bool: ...
    def finish(self, request_id: str, *, prompt_tokens: int | None = None, cached_tokens: int | None = None) -> bool: ...
    def abort(self, request_id: str) -> bool: ...
    def report_load(
        self,
        rank: int,
        *,
        running: int = 0,
        waiting: int = 0,
        tokens: int = 0,
        waiting_tokens: int | None = None,
        timestamp: int | None = None,
    ) -> bool: ...
    def set_active(self, rank: int, active: bool) -> None: ...
    def is_active(self, rank: int) -> bool: ...
    def apply_kv_events(
        self, rank: int, seq: int, payload: bytes, *, now_us: int | None = None
    ) -> Literal["applied", "duplicate", "restarted", "gap", "undecodable"]: ...
    def follow_kv_events(self, rank: int, endpoint: str, *, bind: bool = False, topic: str = "") -> None: ...
    def kv_event_status(self) -> list[dict[str, int | str | bool]]: ...
    def in_flight(self) -> list[int]: ...
    @property
    def num_ranks(self) -> int: ...
    @property
    def policy(self) -> str: ...
    @property
    def tickets(self) -> int: ...

def prefix_match_rank(token_ids: TokenIds, num_ranks: int) -> int: ...
