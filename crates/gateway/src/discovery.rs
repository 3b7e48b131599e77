//! Discovery's one way into the registry: each source ([`crate::kubernetes`], [`crate::dns`]) says which workers
//! it finds now, and a reconciler adds the new ones the way `POST /workers` does ([`AppState::add_worker`]: the
//! same checks, SGLang's ranks asked, KV-event feeds started by the registry's change) and removes the ones gone
//! ([`crate::registry::Registry::remove_worker`]: no new request goes there, requests in flight finish, its feeds
//! stop). A worker that cannot be added yet (an SGLang engine still loading) is tried again every second. A
//! worker whose description changed (an annotation) is removed and added again. Workers from the config file or
//! `POST /workers` are never touched; a URL already registered that way is left to it.
//!
//! The gateway is ready (`/readiness`, the Endpoint Picker's gRPC health) once every source has delivered its
//! first list and that list was applied once.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use dprouter_core::WorkerId;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::discovery_config::Found;
use crate::state::{AppState, StartError};
use crate::worker_config::WorkerConfig;

/// The wait before a worker that could not be added is tried again.
const RETRY: Duration = Duration::from_secs(1);

/// Starts every configured source and its reconciler; they end when `stopped` turns true.
pub fn spawn(state: &Arc<AppState>, stopped: watch::Receiver<bool>) -> Vec<JoinHandle<()>> {
    let mut tasks = Vec::new();
    for source in state.config.discovery.kubernetes.clone() {
        let label = source.label();
        // Checked when the state was built.
        let api = match crate::kubernetes::Api::new(&source) {
            Ok(api) => api,
            Err(e) => {
                tracing::error!(error = %e, "discovery source not started");
                continue;
            }
        };
        tracing::info!(source = %label, namespace = api.namespace(), "discovery started");
        let (found, seen) = watch::channel(None);
        tasks.push(tokio::spawn(crate::kubernetes::run(
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
        let resolver = Arc::new(crate::dns::SystemResolver);
        tasks.push(tokio::spawn(crate::dns::run(source, resolver, found, stopped.clone())));
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
            reconciler.apply(&found).await;
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

    async fn apply(&mut self, found: &Found) {
        let registered: BTreeSet<WorkerId> = self.state.registry.workers().iter().map(|w| w.id).collect();
        let label = &self.label;
        self.owned.retain(|url, (id, config)| {
            if !registered.contains(id) {
                // Removed by `DELETE /workers/{id}`: added again below while it is found.
                return false;
            }
            if found.get(url) == Some(&*config) {
                return true;
            }
            self.state.registry.remove_worker(*id);
            tracing::info!(source = %label, %url, worker = id.0, "worker removed: no new request goes there, requests in flight finish");
            false
        });
        self.waiting = found
            .iter()
            .filter(|(url, _)| !self.owned.contains_key(*url))
            .map(|(url, w)| (url.clone(), w.clone()))
            .collect();
        self.warned.retain(|url| self.waiting.contains_key(url));
        let adds = self
            .waiting
            .values()
            .map(|w| async { (w.url.clone(), self.state.add_worker(w).await) });
        let results = futures_util::future::join_all(adds).await;
        for (url, result) in results {
            match result {
                Ok((id, dp_size)) => {
                    let worker = self.waiting.remove(&url).expect("found above");
                    tracing::info!(source = %self.label, %url, worker = id.0, dp_size, "worker discovered");
                    self.owned.insert(url, (id, worker));
                }
                Err(e) => {
                    if self.warned.insert(url.clone()) {
                        match e {
                            StartError::Duplicate { .. } => {
                                tracing::info!(source = %self.label, %url, "found, but already registered (config file or POST /workers): left to it")
                            }
                            e => {
                                tracing::warn!(source = %self.label, error = %e, "found, not added yet: trying every second")
                            }
                        }
                    }
                }
            }
        }
    }
}
