//! Background work, owned by the supervisor: active health probes (on their interval, and at once when a request
//! failure asks for one), the outlier-ejection sweep, and SGLang load polling. Health itself is decided in
//! [`crate::fleet::registry`].

use std::sync::Arc;
use std::time::Duration;

use std::collections::{HashMap, HashSet};

use dprouter_core::{EngineReport, WorkerId};
use futures_util::future::join_all;
use futures_util::StreamExt;
use serde_json::Value;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::common::throttled::Throttled;
use crate::config::Backend;
use crate::fleet::registry::WorkerState;
use crate::fleet::upstream::{ProbeError, WorkerInfo};
use crate::state::AppState;

/// Starts the background tasks; they stop when `stop` turns true.
pub fn spawn(state: Arc<AppState>, stop: watch::Receiver<bool>) -> Vec<JoinHandle<()>> {
    let mut tasks = vec![
        tokio::spawn(probe_loop(Arc::clone(&state), stop.clone())),
        tokio::spawn(sweep_loop(Arc::clone(&state), stop.clone())),
        tokio::spawn(metrics_upkeep(stop.clone())),
    ];
    if !state.pending_workers().is_empty() {
        tasks.push(tokio::spawn(pending_loop(Arc::clone(&state), stop.clone())));
    }
    if state.config.load.poll_interval_ms > 0 {
        tasks.push(tokio::spawn(load_loop(state, stop)));
    }
    tasks
}

/// `work`'s output, or `None` if `stop` turns true first: a round in flight (a probe waiting for its timeout) does
/// not hold the shutdown up.
async fn until_stopped<T>(stop: &mut watch::Receiver<bool>, work: impl std::future::Future<Output = T>) -> Option<T> {
    if *stop.borrow() {
        return None;
    }
    tokio::select! {
        out = work => Some(out),
        _ = stop.wait_for(|stopped| *stopped) => None,
    }
}

/// Runs `round` every `interval` until stopped.
async fn every<F, Fut>(interval: Duration, mut stop: watch::Receiver<bool>, mut round: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = stop.changed() => {}
        }
        if until_stopped(&mut stop, round()).await.is_none() {
            return;
        }
    }
}

/// Probes every worker once per `interval_ms` (one that is down, or found and never up, less and less often, down
/// to once per `unhealthy_interval_ms`: [`Prober::due`]), the round's probes spread evenly over the interval and
/// at most `max_concurrent_probes` in flight; and at once the workers a failed request made suspect and those
/// discovery just found ([`Prober::due_now`]). A found worker whose probe passes is asked what it serves and
/// admitted ([`crate::fleet::registry::Registry::admit_all`]). Results are recorded in batches: one snapshot rebuild for
/// many workers whose health changed.
async fn probe_loop(state: Arc<AppState>, mut stop: watch::Receiver<bool>) {
    let interval = Duration::from_millis(state.config.health.interval_ms);
    let prober = Prober::new(Arc::clone(&state));
    loop {
        let round_start = tokio::time::Instant::now();
        let round = prober.probe(prober.due(state.registry.workers(), round_start), interval);
        let mut round = std::pin::pin!(round);
        // The round, interleaved with probes due now, until the interval has passed and the round is done.
        let mut done = false;
        loop {
            tokio::select! {
                () = &mut round, if !done => done = true,
                () = tokio::time::sleep_until(round_start + interval), if done => break,
                () = state.registry.probe_requested() => {
                    let due = prober.due_now();
                    if until_stopped(&mut stop, prober.probe(due, Duration::ZERO)).await.is_none() {
                        return;
                    }
                }
                _ = stop.changed() => return,
            }
        }
    }
}

/// A round's probes start in groups this far apart.
const SPREAD_STEP: Duration = Duration::from_millis(20);

/// Admissions are recorded together at most this often during a round (each is a snapshot rebuild).
const ADMIT_EVERY: Duration = Duration::from_millis(100);

/// What one probe found.
enum Outcome {
    /// A probe of a worker in service: passed, or failed.
    Probed(bool),
    /// A found worker passed its first probe and said what it serves.
    Admit(WorkerInfo),
    /// A slow `/health` of a worker that is serving: counts neither way.
    Serving,
}

/// The probes' shared limit and their logs.
struct Prober {
    state: Arc<AppState>,
    slots: tokio::sync::Semaphore,
    concurrency: usize,
    timeout: Duration,
    /// Each worker's last probe result: a probe that fails after one that did not (or first) is logged at `warn`
    /// with its reason (a refused connection, a TLS certificate the gateway does not trust, a status), once; at
    /// most one such line per [`crate::common::throttled::LOG_EVERY`], counting the others (a fleet of dead endpoints).
    last_ok: std::sync::Mutex<HashMap<WorkerId, bool>>,
    /// When each worker was last probed, for the slower interval of those down.
    last_probed: std::sync::Mutex<HashMap<WorkerId, tokio::time::Instant>>,
    interval: Duration,
    unhealthy_interval: Duration,
    failed_log: std::sync::Mutex<Throttled>,
    back_log: std::sync::Mutex<Throttled>,
}

impl Prober {
    fn new(state: Arc<AppState>) -> Self {
        let health = &state.config.health;
        let concurrency = health.max_concurrent_probes as usize;
        Self {
            slots: tokio::sync::Semaphore::new(concurrency),
            concurrency,
            timeout: Duration::from_millis(health.timeout_ms),
            last_ok: Default::default(),
            last_probed: Default::default(),
            interval: Duration::from_millis(health.interval_ms),
            unhealthy_interval: Duration::from_millis(health.unhealthy_interval_ms),
            failed_log: Default::default(),
            back_log: Default::default(),
            state,
        }
    }

    /// The workers due in a round starting `now`: those routable, and those down whose wait since their last probe
    /// ends within the round. A worker down waits the interval, doubled for each failed probe past
    /// `failure_threshold`, up to `unhealthy_interval` (as HAProxy's `downinter`, growing): one that just went
    /// down (a restart) is back within a few intervals, and a fleet's long-dead endpoints cost little. Workers gone
    /// are forgotten.
    fn due(&self, workers: Vec<Arc<WorkerState>>, now: tokio::time::Instant) -> Vec<Arc<WorkerState>> {
        let mut last_probed = lock(&self.last_probed);
        let present: HashSet<WorkerId> = workers.iter().map(|w| w.id).collect();
        last_probed.retain(|id, _| present.contains(id));
        let threshold = self.state.config.health.failure_threshold;
        let longest = self.unhealthy_interval.max(self.interval);
        let wait = |w: &WorkerState| {
            let doublings = w.probe_failures().saturating_sub(threshold).min(16);
            (self.interval * (1 << doublings)).min(longest)
        };
        workers
            .into_iter()
            .filter(|w| {
                let waited = |at: &tokio::time::Instant| *at + wait(w) < now + self.interval;
                w.active_healthy() || last_probed.get(&w.id).is_none_or(waited)
            })
            .collect()
    }

    /// The workers to probe at once: those a failed request made suspect, and those found and never probed yet
    /// (one found earlier that has failed waits its turn in the rounds, however many requests fail elsewhere).
    fn due_now(&self) -> Vec<Arc<WorkerState>> {
        let last_probed = lock(&self.last_probed);
        let mut due = self.state.registry.due_now();
        due.retain(|w| w.unprobed.is_none() || !last_probed.contains_key(&w.id));
        due
    }

    /// Probes `workers`, their start times spread evenly over `spread`, and records what they found.
    async fn probe(&self, workers: Vec<Arc<WorkerState>>, spread: Duration) {
        let count = u32::try_from(workers.len().max(1)).unwrap_or(u32::MAX);
        let start = tokio::time::Instant::now();
        let present: HashSet<WorkerId> = workers.iter().map(|w| w.id).collect();
        let probes = futures_util::stream::iter(workers.into_iter().zip(0u32..))
            .map(|(w, i)| async move {
                // Started in groups a few milliseconds apart: a probe at its own instant each would wake the runtime
                // for every one of them.
                let offset = spread / count * i;
                let offset = offset - Duration::from_nanos((offset.as_nanos() % SPREAD_STEP.as_nanos()) as u64);
                tokio::time::sleep_until(start + offset).await;
                let _slot = self.slots.acquire().await;
                lock(&self.last_probed).insert(w.id, tokio::time::Instant::now());
                let outcome = self.probe_one(&w).await;
                (w, outcome)
            })
            .buffer_unordered(self.concurrency)
            .ready_chunks(256);
        let mut probes = std::pin::pin!(probes);
        let mut admitted = Vec::new();
        let mut last_admitted = tokio::time::Instant::now();
        while let Some(chunk) = probes.next().await {
            self.record(chunk, &mut admitted);
            if !admitted.is_empty() && last_admitted.elapsed() >= ADMIT_EVERY {
                self.state.registry.admit_all(std::mem::take(&mut admitted));
                last_admitted = tokio::time::Instant::now();
            }
        }
        if !admitted.is_empty() {
            self.state.registry.admit_all(admitted);
        }
        if spread > Duration::ZERO {
            self.lock_last_ok().retain(|id, _| present.contains(id));
        }
    }

    async fn probe_one(&self, w: &WorkerState) -> Outcome {
        let state = &self.state;
        let result = state.upstream.probe(&w.url, w.auth.as_ref(), self.timeout).await;
        if let Some(config) = &w.unprobed {
            // Found by discovery: routable once it answers, and once it says what it serves.
            if let Err(reason) = &result {
                self.log_failure(w, reason);
                return Outcome::Probed(false);
            }
            return match state.upstream.discover(config, state.discover_timeout()).await {
                Ok(info) => Outcome::Admit(info),
                Err(reason) => {
                    self.log_failure(w, &ProbeError::Failed(reason));
                    Outcome::Probed(false)
                }
            };
        }
        // A slow /health of a worker that is answering requests counts neither way.
        if matches!(result, Err(ProbeError::Slow(_)))
            && state.registry.record_slow_probe(w.id, crate::common::clock::now_us())
        {
            tracing::debug!(worker = w.id.0, url = %w.url, "slow health probe of a worker that is serving");
            return Outcome::Serving;
        }
        match &result {
            Err(reason) => self.log_failure(w, reason),
            Ok(()) => {
                if self.lock_last_ok().insert(w.id, true) == Some(false) {
                    if let Some(suppressed) = lock(&self.back_log).ready() {
                        tracing::info!(worker = w.id.0, url = %w.url, suppressed, "health probe answered again");
                    }
                }
            }
        }
        match result {
            // Already recorded by `record_slow_probe`.
            Err(ProbeError::Slow(_)) => Outcome::Serving,
            result => Outcome::Probed(result.is_ok()),
        }
    }

    fn log_failure(&self, w: &WorkerState, reason: &ProbeError) {
        if self.lock_last_ok().insert(w.id, false) != Some(false) {
            if let Some(suppressed) = lock(&self.failed_log).ready() {
                tracing::warn!(worker = w.id.0, url = %w.url, error = %crate::common::throttled::clip(&reason.to_string()),
                               suppressed, "health probe failed");
            }
        }
    }

    /// Records a batch of probes; the workers to admit are added to `admitted` (recorded together later).
    fn record(&self, chunk: Vec<(Arc<WorkerState>, Outcome)>, admitted: &mut Vec<(WorkerId, WorkerInfo)>) {
        let mut probes = Vec::with_capacity(chunk.len());
        for (w, outcome) in chunk {
            match outcome {
                Outcome::Probed(ok) => probes.push((w.id, ok)),
                Outcome::Admit(info) => admitted.push((w.id, info)),
                Outcome::Serving => {}
            }
        }
        self.state.registry.record_probes(&probes);
    }

    fn lock_last_ok(&self) -> std::sync::MutexGuard<'_, HashMap<WorkerId, bool>> {
        lock(&self.last_ok)
    }
}

fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// Discovers the workers that were down at start, each probe interval, until none is left.
async fn pending_loop(state: Arc<AppState>, mut stop: watch::Receiver<bool>) {
    let mut ticker = tokio::time::interval(Duration::from_millis(state.config.health.interval_ms));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = stop.changed() => return,
        }
        if until_stopped(&mut stop, state.add_pending_workers()).await.unwrap_or(0) == 0 {
            return;
        }
    }
}

/// The Prometheus recorder keeps histogram samples until they are drained: by a scrape, or by this upkeep, so
/// that a gateway nobody scrapes does not grow (the exporter's own `build()` does the same every 5 s).
async fn metrics_upkeep(stop: watch::Receiver<bool>) {
    every(Duration::from_secs(5), stop, || {
        if let Some(handle) = crate::observe::telemetry::handle() {
            handle.run_upkeep();
        }
        std::future::ready(())
    })
    .await;
}

/// How often ejections are checked for their end: a small fraction of the shortest ejection.
const SWEEP_INTERVAL: Duration = Duration::from_millis(100);

async fn sweep_loop(state: Arc<AppState>, stop: watch::Receiver<bool>) {
    every(SWEEP_INTERVAL, stop, || {
        state.registry.sweep(std::time::Instant::now());
        std::future::ready(())
    })
    .await;
}

async fn load_loop(state: Arc<AppState>, stop: watch::Receiver<bool>) {
    let interval = Duration::from_millis(state.config.load.poll_interval_ms);
    let timeout = Duration::from_millis(state.config.health.timeout_ms);
    every(interval, stop, || {
        let state = Arc::clone(&state);
        async move {
            let workers = state.registry.workers_of(Backend::Sglang);
            let urls: Vec<String> = workers.iter().map(|w| format!("{}/get_load", w.url)).collect();
            let asked = urls
                .iter()
                .zip(&workers)
                .map(|(u, w)| state.upstream.get_json(u, w.auth.as_ref(), timeout));
            let answers = join_all(asked).await;
            for (w, answer) in workers.iter().zip(answers) {
                let Ok(Value::Array(ranks)) = answer else { continue };
                for rank in &ranks {
                    let Some(report) = parse_report(rank) else { continue };
                    let dp_rank = rank.get("dp_rank").and_then(Value::as_u64).unwrap_or(u64::MAX);
                    if let Some(e) = w.endpoints.iter().find(|e| u64::from(e.id.dp_rank) == dp_rank) {
                        e.load.apply_report(report);
                        // Fresh for flow control's staleness limit, whatever its own timestamp says.
                        e.load.mark_reported(crate::common::clock::now_us());
                    }
                }
            }
        }
    })
    .await;
}

/// One element of SGLang's `/get_load` list.
fn parse_report(rank: &Value) -> Option<EngineReport> {
    Some(EngineReport {
        requests: rank.get("num_reqs")?.as_u64()?,
        waiting: rank.get("num_waiting_reqs").and_then(Value::as_u64).unwrap_or(0),
        tokens: rank.get("num_tokens").and_then(Value::as_u64).unwrap_or(0),
        // `ts_tic` is seconds as a float; keep microseconds.
        timestamp: (rank.get("ts_tic")?.as_f64()? * 1e6) as u64,
        queued_prefill_tokens: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A worker down is probed after the interval, then after twice as long for each further failure, up to
    /// `unhealthy_interval_ms`; one in service at every round.
    #[tokio::test(start_paused = true)]
    async fn down_workers_are_probed_less_and_less_often() {
        let state = AppState::new(crate::GatewayConfig::default()).await.unwrap();
        let worker = crate::WorkerConfig {
            url: "http://10.0.0.1:8000".into(),
            backend: Backend::Vllm,
            dp_size: Some(1),
            ..Default::default()
        };
        let info = WorkerInfo {
            dp_size: 1,
            kv_capacity: None,
            models: Vec::new(),
        };
        let id = state.registry.add_worker(&worker, info).unwrap();
        let prober = Prober::new(Arc::clone(&state));
        let start = tokio::time::Instant::now();
        // The first round (in seconds from the last probe, rounds every 2 s) at which the worker is due.
        let first_due = || {
            lock(&prober.last_probed).insert(id, start);
            (0..20u64).map(|k| 2 * k).find(|&s| {
                !prober
                    .due(state.registry.workers(), start + Duration::from_secs(s))
                    .is_empty()
            })
        };
        assert_eq!(first_due(), Some(0), "in service: every round");
        let mut waits = Vec::new();
        for _ in 0..6 {
            state.registry.record_probe(id, false);
            waits.push(first_due().unwrap());
        }
        // The first failure leaves it in service (failure_threshold 2); then 2, 4, 8 s, and 10 s at most.
        assert_eq!(waits, [0, 2, 4, 8, 10, 10]);

        // A worker discovery found is probed at once, once: later it waits its turn in the rounds.
        let found = crate::WorkerConfig {
            url: "http://10.0.0.2:8000".into(),
            ..worker
        };
        let found = state.add_found(vec![found]).pop().unwrap().unwrap();
        let due_now = || prober.due_now().iter().map(|w| w.id).collect::<Vec<_>>();
        assert_eq!(due_now(), [found]);
        lock(&prober.last_probed).insert(found, start);
        assert_eq!(due_now(), Vec::<WorkerId>::new());
    }

    #[test]
    fn parses_sglang_load_entries() {
        let v =
            serde_json::json!({"dp_rank": 1, "num_reqs": 3, "num_waiting_reqs": 1, "num_tokens": 900, "ts_tic": 2.5});
        assert_eq!(
            parse_report(&v),
            Some(EngineReport {
                requests: 3,
                waiting: 1,
                tokens: 900,
                timestamp: 2_500_000,
                queued_prefill_tokens: None,
            })
        );
        assert_eq!(parse_report(&serde_json::json!({"dp_rank": 1})), None);
    }
}
