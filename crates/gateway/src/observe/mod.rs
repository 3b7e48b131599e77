//! What the gateway tells about itself: metric names and the Prometheus recorder, untrusted input refused,
//! trace context and spans, and the access log's record of each answer.

pub mod access;
pub mod refusals;
pub mod spans;
pub mod telemetry;
pub mod trace_context;
