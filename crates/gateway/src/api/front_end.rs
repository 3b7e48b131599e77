//! The surface a front end other than `serve`'s own handler builds on (`dprouter_gateway::front_end`): the Endpoint
//! Picker (`crates/epp`) translates Envoy's ext_proc stream into these calls and imports nothing else of the
//! gateway. It follows the pipeline's steps, each the one `serve` runs:
//!
//! - **serve**: the gateway's state ([`AppState`]), its listener ([`listen`], its [`Protocol`]s and TLS), the control routes and the
//!   background tasks;
//! - **admit**: the head ([`admit_head`]: header sizes, the route, the client's first-byte deadline, the key and
//!   rate limit) and the body ([`BodyReader`]: the size limit, the shared budget);
//! - **decide**: [`route`] (parse, model, tokens, flow control, pick or pair) into a [`Routed`] request, or, for a
//!   request that changes no cache ([`changes_no_cache`]: Anthropic's `count_tokens`), [`route_uncached`];
//! - **attempt**: the one engine-header rule ([`reaches_engine`]), the one outcome recorder ([`record`]), the
//!   decode sidecar's header names;
//! - **feedback**: [`feedback`] for the answer's bytes, and the request's span; the gateway's own errors in the
//!   route's [`ErrorShape`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::HeaderMap;

pub use crate::admission::body_reader::BodyReader;
pub use crate::admission::clients::Client;
pub use crate::api::server::{control_router, Background};
pub use crate::common::error::{add_ids, ApiError};
pub use crate::common::error_shape::ErrorShape;
pub use crate::common::names::REQUEST_ID;
pub use crate::config::{Backend, GatewayConfig};
pub use crate::disagg::legs::PREFILL_ENDPOINT_HEADER;
pub use crate::disagg::sidecar::{FAILED_LEG_HEADER, PREFILLER_HEADER, PREFILL_RANK_HEADER};
pub use crate::fleet::registry::{Membership, Target};
pub use crate::http::listener::{run as listen, Protocol};
pub use crate::http::tls::{acceptor as tls_acceptor, HTTP2};
pub use crate::observe::access::Exchange;
pub use crate::observe::refusals::refused;
pub use crate::observe::spans::RequestSpan;
pub use crate::observe::trace_context::{traceparent, TRACEPARENT, TRACESTATE};
pub use crate::pipeline::engine_headers::{data_planes, reaches_engine};
pub use crate::pipeline::feedback::Feedback;
pub use crate::pipeline::outcome::{record, Attempt, Outcome};
pub use crate::pipeline::routing::{
    changes_no_cache, check_content_type, injects_rank, route, route_uncached, Routed, Uncached, RANK_HEADER,
};
pub use crate::state::AppState;

use crate::api::{proxy, server};

/// What a request's head admitted: its client (when clients are configured) and its first-byte deadline.
pub struct Head {
    pub client: Option<Arc<Client>>,
    pub first_byte: Duration,
}

/// Checks a request's head as `serve` does before its body is read: the headers' count and size (`sizes`: each
/// header's name and value lengths, pseudo-headers left out), the route (`serve`'s 404 or 405), the client's
/// `x-dprouter-first-byte-timeout-ms`, and the key and rate limit. `traced` is called with the route's name (or
/// `unmatched`) when its requests are traced, before the route can be refused, so that a refusal has its span.
pub fn admit_head(
    state: &AppState,
    (method, path): (&str, &str),
    headers: &HeaderMap,
    sizes: impl Iterator<Item = (usize, usize)>,
    traced: impl FnOnce(&'static str),
) -> Result<Head, ApiError> {
    server::check_header_sizes(sizes)?;
    let route = server::public_route(method, path);
    let name = route.as_ref().map_or("unmatched", |r| r);
    if server::is_traced(name) {
        traced(name);
    }
    route?;
    let first_byte = proxy::first_byte_timeout(state, headers)?;
    let client = state.clients.admit(headers)?;
    Ok(Head { client, first_byte })
}

/// The feedback that reads the answer of `routed` (served by `target`, `status`, an event stream when `sse`, on a
/// route whose errors take `shape`) as
/// `serve`'s relay does: its first byte, the engine's usage report into the ticket, a Responses answer's id, and
/// the access log's record (returned beside it, for the request's span). A disaggregated request's prefill ticket
/// is held until the answer's first byte.
pub fn feedback(
    state: &AppState,
    mut routed: Routed,
    target: &Target,
    (status, sse, shape): (u16, bool, ErrorShape),
    received: Instant,
) -> (Feedback, Exchange) {
    let prefill = routed.pair.as_mut().and_then(|pair| pair.ticket.take());
    let exchange = Exchange::new();
    exchange.routed(routed.routing(target, state.policies.default_policy().name(), 0));
    let remember = routed.remember(status);
    let feedback = Feedback::new(routed.ticket, sse, received, exchange.clone())
        .with_prefill_leg(prefill)
        .in_shape(shape);
    let feedback = match remember {
        Some(owner) => feedback.remembering_the_response(Arc::clone(&state.responses), owner),
        None => feedback,
    };
    (feedback, exchange)
}
