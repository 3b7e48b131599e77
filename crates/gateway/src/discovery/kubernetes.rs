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
use std::sync::Mutex;
use std::time::Duration;

use http_body_util::BodyExt;
use hyper::{Request, StatusCode};
use serde::Deserialize;
use serde_json::Value;
use tokio::sync::watch;

use crate::common::throttled::clip;
use crate::config::discovery::{Found, KubernetesSource, Watched, WorkerTemplate, SERVICE_ACCOUNT_DIR};
pub use crate::discovery::kubernetes_objects::{pod_workers, slice_addresses, PoolSpec};
use crate::discovery::kubernetes_objects::{EndpointSlice, Lenient, List, Object, Pod, Pool};
use crate::discovery::kubernetes_watch::{parse_event, Change, Event, Lines, Objects};
use crate::fleet::upstream::{error_chain, Chunks, Upstream};

/// The largest LIST page read.
const MAX_LIST_BYTES: usize = 64 << 20;
/// Objects asked per LIST page (`limit`, as client-go's reflector pages): a page of Pods is a few MB. A page with
/// more is refused as it is read.
const LIST_PAGE: usize = 500;
/// The most objects one LIST may bring (pages together): a collection larger than this is refused.
pub const MAX_LIST_OBJECTS: usize = 100_000;
/// The most pages one LIST may take: an API server that keeps sending `continue` is refused past this.
pub const MAX_LIST_PAGES: usize = 1_000;
/// A collection's changes are published at most this often: a burst of watch events (or a LIST) is one change of
/// membership, not one per event.
const PUBLISH_EVERY: Duration = Duration::from_millis(100);
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

/// An API server's LIST answer that is not taken (too many objects or pages, a page larger than asked, or one
/// that does not read): counted, and the LIST fails (tried again, keeping what was found).
fn refused(path: &str, why: String) -> ApiError {
    let message = format!("{path}: the LIST answer was refused: {why}");
    let logged = message.clone();
    crate::observe::refusals::refused("kubernetes_answer", move || logged);
    ApiError::Other(message)
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
        let tls = crate::http::tls::client_config(ca_file.as_deref(), "discovery.kubernetes ca_file")?;
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

    /// LIST, page by page: the objects (those that do not read as `T` skipped, counted in a warning) and the
    /// list's resource version.
    async fn list<T: Object>(&self, path: &str, query: &str) -> Result<(Vec<T>, String), ApiError> {
        let mut items = Vec::new();
        let mut next: Option<String> = None;
        let mut unreadable: Option<(usize, String)> = None;
        for _ in 0..MAX_LIST_PAGES {
            let page_query = match &next {
                Some(token) => format!("{query}&limit={LIST_PAGE}&continue={}", encode(token)),
                None => format!("{query}&limit={LIST_PAGE}"),
            };
            let request = self.request(&format!("{path}?{page_query}"))?;
            let (status, _, body) = self
                .client
                .exchange(request, REQUEST_TIMEOUT, MAX_LIST_BYTES)
                .await
                .map_err(ApiError::Other)?;
            check_status(status, &body, path)?;
            let page = List::<T>::read(&body, LIST_PAGE).map_err(|e| refused(path, e.to_string()))?;
            drop(body);
            if items.len() + page.items.as_ref().map_or(0, Vec::len) > MAX_LIST_OBJECTS {
                return Err(refused(path, format!("more than {MAX_LIST_OBJECTS} objects")));
            }
            for item in page.items.into_iter().flatten() {
                match item {
                    Lenient::Read(item) => items.push(item),
                    Lenient::Unreadable(e) => unreadable.get_or_insert((0, e)).0 += 1,
                }
            }
            match page.metadata.next.filter(|token| !token.is_empty()) {
                Some(token) => next = Some(token),
                None => {
                    if let Some((count, first)) = unreadable {
                        tracing::warn!(%path, count, first = %clip(&first), "objects that do not read skipped");
                    }
                    let version = page
                        .metadata
                        .resource_version
                        .ok_or_else(|| ApiError::Other(format!("{path}: the list has no metadata.resourceVersion")))?;
                    return Ok((items, version));
                }
            }
        }
        Err(refused(path, format!("more than {MAX_LIST_PAGES} pages")))
    }

    /// WATCH from `version`: each event to `event` until the server ends the watch (`Ok`), a `410` (as the status
    /// or an `ERROR` event) or another failure. `version` follows the events and bookmarks.
    async fn watch<T: Object>(
        &self,
        path: &str,
        query: &str,
        version: &mut String,
        mut event: impl FnMut(Event<T>),
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
                match parse_event::<T>(&line) {
                    Ok((Event::Error(status), _)) if status.get("code").and_then(Value::as_u64) == Some(410) => {
                        return Err(ApiError::Gone)
                    }
                    Ok((Event::Error(status), _)) => {
                        let status = clip(&status.to_string()).into_owned();
                        return Err(ApiError::Other(format!("{path}: the watch sent an error: {status}")));
                    }
                    Ok((e, seen)) => {
                        if let Some(v) = seen {
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
    async fn follow<T: Object>(
        &self,
        path: &str,
        query: &str,
        stop: &mut watch::Receiver<bool>,
        mut on: impl FnMut(Change<T>),
    ) {
        let mut version: Option<String> = None;
        // An API server failing the same way again and again is logged at most every few seconds.
        let mut failing = crate::common::throttled::Throttled::new();
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
            if let Some(skipped) = failing.ready() {
                tracing::warn!(error = %clip(&error), skipped, "kubernetes discovery: retrying in {RETRY:?}");
            }
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
    #[derive(Deserialize)]
    struct Status {
        #[serde(default)]
        message: String,
    }
    let message = serde_json::from_slice::<Status>(body)
        .map(|s| s.message)
        .unwrap_or_default();
    let message = clip(&message);
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

/// Follows a collection of `T` (each object giving an `O` through `read`), publishing its objects through
/// `publish` at most every [`PUBLISH_EVERY`] while they change, until `stop`.
async fn follow_collection<T: Object, O: PartialEq>(
    api: &Api,
    path: &str,
    query: &str,
    stop: &mut watch::Receiver<bool>,
    read: impl Fn(&T) -> O,
    mut publish: impl FnMut(&BTreeMap<String, O>),
) {
    // The objects, and whether they changed since they were last published.
    let objects = Mutex::new((Objects::new(read), false));
    let lock = || objects.lock().unwrap_or_else(|e| e.into_inner());
    let following = api.follow(path, query, stop, |change| {
        let mut objects = lock();
        if objects.0.apply(change) {
            objects.1 = true;
        }
    });
    let mut following = std::pin::pin!(following);
    let mut ticker = tokio::time::interval(PUBLISH_EVERY);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = &mut following => return,
            _ = ticker.tick() => {
                let mut objects = lock();
                if std::mem::take(&mut objects.1) {
                    publish(&objects.0.by_name);
                }
            }
        }
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
            let query = format!("labelSelector={}", encode(selector));
            let read = |slice: &EndpointSlice| slice_addresses(slice, port_name);
            let publish = |slices: &BTreeMap<String, Vec<(IpAddr, u16)>>| {
                let mut all = Found::new();
                let mut skipped: Option<(usize, String)> = None;
                for (ip, port) in slices.values().flatten() {
                    match template.worker(*ip, *port, &BTreeMap::new()) {
                        Ok(w) => drop(all.insert(w.url.clone(), w)),
                        Err(e) => skipped.get_or_insert((0, e)).0 += 1,
                    }
                }
                if let Some((count, first)) = skipped {
                    tracing::warn!(count, first = %first, "endpoints skipped");
                }
                found.send_replace(Some(all));
            };
            follow_collection(&api, &path, &query, &mut stop, read, publish).await;
        }
        Watched::InferencePool(pool) => {
            let path = format!("/apis/{INFERENCE_POOL_API}/namespaces/{ns}/inferencepools");
            let query = format!("fieldSelector={}", encode(&format!("metadata.name={pool}")));
            // The pool's spec (None: no such pool, or one that does not read); its Pods follow it.
            let (spec_tx, mut spec_rx) = watch::channel(None::<PoolSpec>);
            let mut pools = Objects::new(|p: &Pool| {
                let name = p.metadata.name.as_deref().unwrap_or("?");
                PoolSpec::read(p).map_err(|e| format!("inferencepool {name}: {e}"))
            });
            let mut stop_pools = stop.clone();
            let follow_pool = api.follow(&path, &query, &mut stop_pools, |change: Change<Pool>| {
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
    let query = format!("labelSelector={}", encode(selector));
    let read = |pod: &Pod| pod_workers(pod, ports, template);
    let publish = |pods: &BTreeMap<String, Vec<crate::config::worker::WorkerConfig>>| {
        let all: Found = pods.values().flatten().map(|w| (w.url.clone(), w.clone())).collect();
        found.send_replace(Some(all));
    };
    follow_collection(api, path, &query, stop, read, publish).await;
}

#[cfg(test)]
#[path = "kubernetes_tests.rs"]
mod tests;
