//! The ext_proc service: one gRPC stream per HTTP request the data plane proxies, handled in order (request headers,
//! body, trailers; response headers, body, trailers; `FULL_DUPLEX_STREAMED` bodies).
//!
//! The stream is a strict state machine ([`Phase`]): request headers first (a path `serve` does not serve gets
//! `serve`'s 404 or 405), then the body, then the response; anything out of turn or undecodable ends the stream
//! with `INVALID_ARGUMENT`, a message over [`crate::max_message_bytes`] with `RESOURCE_EXHAUSTED`, and each phase
//! has a deadline (`DEADLINE_EXCEEDED`, or the client's 408 for a body too slow). A response whose headers do not
//! come within `first_byte_timeout_ms` counts against its endpoint as in `serve`, and its load is released.
//!
//! The request's headers are held until its body has ended (bounded in size and time as `serve` bounds bodies,
//! and its bytes in the budget of all bodies arriving at once, `max_buffered_body_bytes`); then the request is
//! routed exactly as `serve` routes it ([`dprouter_gateway::front_end::route`]: the same parser, prompt keys, model
//! checks, policies and ticket), and the replies go out in the order Envoy needs: the headers' (destination, rank
//! header, cleared route cache), then the body as the chosen endpoint must get it (the client's rank overrides
//! out, SGLang's `routed_dp_rank` in) in chunks, then the trailers'. The response streams
//! back through unchanged while its bytes feed the same [`Feedback`] as `serve`'s response bodies: the first byte,
//! the engine's usage report (cached tokens) into the ticket, one ticket per request. When the stream ends in any
//! way, the ticket is dropped and the endpoint's load released.

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use dprouter_gateway::front_end::{
    self as gateway, add_ids, ApiError, AppState, BodyReader, Client, Exchange, Feedback, RequestSpan, Routed, Target,
};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Message;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Status, Streaming};

use crate::protocol::{self, Allowed};

mod response;
mod routing;

pub use routing::address;

/// The Endpoint Picker's ext_proc service over the gateway's state.
#[derive(Clone)]
pub struct Picker {
    state: Arc<AppState>,
    /// Endpoints listed after the chosen one for the data plane to retry on, where no rank is injected.
    fallbacks: usize,
}

impl Picker {
    pub fn new(state: Arc<AppState>, fallbacks: usize) -> Self {
        Self { state, fallbacks }
    }
}

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = ReceiverStream<Result<ProcessingResponse, Status>>;

    async fn process(
        &self,
        request: tonic::Request<Streaming<ProcessingRequest>>,
    ) -> Result<tonic::Response<Self::ProcessStream>, Status> {
        // A few replies at most are queued: a request's body goes out in chunks, the response's one per chunk in.
        let (tx, rx) = mpsc::channel(8);
        // The data plane's own span for this call (Envoy's, when it traces), which the picker's span joins.
        let mut grpc_trace = HeaderMap::new();
        for name in [gateway::TRACEPARENT, gateway::TRACESTATE] {
            if let Some(v) = request.metadata().get(name.as_str()).and_then(|v| v.to_str().ok()) {
                if let Ok(v) = HeaderValue::from_str(v) {
                    grpc_trace.insert(name, v);
                }
            }
        }
        let stream = Stream {
            picker: self.clone(),
            tx,
            grpc_trace,
            trace: Default::default(),
        };
        tokio::spawn(stream.run(request.into_inner()));
        Ok(tonic::Response::new(ReceiverStream::new(rx)))
    }
}

/// One HTTP request's ext_proc stream.
struct Stream {
    picker: Picker,
    tx: mpsc::Sender<Result<ProcessingResponse, Status>>,
    /// `traceparent` and `tracestate` of the gRPC call.
    grpc_trace: HeaderMap,
    trace: Trace,
}

/// The request's trace span and what it ends with (set as the stream goes).
#[derive(Default)]
struct Trace {
    span: OnceLock<RequestSpan>,
    request_id: OnceLock<String>,
    /// The response's status, once its headers came.
    status: OnceLock<u16>,
    exchange: OnceLock<Exchange>,
    /// The shape of the route's errors (Anthropic's on the Messages routes), once its path is known.
    shape: OnceLock<gateway::ErrorShape>,
}

/// Where the request went.
struct Sent {
    /// Its ticket's request and the endpoint's address; `None` for a request without a body (no ticket).
    routed: Option<Routed>,
    address: SocketAddr,
    target: Target,
    /// Every address the picker offered the data plane on this stream (the choice, then its fallbacks): a report
    /// that another endpoint served the request is not believed, and its outcome counts for no endpoint.
    offered: Vec<SocketAddr>,
}

/// The data plane has gone away (the stream is closed): nothing more to do.
struct Gone;

/// A request whose headers have arrived and whose body is arriving.
struct Arriving {
    /// The client whose key the request carries, when clients are configured.
    client: Option<Arc<Client>>,
    headers: Vec<(String, Vec<u8>)>,
    subset: Option<Vec<Allowed>>,
    /// The body so far, under the size limit and in the budget of all bodies arriving at once.
    body: BodyReader,
}

/// Where a stream is. Each phase has a deadline: the request's headers `header_read_timeout_ms` after the stream
/// opened, its body `request_body_timeout_ms` after its headers, the response's headers `first_byte_timeout_ms`
/// after the body went out, and each later message `stream_idle_timeout_ms` after the one before.
enum Phase {
    /// Waiting for the request's headers: nothing else may come first.
    Open,
    /// The headers are in; the body arrives (held until it ends, then routed).
    Body(Arriving),
    /// Routed; the response's headers are awaited (the request's load is on the endpoint).
    Sent(Sent),
    /// The response streams back through the feedback (`None`: a request without a ticket).
    Response(Option<Feedback>),
}

/// How a stream ends early.
enum End {
    /// The data plane has gone: nothing to answer.
    Gone,
    /// The client gets this answer (an immediate response), then the stream ends.
    Answer(ApiError),
    /// The stream ends with this gRPC status: the data plane broke the protocol or a deadline passed.
    Grpc(Status),
}

impl From<Gone> for End {
    fn from(_: Gone) -> Self {
        End::Gone
    }
}

/// A message out of turn: the stream ends with `INVALID_ARGUMENT`.
fn out_of_turn(what: &str, phase: &str) -> End {
    End::Grpc(Status::invalid_argument(format!("ext_proc: {what} {phase}")))
}

/// What a message is, for errors.
fn kind(message: &Message) -> &'static str {
    match message {
        Message::RequestHeaders(_) => "request headers",
        Message::RequestBody(_) => "a request body",
        Message::RequestTrailers(_) => "request trailers",
        Message::ResponseHeaders(_) => "response headers",
        Message::ResponseBody(_) => "a response body",
        Message::ResponseTrailers(_) => "response trailers",
    }
}

impl Stream {
    async fn send(&self, reply: ProcessingResponse) -> Result<(), Gone> {
        self.tx.send(Ok(reply)).await.map_err(|_| Gone)
    }

    async fn run(self, incoming: Streaming<ProcessingRequest>) {
        let ended = self.exchange(incoming).await;
        let span = self.trace.span.get();
        let mut status = self.trace.status.get().copied();
        match ended {
            Ok(()) => {}
            Err(End::Gone) => {
                if let Some(span) = span.filter(|_| status.is_none()) {
                    span.failed("the data plane closed the stream before the response");
                }
            }
            Err(End::Answer(err)) => {
                tracing::debug!(status = err.status().as_u16(), error = %err, "refused");
                status = Some(err.status().as_u16());
                let mut body = err.body();
                let trace_id = span.and_then(RequestSpan::trace_id);
                add_ids(
                    &mut body,
                    self.trace.request_id.get().map(String::as_str),
                    trace_id.as_deref(),
                );
                let body = self.trace.shape.get().copied().unwrap_or_default().reshape(body);
                let reply = protocol::immediate(err.status().as_u16(), &body, err.retry_after());
                let _ = self.send(reply).await;
            }
            Err(End::Grpc(grpc)) => {
                tracing::debug!(code = ?grpc.code(), message = grpc.message(), "ext_proc stream ended");
                if let Some(span) = span {
                    span.failed(&format!("ext_proc: {:?}: {}", grpc.code(), grpc.message()));
                }
                let _ = self.tx.send(Err(grpc)).await;
            }
        }
        if let Some(span) = span {
            let facts = self.trace.exchange.get().map(Exchange::facts).unwrap_or_default();
            span.finish(status, facts.span_attributes());
        }
    }

    /// Tracing on: the engine's parent is the picker's span (a data plane that traces puts its own instead).
    fn trace_header(&self, set: &mut Vec<envoy_types::pb::envoy::config::core::v3::HeaderValueOption>) {
        if let Some(parent) = self.trace.span.get().and_then(RequestSpan::traceparent) {
            set.push(protocol::set_header("traceparent", parent.as_bytes()));
        }
    }

    /// The request's span, joining the data plane's (its gRPC call's `traceparent`) or else the client's.
    fn start_span(&self, method: &str, route: &str, headers: &HeaderMap) {
        let mut parent = headers.clone();
        let grpc = self.grpc_trace.get(gateway::TRACEPARENT);
        if grpc
            .and_then(|v| v.to_str().ok())
            .and_then(gateway::traceparent)
            .is_some()
        {
            parent.remove(gateway::TRACESTATE);
            parent.extend(self.grpc_trace.clone());
        }
        let _ = self.trace.span.set(RequestSpan::start(method, route, &parent));
        if let Some(id) = headers.get(gateway::REQUEST_ID).and_then(|v| v.to_str().ok()) {
            let _ = self.trace.request_id.set(id.to_string());
        }
    }

    /// The stream's messages in order, phase by phase, until the data plane closes it (`Ok`) or it ends early.
    async fn exchange(&self, mut incoming: Streaming<ProcessingRequest>) -> Result<(), End> {
        let state = Arc::clone(&self.picker.state);
        let config = &state.config;
        let ms = Duration::from_millis;
        let mut phase = Phase::Open;
        let mut deadline = Instant::now() + ms(config.server.header_read_timeout_ms);
        // When the request's headers arrived (its time to first token counts from there).
        let mut received = Instant::now();
        let mut first_byte = ms(config.first_byte_timeout_ms);
        loop {
            let message = match tokio::time::timeout_at(deadline.into(), incoming.message()).await {
                Ok(Ok(Some(message))) => message,
                // The data plane closed the stream: whatever is held (the ticket) is dropped.
                Ok(Ok(None)) => return Ok(()),
                Ok(Err(status)) => return Err(undecodable(status)),
                Err(_) => return Err(self.expired(phase, config)),
            };
            let metadata = message.metadata_context.as_ref();
            let Some(request) = message.request else {
                return Err(End::Grpc(Status::invalid_argument(
                    "ext_proc: a message with no request",
                )));
            };
            phase = match (phase, request) {
                (Phase::Open, Message::RequestHeaders(h)) => {
                    received = Instant::now();
                    let headers = protocol::headers(h.headers.as_ref());
                    let (Some(method), Some(path)) = (
                        protocol::header(&headers, ":method"),
                        protocol::header(&headers, ":path"),
                    ) else {
                        return Err(End::Grpc(Status::invalid_argument(
                            "ext_proc: request headers without :method or :path",
                        )));
                    };
                    // The head is admitted as `serve` admits it (Envoy's pseudo-headers aside), and who calls is
                    // known before its body is held.
                    let sizes = headers.iter().filter(|(n, _)| !n.starts_with(':'));
                    let sizes = sizes.map(|(n, v)| (n.len(), v.len()));
                    let map = header_map(&headers);
                    let _ = self.trace.shape.set(gateway::ErrorShape::of_route(path));
                    let traced = |route| self.start_span(method, route, &map);
                    let head = gateway::admit_head(&state, (method, path), &map, sizes, traced).map_err(End::Answer)?;
                    first_byte = head.first_byte;
                    let arriving = Arriving {
                        client: head.client,
                        subset: protocol::subset_hint(metadata),
                        headers,
                        body: BodyReader::new(&state.bodies, config.max_body_bytes, None),
                    };
                    if h.end_of_stream {
                        let sent = self.route(arriving, false).await?;
                        deadline = Instant::now() + first_byte;
                        Phase::Sent(sent)
                    } else {
                        deadline = received + ms(config.server.request_body_timeout_ms);
                        Phase::Body(arriving)
                    }
                }
                (Phase::Open, other) => return Err(out_of_turn(kind(&other), "before the request headers")),
                (Phase::Body(mut arriving), Message::RequestBody(b)) => {
                    arriving.body.push(&b.body).map_err(End::Answer)?;
                    if b.end_of_stream {
                        let sent = self.route(arriving, false).await?;
                        deadline = Instant::now() + first_byte;
                        Phase::Sent(sent)
                    } else {
                        Phase::Body(arriving)
                    }
                }
                (Phase::Body(arriving), Message::RequestTrailers(_)) => {
                    // Trailers end a body that did not say it ended.
                    let sent = self.route(arriving, true).await?;
                    self.send(protocol::trailers_reply(true)).await?;
                    deadline = Instant::now() + first_byte;
                    Phase::Sent(sent)
                }
                (Phase::Body(_), other) => return Err(out_of_turn(kind(&other), "while the request body arrives")),
                // The body ended: a chunk after its end breaks the protocol (it would reach the engine unrouted).
                (Phase::Sent(_) | Phase::Response(_), Message::RequestBody(_)) => {
                    gateway::refused("late_body", || {
                        "an ext_proc request body chunk after the body's end refused (INVALID_ARGUMENT)".into()
                    });
                    return Err(out_of_turn("request body", "after the body's end"));
                }
                (phase @ (Phase::Sent(_) | Phase::Response(_)), Message::RequestTrailers(_)) => {
                    self.send(protocol::trailers_reply(true)).await?;
                    phase
                }
                (Phase::Sent(mut sent), Message::ResponseHeaders(h)) => {
                    let response_headers = protocol::headers(h.headers.as_ref());
                    let (reply, mut feedback) = self.response_headers(&mut sent, &response_headers, metadata, received);
                    if h.end_of_stream {
                        if let Some(f) = feedback.as_mut() {
                            f.finish();
                        }
                    }
                    self.send(reply).await?;
                    deadline = Instant::now() + ms(config.stream_idle_timeout_ms);
                    Phase::Response(feedback)
                }
                (Phase::Response(_), Message::ResponseHeaders(_)) => {
                    return Err(out_of_turn("response headers", "twice"))
                }
                // A response body or trailers with no headers before them (the data plane does not send response
                // headers): passed on; the request's feedback is lost.
                (Phase::Sent(_), Message::ResponseBody(b)) => {
                    self.send(protocol::body_chunk(false, b.body, b.end_of_stream)).await?;
                    deadline = Instant::now() + ms(config.stream_idle_timeout_ms);
                    Phase::Response(None)
                }
                (Phase::Response(mut feedback), Message::ResponseBody(b)) => {
                    if let Some(f) = feedback.as_mut() {
                        f.on_data(&b.body);
                        if b.end_of_stream {
                            f.finish();
                        }
                    }
                    self.send(protocol::body_chunk(false, b.body, b.end_of_stream)).await?;
                    deadline = Instant::now() + ms(config.stream_idle_timeout_ms);
                    Phase::Response(feedback)
                }
                (Phase::Sent(_), Message::ResponseTrailers(_)) => {
                    self.send(protocol::trailers_reply(false)).await?;
                    deadline = Instant::now() + ms(config.stream_idle_timeout_ms);
                    Phase::Response(None)
                }
                (Phase::Response(mut feedback), Message::ResponseTrailers(_)) => {
                    // Trailers end the response.
                    if let Some(f) = feedback.as_mut() {
                        f.finish();
                    }
                    self.send(protocol::trailers_reply(false)).await?;
                    deadline = Instant::now() + ms(config.stream_idle_timeout_ms);
                    Phase::Response(feedback)
                }
                (Phase::Sent(_), Message::RequestHeaders(_)) | (Phase::Response(_), Message::RequestHeaders(_)) => {
                    return Err(out_of_turn("request headers", "twice"))
                }
            };
        }
    }

    /// The phase's deadline passed: how the stream ends.
    fn expired(&self, phase: Phase, config: &gateway::GatewayConfig) -> End {
        match phase {
            Phase::Open => End::Grpc(Status::deadline_exceeded(format!(
                "ext_proc: no request headers within header_read_timeout_ms ({})",
                config.server.header_read_timeout_ms
            ))),
            Phase::Body(_) => End::Answer(ApiError::BodyTimeout {
                after_ms: config.server.request_body_timeout_ms,
            }),
            Phase::Sent(sent) => {
                // As `serve` when an engine says nothing in time: the endpoint failed this request, whose load is
                // released as its ticket is dropped here.
                let label = sent.target.label();
                tracing::warn!(endpoint = %label, "no response headers within first_byte_timeout_ms");
                if let Some(routed) = &sent.routed {
                    let attempt = gateway::Attempt::at(&sent.target, Some(routed.ticket.pick.branch));
                    gateway::record(&self.picker.state.registry, attempt, gateway::Outcome::NoHead);
                }
                End::Grpc(Status::deadline_exceeded(format!(
                    "ext_proc: no response headers from {label} within first_byte_timeout_ms"
                )))
            }
            Phase::Response(_) => End::Grpc(Status::deadline_exceeded(format!(
                "ext_proc: the response went stream_idle_timeout_ms ({}) without a message",
                config.stream_idle_timeout_ms
            ))),
        }
    }
}

/// An error reading the stream: a message the picker cannot decode is the data plane's fault
/// (`INVALID_ARGUMENT`), one over the size limit `RESOURCE_EXHAUSTED`; a broken stream is gone. Envoy resets an
/// ext_proc stream whose exchange has ended rather than closing it: the HTTP/2 transport's error under the status
/// says the peer went, not that a message did not decode.
fn undecodable(status: Status) -> End {
    let mut source = std::error::Error::source(&status);
    while let Some(error) = source {
        if error.downcast_ref::<hyper::Error>().is_some() {
            return End::Gone;
        }
        source = error.source();
    }
    match status.code() {
        Code::OutOfRange | Code::ResourceExhausted => End::Grpc(Status::resource_exhausted(status.message())),
        Code::Internal => End::Grpc(Status::invalid_argument(status.message())),
        _ => End::Gone,
    }
}

/// The request's headers as the gateway reads them (pseudo-headers left out).
fn header_map(headers: &[(String, Vec<u8>)]) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (name, value) in headers.iter().filter(|(n, _)| !n.starts_with(':')) {
        if let (Ok(name), Ok(value)) = (HeaderName::from_bytes(name.as_bytes()), HeaderValue::from_bytes(value)) {
            map.append(name, value);
        }
    }
    map
}
