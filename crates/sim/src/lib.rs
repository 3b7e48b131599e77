//! dprouter's engine simulator: DP ranks with radix caches and a cost model, run in virtual time.
//!
//! The same [`dprouter_core`] policies the gateway runs route a [`workload::Workload`] onto simulated ranks
//! ([`simulator::simulate`]); [`report::Summary`] condenses the outcome per policy. No I/O except reading traces.

pub mod cost;
pub mod decode_clock;
pub mod oracle;
pub mod radix;
pub mod report;
pub mod shared_prefill;
pub mod simulator;
pub mod tokens;
pub mod workload;

pub use cost::{CostModel, Micros};
pub use oracle::Oracle;
pub use report::Summary;
pub use simulator::{
    simulate, simulate_disaggregated, simulate_replicas, DecodePool, KvEventsConfig, RankRemoval, RemovalMode,
    RequestRecord, SimConfig, SimOutcome,
};
pub use workload::{SimRequest, Workload, WorkloadError, WorkloadSpec};
