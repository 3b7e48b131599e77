//! Discovery against a stand-in Kubernetes API server (`common/api_server.rs`: the real LIST and WATCH wire format;
//! no real API server can be installed here) and the system's DNS resolver: the watch and its relists, what
//! counts as a worker, and a gateway that serves the workers found and drains the ones that go.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::api_server::ApiServer;
use dprouter_gateway::config::discovery::{DnsSource, Found, KubernetesSource, WorkerTemplate};
use dprouter_gateway::kubernetes::{self, Api};
use dprouter_gateway::upstream::{Chunks, Upstream};
use dprouter_gateway::{AppState, Backend, GatewayConfig};
use hyper::{Method, Request, StatusCode};
use serde_json::{json, Value};
use tokio::sync::watch;

const PODS: &str = "/api/v1/namespaces/serving/pods";
const SLICES: &str = "/apis/discovery.k8s.io/v1/namespaces/serving/endpointslices";
const POOLS: &str = "/apis/inference.networking.k8s.io/v1/namespaces/serving/inferencepools";
const WAIT: Duration = Duration::from_secs(10);

fn pod(name: &str, app: &str, ip: &str, ready: bool) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": "serving", "labels": {"app": app}},
           "status": {"phase": "Running", "podIP": ip,
                      "conditions": [{"type": "PodScheduled", "status": "True"},
                                     {"type": "Ready", "status": if ready { "True" } else { "False" }}]}})
}

fn pool(name: &str, app: &str, port: u16) -> Value {
    json!({"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
           "metadata": {"name": name, "namespace": "serving"},
           "spec": {"selector": {"matchLabels": {"app": app}}, "targetPorts": [{"number": port}],
                    "endpointPickerRef": {"name": "dprouter-epp", "port": {"number": 9002}}}})
}

fn source(api: &ApiServer) -> KubernetesSource {
    KubernetesSource {
        api_server: Some(api.url.clone()),
        namespace: Some("serving".into()),
        worker: WorkerTemplate {
            backend: Backend::Vllm,
            dp_size: Some(2),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// A followed source: what it finds, and how to stop it.
struct Following {
    seen: watch::Receiver<Option<Found>>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Following {
    fn start(source: KubernetesSource) -> Self {
        let (found, seen) = watch::channel(None);
        let (stop, stopped) = watch::channel(false);
        let api = Api::new(&source).unwrap();
        let task = tokio::spawn(kubernetes::run(api, source, found, stopped));
        Self { seen, stop, task }
    }

    /// The URLs of the next list it sends.
    async fn next(&mut self) -> Vec<String> {
        tokio::time::timeout(WAIT, self.seen.changed())
            .await
            .expect("nothing found in time")
            .unwrap();
        let found = self.seen.borrow_and_update();
        found.as_ref().expect("a list").keys().cloned().collect()
    }

    async fn stop(self) {
        self.stop.send_replace(true);
        tokio::time::timeout(WAIT, self.task).await.unwrap().unwrap();
    }
}

async fn until(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !check() {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn temp_file(name: &str, text: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("dprouter-discovery-{}-{name}", std::process::id()));
    std::fs::write(&path, text).unwrap();
    path
}

#[tokio::test]
async fn pods_are_listed_then_watched_and_both_forms_of_410_make_a_new_list() {
    let api = ApiServer::start().await;
    let token = temp_file("token", "first-token\n");
    api.put(PODS, pod("a", "vllm", "10.0.0.1", true));
    api.put(PODS, pod("other", "other", "10.0.0.9", true));
    let mut following = Following::start(KubernetesSource {
        pods: Some("app=vllm".into()),
        port: Some(8000),
        token_file: Some(token.clone()),
        ..source(&api)
    });
    assert_eq!(following.next().await, ["http://10.0.0.1:8000"]);
    let list = &api.requests()[0];
    assert_eq!((list.verb, list.path.as_str()), ("LIST", PODS));
    assert_eq!(list.query["labelSelector"], "app=vllm");
    assert_eq!(list.token.as_deref(), Some("first-token"));
    until("the watch", || api.count("WATCH") == 1).await;
    let watch = &api.requests()[1];
    assert_eq!(
        watch.query["resourceVersion"], "2",
        "the watch starts at the list's version"
    );
    assert_eq!(watch.query["allowWatchBookmarks"], "true");

    // Events: a pod that becomes ready, one that stops being ready, one being deleted, one deleted.
    api.put(PODS, pod("b", "vllm", "10.0.0.2", true));
    assert_eq!(following.next().await, ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]);
    api.put(PODS, pod("b", "vllm", "10.0.0.2", false));
    assert_eq!(following.next().await, ["http://10.0.0.1:8000"]);
    api.put(PODS, pod("b", "vllm", "10.0.0.2", true));
    assert_eq!(following.next().await, ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]);
    let mut deleting = pod("a", "vllm", "10.0.0.1", true);
    deleting["metadata"]["deletionTimestamp"] = json!("2026-12-01T20:00:00Z");
    api.put(PODS, deleting);
    assert_eq!(following.next().await, ["http://10.0.0.2:8000"]);
    api.delete(PODS, "a");
    api.delete(PODS, "b");
    assert!(following.next().await.len() <= 1);
    if !following.seen.borrow().as_ref().unwrap().is_empty() {
        assert!(following.next().await.is_empty());
    }
    let worker_of = |f: &Following, url: &str| f.seen.borrow().as_ref().unwrap().get(url).cloned();
    api.put(PODS, pod("c", "vllm", "10.0.0.3", true));
    assert_eq!(following.next().await, ["http://10.0.0.3:8000"]);
    let worker = worker_of(&following, "http://10.0.0.3:8000").unwrap();
    assert_eq!((worker.backend, worker.dp_size), (Backend::Vllm, Some(2)));

    // A bookmark moves the version; a watch the server ends is resumed from it, with no new list and the token
    // read again.
    std::fs::write(&token, "second-token").unwrap();
    let bookmarked = api.bookmark();
    tokio::time::sleep(Duration::from_millis(100)).await;
    api.end_watches();
    until("a second watch", || api.count("WATCH") == 2).await;
    let resumed = api.requests().last().cloned().unwrap();
    assert_eq!(resumed.query["resourceVersion"], bookmarked.to_string());
    assert_eq!(resumed.token.as_deref(), Some("second-token"));
    assert_eq!(api.count("LIST"), 1);

    // 410 as a watch ERROR event: a new list, then a watch from its version.
    api.expire_watches();
    assert_eq!(following.next().await, ["http://10.0.0.3:8000"]);
    assert_eq!(api.count("LIST"), 2);
    until("a watch after the list", || api.count("WATCH") == 3).await;

    // 410 as the watch request's status: a new list again.
    api.put(PODS, pod("d", "vllm", "10.0.0.4", true));
    assert_eq!(following.next().await, ["http://10.0.0.3:8000", "http://10.0.0.4:8000"]);
    api.compact();
    api.end_watches();
    until("a third list", || api.count("LIST") == 3).await;
    assert_eq!(following.next().await, ["http://10.0.0.3:8000", "http://10.0.0.4:8000"]);
    api.put(PODS, pod("e", "vllm", "10.0.0.5", true));
    assert_eq!(following.next().await.len(), 3, "watching goes on after the relist");
    let gone_watches = api.requests().iter().filter(|r| r.verb == "WATCH").count();
    assert!(gone_watches >= 5, "{gone_watches} watches");
    following.stop().await;
    std::fs::remove_file(token).unwrap();
}

/// A watch that sends the same Pod modified again and again (a status heartbeat, or a hostile server) changes
/// nothing discovery reads: no new list of workers is published for it, and a real change still is.
#[tokio::test]
async fn a_pod_modified_the_same_again_and_again_publishes_nothing() {
    let api = ApiServer::start().await;
    api.put(PODS, pod("a", "vllm", "10.0.0.1", true));
    let mut following = Following::start(KubernetesSource {
        pods: Some("app=vllm".into()),
        port: Some(8000),
        ..source(&api)
    });
    assert_eq!(following.next().await, ["http://10.0.0.1:8000"]);
    until("the watch", || api.count("WATCH") == 1).await;
    for i in 0..2000 {
        let mut same = pod("a", "vllm", "10.0.0.1", true);
        // Fields discovery does not read change; what it reads does not.
        same["metadata"]["annotations"] = json!({"heartbeat": i.to_string()});
        api.put(PODS, same);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !following.seen.has_changed().unwrap(),
        "the same Pod, modified, was published again"
    );
    api.put(PODS, pod("a", "vllm", "10.0.0.2", true));
    assert_eq!(following.next().await, ["http://10.0.0.2:8000"]);
    following.stop().await;
}

#[tokio::test]
async fn endpoint_slices_give_their_ready_endpoints_at_the_named_port_and_drop_terminating_ones() {
    let api = ApiServer::start().await;
    let slice = |terminating_first: bool| {
        json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
               "metadata": {"name": "vllm-abc", "labels": {"kubernetes.io/service-name": "vllm"}},
               "ports": [{"name": "metrics", "port": 9000}, {"name": "http", "port": 8000}],
               "endpoints": [
                   {"addresses": ["10.0.0.1"], "conditions": {"ready": !terminating_first, "serving": true, "terminating": terminating_first}},
                   {"addresses": ["10.0.0.2"], "conditions": {"ready": false}},
                   {"addresses": ["10.0.0.3"], "conditions": {"ready": false, "serving": true, "terminating": true}},
                   {"addresses": ["10.0.0.4"], "conditions": {}}]})
    };
    api.put(SLICES, slice(false));
    let mut other = slice(false);
    other["metadata"] = json!({"name": "sglang-xyz", "labels": {"kubernetes.io/service-name": "sglang"}});
    other["endpoints"] = json!([{"addresses": ["10.0.9.9"], "conditions": {"ready": true}}]);
    api.put(SLICES, other);
    let mut following = Following::start(KubernetesSource {
        endpoint_slices: Some("kubernetes.io/service-name=vllm".into()),
        port_name: Some("http".into()),
        ..source(&api)
    });
    assert_eq!(following.next().await, ["http://10.0.0.1:8000", "http://10.0.0.4:8000"]);
    assert_eq!(
        api.requests()[0].query["labelSelector"],
        "kubernetes.io/service-name=vllm"
    );
    api.put(SLICES, slice(true));
    assert_eq!(following.next().await, ["http://10.0.0.4:8000"]);
    following.stop().await;
}

#[tokio::test]
async fn an_inference_pool_selects_its_pods_at_its_target_port_and_follows_its_changes() {
    let api = ApiServer::start().await;
    api.put(PODS, pod("llama-0", "llama", "10.0.0.1", true));
    let mut annotated = pod("other-0", "other", "10.0.0.2", true);
    annotated["metadata"]["annotations"] = json!({"dprouter.io/backend": "sglang", "dprouter.io/dp-size": "4"});
    api.put(PODS, annotated);
    let mut following = Following::start(KubernetesSource {
        inference_pool: Some("llama".into()),
        ..source(&api)
    });
    // No such pool yet: nothing is found, and the source has not synced.
    until("the pool's list", || api.count("LIST") == 1).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(following.seen.borrow().is_none(), "a source with no pool synced");
    let list = &api.requests()[0];
    assert_eq!(
        (list.path.as_str(), list.query["fieldSelector"].as_str()),
        (POOLS, "metadata.name=llama")
    );

    api.put(POOLS, pool("llama", "llama", 8000));
    assert_eq!(following.next().await, ["http://10.0.0.1:8000"]);
    let pods_list = api.requests().into_iter().find(|r| r.path == PODS).unwrap();
    assert_eq!(pods_list.query["labelSelector"], "app=llama");
    api.put(POOLS, pool("llama", "llama", 8001));
    assert_eq!(following.next().await, ["http://10.0.0.1:8001"]);
    api.put(POOLS, pool("llama", "other", 8001));
    assert_eq!(following.next().await, ["http://10.0.0.2:8001"]);
    let worker = following.seen.borrow().as_ref().unwrap()["http://10.0.0.2:8001"].clone();
    assert_eq!(
        (worker.backend, worker.dp_size),
        (Backend::Sglang, Some(4)),
        "the pod's annotations win"
    );
    api.delete(POOLS, "llama");
    assert_eq!(following.next().await, Vec::<String>::new());
    following.stop().await;
}

/// A mock SGLang engine with one rank on 127.0.0.1, answering each request's first byte after `delay`.
async fn engine(delay: Duration) -> u16 {
    let config = dprouter_mock_engine::EngineConfig {
        faults: dprouter_mock_engine::Faults {
            first_byte_delay: delay,
            ..Default::default()
        },
        ..Default::default()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let engine = dprouter_mock_engine::Engine::new(config);
    tokio::spawn(dprouter_mock_engine::serve(listener, engine, std::future::pending()));
    port
}

/// A gateway in this process with `config`; its base URL.
async fn gateway(mut config: GatewayConfig) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    config.listen = listener.local_addr().unwrap();
    let state = AppState::new(config.clone()).await.unwrap();
    tokio::spawn(dprouter_gateway::serve(listener, state, std::future::pending()));
    format!("http://{}", config.listen)
}

/// The URLs of the gateway's workers.
/// The URLs of the workers `gateway` routes to (a worker discovery found is routable once its first probe passed).
async fn worker_urls(client: &Upstream, gateway: &str) -> Vec<String> {
    let (_, _, workers) = call(client, Method::GET, &format!("{gateway}/workers"), None).await;
    workers["workers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|w| w["healthy"] == true)
        .map(|w| w["url"].as_str().unwrap().to_string())
        .collect()
}

/// A chat completion through `gateway`.
async fn ask(client: &Upstream, gateway: &str) -> (StatusCode, hyper::HeaderMap, Value) {
    call(
        client,
        Method::POST,
        &format!("{gateway}/v1/chat/completions"),
        Some(chat()),
    )
    .await
}

fn chat() -> Value {
    json!({"model": "dprouter/mock", "max_tokens": 4, "messages": [{"role": "user", "content": "Where am I served?"}]})
}

async fn call(
    client: &Upstream,
    method: Method,
    url: &str,
    body: Option<Value>,
) -> (StatusCode, hyper::HeaderMap, Value) {
    let body = body.map(|b| Bytes::from(b.to_string()));
    let request = Request::builder()
        .method(method)
        .uri(url)
        .header("content-type", "application/json")
        .body(Chunks::new(body))
        .unwrap();
    let (status, headers, body) = client.exchange(request, WAIT, 1 << 20).await.unwrap();
    (status, headers, serde_json::from_slice(&body).unwrap_or(Value::Null))
}

fn client() -> Upstream {
    let tls = dprouter_gateway::upstream::client_config(None, "ca").unwrap();
    Upstream::new(Duration::from_secs(2), Duration::from_secs(5), tls)
}

#[tokio::test]
async fn a_gateway_serves_the_pools_workers_once_synced_and_drains_the_ones_that_go() {
    let slow = engine(Duration::from_millis(1500)).await;
    let fast = engine(Duration::ZERO).await;
    let api = ApiServer::start().await;
    api.put(PODS, pod("engine-0", "mock", "127.0.0.1", true));
    let mut config = GatewayConfig::default();
    config.discovery.kubernetes.push(KubernetesSource {
        inference_pool: Some("mock".into()),
        worker: WorkerTemplate {
            backend: Backend::Sglang,
            dp_size: Some(1),
            ..Default::default()
        },
        ..source(&api)
    });
    let gateway = gateway(config).await;
    let client = client();
    let readiness = format!("{gateway}/readiness");

    // No pool yet: not ready, and it says why.
    until("the pool's list", || api.count("LIST") >= 1).await;
    let (status, _, ready) = call(&client, Method::GET, &readiness, None).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(ready["discovery_synced"], false);

    api.put(POOLS, pool("mock", "mock", slow));
    let deadline = tokio::time::Instant::now() + WAIT;
    while call(&client, Method::GET, &readiness, None).await.0 != StatusCode::OK {
        assert!(tokio::time::Instant::now() < deadline, "never ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        worker_urls(&client, &gateway).await,
        [format!("http://127.0.0.1:{slow}")]
    );

    // A request in flight on the worker that goes finishes; new ones go to the one that came.
    let in_flight = {
        let (client, gateway) = (client.clone(), gateway.clone());
        tokio::spawn(async move { ask(&client, &gateway).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    api.put(POOLS, pool("mock", "mock", fast));
    let deadline = tokio::time::Instant::now() + WAIT;
    while worker_urls(&client, &gateway).await != [format!("http://127.0.0.1:{fast}")] {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the pool's change was not applied"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        !in_flight.is_finished(),
        "the slow request ended before its worker went"
    );
    let (status, _, answer) = in_flight.await.unwrap();
    assert_eq!(status, StatusCode::OK, "the request in flight was cut: {answer}");
    assert!(answer["choices"][0]["message"]["content"].is_string());
    assert_eq!(ask(&client, &gateway).await.0, StatusCode::OK);
}

#[tokio::test]
async fn dns_discovery_finds_localhost_with_the_systems_resolver() {
    let port = engine(Duration::ZERO).await;
    let mut config = GatewayConfig::default();
    config.discovery.dns.push(DnsSource {
        name: "localhost".into(),
        port,
        interval_ms: 200,
        worker: WorkerTemplate {
            backend: Backend::Sglang,
            dp_size: Some(1),
            ..Default::default()
        },
    });
    let gateway = gateway(config).await;
    let client = client();
    let want = format!("http://127.0.0.1:{port}");
    let deadline = tokio::time::Instant::now() + WAIT;
    while !worker_urls(&client, &gateway).await.contains(&want) {
        assert!(tokio::time::Instant::now() < deadline, "localhost never found");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, headers, _) = ask(&client, &gateway).await;
    assert_eq!(status, StatusCode::OK);
    assert!(headers.contains_key("x-dprouter-endpoint"));
}
