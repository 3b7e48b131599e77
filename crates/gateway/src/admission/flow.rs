//! Flow control (`[flow_control]`): while every endpoint a request may use is **saturated**, the request waits in one
//! central queue instead of being pushed onto some rank's own queue, and it is routed when it leaves the queue, with
//! the load of that moment (late binding: a rank whose cache holds its prefix may have freed up by then). The same
//! queue serves `dprouter serve` and `dprouter epp`: [`crate::pipeline::routing::route`] asks [`FlowControl::admit`] before it
//! picks.
//!
//! - **Saturation**, per endpoint ([`FlowControl::saturated`]), from what is known of it without asking: requests
//!   waiting for their first token (its engine's reported queue plus what was sent since, or the gateway's own count)
//!   at `queue_depth_threshold`, its KV cache at `kv_cache_threshold` (when its engine reports usage and capacity),
//!   `max_in_flight_per_endpoint` requests in flight, or a load report older than `staleness_ms` (an engine that
//!   reports and stops is busy or stuck). A request's pool is the healthy endpoints that serve its model, prefill
//!   endpoints aside (under disaggregation its decode endpoints hold it longest); the pool is saturated when all of
//!   them are.
//! - **The queue** ([`dprouter_core::flow_queue`]): bands by priority, strict between bands; flows by fairness id
//!   (a keyed client's name, else the header `x-gateway-inference-fairness-id`, else `default-flow`), taking turns
//!   within a band; first come first served within a flow (among its requests for one pool: a request for a model
//!   whose pool has room passes one whose pool is full). Priority: the request's objective
//!   (`x-gateway-inference-objective`, mapped by `[flow_control.objectives]`), else its client's, else 0.
//! - **Admission**: with none of its pool's requests waiting and the pool not saturated a request goes at once. Otherwise it is refused
//!   at once when its priority is negative (sheddable), when `max_queued_requests` wait already, or when its body
//!   would take the bytes waiting past `max_queued_bytes` (503 with `Retry-After`); else it waits, at most its band's
//!   queue timeout (then a 503). A client that goes away leaves the queue at once (its future is dropped).
//! - **Dispatch**: one task looks at the queue each time something arrives, each time a request let through has
//!   picked its endpoint, and every 10 ms while requests wait; it releases, in service order, the first request whose
//!   pool is not saturated, one at a time, each after the one before has taken its share of the load. A request let
//!   through is routed among the endpoints of its pool with room (all of them when none has).
//! - **Prefix affinity** (`prefix_wait_ms`, [`crate::admission::flow_affinity`]): a request whose policy predicts its prefix
//!   cached at a saturated endpoint waits for that endpoint while others pass it, at most `prefix_wait_ms` from the
//!   first time it let one pass, and even then only when no other request's turn has come.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use dprouter_core::flow_queue::FlowQueue;
use dprouter_core::{EndpointLoad, RouteRequest};
use tokio::sync::{oneshot, watch, Notify};

use crate::admission::clients::Client;
use crate::admission::flow_affinity::Affinity;
use crate::common::error::ApiError;
use crate::config::flow::FlowControlConfig;
use crate::config::Role;
use crate::fleet::registry::{Membership, Registry};
use crate::observe::telemetry;

/// The header that names a request's flow (the Gateway API Inference Extension's).
pub const FAIRNESS_HEADER: &str = "x-gateway-inference-fairness-id";
/// The header that names a request's objective, mapped to its priority.
pub const OBJECTIVE_HEADER: &str = "x-gateway-inference-objective";
/// The flow of a request that names none.
pub const DEFAULT_FLOW: &str = "default-flow";
/// The longest fairness id taken.
const MAX_FLOW_ID_BYTES: usize = 256;
/// Flows with a label of their own in the queue's gauges; later ones share [`OTHER_FLOWS`].
const MAX_FLOW_LABELS: usize = 64;
/// The gauges' label of the flows past [`MAX_FLOW_LABELS`].
const OTHER_FLOWS: &str = "other";
/// While requests wait, the pool is looked at again this often.
const TICK: Duration = Duration::from_millis(10);
/// How long the dispatcher waits for a released request to pick its endpoint before it looks again.
const ACK_WAIT: Duration = Duration::from_millis(100);
/// Why requests are refused or leave the queue, for `dprouter_queue_refusals_total`.
const REASONS: [&str; 5] = ["shed", "queue_full", "queue_bytes", "timeout", "client_gone"];

/// A queued request: how to release it, and what decides whether it may go.
struct Waiter {
    release: oneshot::Sender<Released>,
    model: Option<String>,
    /// Its routing data, when it may wait for the endpoint that holds its prefix ([`crate::admission::flow_affinity`]).
    affinity: Option<Affinity>,
}

/// What a released request gets: its place among the requests let through and not picked yet, and how to say it
/// has picked.
struct Released {
    pending: Pending,
    picked: oneshot::Sender<()>,
    /// Its request, when it came with its routing data.
    route: Option<RouteRequest>,
}

/// One request let through that has not picked its endpoint yet, counted in [`FlowControl::pending`] while it
/// lives (however it ends: picked, refused, or its client gone before it even read its release).
struct Pending(Arc<FlowControl>);

impl Drop for Pending {
    fn drop(&mut self) {
        self.0.pending.fetch_sub(1, Ordering::Relaxed);
        self.0.wake.notify_one();
    }
}

struct Queue {
    entries: FlowQueue<Waiter>,
    /// The flows with a label of their own in the gauges (at most [`MAX_FLOW_LABELS`]).
    flow_labels: BTreeSet<Arc<str>>,
    /// The (band, flow label) series that ever held a request (their gauges go back to 0 when they empty).
    series_seen: BTreeSet<(i32, Arc<str>)>,
}

/// The central queue and its dispatcher's signal.
pub struct FlowControl {
    config: FlowControlConfig,
    /// A load report older than this is stale, microseconds: `staleness_ms`, or more when a poll round can take
    /// longer (the poll interval plus the probe timeout its slowest worker may take).
    stale_after_us: u64,
    queue: Mutex<Queue>,
    wake: Notify,
    /// Requests let through that have not picked their endpoint yet: their load is not on any endpoint, so a
    /// request arriving meanwhile waits its turn rather than pass them on a pool they may saturate.
    pending: AtomicUsize,
}

/// What flow control knows of a request.
/// A request's place in flow control's fairness: its group (a keyed client, or the flow alone) and its flow within
/// the group (an agent program).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlowId {
    pub group: String,
    pub flow: String,
}

impl FlowId {
    /// A flow that is a group of its own.
    pub fn alone(name: impl Into<String>) -> Self {
        let name = name.into();
        Self {
            group: name.clone(),
            flow: name,
        }
    }
}

pub struct Demand<'a> {
    /// The model as the workers know it (`None`: any worker serves it).
    pub model: Option<&'a str>,
    pub priority: i32,
    pub flow: &'a FlowId,
    /// Its body's bytes, held while it waits.
    pub bytes: usize,
    /// Its routing data, for a request that may wait for the endpoint holding its prefix (`prefix_wait_ms`); given
    /// back in [`Admitted::route`].
    pub affinity: Option<Affinity>,
}

/// A request flow control let through. Dropped once the request has its endpoint (or gave up), it tells the
/// dispatcher to look at the pool again.
pub struct Admitted {
    picked: Option<oneshot::Sender<()>>,
    /// Whether it waited in the queue (the membership it was parsed against is then old).
    pub waited: bool,
    /// The request of [`Demand::affinity`], given back.
    pub route: Option<RouteRequest>,
    /// Dropped after the dispatcher is told (fields drop after [`Drop::drop`]).
    _pending: Pending,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        if let Some(picked) = self.picked.take() {
            let _ = picked.send(());
        }
    }
}

impl FlowControl {
    /// Flow control as configured; `None` when it is off. `poll_round_ms`: the longest a round of load polls may
    /// take (0: no polling), under which no report counts as stale.
    pub fn new(config: &FlowControlConfig, poll_round_ms: u64) -> Option<Arc<Self>> {
        if !config.enabled {
            return None;
        }
        Some(Arc::new(Self {
            stale_after_us: config.staleness_ms.max(poll_round_ms).saturating_mul(1000),
            config: config.clone(),
            queue: Mutex::new(Queue {
                entries: FlowQueue::new(),
                flow_labels: BTreeSet::new(),
                series_seen: BTreeSet::new(),
            }),
            wake: Notify::new(),
            pending: AtomicUsize::new(0),
        }))
    }

    /// One more request let through and not picked yet.
    fn pending(self: &Arc<Self>) -> Pending {
        self.pending.fetch_add(1, Ordering::Relaxed);
        Pending(Arc::clone(self))
    }

    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The flow and the priority of a request of `client` (when keyed) with `headers`.
    pub fn classify(
        &self,
        client: Option<&Client>,
        headers: &HeaderMap,
        program: Option<u64>,
    ) -> Result<(FlowId, i32), ApiError> {
        let named = headers.get(OBJECTIVE_HEADER);
        let trusted = client.is_some() || self.config.trust_unkeyed_objectives;
        if named.is_some() && !trusted {
            crate::observe::refusals::refused("unkeyed_objective", || {
                format!("{OBJECTIVE_HEADER} of a request without a key ignored (trust_unkeyed_objectives = false)")
            });
        }
        let objective = named
            .filter(|_| trusted)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .and_then(|name| self.config.objectives.get(name));
        // An objective may lower a keyed client's priority, never raise it past its own.
        let priority = match (client, objective.copied()) {
            (Some(c), Some(o)) => o.min(c.priority),
            (Some(c), None) => c.priority,
            (None, o) => o.unwrap_or(0),
        };
        // One agent program, one flow, however many subagents it runs (its id hashed: it is the client's word).
        let program = program.map(|p| format!("program:{p:016x}"));
        if let Some(client) = client {
            // A keyed client's group is its own (a header cannot put it in another's); its programs share its turns.
            let group = client.name.to_string();
            let flow = program.unwrap_or_else(|| group.clone());
            return Ok((FlowId { group, flow }, priority));
        }
        if let Some(program) = program {
            return Ok((FlowId::alone(program), priority));
        }
        let flow = match headers.get(FAIRNESS_HEADER) {
            None => DEFAULT_FLOW.to_string(),
            Some(v) => {
                let id = v.to_str().map(str::trim).unwrap_or("");
                if id.is_empty() || id.len() > MAX_FLOW_ID_BYTES {
                    return Err(ApiError::BadRequest(format!(
                        "{FAIRNESS_HEADER} must be 1 to {MAX_FLOW_ID_BYTES} bytes of text"
                    )));
                }
                id.to_string()
            }
        };
        Ok((FlowId::alone(flow), priority))
    }

    /// Lets the request go at once, or queues it until its pool has room (see the module documentation).
    pub async fn admit(self: &Arc<Self>, registry: &Registry, demand: Demand<'_>) -> Result<Admitted, ApiError> {
        let (id, released) = {
            let mut queue = self.lock();
            let membership = registry.membership();
            let (some, saturated) = self.pool_saturation(&membership, demand.model);
            let now = crate::common::clock::now_us();
            // Another pool's requests waiting do not hold this one up; its own do (first come first served).
            let same_pool = |w: &Waiter| w.model.as_deref() == demand.model;
            // With an endpoint of its pool saturated, it may want to wait for that one.
            let held = some
                && !saturated
                && demand.affinity.as_ref().is_some_and(|a| {
                    !a.turn(
                        &membership,
                        &|r| self.rank_saturated(&membership, r, now),
                        demand.model,
                        tokio::time::Instant::now(),
                    )
                });
            if !saturated && !held && !queue.entries.any(same_pool) {
                return Ok(Admitted {
                    picked: None,
                    waited: false,
                    route: demand.affinity.map(Affinity::into_route),
                    _pending: self.pending(),
                });
            }
            let refuse = |reason: &'static str, message: String| {
                metrics::counter!(telemetry::QUEUE_REFUSALS, "reason" => reason).increment(1);
                Err(ApiError::Overloaded(message))
            };
            // Not saturated, only behind its pool's requests about to go: it waits a moment, whatever its priority.
            if saturated && demand.priority < 0 {
                return refuse(
                    "shed",
                    format!(
                        "every endpoint this request may use is saturated, and its priority ({}) is sheddable",
                        demand.priority
                    ),
                );
            }
            let c = &self.config;
            if queue.entries.len() >= c.max_queued_requests {
                return refuse(
                    "queue_full",
                    format!(
                        "the gateway is overloaded: its queue is full ({} requests wait already)",
                        c.max_queued_requests
                    ),
                );
            }
            if queue.entries.bytes().saturating_add(demand.bytes) > c.max_queued_bytes {
                return refuse(
                    "queue_bytes",
                    format!(
                        "the gateway is overloaded: the requests waiting hold {} of the {} bytes its queue takes",
                        queue.entries.bytes(),
                        c.max_queued_bytes
                    ),
                );
            }
            let (release, released) = oneshot::channel();
            let waiter = Waiter {
                release,
                model: demand.model.map(str::to_owned),
                affinity: demand.affinity,
            };
            let flow = (demand.flow.group.as_str(), demand.flow.flow.as_str());
            let id = queue.entries.push_in(demand.priority, flow, demand.bytes, waiter);
            publish(&mut queue);
            (id, released)
        };
        self.wake.notify_one();
        let enqueued = Instant::now();
        let mut leave = Leave {
            flow: self,
            id: Some(id),
            reason: "client_gone",
        };
        let timeout_ms = self.config.timeout_ms(demand.priority);
        match tokio::time::timeout(Duration::from_millis(timeout_ms), released).await {
            Ok(Ok(released)) => {
                leave.id = None;
                let band = demand.priority.to_string();
                metrics::histogram!(telemetry::QUEUE_WAIT, "band" => band).record(enqueued.elapsed().as_secs_f64());
                Ok(Admitted {
                    picked: Some(released.picked),
                    waited: true,
                    route: released.route,
                    _pending: released.pending,
                })
            }
            Ok(Err(_)) => {
                leave.id = None;
                Err(ApiError::Overloaded(
                    "flow control stopped before the request left the queue".into(),
                ))
            }
            Err(_) => {
                leave.reason = "timeout";
                Err(ApiError::Overloaded(format!(
                    "the request waited {timeout_ms} ms while every endpoint it may use was saturated"
                )))
            }
        }
    }

    /// Whether every healthy endpoint that serves `model` (prefill endpoints aside) is saturated; not when there is
    /// none (routing then says why).
    pub fn pool_saturated(&self, membership: &Membership, model: Option<&str>) -> bool {
        self.pool_saturation(membership, model).1
    }

    /// Whether some, and whether all, of the healthy endpoints that serve `model` (prefill endpoints aside) are
    /// saturated; neither when there is none.
    fn pool_saturation(&self, membership: &Membership, model: Option<&str>) -> (bool, bool) {
        let now = crate::common::clock::now_us();
        let snapshot = &membership.snapshot;
        let (mut some, mut all, mut any) = (false, true, false);
        for &r in snapshot.healthy() {
            let t = &membership.targets[r];
            if t.role == Role::Prefill || model.is_some_and(|m| !t.serves(m)) {
                continue;
            }
            let full = self.rank_saturated(membership, r, now);
            (some, all, any) = (some || full, all && full, true);
        }
        (some, any && all)
    }

    /// Whether queued requests may wait for the endpoint that holds their prefix (`prefix_wait_ms` above 0).
    pub fn prefix_wait(&self) -> bool {
        self.config.prefix_wait_ms > 0
    }

    /// Whether the endpoint of global rank `rank` in `membership` is saturated at `now_us`.
    pub fn rank_saturated(&self, membership: &Membership, rank: usize, now_us: u64) -> bool {
        let snapshot = &membership.snapshot;
        self.saturated(snapshot.load(rank), snapshot.endpoints()[rank].kv_capacity, now_us)
    }

    /// Whether an endpoint with `load` and `kv_capacity` is saturated at `now_us` (see the module documentation).
    pub fn saturated(&self, load: &EndpointLoad, kv_capacity: Option<u64>, now_us: u64) -> bool {
        let c = &self.config;
        if c.max_in_flight_per_endpoint > 0 && load.in_flight_requests() >= c.max_in_flight_per_endpoint {
            return true;
        }
        if load.queued_prefill_requests() >= c.queue_depth_threshold {
            return true;
        }
        if let (Some(report), Some(capacity)) = (load.last_report(), kv_capacity.filter(|&c| c > 0)) {
            if report.tokens as f64 >= c.kv_cache_threshold * capacity as f64 {
                return true;
            }
        }
        load.reported_at_us()
            .is_some_and(|at| now_us.saturating_sub(at) > self.stale_after_us)
    }

    /// Releases queued requests while their pools have room, one at a time, in service order: the first whose pool
    /// is not saturated (a request whose client went away is taken out at once).
    async fn release_while_room(self: &Arc<Self>, registry: &Registry) {
        loop {
            let membership = registry.membership();
            let (waiter, released, was_picked) = {
                let mut queue = self.lock();
                let now = tokio::time::Instant::now();
                let prefix_wait = Duration::from_millis(self.config.prefix_wait_ms);
                let room = |w: &Waiter| !self.pool_saturated(&membership, w.model.as_deref());
                let now_us = crate::common::clock::now_us();
                let full = |r: usize| self.rank_saturated(&membership, r, now_us);
                // Its turn: its pool has room, and so has the endpoint it waits for, if it waits for one.
                let its_turn = |w: &Waiter| {
                    w.release.is_closed()
                        || (room(w)
                            && w.affinity
                                .as_ref()
                                .is_none_or(|a| a.turn(&membership, &full, w.model.as_deref(), now)))
                };
                // With nobody's turn, the first that has let others pass for `prefix_wait` takes an endpoint with
                // room (its prefix cold there).
                let waited_enough =
                    |w: &Waiter| room(w) && w.affinity.as_ref().is_some_and(|a| a.waited(now, prefix_wait));
                let popped = match queue.entries.pop_first(its_turn) {
                    Some(popped) => Some(popped),
                    None => queue.entries.pop_first(waited_enough),
                };
                let Some((_, mut waiter)) = popped else {
                    return;
                };
                publish(&mut queue);
                // Counted pending before the lock is let go: no request arriving meanwhile misses it.
                let (picked, was_picked) = oneshot::channel();
                let released = Released {
                    pending: self.pending(),
                    picked,
                    route: waiter.affinity.take().map(Affinity::into_route),
                };
                (waiter, released, was_picked)
            };
            // Its client gone, the release is dropped here, and with it its place among the pending.
            if waiter.release.send(released).is_ok() {
                let _ = tokio::time::timeout(ACK_WAIT, was_picked).await;
            }
        }
    }
}

/// A queued request's place, given up if the request leaves without being released (its client went away, or its
/// deadline passed).
struct Leave<'a> {
    flow: &'a FlowControl,
    id: Option<u64>,
    reason: &'static str,
}

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        let Some(id) = self.id else { return };
        let mut queue = self.flow.lock();
        if queue.entries.remove(id).is_some() {
            metrics::counter!(telemetry::QUEUE_REFUSALS, "reason" => self.reason).increment(1);
            publish(&mut queue);
        }
    }
}

/// The queue's gauges, per band and flow: a flow by its id while fewer than [`MAX_FLOW_LABELS`] ids have been
/// seen, the later ones together as `other` (ids come from clients' headers: their number has no bound).
fn publish(queue: &mut Queue) {
    let mut sizes: BTreeMap<(i32, Arc<str>), (usize, usize)> = BTreeMap::new();
    for f in queue.entries.flows() {
        let label = match queue.flow_labels.contains(&f.flow) || queue.flow_labels.len() < MAX_FLOW_LABELS {
            true => {
                queue.flow_labels.insert(Arc::clone(&f.flow));
                f.flow
            }
            false => Arc::from(OTHER_FLOWS),
        };
        let size = sizes.entry((f.priority, label)).or_default();
        *size = (size.0 + f.requests, size.1 + f.bytes);
    }
    queue.series_seen.extend(sizes.keys().cloned());
    for key in &queue.series_seen {
        let (requests, bytes) = sizes.get(key).copied().unwrap_or_default();
        let labels = [("band", key.0.to_string()), ("flow", key.1.to_string())];
        metrics::gauge!(telemetry::QUEUE_REQUESTS, &labels).set(requests as f64);
        metrics::gauge!(telemetry::QUEUE_BYTES, &labels).set(bytes as f64);
    }
}

/// The dispatcher: releases queued requests as their pools free up, until `stop`. The refusal counters are defined
/// from its start, so their rates are.
pub async fn dispatch(flow: Arc<FlowControl>, registry: Arc<Registry>, mut stop: watch::Receiver<bool>) {
    for reason in REASONS {
        metrics::counter!(telemetry::QUEUE_REFUSALS, "reason" => reason).increment(0);
    }
    loop {
        let waiting = !flow.lock().entries.is_empty();
        tokio::select! {
            biased;
            _ = stop.wait_for(|s| *s) => return,
            () = flow.wake.notified() => {}
            () = tokio::time::sleep(TICK), if waiting => {}
        }
        flow.release_while_room(&registry).await;
    }
}

#[cfg(test)]
#[path = "flow_tests.rs"]
mod tests;
