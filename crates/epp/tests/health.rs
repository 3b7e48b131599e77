//! The picker's gRPC health: `liveness` serves from the start; `readiness` (and the names Envoy and the reference
//! chart ask) only once discovery has synced, and not after shutdown begins.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use dprouter_gateway::config::discovery::{DnsSource, WorkerTemplate};
use dprouter_gateway::{AppState, Backend, GatewayConfig};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

/// A picker in this process with one DNS discovery source for `name`; its gRPC address and a way to stop it.
async fn picker(name: &str, port: u16) -> (String, tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
    let mut config = GatewayConfig::default();
    config.discovery.dns.push(DnsSource {
        name: name.into(),
        port,
        interval_ms: 100,
        worker: WorkerTemplate {
            backend: Backend::Sglang,
            dp_size: Some(1),
            ..Default::default()
        },
    });
    config.server.drain_timeout_ms = 1000;
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = format!("http://{}", grpc.local_addr().unwrap());
    let state = AppState::new(config).await.unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let options = dprouter_epp::Options { fallbacks: 0 };
    let task = tokio::spawn(async move {
        dprouter_epp::run(grpc, http, state, options, async move { drop(stopped.await) })
            .await
            .unwrap();
    });
    (address, stop, task)
}

type Client = HealthClient<tonic::transport::Channel>;

async fn client(address: &str) -> Client {
    let channel = tonic::transport::Channel::from_shared(address.to_string())
        .unwrap()
        .connect()
        .await;
    HealthClient::new(channel.unwrap())
}

async fn status(client: &mut Client, service: &str) -> ServingStatus {
    let answer = client
        .check(HealthCheckRequest {
            service: service.into(),
        })
        .await
        .unwrap();
    answer.into_inner().status()
}

async fn until(client: &mut Client, service: &str, wanted: ServingStatus) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while status(client, service).await != wanted {
        assert!(tokio::time::Instant::now() < deadline, "{service} never {wanted:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn readiness_waits_for_discovery_and_ends_with_shutdown() {
    // A name that never resolves (RFC 6761's .invalid): the source never syncs.
    let (never, stop, task) = picker("dprouter-test.invalid", 8000).await;
    let mut c = client(&never).await;
    until(&mut c, "liveness", ServingStatus::Serving).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    for service in dprouter_epp::READY_NAMES {
        assert_eq!(
            status(&mut c, service).await,
            ServingStatus::NotServing,
            "{service:?} before discovery synced"
        );
    }
    stop.send(()).unwrap();
    task.await.unwrap();

    // localhost resolves: ready once the first answer is applied, whether or not an engine answers there.
    let (synced, stop, task) = picker("localhost", 1).await;
    let mut c = client(&synced).await;
    for service in dprouter_epp::READY_NAMES {
        until(&mut c, service, ServingStatus::Serving).await;
    }
    assert_eq!(status(&mut c, "liveness").await, ServingStatus::Serving);
    // Shutdown: a connection already open still gets answers while the picker drains, and it is not ready.
    stop.send(()).unwrap();
    until(&mut c, "readiness", ServingStatus::NotServing).await;
    task.await.unwrap();
}
