//! dprouter's routing core: endpoints, the load model, prompt keys and the routing policies.
//!
//! Pure algorithms, no I/O and no async runtime: the gateway, the simulator and `dprouter route` all run this same
//! code. Entry point: build a policy from a [`PolicyConfig`], then [`dispatch`] each [`RouteRequest`] against the
//! current [`Snapshot`]; the [`Ticket`] it returns carries the request's feedback.

pub mod anthropic;
pub mod block_index;
mod chat;
pub mod config;
pub mod cost_fit;
pub mod dp_router;
pub mod endpoint;
pub mod engine_blocks;
pub mod error;
pub mod flow_queue;
pub mod hashing;
mod json_key;
pub mod kv_events;
pub mod kv_feed;
pub mod load;
pub mod policy;
pub mod prefix_key;
pub mod prompt;
pub mod request;
pub mod request_body;
pub mod ticket;
pub mod tool_calls;
pub mod usage;

pub use config::{ConfigError, InvalidOption, PolicyConfig};
pub use endpoint::{Endpoint, EndpointId, Snapshot, WorkerId};
pub use error::RouteError;
pub use load::{EndpointLoad, EngineReport, LoadGuard, LoadView};
pub use policy::{
    route, AffinityLoad, Branch, CacheAware, CacheAwareConfig, Candidates, Ending, IndexStats, Pick, Policy,
    PrefixAffinityConfig, Prepared,
};
pub use prefix_key::PrefixWindow;
pub use request::{Prompt, RouteRequest};
pub use ticket::{dispatch, dispatch_among, PolicyRef, Ticket};
pub use usage::{Framing, Usage, UsageScanner};
