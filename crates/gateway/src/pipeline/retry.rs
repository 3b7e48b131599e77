//! The one way a request is tried again after a refused connection, for the aggregated path and either leg of a
//! pair: only a connection that was never made (the engine never got the request), never a request pinned to its
//! rank, at most `retries` times, before any byte reached the client. A refused connection means the whole worker
//! is down: the next try skips all its endpoints, and the policy forgets that the prompt went there
//! (`Ticket::reroute`).

use dprouter_core::{Branch, RouteError, WorkerId};

use crate::fleet::registry::{Membership, Target};
use crate::observe::telemetry;
use crate::pipeline::body::GatewayTicket;
use crate::state::AppState;

/// The workers a request's connections were refused by, in order.
#[derive(Debug, Default)]
pub struct Refused {
    workers: Vec<WorkerId>,
}

impl Refused {
    /// Tries made elsewhere so far (the next attempt's number is this plus one).
    pub fn count(&self) -> usize {
        self.workers.len()
    }

    /// A connection to `worker` was refused for a request picked by `branch`: whether it may be tried elsewhere.
    /// If so, the retry is counted (`dprouter_retries_total`) and the worker skipped from now on.
    pub fn may_retry(&mut self, state: &AppState, worker: WorkerId, branch: Branch) -> bool {
        let allowed = branch != Branch::Override && self.workers.len() < state.config.retries as usize;
        if allowed {
            metrics::counter!(telemetry::RETRIES).increment(1);
            self.workers.push(worker);
        }
        allowed
    }

    /// `ticket` routed again by its policy among the endpoints `eligible` (by role, model) of the workers not
    /// refused; the decision counted.
    pub fn reroute(
        &self,
        state: &AppState,
        membership: &Membership,
        ticket: GatewayTicket,
        eligible: impl Fn(&Target, usize) -> bool,
    ) -> Result<GatewayTicket, RouteError> {
        let accept = |rank: usize| {
            let target = &membership.targets[rank];
            !self.workers.contains(&target.id.worker) && eligible(target, rank)
        };
        let ticket = ticket.reroute(&membership.snapshot, &accept, crate::common::clock::now_us())?;
        crate::pipeline::routing::count_decision(state, ticket.pick.branch);
        Ok(ticket)
    }
}
