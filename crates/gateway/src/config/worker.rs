//! One worker's configuration (a `[[workers]]` entry, a `POST /workers` body, a discovered worker) and the
//! config's error type: below both the whole config ([`crate::config`]) and discovery's
//! ([`crate::config::discovery`]).

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

/// What part of serving a worker does (`docs/disaggregation.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Prefill and decode alike: a request goes to one endpoint.
    #[default]
    Aggregated,
    /// Prefill only (SGLang `--disaggregation-mode prefill`): computes a prompt's KV cache for a decode server.
    Prefill,
    /// Decode only (SGLang `--disaggregation-mode decode`): generates from the KV cache a prefill server sent.
    Decode,
}

impl Role {
    pub const ALL: [Role; 3] = [Role::Aggregated, Role::Prefill, Role::Decode];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Aggregated => "aggregated",
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }

    fn is_aggregated(&self) -> bool {
        *self == Role::Aggregated
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
    /// Prefill, decode, or both (the default): see [`Role`].
    #[serde(default, skip_serializing_if = "Role::is_aggregated")]
    pub role: Role,
    /// A prefill SGLang server's bootstrap port (`--disaggregation-bootstrap-port`), which decode servers fetch
    /// its KV cache through. Unset: the decode server uses its own setting (SGLang's default, 8998).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_port: Option<u16>,
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
    /// The worker's own API key (its engine's `--api-key`), sent to it as `Authorization: Bearer KEY` on every
    /// request the gateway makes there; never shown.
    #[serde(default, skip_serializing)]
    pub api_key: Option<ApiKey>,
}

/// A key the gateway sends, which its debug form and its serialization never show.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct ApiKey(pub String);

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(..)")
    }
}

impl ApiKey {
    /// `Bearer KEY`, as a header value (`None` for a key no header can carry).
    pub fn bearer(&self) -> Option<hyper::header::HeaderValue> {
        let mut value = hyper::header::HeaderValue::from_str(&format!("Bearer {}", self.0)).ok()?;
        value.set_sensitive(true);
        Some(value)
    }
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

/// The most data-parallel ranks one worker may have (configured, added at run time, or reported by SGLang): each
/// rank is an endpoint with its own load counters, so an absurd count must not allocate.
pub const MAX_DP_SIZE: u32 = 1024;

/// The form in which two worker URLs are compared: scheme lowercase, the host in its one spelling
/// ([`canonical_host`]), the port explicit, no trailing slash.
pub fn worker_url_key(url: &str) -> String {
    match url.trim().parse::<hyper::Uri>() {
        Ok(uri) if uri.host().is_some() => {
            let scheme = uri.scheme_str().unwrap_or("http").to_ascii_lowercase();
            let host = canonical_host(uri.host().unwrap_or_default());
            let port = uri.port_u16().unwrap_or(if scheme == "https" { 443 } else { 80 });
            let path = uri.path().trim_end_matches('/');
            let query = uri.query().map(|q| format!("?{q}")).unwrap_or_default();
            format!("{scheme}://{host}:{port}{path}{query}")
        }
        _ => url.trim().trim_end_matches('/').to_string(),
    }
}

/// A worker's host in one spelling: an IPv4 address in any form a resolver reads as one (`127.1`, `2130706433`,
/// `0x7f000001`, `0177.0.0.1`: the WHATWG URL standard's IPv4 forms, which `getaddrinfo` also takes) as its dotted
/// quad; an IPv6 address in its standard form, bracketed (an IPv4-mapped one as the IPv4 address); a name in
/// lowercase without a trailing dot. A name stays a name: `localhost` is not resolved to compare it.
pub fn canonical_host(host: &str) -> String {
    let bare = host.strip_prefix('[').and_then(|h| h.strip_suffix(']'));
    if let Some(v6) = bare.and_then(|h| h.parse::<std::net::Ipv6Addr>().ok()) {
        return match std::net::IpAddr::V6(v6).to_canonical() {
            std::net::IpAddr::V4(v4) => v4.to_string(),
            std::net::IpAddr::V6(v6) => format!("[{v6}]"),
        };
    }
    match ipv4_in_any_form(host) {
        Some(v4) => v4.to_string(),
        None => host.trim_end_matches('.').to_ascii_lowercase(),
    }
}

/// `host` as an IPv4 address in the WHATWG URL standard's forms: one to four parts separated by dots (a trailing
/// dot allowed), each decimal, hexadecimal (`0x`) or octal (a leading `0`), the last filling the bytes the others
/// leave; `None` when it is not all numbers or out of range.
fn ipv4_in_any_form(host: &str) -> Option<std::net::Ipv4Addr> {
    let host = host.strip_suffix('.').unwrap_or(host);
    let mut numbers = Vec::with_capacity(4);
    for part in host.split('.') {
        let (digits, radix) = match part.get(..2) {
            Some("0x" | "0X") => (&part[2..], 16),
            _ if part.len() > 1 && part.starts_with('0') => (&part[1..], 8),
            _ => (part, 10),
        };
        if part.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) || numbers.len() == 4 {
            return None;
        }
        numbers.push(if digits.is_empty() {
            0
        } else {
            u64::from_str_radix(digits, radix).ok()?
        });
    }
    let (&last, leading) = numbers.split_last()?;
    if leading.iter().any(|&n| n > 255) || last >= 1u64 << (8 * (4 - leading.len())) {
        return None;
    }
    let value = leading
        .iter()
        .enumerate()
        .fold(last, |value, (i, &n)| value | n << (8 * (3 - i)));
    u32::try_from(value).ok().map(std::net::Ipv4Addr::from)
}

/// The port written in a URL's authority, if any (`host:port`, `[v6]:port`).
fn written_port(authority: &str) -> Option<&str> {
    match authority.strip_prefix('[') {
        Some(rest) => rest.split_once("]:").map(|(_, port)| port),
        None => authority.rsplit_once(':').map(|(_, port)| port),
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
    let authority = uri.authority().map(|a| a.as_str()).unwrap_or_default();
    if written_port(authority).is_some_and(|port| !port.parse::<u16>().is_ok_and(|p| p > 0)) {
        return Err(ConfigError::Invalid(format!(
            "worker url `{}`: the port must be a number from 1 to 65535",
            w.url
        )));
    }
    if w.api_key
        .as_ref()
        .is_some_and(|k| k.0.trim().is_empty() || k.bearer().is_none())
    {
        return Err(ConfigError::Invalid(format!(
            "worker `{}`: api_key must be a non-empty key that fits in a header",
            w.url
        )));
    }
    let host = canonical_host(uri.host().unwrap_or_default());
    let address = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<std::net::IpAddr>();
    if address.is_ok_and(|ip| ip.is_unspecified()) {
        return Err(ConfigError::Invalid(format!(
            "worker url `{}`: {host} is no address to connect to (it means every interface of a listener)",
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
    if w.role != Role::Aggregated && w.backend == Backend::Openai {
        return Err(ConfigError::Invalid(format!(
            "worker `{}`: role {} needs an engine that disaggregates (backend sglang or vllm)",
            w.url,
            w.role.as_str()
        )));
    }
    if w.bootstrap_port.is_some() && (w.role != Role::Prefill || w.backend != Backend::Sglang) {
        return Err(ConfigError::Invalid(format!(
            "worker `{}`: bootstrap_port is a prefill SGLang server's (role prefill, backend sglang)",
            w.url
        )));
    }
    if w.bootstrap_port == Some(0) {
        return Err(ConfigError::Invalid(format!(
            "worker `{}`: bootstrap_port must be from 1 to 65535",
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
