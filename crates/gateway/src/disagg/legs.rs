//! A disaggregated request's two legs ([`crate::pipeline::pairing`]). SGLang's way: the prefill and the decode server get
//! the same body at once, each with the bootstrap room that pairs them, and the client gets the decode server's
//! answer. vLLM's way ([`PrefillFirst`]): the prefill leg first, to its end, then the decode leg with the
//! `kv_transfer_params` of the prefill answer; a prefill leg that fails on the server's side leaves the decode
//! server to prefill the prompt itself.
//!
//! The prefill leg runs in a task of its own ([`crate::disagg::prefill_leg`], the sidecar's runner too) holding the prefill ticket: its first byte releases
//! the prefill endpoint's queued-prefill share, its usage report (the prompt tokens the prefill server had cached)
//! teaches the prefill policy, and its end releases the endpoint's in-flight count. Its outcome is watched by
//! whatever waits on the decode leg: the response head first, then the body relayed to the client
//! ([`crate::pipeline::body::GuardedBody::watching`]). Either leg failing ends the other:
//! - the prefill leg fails before the decode leg answers: the decode request is dropped (its connection closes,
//!   which aborts it at the engine) and the client gets the prefill's 4xx as it came, or a 502/504 that names the
//!   prefill endpoint;
//! - the prefill leg fails while the decode answer streams: the stream ends with an error event (a body that is
//!   not a stream breaks);
//! - the decode leg fails, or the client goes away: the prefill task is aborted, closing its connection.
//!
//! A connection refused on either leg is retried (at most `retries` times, never for a pinned leg) before any byte
//! reached the client: a refused prefill leg on another prefill endpoint with a new room (the decode request
//! waiting for the old room is dropped and sent again), a refused decode leg on another decode endpoint with the
//! same room (the prefill server still holds the room's KV cache for whichever decode server asks for it).

use std::sync::Arc;
use std::time::Duration;

use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use dprouter_core::UsageScanner;

use crate::common::error::ApiError;
use crate::config::{Backend, Role};
use crate::disagg::prefill_leg::{self, Described, LegEvents, LegFailure, LegRun, PrefillWatch};
use crate::fleet::registry::Target;
use crate::fleet::upstream::Chunks;
use crate::observe::spans::{AttemptSpan, RequestSpan};
use crate::observe::telemetry;
use crate::pipeline::body::{GatewayTicket, Timing, Watch};
use crate::pipeline::outcome::{record, Attempt, Outcome};
use crate::pipeline::relay::{answered, exchange_failed, no_head, relay, upstream_request, Answer};
use crate::pipeline::retry::Refused;
use crate::pipeline::routing::Routed;
use crate::state::AppState;

/// A prefill leg of `serve`'s that failed: how, and its ticket back when its connection was refused (to route
/// again).
struct Failed {
    failure: LegFailure,
    ticket: Option<Box<GatewayTicket>>,
}

impl Described for Failed {
    fn message(&self, endpoint: &str) -> String {
        self.failure.message(endpoint)
    }
}

/// What `serve`'s prefill leg holds while it runs ([`prefill_leg::run`] runs it): the prefill ticket, whose
/// first byte releases the endpoint's queued-prefill share and whose usage report teaches the prefill policy; the
/// attempt's span; the outcome recorder's target.
struct TicketedLeg {
    ticket: GatewayTicket,
    target: Target,
    state: Arc<AppState>,
    attempt: AttemptSpan,
    scanner: Option<UsageScanner>,
}

impl LegEvents for TicketedLeg {
    fn outcome(&mut self, outcome: Outcome, detail: &str) {
        match outcome {
            Outcome::Answered(status) => self.attempt.answered(status),
            Outcome::NoHead | Outcome::Failed { .. } => self.attempt.failed(detail),
            Outcome::Cut { .. } => {}
        }
        let branch = Some(self.ticket.pick.branch);
        record(&self.state.registry, Attempt::at(&self.target, branch), outcome);
    }

    fn prefill_over(&mut self) {
        self.ticket.first_token(crate::common::clock::now_us());
    }

    fn data(&mut self, data: &[u8], sse: bool) {
        if let Some(usage) = self.scanner.get_or_insert_with(|| UsageScanner::new(sse)).feed(data) {
            self.report(usage);
        }
    }

    fn ended(&mut self) {
        if let Some(usage) = self.scanner.as_mut().and_then(UsageScanner::finish) {
            self.report(usage);
        }
    }
}

impl TicketedLeg {
    /// Runs the leg ([`prefill_leg::run`]); a refused connection gives the ticket back.
    async fn run(mut self, request: hyper::Request<Chunks>, run: LegRun) -> Result<Option<Bytes>, Failed> {
        let upstream = self.state.upstream.clone();
        match prefill_leg::run(&upstream, request, run, &mut self).await {
            Ok(kept) => Ok(kept),
            Err(failure @ LegFailure::Refused(_)) => Err(Failed {
                failure,
                ticket: Some(Box::new(self.ticket)),
            }),
            Err(failure) => Err(Failed { failure, ticket: None }),
        }
    }

    /// The prefill server's usage report: how much of the prompt it had cached teaches the prefill policy.
    fn report(&mut self, usage: dprouter_core::Usage) {
        let label = self.target.label();
        metrics::counter!(telemetry::PROMPT_TOKENS, "endpoint" => label.clone()).increment(usage.prompt_tokens);
        metrics::counter!(telemetry::CACHED_TOKENS, "endpoint" => label).increment(usage.cached_tokens);
        self.ticket.usage(usage);
    }
}

/// What ended the wait for the decode leg's response head.
enum Waited {
    Decode(Result<Result<hyper::Response<hyper::body::Incoming>, crate::fleet::upstream::UpstreamError>, ()>),
    Prefill(Failed),
}

/// Forwards a disaggregated request (`routed.pair` is set): both legs, retries on refused connections, and the
/// decode leg's answer relayed with the prefill leg watched.
pub async fn forward(
    state: &Arc<AppState>,
    headers: &HeaderMap,
    path_and_query: &str,
    mut routed: Routed,
    span: RequestSpan,
    timing: Timing,
    first_byte_timeout: Duration,
) -> Result<Response, ApiError> {
    let membership = Arc::clone(&routed.membership);
    let mut refused = Refused::default();
    let mut running: Option<PrefillWatch<Failed>> = None;
    let prefill_budget = state.config.disaggregation.prefill_first_byte(first_byte_timeout);
    if routed.prefill_target().is_some_and(|t| t.backend == Backend::Vllm) {
        let step = PrefillFirst {
            state,
            headers,
            path_and_query,
            span: &span,
            timing: prefill_timing(timing, prefill_budget),
        };
        if let Some(answer) = step.run(&mut routed, &mut refused).await? {
            return Ok(answer);
        }
    }
    loop {
        let attempt_no = refused.count() as u32 + 1;
        let Some(pair) = routed.pair.as_mut() else {
            return Err(ApiError::Unavailable(
                "a disaggregated request lost its prefill leg".into(),
            ));
        };
        let prefill_target = membership.targets[pair.rank].clone();
        let prefill_label = prefill_target.label();
        // A prefill leg not sent yet (or picked again): sent now, beside the decode leg.
        if let Some(ticket) = pair.ticket.take() {
            let attempt = span.attempt(&prefill_label, prefill_target.id.dp_rank, attempt_no);
            let request = upstream_request(&routed, &prefill_target, path_and_query, headers, attempt.traceparent())?;
            let leg = TicketedLeg {
                ticket,
                target: prefill_target.clone(),
                state: Arc::clone(state),
                attempt,
                scanner: None,
            };
            let leg_timing = prefill_timing(timing, prefill_budget);
            running = Some(PrefillWatch::spawn(
                prefill_label.clone(),
                |decode_started| async move {
                    let run = LegRun {
                        head_by: leg_timing.first_byte,
                        idle: leg_timing.idle,
                        keep: false,
                        decode_started: Some(decode_started),
                    };
                    leg.run(request, run).await.map(|_| ())
                },
            ));
        }
        let target = &membership.targets[routed.ticket.pick.rank];
        let branch = routed.ticket.pick.branch;
        let label = target.label();
        let attempt = span.attempt(&label, target.id.dp_rank, attempt_no);
        let request = upstream_request(&routed, target, path_and_query, headers, attempt.traceparent())?;
        let send = tokio::time::timeout_at(timing.first_byte, state.upstream.send(request));
        tokio::pin!(send);
        let outcome = loop {
            let Some(watch) = running.as_mut() else {
                break Waited::Decode(send.as_mut().await.map_err(|_| ()));
            };
            tokio::select! {
                sent = send.as_mut() => break Waited::Decode(sent.map_err(|_| ())),
                ended = &mut watch.handle => match ended {
                    Ok(Ok(())) => {
                        // The prefill is done; the decode answer comes next.
                        watch.detach();
                        running = None;
                    }
                    Ok(Err(failed)) => break Waited::Prefill(failed),
                    Err(e) => break Waited::Prefill(Failed { failure: LegFailure::Broken(e.to_string()), ticket: None }),
                },
            }
        };
        match outcome {
            Waited::Prefill(Failed { failure, ticket }) => {
                running = None;
                // The decode request waits for a room that will never be ready: dropped, it is aborted.
                attempt.failed("its prefill leg failed");
                match (failure, ticket) {
                    (LegFailure::Refused(message), Some(ticket)) => {
                        if !refused.may_retry(state, prefill_target.id.worker, ticket.pick.branch) {
                            return Err(ApiError::Upstream {
                                endpoint: prefill_label,
                                message,
                            });
                        }
                        let prefill = |t: &Target, rank| t.role == Role::Prefill && routed.serving(rank);
                        let ticket = refused
                            .reroute(state, &membership, *ticket, prefill)
                            .map_err(|e| no_prefill(e, &message))?;
                        pair_again(&mut routed, ticket);
                        continue;
                    }
                    (LegFailure::Status { status, body }, _) if (400..500).contains(&status) => {
                        // The request's own fault: the client gets the prefill server's answer as it came.
                        return Ok(client_error(status, body));
                    }
                    (LegFailure::Timeout { .. }, _) => {
                        return Err(ApiError::UpstreamTimeout {
                            endpoint: prefill_label,
                            after_ms: prefill_budget.as_millis() as u64,
                        })
                    }
                    (failure, _) => {
                        return Err(ApiError::Upstream {
                            message: failure.message(&prefill_label),
                            endpoint: prefill_label,
                        })
                    }
                }
            }
            Waited::Decode(Err(())) => {
                return Err(no_head(state, target, branch, &attempt, first_byte_timeout));
            }
            Waited::Decode(Ok(Ok(response))) => {
                let status = response.status();
                answered(state, target, branch, &attempt, status.as_u16());
                if !status.is_success() {
                    // No decode server will fetch the room: the prefill leg ends now.
                    running = None;
                }
                let policy = state.policies.role_default(Role::Decode).name();
                let routing = routed.routing(target, policy, refused.count() as u32);
                let answer = Answer {
                    response,
                    routing,
                    attempt,
                    timing,
                    remember: routed.remember(status.as_u16()),
                    prefill: running.map(|watch| Box::new(watch) as Box<dyn Watch>),
                    shape: crate::common::error_shape::ErrorShape::of_route(path_and_query),
                };
                let mut out = relay(state, answer, routed.ticket, target);
                if let Ok(v) = axum::http::HeaderValue::from_str(&prefill_label) {
                    out.headers_mut().insert(PREFILL_ENDPOINT_HEADER, v);
                }
                return Ok(out);
            }
            Waited::Decode(Ok(Err(err))) => {
                exchange_failed(state, target, branch, &attempt, &err, &mut refused)?;
                // The prefill leg goes on: the new decode endpoint fetches the same room.
                let served = routed.served.clone();
                let decode = |t: &Target, _| t.role == Role::Decode && served.as_deref().is_none_or(|m| t.serves(m));
                routed.ticket = refused.reroute(state, &membership, routed.ticket, decode)?;
            }
        }
    }
}

/// A prefill leg's timing: its response head within `budget` from now, and never after the request's deadline
/// (`[disaggregation] prefill_first_byte_timeout_ms`): a prefill server that never answers is found out, and
/// blamed, while the decode leg still has time.
fn prefill_timing(request: Timing, budget: Duration) -> Timing {
    Timing {
        first_byte: request.first_byte.min(tokio::time::Instant::now() + budget),
        ..request
    }
}

/// vLLM's way: the prefill leg first, to its end; its answer's `kv_transfer_params` then go to the decode leg
/// ([`forward`] sends it). A prefill leg that fails on the server's side (5xx, a broken or late answer, no prefill
/// endpoint left after refused connections) leaves the decode server to prefill the prompt itself, as llm-d does;
/// its 4xx goes to the client as it came.
struct PrefillFirst<'a> {
    state: &'a Arc<AppState>,
    headers: &'a HeaderMap,
    path_and_query: &'a str,
    span: &'a RequestSpan,
    timing: Timing,
}

impl PrefillFirst<'_> {
    /// Runs the prefill leg; `Some(answer)` is the client's answer already (a prefill 4xx).
    async fn run(self, routed: &mut Routed, refused: &mut Refused) -> Result<Option<Response>, ApiError> {
        let membership = Arc::clone(&routed.membership);
        loop {
            let Some(pair) = routed.pair.as_mut() else {
                return Ok(None);
            };
            let Some(ticket) = pair.ticket.take() else {
                return Ok(None);
            };
            let target = membership.targets[pair.rank].clone();
            let label = target.label();
            let attempt = self.span.attempt(&label, target.id.dp_rank, refused.count() as u32 + 1);
            let request = upstream_request(
                routed,
                &target,
                self.path_and_query,
                self.headers,
                attempt.traceparent(),
            )?;
            let leg = TicketedLeg {
                ticket,
                target: target.clone(),
                state: Arc::clone(self.state),
                attempt,
                scanner: None,
            };
            let run = LegRun {
                head_by: self.timing.first_byte,
                idle: self.timing.idle,
                keep: true,
                // vLLM's decode leg starts after this one ends.
                decode_started: None,
            };
            let failed = match leg.run(request, run).await {
                Ok(answer) => {
                    let params = answer.as_deref().and_then(kv_transfer_params);
                    if params.is_none() {
                        // An answer that ended before its one token (an end-of-sequence first token) names no KV:
                        // the decode server prefills.
                        tracing::debug!(endpoint = %label, "the prefill answer has no kv_transfer_params");
                    }
                    if let Some(pair) = routed.pair.as_mut() {
                        pair.kv_transfer_params = params;
                    }
                    return Ok(None);
                }
                Err(failed) => failed,
            };
            match (failed.failure, failed.ticket) {
                (LegFailure::Refused(message), Some(ticket)) => {
                    if refused.may_retry(self.state, target.id.worker, ticket.pick.branch) {
                        let served = routed.served.clone();
                        let prefill =
                            |t: &Target, _| t.role == Role::Prefill && served.as_deref().is_none_or(|m| t.serves(m));
                        if let Ok(ticket) = refused.reroute(self.state, &membership, *ticket, prefill) {
                            pair_again(routed, ticket);
                            continue;
                        }
                    }
                    decode_alone(&label, &message);
                }
                (LegFailure::Status { status, body }, _) if (400..500).contains(&status) => {
                    return Ok(Some(client_error(status, body)));
                }
                (failure, _) => decode_alone(&label, &failure.message(&label)),
            }
            return Ok(None);
        }
    }
}

/// A vLLM prefill leg failed on the server's side (counted in `dprouter_upstream_errors_total` by its leg): the
/// decode server prefills the prompt itself.
fn decode_alone(endpoint: &str, why: &str) {
    tracing::warn!(endpoint, "{why}: the decode server prefills the prompt itself");
}

/// The `kv_transfer_params` of a vLLM answer, as JSON, when it has any.
pub(crate) fn kv_transfer_params(answer: &[u8]) -> Option<Bytes> {
    #[derive(serde::Deserialize)]
    struct Answer {
        kv_transfer_params: Option<serde_json::Value>,
    }
    let params = serde_json::from_slice::<Answer>(answer).ok()?.kv_transfer_params?;
    (!params.is_null()).then(|| Bytes::from(params.to_string()))
}

/// The response header that names a disaggregated request's prefill endpoint (beside `x-dprouter-endpoint`, the
/// decode endpoint's).
pub const PREFILL_ENDPOINT_HEADER: &str = "x-dprouter-prefill-endpoint";

/// A prefill endpoint could not be found again after a refused connection.
fn no_prefill(e: dprouter_core::RouteError, refused: &str) -> ApiError {
    match e {
        dprouter_core::RouteError::NoHealthyEndpoint => ApiError::Unavailable(format!(
            "no other healthy prefill endpoint (the last one refused: {refused})"
        )),
        other => other.into(),
    }
}

/// The pair's prefill leg is `ticket` now, with a fresh room for its rank.
fn pair_again(routed: &mut Routed, ticket: GatewayTicket) {
    let room = crate::pipeline::pairing::room_of(&routed.membership, &ticket);
    if let Some(pair) = routed.pair.as_mut() {
        pair.rank = ticket.pick.rank;
        pair.room = room;
        pair.ticket = Some(ticket);
    }
}

/// A prefill server's 4xx, as it came (a JSON body, or the gateway's own error body around its text).
pub(crate) fn client_error(status: u16, body: Bytes) -> Response {
    let status = axum::http::StatusCode::from_u16(status).unwrap_or(axum::http::StatusCode::BAD_REQUEST);
    if serde_json::from_slice::<serde_json::Value>(&body).is_ok() {
        let mut out = (status, body).into_response();
        out.headers_mut().insert(
            axum::http::header::CONTENT_TYPE,
            axum::http::HeaderValue::from_static("application/json"),
        );
        return out;
    }
    let message = String::from_utf8_lossy(&body).trim().to_string();
    let body =
        serde_json::json!({"error": {"message": message, "type": "invalid_request_error", "code": status.as_u16()}});
    (status, axum::Json(body)).into_response()
}
