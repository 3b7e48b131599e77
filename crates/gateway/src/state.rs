//! Shared gateway state: configuration, membership, the policy, the upstream client, decision counters.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dprouter_core::{Branch, Policy, WorkerId};

use crate::config::{GatewayConfig, WorkerConfig};
use crate::registry::Registry;
use crate::upstream::Upstream;

pub struct AppState {
    pub config: GatewayConfig,
    pub registry: Arc<Registry>,
    pub policy: Box<dyn Policy>,
    pub upstream: Upstream,
    /// Routing decisions by branch since start (for `GET /workers`).
    decisions: Mutex<Decisions>,
}

#[derive(Default)]
struct Decisions {
    by_branch: BTreeMap<&'static str, u64>,
}

/// Why the gateway could not start or add a worker.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error("cannot add worker {url}: {message}")]
    Worker { url: String, message: String },
}

impl AppState {
    /// Validates the config and adds every worker (discovering SGLang's `dp_size` when not given).
    pub async fn new(config: GatewayConfig) -> Result<Arc<Self>, StartError> {
        config.validate()?;
        let state = Arc::new(Self {
            registry: Arc::new(Registry::new(config.health.clone())),
            policy: config.routing.build(),
            upstream: Upstream::new(Duration::from_millis(config.connect_timeout_ms)),
            decisions: Mutex::new(Decisions::default()),
            config,
        });
        for worker in state.config.workers.clone() {
            state.add_worker(&worker).await?;
        }
        Ok(state)
    }

    /// Adds one worker at run time.
    pub async fn add_worker(&self, worker: &WorkerConfig) -> Result<(WorkerId, u32), StartError> {
        crate::config::validate_worker(worker)?;
        let timeout = Duration::from_millis(self.config.health.timeout_ms.max(self.config.connect_timeout_ms));
        let info = self
            .upstream
            .discover(worker, timeout)
            .await
            .map_err(|message| StartError::Worker {
                url: worker.url.clone(),
                message,
            })?;
        let id = self.registry.add_worker(worker, info);
        tracing::info!(url = %worker.url, backend = worker.backend.as_str(), dp_size = info.dp_size,
                       kv_capacity = ?info.kv_capacity, worker = id.0, "worker added");
        Ok((id, info.dp_size))
    }

    pub fn count_decision(&self, branch: Branch) {
        let mut d = self.decisions.lock().unwrap_or_else(|e| e.into_inner());
        *d.by_branch.entry(branch.as_str()).or_default() += 1;
    }

    pub fn decisions_by_branch(&self) -> BTreeMap<&'static str, u64> {
        self.decisions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .by_branch
            .clone()
    }
}
