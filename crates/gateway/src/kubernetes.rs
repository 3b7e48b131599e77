//! Kubernetes discovery: the workers of an `InferencePool`, of Pods by label selector, or of EndpointSlices by
//! label selector, followed with the API server's LIST and WATCH (a small client over the gateway's own HTTP
//! client: `kube` and `k8s-openapi` would take longer to compile than the rest of the gateway).
//!
//! How it follows a collection, as client-go's reflector does: LIST (the objects and the list's
//! `resourceVersion`), then WATCH from that version with bookmarks (JSON lines of `ADDED`, `MODIFIED`, `DELETED`,
//! `BOOKMARK` and `ERROR` events), watching again from the last version seen when the server ends the watch.
//! A `410 Gone`, as the watch request's status or as an `ERROR` event, means the version is too old: LIST again.
//! Other failures are retried every second, keeping what was found. A Pod counts while it is Ready, has an IP and
//! is not being deleted; an EndpointSlice's endpoint while it is ready and not terminating: a terminating one
//! is removed from the registry at once, and its requests in flight finish (drained, not cut).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::{Request, StatusCode};
use serde_json::Value;
use tokio::sync::watch;

use crate::discovery_config::{Found, KubernetesSource, Watched, WorkerTemplate, SERVICE_ACCOUNT_DIR};
use crate::upstream::{error_chain, Chunks, Upstream};
use crate::worker_config::WorkerConfig;

/// The largest LIST answer read.
const MAX_LIST_BYTES: usize = 64 << 20;
/// The largest watch event (one object) read.
const MAX_EVENT_BYTES: usize = 16 << 20;
/// How long the server keeps a watch open before it ends it (the client watches again).
const WATCH_SECONDS: u64 = 290;
/// A watch silent this long is given up (bookmarks come about every minute; the server ends it after
/// [`WATCH_SECONDS`]).
const WATCH_IDLE: Duration = Duration::from_secs(WATCH_SECONDS + 30);
/// How long a LIST or the start of a watch may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// The wait before trying again after a failure.
pub const RETRY: Duration = Duration::from_secs(1);

/// The InferencePool API (the Gateway API Inference Extension's v1).
pub const INFERENCE_POOL_API: &str = "inference.networking.k8s.io/v1";

/// A connection to the API server, for one namespace.
pub struct Api {
    base: String,
    namespace: String,
    token_file: Option<PathBuf>,
    client: Upstream,
}

/// Why a request to the API server failed.
#[derive(Debug)]
enum ApiError {
    /// `410 Gone`: the resource version is too old; LIST again.
    Gone,
    Other(String),
}

impl Api {
    /// The source's API server, namespace and credentials, with the service account's as defaults (`Err`: no API
    /// server is known, or a CA file does not read).
    pub fn new(source: &KubernetesSource) -> Result<Self, String> {
        let account = Path::new(SERVICE_ACCOUNT_DIR);
        let base = match &source.api_server {
            Some(url) => url.trim_end_matches('/').to_string(),
            None => match (
                std::env::var("KUBERNETES_SERVICE_HOST"),
                std::env::var("KUBERNETES_SERVICE_PORT"),
            ) {
                (Ok(host), Ok(port)) if host.contains(':') => format!("https://[{host}]:{port}"),
                (Ok(host), Ok(port)) => format!("https://{host}:{port}"),
                _ => {
                    return Err(format!(
                        "discovery {}: no api_server, and KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are \
                         not set (not in a pod): set api_server",
                        source.label()
                    ))
                }
            },
        };
        let namespace = match &source.namespace {
            Some(ns) => ns.clone(),
            None => std::fs::read_to_string(account.join("namespace"))
                .map(|s| s.trim().to_string())
                .ok()
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| "default".to_string()),
        };
        let existing = |name: &str| Some(account.join(name)).filter(|p| p.exists());
        let token_file = source.token_file.clone().or_else(|| existing("token"));
        let ca_file = source.ca_file.clone().or_else(|| existing("ca.crt"));
        let tls = crate::tls::client_config(ca_file.as_deref(), "discovery.kubernetes ca_file")?;
        Ok(Self {
            base,
            namespace,
            token_file,
            client: Upstream::new(REQUEST_TIMEOUT, Duration::from_secs(90), tls),
        })
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    fn request(&self, path_and_query: &str) -> Result<Request<Chunks>, ApiError> {
        let mut request = Request::get(format!("{}{path_and_query}", self.base)).header("accept", "application/json");
        if let Some(file) = &self.token_file {
            // Read again every time: the kubelet rotates projected tokens.
            let token = read_small(file).map_err(|e| ApiError::Other(format!("token_file {}: {e}", file.display())))?;
            request = request.header("authorization", format!("Bearer {}", token.trim()));
        }
        request
            .body(Chunks::default())
            .map_err(|e| ApiError::Other(format!("{path_and_query}: {e}")))
    }

    /// LIST: the objects and the list's resource version.
    async fn list(&self, path: &str, query: &str) -> Result<(Vec<Value>, String), ApiError> {
        let request = self.request(&format!("{path}?{query}"))?;
        let (status, _, body) = self
            .client
            .exchange(request, REQUEST_TIMEOUT, MAX_LIST_BYTES)
            .await
            .map_err(ApiError::Other)?;
        check_status(status, &body, path)?;
        let mut list: Value = serde_json::from_slice(&body).map_err(|e| ApiError::Other(format!("{path}: {e}")))?;
        let version = resource_version(&list)
            .ok_or_else(|| ApiError::Other(format!("{path}: the list has no metadata.resourceVersion")))?;
        let items = match list.get_mut("items").map(Value::take) {
            Some(Value::Array(items)) => items,
            Some(Value::Null) | None => Vec::new(),
            Some(_) => return Err(ApiError::Other(format!("{path}: items is not a list"))),
        };
        Ok((items, version))
    }

    /// WATCH from `version`: each event to `event` until the server ends the watch (`Ok`), a `410` (as the status
    /// or an `ERROR` event) or another failure. `version` follows the events and bookmarks.
    async fn watch(
        &self,
        path: &str,
        query: &str,
        version: &mut String,
        mut event: impl FnMut(Event),
    ) -> Result<(), ApiError> {
        let request = self.request(&format!(
            "{path}?{query}&watch=true&allowWatchBookmarks=true&timeoutSeconds={WATCH_SECONDS}&resourceVersion={}",
            encode(version)
        ))?;
        let response = tokio::time::timeout(REQUEST_TIMEOUT, self.client.send(request))
            .await
            .map_err(|_| ApiError::Other(format!("{path}: no answer within {REQUEST_TIMEOUT:?}")))?
            .map_err(|e| ApiError::Other(format!("{path}: {}", error_chain(&e))))?;
        let (parts, mut body) = response.into_parts();
        if !parts.status.is_success() {
            let text = http_body_util::Limited::new(body, 64 << 10)
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            check_status(parts.status, &text, path)?;
            return Err(ApiError::Other(format!("{path}: status {}", parts.status)));
        }
        let mut lines = Lines::default();
        loop {
            let frame = match tokio::time::timeout(WATCH_IDLE, body.frame()).await {
                Err(_) => {
                    return Err(ApiError::Other(format!(
                        "{path}: the watch was silent for {WATCH_IDLE:?}"
                    )))
                }
                Ok(None) => return Ok(()),
                Ok(Some(Err(e))) => return Err(ApiError::Other(format!("{path}: the watch broke: {e}"))),
                Ok(Some(Ok(frame))) => frame,
            };
            let Ok(data) = frame.into_data() else { continue };
            for line in lines.push(&data).map_err(|e| ApiError::Other(format!("{path}: {e}")))? {
                match parse_event(&line) {
                    Ok(Event::Error(status)) if status.get("code").and_then(Value::as_u64) == Some(410) => {
                        return Err(ApiError::Gone)
                    }
                    Ok(Event::Error(status)) => {
                        return Err(ApiError::Other(format!("{path}: the watch sent an error: {status}")))
                    }
                    Ok(e) => {
                        if let Some(v) = e.object().and_then(resource_version) {
                            *version = v;
                        }
                        event(e);
                    }
                    Err(e) => return Err(ApiError::Other(format!("{path}: {e}"))),
                }
            }
        }
    }

    /// Follows a collection (LIST, then WATCH, again and again) until `stop`, telling `on` every change.
    async fn follow(&self, path: &str, query: &str, stop: &mut watch::Receiver<bool>, mut on: impl FnMut(Change)) {
        let mut version: Option<String> = None;
        loop {
            let mut listed = false;
            let started = tokio::time::Instant::now();
            let step = async {
                let current = match version.take() {
                    Some(v) => v,
                    None => {
                        let (items, v) = self.list(path, query).await?;
                        on(Change::Listed(items));
                        listed = true;
                        v
                    }
                };
                let mut current = current;
                let result = self.watch(path, query, &mut current, |e| on(Change::Event(e))).await;
                if !matches!(result, Err(ApiError::Gone)) {
                    version = Some(current);
                }
                result
            };
            let result = tokio::select! {
                result = step => result,
                _ = stop.wait_for(|s| *s) => return,
            };
            let error = match result {
                // The server ended the watch: again from the last version (not at once, if it ended at once).
                Ok(()) if started.elapsed() >= RETRY => continue,
                Ok(()) => format!("{path}: the server ended the watch at once"),
                Err(ApiError::Gone) if !listed => {
                    tracing::info!(%path, "resource version too old (410 Gone): listing again");
                    continue;
                }
                // Even a new list's version: not again at once.
                Err(ApiError::Gone) => format!("{path}: 410 Gone for the version a list just gave"),
                Err(ApiError::Other(e)) => e,
            };
            tracing::warn!(%error, "kubernetes discovery: retrying in {RETRY:?}");
            tokio::select! {
                () = tokio::time::sleep(RETRY) => {}
                _ = stop.wait_for(|s| *s) => return,
            }
        }
    }
}

/// A status other than 2xx as an error (`410` as [`ApiError::Gone`]), with the server's message.
fn check_status(status: StatusCode, body: &[u8], path: &str) -> Result<(), ApiError> {
    if status.is_success() {
        return Ok(());
    }
    if status == StatusCode::GONE {
        return Err(ApiError::Gone);
    }
    let message = serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v.get("message").and_then(Value::as_str).map(str::to_string))
        .unwrap_or_default();
    let hint = match status {
        StatusCode::UNAUTHORIZED => " (the token is not accepted)",
        StatusCode::FORBIDDEN => " (the service account needs get, list and watch on it: deploy/kubernetes/epp.yaml)",
        _ => "",
    };
    Err(ApiError::Other(format!("{path}: status {status}{hint}: {message}")))
}

fn read_small(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(path)?.take(64 << 10).read_to_string(&mut text)?;
    Ok(text)
}

/// A query value, percent-encoded.
fn encode(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn resource_version(object: &Value) -> Option<String> {
    object
        .pointer("/metadata/resourceVersion")?
        .as_str()
        .map(str::to_string)
}

fn name(object: &Value) -> Option<&str> {
    object.pointer("/metadata/name")?.as_str()
}

/// One watch event.
#[derive(Debug, Clone, PartialEq)]
enum Event {
    Added(Value),
    Modified(Value),
    Deleted(Value),
    Bookmark(Value),
    /// The object is a `Status`.
    Error(Value),
}

impl Event {
    fn object(&self) -> Option<&Value> {
        match self {
            Event::Added(o) | Event::Modified(o) | Event::Deleted(o) | Event::Bookmark(o) => Some(o),
            Event::Error(_) => None,
        }
    }
}

fn parse_event(line: &[u8]) -> Result<Event, String> {
    let mut value: Value = serde_json::from_slice(line).map_err(|e| format!("a watch event that is not JSON: {e}"))?;
    let object = value.get_mut("object").map(Value::take).unwrap_or_default();
    Ok(match value.get("type").and_then(Value::as_str) {
        Some("ADDED") => Event::Added(object),
        Some("MODIFIED") => Event::Modified(object),
        Some("DELETED") => Event::Deleted(object),
        Some("BOOKMARK") => Event::Bookmark(object),
        Some("ERROR") => Event::Error(object),
        other => return Err(format!("a watch event of type {other:?}")),
    })
}

/// The watch body split into lines, each at most [`MAX_EVENT_BYTES`].
#[derive(Default)]
struct Lines {
    partial: BytesMut,
}

impl Lines {
    fn push(&mut self, data: &Bytes) -> Result<Vec<Bytes>, String> {
        let mut lines = Vec::new();
        let mut rest = &data[..];
        while let Some(end) = rest.iter().position(|&b| b == b'\n') {
            self.partial.extend_from_slice(&rest[..end]);
            rest = &rest[end + 1..];
            let line = self.partial.split().freeze();
            if !line.iter().all(u8::is_ascii_whitespace) {
                lines.push(line);
            }
        }
        if self.partial.len() + rest.len() > MAX_EVENT_BYTES {
            return Err(format!("a watch event over {MAX_EVENT_BYTES} bytes"));
        }
        self.partial.extend_from_slice(rest);
        Ok(lines)
    }
}

/// What a followed collection did.
#[derive(Debug, Clone, PartialEq)]
enum Change {
    /// A LIST: these are all the objects now.
    Listed(Vec<Value>),
    Event(Event),
}

/// The objects of a followed collection by name, each with what it gives.
#[derive(Debug)]
struct Objects<T> {
    by_name: BTreeMap<String, T>,
    /// What an object gives.
    read: fn(&Value) -> T,
}

impl<T> Objects<T> {
    fn new(read: fn(&Value) -> T) -> Self {
        Self {
            by_name: BTreeMap::new(),
            read,
        }
    }

    /// Applies `change`; whether anything but a bookmark came.
    fn apply(&mut self, change: Change) -> bool {
        match change {
            Change::Listed(items) => {
                self.by_name = items
                    .iter()
                    .filter_map(|o| Some((name(o)?.to_string(), (self.read)(o))))
                    .collect();
            }
            Change::Event(Event::Added(o) | Event::Modified(o)) => {
                if let Some(n) = name(&o) {
                    self.by_name.insert(n.to_string(), (self.read)(&o));
                }
            }
            Change::Event(Event::Deleted(o)) => {
                if let Some(n) = name(&o) {
                    self.by_name.remove(n);
                }
            }
            Change::Event(Event::Bookmark(_) | Event::Error(_)) => return false,
        }
        true
    }
}

/// A Pod's address, when it counts: Ready, with an IP, not being deleted.
fn pod_address(pod: &Value) -> Option<IpAddr> {
    if pod.pointer("/metadata/deletionTimestamp").is_some_and(|v| !v.is_null()) {
        return None;
    }
    let ready = pod.pointer("/status/conditions")?.as_array()?.iter().any(|c| {
        c.get("type").and_then(Value::as_str) == Some("Ready")
            && c.get("status").and_then(Value::as_str) == Some("True")
    });
    if !ready {
        return None;
    }
    pod.pointer("/status/podIP")?.as_str()?.parse().ok()
}

fn annotations(object: &Value) -> BTreeMap<String, String> {
    object
        .pointer("/metadata/annotations")
        .and_then(Value::as_object)
        .map(|map| {
            map.iter()
                .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                .collect()
        })
        .unwrap_or_default()
}

/// The workers of a Pod at `ports`; none when it does not count or its annotations do not parse (logged).
fn pod_workers(pod: &Value, ports: &[u16], template: &WorkerTemplate) -> Vec<WorkerConfig> {
    let Some(ip) = pod_address(pod) else { return Vec::new() };
    let annotations = annotations(pod);
    ports
        .iter()
        .filter_map(|&port| match template.worker(ip, port, &annotations) {
            Ok(worker) => Some(worker),
            Err(e) => {
                tracing::warn!(pod = name(pod).unwrap_or("?"), error = %e, "pod skipped");
                None
            }
        })
        .collect()
}

/// The ready, not terminating endpoints of an EndpointSlice, with the port chosen.
fn slice_addresses(slice: &Value, port_name: Option<&str>) -> Vec<(IpAddr, u16)> {
    let ports = slice
        .get("ports")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let port = ports
        .iter()
        .find(|p| port_name.is_none_or(|n| p.get("name").and_then(Value::as_str) == Some(n)))
        .and_then(|p| p.get("port")?.as_u64())
        .and_then(|p| u16::try_from(p).ok())
        .filter(|&p| p > 0);
    let Some(port) = port else { return Vec::new() };
    let endpoints = slice
        .get("endpoints")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    endpoints
        .iter()
        .filter(|e| {
            let condition = |c: &str| e.pointer(&format!("/conditions/{c}")).and_then(Value::as_bool);
            // As kube-proxy reads them: unset `ready` is ready; a terminating endpoint is drained.
            condition("ready") != Some(false) && condition("terminating") != Some(true)
        })
        // "Consumers must use the first address" (EndpointSlice API).
        .filter_map(|e| e.pointer("/addresses/0")?.as_str()?.parse().ok())
        .map(|ip| (ip, port))
        .collect()
}

/// An InferencePool's selector and target ports.
#[derive(Debug, Clone, PartialEq, Eq)]
struct PoolSpec {
    match_labels: BTreeMap<String, String>,
    ports: Vec<u16>,
}

impl PoolSpec {
    /// Reads `spec.selector.matchLabels` and `spec.targetPorts[].number` of an `inference.networking.k8s.io/v1`
    /// InferencePool.
    fn read(pool: &Value) -> Result<Self, String> {
        let labels = pool
            .pointer("/spec/selector/matchLabels")
            .and_then(Value::as_object)
            .ok_or("spec.selector.matchLabels is missing")?;
        let match_labels: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| {
                Ok((
                    k.clone(),
                    v.as_str().ok_or("a label value is not a string")?.to_string(),
                ))
            })
            .collect::<Result<_, String>>()?;
        if match_labels.is_empty() {
            return Err("spec.selector.matchLabels is empty".into());
        }
        let ports: Vec<u16> = pool
            .pointer("/spec/targetPorts")
            .and_then(Value::as_array)
            .ok_or("spec.targetPorts is missing")?
            .iter()
            .map(|p| {
                p.get("number")
                    .and_then(Value::as_u64)
                    .and_then(|n| u16::try_from(n).ok())
                    .filter(|&n| n > 0)
                    .ok_or("a target port's number is not a port")
            })
            .collect::<Result<_, _>>()?;
        if ports.is_empty() {
            return Err("spec.targetPorts is empty".into());
        }
        Ok(Self { match_labels, ports })
    }

    fn selector(&self) -> String {
        self.match_labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// Follows `source` until `stop`, sending what it finds to `found` (`None` until the first LIST).
pub async fn run(
    api: Api,
    source: KubernetesSource,
    found: watch::Sender<Option<Found>>,
    mut stop: watch::Receiver<bool>,
) {
    let ns = encode(api.namespace());
    let pods_path = format!("/api/v1/namespaces/{ns}/pods");
    let template = source.worker.clone();
    match source.watched() {
        Watched::Pods { selector, port } => {
            follow_pods(&api, &pods_path, selector, &[port], &template, &found, &mut stop).await;
        }
        Watched::EndpointSlices { selector, port_name } => {
            let path = format!("/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices");
            let mut slices = Objects::new(|s| s.clone());
            api.follow(
                &path,
                &format!("labelSelector={}", encode(selector)),
                &mut stop,
                |change| {
                    if slices.apply(change) {
                        let mut all = Found::new();
                        for slice in slices.by_name.values() {
                            for (ip, port) in slice_addresses(slice, port_name) {
                                match template.worker(ip, port, &BTreeMap::new()) {
                                    Ok(w) => drop(all.insert(w.url.clone(), w)),
                                    Err(e) => tracing::warn!(error = %e, "endpoint skipped"),
                                }
                            }
                        }
                        found.send_replace(Some(all));
                    }
                },
            )
            .await;
        }
        Watched::InferencePool(pool) => {
            let path = format!("/apis/{INFERENCE_POOL_API}/namespaces/{ns}/inferencepools");
            let query = format!("fieldSelector={}", encode(&format!("metadata.name={pool}")));
            // The pool's spec (None: no such pool, or one that does not read); its Pods follow it.
            let (spec_tx, mut spec_rx) = watch::channel(None::<PoolSpec>);
            let mut pools = Objects::new(|p| {
                PoolSpec::read(p).map_err(|e| format!("inferencepool {}: {e}", name(p).unwrap_or("?")))
            });
            let mut stop_pools = stop.clone();
            let follow_pool = api.follow(&path, &query, &mut stop_pools, |change| {
                if pools.apply(change) {
                    let spec = match pools.by_name.get(pool) {
                        Some(Ok(spec)) => Some(spec.clone()),
                        Some(Err(e)) => {
                            tracing::warn!(error = %e, "the InferencePool does not read: no workers");
                            None
                        }
                        None => {
                            tracing::warn!(%pool, namespace = api.namespace(), "no such InferencePool: no workers");
                            None
                        }
                    };
                    spec_tx.send_if_modified(|s| std::mem::replace(s, spec.clone()) != spec);
                    if spec.is_none() {
                        // Its workers go; a source that never saw the pool stays unsynced (not ready).
                        found.send_if_modified(|f| match f {
                            Some(workers) => !std::mem::take(workers).is_empty(),
                            None => false,
                        });
                    }
                }
            });
            let follow_pods_of_pool = async {
                loop {
                    let spec = spec_rx.borrow_and_update().clone();
                    let mut stop_pods = stop.clone();
                    let pods = async {
                        match &spec {
                            Some(spec) => {
                                follow_pods(
                                    &api,
                                    &pods_path,
                                    &spec.selector(),
                                    &spec.ports,
                                    &template,
                                    &found,
                                    &mut stop_pods,
                                )
                                .await
                            }
                            None => std::future::pending().await,
                        }
                    };
                    let mut stop = stop.clone();
                    tokio::select! {
                        biased;
                        _ = stop.wait_for(|s| *s) => return,
                        changed = spec_rx.changed() => if changed.is_err() { return },
                        () = pods => return,
                    }
                }
            };
            tokio::join!(follow_pool, follow_pods_of_pool);
        }
    }
}

async fn follow_pods(
    api: &Api,
    path: &str,
    selector: &str,
    ports: &[u16],
    template: &WorkerTemplate,
    found: &watch::Sender<Option<Found>>,
    stop: &mut watch::Receiver<bool>,
) {
    let mut pods = Objects::new(|p| p.clone());
    api.follow(path, &format!("labelSelector={}", encode(selector)), stop, |change| {
        if pods.apply(change) {
            let all: Found = pods
                .by_name
                .values()
                .flat_map(|pod| pod_workers(pod, ports, template))
                .map(|w| (w.url.clone(), w))
                .collect();
            found.send_replace(Some(all));
        }
    })
    .await;
}

#[cfg(test)]
#[path = "kubernetes_tests.rs"]
mod tests;
