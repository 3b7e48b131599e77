//! Prefill/decode disaggregation beside the aggregated path: a pair's two legs under `serve`, and the decode
//! sidecar that runs them for a picker; one prefill-leg runner for both.

pub mod legs;
pub(crate) mod prefill_leg;
pub mod sidecar;
mod sidecar_leg;
pub mod trust;
