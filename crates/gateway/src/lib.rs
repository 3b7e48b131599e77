//! dprouter's gateway: an HTTP server that routes OpenAI (`/v1/chat/completions`, `/v1/completions`,
//! `/v1/responses`, `/v1/embeddings`) and SGLang (`/generate`) requests to the data-parallel ranks of SGLang, vLLM
//! or plain OpenAI-compatible workers, with a `core` policy, health checks, load accounting released on every path,
//! and Prometheus metrics.
//!
//! Start in-process: `let state = AppState::new(config).await?; serve(listener, state, shutdown).await`.
//!
//! Outside the crate, its surface is small: the configuration ([`config`]), the state and [`serve`], the surface
//! other front ends build on ([`front_end`], the Endpoint Picker's), the decode sidecar ([`decode_sidecar`]), the
//! metric names ([`telemetry`]), and the client towards engines ([`upstream`]); the folders below are the crate's
//! own.
//!
//! The crate's folders, one concern each, in layers: each imports only from the folders before it in this list
//! (`tests/layers.rs` holds the list and fails when a folder imports a later one), so the crate reads bottom-up:
//!
//! 1. [`common`]: shared names and plain values (errors, the clock, header names, throttled logs, the drain
//!    deadline, the Responses ids store).
//! 2. [`config`]: the typed configuration (workers, discovery sources, clients, flow control).
//! 3. [`http`]: the listener (connections, limits, timeouts, drain), TLS, the in-flight gate.
//! 4. [`fleet`]: workers and endpoints (the registry: membership, health, load), the client towards the engines,
//!    the policies by model.
//! 5. [`observe`]: metrics, untrusted input refused, trace context and spans, the access log's record.
//! 6. [`discovery`]: Kubernetes and DNS sources, each telling what it found on a channel.
//! 7. [`kv_feeds`]: the engines' KV event feeds (precise mode).
//! 8. [`admission`]: keys and rate limits, the shared body budget, flow control's queue, the tokenizer.
//! 9. [`state`]: the parts together, for the handlers.
//! 10. [`background`]: health probes and load polls, found workers joining the fleet.
//! 11. [`pipeline`]: one request's decision (routing, pairing) and its exchange with an engine (relay, feedback).
//! 12. [`disagg`]: a disaggregated request's two legs under `serve`, and the decode sidecar for a picker.
//! 13. [`api`]: the routes, the inference handler, stored Responses, the admin API and `serve`.

mod admission;
mod api;
mod background;
mod common;
pub mod config;
mod disagg;
mod discovery;
mod fleet;
mod http;
mod kv_feeds;
mod observe;
mod pipeline;
mod state;

pub use api::front_end;
pub use api::server::{router, serve};
pub use common::error::ApiError;
pub use common::runtime;
pub use config::{Backend, GatewayConfig, RankField, Role, WorkerConfig};
pub use observe::telemetry;
pub use state::{AppState, StartError};

/// The decode sidecar (`dprouter decode-sidecar`), a front end of its own: the prefill leg beside a decode server.
pub mod decode_sidecar {
    pub use crate::disagg::sidecar::{serve, SidecarConfig};
    pub use crate::disagg::trust::PrefillAllow;
}

/// The client towards the engines, as the gateway sends to them, for tools and tests that talk to engines (or to
/// the Kubernetes API) the same way.
pub mod upstream {
    pub use crate::fleet::upstream::{Chunks, Upstream};
    pub use crate::http::tls::client_config;
}

/// Kubernetes discovery on its own (what `[[discovery.kubernetes]]` runs), for tests against a stand-in API
/// server.
pub mod kubernetes {
    pub use crate::discovery::kubernetes::{run, Api};
}
