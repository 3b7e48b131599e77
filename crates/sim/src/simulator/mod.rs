//! The virtual-time discrete-event simulator: a workload, routed by a `core` policy (the same code the gateway
//! runs), onto N simulated DP ranks.
//!
//! Each rank has a [`RadixCache`] and the [`CostModel`]'s timing: requests queue for prefill first come first
//! served; at prefill start the rank matches the prompt against its cache and pins the hit; the first token comes
//! `base + uncached / prefill_rate` later, when the prompt is cached; decode follows, and at the end the prompt plus
//! the answer are cached and the pin released. Routing goes through [`dispatch`], as in the gateway: the request's
//! [`Ticket`] holds its in-flight load until it finishes, releases its queued-prefill share
//! ([`Ticket::first_token`]) when prefill completes, and at prefill start tells the policy how much of the prompt
//! the rank really had cached ([`Ticket::usage`]), as an engine's `cached_tokens` would. Every `report_interval` (checked at each arrival)
//! every rank publishes an [`EngineReport`] (running + waiting requests; pinned KV plus queued prompt tokens), as
//! SGLang's schedulers do. Ranks are endpoints `(worker 0, dp_rank)` with the cost model's KV capacity.
//!
//! With [`SimConfig::kv_events`], the ranks' caches also publish their KV events ([`RadixCache::with_events`]),
//! which reach the policy `delay` after the cache changed, followed into its block hashes as the gateway follows an
//! engine's ([`EngineBlocks`]): `cache_aware`'s precise mode.
//!
//! Every arrival is also fed to an [`Oracle`], the hit rate one infinite cache would reach on the same requests,
//! and to a [`PooledCache`], one LRU cache of all the ranks' capacity: the references of the hit-rate ladder.
//! Optionally one rank is removed at a given time ([`RankRemoval`]): marked down in the snapshot, or dropped from it
//! (the remaining endpoints renumbered); the work already queued on it still completes.
//!
//! Under prefill/decode disaggregation ([`simulate_disaggregated`]) the `dp_size` ranks only prefill, and a
//! [`DecodePool`] of ranks on their own servers decodes: each request gets a decode rank from the decode pool's
//! policy at arrival (both legs are sent at once, as SGLang's router does); its prefill rank caches the prompt (never
//! the answer, which only the decode rank sees); the prompt's KV then moves to the decode rank in
//! `kv_transfer_tokens_per_s`, and the first token comes when it is there. Decode ranks never prefill, so nothing
//! stalls their decode (`prefill_stalls_decode` does not apply), and they report their own load to the decode
//! policy.
//!
//! Deterministic: events at equal times run in the order they were scheduled. Cost per request: O(prompt length)
//! for cache matching plus O(log events) for the queue; per report: O(ranks).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use std::sync::Arc;

use dprouter_core::engine_blocks::EngineBlocks;
use dprouter_core::kv_events::KvEvent;
use dprouter_core::{
    dispatch, Branch, Endpoint, EndpointId, EndpointLoad, Policy, RouteRequest, Snapshot, Ticket, Usage,
};

use crate::cost::Micros;
use crate::decode_clock::DecodeClock;
use crate::oracle::{Oracle, PooledCache};
use crate::radix::{LockId, RadixCache};
use crate::shared_prefill::{Due, SharedPrefill};
use crate::tokens;
use crate::workload::{SimRequest, Workload, WorkloadError};

pub use outcome::{RequestRecord, SimOutcome};
pub use settings::{DecodePool, KvEventsConfig, RankRemoval, RemovalMode, SimConfig};

mod outcome;
mod reports;
mod settings;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Removal,
    Arrival(usize),
    /// A prefill may be done (stale unless its number is the one [`SharedPrefill`] last gave it).
    PrefillDue(u64),
    /// Decodes may be complete (stale unless its number is the latest [`Sim::decode_wakeup`]).
    DecodeDue(u64),
    /// A rank's KV events reach the policy (the batch's number in [`Sim::published`]).
    KvEvents(u64),
    /// Under disaggregation: a prompt's KV has reached its decode rank.
    Transferred(usize),
}

struct Live<'a> {
    req: SimRequest,
    open_loop: bool,
    /// The simulated rank (the endpoint's `dp_rank`, whatever its snapshot position).
    rank: usize,
    branch: Branch,
    /// The request's ticket: its load, and the way its feedback reaches the policy.
    ticket: Option<Ticket<&'a dyn Policy>>,
    lock: Option<LockId>,
    cached: usize,
    /// The cached tokens the policy predicted.
    predicted: Option<u64>,
    first_token: Micros,
    /// The service time of its prefill.
    prefill: Micros,
    /// Under disaggregation: its decode rank and the decode leg's ticket.
    decode_rank: usize,
    decode_ticket: Option<Ticket<&'a dyn Policy>>,
}

struct Rank {
    cache: RadixCache,
    /// With KV events: the rank's events followed into the policy's block hashes.
    followed: Option<EngineBlocks>,
    queue: VecDeque<usize>,
    queued_tokens: u64,
    prefilling: Option<usize>,
    decoding: usize,
}

/// A decode rank of a disaggregated run.
#[derive(Default)]
struct DecodeRank {
    /// Requests whose KV is on its way.
    arriving: usize,
    decoding: usize,
    /// The prompt tokens of both: the KV it holds or has reserved.
    held_tokens: u64,
}

/// The decode side of a disaggregated run: one router per gateway replica, and the ranks.
struct Decoders<'a> {
    routers: Vec<Router<'a>>,
    ranks: Vec<DecodeRank>,
}

/// One router (a gateway replica): its policy, and its own view of the ranks' load.
struct Router<'a> {
    policy: &'a dyn Policy,
    snap: Snapshot,
    /// Its load counters per rank (shared with every snapshot's endpoint of that rank): its own requests in flight,
    /// and the engine reports every router receives.
    loads: Vec<Arc<EndpointLoad>>,
}

struct Sim<'a> {
    routers: Vec<Router<'a>>,
    workload: &'a mut dyn Workload,
    config: &'a SimConfig,
    oracle: Oracle,
    pooled: PooledCache,
    ranks: Vec<Rank>,
    live: Vec<Option<Live<'a>>>,
    free: Vec<usize>,
    events: BinaryHeap<Reverse<(Micros, u64, Event)>>,
    seq: u64,
    last_report: Option<Micros>,
    /// When running decodes finish.
    decode: DecodeClock,
    /// When prefills end.
    prefill: SharedPrefill,
    /// The number of the one [`Event::DecodeDue`] that is current; earlier ones are stale.
    decode_wakeup: u64,
    /// KV event batches on their way to the policy: their rank and events, by number.
    published: std::collections::HashMap<u64, (usize, Vec<KvEvent>)>,
    /// Under disaggregation, the decode servers.
    decoders: Option<Decoders<'a>>,
    outcome: SimOutcome,
}

/// Routers over `ranks` endpoints of `worker`, one per policy, each endpoint reporting `kv` tokens of capacity.
fn routers<'a>(policies: &[&'a dyn Policy], worker: u32, ranks: u32, kv: u64) -> Vec<Router<'a>> {
    policies
        .iter()
        .map(|&policy| {
            let snap = Snapshot::new(
                (0..ranks)
                    .map(|r| Endpoint::new(EndpointId::new(worker, r)).with_kv_capacity(kv))
                    .collect(),
            );
            Router {
                policy,
                loads: snap.endpoints().iter().map(|e| Arc::clone(&e.load)).collect(),
                snap,
            }
        })
        .collect()
}

/// Runs `workload` through `policy` until every request has finished. `on_progress` is called with the number of
/// finished requests from time to time.
pub fn simulate(
    policy: &dyn Policy,
    workload: &mut dyn Workload,
    config: &SimConfig,
    on_progress: &mut dyn FnMut(usize),
) -> Result<SimOutcome, WorkloadError> {
    simulate_replicas(&[policy], workload, config, on_progress)
}

/// [`simulate`] with several routers, as gateway replicas behind a load balancer: request `i` goes to router
/// `i mod n`. Each router has its own policy and its own in-flight counts; the ranks' load reports and KV events
/// reach them all.
pub fn simulate_replicas(
    policies: &[&dyn Policy],
    workload: &mut dyn Workload,
    config: &SimConfig,
    on_progress: &mut dyn FnMut(usize),
) -> Result<SimOutcome, WorkloadError> {
    run(policies, None, workload, config, on_progress)
}

/// [`simulate_replicas`] under prefill/decode disaggregation: `prefill[i]` routes router `i`'s requests onto the
/// `dp_size` prefill ranks and `decode.policies[i]` onto the decode ranks.
///
/// # Panics
/// If the two lists differ in length.
pub fn simulate_disaggregated(
    prefill: &[&dyn Policy],
    decode: DecodePool<'_>,
    workload: &mut dyn Workload,
    config: &SimConfig,
    on_progress: &mut dyn FnMut(usize),
) -> Result<SimOutcome, WorkloadError> {
    assert_eq!(prefill.len(), decode.policies.len(), "one decode policy per router");
    run(prefill, Some(decode), workload, config, on_progress)
}

fn run<'a>(
    policies: &[&'a dyn Policy],
    decode: Option<DecodePool<'a>>,
    workload: &'a mut dyn Workload,
    config: &'a SimConfig,
    on_progress: &mut dyn FnMut(usize),
) -> Result<SimOutcome, WorkloadError> {
    let dp = config.dp_size as usize;
    let kv = config.cost.kv_capacity as u64;
    let decoders = decode.map(|pool| Decoders {
        routers: routers(pool.policies, 1, pool.ranks, kv),
        ranks: (0..pool.ranks).map(|_| DecodeRank::default()).collect(),
    });
    let mut sim = Sim {
        routers: routers(policies, 0, config.dp_size, kv),
        workload,
        config,
        oracle: Oracle::default(),
        pooled: PooledCache::new(dp, config.cost.kv_capacity, config.cost.page_size),
        ranks: (0..dp)
            .map(|_| Rank {
                cache: match config.kv_events {
                    Some(_) => RadixCache::with_events(config.cost.kv_capacity, config.cost.page_size),
                    None => RadixCache::new(config.cost.kv_capacity, config.cost.page_size),
                },
                followed: config.kv_events.map(|e| EngineBlocks::new(e.block_tokens, usize::MAX)),
                queue: VecDeque::new(),
                queued_tokens: 0,
                prefilling: None,
                decoding: 0,
            })
            .collect(),
        live: Vec::new(),
        free: Vec::new(),
        events: BinaryHeap::new(),
        seq: 0,
        last_report: None,
        // Decode servers of their own never wait for a prefill.
        decode: DecodeClock::new(config.cost.prefill_stalls_decode && decoders.is_none()),
        prefill: SharedPrefill::new(config.cost.prefill_contention),
        decode_wakeup: 0,
        published: std::collections::HashMap::new(),
        outcome: SimOutcome {
            routed_per_rank: vec![0; dp],
            routed_per_decode_rank: vec![0; decoders.as_ref().map_or(0, |d| d.ranks.len())],
            ..SimOutcome::default()
        },
        decoders,
    };
    if let Some(removal) = config.removal.filter(|r| r.rank < dp) {
        sim.schedule(removal.at, Event::Removal);
        sim.outcome.removal = Some(removal);
    }
    sim.pull_open_loop(0);
    while let Some(Reverse((now, _, event))) = sim.events.pop() {
        match event {
            Event::Removal => sim.remove_rank(),
            Event::Arrival(slot) => sim.arrive(slot, now),
            Event::PrefillDue(version) => {
                if let Some((rank, moved)) = sim.prefill.end(version, now) {
                    sim.schedule_prefills(moved);
                    sim.prefill_done(rank, now);
                }
            }
            Event::DecodeDue(wakeup) if wakeup == sim.decode_wakeup => {
                for slot in sim.decode.take_due(now) {
                    sim.decode_done(slot, now);
                    if sim.outcome.records.len().is_multiple_of(256) {
                        on_progress(sim.outcome.records.len());
                    }
                }
                sim.wake_decode();
            }
            Event::DecodeDue(_) => {}
            Event::KvEvents(batch) => sim.deliver_events(batch, now),
            Event::Transferred(slot) => sim.transferred(slot, now),
        }
    }
    if let Some(err) = sim.workload.take_error() {
        return Err(err);
    }
    on_progress(sim.outcome.records.len());
    let decode_routers = sim.decoders.iter().flat_map(|d| &d.routers);
    let all: Vec<&Router<'_>> = sim.routers.iter().chain(decode_routers).collect();
    let loads = || all.iter().flat_map(|router| &router.loads);
    sim.outcome.in_flight_at_end = loads().map(|l| l.in_flight_requests()).sum();
    sim.outcome.queued_prefill_at_end = loads().map(|l| l.queued_prefill_requests()).sum();
    sim.outcome.oracle_hit_rate = Some(sim.oracle.hit_rate());
    sim.outcome.pooled_hit_rate = Some(sim.pooled.hit_rate());
    Ok(sim.outcome)
}

impl<'a> Sim<'a> {
    fn schedule_prefills(&mut self, due: Vec<Due>) {
        for d in due {
            self.schedule(d.at, Event::PrefillDue(d.version));
        }
    }

    fn schedule(&mut self, at: Micros, event: Event) {
        self.seq += 1;
        self.events.push(Reverse((at, self.seq, event)));
    }

    /// Schedules the next decode completion as the decode clock now predicts it (after any change to it).
    fn wake_decode(&mut self) {
        self.decode_wakeup += 1;
        if let Some(at) = self.decode.next_due() {
            self.schedule(at, Event::DecodeDue(self.decode_wakeup));
        }
    }

    fn admit(&mut self, mut req: SimRequest, open_loop: bool, now: Micros) {
        // A request cannot arrive in the past (an out-of-order trace line arrives now).
        req.arrival = req.arrival.max(now);
        let at = req.arrival;
        let live = Live {
            req,
            open_loop,
            rank: 0,
            branch: Branch::Turn,
            ticket: None,
            lock: None,
            cached: 0,
            predicted: None,
            first_token: 0,
            prefill: 0,
            decode_rank: 0,
            decode_ticket: None,
        };
        let slot = match self.free.pop() {
            Some(slot) => {
                self.live[slot] = Some(live);
                slot
            }
            None => {
                self.live.push(Some(live));
                self.live.len() - 1
            }
        };
        self.schedule(at, Event::Arrival(slot));
    }

    /// Schedules the workload's next open-loop arrival, if any.
    fn pull_open_loop(&mut self, now: Micros) {
        if let Some(req) = self.workload.next_arrival() {
            self.admit(req, true, now);
        }
    }

    fn release(&mut self, slot: usize) -> Option<Live<'a>> {
        let live = self.live.get_mut(slot)?.take();
        self.free.push(slot);
        live
    }

    fn arrive(&mut self, slot: usize, now: Micros) {
        let Some(live) = self.live[slot].as_ref() else { return };
        if live.open_loop {
            self.pull_open_loop(now);
        }
        self.publish_reports(now);
        let Some(live) = self.live[slot].as_mut() else { return };
        let mut full = live.req.tokens.clone();
        full.extend(tokens::output(
            self.config.seed,
            live.req.id,
            live.req.output_tokens as usize,
        ));
        self.oracle.request(&live.req.tokens, &full);
        // Prefill ranks of their own never see the answer.
        let cached = if self.decoders.is_some() {
            &live.req.tokens
        } else {
            &full
        };
        self.pooled.request(&live.req.tokens, cached);
        let mut route_req = RouteRequest::tokens(live.req.tokens.clone())
            .with_bootstrap_room(live.req.bootstrap_room(self.config.seed))
            .at(now);
        if live.req.named_session {
            route_req = route_req.with_session(&live.req.session.to_string());
        }
        let which = (live.req.id % self.routers.len() as u64) as usize;
        let router = &self.routers[which];
        match dispatch(router.policy, &router.snap, route_req) {
            Ok(ticket) => {
                if let Some(decoders) = self.decoders.as_mut() {
                    let router = &decoders.routers[which];
                    let route_req = RouteRequest::tokens(live.req.tokens.clone()).at(now);
                    let Ok(decode) = dispatch(router.policy, &router.snap, route_req) else {
                        self.outcome.errors += 1;
                        self.release(slot);
                        return;
                    };
                    let d = decode.endpoint.dp_rank as usize;
                    decoders.ranks[d].arriving += 1;
                    decoders.ranks[d].held_tokens += live.req.tokens.len() as u64;
                    self.outcome.routed_per_decode_rank[d] += 1;
                    live.decode_rank = d;
                    live.decode_ticket = Some(decode);
                }
                let r = ticket.endpoint.dp_rank as usize;
                live.predicted = ticket
                    .pick
                    .prefill_tokens
                    .map(|prefill| ticket.request().input_tokens.saturating_sub(prefill));
                live.rank = r;
                live.branch = ticket.pick.branch;
                live.ticket = Some(ticket);
                let rank = &mut self.ranks[r];
                rank.queue.push_back(slot);
                rank.queued_tokens += live.req.tokens.len() as u64;
                self.outcome.routed_per_rank[r] += 1;
                if rank.prefilling.is_none() {
                    self.start_prefill(r, now);
                }
            }
            Err(_) => {
                self.outcome.errors += 1;
                self.release(slot);
            }
        }
    }

    fn start_prefill(&mut self, r: usize, now: Micros) {
        let rank = &mut self.ranks[r];
        let Some(slot) = rank.queue.pop_front() else { return };
        let Some(live) = self.live[slot].as_mut() else { return };
        rank.queued_tokens -= live.req.tokens.len() as u64;
        let cached = rank.cache.match_prefix(&live.req.tokens);
        live.lock = Some(rank.cache.lock(&live.req.tokens, cached));
        live.cached = cached;
        // The engine knows what it had cached when it starts the prefill.
        if let Some(ticket) = live.ticket.as_mut() {
            ticket.usage(Usage {
                prompt_tokens: live.req.tokens.len() as u64,
                cached_tokens: cached as u64,
            });
        }
        rank.prefilling = Some(slot);
        live.prefill = self.config.cost.prefill(live.req.tokens.len() - cached);
        let due = self.prefill.start(r, live.prefill, now);
        self.publish_events(r, now);
        self.schedule_prefills(due);
        self.decode.prefill_started(now);
        self.wake_decode();
    }

    fn prefill_done(&mut self, r: usize, now: Micros) {
        let rank = &mut self.ranks[r];
        let Some(slot) = rank.prefilling.take() else { return };
        self.decode.prefill_ended(now);
        if let (Some(live), Some(_)) = (self.live[slot].as_mut(), &self.decoders) {
            // The prefill server keeps the prompt's KV in its cache and sends it to the decode rank.
            rank.cache.insert(&live.req.tokens);
            if let Some(lock) = live.lock.take() {
                rank.cache.unlock(lock);
            }
            if let Some(ticket) = live.ticket.as_mut() {
                ticket.first_token(now);
            }
            let transfer = self.config.cost.transfer(live.req.tokens.len());
            live.prefill += transfer;
            self.schedule(now + transfer, Event::Transferred(slot));
        } else if let Some(live) = self.live[slot].as_mut() {
            live.first_token = now;
            if let Some(ticket) = live.ticket.as_mut() {
                ticket.first_token(now);
            }
            rank.cache.insert(&live.req.tokens);
            let pin = rank.cache.lock(&live.req.tokens, live.req.tokens.len());
            if let Some(old) = live.lock.replace(pin) {
                rank.cache.unlock(old);
            }
            rank.decoding += 1;
            let duration = self.config.cost.decode(live.req.output_tokens, rank.decoding);
            self.decode.start(now, duration, slot);
        }
        self.publish_events(r, now);
        self.wake_decode();
        self.start_prefill(r, now);
    }

    /// A prompt's KV reached its decode rank: the prefill leg is over, the first token goes out and decoding starts.
    fn transferred(&mut self, slot: usize, now: Micros) {
        let (Some(live), Some(decoders)) = (self.live[slot].as_mut(), self.decoders.as_mut()) else {
            return;
        };
        live.first_token = now;
        // Releases the prefill server's in-flight load.
        live.ticket = None;
        if let Some(ticket) = live.decode_ticket.as_mut() {
            ticket.first_token(now);
        }
        let rank = &mut decoders.ranks[live.decode_rank];
        rank.arriving -= 1;
        rank.decoding += 1;
        let duration = self.config.cost.decode(live.req.output_tokens, rank.decoding);
        self.decode.start(now, duration, slot);
        self.wake_decode();
    }

    /// Takes the configured rank out of the snapshot's service; its queued work goes on.
    fn remove_rank(&mut self) {
        let Some(removal) = self.outcome.removal else { return };
        let gone = EndpointId::new(0, removal.rank as u32);
        for router in &mut self.routers {
            router.snap = match removal.mode {
                RemovalMode::Control => return,
                RemovalMode::Drop => Snapshot::new(
                    router
                        .snap
                        .endpoints()
                        .iter()
                        .filter(|e| e.id != gone)
                        .cloned()
                        .collect(),
                ),
                RemovalMode::Down => router.snap.with_health(|_, e| e.healthy && e.id != gone),
            };
        }
    }

    fn decode_done(&mut self, slot: usize, now: Micros) {
        let Some(mut live) = self.release(slot) else { return };
        let output = tokens::output(self.config.seed, live.req.id, live.req.output_tokens as usize);
        if let Some(decoders) = self.decoders.as_mut() {
            // Only the decode rank saw the answer; the prefill rank cached the prompt alone.
            let rank = &mut decoders.ranks[live.decode_rank];
            rank.decoding -= 1;
            rank.held_tokens -= live.req.tokens.len() as u64;
        } else {
            let rank = &mut self.ranks[live.rank];
            rank.decoding -= 1;
            let mut full = live.req.tokens.clone();
            full.extend_from_slice(&output);
            rank.cache.insert(&full);
            if let Some(lock) = live.lock.take() {
                rank.cache.unlock(lock);
            }
            self.publish_events(live.rank, now);
        }
        // Ends the request (both legs under disaggregation), releasing its in-flight load.
        if let Some(ticket) = live.ticket.take() {
            ticket.end(now, live.req.tool_call);
        }
        if let Some(ticket) = live.decode_ticket.take() {
            ticket.end(now, live.req.tool_call);
        }
        self.outcome.records.push(RequestRecord {
            id: live.req.id,
            group: live.req.group,
            session: live.req.session,
            rank: live.rank,
            branch: live.branch,
            arrival: live.req.arrival,
            first_token: live.first_token,
            finish: now,
            prompt_tokens: live.req.tokens.len(),
            cached_tokens: live.cached,
            predicted_cached: live.predicted,
            floor: Some(live.prefill),
        });
        for next in self.workload.on_finish(&live.req, &output, now) {
            self.admit(next, false, now);
        }
    }
}

#[cfg(test)]
mod tests;
