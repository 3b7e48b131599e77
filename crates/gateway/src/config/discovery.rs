//! The `[discovery]` section: where the gateway finds workers besides its static list and `POST /workers`.
//! Kubernetes (Pods of an `InferencePool`, Pods by label selector, or EndpointSlices by label selector) and DNS
//! (a name's addresses, re-resolved on an interval). Each discovered address becomes a worker built from the
//! source's [`WorkerTemplate`], which a Pod's annotations may override (`docs/discovery.md`).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::config::worker::{Backend, ConfigError, EventEndpoints, RankField, Role, WorkerConfig};

/// What one source found: its workers by URL.
pub type Found = BTreeMap<String, WorkerConfig>;

/// Where the service account's files are mounted in a pod.
pub const SERVICE_ACCOUNT_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// A Pod's annotations that override its source's template.
pub mod annotations {
    pub const BACKEND: &str = "dprouter.io/backend";
    pub const DP_SIZE: &str = "dprouter.io/dp-size";
    pub const KV_CAPACITY_TOKENS: &str = "dprouter.io/kv-capacity-tokens";
    pub const KV_EVENTS_PORT: &str = "dprouter.io/kv-events-port";
    pub const KV_EVENTS_REPLAY_PORT: &str = "dprouter.io/kv-events-replay-port";
    /// `prefill`, `decode` or `aggregated` (the default): the Pod's part under disaggregation.
    pub const ROLE: &str = "dprouter.io/role";
    /// A prefill SGLang Pod's `--disaggregation-bootstrap-port`.
    pub const BOOTSTRAP_PORT: &str = "dprouter.io/bootstrap-port";
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DiscoveryConfig {
    pub kubernetes: Vec<KubernetesSource>,
    pub dns: Vec<DnsSource>,
}

impl DiscoveryConfig {
    /// How many sources there are (the gateway is ready once each has delivered its first list).
    pub fn sources(&self) -> usize {
        self.kubernetes.len() + self.dns.len()
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        for source in &self.kubernetes {
            source.validate()?;
        }
        for source in &self.dns {
            source.validate()?;
        }
        Ok(())
    }
}

/// What a [`KubernetesSource`] watches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Watched<'a> {
    /// The Pods an `InferencePool` (`inference.networking.k8s.io/v1`) selects, at its target ports.
    InferencePool(&'a str),
    /// Pods matching a label selector, at `port`.
    Pods { selector: &'a str, port: u16 },
    /// The endpoints of EndpointSlices matching a label selector (`kubernetes.io/service-name=NAME`), at their
    /// port named `port_name` (else their first port).
    EndpointSlices {
        selector: &'a str,
        port_name: Option<&'a str>,
    },
}

/// Workers found by watching Kubernetes objects of one namespace.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KubernetesSource {
    /// The API server's URL. Unset: `https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT` (in a pod).
    pub api_server: Option<String>,
    /// Unset: the service account's namespace (in a pod), else `default`.
    pub namespace: Option<String>,
    /// A bearer token file, read again before every request (the kubelet rotates it). Unset: the service
    /// account's token when it exists.
    pub token_file: Option<PathBuf>,
    /// The certificate authorities the API server's certificate is checked against. Unset: the service account's
    /// `ca.crt` when it exists, else the system's roots.
    pub ca_file: Option<PathBuf>,
    /// Watch this `InferencePool`'s Pods (its `spec.selector.matchLabels`) at its `spec.targetPorts`.
    pub inference_pool: Option<String>,
    /// Or: Pods matching this label selector (`app=vllm,tier=serve`), at `port`.
    pub pods: Option<String>,
    /// Or: EndpointSlices matching this label selector (`kubernetes.io/service-name=vllm`).
    pub endpoint_slices: Option<String>,
    /// With `pods`: the port workers listen on.
    pub port: Option<u16>,
    /// With `endpoint_slices`: the slice port to use, by name (unset: each slice's first port).
    pub port_name: Option<String>,
    /// What each discovered worker is.
    pub worker: WorkerTemplate,
}

impl KubernetesSource {
    /// What it watches (the config is validated).
    pub fn watched(&self) -> Watched<'_> {
        match (&self.inference_pool, &self.pods, &self.endpoint_slices) {
            (Some(pool), _, _) => Watched::InferencePool(pool),
            (None, Some(selector), _) => Watched::Pods {
                selector,
                port: self.port.unwrap_or_default(),
            },
            (None, None, selector) => Watched::EndpointSlices {
                selector: selector.as_deref().unwrap_or_default(),
                port_name: self.port_name.as_deref(),
            },
        }
    }

    /// A name for logs and status: `inferencepool/NAME`, `pods/SELECTOR` or `endpointslices/SELECTOR`.
    pub fn label(&self) -> String {
        match self.watched() {
            Watched::InferencePool(name) => format!("kubernetes inferencepool/{name}"),
            Watched::Pods { selector, .. } => format!("kubernetes pods/{selector}"),
            Watched::EndpointSlices { selector, .. } => format!("kubernetes endpointslices/{selector}"),
        }
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |m: String| Err(ConfigError::Invalid(format!("discovery.kubernetes: {m}")));
        let chosen = [&self.inference_pool, &self.pods, &self.endpoint_slices]
            .iter()
            .filter(|s| s.is_some())
            .count();
        if chosen != 1 {
            return invalid("give exactly one of inference_pool, pods and endpoint_slices".into());
        }
        if self.pods.is_some() && self.port.is_none_or(|p| p == 0) {
            return invalid("pods needs port (the port the workers listen on)".into());
        }
        if self.pods.is_none() && self.port.is_some() {
            return invalid(
                "port goes with pods (an InferencePool names its target ports; EndpointSlices their own)".into(),
            );
        }
        if self.endpoint_slices.is_none() && self.port_name.is_some() {
            return invalid("port_name goes with endpoint_slices".into());
        }
        for (what, value) in [("inference_pool", &self.inference_pool), ("namespace", &self.namespace)] {
            if value.as_deref().is_some_and(|v| !is_dns_label(v)) {
                return invalid(format!(
                    "{what} {value:?} is not a Kubernetes name (lowercase letters, digits and '-')"
                ));
            }
        }
        for (what, value) in [("pods", &self.pods), ("endpoint_slices", &self.endpoint_slices)] {
            if value.as_deref().is_some_and(|v| v.trim().is_empty()) {
                return invalid(format!(
                    "{what} needs a label selector (`app=vllm`): an empty one selects everything"
                ));
            }
        }
        if let Some(url) = &self.api_server {
            if !(url.starts_with("http://") || url.starts_with("https://")) || url.parse::<hyper::Uri>().is_err() {
                return invalid(format!("api_server `{url}` must be an http:// or https:// URL"));
            }
        }
        self.worker.validate(&self.label())
    }
}

/// Workers found by resolving a DNS name (a headless Service's name, for example) on an interval.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DnsSource {
    pub name: String,
    /// The port workers listen on.
    pub port: u16,
    /// How often the name is resolved again, milliseconds.
    #[serde(default = "default_dns_interval_ms")]
    pub interval_ms: u64,
    #[serde(default)]
    pub worker: WorkerTemplate,
}

fn default_dns_interval_ms() -> u64 {
    5000
}

impl DnsSource {
    pub fn label(&self) -> String {
        format!("dns {}:{}", self.name, self.port)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if self.name.trim().is_empty() || self.name.contains(['/', ':', ' ']) {
            return Err(ConfigError::Invalid(format!(
                "discovery.dns: name {:?} is not a host name",
                self.name
            )));
        }
        if self.port == 0 || self.interval_ms == 0 {
            return Err(ConfigError::Invalid(format!(
                "discovery.dns {}: port and interval_ms must be positive",
                self.name
            )));
        }
        self.worker.validate(&self.label())
    }
}

/// What a discovered worker is: the fields of a `[[workers]]` entry but its URL, and the KV-event ports of its
/// engine (its publishers must bind: `tcp://*:PORT`, rank r at PORT + r).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkerTemplate {
    /// `http` (default) or `https`.
    pub scheme: Option<String>,
    pub backend: Backend,
    pub dp_size: Option<u32>,
    pub rank_field: RankField,
    pub kv_capacity_tokens: Option<u64>,
    pub models: Vec<String>,
    /// The port rank 0 publishes KV events at, on the worker's address.
    pub kv_events_port: Option<u16>,
    /// The port rank 0 answers replays at.
    pub kv_events_replay_port: Option<u16>,
    /// The workers' own API key, as a worker's `api_key`.
    #[serde(skip_serializing)]
    pub api_key: Option<crate::config::worker::ApiKey>,
}

impl WorkerTemplate {
    fn validate(&self, source: &str) -> Result<(), ConfigError> {
        if self.scheme.as_deref().is_some_and(|s| s != "http" && s != "https") {
            return Err(ConfigError::Invalid(format!(
                "discovery {source}: scheme must be http or https"
            )));
        }
        if self.kv_events_replay_port.is_some() && self.kv_events_port.is_none() {
            return Err(ConfigError::Invalid(format!(
                "discovery {source}: kv_events_replay_port needs kv_events_port"
            )));
        }
        // The rest is checked on a worker it makes.
        let sample = self
            .worker(IpAddr::from([10, 0, 0, 1]), 8000, &BTreeMap::new())
            .map_err(|e| ConfigError::Invalid(format!("discovery {source}: {e}")))?;
        crate::config::worker::validate_worker(&sample)
            .map_err(|e| ConfigError::Invalid(format!("discovery {source}: {e}")))
    }

    /// The worker at `ip:port`, with `annotations` (a Pod's) overriding the template: an annotation that does not
    /// parse is an error naming it.
    pub fn worker(
        &self,
        ip: IpAddr,
        port: u16,
        annotations: &BTreeMap<String, String>,
    ) -> Result<WorkerConfig, String> {
        fn parsed<T: std::str::FromStr>(
            annotations: &BTreeMap<String, String>,
            key: &str,
        ) -> Result<Option<T>, String> {
            annotations
                .get(key)
                .map(|v| {
                    v.trim()
                        .parse()
                        .map_err(|_| format!("annotation {key}: {v:?} does not parse"))
                })
                .transpose()
        }
        let backend = match annotations.get(annotations::BACKEND).map(|s| s.trim()) {
            None => self.backend,
            Some("sglang") => Backend::Sglang,
            Some("vllm") => Backend::Vllm,
            Some("openai") => Backend::Openai,
            Some(other) => {
                return Err(format!(
                    "annotation {}: {other:?} is not sglang, vllm or openai",
                    annotations::BACKEND
                ))
            }
        };
        let role = match annotations.get(annotations::ROLE).map(|s| s.trim()) {
            None | Some("aggregated") => Role::Aggregated,
            Some("prefill") => Role::Prefill,
            Some("decode") => Role::Decode,
            Some(other) => {
                return Err(format!(
                    "annotation {}: {other:?} is not prefill, decode or aggregated",
                    annotations::ROLE
                ))
            }
        };
        let host = match ip {
            IpAddr::V4(v4) => v4.to_string(),
            IpAddr::V6(v6) => format!("[{v6}]"),
        };
        let events_port: Option<u16> = parsed(annotations, annotations::KV_EVENTS_PORT)?.or(self.kv_events_port);
        let replay_port: Option<u16> =
            parsed(annotations, annotations::KV_EVENTS_REPLAY_PORT)?.or(self.kv_events_replay_port);
        let zmq = |port: u16| EventEndpoints::Base(format!("tcp://{host}:{port}"));
        Ok(WorkerConfig {
            url: format!("{}://{host}:{port}", self.scheme.as_deref().unwrap_or("http")),
            backend,
            dp_size: parsed(annotations, annotations::DP_SIZE)?.or(self.dp_size),
            rank_field: self.rank_field,
            role,
            bootstrap_port: parsed(annotations, annotations::BOOTSTRAP_PORT)?,
            kv_capacity_tokens: parsed(annotations, annotations::KV_CAPACITY_TOKENS)?.or(self.kv_capacity_tokens),
            models: self.models.clone(),
            kv_events: events_port.map(zmq),
            kv_events_bind: None,
            kv_events_replay: events_port.and(replay_port).map(zmq),
            api_key: self.api_key.clone(),
        })
    }
}

/// A Kubernetes object name (an RFC 1123 label: what namespaces and most names are).
fn is_dns_label(s: &str) -> bool {
    (1..=253).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && !s.starts_with(['-', '.'])
        && !s.ends_with(['-', '.'])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<DiscoveryConfig, String> {
        let config: DiscoveryConfig = toml::from_str(text).map_err(|e| e.to_string())?;
        config.validate().map_err(|e| e.to_string())?;
        Ok(config)
    }

    #[test]
    fn each_kubernetes_source_watches_exactly_one_thing() {
        let pool = parse("[[kubernetes]]\ninference_pool = \"llama\"\nworker = { backend = \"vllm\", dp_size = 2 }\n")
            .unwrap();
        assert_eq!(pool.kubernetes[0].watched(), Watched::InferencePool("llama"));
        let pods = parse("[[kubernetes]]\npods = \"app=vllm\"\nport = 8000\n").unwrap();
        assert_eq!(
            pods.kubernetes[0].watched(),
            Watched::Pods {
                selector: "app=vllm",
                port: 8000
            }
        );
        for bad in [
            "[[kubernetes]]\n",
            "[[kubernetes]]\ninference_pool = \"a\"\npods = \"app=x\"\nport = 1\n",
            "[[kubernetes]]\npods = \"app=vllm\"\n",
            "[[kubernetes]]\npods = \" \"\nport = 8000\n",
            "[[kubernetes]]\ninference_pool = \"a\"\nport = 8000\n",
            "[[kubernetes]]\ninference_pool = \"Not_A_Name\"\n",
            "[[kubernetes]]\ninference_pool = \"a\"\napi_server = \"kubernetes:443\"\n",
            "[[kubernetes]]\ninference_pool = \"a\"\nworker = { dp_size = 0 }\n",
            "[[kubernetes]]\ninference_pool = \"a\"\nworker = { kv_events_replay_port = 5558 }\n",
            "[[kubernetes]]\ninference_pool = \"a\"\nwhat = 1\n",
            "[[dns]]\nname = \"vllm\"\nport = 0\n",
            "[[dns]]\nname = \"http://vllm\"\nport = 8000\n",
        ] {
            assert!(parse(bad).is_err(), "accepted: {bad}");
        }
    }

    #[test]
    fn a_pods_annotations_override_the_template_and_a_bad_one_is_an_error() {
        let template = WorkerTemplate {
            backend: Backend::Vllm,
            dp_size: Some(2),
            kv_events_port: Some(5557),
            kv_events_replay_port: Some(5558),
            ..Default::default()
        };
        let ip = IpAddr::from([10, 1, 2, 3]);
        let plain = template.worker(ip, 8000, &BTreeMap::new()).unwrap();
        assert_eq!(plain.url, "http://10.1.2.3:8000");
        assert_eq!((plain.backend, plain.dp_size), (Backend::Vllm, Some(2)));
        assert_eq!(
            plain.kv_events,
            Some(EventEndpoints::Base("tcp://10.1.2.3:5557".into()))
        );
        assert_eq!(
            plain.kv_events_replay,
            Some(EventEndpoints::Base("tcp://10.1.2.3:5558".into()))
        );
        let annotated: BTreeMap<String, String> = [
            (annotations::BACKEND, "sglang"),
            (annotations::DP_SIZE, "8"),
            (annotations::KV_EVENTS_PORT, "6000"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let worker = template.worker(ip, 30000, &annotated).unwrap();
        assert_eq!((worker.backend, worker.dp_size), (Backend::Sglang, Some(8)));
        assert_eq!(
            worker.kv_events,
            Some(EventEndpoints::Base("tcp://10.1.2.3:6000".into()))
        );
        let v6 = template
            .worker("fd00::5".parse().unwrap(), 8000, &BTreeMap::new())
            .unwrap();
        assert_eq!(v6.url, "http://[fd00::5]:8000");
        let bad: BTreeMap<String, String> = [(annotations::DP_SIZE.to_string(), "two".to_string())].into();
        let error = template.worker(ip, 8000, &bad).unwrap_err();
        assert!(error.contains("dprouter.io/dp-size"), "{error}");
    }
}
