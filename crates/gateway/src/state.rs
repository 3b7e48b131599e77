//! Shared gateway state: configuration, membership, the policy, the upstream client, decision counters.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dprouter_core::{Branch, WorkerId};

use crate::config::{Backend, GatewayConfig, WorkerConfig};
use crate::fleet::policies::Policies;
use crate::fleet::registry::{Admission, Registry};
use crate::fleet::upstream::Upstream;

pub struct AppState {
    pub config: GatewayConfig,
    pub registry: Arc<Registry>,
    /// The routing policies: the default one, and one per model served.
    pub policies: Arc<Policies>,
    pub upstream: Upstream,
    /// TLS on the listener, when the config has a certificate.
    pub tls_acceptor: Option<tokio_rustls::TlsAcceptor>,
    /// The models' tokenizers, for token-exact keys.
    pub tokenizers: crate::admission::tokens::Tokenizers,
    /// Each KV event feed's status (precise mode).
    pub kv_feeds: crate::kv_feeds::Feeds,
    /// Which endpoint made each of the last Responses answers (for `previous_response_id`).
    pub responses: Arc<crate::common::response_homes::ResponseHomes>,
    /// The clients and their keys and limits (`[[clients]]`).
    pub clients: crate::admission::clients::Clients,
    /// Flow control's central queue, when it is on (`[flow_control]`).
    pub flow: Option<Arc<crate::admission::flow::FlowControl>>,
    /// Request body bytes held while bodies arrive, across requests (`max_buffered_body_bytes`).
    pub bodies: Arc<crate::admission::body_budget::BodyBudget>,
    /// Fired when the shutdown's drain deadline passes: streams still open end with an error event.
    pub drain_deadline: crate::common::drain_deadline::DrainDeadline,
    /// Discovery sources that have not delivered and applied their first list yet: the gateway is ready at 0
    /// ([`crate::background::joining`]).
    pub discovery_unsynced: tokio::sync::watch::Sender<usize>,
    /// Routing decisions by branch ([`Branch::index`]) since start (for `GET /workers`).
    decisions: [AtomicU64; Branch::ALL.len()],
    /// SGLang workers whose ranks are not known yet (down at start, no `dp_size` given): added, after the
    /// workers already serving, when they answer.
    pending: Mutex<Vec<WorkerConfig>>,
}

/// Why the gateway could not start or add a worker.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error("TLS: {0}")]
    Tls(String),
    #[error("cannot add worker {url}: {message}")]
    Worker { url: String, message: String },
    #[error("worker {url} is already registered as worker {id}; remove it first (DELETE /workers/{id}) to replace it")]
    Duplicate { url: String, id: u32 },
}

impl AppState {
    /// Validates the config and adds every worker (discovering SGLang's `dp_size` when not given).
    pub async fn new(config: GatewayConfig) -> Result<Arc<Self>, StartError> {
        config.validate()?;
        for source in &config.discovery.kubernetes {
            crate::discovery::kubernetes::Api::new(source)
                .map_err(|e| StartError::Config(crate::config::ConfigError::Invalid(e)))?;
        }
        let state = Arc::new(Self {
            registry: Arc::new(Registry::new(config.health.clone())),
            policies: Arc::new(Policies::new(&config)),
            upstream: Upstream::new(
                Duration::from_millis(config.connect_timeout_ms),
                Duration::from_millis(config.upstream_idle_timeout_ms),
                crate::http::tls::client_config(config.upstream_ca_file.as_deref(), "upstream_ca_file")
                    .map_err(StartError::Tls)?,
            ),
            tls_acceptor: crate::http::tls::acceptor(&config.server, crate::http::tls::HTTP1)
                .map_err(StartError::Tls)?,
            kv_feeds: Default::default(),
            tokenizers: crate::admission::tokens::Tokenizers::load(&config)
                .map_err(|e| StartError::Config(crate::config::ConfigError::Invalid(e)))?,
            responses: Arc::new(crate::common::response_homes::ResponseHomes::new(
                config.remembered_responses,
            )),
            clients: crate::admission::clients::Clients::new(&config.clients),
            flow: crate::admission::flow::FlowControl::new(&config.flow_control, {
                let poll = config.load.poll_interval_ms;
                if poll > 0 {
                    poll + config.health.timeout_ms
                } else {
                    0
                }
            }),
            bodies: crate::admission::body_budget::BodyBudget::new(config.body_budget()),
            drain_deadline: Default::default(),
            discovery_unsynced: tokio::sync::watch::Sender::new(config.discovery.sources()),
            decisions: Default::default(),
            pending: Mutex::new(Vec::new()),
            config,
        });
        for worker in state.config.workers.clone() {
            match state.add_worker(&worker).await {
                Ok(_) => {}
                // Its rank count can only come from the worker itself: wait for it rather than refuse to start.
                Err(StartError::Worker { url, message }) if worker.dp_size.is_none() => {
                    tracing::warn!(%url, error = %message, "worker pending: its ranks are added when it answers");
                    state.lock_pending().push(worker);
                }
                Err(e) => return Err(e),
            }
        }
        Ok(state)
    }

    fn lock_pending(&self) -> std::sync::MutexGuard<'_, Vec<WorkerConfig>> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The URLs of workers still waiting to be discovered.
    pub fn pending_workers(&self) -> Vec<String> {
        self.lock_pending().iter().map(|w| w.url.clone()).collect()
    }

    /// Tries to add every pending worker once; returns how many are still pending.
    pub async fn add_pending_workers(&self) -> usize {
        let waiting = self.lock_pending().clone();
        for worker in waiting {
            if self.add_worker(&worker).await.is_ok() {
                self.lock_pending().retain(|w| *w != worker);
            }
        }
        self.lock_pending().len()
    }

    /// Adds one worker at run time: its ranks and models are asked first, so it is routable at once.
    pub async fn add_worker(&self, worker: &WorkerConfig) -> Result<(WorkerId, u32), StartError> {
        crate::config::validate_worker(worker)?;
        self.check_not_registered(worker)?;
        let info = self
            .upstream
            .discover(worker, self.discover_timeout())
            .await
            .map_err(|message| StartError::Worker {
                url: worker.url.clone(),
                message,
            })?;
        // The registry checks again, atomically: another request may have added it while this one asked.
        let id = self
            .registry
            .add_worker(worker, info.clone())
            .map_err(|id| StartError::Duplicate {
                url: worker.url.clone(),
                id: id.0,
            })?;
        // The capacity the worker got: the configured one, else what the engine said.
        let kv_capacity = worker.kv_capacity_tokens.or(info.kv_capacity);
        tracing::info!(url = %worker.url, backend = worker.backend.as_str(), dp_size = info.dp_size,
                       kv_capacity = ?kv_capacity, worker = id.0, "worker added");
        Ok((id, info.dp_size))
    }

    /// Adds workers found by discovery in one membership change, without asking them anything: each is routable
    /// once its first health probe passes and its models are known ([`Admission::Unprobed`]). Their rank counts
    /// must be known ([`ranks_known`]); the others go through [`AppState::add_worker`]. One result per worker.
    pub fn add_found(&self, workers: Vec<WorkerConfig>) -> Vec<Result<WorkerId, StartError>> {
        let mut results: Vec<Option<Result<WorkerId, StartError>>> = Vec::with_capacity(workers.len());
        let mut batch = Vec::new();
        for worker in workers {
            let checked = crate::config::validate_worker(&worker).map_err(StartError::from);
            match checked {
                Ok(()) if ranks_known(&worker) => {
                    results.push(None);
                    batch.push((worker, Admission::Unprobed));
                }
                Ok(()) => results.push(Some(Err(StartError::Worker {
                    url: worker.url.clone(),
                    message: "its rank count is not known: it is asked first".into(),
                }))),
                Err(e) => results.push(Some(Err(e))),
            }
        }
        let urls: Vec<String> = batch.iter().map(|(w, _)| w.url.clone()).collect();
        let mut added = self.registry.add_workers(batch).into_iter().zip(urls);
        results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| {
                    let (result, url) = added.next().expect("one result per worker added");
                    result.map_err(|id| StartError::Duplicate { url, id: id.0 })
                })
            })
            .collect()
    }

    /// How long asking a worker what it serves may take.
    pub fn discover_timeout(&self) -> Duration {
        Duration::from_millis(self.config.health.timeout_ms.max(self.config.connect_timeout_ms))
    }

    /// A worker whose URL (normalized: [`crate::config::worker_url_key`]) is already registered is a [`StartError::Duplicate`].
    fn check_not_registered(&self, worker: &WorkerConfig) -> Result<(), StartError> {
        match self.registry.registered(&worker.url) {
            Some(id) => Err(StartError::Duplicate {
                url: worker.url.clone(),
                id: id.0,
            }),
            None => Ok(()),
        }
    }

    /// Whether every discovery source has delivered and applied its first list.
    pub fn discovery_synced(&self) -> bool {
        *self.discovery_unsynced.borrow() == 0
    }

    pub fn count_decision(&self, branch: Branch) {
        self.decisions[branch.index()].fetch_add(1, Relaxed);
    }

    /// The branches taken at least once, with their counts.
    pub fn decisions_by_branch(&self) -> BTreeMap<&'static str, u64> {
        Branch::ALL
            .iter()
            .map(|b| (b.as_str(), self.decisions[b.index()].load(Relaxed)))
            .filter(|&(_, n)| n > 0)
            .collect()
    }
}

/// Whether a worker's rank count is known without asking it: configured, or one (vLLM and OpenAI-style servers
/// without `dp_size` take one); an SGLang worker without `dp_size` reports it.
pub fn ranks_known(worker: &WorkerConfig) -> bool {
    worker.dp_size.is_some() || worker.backend != Backend::Sglang
}
