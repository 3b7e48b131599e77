//! `dprouter mock-engine`: an HTTP server that behaves like SGLang launched with `--dp-size N` (or a vLLM DP
//! deployment), with each rank's radix cache and timing taken from the simulator's model, in scaled real time.
//!
//! For the gateway's tests, CI, demos and HTTP benchmarks on machines without GPUs. Start it in-process with
//! [`serve`] on a listener bound to `127.0.0.1:0`.

use std::future::Future;
use std::sync::Arc;

use axum::serve::ListenerExt;
use tokio::net::TcpListener;

pub mod api;
pub mod disagg;
pub mod engine;
mod job;
pub mod kv_publisher;
mod messages;
mod render;
pub mod responses;
pub mod stall;
pub mod tokenizer;

pub use api::{router, SERVED_RANK_HEADER};
pub use engine::{Admission, Api, Engine, EngineConfig, Faults, Leg};

/// Serves `engine` on `listener` until `shutdown` completes (in-flight requests finish first).
pub async fn serve(
    listener: TcpListener,
    engine: Arc<Engine>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    // Small SSE events must not wait for Nagle's algorithm.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, router(engine))
        .with_graceful_shutdown(shutdown)
        .await
}

/// Serves a prefill mock's bootstrap server ([`disagg`]) on `listener` until `shutdown` completes.
pub async fn serve_bootstrap(
    listener: TcpListener,
    engine: Arc<Engine>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let config = engine
        .config()
        .disaggregation
        .clone()
        .unwrap_or_else(|| disagg::Disaggregation::new(disagg::Mode::Prefill));
    let router = disagg::bootstrap_router(Arc::clone(engine.rooms()), &config);
    axum::serve(listener, router).with_graceful_shutdown(shutdown).await
}
