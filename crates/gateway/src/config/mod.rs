//! The gateway's typed configuration (TOML), every field documented in `docs/gateway.md`.
//!
//! Unknown fields and unknown policies are start-up errors. Command-line flags override the file.

pub mod clients;
pub mod discovery;
pub mod flow;
pub mod worker;

use std::net::SocketAddr;
use std::path::Path;

use dprouter_core::PolicyConfig;
use serde::{Deserialize, Serialize};

pub use crate::config::worker::{
    validate_worker, worker_url_key, Backend, ConfigError, EventEndpoints, RankField, Role, WorkerConfig, WorkerEvents,
    MAX_DP_SIZE,
};

/// Active and passive health checking.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HealthConfig {
    /// Interval between active `GET /health` probes of each worker, milliseconds.
    pub interval_ms: u64,
    /// The longest interval between probes of a worker that is down or has never answered, milliseconds: such a
    /// worker is probed at `interval_ms`, the wait doubling with each failed probe past `failure_threshold` up to
    /// this, so one that just went down is back within a few intervals and a fleet's dead endpoints cost little.
    pub unhealthy_interval_ms: u64,
    /// Probe timeout, milliseconds.
    pub timeout_ms: u64,
    /// Consecutive failed probes that mark a worker's endpoints down.
    pub failure_threshold: u32,
    /// Consecutive successful probes that bring them back.
    pub success_threshold: u32,
    /// Consecutive failures of one endpoint (5xx answers, refused connections, broken streams, first-byte
    /// timeouts) that eject it from routing. A request's own fault (4xx, a client disconnect) never counts.
    pub passive_failure_threshold: u32,
    /// How long an endpoint's first ejection lasts, milliseconds; each ejection in a row doubles it.
    pub base_ejection_ms: u64,
    /// The longest ejection, milliseconds.
    pub max_ejection_ms: u64,
    /// At most this share of all endpoints (percent) is ejected at once; at least one may always be.
    pub max_ejection_percent: u32,
    /// Below this share of routable endpoints (percent), route across all endpoints (panic mode).
    pub panic_threshold_percent: u32,
    /// Probes in flight at once, across all workers. Each round's probes are spread over `interval_ms`; a fleet
    /// that needs more than this many at once (many workers, slow answers) gets rounds longer than the interval.
    pub max_concurrent_probes: u32,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            interval_ms: 2000,
            unhealthy_interval_ms: 10_000,
            timeout_ms: 1000,
            failure_threshold: 2,
            success_threshold: 2,
            passive_failure_threshold: 3,
            base_ejection_ms: 5_000,
            max_ejection_ms: 300_000,
            max_ejection_percent: 50,
            panic_threshold_percent: 50,
            max_concurrent_probes: 64,
        }
    }
}

/// The longest duration a setting in milliseconds takes: 7 days. Longer is a mistake (a deadline that never comes,
/// and a clock sum that overflows), refused with the rest of an invalid config.
pub const MAX_MS: u64 = 7 * 24 * 3600 * 1000;

/// Polling SGLang's `/get_load` into the load table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct LoadConfig {
    /// Interval of `GET /get_load` polls of SGLang workers, milliseconds; 0 turns polling off.
    pub poll_interval_ms: u64,
}

/// The client side of the gateway's HTTP server (`[server]`): timeouts and limits. Why each default is what it is:
/// `docs/operations.md`, "Timeouts and limits".
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServerConfig {
    /// From the first byte of a request to the end of its headers, milliseconds; the connection is closed after.
    pub header_read_timeout_ms: u64,
    /// From the end of a generation request's headers to the end of its body, milliseconds; 408 after.
    pub request_body_timeout_ms: u64,
    /// A connection with no request in flight and none arriving is closed after this long, milliseconds.
    pub idle_timeout_ms: u64,
    /// After SIGTERM or Ctrl-C, how long requests in flight may take to finish before their connections are cut.
    pub drain_timeout_ms: u64,
    /// Client connections open at once; more wait in the kernel's accept queue (keep it under `ulimit -n`).
    pub max_connections: u32,
    /// Generation requests in flight at once; more are answered 503 with `Retry-After: 1` at once.
    pub max_in_flight: u32,
    /// Browser origins allowed to call the gateway (CORS): `["*"]` for any, or exact origins such as
    /// `"https://app.example.com"`. Empty (the default): no CORS headers, and a preflight `OPTIONS` is a 405.
    pub cors_allow_origins: Vec<String>,
    /// One structured log line per answered request (target `dprouter::access`; fields: `docs/operations.md`,
    /// "Logs").
    pub access_log: bool,
    /// TLS on the listener: the certificate chain (PEM, leaf first). Set with `tls_key_file`, or neither.
    pub tls_cert_file: Option<std::path::PathBuf>,
    /// TLS on the listener: the certificate's private key (PEM).
    pub tls_key_file: Option<std::path::PathBuf>,
    /// Mutual TLS: clients must present a certificate issued by one of these authorities (PEM); needs
    /// `tls_cert_file`. For `dprouter epp`'s gRPC port, so that only the data plane can talk to the picker.
    pub tls_client_ca_file: Option<std::path::PathBuf>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            header_read_timeout_ms: 10_000,
            request_body_timeout_ms: 60_000,
            idle_timeout_ms: 75_000,
            drain_timeout_ms: 25_000,
            max_connections: 4096,
            max_in_flight: 2048,
            cors_allow_origins: Vec::new(),
            access_log: false,
            tls_cert_file: None,
            tls_key_file: None,
            tls_client_ca_file: None,
        }
    }
}

impl ServerConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        for (field, value) in [
            ("header_read_timeout_ms", self.header_read_timeout_ms),
            ("request_body_timeout_ms", self.request_body_timeout_ms),
            ("idle_timeout_ms", self.idle_timeout_ms),
            ("drain_timeout_ms", self.drain_timeout_ms),
            ("max_connections", u64::from(self.max_connections)),
            ("max_in_flight", u64::from(self.max_in_flight)),
        ] {
            if value == 0 {
                return Err(ConfigError::Invalid(format!("server.{field} must be positive")));
            }
        }
        if self.tls_cert_file.is_some() != self.tls_key_file.is_some() {
            return Err(ConfigError::Invalid(
                "server.tls_cert_file and server.tls_key_file go together: set both for TLS, or neither".into(),
            ));
        }
        if self.tls_client_ca_file.is_some() && self.tls_cert_file.is_none() {
            return Err(ConfigError::Invalid(
                "server.tls_client_ca_file checks clients' certificates over TLS: set tls_cert_file and tls_key_file too"
                    .into(),
            ));
        }
        for origin in &self.cors_allow_origins {
            let exact = origin.starts_with("http://") || origin.starts_with("https://");
            let valid = origin == "*" || (exact && axum::http::HeaderValue::from_str(origin).is_ok());
            if !valid || (origin == "*" && self.cors_allow_origins.len() > 1) {
                return Err(ConfigError::Invalid(format!(
                    "server.cors_allow_origins: {origin:?} is not an origin (\"*\" alone, or origins like \"https://app.example.com\")"
                )));
            }
        }
        Ok(())
    }
}

/// `[disaggregation]`: when a request for a vLLM decode server skips the prefill server and is prefilled by its
/// decode server (SGLang's decode servers cannot prefill: its requests always take both legs).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DisaggregationConfig {
    /// Prefill on the decode server when fewer of the prompt's tokens than this are predicted uncached there (the
    /// decode policy's prediction, `cache_aware`'s; with a policy that predicts nothing, the whole prompt); 0: never.
    pub local_prefill_below_tokens: u64,
    /// ... and those tokens are at most this share of the prompt (Dynamo's 0.7; 1: any share).
    pub local_prefill_max_share: f64,
    /// Prefill on the decode server when every prefill endpoint the request may take has at least this many prompt
    /// tokens waiting for their first token (the prefill pool is saturated); 0: never.
    pub prefill_busy_tokens: u64,
    /// The prefill leg's own deadline for its response head, milliseconds (at most the request's first-byte
    /// deadline); default: half of the request's (`first_byte_timeout_ms`, or the client's lower one), so that a
    /// prefill server that never answers is blamed for it, and the rest is left to the decode leg (under vLLM, to
    /// the decode server prefilling the prompt itself).
    pub prefill_first_byte_timeout_ms: Option<u64>,
}

impl Default for DisaggregationConfig {
    fn default() -> Self {
        Self {
            local_prefill_below_tokens: 0,
            local_prefill_max_share: 1.0,
            prefill_busy_tokens: 0,
            prefill_first_byte_timeout_ms: None,
        }
    }
}

impl DisaggregationConfig {
    pub fn validate(&self) -> Result<(), String> {
        let share = self.local_prefill_max_share;
        if !(0.0..=1.0).contains(&share) {
            return Err(format!(
                "disaggregation.local_prefill_max_share must be from 0 to 1, got {share}"
            ));
        }
        if self.prefill_first_byte_timeout_ms == Some(0) {
            return Err("disaggregation.prefill_first_byte_timeout_ms must be positive".into());
        }
        Ok(())
    }

    /// The prefill leg's time for its response head, of a request's `first_byte` budget.
    pub fn prefill_first_byte(&self, first_byte: std::time::Duration) -> std::time::Duration {
        match self.prefill_first_byte_timeout_ms {
            Some(ms) => std::time::Duration::from_millis(ms).min(first_byte),
            None => first_byte / 2,
        }
    }

    /// Whether `uncached` of `prompt` tokens are few enough to prefill on the decode server.
    pub fn few_uncached(&self, uncached: u64, prompt: u64) -> bool {
        uncached < self.local_prefill_below_tokens && uncached as f64 <= self.local_prefill_max_share * prompt as f64
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GatewayConfig {
    pub listen: SocketAddr,
    pub workers: Vec<WorkerConfig>,
    /// Workers found at run time: Kubernetes objects and DNS names (`docs/discovery.md`).
    pub discovery: crate::config::discovery::DiscoveryConfig,
    /// The policy and its options (`policy = "prefix_match"`, …); default `cache_aware`.
    pub routing: PolicyConfig,
    /// Under prefill/decode disaggregation, the policy that picks a request's prefill endpoint (`[prefill_routing]`,
    /// options as `[routing]`'s); default `cache_aware`, over the prefill servers' caches.
    pub prefill_routing: PolicyConfig,
    /// The policy that picks a disaggregated request's decode endpoint; default `least_loaded` (by in-flight tokens).
    pub decode_routing: PolicyConfig,
    /// When a vLLM decode server prefills a request itself (`[disaggregation]`: conditional disaggregation).
    pub disaggregation: DisaggregationConfig,
    pub health: HealthConfig,
    pub load: LoadConfig,
    /// Client-side timeouts and connection and request limits.
    pub server: ServerConfig,
    /// Largest accepted request body, bytes (default 64 MiB: a 200k-token prompt as `input_ids` is ~1.5 MB).
    pub max_body_bytes: usize,
    /// Request body bytes held across all requests while they arrive, at least `max_body_bytes`: a body that would
    /// take the sum past it is refused with a 503 at once. Unset: 512 MiB, or twice `max_body_bytes` if that is
    /// more ([`GatewayConfig::body_budget`]).
    pub max_buffered_body_bytes: Option<usize>,
    /// When set, admin routes require `Authorization: Bearer <key>` from every client; unset, they answer only
    /// loopback clients (403 to the others). Must not be empty.
    pub admin_key: Option<String>,
    /// Honour a client's `routed_dp_rank` / `data_parallel_rank` / `X-Data-Parallel-Rank`. Turn off for
    /// multi-tenant deployments: the fields are then ignored and stripped. With clients configured, only those
    /// allowed to (`allow_pins`) may pin.
    pub allow_client_overrides: bool,
    /// The clients (`[[clients]]`): with any, inference requests need one's API key ([`crate::admission::clients`]).
    pub clients: Vec<crate::config::clients::ClientConfig>,
    /// Flow control (`[flow_control]`): the central queue while the pool is saturated ([`crate::admission::flow`]).
    pub flow_control: crate::config::flow::FlowControlConfig,
    /// A request header that names the client's session (e.g. `x-session-id`): requests with the same value prefer
    /// the same endpoint under `prefix_affinity` and `cache_aware`, as OpenAI's `prompt_cache_key` body field does
    /// (which wins when both are given). Unset: no header is read.
    pub session_header: Option<String>,
    /// A model directory (`tokenizer.json`, `tokenizer_config.json`) whose tokenizer and chat template key text
    /// and chat prompts on the token ids the engine caches (`docs/gateway.md`, "Token-exact keys"); for every
    /// model without its own in `tokenizers`. Unset: prompts are keyed on their bytes.
    pub tokenizer: Option<std::path::PathBuf>,
    /// Per served model name, its model directory, as `tokenizer`.
    pub tokenizers: std::collections::BTreeMap<String, std::path::PathBuf>,
    /// The most of a text or chat prompt (its rendering, bytes) tokenized for its key: a longer one is keyed on
    /// the tokens of about its first this many bytes (`dprouter_tokenize_cut_total` counts them). Tokenizing costs
    /// about 200 bytes of memory and 0.3 to 0.5 µs of CPU per byte, so this bounds a request's cost (128 KiB: some
    /// 30,000 to 45,000 tokens, 25 MB, 40 to 75 ms; `cargo bench -p dprouter-tokenize -- chat_20MB`).
    pub tokenize_max_bytes: usize,
    /// Model names clients may use for another, served one (`"gpt-4o" = "smollm2"`): the request is routed to the
    /// workers serving the served name, which the worker gets in the body.
    pub model_aliases: std::collections::BTreeMap<String, String>,
    /// How many Responses ids the gateway remembers, to send a `previous_response_id` to the endpoint that made
    /// it; each keyed client keeps a fair share ([`crate::common::response_homes`]).
    pub remembered_responses: usize,
    /// Connection failures retried on the policy's next choice, before any byte reaches the client.
    pub retries: u32,
    /// Upstream connect timeout, milliseconds.
    pub connect_timeout_ms: u64,
    /// PEM file of the certificate authorities that `https://` workers' certificates are checked against, instead
    /// of the system's roots.
    pub upstream_ca_file: Option<std::path::PathBuf>,
    /// How long the gateway waits for an engine's response head, milliseconds (a 504 after it). For a response
    /// that is not streamed the head comes with the whole answer. A client may ask for less with the header
    /// `x-dprouter-first-byte-timeout-ms`.
    pub first_byte_timeout_ms: u64,
    /// How long a response body may go without a byte once it has started, milliseconds (Envoy's
    /// `stream_idle_timeout`); the stream then ends with an error event.
    pub stream_idle_timeout_ms: u64,
    /// How long an upstream connection may sit unused in the pool before it is closed, milliseconds.
    pub upstream_idle_timeout_ms: u64,
    /// OpenTelemetry tracing (`[tracing]`, and the `OTEL_*` variables): off unless an endpoint is given.
    pub tracing: dprouter_otel::TracingConfig,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8000)),
            workers: Vec::new(),
            discovery: Default::default(),
            routing: PolicyConfig::CacheAware(Default::default()),
            prefill_routing: PolicyConfig::CacheAware(Default::default()),
            decode_routing: PolicyConfig::LeastLoaded(Default::default()),
            disaggregation: Default::default(),
            health: HealthConfig::default(),
            load: LoadConfig::default(),
            server: ServerConfig::default(),
            max_body_bytes: 64 << 20,
            max_buffered_body_bytes: None,
            admin_key: None,
            allow_client_overrides: true,
            clients: Vec::new(),
            flow_control: Default::default(),
            session_header: None,
            model_aliases: Default::default(),
            tokenizer: None,
            tokenizers: Default::default(),
            tokenize_max_bytes: 128 << 10,
            remembered_responses: crate::common::response_homes::REMEMBERED,
            retries: 2,
            connect_timeout_ms: 2000,
            upstream_ca_file: None,
            first_byte_timeout_ms: 300_000,
            stream_idle_timeout_ms: 300_000,
            upstream_idle_timeout_ms: 30_000,
            tracing: Default::default(),
        }
    }
}

/// The default budget of request bodies arriving at once: 512 MiB, or twice the largest body if that is more.
pub fn default_body_budget(max_body_bytes: usize) -> usize {
    (512 << 20).max(max_body_bytes.saturating_mul(2))
}

impl GatewayConfig {
    /// The budget of request bodies arriving at once: `max_buffered_body_bytes`, or its default.
    pub fn body_budget(&self) -> usize {
        self.max_buffered_body_bytes
            .unwrap_or_else(|| default_body_budget(self.max_body_bytes))
    }

    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|error| ConfigError::Read {
            path: path.display().to_string(),
            error,
        })?;
        Self::from_toml(&text).map_err(|e| match e {
            ConfigError::Parse { error, .. } => ConfigError::Parse {
                path: path.display().to_string(),
                error,
            },
            other => other,
        })
    }

    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let config: Self = toml::from_str(text).map_err(|error| ConfigError::Parse {
            path: "<text>".into(),
            error,
        })?;
        config.validate()?;
        Ok(config)
    }

    /// KV events are followed under `cache_aware` only: given under another policy they would be accepted and
    /// ignored, so they are refused (as `POST /workers` refuses them).
    fn check_events_are_followed(&self) -> Result<(), ConfigError> {
        let worker = self
            .workers
            .iter()
            .find(|w| {
                (w.events().is_some() || w.kv_events_replay.is_some())
                    && !matches!(self.routing_of(w.role), PolicyConfig::CacheAware(_))
            })
            .map(|w| (format!("worker `{}`", w.url), self.routing_of(w.role)));
        if let Some((which, routing)) = worker {
            return Err(ConfigError::Invalid(format!(
                "{which}: KV events are followed under cache_aware only, and this config routes its role with {}: \
                 remove the kv_events settings, or route with policy = \"cache_aware\"",
                routing.name()
            )));
        }
        if matches!(self.routing, PolicyConfig::CacheAware(_)) {
            return Ok(());
        }
        let templates = (self.discovery.kubernetes.iter().map(|s| (&s.worker, s.label())))
            .chain(self.discovery.dns.iter().map(|s| (&s.worker, s.label())));
        let template = templates
            .filter(|(t, _)| t.kv_events_port.is_some() || t.kv_events_replay_port.is_some())
            .map(|(_, label)| format!("discovery {label}"))
            .next();
        match template {
            Some(which) => Err(ConfigError::Invalid(format!(
                "{which}: KV events are followed under cache_aware only, and this config routes with {}: remove \
                 the kv_events settings, or route with policy = \"cache_aware\"",
                self.routing.name()
            ))),
            None => Ok(()),
        }
    }

    /// The policy config of workers with `role`.
    pub fn routing_of(&self, role: Role) -> &PolicyConfig {
        match role {
            Role::Aggregated => &self.routing,
            Role::Prefill => &self.prefill_routing,
            Role::Decode => &self.decode_routing,
        }
    }

    /// Tracing's settings from `[tracing]` and the process's `OTEL_*` variables; `None` when tracing is off.
    pub fn tracing_settings(&self) -> Result<Option<dprouter_otel::Settings>, ConfigError> {
        self.tracing
            .resolve(&|name| std::env::var(name).ok())
            .map_err(|e| ConfigError::Invalid(e.to_string()))
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut urls = std::collections::HashSet::new();
        for w in &self.workers {
            validate_worker(w)?;
            if !urls.insert(worker_url_key(&w.url)) {
                return Err(ConfigError::Invalid(format!("worker `{}` is listed twice", w.url)));
            }
        }
        self.discovery.validate()?;
        crate::config::clients::validate_clients(&self.clients).map_err(ConfigError::Invalid)?;
        for (table, routing) in [
            ("routing", &self.routing),
            ("prefill_routing", &self.prefill_routing),
            ("decode_routing", &self.decode_routing),
        ] {
            routing
                .validate()
                .map_err(|e| ConfigError::Invalid(format!("{table}: {e}")))?;
        }
        self.check_events_are_followed()?;
        self.disaggregation.validate().map_err(ConfigError::Invalid)?;
        self.tracing_settings()?;
        if let Some(name) = &self.session_header {
            if hyper::header::HeaderName::from_bytes(name.as_bytes()).is_err() {
                return Err(ConfigError::Invalid(format!(
                    "session_header {name:?} is not a header name"
                )));
            }
        }
        if self.max_body_bytes == 0 {
            return Err(ConfigError::Invalid("max_body_bytes must be at least 1".into()));
        }
        if let Some(budget) = self.max_buffered_body_bytes.filter(|&b| b < self.max_body_bytes) {
            return Err(ConfigError::Invalid(format!(
                "max_buffered_body_bytes ({budget}) must be at least max_body_bytes ({}): the budget of all bodies \
                 arriving at once must hold one",
                self.max_body_bytes
            )));
        }
        if self.tokenize_max_bytes == 0 {
            return Err(ConfigError::Invalid("tokenize_max_bytes must be at least 1".into()));
        }
        if let Some(key) = &self.admin_key {
            if key.trim().is_empty() {
                return Err(ConfigError::Invalid(
                    "admin_key must not be empty: set a secret, or leave admin_key out (admin routes then answer \
                     loopback clients only)"
                        .into(),
                ));
            }
            if key.trim() != key || !key.chars().all(|c| c == ' ' || c.is_ascii_graphic()) {
                return Err(ConfigError::Invalid(
                    "admin_key must be printable ASCII with no leading or trailing space (it travels in an HTTP \
                     header)"
                        .into(),
                ));
            }
        }
        if self.health.failure_threshold == 0 || self.health.success_threshold == 0 {
            return Err(ConfigError::Invalid("health thresholds must be at least 1".into()));
        }
        if self.health.passive_failure_threshold == 0 {
            return Err(ConfigError::Invalid(
                "health.passive_failure_threshold must be at least 1".into(),
            ));
        }
        let h = &self.health;
        if h.base_ejection_ms == 0 || h.max_ejection_ms < h.base_ejection_ms {
            return Err(ConfigError::Invalid(
                "health.base_ejection_ms must be positive and at most health.max_ejection_ms".into(),
            ));
        }
        if h.max_ejection_percent > 100 || h.panic_threshold_percent > 100 {
            return Err(ConfigError::Invalid(
                "health.max_ejection_percent and health.panic_threshold_percent are percentages (0 to 100)".into(),
            ));
        }
        if [
            self.connect_timeout_ms,
            self.first_byte_timeout_ms,
            self.stream_idle_timeout_ms,
            self.upstream_idle_timeout_ms,
        ]
        .contains(&0)
        {
            return Err(ConfigError::Invalid(
                "connect_timeout_ms, first_byte_timeout_ms, stream_idle_timeout_ms and upstream_idle_timeout_ms must be positive"
                    .into(),
            ));
        }
        if h.interval_ms == 0 || h.unhealthy_interval_ms == 0 || h.timeout_ms == 0 || h.max_concurrent_probes == 0 {
            return Err(ConfigError::Invalid(
                "health.interval_ms, health.unhealthy_interval_ms, health.timeout_ms and health.max_concurrent_probes \
                 must be positive"
                    .into(),
            ));
        }
        self.server.validate()?;
        let s = &self.server;
        for (field, value) in [
            ("health.interval_ms", h.interval_ms),
            ("health.unhealthy_interval_ms", h.unhealthy_interval_ms),
            ("health.timeout_ms", h.timeout_ms),
            ("health.base_ejection_ms", h.base_ejection_ms),
            ("health.max_ejection_ms", h.max_ejection_ms),
            ("load.poll_interval_ms", self.load.poll_interval_ms),
            ("server.header_read_timeout_ms", s.header_read_timeout_ms),
            ("server.request_body_timeout_ms", s.request_body_timeout_ms),
            ("server.idle_timeout_ms", s.idle_timeout_ms),
            ("server.drain_timeout_ms", s.drain_timeout_ms),
            ("connect_timeout_ms", self.connect_timeout_ms),
            ("first_byte_timeout_ms", self.first_byte_timeout_ms),
            ("stream_idle_timeout_ms", self.stream_idle_timeout_ms),
            ("upstream_idle_timeout_ms", self.upstream_idle_timeout_ms),
        ]
        .into_iter()
        .map(|(field, value)| (field.to_string(), value))
        .chain(self.flow_control.millisecond_settings())
        {
            if value > MAX_MS {
                return Err(ConfigError::Invalid(format!(
                    "{field} is {value}: at most {MAX_MS} (7 days)"
                )));
            }
        }
        self.flow_control.validate().map_err(ConfigError::Invalid)?;

        Ok(())
    }
}

#[cfg(test)]
mod tests;
