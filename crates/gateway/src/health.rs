//! Background work, owned by the supervisor: active health probes (on their interval, and at once when a request
//! failure asks for one), the outlier-ejection sweep, and SGLang load polling. Health itself is decided in
//! [`crate::registry`].

use std::sync::Arc;
use std::time::Duration;

use dprouter_core::EngineReport;
use futures_util::future::join_all;
use serde_json::Value;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::Backend;
use crate::state::AppState;
use crate::upstream::ProbeError;

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

/// Probes every worker each `interval_ms`, and at once when a failed request asks for it.
async fn probe_loop(state: Arc<AppState>, mut stop: watch::Receiver<bool>) {
    let health = state.config.health.clone();
    let timeout = Duration::from_millis(health.timeout_ms);
    let mut ticker = tokio::time::interval(Duration::from_millis(health.interval_ms));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Each worker's last probe result: a probe that fails after one that did not (or first) is logged at `warn`
    // with its reason (a refused connection, a TLS certificate the gateway does not trust, a status), once.
    let mut last_ok: std::collections::HashMap<dprouter_core::WorkerId, bool> = Default::default();
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            () = state.registry.probe_requested() => {}
            _ = stop.changed() => return,
        }
        let workers = state.registry.workers();
        let probes = join_all(workers.iter().map(|w| state.upstream.probe(&w.url, timeout)));
        let Some(results) = until_stopped(&mut stop, probes).await else {
            return;
        };
        last_ok.retain(|id, _| workers.iter().any(|w| w.id == *id));
        let now_us = crate::clock::now_us();
        for (w, result) in workers.iter().zip(results) {
            // A slow /health of a worker that is answering requests counts neither way.
            let serving = matches!(result, Err(ProbeError::Slow(_))) && state.registry.record_slow_probe(w.id, now_us);
            if serving {
                tracing::debug!(worker = w.id.0, url = %w.url, "slow health probe of a worker that is serving");
                continue;
            }
            let was_ok = last_ok.insert(w.id, result.is_ok());
            match &result {
                Err(reason) if was_ok != Some(false) => {
                    tracing::warn!(worker = w.id.0, url = %w.url, error = %reason, "health probe failed")
                }
                Ok(()) if was_ok == Some(false) => {
                    tracing::info!(worker = w.id.0, url = %w.url, "health probe answered again")
                }
                _ => {}
            }
            if !matches!(result, Err(ProbeError::Slow(_))) {
                state.registry.record_probe(w.id, result.is_ok());
            }
        }
    }
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
        if let Some(handle) = crate::telemetry::handle() {
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
            let answers = join_all(urls.iter().map(|u| state.upstream.get_json(u, timeout))).await;
            for (w, answer) in workers.iter().zip(answers) {
                let Ok(Value::Array(ranks)) = answer else { continue };
                for rank in &ranks {
                    let Some(report) = parse_report(rank) else { continue };
                    let dp_rank = rank.get("dp_rank").and_then(Value::as_u64).unwrap_or(u64::MAX);
                    if let Some(e) = w.endpoints.iter().find(|e| u64::from(e.id.dp_rank) == dp_rank) {
                        e.load.apply_report(report);
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
