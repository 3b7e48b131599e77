//! The work started beside the listeners, over the state: health probes and load polls, and found workers
//! joining the fleet.

pub mod health;
pub mod joining;
