//! What the registry ([`crate::fleet::registry`]) keeps per worker and per endpoint to decide health: a worker's
//! probe record and description, an endpoint's load and outlier record (its failures in a row, its ejections, its
//! recent failure rate), and what a failure counts as.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use dprouter_core::{EndpointId, EndpointLoad, WorkerId};

use crate::config::{Backend, RankField, Role, WorkerConfig, WorkerEvents};
use crate::fleet::upstream::WorkerInfo;

/// One endpoint's outlier-detection state.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Outlier {
    /// Failures in a row.
    pub(super) consecutive: u32,
    /// Ejections in a row: the back-off exponent, decaying while the endpoint stays routable.
    pub(super) ejections: u32,
    pub(super) ejected_until: Option<Instant>,
    /// When `ejections` last changed.
    pub(super) since: Option<Instant>,
    /// Recent share of failed requests: an exponentially weighted average over about the last
    /// `1 / FAILURE_RATE_WEIGHT` requests.
    pub(super) failure_rate: f64,
}

/// The weight of one request in an endpoint's recent failure rate (about the last 50 requests count).
pub(super) const FAILURE_RATE_WEIGHT: f64 = 0.02;

/// A recent failure rate below this is no failure at all: the endpoint is clean again, and its successes are
/// recorded with one atomic read (about 350 successes after a single failure).
pub(super) const CLEAN_RATE: f64 = 1e-3;

/// An endpoint is an outlier, and may be ejected, only while its recent failure rate is above twice the median of
/// the other routable endpoints' plus this margin: failures that most endpoints see alike (a bad request mix, an
/// upstream dependency, faults spread evenly) are not an endpoint's, and ejecting would only cut capacity.
pub(super) const OUTLIER_MARGIN: f64 = 0.05;

impl Outlier {
    pub(super) fn observe(&mut self, failed: bool) {
        self.failure_rate += FAILURE_RATE_WEIGHT * (f64::from(u8::from(failed)) - self.failure_rate);
    }
}

#[derive(Debug)]
pub struct EndpointState {
    pub id: EndpointId,
    pub load: Arc<EndpointLoad>,
    pub(super) outlier: Mutex<Outlier>,
    /// No failure in its recent record: a success changes nothing and takes no lock.
    pub(super) clean: AtomicBool,
    /// When it last answered a request successfully ([`crate::common::clock::now_us`]; 0: never).
    pub(super) last_answer_us: AtomicU64,
}

impl EndpointState {
    pub(super) fn new(id: EndpointId) -> Self {
        Self {
            id,
            load: Arc::new(EndpointLoad::default()),
            outlier: Mutex::new(Outlier::default()),
            clean: AtomicBool::new(true),
            last_answer_us: AtomicU64::new(0),
        }
    }

    /// Its engine came back after being down (a restart, most often): back in good standing (no ejection, no
    /// failures on record), and the prefill costs learned before are forgotten (it may run another model, on
    /// another GPU, now).
    pub(super) fn restarted(&self) {
        *self.outlier() = Outlier::default();
        self.clean.store(true, Relaxed);
        self.load.reset_costs();
    }

    /// A successful answer: the endpoint's run of failures ends and its recent failure rate decays.
    pub fn record_success(&self) {
        self.last_answer_us
            .store(crate::common::clock::now_us().max(1), Relaxed);
        if self.clean.load(Relaxed) {
            return;
        }
        let mut o = self.outlier();
        o.consecutive = 0;
        o.observe(false);
        if o.failure_rate < CLEAN_RATE {
            o.failure_rate = 0.0;
            self.clean.store(true, Relaxed);
        }
    }

    pub(super) fn outlier(&self) -> MutexGuard<'_, Outlier> {
        self.outlier.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Ejected by outlier detection (until the next sweep past its deadline).
    pub fn ejected(&self) -> bool {
        self.outlier().ejected_until.is_some()
    }

    /// Its ejections in a row (0: in good standing).
    pub fn ejections(&self) -> u32 {
        self.outlier().ejections
    }
}

#[derive(Debug)]
pub struct WorkerState {
    pub id: WorkerId,
    pub url: Arc<str>,
    pub backend: Backend,
    pub rank_field: RankField,
    pub role: Role,
    pub bootstrap_port: Option<u16>,
    /// KV cache tokens per rank, when the engine reported it.
    pub kv_capacity: Option<u64>,
    /// The models it serves; empty when unknown.
    pub models: Arc<[String]>,
    /// Where its ranks publish KV events, when it was given them.
    pub events: Option<Arc<WorkerEvents>>,
    /// `Authorization` for every request to it (its `api_key`), when it has one.
    pub auth: Option<hyper::header::HeaderValue>,
    pub endpoints: Vec<Arc<EndpointState>>,
    /// Found by discovery and not probed yet (its description, to ask its models when its first probe passes):
    /// not routable until then ([`Registry::admit`]).
    pub unprobed: Option<WorkerConfig>,
    pub(super) active_healthy: AtomicBool,
    /// A request failed to reach it since its last probe: one failed probe confirms it is down.
    pub(super) suspect: AtomicBool,
    pub(super) probe_failures: AtomicU32,
    pub(super) probe_successes: AtomicU32,
}

impl WorkerState {
    pub(super) fn new(id: WorkerId, config: &WorkerConfig, admission: Admission) -> Self {
        let (info, unprobed) = match admission {
            Admission::Ready(info) => (info, None),
            Admission::Unprobed => {
                let info = WorkerInfo {
                    dp_size: config.dp_size.unwrap_or(1),
                    kv_capacity: None,
                    models: config.models.clone(),
                };
                (info, Some(config.clone()))
            }
        };
        Self {
            id,
            url: config.url.trim_end_matches('/').into(),
            backend: config.backend,
            rank_field: config.rank_field,
            role: config.role,
            bootstrap_port: config.bootstrap_port,
            kv_capacity: config.kv_capacity_tokens.or(info.kv_capacity),
            models: info.models.into(),
            events: config.events().map(Arc::new),
            auth: config.api_key.as_ref().and_then(|k| k.bearer()),
            endpoints: (0..info.dp_size)
                .map(|rank| {
                    Arc::new(EndpointState::new(EndpointId {
                        worker: id,
                        dp_rank: rank,
                    }))
                })
                .collect(),
            active_healthy: AtomicBool::new(unprobed.is_none()),
            unprobed,
            suspect: AtomicBool::new(false),
            probe_failures: AtomicU32::new(0),
            probe_successes: AtomicU32::new(0),
        }
    }

    pub fn active_healthy(&self) -> bool {
        self.active_healthy.load(Relaxed)
    }

    /// Failed probes in a row.
    pub fn probe_failures(&self) -> u32 {
        self.probe_failures.load(Relaxed)
    }

    pub fn endpoint_healthy(&self, e: &EndpointState) -> bool {
        self.active_healthy() && !e.ejected()
    }
}

/// What went wrong talking to an endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The connection could not be made. Counts against the endpoint and asks for a probe of its worker.
    Connect,
    /// The engine answered 5xx, broke a stream mid-way, or sent nothing before the first-byte timeout.
    Engine,
    /// The exchange broke after the request was sent and before any answer (a reset, a closed connection): the
    /// engine may have refused this request (a body too large for it) or died. Does not count; asks for a probe.
    Ambiguous,
}

impl Failure {
    /// How an engine's failure to answer a request routed by `branch` (5xx, nothing in time, a broken stream)
    /// counts: against the endpoint ([`Failure::Engine`]), unless the client pinned the rank
    /// ([`dprouter_core::Branch::Override`]), when it may be the request's own fault (a body that makes the engine fail, sent to
    /// one rank again and again) and only asks for a probe ([`Failure::Ambiguous`]).
    pub fn engine(branch: dprouter_core::Branch) -> Self {
        match branch {
            dprouter_core::Branch::Override => Failure::Ambiguous,
            _ => Failure::Engine,
        }
    }
}

/// How a worker joins the registry.
#[derive(Debug, Clone)]
pub enum Admission {
    /// Its ranks and models were asked already (the config file, `POST /workers`): routable at once.
    Ready(WorkerInfo),
    /// Found by discovery and not asked yet (its rank count is known: configured, or one): not routable until its
    /// first health probe passes, when its models and capacity are asked ([`Registry::admit`]).
    Unprobed,
}
