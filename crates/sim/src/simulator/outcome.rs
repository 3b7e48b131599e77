//! What a simulation gives back: a record per request, and the run's totals.

use dprouter_core::Branch;

use crate::cost::Micros;
use crate::simulator::RankRemoval;

/// What happened to one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestRecord {
    pub id: u64,
    pub group: u64,
    pub session: u64,
    pub rank: usize,
    pub branch: Branch,
    pub arrival: Micros,
    pub first_token: Micros,
    pub finish: Micros,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    /// The cached tokens the policy predicted, if it predicts.
    pub predicted_cached: Option<u64>,
    /// Its queue-free floor: the TTFT it would have had with no queueing, given the cache hit it got (the prefill
    /// of its uncached tokens alone); `None` where nobody knows the engine's costs (a run over HTTP).
    pub floor: Option<Micros>,
}

impl RequestRecord {
    pub fn ttft(&self) -> Micros {
        self.first_token - self.arrival
    }
}

/// The result of one simulation.
#[derive(Debug, Clone, Default)]
pub struct SimOutcome {
    /// Completed requests, in completion order.
    pub records: Vec<RequestRecord>,
    /// Requests the policy could not route.
    pub errors: u64,
    /// Requests routed to each rank.
    pub routed_per_rank: Vec<u64>,
    /// In-flight requests the load table still counts after the run: 0 unless a guard leaked.
    pub in_flight_at_end: u64,
    /// Queued-prefill requests the load table still counts after the run: 0 unless a first token was lost.
    pub queued_prefill_at_end: u64,
    /// Hit rate of one infinite cache fed the same requests in arrival order (see [`Oracle`]); `None` when the run
    /// did not compute it (a run over HTTP).
    pub oracle_hit_rate: Option<f64>,
    /// Hit rate of one LRU cache of all the ranks' capacity fed the same requests in arrival order (see
    /// [`PooledCache`]); `None` when the run did not compute it.
    pub pooled_hit_rate: Option<f64>,
    /// The removal applied during the run, if any.
    pub removal: Option<RankRemoval>,
    /// Under disaggregation: requests routed to each decode rank (empty otherwise).
    pub routed_per_decode_rank: Vec<u64>,
}
