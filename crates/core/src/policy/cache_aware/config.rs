//! `cache_aware`'s options.

use serde::{Deserialize, Serialize};

/// A session's idle time before it is forgotten, by default: Anthropic's own prompt cache keeps a prefix 5 minutes.
pub const DEFAULT_SESSION_TTL_MS: u64 = 300_000;

/// How much costlier than the best endpoint an active session's home may be predicted before the session leaves
/// it, by default, milliseconds: about 3,750 tokens of prefill on the default costs. A turn whose prompt alone
/// would place it elsewhere by a little (what the home holds that the index does not see) stays home; a home busy
/// prefilling, or one whose cache the turn would overflow, is left. Measured in `docs/measurements.md` ("Session
/// homes"): from 100 to 250 ms the results are the same within the runs' noise; the bound this replaces (queued
/// tokens, 32,768) kept sessions on busy homes and cost 2 to 3 points of hit rate at cache pressure.
pub const DEFAULT_SESSION_HOME_MARGIN_MS: f64 = 150.0;

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CacheAwareConfig {
    /// Tokens per indexed block (text prompts: 4 bytes per token).
    pub block_tokens: usize,
    /// KV capacity in tokens of an endpoint that does not report its own.
    pub kv_capacity_tokens: u64,
    /// One engine rank's prefill throughput, tokens per second (until its own is learned: `learn_costs`).
    pub prefill_tokens_per_s: f64,
    /// Fixed time per prefill, milliseconds (until its own is learned: `learn_costs`).
    pub base_ms: f64,
    /// Predict each endpoint with the prefill costs fitted from its own requests once there are enough of them
    /// (`crate::cost_fit`); `false` keeps `prefill_tokens_per_s` and `base_ms` for every endpoint.
    pub learn_costs: bool,
    /// How much the endpoints' prefills share compute (expert parallelism), from 0 (independent ranks) to 1: a
    /// prefill is predicted longer by this share of the time it overlaps the prefill work queued at each other
    /// endpoint (while k others prefill, it advances at about `1 / (1 + prefill_contention · k)` of its speed).
    pub prefill_contention: f64,
    /// Learn from the engines' reported cached tokens: a refuted prediction bounds how much of the prompts the
    /// index sees the endpoint really keeps, and the index forgets at that capacity when it is below the given
    /// one (the module `learned`; not in precise mode).
    pub correct_on_feedback: bool,
    /// Count the part of an endpoint's queue already prefilled (from the request's clock); `false` counts every
    /// queued prefill whole.
    pub prefill_progress: bool,
    /// Charge for the delay this request's own prefill adds to the requests that will queue behind it: its
    /// prefill time there, times this weight, times the requests already waiting for a first token there. 0
    /// compares the plain predicted TTFT.
    pub congestion_weight: f64,
    /// Charge for the blocks of other prompts a choice makes the endpoint forget (its index over capacity): their
    /// prefill time, times this weight. 0 counts only this request's own time.
    pub eviction_weight: f64,
    /// Cold placements (equal predictions) pass over endpoints sent more than `1 + recent_epsilon` times the
    /// mean of the requests sent recently (counts that halve every this many seconds of request time).
    pub recent_half_life_s: f64,
    /// See `recent_half_life_s`.
    pub recent_epsilon: f64,
    /// The requests a conversation is expected to make in all: a placement is charged the delay its remaining
    /// turns and those of the other conversations at the endpoint would cause each other there
    /// (module `conversations`). 0 leaves the forecast out (each request is placed for its own time to first token).
    pub session_turns: u32,
    /// Precise mode: how long the blocks of a request routed to an endpoint with KV events stay in the index
    /// unconfirmed by them, milliseconds (the engine's queue and prefill must fit in it).
    pub event_grace_ms: u64,
    /// A prompt no endpoint holds goes to its rendezvous choice among the endpoints predicted within this many
    /// milliseconds of the lowest time to first token, rather than to the lowest: replicas that each see only
    /// their own requests in flight then agree on where a new prefix goes while their views of the queues differ
    /// by less than this. 0 (the default): the lowest.
    pub cold_tolerance_ms: f64,
    /// How long a session stays active after its last request, milliseconds: while it is, its requests go to the
    /// endpoint of its last one (its home, `policy::session_homes`) within `session_home_margin_ms`. 0: no session
    /// is kept.
    pub session_ttl_ms: u64,
    /// An active session's request goes home while the home's predicted cost (the time to first token with the
    /// delays and evictions it causes, as compared between endpoints) is at most this many milliseconds above the
    /// lowest; beyond it the session leaves (a home busy prefilling, or one whose cache it would overflow).
    pub session_home_margin_ms: f64,
    /// Charge for the prefixes of sessions paused for a tool (their answer ended on tool calls) that a choice
    /// pushes out of the endpoint's cache: their prefill time, times this weight, on top of `eviction_weight`'s
    /// (module `pauses`). 0 (the default: measured in `docs/measurements.md`, it helps some agent fleets and
    /// hurts others): sessions' pauses are not followed.
    pub pause_weight: f64,
}

impl Default for CacheAwareConfig {
    /// An 8B-class model on one H100 per rank (the simulator's `h100-8b` preset).
    fn default() -> Self {
        Self {
            block_tokens: 64,
            kv_capacity_tokens: 400_000,
            prefill_tokens_per_s: 25_000.0,
            base_ms: 25.0,
            learn_costs: true,
            prefill_contention: 0.0,
            correct_on_feedback: true,
            prefill_progress: true,
            congestion_weight: 1.0,
            eviction_weight: 3.0,
            recent_half_life_s: 60.0,
            recent_epsilon: 0.05,
            session_turns: 0,
            event_grace_ms: 10_000,
            cold_tolerance_ms: 0.0,
            session_ttl_ms: DEFAULT_SESSION_TTL_MS,
            session_home_margin_ms: DEFAULT_SESSION_HOME_MARGIN_MS,
            pause_weight: 0.0,
        }
    }
}
