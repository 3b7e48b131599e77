//! The fleet: workers and their endpoints (the registry: membership, health, load), the client towards the
//! engines, and the policies by model.

pub mod policies;
pub mod registry;
pub mod upstream;
pub mod worker_state;
