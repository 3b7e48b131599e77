//! Prefix affinity in flow control's queue: a request waiting there keeps its routing data, so that when its turn
//! comes the dispatcher can ask its policy where its prefix is cached, and let it wait a little longer for that
//! endpoint rather than send it where its prefix is cold.
//!
//! Without this, late binding scatters prefixes under overload: the requests of one prefix that arrive while the
//! first of them still waits all find the prefix nowhere, and each is sent to whichever endpoint frees first. With
//! it, the dispatcher asks the request's policy which endpoint of its pool holds the most of its prompt
//! ([`Policy::most_cached`]: `cache_aware`'s index; the other policies keep none, and their requests never wait)
//! whenever the request is considered for release and has no such endpoint yet (the requests before it may have
//! placed its prefix meanwhile). If that endpoint is saturated, the request lets others pass until it has room. It
//! does so for at most `prefix_wait_ms` from the first time it let another pass, and then only when no other
//! request's turn has come: an endpoint with room takes first a request that prefers it or prefers none, and only
//! then one that has waited long enough elsewhere (its prefix cold there).

use std::cell::Cell;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use dprouter_core::policy::{Candidates, Prepared};
use dprouter_core::{EndpointId, Policy, RouteRequest};

use crate::config::Role;
use crate::fleet::registry::Membership;

/// A queued request's routing data, and the endpoint it waits for.
pub struct Affinity {
    policy: Arc<dyn Policy>,
    route: RouteRequest,
    prepared: Prepared,
    /// The endpoint holding the most of its prompt, once its policy names one.
    endpoint: Cell<Option<EndpointId>>,
    /// When it first let another request pass while its pool had room.
    since: Cell<Option<Instant>>,
}

impl Affinity {
    /// The routing data of `route`, to be routed by `policy`.
    pub fn new(policy: Arc<dyn Policy>, route: RouteRequest) -> Self {
        let prepared = policy.prepare(&route);
        Self {
            policy,
            route,
            prepared,
            endpoint: Cell::new(None),
            since: Cell::new(None),
        }
    }

    /// The request, to be routed for real.
    pub fn into_route(self) -> RouteRequest {
        self.route
    }

    /// Whether its turn has come, given that its pool has room: it has, unless the endpoint holding the most of its
    /// prompt is saturated (from then on it lets the others pass). Its policy is asked until it names such an
    /// endpoint: the requests placed meanwhile may have put its prefix somewhere.
    /// `saturated` says whether the endpoint of a global rank of `membership` is.
    pub(crate) fn turn(
        &self,
        membership: &Membership,
        saturated: &dyn Fn(usize) -> bool,
        model: Option<&str>,
        now: Instant,
    ) -> bool {
        if self.endpoint.get().is_none() {
            self.endpoint.set(self.ask(membership, model));
        }
        let Some(id) = self.endpoint.get() else {
            return true;
        };
        let endpoints = membership.snapshot.endpoints();
        let full = endpoints.iter().position(|e| e.id == id).is_some_and(saturated);
        if full && self.since.get().is_none() {
            self.since.set(Some(now));
        }
        !full
    }

    /// Whether it has let others pass for `wait` already.
    pub(crate) fn waited(&self, now: Instant, wait: Duration) -> bool {
        self.since.get().is_some_and(|since| now >= since + wait)
    }

    /// The endpoint its policy predicts to hold the most of its prompt among the healthy aggregated endpoints
    /// serving `model`, if any holds part of it.
    fn ask(&self, membership: &Membership, model: Option<&str>) -> Option<EndpointId> {
        let pool = |r: usize| {
            let target = &membership.targets[r];
            target.role == Role::Aggregated && model.is_none_or(|m| target.serves(m))
        };
        let snapshot = &membership.snapshot;
        let candidates = Candidates::accepting(snapshot, &pool);
        let (rank, _) = self.policy.most_cached(&candidates, &self.route, &self.prepared)?;
        Some(snapshot.endpoints()[rank].id)
    }
}
