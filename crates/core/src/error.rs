//! Why a request could not be routed.

use thiserror::Error;

/// A routing failure. Front ends map [`RouteError::is_client_error`] to 400 and the rest to 503.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum RouteError {
    #[error("no healthy endpoint is available")]
    NoHealthyEndpoint,
    #[error("DP rank {rank} is out of range: there are {size} ranks (0..{size})")]
    OverrideOutOfRange { rank: i64, size: usize },
    #[error("DP rank {rank} is not active (the endpoint is down)")]
    OverrideDown { rank: usize },
    #[error("follow_bootstrap_room needs a request with `bootstrap_room`")]
    MissingBootstrapRoom,
    #[error("DP rank {rank} named by bootstrap_room {room} is not active (the endpoint is down)")]
    BootstrapRankDown { room: u64, rank: usize },
}

impl RouteError {
    /// True when the request itself is at fault (HTTP 400); false when the fleet cannot serve it now (503).
    pub fn is_client_error(&self) -> bool {
        matches!(
            self,
            RouteError::OverrideOutOfRange { .. } | RouteError::OverrideDown { .. } | RouteError::MissingBootstrapRoom
        )
    }
}
