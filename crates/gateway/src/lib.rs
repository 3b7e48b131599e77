//! dprouter's gateway: an HTTP server that routes OpenAI (`/v1/chat/completions`, `/v1/completions`,
//! `/v1/responses`, `/v1/embeddings`) and SGLang (`/generate`) requests to the data-parallel ranks of SGLang, vLLM or plain OpenAI-compatible workers, with a
//! `core` policy, health checks, load accounting released on every path, and Prometheus metrics.
//!
//! Start in-process: `let state = AppState::new(config).await?; serve(listener, state, shutdown).await`.
//!
//! The gateway's modules in layers, each importing only from the layers below it (no module imports one that
//! imports it back, directly or through others), so the crate reads bottom-up:
//!
//! 1. Shared names and plain values, importing nothing of the crate but each other: [`crate::names`] (the
//!    request-id header, the limits of a request head), [`crate::worker_config`] (one worker's),
//!    [`crate::discovery_config`], [`crate::client_config`], [`crate::flow_config`], [`crate::config`] (the whole), [`crate::error`], [`crate::clock`],
//!    [`crate::tls`], [`crate::response_homes`], [`crate::drain_deadline`], [`crate::runtime`] (the runtime both
//!    front doors run on), [`crate::trace_context`] and [`crate::spans`] (the trace context the engines get, and
//!    the gateway's trace spans).
//! 2. Parts of the state, each on its own: [`crate::upstream`] (the client towards the engines),
//!    [`crate::registry`] (workers, endpoints, health, membership), [`crate::policies`], [`crate::tokens`],
//!    [`crate::clients`] (who calls: keys and rate limits), [`crate::flow_affinity`] (a queued request's routing
//!    data, over the registry's membership);
//!    [`crate::telemetry`] (metric names, over the registry); [`crate::refusals`] (untrusted input dropped,
//!    clipped or refused, counted); [`crate::parse_errors`] (JSON bodies for the answers hyper writes itself).
//! 3. Features that take the parts they use: [`crate::kv_events`] (the feeds: workers, registry, policies and
//!    their own status map), [`crate::access`] (what each answer was), [`crate::flow`] (flow control's queue, over
//!    the registry), the discovery sources
//!    [`crate::kubernetes`] and [`crate::dns`] (what they find, on a channel).
//! 4. [`crate::state`]: the parts together, for the handlers.
//! 5. What serves requests over the state: [`crate::discovery`] (found workers into the registry), [`crate::health`], [`crate::body`], [`crate::responses`],
//!    [`crate::routing`] (one request's decision, for the proxy and the Endpoint Picker), [`crate::proxy`], [`crate::listener`],
//!    [`crate::sidecar`] (a disaggregated request's prefill leg beside its decode server, for a picker).
//! 6. [`crate::server`]: the routes, the admin API and `serve`.
//!
//! The workspace's `tests/layers.rs` fails on an import cycle in any crate.

pub mod access;
pub mod admin;
pub mod body;
pub mod body_budget;
pub mod client_config;
pub mod clients;
pub mod clock;
pub mod config;
pub mod discovery;
pub mod discovery_config;
pub mod dns;
pub mod drain_deadline;
pub mod error;
pub mod flow;
pub mod flow_affinity;
pub mod flow_config;
pub mod health;
pub mod in_flight;
pub mod kubernetes;
pub mod kubernetes_objects;
pub mod kv_events;
pub mod legs;
pub mod listener;
pub mod names;
pub mod pairing;
pub mod parse_errors;
pub mod policies;
pub mod proxy;
pub mod refusals;
pub mod registry;
pub mod relay;
pub mod response_homes;
pub mod responses;
pub mod routing;
pub mod runtime;
pub mod server;
pub mod sidecar;
pub mod spans;
pub mod state;
pub mod telemetry;
pub mod throttled;
pub mod tls;
pub mod tokens;
pub mod trace_context;
pub mod upstream;
pub mod worker_config;

pub use config::{Backend, GatewayConfig, RankField, Role, WorkerConfig};
pub use error::ApiError;
pub use server::{router, serve};
pub use state::{AppState, StartError};
