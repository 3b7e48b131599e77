//! What a simulation is given: the engine, the ranks, and what happens to them during the run.

use dprouter_core::Policy;

use crate::cost::{CostModel, Micros};

/// Simulation settings shared by every policy of a run.
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    pub dp_size: u32,
    pub cost: CostModel,
    /// How often ranks publish load reports to the router (SGLang: every ~20 ms).
    pub report_interval: Micros,
    /// Seeds synthetic outputs (must match the workload's seed).
    pub seed: u64,
    /// Take one rank out of service mid-run.
    pub removal: Option<RankRemoval>,
    /// Deliver the ranks' KV cache events to the policy (precise mode).
    pub kv_events: Option<KvEventsConfig>,
}

/// How the ranks' KV events reach the policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvEventsConfig {
    /// From a cache change to the policy: publishing, the network, decoding.
    pub delay: Micros,
    /// The policy's block size, tokens (the events are followed into its block hashes).
    pub block_tokens: usize,
}

/// One rank leaving service at a point in virtual time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankRemoval {
    pub rank: usize,
    pub at: Micros,
    pub mode: RemovalMode,
}

/// How a [`RankRemoval`] takes its rank out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemovalMode {
    /// The snapshot marks the rank down (membership unchanged).
    Down,
    /// The snapshot drops it and the ranks after it move down one position, as when an engine restarts with one
    /// rank fewer.
    Drop,
    /// Nothing is removed: a control run, measuring how often groups change rank anyway (load spills).
    Control,
}

/// The decode servers of a disaggregated run: how many ranks, and each router's policy for them.
#[derive(Clone, Copy)]
pub struct DecodePool<'p> {
    pub ranks: u32,
    /// One per router, beside the prefill policy of the same index.
    pub policies: &'p [&'p dyn Policy],
}
