//! The gateway's typed configuration (TOML), every field documented in `docs/gateway.md`.
//!
//! Unknown fields and unknown policies are start-up errors. Command-line flags override the file.

use std::net::SocketAddr;
use std::path::Path;

use dprouter_core::PolicyConfig;
use serde::{Deserialize, Serialize};

/// How the gateway targets one rank of a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    /// SGLang with `--dp-size N`: one URL, N endpoints, the rank named in the JSON body.
    #[default]
    Sglang,
    /// vLLM with data parallelism: one URL, N endpoints, the rank in the `X-data-parallel-rank` header.
    Vllm,
    /// Any OpenAI-compatible server: one URL is one endpoint; nothing is injected.
    Openai,
}

impl Backend {
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Sglang => "sglang",
            Backend::Vllm => "vllm",
            Backend::Openai => "openai",
        }
    }
}

/// How an SGLang worker is told the rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum RankField {
    /// Current SGLang.
    #[default]
    RoutedDpRank,
    /// Older SGLang servers.
    DataParallelRank,
    /// SGLang with PR #19832: the `X-Data-Parallel-Rank` header on `/v1/*` (the client's body goes on untouched),
    /// `routed_dp_rank` in the body of `/generate`. Older servers ignore the header, silently: choose it only
    /// for servers known to read it.
    Header,
}

impl RankField {
    /// The config name.
    pub fn as_str(self) -> &'static str {
        match self {
            RankField::RoutedDpRank => "routed_dp_rank",
            RankField::DataParallelRank => "data_parallel_rank",
            RankField::Header => "header",
        }
    }

    /// The body field that carries the rank on `path` (`None`: the header does).
    pub fn body_field(self, path: &str) -> Option<&'static str> {
        match self {
            RankField::RoutedDpRank => Some("routed_dp_rank"),
            RankField::DataParallelRank => Some("data_parallel_rank"),
            RankField::Header if path.starts_with("/v1/") => None,
            RankField::Header => Some("routed_dp_rank"),
        }
    }
}

/// One upstream server.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    /// Base URL, e.g. `http://10.0.0.5:30000`, or `https://…` (TLS; roots: `upstream_ca_file`).
    pub url: String,
    #[serde(default)]
    pub backend: Backend,
    /// Data-parallel ranks behind the URL, 1 to [`MAX_DP_SIZE`]. SGLang: read from `/get_server_info` when absent.
    /// vLLM: required (default 1). OpenAI: always 1.
    #[serde(default)]
    pub dp_size: Option<u32>,
    /// SGLang only: how the rank is sent (a body field, or the header on `/v1/*`).
    #[serde(default)]
    pub rank_field: RankField,
    /// Prompt tokens each of the worker's ranks keeps cached, for cache-aware policies: what SGLang reports
    /// (`max_total_num_tokens`) when absent; for other engines the policy's `kv_capacity_tokens` when absent. A
    /// llama.cpp server keeps one prompt per slot: slots times the prompt length its clients send.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_capacity_tokens: Option<u64>,
    /// The models the worker serves (the `model` of a request it may take). Empty: asked from its
    /// `GET /v1/models` when it is added; a worker whose models stay unknown takes any model.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<String>,
    /// Where the worker's engine publishes its KV cache events (`cache_aware`'s precise mode; `docs/gateway.md`,
    /// "KV events"): one ZMQ endpoint, rank r at its port + r as the engines offset it, or one per rank.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<EventEndpoints>,
    /// Instead of `kv_events`, for engines whose publishers connect (vLLM with an endpoint that names a host, such
    /// as `tcp://127.0.0.1:5557`): where the gateway binds, rank r at its port + r, or one per rank, and each
    /// rank's publisher connects. One subscriber per address: replicas of the gateway need engines that bind.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events_bind: Option<EventEndpoints>,
    /// Where it serves replays of its recent events, the same way; without it, a gap in the events empties the
    /// endpoint's index instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events_replay: Option<EventEndpoints>,
}

/// Where a worker's ranks publish their KV events, as its config gives them (see [`WorkerConfig`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerEvents {
    pub kv_events: Option<EventEndpoints>,
    pub kv_events_bind: Option<EventEndpoints>,
    pub kv_events_replay: Option<EventEndpoints>,
}

impl WorkerConfig {
    /// Its KV event endpoints, if it has any.
    pub fn events(&self) -> Option<WorkerEvents> {
        (self.kv_events.is_some() || self.kv_events_bind.is_some()).then(|| WorkerEvents {
            kv_events: self.kv_events.clone(),
            kv_events_bind: self.kv_events_bind.clone(),
            kv_events_replay: self.kv_events_replay.clone(),
        })
    }
}

/// ZMQ endpoints of a worker's ranks: `"tcp://host:port"` (rank r at port + r) or one per rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum EventEndpoints {
    Base(String),
    PerRank(Vec<String>),
}

impl EventEndpoints {
    /// Rank `rank`'s endpoint; `None` past a list's end or the last port.
    pub fn for_rank(&self, rank: u32) -> Option<String> {
        match self {
            EventEndpoints::PerRank(list) => list.get(rank as usize).cloned(),
            EventEndpoints::Base(base) => {
                let (head, port) = base.rsplit_once(':')?;
                let port = port.parse::<u32>().ok()? + rank;
                (port <= 65_535).then(|| format!("{head}:{port}"))
            }
        }
    }

    fn validate(&self, url: &str, field: &str) -> Result<(), ConfigError> {
        let list = match self {
            EventEndpoints::Base(base) => std::slice::from_ref(base),
            EventEndpoints::PerRank(list) => list.as_slice(),
        };
        for endpoint in list {
            let port = endpoint
                .strip_prefix("tcp://")
                .and_then(|rest| rest.rsplit_once(':'))
                .and_then(|(host, port)| (!host.is_empty()).then_some(port))
                .and_then(|port| port.parse::<u16>().ok());
            if port.is_none_or(|p| p == 0) {
                return Err(ConfigError::Invalid(format!(
                    "worker `{url}`: {field} `{endpoint}` must be tcp://host:port"
                )));
            }
        }
        Ok(())
    }
}

/// Active and passive health checking.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HealthConfig {
    /// Interval between active `GET /health` probes of each worker, milliseconds.
    pub interval_ms: u64,
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
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            interval_ms: 2000,
            timeout_ms: 1000,
            failure_threshold: 2,
            success_threshold: 2,
            passive_failure_threshold: 3,
            base_ejection_ms: 5_000,
            max_ejection_ms: 300_000,
            max_ejection_percent: 50,
            panic_threshold_percent: 50,
        }
    }
}

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

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GatewayConfig {
    pub listen: SocketAddr,
    pub workers: Vec<WorkerConfig>,
    /// The policy and its options (`policy = "prefix_match"`, …); default `cache_aware`.
    pub routing: PolicyConfig,
    pub health: HealthConfig,
    pub load: LoadConfig,
    /// Client-side timeouts and connection and request limits.
    pub server: ServerConfig,
    /// Largest accepted request body, bytes (default 64 MiB: a 200k-token prompt as `input_ids` is ~1.5 MB).
    pub max_body_bytes: usize,
    /// When set, admin routes require `Authorization: Bearer <key>` from every client; unset, they answer only
    /// loopback clients (403 to the others). Must not be empty.
    pub admin_key: Option<String>,
    /// Honour a client's `routed_dp_rank` / `data_parallel_rank` / `X-Data-Parallel-Rank`. Turn off for
    /// multi-tenant deployments: the fields are then ignored and stripped.
    pub allow_client_overrides: bool,
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
    /// about 200 bytes of memory per byte, so this bounds a request's cost (256 KiB: some 60,000 tokens, 50 MB).
    pub tokenize_max_bytes: usize,
    /// Model names clients may use for another, served one (`"gpt-4o" = "smollm2"`): the request is routed to the
    /// workers serving the served name, which the worker gets in the body.
    pub model_aliases: std::collections::BTreeMap<String, String>,
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
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8000)),
            workers: Vec::new(),
            routing: PolicyConfig::CacheAware(Default::default()),
            health: HealthConfig::default(),
            load: LoadConfig::default(),
            server: ServerConfig::default(),
            max_body_bytes: 64 << 20,
            admin_key: None,
            allow_client_overrides: true,
            session_header: None,
            model_aliases: Default::default(),
            tokenizer: None,
            tokenizers: Default::default(),
            tokenize_max_bytes: 256 << 10,
            retries: 2,
            connect_timeout_ms: 2000,
            upstream_ca_file: None,
            first_byte_timeout_ms: 300_000,
            stream_idle_timeout_ms: 300_000,
            upstream_idle_timeout_ms: 30_000,
        }
    }
}

/// A config that cannot be used. The cause is part of the message, not a `source`, so an error chain prints it once.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {error}")]
    Read { path: String, error: std::io::Error },
    #[error("invalid config {path}: {error}")]
    Parse { path: String, error: toml::de::Error },
    #[error("invalid config: {0}")]
    Invalid(String),
}

impl GatewayConfig {
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

    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut urls = std::collections::HashSet::new();
        for w in &self.workers {
            validate_worker(w)?;
            if !urls.insert(worker_url_key(&w.url)) {
                return Err(ConfigError::Invalid(format!("worker `{}` is listed twice", w.url)));
            }
        }
        self.routing
            .validate()
            .map_err(|e| ConfigError::Invalid(format!("routing: {e}")))?;
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
        if self.health.interval_ms == 0 || self.health.timeout_ms == 0 {
            return Err(ConfigError::Invalid(
                "health.interval_ms and health.timeout_ms must be positive".into(),
            ));
        }
        self.server.validate()?;
        Ok(())
    }
}

/// The most data-parallel ranks one worker may have (configured, added at run time, or reported by SGLang): each
/// rank is an endpoint with its own load counters, so an absurd count must not allocate.
pub const MAX_DP_SIZE: u32 = 1024;

/// The form in which two worker URLs are compared: scheme and host lowercase, the port explicit, no trailing
/// slash.
pub fn worker_url_key(url: &str) -> String {
    match url.trim().parse::<hyper::Uri>() {
        Ok(uri) if uri.host().is_some() => {
            let scheme = uri.scheme_str().unwrap_or("http").to_ascii_lowercase();
            let host = uri.host().unwrap_or_default().to_ascii_lowercase();
            let port = uri.port_u16().unwrap_or(if scheme == "https" { 443 } else { 80 });
            let path = uri.path().trim_end_matches('/');
            let query = uri.query().map(|q| format!("?{q}")).unwrap_or_default();
            format!("{scheme}://{host}:{port}{path}{query}")
        }
        _ => url.trim().trim_end_matches('/').to_string(),
    }
}

/// Checks one worker's settings (also used for workers added at run time).
pub fn validate_worker(w: &WorkerConfig) -> Result<(), ConfigError> {
    let uri: hyper::Uri = w
        .url
        .parse()
        .map_err(|_| ConfigError::Invalid(format!("worker url `{}` is not a URL", w.url)))?;
    let has_user_info = uri.authority().is_some_and(|a| a.as_str().contains('@'));
    // Slashes alone are no path: `http://h:1/` is `http://h:1`.
    let has_path = uri
        .path_and_query()
        .is_some_and(|p| !p.as_str().trim_start_matches('/').is_empty());
    if !matches!(uri.scheme_str(), Some("http" | "https")) || uri.authority().is_none() || has_user_info || has_path {
        return Err(ConfigError::Invalid(format!(
            "worker url `{}` must be http://host:port or https://host:port (no user, path or query)",
            w.url
        )));
    }
    if let Some(n) = w.dp_size.filter(|n| !(1..=MAX_DP_SIZE).contains(n)) {
        return Err(ConfigError::Invalid(format!(
            "worker `{}`: dp_size must be between 1 and {MAX_DP_SIZE}, got {n}",
            w.url
        )));
    }
    if w.kv_capacity_tokens == Some(0) {
        return Err(ConfigError::Invalid(format!(
            "worker `{}`: kv_capacity_tokens must be positive",
            w.url
        )));
    }
    for (field, endpoints) in [
        ("kv_events", &w.kv_events),
        ("kv_events_bind", &w.kv_events_bind),
        ("kv_events_replay", &w.kv_events_replay),
    ] {
        if let Some(endpoints) = endpoints {
            endpoints.validate(&w.url, field)?;
        }
    }
    if w.kv_events.is_some() && w.kv_events_bind.is_some() {
        return Err(ConfigError::Invalid(format!(
            "worker `{}`: kv_events (the gateway connects) and kv_events_bind (the gateway binds) exclude each other",
            w.url
        )));
    }
    if w.kv_events_replay.is_some() && w.kv_events.is_none() && w.kv_events_bind.is_none() {
        return Err(ConfigError::Invalid(format!(
            "worker `{}`: kv_events_replay needs kv_events or kv_events_bind",
            w.url
        )));
    }
    if w.backend == Backend::Openai && w.dp_size.is_some_and(|n| n != 1) {
        return Err(ConfigError::Invalid(format!(
            "worker `{}`: an openai backend is one endpoint (dp_size 1)",
            w.url
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_config_parses() {
        let config = GatewayConfig::from_toml(
            r#"
            listen = "127.0.0.1:9000"
            admin_key = "k"
            allow_client_overrides = false
            [routing]
            policy = "prefix_match"
            window_tokens = 128
            [health]
            interval_ms = 500
            [load]
            poll_interval_ms = 50
            [[workers]]
            url = "http://127.0.0.1:30000"
            [[workers]]
            url = "http://127.0.0.1:30001"
            backend = "vllm"
            dp_size = 2
            "#,
        )
        .unwrap();
        assert_eq!(config.listen.port(), 9000);
        assert_eq!(config.routing.name(), "prefix_match");
        assert_eq!(config.workers[1].backend, Backend::Vllm);
        assert_eq!(config.health.interval_ms, 500);
        assert_eq!(config.health.failure_threshold, 2);
        assert!(!config.allow_client_overrides);
    }

    #[test]
    fn the_documented_example_parses_and_shows_every_field() {
        let doc = include_str!("../../../docs/gateway.md");
        let section = doc.split("## Configuration file").nth(1).unwrap();
        let toml_text = section.split("```toml").nth(1).unwrap().split("```").next().unwrap();
        let config = GatewayConfig::from_toml(toml_text).unwrap();
        assert_eq!(config.workers.len(), 1);
        let documented = |key: &str| {
            toml_text
                .lines()
                .any(|l| l.trim_start().trim_start_matches("# ").starts_with(key))
        };
        let defaults = toml::to_string(&GatewayConfig {
            workers: config.workers.clone(),
            admin_key: Some("k".into()),
            ..GatewayConfig::default()
        })
        .unwrap();
        // Policy options are documented with each policy, not in this example.
        let mut table = "";
        for line in defaults.lines() {
            if line.starts_with('[') {
                table = line;
            } else if line.contains(" = ") && table != "[routing]" {
                let key = line.split(" = ").next().unwrap().trim();
                assert!(documented(key), "docs/gateway.md's config example lacks `{key}`");
            }
        }
    }

    #[test]
    fn the_readme_example_parses() {
        let readme = include_str!("../../../README.md");
        let toml_text = readme.split("```toml").nth(1).unwrap().split("```").next().unwrap();
        let config = GatewayConfig::from_toml(toml_text).unwrap();
        assert_eq!(config.workers.len(), 2);
        assert_eq!(config.workers[1].backend, Backend::Vllm);
        assert_eq!(config.routing.name(), "cache_aware");
        assert_eq!(config.admin_key.as_deref(), Some("change-me"));
    }

    #[test]
    fn senseless_values_are_errors_naming_the_field() {
        for (text, needle) in [
            ("max_body_bytes = 0", "max_body_bytes"),
            ("admin_key = \"\"", "admin_key"),
            ("admin_key = \"  \"", "admin_key"),
            ("admin_key = \" k\"", "admin_key"),
            ("admin_key = \"k\\n\"", "admin_key"),
            ("[routing]\npolicy = \"cache_aware\"\nblock_tokens = 0", "block_tokens"),
            (
                "[routing]\npolicy = \"cache_aware\"\nprefill_tokens_per_s = 0",
                "prefill_tokens_per_s",
            ),
            (
                "[routing]\npolicy = \"cache_aware\"\nprefill_tokens_per_s = inf",
                "prefill_tokens_per_s",
            ),
            ("[routing]\npolicy = \"cache_aware\"\nbase_ms = -1", "base_ms"),
            ("[routing]\npolicy = \"prefix_affinity\"\nepsilon = -0.5", "epsilon"),
            ("[routing]\npolicy = \"prefix_affinity\"\nepsilon = nan", "epsilon"),
            (
                "[routing]\npolicy = \"prefix_match\"\nwindow_tokens = 0",
                "window_tokens",
            ),
            ("[[workers]]\nurl = \"http://x:1\"\ndp_size = 4294967295", "dp_size"),
            ("[[workers]]\nurl = \"http://x:1\"\ndp_size = 1025", "dp_size"),
            (
                "[[workers]]\nurl = \"http://x:1\"\n[[workers]]\nurl = \"http://X:1/\"",
                "listed twice",
            ),
            (
                "[[workers]]\nurl = \"http://x:1\"\nkv_events = \"tcp://x:5\"\nkv_events_bind = \"tcp://x:5\"",
                "exclude each other",
            ),
            (
                "[[workers]]\nurl = \"http://x:1\"\nkv_events_replay = \"tcp://x:6\"",
                "kv_events_replay needs",
            ),
            (
                "[[workers]]\nurl = \"http://x:1\"\nkv_events_bind = \"x:5\"",
                "kv_events_bind",
            ),
            ("[[workers]]\nurl = \"http://user:pw@x:1\"", "no user, path or query"),
            ("[[workers]]\nurl = \"http://x:1/v1\"", "no user, path or query"),
            ("[[workers]]\nurl = \"http://x:1/?a=b\"", "no user, path or query"),
        ] {
            let err = GatewayConfig::from_toml(text).unwrap_err().to_string();
            assert!(err.contains(needle), "{text}: {err}");
        }
        let config = |f: fn(&mut GatewayConfig)| {
            let mut c = GatewayConfig::default();
            f(&mut c);
            c.validate().map_err(|e| e.to_string())
        };
        assert!(config(|_| {}).is_ok());
        assert!(config(|c| c.admin_key = Some("s3cret key-1".into())).is_ok());
        assert!(config(|c| c.workers.push(WorkerConfig {
            url: "http://x:1".into(),
            backend: Backend::Vllm,
            dp_size: Some(MAX_DP_SIZE),
            ..WorkerConfig::default()
        }))
        .is_ok());
        // A config built in code (the command line's flags) gets the same checks.
        let err = config(|c| {
            c.routing = PolicyConfig::CacheAware(dprouter_core::policy::CacheAwareConfig {
                block_tokens: 0,
                ..Default::default()
            })
        })
        .unwrap_err();
        assert!(err.contains("block_tokens"), "{err}");
        assert!(config(|c| c.admin_key = Some(String::new()))
            .unwrap_err()
            .contains("admin_key"));
    }

    #[test]
    fn worker_urls_compare_normalized() {
        for (a, b) in [
            ("http://h:1", "http://h:1/"),
            ("http://H:1", "http://h:1"),
            ("http://h", "http://h:80"),
            ("http://h:1/v/", "http://h:1/v"),
            ("https://h", "HTTPS://h:443/"),
        ] {
            assert_eq!(worker_url_key(a), worker_url_key(b), "{a} {b}");
        }
        assert_ne!(worker_url_key("http://h:443"), worker_url_key("https://h:443"));
        assert_ne!(worker_url_key("http://h:1"), worker_url_key("http://h:2"));
        assert_ne!(worker_url_key("http://h:1/a"), worker_url_key("http://h:1/b"));
    }

    #[test]
    fn a_config_error_prints_its_cause_once() {
        let errors = [
            GatewayConfig::from_file(Path::new("/nonexistent/dprouter.toml")).unwrap_err(),
            GatewayConfig::from_toml("listn = 1").unwrap_err(),
        ];
        for err in errors {
            assert!(std::error::Error::source(&err).is_none(), "{err}");
        }
    }

    #[test]
    fn unknown_fields_and_policies_are_errors() {
        for (text, needle) in [
            ("[routing]\npolicy = \"fastest\"", "fastest"),
            ("listn = \"127.0.0.1:1\"", "listn"),
            ("[[workers]]\nurl = \"http://x:1\"\nbackend = \"tgi\"", "tgi"),
            ("[[workers]]\nurl = \"ftp://x:1\"", "http://host:port"),
            ("[[workers]]\nurl = \"http://x:1\"\ndp_size = 0", "dp_size"),
            ("[health]\nfailure_threshold = 0", "thresholds"),
            ("[server]\nidle_timeout_ms = 0", "server.idle_timeout_ms"),
            ("[server]\nmax_in_flight = 0", "server.max_in_flight"),
            ("[server]\nmax_conections = 9", "max_conections"),
        ] {
            let err = GatewayConfig::from_toml(text).unwrap_err().to_string();
            assert!(err.contains(needle), "{text}: {err}");
        }
    }
}
