//! dprouter's routing core: endpoints, the load model, prompt keys and the routing policies.
//!
//! Pure algorithms, no I/O and no async runtime: the gateway, the simulator and `dprouter route` all run this same
//! code. Entry point: build a policy from a [`PolicyConfig`], then [`dispatch`] each [`RouteRequest`] against the
//! current [`Snapshot`].

pub mod block_index;
pub mod config;
pub mod endpoint;
pub mod error;
pub mod hashing;
pub mod load;
pub mod policy;
pub mod prefix_key;
pub mod prompt;
pub mod request;
pub mod request_body;

pub use config::{ConfigError, InvalidOption, PolicyConfig};
pub use endpoint::{Endpoint, EndpointId, Snapshot, WorkerId};
pub use error::RouteError;
pub use load::{EndpointLoad, EngineReport, LoadGuard, LoadView};
pub use policy::{
    dispatch, route, AffinityLoad, Branch, CacheAware, CacheAwareConfig, Dispatch, IndexStats, Pick, Policy,
    PrefixAffinityConfig,
};
pub use prefix_key::PrefixWindow;
pub use request::{Prompt, RouteRequest};
