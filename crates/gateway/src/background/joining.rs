//! Discovery's one way into the registry: each source ([`crate::discovery::kubernetes`], [`crate::discovery::dns`]) says which workers
//! it finds now, and a reconciler applies the difference as membership changes. The workers gone are removed in
//! one change ([`crate::fleet::registry::Registry::remove_workers`]: no new request goes there, requests in flight
//! finish, their feeds stop). The new ones whose rank count is known (given, or one) are added in one change
//! without being asked anything ([`AppState::add_found`]): each is routable once its first health probe passes and
//! it has said what it serves, which the health loop does at once for new workers ([`crate::background::health`]); so a list
//! of 10,000 endpoints is one snapshot rebuild, and no request reaches an endpoint never probed. An SGLang worker
//! whose rank count only it can tell is asked first ([`AppState::add_worker`], as `POST /workers` is). A worker
//! that cannot be added yet is tried again every second. A worker whose description changed (an annotation) is
//! removed and added again. Workers from the config file or `POST /workers` are never touched; a URL already
//! registered that way is left to it.
//!
//! The gateway is ready (`/readiness`, the Endpoint Picker's gRPC health) once every source has delivered its
//! first list and that list was applied once. Shutdown does not wait for a list being applied.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;
use std::time::Duration;

use dprouter_core::WorkerId;
use futures_util::StreamExt;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::discovery::Found;
use crate::config::worker::WorkerConfig;
use crate::state::{ranks_known, AppState, StartError};

/// The wait before a worker that could not be added is tried again.
const RETRY: Duration = Duration::from_secs(1);
/// Workers whose rank count must be asked (SGLang without `dp_size`) asked at once, at most.
const ASK_AT_ONCE: usize = 64;
/// Workers named in a log line about many, at most.
const SHOWN: usize = 3;

/// Starts every configured source and its reconciler; they end when `stopped` turns true.
pub fn spawn(state: &Arc<AppState>, stopped: watch::Receiver<bool>) -> Vec<JoinHandle<()>> {
    let mut tasks = Vec::new();
    for source in state.config.discovery.kubernetes.clone() {
        let label = source.label();
        // Checked when the state was built.
        let api = match crate::discovery::kubernetes::Api::new(&source) {
            Ok(api) => api,
            Err(e) => {
                tracing::error!(error = %e, "discovery source not started");
                continue;
            }
        };
        tracing::info!(source = %label, namespace = api.namespace(), "discovery started");
        let (found, seen) = watch::channel(None);
        tasks.push(tokio::spawn(crate::discovery::kubernetes::run(
            api,
            source,
            found,
            stopped.clone(),
        )));
        tasks.push(tokio::spawn(follow(Arc::clone(state), label, seen, stopped.clone())));
    }
    for source in state.config.discovery.dns.clone() {
        let label = source.label();
        tracing::info!(source = %label, interval_ms = source.interval_ms, "discovery started");
        let (found, seen) = watch::channel(None);
        let resolver = Arc::new(crate::discovery::dns::SystemResolver);
        tasks.push(tokio::spawn(crate::discovery::dns::run(
            source,
            resolver,
            found,
            stopped.clone(),
        )));
        tasks.push(tokio::spawn(follow(Arc::clone(state), label, seen, stopped.clone())));
    }
    tasks
}

/// Applies what one source finds (`seen`) to the registry until `stopped`.
pub async fn follow(
    state: Arc<AppState>,
    label: String,
    mut seen: watch::Receiver<Option<Found>>,
    mut stopped: watch::Receiver<bool>,
) {
    let mut reconciler = Reconciler::new(Arc::clone(&state), label);
    let mut synced = false;
    loop {
        let found = seen.borrow_and_update().clone();
        if let Some(found) = found {
            // Shutdown does not wait for workers being asked.
            tokio::select! {
                () = reconciler.apply(&found) => {}
                _ = stopped.wait_for(|s| *s) => return,
            }
            if !synced {
                synced = true;
                state.discovery_unsynced.send_modify(|n| *n = n.saturating_sub(1));
                tracing::info!(source = %reconciler.label, workers = reconciler.owned.len(), waiting = reconciler.waiting.len(), "discovery synced");
            }
        }
        tokio::select! {
            changed = seen.changed() => if changed.is_err() { return },
            () = tokio::time::sleep(RETRY), if !reconciler.waiting.is_empty() => {}
            _ = stopped.wait_for(|s| *s) => return,
        }
    }
}

/// One source's workers in the registry.
struct Reconciler {
    state: Arc<AppState>,
    label: String,
    /// What this source added, by URL.
    owned: BTreeMap<String, (WorkerId, WorkerConfig)>,
    /// Found but not added yet.
    waiting: BTreeMap<String, WorkerConfig>,
    /// URLs whose failure to be added was logged (once each).
    warned: BTreeSet<String>,
}

impl Reconciler {
    fn new(state: Arc<AppState>, label: String) -> Self {
        Self {
            state,
            label,
            owned: BTreeMap::new(),
            waiting: BTreeMap::new(),
            warned: BTreeSet::new(),
        }
    }

    /// Applies one list: the workers gone removed in one membership change, the new ones whose rank count is known
    /// added in one (unprobed: routable once their first probe passes), the others asked, at most [`ASK_AT_ONCE`]
    /// at a time.
    async fn apply(&mut self, found: &Found) {
        let registered: HashSet<WorkerId> = self.state.registry.workers().iter().map(|w| w.id).collect();
        let mut gone = Vec::new();
        self.owned.retain(|url, (id, config)| {
            if !registered.contains(id) {
                // Removed by `DELETE /workers/{id}`: added again below while it is found.
                return false;
            }
            if found.get(url) == Some(&*config) {
                return true;
            }
            gone.push((url.clone(), *id));
            false
        });
        if !gone.is_empty() {
            let ids: Vec<WorkerId> = gone.iter().map(|(_, id)| *id).collect();
            let removed = self.state.registry.remove_workers(&ids);
            let urls: Vec<&str> = gone.iter().take(SHOWN).map(|(url, _)| url.as_str()).collect();
            tracing::info!(source = %self.label, removed, first = ?urls,
                           "workers removed: no new request goes there, requests in flight finish");
        }
        self.waiting = found
            .iter()
            .filter(|(url, _)| !self.owned.contains_key(*url))
            .map(|(url, w)| (url.clone(), w.clone()))
            .collect();
        self.warned.retain(|url| self.waiting.contains_key(url));
        let (known, unknown): (Vec<WorkerConfig>, Vec<WorkerConfig>) =
            self.waiting.values().cloned().partition(ranks_known);
        let mut results: Vec<(String, Result<WorkerId, StartError>)> = {
            let urls: Vec<String> = known.iter().map(|w| w.url.clone()).collect();
            urls.into_iter().zip(self.state.add_found(known)).collect()
        };
        let state = &self.state;
        let asked = futures_util::stream::iter(unknown)
            .map(|w| async move {
                let added = state.add_worker(&w).await.map(|(id, _)| id);
                (w.url, added)
            })
            .buffer_unordered(ASK_AT_ONCE)
            .collect::<Vec<_>>()
            .await;
        results.extend(asked);
        let (mut added, mut left, mut failed) = (Vec::new(), Vec::new(), Vec::new());
        for (url, result) in results {
            match result {
                Ok(id) => {
                    let worker = self.waiting.remove(&url).expect("found above");
                    tracing::debug!(source = %self.label, %url, worker = id.0, "worker discovered");
                    added.push(url.clone());
                    self.owned.insert(url, (id, worker));
                }
                Err(e) => {
                    if self.warned.insert(url.clone()) {
                        match e {
                            StartError::Duplicate { .. } => left.push(url),
                            e => failed.push(crate::common::throttled::clip(&e.to_string()).into_owned()),
                        }
                    }
                }
            }
        }
        let label = &self.label;
        if !added.is_empty() {
            tracing::info!(source = %label, added = added.len(), first = ?&added[..added.len().min(SHOWN)],
                           "workers discovered (each routable once its first health probe passes)");
        }
        if !left.is_empty() {
            tracing::info!(source = %label, count = left.len(), first = ?&left[..left.len().min(SHOWN)],
                           "found, but already registered (config file or POST /workers): left to it");
        }
        if !failed.is_empty() {
            tracing::warn!(source = %label, count = failed.len(), first = ?&failed[..failed.len().min(SHOWN)],
                           "found, not added yet: trying every second");
        }
    }
}
