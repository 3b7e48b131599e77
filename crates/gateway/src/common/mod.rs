//! Shared names and plain values, importing nothing of the crate: the API's errors and their JSON bodies,
//! the clock, header names and head limits, the runtime both front doors run on, throttled logs, the drain
//! deadline, and the store of Responses ids (a store the state holds).

pub mod clock;
pub mod drain_deadline;
pub mod error;
pub mod error_shape;
pub mod names;
pub mod response_homes;
pub mod runtime;
pub mod throttled;
