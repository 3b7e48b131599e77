//! Prefill/decode disaggregation beside the aggregated path: a pair's two legs under `serve`, and the decode
//! sidecar that runs them for a picker.

pub mod legs;
pub mod sidecar;
mod sidecar_leg;
pub mod trust;
