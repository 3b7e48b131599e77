//! The HTTP plumbing both listeners run on: the listener (connections, limits, timeouts, drain), TLS, the
//! `max_in_flight` gate, and the JSON bodies of the answers hyper writes itself.

pub mod in_flight;
pub mod listener;
pub mod parse_errors;
pub mod tls;
