//! `follow_bootstrap_room`: PD-disaggregation prefill routing.
//!
//! The rank is `bootstrap_room % dp_size` (over all ranks, so prefill and decode agree). A request without a room
//! is an error, and so is a room whose rank is down: sending it elsewhere would break the KV transfer pairing.
//! O(1) per request.

use crate::error::RouteError;
use crate::policy::{Branch, Candidates, Pick, Policy, Prepared};
use crate::request::RouteRequest;

#[derive(Debug, Default)]
pub struct FollowBootstrapRoom;

impl Policy for FollowBootstrapRoom {
    fn name(&self) -> &'static str {
        "follow_bootstrap_room"
    }

    fn choose(
        &self,
        candidates: &Candidates<'_>,
        req: &RouteRequest,
        _prepared: &Prepared,
    ) -> Result<Pick, RouteError> {
        let room = req.bootstrap_room.ok_or(RouteError::MissingBootstrapRoom)?;
        let rank = (room % candidates.snap().len() as u64) as usize;
        if !candidates.contains(rank) {
            return Err(RouteError::BootstrapRankDown { room, rank });
        }
        Ok(Pick::new(rank, Branch::Hashed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::Snapshot;
    use crate::policy::route;

    #[test]
    fn room_modulo_dp_size() {
        let snap = Snapshot::single_worker(4);
        for (room, rank) in [(0, 0), (1, 1), (4, 0), (5, 1), (100, 0), (101, 1)] {
            let req = RouteRequest::text("p").with_bootstrap_room(room);
            assert_eq!(
                route(&FollowBootstrapRoom, &snap, &req).unwrap(),
                Pick::new(rank, Branch::Hashed)
            );
        }
    }

    #[test]
    fn missing_room_is_an_error_and_override_still_wins() {
        let snap = Snapshot::single_worker(4);
        let req = RouteRequest::text("p");
        assert_eq!(
            route(&FollowBootstrapRoom, &snap, &req),
            Err(RouteError::MissingBootstrapRoom)
        );
        let pinned = req.with_override(2);
        assert_eq!(route(&FollowBootstrapRoom, &snap, &pinned).unwrap().rank, 2);
    }

    #[test]
    fn room_naming_a_down_rank_is_an_error() {
        let snap = Snapshot::single_worker(4).with_health(|i, _| i != 1);
        let req = RouteRequest::text("p").with_bootstrap_room(5);
        assert_eq!(
            route(&FollowBootstrapRoom, &snap, &req),
            Err(RouteError::BootstrapRankDown { room: 5, rank: 1 })
        );
    }
}
