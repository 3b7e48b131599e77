//! dprouter's gateway: an HTTP server that routes OpenAI (`/v1/chat/completions`, `/v1/completions`,
//! `/v1/responses`, `/v1/embeddings`) and SGLang (`/generate`) requests to the data-parallel ranks of SGLang, vLLM or plain OpenAI-compatible workers, with a
//! `core` policy, health checks, load accounting released on every path, and Prometheus metrics.
//!
//! Start in-process: `let state = AppState::new(config).await?; serve(listener, state, shutdown).await`.

pub mod access;
pub mod body;
pub mod clock;
pub mod config;
pub mod error;
pub mod health;
pub mod kv_events;
pub mod listener;
pub mod proxy;
pub mod registry;
pub mod responses;
pub mod server;
pub mod state;
pub mod telemetry;
pub mod tls;
pub mod tokens;
pub mod upstream;

pub use config::{Backend, GatewayConfig, RankField, WorkerConfig};
pub use error::ApiError;
pub use server::{router, serve};
pub use state::{AppState, StartError};
