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
//! routed exactly as `serve` routes it ([`dprouter_gateway::pipeline::routing::route`]: the same parser, prompt keys, model
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
use bytes::Bytes;
use dprouter_gateway::admission::body_reader::BodyReader;
use dprouter_gateway::admission::clients::Client;
use dprouter_gateway::api::{proxy, server};
use dprouter_gateway::common::error::add_ids;
use dprouter_gateway::disagg::{legs, sidecar};
use dprouter_gateway::fleet::registry::{Membership, Target};
use dprouter_gateway::observe::access::Exchange;
use dprouter_gateway::observe::spans::RequestSpan;
use dprouter_gateway::observe::trace_context;
use dprouter_gateway::pipeline::body::Feedback;
use dprouter_gateway::pipeline::engine_headers;
use dprouter_gateway::pipeline::outcome::{self, Attempt, Outcome};
use dprouter_gateway::pipeline::routing::{self, Routed, RANK_HEADER};
use dprouter_gateway::{ApiError, AppState};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Message;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Status, Streaming};

use crate::protocol::{self, Allowed};

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
        for name in [trace_context::TRACEPARENT, trace_context::TRACESTATE] {
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

/// `ip:port` of a target, for the data plane (its worker URL's host must be an IP address: Envoy's original
/// destination cluster connects to what the header says, unresolved).
pub fn address(target: &Target) -> Option<SocketAddr> {
    let rest = target
        .base
        .strip_prefix("http://")
        .or_else(|| target.base.strip_prefix("https://"))?;
    let authority = rest.split('/').next()?;
    authority.parse().ok().or_else(|| {
        let ip: std::net::IpAddr = authority.trim_matches(['[', ']']).parse().ok()?;
        let port = if target.base.starts_with("https://") { 443 } else { 80 };
        Some(SocketAddr::new(ip, port))
    })
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
        let grpc = self.grpc_trace.get(trace_context::TRACEPARENT);
        if grpc
            .and_then(|v| v.to_str().ok())
            .and_then(trace_context::traceparent)
            .is_some()
        {
            parent.remove(trace_context::TRACESTATE);
            parent.extend(self.grpc_trace.clone());
        }
        let _ = self.trace.span.set(RequestSpan::start(method, route, &parent));
        if let Some(id) = headers
            .get(dprouter_gateway::common::names::REQUEST_ID)
            .and_then(|v| v.to_str().ok())
        {
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
                    // The head's limits are `serve`'s (Envoy's pseudo-headers aside).
                    let sizes = headers.iter().filter(|(n, _)| !n.starts_with(':'));
                    server::check_header_sizes(sizes.map(|(n, v)| (n.len(), v.len()))).map_err(End::Answer)?;
                    let route = server::public_route(method, path);
                    let map = header_map(&headers);
                    let traced = route.as_ref().map_or("unmatched", |r| r);
                    if server::is_traced(traced) {
                        self.start_span(method, traced, &map);
                    }
                    route.map_err(End::Answer)?;
                    first_byte = proxy::first_byte_timeout(&state, &map).map_err(End::Answer)?;
                    // Who calls, before its body is held.
                    let client = state.clients.admit(&map).map_err(End::Answer)?;
                    let arriving = Arriving {
                        client,
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
                    dprouter_gateway::observe::refusals::refused("late_body", || {
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
    fn expired(&self, phase: Phase, config: &dprouter_gateway::GatewayConfig) -> End {
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
                    let attempt = Attempt::at(&sent.target, Some(routed.ticket.pick.branch));
                    outcome::record(&self.picker.state.registry, attempt, Outcome::NoHead);
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

    /// Routes the request whose headers and body have arrived and sends the replies to its headers and body
    /// (`trailers`: trailers follow, the body's last chunk does not end the stream). A request of a method that
    /// takes no body (a GET) goes to the least loaded endpoint allowed, with no ticket (there is no prompt to learn
    /// from); its body, if it had one, goes on unchanged.
    async fn route(&self, arriving: Arriving, trailers: bool) -> Result<Sent, End> {
        let Arriving {
            client,
            headers,
            subset,
            body,
        } = arriving;
        let keyed = client.is_some();
        let state = &self.picker.state;
        let path = protocol::header(&headers, ":path").unwrap_or("/").to_string();
        let takes_body = protocol::header(&headers, ":method") == Some("POST");
        let header_map = header_map(&headers);
        let subset = subset.as_deref();
        let allowed = |t: &Target| address(t).is_some_and(|a| subset.is_none_or(|s| s.iter().any(|x| x.contains(a))));
        if subset.is_some_and(<[Allowed]>::is_empty) {
            return Err(End::Answer(ApiError::Unavailable(
                "the data plane's subset hint allows no endpoint".into(),
            )));
        }
        // The body is routed (or refused) now: it no longer counts as arriving.
        let body = body.finish();
        if !takes_body {
            let membership = state.registry.membership();
            let rank = least_loaded(&membership, &allowed).ok_or(End::Answer(ApiError::Route(
                dprouter_core::RouteError::NoHealthyEndpoint,
            )))?;
            let target = membership.targets[rank].clone();
            let address = address(&target).ok_or(End::Gone)?;
            let (mut set, remove) = rank_headers(&target, None, &headers, keyed);
            self.trace_header(&mut set);
            self.send(protocol::request_headers_reply(&address.to_string(), set, remove))
                .await?;
            if !body.is_empty() {
                for chunk in protocol::request_body_chunks(vec![body], trailers) {
                    self.send(chunk).await?;
                }
            }
            return Ok(Sent {
                routed: None,
                address,
                target,
                offered: vec![address],
            });
        }
        routing::check_content_type(&header_map).map_err(End::Answer)?;
        // Routing may wait in flow control's queue: a data plane that closes the stream meanwhile (its client went
        // away) takes the request out of it.
        let routed = tokio::select! {
            routed = routing::route(state, (&path, &header_map), body, client, &allowed) => routed.map_err(End::Answer)?,
            () = self.tx.closed() => return Err(End::Gone),
        };
        let target = routed.target().clone();
        let address = address(&target).ok_or(End::Gone)?;
        let (pieces, rank_header) = routed.upstream_body(&target, &path);
        let length: usize = pieces.iter().map(Bytes::len).sum();
        let (mut set, mut remove) = rank_headers(&target, rank_header.map(|(_, r)| r), &headers, keyed);
        set.push(protocol::set_header("content-length", length.to_string()));
        if let Some(prefill) = routed.prefill_target() {
            // A disaggregated request goes to its decode endpoint, whose sidecar runs the prefill leg there
            // (`dprouter decode-sidecar`, or llm-d's): SGLang's bootstrap fields are in the body already.
            let at = self::address(prefill).ok_or(End::Gone)?;
            set.push(protocol::set_header(sidecar::PREFILLER_HEADER, at.to_string()));
            set.push(protocol::set_header(
                sidecar::PREFILL_RANK_HEADER,
                prefill.id.dp_rank.to_string(),
            ));
            remove.retain(|name| name != sidecar::PREFILLER_HEADER && name != sidecar::PREFILL_RANK_HEADER);
        }
        self.trace_header(&mut set);
        let offered = self.destination(&routed, &target, address, &allowed);
        let destination = offered.iter().map(SocketAddr::to_string).collect::<Vec<_>>().join(",");
        self.send(protocol::request_headers_reply(&destination, set, remove))
            .await?;
        for chunk in protocol::request_body_chunks(pieces, trailers) {
            self.send(chunk).await?;
        }
        Ok(Sent {
            routed: Some(routed),
            address,
            target,
            offered,
        })
    }

    /// The addresses for the destination header: the chosen endpoint, then fallbacks where no rank is injected (a
    /// rank chosen for one endpoint never goes to another): other workers' endpoints, routable and allowed, that
    /// take no rank either.
    fn destination(
        &self,
        routed: &Routed,
        target: &Target,
        chosen: SocketAddr,
        allowed: &dyn Fn(&Target) -> bool,
    ) -> Vec<SocketAddr> {
        let mut out = vec![chosen];
        if self.picker.fallbacks > 0 && !routing::injects_rank(target) {
            let membership = &routed.membership;
            for &rank in membership.snapshot.healthy() {
                if out.len() > self.picker.fallbacks {
                    break;
                }
                let other = &membership.targets[rank];
                // A fallback must take the same key: the headers carry the chosen worker's.
                if other.id.worker == target.id.worker
                    || other.auth != target.auth
                    || routing::injects_rank(other)
                    || !routed.serving(rank)
                    || !allowed(other)
                {
                    continue;
                }
                if let Some(a) = address(other).filter(|a| !out.contains(a)) {
                    out.push(a);
                }
            }
        }
        out
    }

    /// The response's head: which endpoint served (the data plane's word when it gives it), its health, and the
    /// feedback that reads the response's bytes.
    fn response_headers(
        &self,
        sent: &mut Sent,
        headers: &[(String, Vec<u8>)],
        metadata: Option<&envoy_types::pb::envoy::config::core::v3::Metadata>,
        received: Instant,
    ) -> (ProcessingResponse, Option<Feedback>) {
        let state = &self.picker.state;
        let status: u16 = protocol::header(headers, ":status")
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let _ = self.trace.status.set(status);
        let served = protocol::served(metadata).filter(|a| *a != sent.address);
        let believed = served.is_none_or(|a| sent.offered.contains(&a));
        match served {
            Some(served) if believed => self.served_elsewhere(sent, served),
            Some(served) => dprouter_gateway::observe::refusals::refused("served_elsewhere", || {
                format!(
                    "the data plane says {served} served a request the picker sent to {} (not offered on its stream): \
                     its outcome counts for no endpoint",
                    sent.address
                )
            }),
            None => {}
        }
        let label = sent.target.label();
        let branch = sent.routed.as_ref().map(|r| r.ticket.pick.branch);
        // A decode sidecar that answers for its prefill leg's failure says so: that leg's endpoint failed.
        let prefill_failed = protocol::header(headers, sidecar::FAILED_LEG_HEADER) == Some("prefill");
        let prefill = sent.routed.as_ref().and_then(|r| {
            let ticket = r.pair.as_ref()?.ticket.as_ref()?;
            Some((r.prefill_target()?, ticket.pick.branch))
        });
        // Not believed: neither the choice (the data plane says another served) nor the endpoint it names (never
        // offered) is told anything.
        if believed {
            let attempt = match prefill.filter(|_| prefill_failed && status >= 500) {
                Some((target, branch)) => Attempt::at(target, Some(branch)),
                None => Attempt::at(&sent.target, branch),
            };
            outcome::record(&state.registry, attempt, Outcome::Answered(status));
        }
        let sse = protocol::header(headers, "content-type").is_some_and(|ct| ct.starts_with("text/event-stream"));
        let mut set = vec![protocol::set_header(protocol::ENDPOINT_HEADER, label.clone())];
        if let Some(prefill) = sent.routed.as_ref().and_then(Routed::prefill_target) {
            set.push(protocol::set_header(legs::PREFILL_ENDPOINT_HEADER, prefill.label()));
        }
        let feedback = sent.routed.take().map(|mut routed| {
            let prefill = routed.pair.as_mut().and_then(|pair| pair.ticket.take());
            let exchange = Exchange::new();
            exchange.routed(dprouter_gateway::observe::access::Routing {
                endpoint: label.clone(),
                rank: sent.target.id.dp_rank,
                policy: state.policies.default_policy().name(),
                branch: routed.ticket.pick.branch.as_str(),
                model: routed.served.clone().or(routed.model.clone()),
                retries: 0,
            });
            let remember = routed.remember(status);
            let _ = self.trace.exchange.set(exchange.clone());
            let feedback = Feedback::new(routed.ticket, sse, received, exchange).with_prefill_leg(prefill);
            match remember {
                Some(owner) => feedback.remembering_the_response(Arc::clone(&state.responses), owner),
                None => feedback,
            }
        });
        let reply = protocol::response_headers_reply(set);
        (reply, feedback)
    }

    /// The data plane sent the request to `served` (a fallback): the ticket moves there, so the policy learns
    /// where the prompt really went (only fallbacks, which take no rank, can differ from the choice).
    fn served_elsewhere(&self, sent: &mut Sent, served: SocketAddr) {
        let Some(routed) = sent.routed.take() else { return };
        let membership = Arc::clone(&routed.membership);
        let found = membership
            .targets
            .iter()
            .position(|t| !routing::injects_rank(t) && address(t) == Some(served));
        let Some(rank) = found else {
            tracing::warn!(%served, chosen = %sent.address, "the data plane served a request on an endpoint the picker does not know");
            sent.routed = Some(routed);
            return;
        };
        let mut routed = routed;
        match routed.ticket.reroute(
            &membership.snapshot,
            &|r| r == rank,
            dprouter_gateway::common::clock::now_us(),
        ) {
            Ok(ticket) => {
                routed.ticket = ticket;
                sent.target = membership.targets[rank].clone();
                sent.address = served;
                sent.routed = Some(routed);
            }
            // The endpoint that served is not routable now: the request's feedback is lost, its load released.
            Err(e) => tracing::debug!(%served, error = %e, "the served endpoint cannot take the ticket"),
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

/// The headers to set and remove so that the endpoint gets the client's headers by the one rule `serve` follows
/// (`dprouter_gateway::pipeline::engine_headers`: every other client header removed, the data plane's own kept),
/// its rank the way its backend reads it (`rank`, a header), never the client's, and its own key (never a `keyed`
/// client's). With `accept-encoding` removed the answer comes uncompressed: usage reports stay visible.
fn rank_headers(
    target: &Target,
    rank: Option<u32>,
    client: &[(String, Vec<u8>)],
    keyed: bool,
) -> (
    Vec<envoy_types::pb::envoy::config::core::v3::HeaderValueOption>,
    Vec<String>,
) {
    let rank = rank.or_else(|| {
        // A request without a body still reaches the rank the policy chose.
        matches!(target.backend, dprouter_gateway::Backend::Vllm).then_some(target.id.dp_rank)
    });
    let mut set = Vec::new();
    // The picker's own (set by it, or Envoy's destination) are never removed.
    let own = |name: &str| {
        name == protocol::DESTINATION || name == "content-length" || (rank.is_some() && name == RANK_HEADER)
    };
    let mut remove: Vec<String> = Vec::new();
    for (name, _) in client.iter().filter(|(n, _)| !n.starts_with(':')) {
        let dropped = !engine_headers::reaches_engine(name) && !engine_headers::data_planes(name) && !own(name);
        if dropped && !remove.contains(name) {
            remove.push(name.clone());
        }
    }
    if let Some(rank) = rank {
        set.push(protocol::set_header(RANK_HEADER, rank.to_string()));
    }
    // The worker's own key, else the client's as it came unless the client was keyed (a client's key never
    // reaches an engine), as `serve` sends it.
    match &target.auth {
        Some(own) => set.push(protocol::set_header("authorization", own.as_bytes())),
        None if keyed && protocol::header(client, "authorization").is_some() => remove.push("authorization".into()),
        None => {}
    }
    (set, remove)
}

/// The routable endpoint with the fewest requests in flight among those `allowed`.
fn least_loaded(membership: &Membership, allowed: &dyn Fn(&Target) -> bool) -> Option<usize> {
    membership
        .snapshot
        .healthy()
        .iter()
        .copied()
        .filter(|&r| allowed(&membership.targets[r]))
        .min_by_key(|&r| membership.snapshot.load(r).in_flight_requests())
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
