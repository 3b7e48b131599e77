//! dprouter as an Endpoint Picker (EPP): the Gateway API Inference Extension's way for a proxy (Envoy, and the
//! Gateway API implementations built on it) to ask which endpoint of an `InferencePool` serves each request, over
//! Envoy's `ext_proc` gRPC stream ([`picker`]; the protocol's names and messages in [`protocol`]).
//!
//! The picker is the gateway without the proxy: the same `AppState` (workers, health, policies, tokenizers, KV
//! event feeds), the same routing decision, the same feedback from each response, and the gateway's control routes
//! (`/health`, `/readiness`, `/metrics`, and the admin API under the same rules) on an HTTP side. gRPC health
//! answers `liveness` at once; `readiness`, the overall `""`, the ext_proc service's name (what Envoy's health
//! check asks) and `inference-extension` once discovery has synced (at once without discovery), and not any more
//! once shutdown begins.
//!
//! Start in-process: `let state = AppState::new(config).await?; run(grpc, http, state, options, shutdown).await`.

pub mod picker;
pub mod protocol;

use std::future::Future;
use std::sync::Arc;

use dprouter_gateway::front_end::{control_router, listen, tls_acceptor, AppState, Background, Protocol, HTTP2};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{ExternalProcessorServer, SERVICE_NAME};
use tokio::net::TcpListener;
use tonic_health::ServingStatus;

pub use picker::Picker;

/// The gRPC health service names answered once the picker is ready: the overall status, Kubernetes' readiness,
/// the ext_proc service (Envoy's health check of the picker's cluster) and the reference chart's name.
pub const READY_NAMES: [&str; 4] = ["", "readiness", SERVICE_NAME, "inference-extension"];

/// The largest ext_proc message the picker reads: a body chunk of up to 4 MiB (or `max_body_bytes`, if less),
/// and room for the rest of the message. A streamed body comes in chunks of what the data plane has read (Envoy:
/// at most its buffer limit, 1 MiB by default), so only a `BUFFERED` body over 4 MiB is refused
/// (`RESOURCE_EXHAUSTED`). The limit bounds what one stream holds before the body budget sees it.
pub fn max_message_bytes(max_body_bytes: usize) -> usize {
    max_body_bytes.min(4 << 20) + (64 << 10)
}

/// How the picker answers beyond what the gateway's config says.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Endpoints listed after the chosen one for the data plane to retry on (only where no rank is injected; 0:
    /// none, as Envoy's original destination cluster takes one address).
    pub fallbacks: usize,
}

/// Serves the picker on `grpc` (ext_proc and gRPC health) and its control routes on `http` until `shutdown`
/// completes; then reports not ready and drains for at most `server.drain_timeout_ms`.
pub async fn run(
    grpc: TcpListener,
    http: TcpListener,
    state: Arc<AppState>,
    options: Options,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let background = Background::start(&state);
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_service_status("liveness", ServingStatus::Serving).await;
    for name in READY_NAMES {
        health.set_service_status(name, ServingStatus::NotServing).await;
    }
    // Ready once discovery has synced (at once without discovery), as the reference EPP once its pool has.
    let mut ready = {
        let health = health.clone();
        let mut unsynced = state.discovery_unsynced.subscribe();
        tokio::spawn(async move {
            if unsynced.wait_for(|n| *n == 0).await.is_ok() {
                for name in READY_NAMES {
                    health.set_service_status(name, ServingStatus::Serving).await;
                }
            }
        })
    };
    let (stopping, stopped) = tokio::sync::watch::channel(false);
    let stop = |mut stopped: tokio::sync::watch::Receiver<bool>| async move {
        let _ = stopped.wait_for(|s| *s).await;
    };
    let http_side = {
        let config = state.config.server.clone();
        let deadline = state.drain_deadline.clone();
        let router = control_router(Arc::clone(&state));
        let stop = stop(stopped.clone());
        tokio::spawn(async move { listen(http, Protocol::Http1, router, &config, None, &deadline, stop).await })
    };
    let picker = ExternalProcessorServer::new(Picker::new(Arc::clone(&state), options.fallbacks))
        .max_decoding_message_size(max_message_bytes(state.config.max_body_bytes));
    // The gateway's listener, in HTTP/2: its connection cap, idle timeout, accept back-off and drain.
    let grpc_router = tonic::service::Routes::new(health_service)
        .add_service(picker)
        .into_axum_router();
    let config = state.config.server.clone();
    // TLS (mutual with `tls_client_ca_file`) on the gRPC port only: the HTTP side answers probes and scrapes.
    let tls = tls_acceptor(&config, HTTP2).map_err(std::io::Error::other)?;
    let server = listen(
        grpc,
        Protocol::Http2,
        grpc_router,
        &config,
        tls,
        &state.drain_deadline,
        stop(stopped),
    );
    let mut server = std::pin::pin!(server);
    let served = tokio::select! {
        served = &mut server => served,
        () = shutdown => {
            ready.abort();
            let _ = (&mut ready).await;
            for name in READY_NAMES {
                health.set_service_status(name, ServingStatus::NotServing).await;
            }
            let _ = stopping.send(true);
            // Streams in flight finish within the drain timeout (the listener's drain).
            server.await
        }
    };
    let _ = stopping.send(true);
    let http_served = http_side.await.unwrap_or(Ok(()));
    background.stop().await;
    served?;
    http_served
}
