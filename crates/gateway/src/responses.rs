//! OpenAI Responses state: which endpoint stored which response.
//!
//! Engines that implement `/v1/responses` (vLLM, SGLang) keep the responses they create in their own process, and
//! a conversation goes on with `previous_response_id`, which only that worker knows: elsewhere it is a 404. So the
//! gateway remembers, for the last [`REMEMBERED`] responses it relayed, the endpoint that made each one (its id is
//! read from the answer as it passes, by the usage scanner), and sends
//! - a request that continues one of them to that endpoint (its rank also holds the conversation's cache), to
//!   another rank of the same worker when that endpoint cannot take it, and through the policy as usual only when
//!   the whole worker is out (the engine's own 404 then says the response is gone);
//! - `GET` and `DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel` and `GET
//!   /v1/responses/{id}/input_items` to its worker; a 404 for an id it does not know.
//!
//! The memory is per gateway process: behind several gateway replicas, a client's conversation must come back to
//! the same replica (or use `prompt_cache_key` and stateless turns). Oldest ids are forgotten first.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{header, HeaderName};
use axum::response::{IntoResponse, Response};
use dprouter_core::EndpointId;

use crate::error::ApiError;
use crate::state::AppState;

/// How many response ids a gateway remembers (about 100 bytes each).
pub const REMEMBERED: usize = 65_536;

/// The longest response id remembered (engines' ids are `resp_` and 32 hex digits or so).
const MAX_ID_BYTES: usize = 256;

/// Response id to the endpoint that made it, the oldest forgotten first.
pub struct ResponseHomes {
    capacity: usize,
    inner: Mutex<Homes>,
}

#[derive(Default)]
struct Homes {
    by_id: HashMap<Arc<str>, EndpointId>,
    order: VecDeque<Arc<str>>,
}

impl ResponseHomes {
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            inner: Mutex::new(Homes::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Homes> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `endpoint` made the response `id`.
    pub fn record(&self, id: String, endpoint: EndpointId) {
        if id.is_empty() || id.len() > MAX_ID_BYTES {
            return;
        }
        let id: Arc<str> = Arc::from(id);
        let mut homes = self.lock();
        if homes.by_id.insert(Arc::clone(&id), endpoint).is_some() {
            return;
        }
        homes.order.push_back(id);
        while homes.order.len() > self.capacity {
            if let Some(old) = homes.order.pop_front() {
                homes.by_id.remove(&old);
            }
        }
    }

    /// The endpoint that made the response `id`, if it is remembered.
    pub fn home(&self, id: &str) -> Option<EndpointId> {
        self.lock().by_id.get(id).copied()
    }

    pub fn len(&self) -> usize {
        self.lock().by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Client headers a stored-response request takes to the worker.
const FORWARDED: [HeaderName; 3] = [
    header::AUTHORIZATION,
    header::ACCEPT,
    HeaderName::from_static(crate::server::REQUEST_ID),
];

/// `GET`/`DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`, `GET /v1/responses/{id}/input_items`: to
/// the worker that made the response, answered as it answers.
pub async fn stored(State(state): State<Arc<AppState>>, request: Request) -> Result<Response, ApiError> {
    let path_and_query = request.uri().path_and_query().map_or("", |p| p.as_str()).to_string();
    let id = request
        .uri()
        .path()
        .trim_start_matches("/v1/responses/")
        .split('/')
        .next()
        .unwrap_or_default()
        .to_string();
    let home = state.responses.home(&id).ok_or_else(|| {
        ApiError::NotFound(format!(
            "no response `{id}` is known here: only the last {REMEMBERED} responses made through this gateway are"
        ))
    })?;
    let membership = state.registry.membership();
    let target = membership
        .targets
        .iter()
        .find(|t| t.id.worker == home.worker)
        .ok_or_else(|| ApiError::NotFound(format!("the worker that made response `{id}` has been removed")))?;
    let mut upstream = hyper::Request::builder()
        .method(request.method().clone())
        .uri(format!("{}{path_and_query}", target.base));
    for name in &FORWARDED {
        if let Some(v) = request.headers().get(name) {
            upstream = upstream.header(name, v);
        }
    }
    let upstream = upstream
        .body(crate::upstream::Chunks::default())
        .map_err(|e| ApiError::BadRequest(format!("cannot build the upstream request: {e}")))?;
    let timeout = Duration::from_millis(state.config.first_byte_timeout_ms);
    let (status, headers, bytes) =
        state
            .upstream
            .exchange(upstream, timeout)
            .await
            .map_err(|message| ApiError::Upstream {
                endpoint: target.label(),
                message,
            })?;
    let mut out = (status, bytes).into_response();
    if let Some(ct) = headers.get(header::CONTENT_TYPE) {
        out.headers_mut().insert(header::CONTENT_TYPE, ct.clone());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint(worker: u32, rank: u32) -> EndpointId {
        EndpointId::new(worker, rank)
    }

    #[test]
    fn the_oldest_ids_are_forgotten_first() {
        let homes = ResponseHomes::new(2);
        homes.record("a".into(), endpoint(0, 1));
        homes.record("b".into(), endpoint(1, 0));
        homes.record("a".into(), endpoint(0, 1));
        assert_eq!(homes.len(), 2, "the same id twice is one");
        homes.record("c".into(), endpoint(2, 0));
        assert_eq!(homes.home("a"), None);
        assert_eq!(homes.home("b"), Some(endpoint(1, 0)));
        assert_eq!(homes.home("c"), Some(endpoint(2, 0)));
        homes.record(String::new(), endpoint(0, 0));
        homes.record("x".repeat(MAX_ID_BYTES + 1), endpoint(0, 0));
        assert_eq!(homes.len(), 2, "empty and oversized ids are not kept");
    }
}
