//! The one load model every policy reads.
//!
//! Per endpoint, two kinds of numbers:
//!
//! - **In flight** (requests, prompt tokens): every request the gateway dispatched to the endpoint and has not
//!   finished. Changed only by a [`LoadGuard`], whose `Drop` releases the count exactly once on every path
//!   (completion, upstream error, client disconnect, retry).
//! - **The load view** SGLang's `DPBudget` keeps: the latest engine report (`num_reqs`, `num_tokens`) plus
//!   *speculative* increments for each request a policy dispatched since that report. A report only replaces the
//!   counters when its timestamp is newer than the last one applied, so speculative increments survive stale
//!   re-reads; a fresh report zeroes them. Unlike SGLang, a speculative increment is also taken back when its
//!   request finishes before the next report, so a gateway without engine reports sees its own in-flight load
//!   instead of a count that only grows. Rank overrides are never counted speculatively (SGLang parity).
//!
//! - **Queued prefill** (requests, tokens): the requests dispatched whose first token has not arrived yet, and their
//!   predicted *uncached* prompt tokens (the policy's prediction when it has one, else the whole prompt). This is
//!   the work that delays the next request's first token. A guard releases its share at
//!   [`LoadGuard::first_token`] (the simulator's prefill completion, the gateway's first upstream byte), or on drop
//!   if the first token never came.
//! - **Prefill progress**: the time the endpoint's current prefill began, as the caller's clock saw it: when its
//!   queue last became non-empty or a first token last arrived (the engine then starts the next queued request).
//!   [`EndpointLoad::prefill_elapsed_us`] is how long the oldest queued request has been prefilling, so a policy
//!   can count the part of it already done instead of the whole prompt. Times are microseconds on any monotonic
//!   clock the caller keeps (the gateway's process clock, the simulator's virtual time); a caller without a clock
//!   passes 0 everywhere and sees no progress.
//!
//! - **Prefill costs** ([`crate::cost_fit`]): the endpoint's fixed cost and cost per uncached prompt token, fitted
//!   from its requests' service times ([`LoadGuard::first_token`] measures each) and the cached tokens its engine
//!   reported; [`EndpointLoad::fitted_costs`] once the fit has enough samples.
//!
//! All reads and updates are a few relaxed atomics: O(1) per endpoint, no locks on the routing path (the cost fit
//! takes a short lock once per request, at its feedback).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use crate::cost_fit::{CostFit, FittedCosts};

/// A load report published by one engine rank (SGLang `/get_load`, or the scheduler's own stats).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EngineReport {
    /// Running plus waiting requests (`num_reqs`).
    pub requests: u64,
    /// Waiting requests alone (`num_waiting_reqs`).
    pub waiting: u64,
    /// Used KV tokens plus pending prompt tokens (`num_tokens`).
    pub tokens: u64,
    /// The engine's monotonically increasing report time (`ts_tic`), in any unit.
    pub timestamp: u64,
    /// Uncached prompt tokens waiting for prefill (SGLang's load snapshots: `num_waiting_uncached_tokens`), when
    /// the engine says. With it, the endpoint's queued prefill is what the engine reports (plus what was
    /// dispatched since), not only what this router dispatched: a router inside the engine, which never sees a
    /// first token, keys on it.
    pub queued_prefill_tokens: Option<u64>,
}

/// What load-based policies compare: engine-reported load plus speculative increments since that report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LoadView {
    pub requests: u64,
    pub tokens: u64,
}

/// Shared load counters of one endpoint.
#[derive(Debug, Default)]
pub struct EndpointLoad {
    in_flight_requests: AtomicU64,
    in_flight_tokens: AtomicU64,
    prefill_requests: AtomicU64,
    prefill_tokens: AtomicU64,
    /// When the current prefill began (see the module docs), microseconds on the caller's clock.
    prefill_since_us: AtomicU64,
    reported_requests: AtomicU64,
    reported_tokens: AtomicU64,
    speculative_requests: AtomicU64,
    speculative_tokens: AtomicU64,
    /// Incremented by every applied report; a guard only takes back speculation from its own epoch.
    epoch: AtomicU64,
    /// The last report's queued prefill: its waiting requests, and its [`EngineReport::queued_prefill_tokens`]
    /// plus one (0: the report gave none); and the requests and predicted uncached tokens dispatched since it.
    reported_queue_requests: AtomicU64,
    reported_queue_tokens_plus_one: AtomicU64,
    queued_since_report_requests: AtomicU64,
    queued_since_report_tokens: AtomicU64,
    last_report: Mutex<Option<EngineReport>>,
    /// When the engine last answered a load poll, on the caller's clock plus one (0: never).
    reported_at_us_plus_one: AtomicU64,
    costs: Mutex<CostFit>,
}

impl EndpointLoad {
    /// Requests dispatched to this endpoint and not yet finished (overrides included).
    pub fn in_flight_requests(&self) -> u64 {
        self.in_flight_requests.load(Relaxed)
    }

    /// Prompt tokens of the requests in flight.
    pub fn in_flight_tokens(&self) -> u64 {
        self.in_flight_tokens.load(Relaxed)
    }

    /// Requests dispatched here whose first token has not arrived (overrides included); when the engine reports
    /// its queue, at least the requests it reported waiting plus those dispatched since.
    pub fn queued_prefill_requests(&self) -> u64 {
        let own = self.prefill_requests.load(Relaxed);
        match self.reported_queue_tokens_plus_one.load(Relaxed) {
            0 => own,
            _ => own.max(self.reported_queue_requests.load(Relaxed) + self.queued_since_report_requests.load(Relaxed)),
        }
    }

    /// The predicted uncached prompt tokens of those requests: the prefill work queued ahead of a new request;
    /// when the engine reports its queue, at least what it reported plus what was dispatched since.
    pub fn queued_prefill_tokens(&self) -> u64 {
        let own = self.prefill_tokens.load(Relaxed);
        match self.reported_queue_tokens_plus_one.load(Relaxed) {
            0 => own,
            reported => own.max(reported - 1 + self.queued_since_report_tokens.load(Relaxed)),
        }
    }

    /// How long the oldest queued request has been prefilling at `now_us`: the time since the queue last became
    /// non-empty or a first token last arrived; 0 with nothing queued (or a clock behind that moment).
    pub fn prefill_elapsed_us(&self, now_us: u64) -> u64 {
        if self.prefill_requests.load(Relaxed) == 0 {
            return 0;
        }
        now_us.saturating_sub(self.prefill_since_us.load(Relaxed))
    }

    /// One prefill done: `uncached_tokens` took `service_us` ([`crate::cost_fit`]). A zero service time (a
    /// caller without a clock) is no sample.
    pub fn observe_prefill(&self, uncached_tokens: u64, service_us: u64) {
        if service_us > 0 {
            self.costs().add(uncached_tokens, service_us);
        }
    }

    /// The endpoint's prefill costs as fitted so far; `None` until the fit has enough samples.
    pub fn fitted_costs(&self) -> Option<FittedCosts> {
        self.costs().fitted()
    }

    /// Forgets the fitted costs (the engine restarted: it may run another model, on other hardware).
    pub fn reset_costs(&self) {
        *self.costs() = CostFit::default();
    }

    /// Samples the cost fit holds.
    pub fn cost_samples(&self) -> usize {
        self.costs().len()
    }

    fn costs(&self) -> std::sync::MutexGuard<'_, CostFit> {
        self.costs.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The view `total_requests` and `total_tokens` compare.
    pub fn view(&self) -> LoadView {
        LoadView {
            requests: self.reported_requests.load(Relaxed) + self.speculative_requests.load(Relaxed),
            tokens: self.reported_tokens.load(Relaxed) + self.speculative_tokens.load(Relaxed),
        }
    }

    /// The engine answered a load poll at `now_us` (its report applied or not: the answer is fresh).
    pub fn mark_reported(&self, now_us: u64) {
        self.reported_at_us_plus_one.store(now_us.saturating_add(1), Relaxed);
    }

    /// When the engine last answered a load poll, if it ever did.
    pub fn reported_at_us(&self) -> Option<u64> {
        self.reported_at_us_plus_one.load(Relaxed).checked_sub(1)
    }

    /// The last report applied, if any.
    pub fn last_report(&self) -> Option<EngineReport> {
        *self.last_report.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Applies an engine report if it is newer than the last one applied. Returns whether it was applied.
    ///
    /// Applying replaces the reported counters and zeroes the speculative increments (the report already
    /// counts those requests). A report with the same or an older timestamp changes nothing.
    pub fn apply_report(&self, report: EngineReport) -> bool {
        let mut last = self.last_report.lock().unwrap_or_else(|e| e.into_inner());
        if last.is_some_and(|prev| report.timestamp <= prev.timestamp) {
            return false;
        }
        *last = Some(report);
        self.reported_requests.store(report.requests, Relaxed);
        self.reported_tokens.store(report.tokens, Relaxed);
        self.speculative_requests.store(0, Relaxed);
        self.speculative_tokens.store(0, Relaxed);
        self.reported_queue_requests.store(report.waiting, Relaxed);
        self.queued_since_report_requests.store(0, Relaxed);
        self.queued_since_report_tokens.store(0, Relaxed);
        let queued = report.queued_prefill_tokens.map_or(0, |t| t.saturating_add(1));
        self.reported_queue_tokens_plus_one.store(queued, Relaxed);
        self.epoch.fetch_add(1, Relaxed);
        true
    }
}

/// Holds one request's share of an endpoint's load; dropping it releases that share exactly once.
#[derive(Debug)]
#[must_use = "dropping the guard releases the load at once"]
pub struct LoadGuard {
    load: Arc<EndpointLoad>,
    tokens: u64,
    /// This request's share of the queued prefill tokens; `None` once released by [`LoadGuard::first_token`].
    prefill: Option<u64>,
    /// The report epoch the speculative increment belongs to; `None` when not counted speculatively.
    speculative_epoch: Option<u64>,
    /// When it was acquired, on the caller's clock.
    acquired_us: u64,
}

impl LoadGuard {
    /// Counts one request of `tokens` prompt tokens in flight at `load`, and in the speculative view when
    /// `speculative` (a policy's choice, not a client's rank override). All `tokens` count as queued prefill; no
    /// clock.
    pub fn acquire(load: Arc<EndpointLoad>, tokens: u64, speculative: bool) -> Self {
        Self::acquire_with_prefill(load, tokens, tokens, speculative, 0)
    }

    /// [`LoadGuard::acquire`] at `now_us` with `prefill_tokens` (the predicted uncached part of the prompt)
    /// counted as queued prefill work until [`LoadGuard::first_token`]. If nothing was queued, the endpoint's
    /// prefill begins now.
    pub fn acquire_with_prefill(
        load: Arc<EndpointLoad>,
        tokens: u64,
        prefill_tokens: u64,
        speculative: bool,
        now_us: u64,
    ) -> Self {
        load.in_flight_requests.fetch_add(1, Relaxed);
        load.in_flight_tokens.fetch_add(tokens, Relaxed);
        if load.prefill_requests.fetch_add(1, Relaxed) == 0 {
            load.prefill_since_us.store(now_us, Relaxed);
        }
        load.prefill_tokens.fetch_add(prefill_tokens, Relaxed);
        if load.reported_queue_tokens_plus_one.load(Relaxed) != 0 {
            load.queued_since_report_requests.fetch_add(1, Relaxed);
            load.queued_since_report_tokens.fetch_add(prefill_tokens, Relaxed);
        }
        let speculative_epoch = speculative.then(|| {
            load.speculative_requests.fetch_add(1, Relaxed);
            load.speculative_tokens.fetch_add(tokens, Relaxed);
            load.epoch.load(Relaxed)
        });
        Self {
            load,
            tokens,
            prefill: Some(prefill_tokens),
            speculative_epoch,
            acquired_us: now_us,
        }
    }

    /// The first token arrived at `now_us`: releases this request's queued-prefill share, and the endpoint's next
    /// queued request begins its prefill now. Only the first call has an effect; the in-flight share stays until
    /// the guard is dropped. Returns the request's service time: from when the endpoint could start on it (its
    /// arrival, or the endpoint's previous first token, whichever came later) to now; `None` after the first call.
    pub fn first_token(&mut self, now_us: u64) -> Option<u64> {
        if !self.release_prefill() {
            return None;
        }
        let since = self.load.prefill_since_us.swap(now_us, Relaxed);
        Some(now_us.saturating_sub(since.max(self.acquired_us)))
    }

    /// The endpoint whose load it holds.
    pub fn load(&self) -> &EndpointLoad {
        &self.load
    }

    /// Releases the queued-prefill share if it is still held; returns whether it was.
    fn release_prefill(&mut self) -> bool {
        let Some(tokens) = self.prefill.take() else {
            return false;
        };
        saturating_sub(&self.load.prefill_requests, 1);
        saturating_sub(&self.load.prefill_tokens, tokens);
        true
    }
}

fn saturating_sub(counter: &AtomicU64, amount: u64) {
    // `fetch_update` with a closure that never returns `None` cannot fail.
    let _ = counter.fetch_update(Relaxed, Relaxed, |v| Some(v.saturating_sub(amount)));
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        // No first token (an error, a disconnect): which queued request the engine was prefilling is unknown, so
        // the endpoint's progress clock is left as it is.
        self.release_prefill();
        saturating_sub(&self.load.in_flight_requests, 1);
        saturating_sub(&self.load.in_flight_tokens, self.tokens);
        // A report that arrived since dispatch already accounts for this request (or its completion).
        if self.speculative_epoch == Some(self.load.epoch.load(Relaxed)) {
            saturating_sub(&self.load.speculative_requests, 1);
            saturating_sub(&self.load.speculative_tokens, self.tokens);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(requests: u64, tokens: u64, timestamp: u64) -> EngineReport {
        EngineReport {
            requests,
            waiting: 0,
            tokens,
            timestamp,
            queued_prefill_tokens: None,
        }
    }

    #[test]
    fn a_reported_queue_counts_with_what_was_dispatched_since() {
        let load = Arc::new(EndpointLoad::default());
        let own = LoadGuard::acquire(Arc::clone(&load), 100, true);
        assert_eq!((load.queued_prefill_requests(), load.queued_prefill_tokens()), (1, 100));
        // A report with a queue: the engine's, plus what comes after it.
        load.apply_report(EngineReport {
            waiting: 3,
            queued_prefill_tokens: Some(5_000),
            ..report(4, 9_000, 1)
        });
        assert_eq!(
            (load.queued_prefill_requests(), load.queued_prefill_tokens()),
            (3, 5_000)
        );
        let next = LoadGuard::acquire_with_prefill(Arc::clone(&load), 800, 300, true, 0);
        assert_eq!(
            (load.queued_prefill_requests(), load.queued_prefill_tokens()),
            (4, 5_300)
        );
        // Finishing does not take it back: the next report says what the engine did with it.
        drop((own, next));
        assert_eq!(
            (load.queued_prefill_requests(), load.queued_prefill_tokens()),
            (4, 5_300)
        );
        load.apply_report(EngineReport {
            waiting: 0,
            queued_prefill_tokens: Some(0),
            ..report(0, 0, 2)
        });
        assert_eq!((load.queued_prefill_requests(), load.queued_prefill_tokens()), (0, 0));
        // A report without one: the router's own count again.
        load.apply_report(report(0, 0, 3));
        let _held = LoadGuard::acquire(Arc::clone(&load), 50, true);
        assert_eq!((load.queued_prefill_requests(), load.queued_prefill_tokens()), (1, 50));
    }

    #[test]
    fn guard_releases_in_flight_exactly_once() {
        let load = Arc::new(EndpointLoad::default());
        let a = LoadGuard::acquire(load.clone(), 100, true);
        let b = LoadGuard::acquire(load.clone(), 50, false);
        assert_eq!((load.in_flight_requests(), load.in_flight_tokens()), (2, 150));
        assert_eq!(
            load.view(),
            LoadView {
                requests: 1,
                tokens: 100
            }
        );
        drop(a);
        assert_eq!((load.in_flight_requests(), load.in_flight_tokens()), (1, 50));
        assert_eq!(load.view(), LoadView::default());
        drop(b);
        assert_eq!((load.in_flight_requests(), load.in_flight_tokens()), (0, 0));
    }

    #[test]
    fn fresh_report_replaces_speculation_and_stale_report_keeps_it() {
        let load = Arc::new(EndpointLoad::default());
        assert!(load.apply_report(report(3, 300, 10)));
        let _g = LoadGuard::acquire(load.clone(), 7, true);
        assert_eq!(
            load.view(),
            LoadView {
                requests: 4,
                tokens: 307
            }
        );
        // Same timestamp: a stale re-read, ignored; the speculative count survives.
        assert!(!load.apply_report(report(0, 0, 10)));
        assert!(!load.apply_report(report(0, 0, 9)));
        assert_eq!(
            load.view(),
            LoadView {
                requests: 4,
                tokens: 307
            }
        );
        // Newer: replaces everything.
        assert!(load.apply_report(report(5, 500, 11)));
        assert_eq!(
            load.view(),
            LoadView {
                requests: 5,
                tokens: 500
            }
        );
        assert_eq!(load.last_report(), Some(report(5, 500, 11)));
    }

    #[test]
    fn prefill_share_is_released_once_at_first_token_or_drop() {
        let load = Arc::new(EndpointLoad::default());
        let mut a = LoadGuard::acquire_with_prefill(load.clone(), 1000, 300, true, 0);
        let b = LoadGuard::acquire(load.clone(), 50, false);
        assert_eq!((load.queued_prefill_requests(), load.queued_prefill_tokens()), (2, 350));
        a.first_token(0);
        a.first_token(0);
        assert_eq!((load.queued_prefill_requests(), load.queued_prefill_tokens()), (1, 50));
        assert_eq!((load.in_flight_requests(), load.in_flight_tokens()), (2, 1050));
        drop(a);
        assert_eq!((load.queued_prefill_requests(), load.queued_prefill_tokens()), (1, 50));
        assert_eq!(load.in_flight_requests(), 1);
        // No first token before the end (an error, a disconnect): drop releases the prefill share too.
        drop(b);
        assert_eq!((load.queued_prefill_requests(), load.queued_prefill_tokens()), (0, 0));
        assert_eq!((load.in_flight_requests(), load.in_flight_tokens()), (0, 0));
    }

    #[test]
    fn prefill_progress_runs_from_an_empty_queue_or_the_last_first_token() {
        let load = Arc::new(EndpointLoad::default());
        assert_eq!(load.prefill_elapsed_us(500), 0, "nothing queued, nothing in progress");
        let mut a = LoadGuard::acquire_with_prefill(load.clone(), 100, 100, true, 1_000);
        // A second request joins the queue: the first one's prefill is still the one running.
        let mut b = LoadGuard::acquire_with_prefill(load.clone(), 100, 100, true, 4_000);
        assert_eq!(load.prefill_elapsed_us(5_000), 4_000);
        assert_eq!(
            load.prefill_elapsed_us(900),
            0,
            "a clock behind the start sees no progress"
        );
        // The first token of `a`: `b` begins now.
        a.first_token(6_000);
        assert_eq!(load.prefill_elapsed_us(6_500), 500);
        // A repeated call changes nothing.
        a.first_token(9_000);
        assert_eq!(load.prefill_elapsed_us(9_000), 3_000);
        b.first_token(10_000);
        assert_eq!(load.prefill_elapsed_us(20_000), 0);
        // Dropped without a first token: the queue empties, and the next request starts a fresh clock.
        let c = LoadGuard::acquire_with_prefill(load.clone(), 100, 100, true, 30_000);
        drop(c);
        assert_eq!(load.prefill_elapsed_us(40_000), 0);
        let _d = LoadGuard::acquire_with_prefill(load.clone(), 100, 100, true, 41_000);
        assert_eq!(load.prefill_elapsed_us(42_000), 1_000);
    }

    #[test]
    fn completion_after_a_report_does_not_take_back_newer_speculation() {
        let load = Arc::new(EndpointLoad::default());
        let old = LoadGuard::acquire(load.clone(), 10, true);
        assert!(load.apply_report(report(1, 10, 1)));
        let _new = LoadGuard::acquire(load.clone(), 20, true);
        drop(old);
        assert_eq!(
            load.view(),
            LoadView {
                requests: 2,
                tokens: 30
            }
        );
        assert_eq!(load.in_flight_requests(), 1);
    }
}
