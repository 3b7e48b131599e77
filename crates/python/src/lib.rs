//! `dprouter._dprouter`: the core's [`DpRouter`] for Python, which the `dprouter` package's SGLang and vLLM plugins
//! put in the engines' own DP dispatch (`python/dprouter/`).
//!
//! Token ids come as a list of ints or any buffer of 32- or 64-bit integers (`array('q')`, `array('i')`, numpy),
//! read in Rust without a Python-level copy ([`token_ids`]); the work that grows with the prompt (hashing, the index) runs with
//! the interpreter released. No panic crosses into Python: a Rust panic would surface as PyO3's `PanicException`,
//! which is not an `Exception` and would end the engine's dispatch loop, so every call catches its panics and
//! raises [`DprouterError`] instead. Errors a caller can cause are `ValueError` subclasses carrying the core's
//! messages.
//!
//! Times (`now_us`) are microseconds on a monotonic clock; left out, this module's own clock is used.

mod kv_events;
mod small_ints;
mod token_ids;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Instant;

use dprouter_core::dp_router::{
    self, Decision, DpRouter, DpRouterError, KvOutcome, LoadReport, PickOptions, TicketLimits,
};
use dprouter_core::{RouteError, Usage};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

pyo3::create_exception!(
    _dprouter,
    DprouterError,
    PyValueError,
    "A dprouter call was refused: a bad policy, rank or argument (a ValueError)."
);
pyo3::create_exception!(_dprouter, PolicyError, DprouterError, "The policy spec is not valid.");
pyo3::create_exception!(
    _dprouter,
    RankError,
    DprouterError,
    "A rank is out of range or not active, or no rank may take the request."
);

fn error(e: DpRouterError) -> PyErr {
    let message = e.to_string();
    match e {
        DpRouterError::Policy(_) => PolicyError::new_err(message),
        DpRouterError::Route(RouteError::MissingBootstrapRoom) => DprouterError::new_err(message),
        DpRouterError::Route(_)
        | DpRouterError::Rank { .. }
        | DpRouterError::NoEligible
        | DpRouterError::NumRanks(_) => RankError::new_err(message),
    }
}

/// Runs `f`, turning a panic into a [`DprouterError`].
fn guarded<T>(f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown".into());
        Err(DprouterError::new_err(format!(
            "internal error in dprouter (a bug): {what}"
        )))
    })
}

/// The engine's report of a request, when it gave its cached tokens.
fn usage(prompt_tokens: Option<u64>, cached_tokens: Option<u64>) -> Option<Usage> {
    cached_tokens.map(|cached_tokens| Usage {
        prompt_tokens: prompt_tokens.unwrap_or(0),
        cached_tokens,
    })
}

/// Microseconds since this module was loaded.
fn clock_us() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_micros() as u64
}

/// A routing decision.
#[pyclass(frozen, get_all, module = "dprouter")]
#[derive(Debug, Clone)]
pub struct Pick {
    /// The rank chosen.
    rank: usize,
    /// Why: `override`, `turn`, `least_loaded`, `hashed`, `fallback`, `empty`, `affine`, `spill`, `hit`, `cold`, `random`.
    branch: &'static str,
    /// Prompt tokens the rank is predicted to hold already (0 when the policy does not predict).
    predicted_cached_tokens: u64,
}

#[pymethods]
impl Pick {
    fn __repr__(&self) -> String {
        format!(
            "Pick(rank={}, branch='{}', predicted_cached_tokens={})",
            self.rank, self.branch, self.predicted_cached_tokens
        )
    }

    fn __eq__(&self, other: &Self) -> bool {
        (self.rank, self.branch, self.predicted_cached_tokens)
            == (other.rank, other.branch, other.predicted_cached_tokens)
    }
}

impl From<Decision> for Pick {
    fn from(d: Decision) -> Self {
        Self {
            rank: d.rank,
            branch: d.branch.as_str(),
            predicted_cached_tokens: d.predicted_cached_tokens,
        }
    }
}

/// A router over one engine's data-parallel ranks with one of dprouter's policies.
#[pyclass(frozen, module = "dprouter")]
pub struct Router {
    /// Shared with the KV event feeds' thread.
    inner: Arc<Mutex<DpRouter>>,
    /// The ranks' KV event feeds, started by the first `follow_kv_events`.
    feeds: Mutex<Option<kv_events::Feeds>>,
}

impl Router {
    fn lock(&self) -> MutexGuard<'_, DpRouter> {
        // A panic inside a call is caught and reported; the router's state stays usable.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reads `token_ids` (with the interpreter), then decides with `how` (without it).
    fn decide(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        options: Options,
        now_us: Option<u64>,
        how: impl FnOnce(&mut DpRouter, Vec<u32>, &PickOptions<'_>, u64) -> Result<Decision, DpRouterError> + Send,
    ) -> PyResult<Pick> {
        guarded(|| {
            let tokens = token_ids::read(token_ids)?;
            let now = now_us.unwrap_or_else(clock_us);
            py.detach(|| guarded(|| how(&mut self.lock(), tokens, &options.borrowed(), now).map_err(error)))
                .map(Pick::from)
        })
    }
}

/// The request's options besides its prompt, owned (to be used with the interpreter released).
struct Options {
    request_id: Option<String>,
    routed_rank: Option<i64>,
    bootstrap_room: Option<u64>,
    session: Option<String>,
    cache_namespace: Option<String>,
    eligible: Option<Vec<i64>>,
}

impl Options {
    fn borrowed(&self) -> PickOptions<'_> {
        PickOptions {
            request_id: self.request_id.as_deref(),
            routed_rank: self.routed_rank,
            bootstrap_room: self.bootstrap_room,
            session: self.session.as_deref(),
            cache_namespace: self.cache_namespace.as_deref(),
            eligible: self.eligible.as_deref(),
        }
    }
}

#[pymethods]
impl Router {
    /// A router with `policy` (a spec as `dprouter serve --policy` takes it, e.g.
    /// `"cache_aware:prefill_tokens_per_s=12000"`) over `num_ranks` ranks, all active. Tickets of requests that
    /// never finish are dropped past `max_tickets` or `ticket_ttl_s`.
    #[new]
    #[pyo3(signature = (policy, num_ranks, *, max_tickets = 100_000, ticket_ttl_s = 1800.0))]
    fn new(policy: &str, num_ranks: usize, max_tickets: usize, ticket_ttl_s: f64) -> PyResult<Self> {
        guarded(|| {
            if !(ticket_ttl_s.is_finite() && ticket_ttl_s > 0.0) {
                return Err(DprouterError::new_err(format!(
                    "ticket_ttl_s must be a positive number of seconds, got {ticket_ttl_s}"
                )));
            }
            let limits = TicketLimits {
                max_tickets: max_tickets.max(1),
                max_age_us: (ticket_ttl_s * 1e6) as u64,
            };
            let router = DpRouter::new(policy, num_ranks, limits).map_err(error)?;
            Ok(Self {
                inner: Arc::new(Mutex::new(router)),
                feeds: Mutex::new(None),
            })
        })
    }

    /// The rank for a prompt of `token_ids`. With `request_id` the router keeps the request until `finish` or
    /// `abort` (or its ticket expires) and counts it in flight at that rank.
    #[pyo3(signature = (token_ids, *, request_id = None, routed_rank = None, bootstrap_room = None, session = None,
        cache_namespace = None, eligible = None, now_us = None))]
    #[allow(clippy::too_many_arguments)]
    fn pick(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        request_id: Option<String>,
        routed_rank: Option<i64>,
        bootstrap_room: Option<u64>,
        session: Option<String>,
        cache_namespace: Option<String>,
        eligible: Option<Vec<i64>>,
        now_us: Option<u64>,
    ) -> PyResult<Pick> {
        let options = Options {
            request_id,
            routed_rank,
            bootstrap_room,
            session,
            cache_namespace,
            eligible,
        };
        self.decide(py, token_ids, options, now_us, DpRouter::pick)
    }

    /// The rank `pick` would choose now, recording nothing.
    #[pyo3(signature = (token_ids, *, routed_rank = None, bootstrap_room = None, session = None,
        cache_namespace = None, eligible = None, now_us = None))]
    #[allow(clippy::too_many_arguments)]
    fn best_rank(
        &self,
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        routed_rank: Option<i64>,
        bootstrap_room: Option<u64>,
        session: Option<String>,
        cache_namespace: Option<String>,
        eligible: Option<Vec<i64>>,
        now_us: Option<u64>,
    ) -> PyResult<Pick> {
        let options = Options {
            request_id: None,
            routed_rank,
            bootstrap_room,
            session,
            cache_namespace,
            eligible,
        };
        self.decide(py, token_ids, options, now_us, |router, tokens, options, now| {
            router.best_rank(tokens, options, now)
        })
    }

    /// The request's first token came: its queued-prefill share is released. With `cached_tokens` (vLLM
    /// reports them with the first token) the policy learns what the rank had cached. False if the id is unknown.
    #[pyo3(signature = (request_id, *, now_us = None, prompt_tokens = None, cached_tokens = None))]
    fn first_token(
        &self,
        request_id: &str,
        now_us: Option<u64>,
        prompt_tokens: Option<u64>,
        cached_tokens: Option<u64>,
    ) -> PyResult<bool> {
        guarded(|| {
            let now = now_us.unwrap_or_else(clock_us);
            Ok(self
                .lock()
                .first_token(request_id, now, usage(prompt_tokens, cached_tokens)))
        })
    }

    /// The request finished: its load is released. With `cached_tokens` (unless `first_token` gave them) the
    /// policy learns how much of the prompt the rank had cached. False if the id is unknown.
    #[pyo3(signature = (request_id, *, prompt_tokens = None, cached_tokens = None))]
    fn finish(&self, request_id: &str, prompt_tokens: Option<u64>, cached_tokens: Option<u64>) -> PyResult<bool> {
        guarded(|| Ok(self.lock().finish(request_id, usage(prompt_tokens, cached_tokens))))
    }

    /// The request ended without a report: its load is released. False if the id is unknown.
    fn abort(&self, request_id: &str) -> PyResult<bool> {
        guarded(|| Ok(self.lock().abort(request_id)))
    }

    /// A rank's load as the engine reports it: `running` and `waiting` requests, `tokens` (KV tokens in use plus
    /// queued prompt tokens), and, when the engine says, `waiting_tokens` (the uncached prompt tokens waiting for
    /// prefill: then `cache_aware` sees the engine's own prefill queue). Applied when `timestamp` (any increasing
    /// number; left out, the clock) is newer than the last one applied. Returns whether it was.
    #[pyo3(signature = (rank, *, running = 0, waiting = 0, tokens = 0, waiting_tokens = None, timestamp = None))]
    fn report_load(
        &self,
        rank: i64,
        running: u64,
        waiting: u64,
        tokens: u64,
        waiting_tokens: Option<u64>,
        timestamp: Option<u64>,
    ) -> PyResult<bool> {
        guarded(|| {
            let report = LoadReport {
                running,
                waiting,
                tokens,
                waiting_tokens,
                timestamp: timestamp.unwrap_or_else(clock_us),
            };
            self.lock().report_load(rank, report).map_err(error)
        })
    }

    /// Marks a rank active or not: an inactive rank is never picked, and a request naming it is refused.
    fn set_active(&self, rank: i64, active: bool) -> PyResult<()> {
        guarded(|| self.lock().set_active(rank, active).map_err(error))
    }

    /// Whether a rank is active.
    fn is_active(&self, rank: i64) -> PyResult<bool> {
        guarded(|| {
            let router = self.lock();
            match usize::try_from(rank).ok().filter(|&r| r < router.num_ranks()) {
                Some(r) => Ok(router.is_active(r)),
                None => Err(error(DpRouterError::Rank {
                    rank,
                    size: router.num_ranks(),
                })),
            }
        })
    }

    /// Applies batch `seq` of a rank's KV events (its msgpack payload as vLLM or SGLang publish it). Returns
    /// what happened: `applied`, `duplicate`, `restarted` (the rank was emptied first), `gap` (batches were missed:
    /// the rank is approximate until its next stored blocks) or `undecodable`.
    #[pyo3(signature = (rank, seq, payload, *, now_us = None))]
    fn apply_kv_events(
        &self,
        py: Python<'_>,
        rank: i64,
        seq: u64,
        payload: &Bound<'_, PyBytes>,
        now_us: Option<u64>,
    ) -> PyResult<&'static str> {
        guarded(|| {
            let bytes = payload.as_bytes();
            let now = now_us.unwrap_or_else(clock_us);
            let outcome =
                py.detach(|| guarded(|| self.lock().apply_kv_events(rank, seq, bytes, now).map_err(error)))?;
            Ok(match outcome {
                KvOutcome::Applied(_) => "applied",
                KvOutcome::Duplicate => "duplicate",
                KvOutcome::Restarted(_) => "restarted",
                KvOutcome::Gap { .. } => "gap",
                KvOutcome::Undecodable(_) => "undecodable",
            })
        })
    }

    /// Follows `rank`'s KV event publisher at `endpoint` (`tcp://host:port`) in a background thread: connects to
    /// a publisher that binds or, with `bind`, binds there for a publisher that connects; subscribes to `topic`.
    /// Each batch goes to `apply_kv_events`. Read with the gateway's bounded ZMTP reader: a hostile or broken
    /// publisher ends its own connection (made again a second later), never the process.
    #[pyo3(signature = (rank, endpoint, *, bind = false, topic = ""))]
    fn follow_kv_events(&self, rank: i64, endpoint: &str, bind: bool, topic: &str) -> PyResult<()> {
        guarded(|| {
            let size = self.lock().num_ranks();
            let rank = usize::try_from(rank)
                .ok()
                .filter(|&r| r < size)
                .ok_or_else(|| error(DpRouterError::Rank { rank, size }))?;
            let mut feeds = self.feeds.lock().unwrap_or_else(|e| e.into_inner());
            if feeds.is_none() {
                let started = kv_events::Feeds::new()
                    .map_err(|e| DprouterError::new_err(format!("cannot start the KV event thread: {e}")))?;
                *feeds = Some(started);
            }
            let feeds = feeds
                .as_mut()
                .ok_or_else(|| DprouterError::new_err("no KV event feeds"))?;
            feeds
                .follow(
                    Arc::clone(&self.inner),
                    rank,
                    endpoint,
                    bind,
                    topic.as_bytes().to_vec(),
                    clock_us,
                )
                .map_err(DprouterError::new_err)
        })
    }

    /// Each followed rank's feed: `rank`, `endpoint`, `bind`, `connected`, `batches`, `gaps`, `restarts`,
    /// `decode_errors`, `frame_errors`.
    fn kv_event_status<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        guarded(|| {
            let feeds = self.feeds.lock().unwrap_or_else(|e| e.into_inner());
            let Some(feeds) = feeds.as_ref() else {
                return Ok(Vec::new());
            };
            feeds
                .statuses
                .iter()
                .map(|status| {
                    let s = status.lock().unwrap_or_else(|e| e.into_inner()).clone();
                    let d = PyDict::new(py);
                    d.set_item("rank", s.rank)?;
                    d.set_item("endpoint", s.endpoint)?;
                    d.set_item("bind", s.bind)?;
                    d.set_item("connected", s.connected)?;
                    d.set_item("batches", s.batches)?;
                    d.set_item("gaps", s.gaps)?;
                    d.set_item("restarts", s.restarts)?;
                    d.set_item("decode_errors", s.decode_errors)?;
                    d.set_item("frame_errors", s.frame_errors)?;
                    Ok(d)
                })
                .collect()
        })
    }

    /// The number of ranks.
    #[getter]
    fn num_ranks(&self) -> usize {
        self.lock().num_ranks()
    }

    /// The policy's name.
    #[getter]
    fn policy(&self) -> &'static str {
        self.lock().policy_name()
    }

    /// Requests held for feedback (routed with an id, not yet finished, aborted or expired).
    #[getter]
    fn tickets(&self) -> usize {
        self.lock().tickets()
    }

    /// Requests in flight at each rank, as the router counts them.
    fn in_flight(&self) -> Vec<u64> {
        self.lock()
            .endpoints()
            .iter()
            .map(|e| e.load.in_flight_requests())
            .collect()
    }

    fn __repr__(&self) -> String {
        let router = self.lock();
        format!(
            "Router(policy='{}', num_ranks={})",
            router.policy_name(),
            router.num_ranks()
        )
    }
}

/// SGLang's proposed `prefix_match` method on its own: the rank of `token_ids` among `num_ranks` active ranks.
#[pyfunction]
fn prefix_match_rank(py: Python<'_>, token_ids: &Bound<'_, PyAny>, num_ranks: usize) -> PyResult<usize> {
    guarded(|| {
        let tokens = token_ids::read(token_ids)?;
        py.detach(|| guarded(|| dp_router::prefix_match_rank(tokens, num_ranks).map_err(error)))
    })
}

#[pymodule]
fn _dprouter(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Router>()?;
    m.add_class::<Pick>()?;
    m.add_function(wrap_pyfunction!(prefix_match_rank, m)?)?;
    m.add("DprouterError", m.py().get_type::<DprouterError>())?;
    m.add("PolicyError", m.py().get_type::<PolicyError>())?;
    m.add("RankError", m.py().get_type::<RankError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    // Whether lists of token ids are read in place on this interpreter (its layouts checked at import).
    m.add("_lists_read_in_place", token_ids::reader(m.py()).enabled())?;
    Ok(())
}
