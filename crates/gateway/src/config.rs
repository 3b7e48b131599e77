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

/// The body field that names an SGLang rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum RankField {
    /// Current SGLang.
    #[default]
    RoutedDpRank,
    /// Older SGLang servers.
    DataParallelRank,
}

impl RankField {
    pub fn as_str(self) -> &'static str {
        match self {
            RankField::RoutedDpRank => "routed_dp_rank",
            RankField::DataParallelRank => "data_parallel_rank",
        }
    }
}

/// One upstream server.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    /// Base URL, e.g. `http://10.0.0.5:30000`.
    pub url: String,
    #[serde(default)]
    pub backend: Backend,
    /// Data-parallel ranks behind the URL. SGLang: read from `/get_server_info` when absent. vLLM: required
    /// (default 1). OpenAI: always 1.
    #[serde(default)]
    pub dp_size: Option<u32>,
    /// SGLang only: the body field that carries the rank.
    #[serde(default)]
    pub rank_field: RankField,
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
    /// Consecutive 5xx answers from one endpoint that mark it down (a refused connection marks it down at once).
    pub passive_failure_threshold: u32,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            interval_ms: 2000,
            timeout_ms: 1000,
            failure_threshold: 2,
            success_threshold: 2,
            passive_failure_threshold: 3,
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

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GatewayConfig {
    pub listen: SocketAddr,
    pub workers: Vec<WorkerConfig>,
    /// The policy and its options (`policy = "prefix_match"`, …); default `cache_aware`.
    pub routing: PolicyConfig,
    pub health: HealthConfig,
    pub load: LoadConfig,
    /// Largest accepted request body, bytes (default 64 MiB: a 200k-token prompt as `input_ids` is ~1.5 MB).
    pub max_body_bytes: usize,
    /// When set, admin routes require `Authorization: Bearer <key>`.
    pub admin_key: Option<String>,
    /// Honour a client's `routed_dp_rank` / `data_parallel_rank` / `X-Data-Parallel-Rank`. Turn off for
    /// multi-tenant deployments: the fields are then ignored and stripped.
    pub allow_client_overrides: bool,
    /// Connection failures retried on the policy's next choice, before any byte reaches the client.
    pub retries: u32,
    /// Upstream connect timeout, milliseconds.
    pub connect_timeout_ms: u64,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8000)),
            workers: Vec::new(),
            routing: PolicyConfig::CacheAware(Default::default()),
            health: HealthConfig::default(),
            load: LoadConfig::default(),
            max_body_bytes: 64 << 20,
            admin_key: None,
            allow_client_overrides: true,
            retries: 2,
            connect_timeout_ms: 2000,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("invalid config {path}: {source}")]
    Parse { path: String, source: toml::de::Error },
    #[error("invalid config: {0}")]
    Invalid(String),
}

impl GatewayConfig {
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_toml(&text).map_err(|e| match e {
            ConfigError::Parse { source, .. } => ConfigError::Parse {
                path: path.display().to_string(),
                source,
            },
            other => other,
        })
    }

    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let config: Self = toml::from_str(text).map_err(|source| ConfigError::Parse {
            path: "<text>".into(),
            source,
        })?;
        config.validate()?;
        Ok(config)
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        for w in &self.workers {
            validate_worker(w)?;
        }
        if self.health.failure_threshold == 0 || self.health.success_threshold == 0 {
            return Err(ConfigError::Invalid("health thresholds must be at least 1".into()));
        }
        if self.health.passive_failure_threshold == 0 {
            return Err(ConfigError::Invalid(
                "health.passive_failure_threshold must be at least 1".into(),
            ));
        }
        if self.health.interval_ms == 0 || self.health.timeout_ms == 0 {
            return Err(ConfigError::Invalid(
                "health.interval_ms and health.timeout_ms must be positive".into(),
            ));
        }
        Ok(())
    }
}

/// Checks one worker's settings (also used for workers added at run time).
pub fn validate_worker(w: &WorkerConfig) -> Result<(), ConfigError> {
    let uri: hyper::Uri = w
        .url
        .parse()
        .map_err(|_| ConfigError::Invalid(format!("worker url `{}` is not a URL", w.url)))?;
    if uri.scheme_str() != Some("http") || uri.authority().is_none() {
        return Err(ConfigError::Invalid(format!(
            "worker url `{}` must be http://host:port",
            w.url
        )));
    }
    if w.dp_size == Some(0) {
        return Err(ConfigError::Invalid(format!(
            "worker `{}`: dp_size must be at least 1",
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
    fn unknown_fields_and_policies_are_errors() {
        for (text, needle) in [
            ("[routing]\npolicy = \"fastest\"", "fastest"),
            ("listn = \"127.0.0.1:1\"", "listn"),
            ("[[workers]]\nurl = \"http://x:1\"\nbackend = \"tgi\"", "tgi"),
            ("[[workers]]\nurl = \"ftp://x:1\"", "http://host:port"),
            ("[[workers]]\nurl = \"http://x:1\"\ndp_size = 0", "dp_size"),
            ("[health]\nfailure_threshold = 0", "thresholds"),
        ] {
            let err = GatewayConfig::from_toml(text).unwrap_err().to_string();
            assert!(err.contains(needle), "{text}: {err}");
        }
    }
}
