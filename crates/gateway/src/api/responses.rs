//! OpenAI Responses state: which endpoint stored which response.
//!
//! Engines that implement `/v1/responses` (vLLM, SGLang) keep the responses they create in their own process, and
//! a conversation goes on with `previous_response_id`, which only that worker knows: elsewhere it is a 404. So the
//! gateway remembers, for the last `remembered_responses` responses it relayed (65,536 by default; a fair share for each keyed client), the endpoint that made each one (its id is
//! read from the answer as it passes, by the usage scanner), and sends
//! - a request that continues one of them to that endpoint (its rank also holds the conversation's cache), to
//!   another rank of the same worker when that endpoint cannot take it, and through the policy as usual only when
//!   the whole worker is out (the engine's own 404 then says the response is gone);
//! - `GET` and `DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel` and `GET
//!   /v1/responses/{id}/input_items` to its worker; a 404 for an id it does not know.
//!
//! With keyed clients ([`crate::admission::clients`]) a response belongs to the client it was made for: another client naming
//! it gets the same 404 as for an id never seen, whether it reads it or continues it, and never reaches the engine
//! (which would serve whoever names the id).
//!
//! The memory ([`crate::common::response_homes`]) is per gateway process: behind several gateway replicas, a client's
//! conversation must come back to the same replica (or use `prompt_cache_key` and stateless turns).

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};

use crate::common::error::ApiError;
use crate::state::AppState;

/// `GET`/`DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`, `GET /v1/responses/{id}/input_items`: to
/// the worker that made the response, answered as it answers.
pub async fn stored(State(state): State<Arc<AppState>>, request: Request) -> Result<Response, ApiError> {
    let client = state.clients.admit(request.headers())?;
    let path_and_query = request.uri().path_and_query().map_or("", |p| p.as_str()).to_string();
    let id = request
        .uri()
        .path()
        .trim_start_matches("/v1/responses/")
        .split('/')
        .next()
        .unwrap_or_default()
        .to_string();
    // A keyed client's responses are its own: another's is unknown to it.
    let home = state
        .responses
        .home(&id, client.as_ref().map(|c| &*c.name))
        .ok_or_else(|| {
            ApiError::NotFound(format!(
                "no response `{id}` is known here: only the last {} responses made through this gateway are",
                state.config.remembered_responses
            ))
        })?;
    let membership = state.registry.membership();
    let target = membership
        .targets
        .iter()
        .find(|t| t.id.worker == home.worker)
        .ok_or_else(|| ApiError::NotFound(format!("the worker that made response `{id}` has been removed")))?;
    let span = request
        .extensions()
        .get::<crate::observe::spans::RequestSpan>()
        .cloned();
    let attempt = span.map(|s| s.attempt(&target.label(), target.id.dp_rank, 1));
    let upstream = crate::pipeline::engine_headers::EngineRequest {
        method: request.method().clone(),
        url: format!("{}{path_and_query}", target.base),
        client: request.headers(),
        traceparent: attempt
            .as_ref()
            .and_then(crate::observe::spans::AttemptSpan::traceparent),
        content_type: None,
        authorization: crate::pipeline::engine_headers::authorization(client.is_some(), target, request.headers())
            .cloned(),
        rank: None,
    }
    .build(Vec::new())?;
    let timeout = Duration::from_millis(state.config.first_byte_timeout_ms);
    let (status, headers, bytes) = state
        .upstream
        // A stored response is at most what a client may send the gateway in one body.
        .exchange(upstream, timeout, state.config.max_body_bytes)
        .await
        .map_err(|message| {
            if let Some(a) = &attempt {
                a.failed(&message);
            }
            ApiError::Upstream {
                endpoint: target.label(),
                message,
            }
        })?;
    if let Some(a) = &attempt {
        a.answered(status.as_u16());
    }
    let mut out = (status, bytes).into_response();
    if let Some(ct) = headers.get(header::CONTENT_TYPE) {
        out.headers_mut().insert(header::CONTENT_TYPE, ct.clone());
    }
    Ok(out)
}
