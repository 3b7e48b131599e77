//! Discovery at fleet scale, against the stand-in API server (`common/api_server.rs`): 10,000 EndpointSlices, each
//! one endpoint on an address where nothing listens (127.1.x.y), besides one engine from the config file.
//! The list is applied as one membership change (all 10,000 workers registered, none routable before a probe
//! passes, so requests during the sync all reach the engine that serves), a slice deleted leaves, and shutdown
//! during the sync is not held up. Timings and CPU are printed for docs/discovery.md (run with `--release
//! --nocapture`); the checks are on behaviour, not speed.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::api_server::ApiServer;
use dprouter_gateway::config::discovery::{KubernetesSource, WorkerTemplate};
use dprouter_gateway::{AppState, Backend, GatewayConfig, WorkerConfig};
use serde_json::{json, Value};

const SLICES: &str = "/apis/discovery.k8s.io/v1/namespaces/serving/endpointslices";
const COUNT: usize = 10_000;

fn slice(i: usize) -> Value {
    let address = format!("127.1.{}.{}", i / 250, i % 250 + 1);
    json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
           "metadata": {"name": format!("llama-{i}"), "namespace": "serving",
                        "labels": {"kubernetes.io/service-name": "llama"}},
           "addressType": "IPv4",
           "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
           "endpoints": [{"addresses": [address], "conditions": {"ready": true, "serving": true, "terminating": false}}]})
}

/// CPU seconds this process has used (user and system), from `/proc/self/stat`; 0 where there is none.
fn cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or_default().split_whitespace().collect();
    let ticks: f64 = [11, 12].iter().map(|&i| fields[i].parse::<f64>().unwrap()).sum();
    ticks / 100.0
}

/// This thread's id (Linux: `/proc/thread-self` links to `PID/task/TID`); 0 where there is none.
fn thread_id() -> u32 {
    std::fs::read_link("/proc/thread-self")
        .ok()
        .and_then(|p| p.file_name()?.to_str()?.parse().ok())
        .unwrap_or(0)
}

/// CPU seconds thread `tid` of this process has used.
fn thread_cpu_seconds(tid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")) else {
        return 0.0;
    };
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or_default().split_whitespace().collect();
    let ticks: f64 = [11, 12].iter().map(|&i| fields[i].parse::<f64>().unwrap()).sum();
    ticks / 100.0
}

fn config(api: &ApiServer, engine: &str) -> GatewayConfig {
    let mut config = GatewayConfig::default();
    config.workers.push(WorkerConfig {
        url: engine.to_string(),
        backend: Backend::Sglang,
        dp_size: Some(1),
        ..Default::default()
    });
    config.discovery.kubernetes.push(KubernetesSource {
        api_server: Some(api.url.clone()),
        namespace: Some("serving".into()),
        endpoint_slices: Some("kubernetes.io/service-name=llama".into()),
        worker: WorkerTemplate {
            backend: Backend::Vllm,
            dp_size: Some(1),
            ..Default::default()
        },
        ..Default::default()
    });
    config.server.drain_timeout_ms = 1000;
    config
}

/// A gateway in this process with `config`, serving until [`Gateway::stop`].
struct Gateway {
    url: String,
    state: Arc<AppState>,
    stop: tokio::sync::oneshot::Sender<()>,
    serving: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Gateway {
    async fn start(mut config: GatewayConfig) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        config.listen = listener.local_addr().unwrap();
        let url = format!("http://{}", config.listen);
        let state = AppState::new(config).await.unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let shutdown = async move { drop(stopped.await) };
        let serving = tokio::spawn(dprouter_gateway::serve(listener, Arc::clone(&state), shutdown));
        Self {
            url,
            state,
            stop,
            serving,
        }
    }

    /// Shuts it down; returns once `serve` has.
    async fn stop(self) {
        self.stop.send(()).unwrap();
        self.serving.await.unwrap().unwrap();
    }
}

/// The process's open file descriptors.
fn open_files() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

async fn engine() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let engine = dprouter_mock_engine::Engine::new(Default::default());
    tokio::spawn(dprouter_mock_engine::serve(listener, engine, std::future::pending()));
    url
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_endpoint_slices_join_as_one_change() {
    let api = ApiServer::start().await;
    for i in 0..COUNT {
        api.put(SLICES, slice(i));
    }
    let g = Gateway::start(config(&api, &engine().await)).await;
    let (state, gateway) = (Arc::clone(&g.state), g.url.clone());
    let started = Instant::now();

    // Requests during the sync: every one reaches the engine that serves (none to an endpoint never probed).
    let client = client();
    let chat = json!({"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let mut statuses = std::collections::BTreeMap::new();
    let mut applied = None;
    let mut most_files = 0;
    while applied.is_none() || statuses.values().sum::<usize>() < 50 {
        most_files = most_files.max(open_files());
        let status = post(&client, &format!("{gateway}/v1/chat/completions"), &chat).await;
        *statuses.entry(status).or_insert(0usize) += 1;
        if applied.is_none() && state.registry.workers().len() == COUNT + 1 && state.discovery_synced() {
            applied = Some(started.elapsed());
        }
        assert!(started.elapsed() < Duration::from_secs(60), "not applied in 60 s");
    }
    let applied = applied.unwrap();
    assert_eq!(
        statuses.keys().copied().collect::<Vec<_>>(),
        [200],
        "answers during the sync: {statuses:?}"
    );
    let membership = state.registry.membership();
    assert_eq!(membership.snapshot.len(), COUNT + 1);
    assert_eq!(
        membership.snapshot.healthy(),
        [0],
        "only the engine that answers is routable"
    );

    // Steady: the dead workers probed every unhealthy interval (refused at once), nothing else happening; over
    // `DPROUTER_STEADY_SECS` (default 6: longer for a figure that spans several unhealthy intervals).
    // The process's open files are sampled through the sync and meanwhile: probes run at most
    // `max_concurrent_probes` (64) at once, not one connection per worker (9,968 files before).
    let seconds = std::env::var("DPROUTER_STEADY_SECS").map_or(6, |s| s.parse().unwrap());
    let cpu = cpu_seconds();
    let quiet = Instant::now();
    while quiet.elapsed() < Duration::from_secs(seconds) {
        most_files = most_files.max(open_files());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let steady = (cpu_seconds() - cpu) / quiet.elapsed().as_secs_f64();
    println!(
        "{COUNT} EndpointSlices applied in {applied:?}; steady CPU {:.0}% of a core; at most {most_files} files open",
        steady * 100.0
    );
    assert!(
        most_files < 1000,
        "{most_files} files open while probing {COUNT} dead workers"
    );

    // A slice deleted: its worker leaves.
    api.delete(SLICES, "llama-0");
    let deadline = Instant::now() + Duration::from_secs(10);
    while state.registry.workers().len() != COUNT {
        assert!(Instant::now() < deadline, "the deleted slice's worker stayed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    g.stop().await;
}

/// Shutdown while a large list is being applied and probed exits within the drain (1 s here), not after the
/// adds finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_during_a_large_sync_is_not_held_up() {
    let api = ApiServer::start().await;
    for i in 0..COUNT {
        api.put(SLICES, slice(i));
    }
    let g = Gateway::start(config(&api, &engine().await)).await;
    while api.count("LIST") == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let asked = Instant::now();
    g.stop().await;
    let took = asked.elapsed();
    println!("shutdown during the sync took {took:?} (drain_timeout_ms = 1000)");
    assert!(
        took < Duration::from_millis(1_500),
        "{took:?}: past the drain deadline and half a second"
    );
}

type Client = dprouter_gateway::upstream::Upstream;

fn client() -> Client {
    let tls = dprouter_gateway::upstream::client_config(None, "ca").unwrap();
    Client::new(Duration::from_secs(2), Duration::from_secs(5), tls)
}

async fn post(client: &Client, url: &str, body: &Value) -> u16 {
    let request = hyper::Request::post(url)
        .header("content-type", "application/json")
        .body(dprouter_gateway::upstream::Chunks::new([bytes::Bytes::from(
            body.to_string(),
        )]))
        .unwrap();
    let (status, _, _) = client
        .exchange(request, Duration::from_secs(10), 1 << 20)
        .await
        .unwrap();
    status.as_u16()
}

/// A live fleet: `DPROUTER_LIVE_WORKERS` workers (default 50) of two ranks each, every one a small HTTP server
/// (on a thread of its own in this process) answering `/health` and `/v1/models`, found through EndpointSlices: all admitted once their first
/// probe passes, then probed every interval. The CPU printed is the whole process's (the gateway's probes and the
/// servers' answers both); the gateway's own is the process's less the servers' thread's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_fleet_is_admitted_and_probed() {
    let workers: usize = std::env::var("DPROUTER_LIVE_WORKERS").map_or(50, |s| s.parse().unwrap());
    let api = ApiServer::start().await;
    // The fleet's servers on a thread of their own, so that their CPU can be told from the gateway's.
    let (ports_tx, ports) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let health = axum::Router::new()
                .route("/health", axum::routing::get(|| async { "ok" }))
                .route(
                    "/v1/models",
                    axum::routing::get(|| async { axum::Json(json!({"data": [{"id": "llama"}]})) }),
                );
            let mut ports = Vec::new();
            for _ in 0..workers {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                ports.push(listener.local_addr().unwrap().port());
                let app = health.clone();
                tokio::spawn(async move { axum::serve(listener, app).await });
            }
            ports_tx.send((thread_id(), ports)).unwrap();
            std::future::pending::<()>().await;
        });
    });
    let (servers, ports) = ports.recv().unwrap();
    for (i, port) in ports.into_iter().enumerate() {
        let mut slice = slice(i);
        slice["endpoints"][0]["addresses"][0] = json!("127.0.0.1");
        slice["ports"][0]["port"] = json!(port);
        api.put(SLICES, slice);
    }
    let mut config = config(&api, &engine().await);
    config.discovery.kubernetes[0].worker.dp_size = Some(2);
    let g = Gateway::start(config).await;
    let state = Arc::clone(&g.state);
    let started = Instant::now();
    let endpoints = 2 * workers + 1;
    while state.registry.membership().snapshot.healthy().len() < endpoints {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "not all admitted in 120 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let admitted = started.elapsed();
    let membership = state.registry.membership();
    assert!(membership.targets[1..]
        .iter()
        .all(|t| *t.models == ["llama".to_string()]));
    let seconds = std::env::var("DPROUTER_STEADY_SECS").map_or(3, |s| s.parse().unwrap());
    let (cpu, server_cpu) = (cpu_seconds(), thread_cpu_seconds(servers));
    let quiet = Instant::now();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    let elapsed = quiet.elapsed().as_secs_f64();
    let servers = (thread_cpu_seconds(servers) - server_cpu) / elapsed;
    let all = (cpu_seconds() - cpu) / elapsed;
    assert_eq!(
        state.registry.membership().snapshot.healthy().len(),
        endpoints,
        "all stay up"
    );
    println!(
        "{workers} live workers ({} endpoints) admitted in {admitted:?}; steady CPU {:.0}% of a core for the gateway \
         (the process {:.0}%, the fleet's servers {:.0}%)",
        2 * workers,
        (all - servers) * 100.0,
        all * 100.0,
        servers * 100.0
    );
    g.stop().await;
}
