//! The ticket of one routed request: the only way feedback about it reaches the policy.
//!
//! [`dispatch`] prepares the request once ([`Policy::prepare`]: `cache_aware` hashes the prompt's blocks there and
//! nowhere else), decides, and takes the request's share of the endpoint's load. The [`Ticket`] it returns owns
//! all of that until the request ends: the front end tells it when the first token came ([`Ticket::first_token`]),
//! what the engine reported ([`Ticket::usage`]), or that the endpoint never got the request
//! ([`Ticket::reroute`]); dropping it ends the request ([`Policy::release`]) and releases its load. The gateway, the simulator and the
//! bench client all hold one ticket per request, so a policy learns the same things in the same order from each.

use std::sync::Arc;

use crate::endpoint::{EndpointId, Snapshot};
use crate::error::RouteError;
use crate::load::LoadGuard;
use crate::policy::{decide, Branch, Candidates, Ending, Pick, Policy, Prepared};
use crate::request::RouteRequest;
use crate::usage::Usage;

/// How a ticket reaches its policy: a reference (the simulator, tools) or a shared pointer (the gateway, whose
/// tickets outlive the handler that routed them).
pub trait PolicyRef: Clone {
    fn policy(&self) -> &dyn Policy;
}

impl<T: Policy> PolicyRef for &T {
    fn policy(&self) -> &dyn Policy {
        *self
    }
}

impl PolicyRef for &dyn Policy {
    fn policy(&self) -> &dyn Policy {
        *self
    }
}

impl PolicyRef for Arc<dyn Policy> {
    fn policy(&self) -> &dyn Policy {
        self.as_ref()
    }
}

/// A routed request, holding its share of the endpoint's load until dropped.
#[must_use = "dropping the ticket ends the request at once"]
pub struct Ticket<P: PolicyRef> {
    /// The decision.
    pub pick: Pick,
    /// The endpoint `pick.rank` named in the snapshot it was made with.
    pub endpoint: EndpointId,
    policy: P,
    guard: LoadGuard,
    req: RouteRequest,
    prepared: Prepared,
    reported: bool,
    /// Rerouted: the policy was told by `retract`, not `release`.
    retracted: bool,
    /// Its service time, from its first token, until the engine's usage report completes the cost sample.
    service_us: Option<u64>,
    /// Its uncached prompt tokens, from the engine's usage report, until the first token completes the sample.
    uncached: Option<u64>,
    /// How it ended, once [`Ticket::end`] said.
    ending: Ending,
}

impl<P: PolicyRef> std::fmt::Debug for Ticket<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket")
            .field("policy", &self.policy.policy().name())
            .field("pick", &self.pick)
            .field("endpoint", &self.endpoint)
            .field("reported", &self.reported)
            .finish_non_exhaustive()
    }
}

/// Routes `req` among the healthy endpoints of `snap`: the client's override if it gave one, otherwise the
/// policy's choice. The ticket counts the request in flight at the endpoint (speculatively too, unless
/// overridden) and its predicted uncached tokens (the whole prompt without a prediction) as queued prefill, at the
/// request's `now_us`.
pub fn dispatch<P: PolicyRef>(policy: P, snap: &Snapshot, req: RouteRequest) -> Result<Ticket<P>, RouteError> {
    let prepared = policy.policy().prepare(&req);
    issue(policy, &Candidates::all(snap), req, prepared)
}

/// [`dispatch`] among the healthy endpoints of `snap` that `accept` lets through (those serving the request's
/// model, say). A client's rank override is checked against the snapshot alone.
pub fn dispatch_among<P: PolicyRef>(
    policy: P,
    snap: &Snapshot,
    accept: &dyn Fn(usize) -> bool,
    req: RouteRequest,
) -> Result<Ticket<P>, RouteError> {
    let prepared = policy.policy().prepare(&req);
    issue(policy, &Candidates::accepting(snap, accept), req, prepared)
}

fn issue<P: PolicyRef>(
    policy: P,
    candidates: &Candidates<'_>,
    req: RouteRequest,
    prepared: Prepared,
) -> Result<Ticket<P>, RouteError> {
    let pick = decide(policy.policy(), candidates, &req, &prepared)?;
    let endpoint = &candidates.snap().endpoints()[pick.rank];
    let guard = LoadGuard::acquire_with_prefill(
        Arc::clone(&endpoint.load),
        req.input_tokens,
        pick.prefill_tokens.unwrap_or(req.input_tokens),
        pick.branch != Branch::Override,
        req.now_us,
    );
    Ok(Ticket {
        pick,
        endpoint: endpoint.id,
        policy,
        guard,
        req,
        prepared,
        reported: false,
        retracted: false,
        service_us: None,
        uncached: None,
        ending: Ending::default(),
    })
}

impl<P: PolicyRef> Ticket<P> {
    /// The request as it was routed.
    pub fn request(&self) -> &RouteRequest {
        &self.req
    }

    /// The first token arrived at `now_us` (the request's clock): the request's queued-prefill share is released
    /// and the endpoint's next queued request begins its prefill. Only the first call has an effect. With the
    /// engine's usage report, its service time is a sample of the endpoint's prefill costs
    /// ([`crate::cost_fit`]).
    pub fn first_token(&mut self, now_us: u64) {
        if let Some(service) = self.guard.first_token(now_us) {
            self.service_us = Some(service);
            self.sample_costs();
        }
    }

    /// The first byte of an answer sent whole (not streamed) arrived at `now_us`: as [`Ticket::first_token`], the
    /// queued-prefill share is released (the prefill is long over), but the time includes the answer's whole
    /// decode, so it is no sample of the prefill costs (a fit fed such times learns each answer's length as
    /// prefill).
    pub fn whole_answer(&mut self, now_us: u64) {
        self.guard.first_token(now_us);
    }

    /// Feeds the endpoint's cost fit once both halves of the sample are known.
    fn sample_costs(&mut self) {
        if let (Some(service), Some(uncached)) = (self.service_us, self.uncached) {
            self.guard.load().observe_prefill(uncached, service);
            self.service_us = None;
        }
    }

    /// The engine's usage report: the policy learns how much of the prompt the endpoint had cached. Only the first
    /// report of a request counts; returns whether this one did.
    pub fn usage(&mut self, usage: Usage) -> bool {
        if std::mem::replace(&mut self.reported, true) {
            return false;
        }
        self.uncached = Some(usage.prompt_tokens.saturating_sub(usage.cached_tokens));
        self.sample_costs();
        self.policy.policy().observe(
            self.endpoint,
            &self.req,
            &self.prepared,
            &self.pick,
            usage.cached_tokens,
        );
        true
    }

    /// The answer ended whole at `now_us`, on tool calls or not ([`crate::tool_calls`]): the request ends, and the
    /// policy hears how. (Dropping a ticket without this ends it unanswered.)
    pub fn end(mut self, now_us: u64, tool_call: bool) {
        self.ending = Ending {
            answered: true,
            tool_call,
            now_us,
        };
    }

    /// The endpoint never got the request (its connection was refused): the policy forgets that it went there,
    /// its load is released, and the request is routed again at `now_us` among the healthy endpoints of `snap` that
    /// `accept` lets through. A client's rank override names the same rank again.
    pub fn reroute(mut self, snap: &Snapshot, accept: &dyn Fn(usize) -> bool, now_us: u64) -> Result<Self, RouteError> {
        self.policy
            .policy()
            .retract(self.endpoint, &self.req, &self.prepared, &self.pick);
        self.retracted = true;
        let policy = self.policy.clone();
        let mut req = std::mem::replace(&mut self.req, RouteRequest::tokens(Vec::new()));
        let prepared = std::mem::take(&mut self.prepared);
        // Releases the load at the endpoint that never got the request.
        drop(self);
        req.now_us = now_us;
        issue(policy, &Candidates::accepting(snap, accept), req, prepared)
    }
}

impl<P: PolicyRef> Drop for Ticket<P> {
    /// The request ended, however it ended: the policy hears of it unless it was rerouted (then it heard
    /// `retract`); the load guard, dropped after this, releases the endpoint's load.
    fn drop(&mut self) {
        if !self.retracted {
            self.policy
                .policy()
                .release(self.endpoint, &self.req, &self.prepared, &self.pick, self.ending);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::PolicyConfig;
    use crate::policy::{Candidates, RoundRobin};
    use std::sync::Mutex;

    /// Records every hook it gets, choosing the first candidate.
    #[derive(Default)]
    struct Recorder {
        calls: Mutex<Vec<String>>,
    }

    impl Policy for Recorder {
        fn name(&self) -> &'static str {
            "recorder"
        }

        fn prepare(&self, req: &RouteRequest) -> Prepared {
            self.calls.lock().unwrap().push("prepare".into());
            Prepared {
                block_hashes: vec![req.input_tokens],
            }
        }

        fn choose(&self, c: &Candidates<'_>, _req: &RouteRequest, prepared: &Prepared) -> Result<Pick, RouteError> {
            let rank = c.iter().next().ok_or(RouteError::NoHealthyEndpoint)?;
            self.calls
                .lock()
                .unwrap()
                .push(format!("choose {rank} {:?}", prepared.block_hashes));
            Ok(Pick::new(rank, Branch::Turn).with_prefill(1))
        }

        fn observe(&self, e: EndpointId, _req: &RouteRequest, prepared: &Prepared, _pick: &Pick, cached: u64) {
            self.calls
                .lock()
                .unwrap()
                .push(format!("observe {e} {cached} {:?}", prepared.block_hashes));
        }

        fn retract(&self, e: EndpointId, _req: &RouteRequest, _prepared: &Prepared, _pick: &Pick) {
            self.calls.lock().unwrap().push(format!("retract {e}"));
        }

        fn release(&self, e: EndpointId, _req: &RouteRequest, _prepared: &Prepared, _pick: &Pick, end: Ending) {
            self.calls
                .lock()
                .unwrap()
                .push(format!("release {e} {}", end.tool_call));
        }
    }

    fn usage(cached_tokens: u64) -> Usage {
        Usage {
            prompt_tokens: 3,
            cached_tokens,
        }
    }

    #[test]
    fn a_ticket_prepares_once_and_reports_once() {
        let policy = Recorder::default();
        let snap = Snapshot::single_worker(3);
        let ticket = dispatch(&policy, &snap, RouteRequest::tokens(vec![1, 2, 3])).unwrap();
        assert_eq!(snap.load(0).in_flight_requests(), 1);
        // The worker of rank 0 refused the connection: the retry refuses rank 0 and keeps the prepared hashes.
        let mut ticket = ticket.reroute(&snap, &|r| r != 0, 7).unwrap();
        assert_eq!(ticket.pick.rank, 1);
        assert_eq!(ticket.request().now_us, 7);
        assert_eq!(
            snap.load(0).in_flight_requests(),
            0,
            "the failed endpoint's load is released"
        );
        assert_eq!(snap.load(0).queued_prefill_requests(), 0);
        assert_eq!(snap.load(1).queued_prefill_requests(), 1);
        ticket.first_token(8);
        assert_eq!(snap.load(1).queued_prefill_requests(), 0);
        assert!(ticket.usage(usage(2)));
        assert!(!ticket.usage(usage(3)), "one report per request");
        ticket.end(9, true);
        assert_eq!(snap.load(1).in_flight_requests(), 0);
        assert_eq!(
            *policy.calls.lock().unwrap(),
            [
                "prepare",
                "choose 0 [3]",
                "retract w0r0",
                "choose 1 [3]",
                "observe w0r1 2 [3]",
                "release w0r1 true"
            ]
        );
    }

    #[test]
    fn a_streamed_first_token_samples_the_prefill_costs_and_a_whole_answer_does_not() {
        let snap = Snapshot::single_worker(1);
        let policy = RoundRobin::default();
        let mut streamed = dispatch(&policy, &snap, RouteRequest::tokens(vec![1, 2, 3]).at(0)).unwrap();
        streamed.first_token(500);
        streamed.usage(usage(1));
        assert_eq!(snap.load(0).cost_samples(), 1);
        let mut whole = dispatch(&policy, &snap, RouteRequest::tokens(vec![1, 2, 3]).at(1_000)).unwrap();
        whole.whole_answer(9_000);
        assert_eq!(
            snap.load(0).queued_prefill_requests(),
            0,
            "the queued share is released"
        );
        whole.usage(usage(1));
        assert_eq!(
            snap.load(0).cost_samples(),
            1,
            "a whole answer's time is no prefill sample"
        );
    }

    #[test]
    fn a_reroute_with_no_candidate_left_is_an_error_and_releases_the_load() {
        let snap = Snapshot::single_worker(2);
        let policy = RoundRobin::default();
        let ticket = dispatch(&policy, &snap, RouteRequest::text("x")).unwrap();
        assert_eq!(
            ticket.reroute(&snap, &|_| false, 0).unwrap_err(),
            RouteError::NoHealthyEndpoint
        );
        assert_eq!(snap.load(0).in_flight_requests() + snap.load(1).in_flight_requests(), 0);
    }

    #[test]
    fn tickets_work_through_every_kind_of_policy_reference() {
        let snap = Snapshot::single_worker(2);
        let shared: Arc<dyn Policy> = Arc::from(PolicyConfig::from_name("cache_aware").unwrap().build());
        let borrowed: &dyn Policy = shared.as_ref();
        let concrete = RoundRobin::default();
        let a = dispatch(Arc::clone(&shared), &snap, RouteRequest::text("hello")).unwrap();
        let b = dispatch(borrowed, &snap, RouteRequest::text("hello")).unwrap();
        let c = dispatch(&concrete, &snap, RouteRequest::text("hello")).unwrap();
        let in_flight = |r| snap.load(r).in_flight_requests();
        assert_eq!(in_flight(0) + in_flight(1), 3);
        drop((a, b, c));
        assert_eq!(in_flight(0) + in_flight(1), 0);
    }
}
