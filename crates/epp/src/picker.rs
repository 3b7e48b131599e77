//! The ext_proc service: one gRPC stream per HTTP request the data plane proxies, handled in order (request headers,
//! body, trailers; response headers, body, trailers; `FULL_DUPLEX_STREAMED` bodies).
//!
//! The request's headers are held until its body has ended (bounded in size and time as `serve` bounds bodies);
//! then the request is routed exactly as `serve` routes it ([`dprouter_gateway::routing::route`]: the same
//! parser, prompt keys, model checks, policies and ticket), and the replies go out in the order Envoy needs: the
//! headers' (destination, rank header, cleared route cache), then the body as the chosen endpoint must get it (the
//! client's rank overrides out, SGLang's `routed_dp_rank` in) in chunks, then the trailers'. The response streams
//! back through unchanged while its bytes feed the same [`Feedback`] as `serve`'s response bodies: the first byte,
//! the engine's usage report (cached tokens) into the ticket, one ticket per request. When the stream ends in any
//! way, the ticket is dropped and the endpoint's load released.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use bytes::Bytes;
use dprouter_gateway::access::Exchange;
use dprouter_gateway::body::Feedback;
use dprouter_gateway::registry::{Failure, Membership, Target};
use dprouter_gateway::routing::{self, Routed, RANK_HEADER};
use dprouter_gateway::{ApiError, AppState};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::ExternalProcessor;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Message;
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};

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
        let stream = Stream {
            picker: self.clone(),
            tx,
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
}

/// Where the request went.
struct Sent {
    /// Its ticket's request and the endpoint's address; `None` for a request without a body (no ticket).
    routed: Option<Routed>,
    address: SocketAddr,
    target: Target,
}

/// The data plane has gone away (the stream is closed): nothing more to do.
struct Gone;

impl Stream {
    async fn send(&self, reply: ProcessingResponse) -> Result<(), Gone> {
        self.tx.send(Ok(reply)).await.map_err(|_| Gone)
    }

    /// Answers the client with `err` (the data plane sends it) and ends the exchange.
    async fn refuse(&self, err: &ApiError) {
        tracing::debug!(status = err.status().as_u16(), error = %err, "refused");
        let _ = self.send(protocol::immediate(err.status().as_u16(), &err.body())).await;
    }

    async fn run(self, mut incoming: Streaming<ProcessingRequest>) {
        let state = Arc::clone(&self.picker.state);
        let limit = state.config.max_body_bytes;
        let body_timeout = Duration::from_millis(state.config.server.request_body_timeout_ms);
        let mut headers: Vec<(String, Vec<u8>)> = Vec::new();
        let mut subset: Option<Vec<Allowed>> = None;
        let mut body: Vec<u8> = Vec::new();
        let mut received = Instant::now();
        let mut sent: Option<Sent> = None;
        let mut feedback: Option<Feedback> = None;
        loop {
            // Until the request is routed, its body must arrive in time.
            let next = if sent.is_none() && !headers.is_empty() {
                match tokio::time::timeout_at((received + body_timeout).into(), incoming.message()).await {
                    Ok(next) => next,
                    Err(_) => {
                        let after_ms = body_timeout.as_millis() as u64;
                        return self.refuse(&ApiError::BodyTimeout { after_ms }).await;
                    }
                }
            } else {
                incoming.message().await
            };
            let message = match next {
                Ok(Some(message)) => message,
                // The data plane closed the stream or broke it: whatever is held (the ticket) is dropped.
                Ok(None) | Err(_) => return,
            };
            let metadata = message.metadata_context.as_ref();
            let outcome = match message.request {
                Some(Message::RequestHeaders(h)) => {
                    received = Instant::now();
                    headers = protocol::headers(h.headers.as_ref());
                    subset = protocol::subset_hint(metadata);
                    if !h.end_of_stream {
                        continue;
                    }
                    self.route(&headers, subset.as_deref(), None, false).await
                }
                Some(Message::RequestBody(b)) => {
                    if sent.is_some() {
                        // Not expected once the body ended; passed on unchanged.
                        self.send(protocol::body_chunk(true, Bytes::from(b.body), b.end_of_stream))
                            .await
                            .map(|()| None)
                            .map_err(Refused::from)
                    } else {
                        if body.len() + b.body.len() > limit {
                            return self.refuse(&ApiError::TooLarge { limit }).await;
                        }
                        body.extend_from_slice(&b.body);
                        if !b.end_of_stream {
                            continue;
                        }
                        let bytes = Bytes::from(std::mem::take(&mut body));
                        self.route(&headers, subset.as_deref(), Some(bytes), false).await
                    }
                }
                Some(Message::RequestTrailers(_)) => {
                    // Trailers end a body that did not say it ended.
                    let routed = if sent.is_none() {
                        let bytes = Bytes::from(std::mem::take(&mut body));
                        self.route(&headers, subset.as_deref(), Some(bytes), true).await
                    } else {
                        Ok(None)
                    };
                    match routed {
                        Ok(new) => self
                            .send(protocol::trailers_reply(true))
                            .await
                            .map(|()| new)
                            .map_err(Refused::from),
                        Err(e) => Err(e),
                    }
                }
                Some(Message::ResponseHeaders(h)) => {
                    let response_headers = protocol::headers(h.headers.as_ref());
                    let reply = match sent.as_mut() {
                        Some(sent) => {
                            let (reply, fed) = self.response_headers(sent, &response_headers, metadata, received);
                            feedback = fed;
                            reply
                        }
                        None => protocol::response_headers_reply(Vec::new()),
                    };
                    if h.end_of_stream {
                        if let Some(f) = feedback.as_mut() {
                            f.finish();
                        }
                    }
                    self.send(reply).await.map(|()| None).map_err(Refused::from)
                }
                Some(Message::ResponseBody(b)) => {
                    if let Some(f) = feedback.as_mut() {
                        f.on_data(&b.body);
                        if b.end_of_stream {
                            f.finish();
                        }
                    }
                    self.send(protocol::body_chunk(false, Bytes::from(b.body), b.end_of_stream))
                        .await
                        .map(|()| None)
                        .map_err(Refused::from)
                }
                Some(Message::ResponseTrailers(_)) => {
                    if let Some(f) = feedback.as_mut() {
                        f.finish();
                    }
                    self.send(protocol::trailers_reply(false))
                        .await
                        .map(|()| None)
                        .map_err(Refused::from)
                }
                None => Ok(None),
            };
            match outcome {
                Ok(Some(new)) => sent = Some(new),
                Ok(None) => {}
                Err(Refused::Gone) => return,
                Err(Refused::Api(err)) => return self.refuse(&err).await,
            }
        }
    }

    /// Routes the request whose headers and body (`None`: it has none) arrived, and sends the replies to its
    /// headers and body (`trailers`: trailers follow, the body's last chunk does not end the stream).
    async fn route(
        &self,
        headers: &[(String, Vec<u8>)],
        subset: Option<&[Allowed]>,
        body: Option<Bytes>,
        trailers: bool,
    ) -> Result<Option<Sent>, Refused> {
        let state = &self.picker.state;
        let path = protocol::header(headers, ":path").unwrap_or("/").to_string();
        let header_map = header_map(headers);
        let allowed = |t: &Target| address(t).is_some_and(|a| subset.is_none_or(|s| s.iter().any(|x| x.contains(a))));
        if subset.is_some_and(<[Allowed]>::is_empty) {
            return Err(Refused::Api(ApiError::Unavailable(
                "the data plane's subset hint allows no endpoint".into(),
            )));
        }
        let Some(bytes) = body else {
            // No body (a GET): the least loaded endpoint allowed, no ticket (there is no prompt to learn from).
            let membership = state.registry.membership();
            let rank = least_loaded(&membership, &allowed).ok_or(Refused::Api(ApiError::Route(
                dprouter_core::RouteError::NoHealthyEndpoint,
            )))?;
            let target = membership.targets[rank].clone();
            let address = address(&target).ok_or(Refused::Gone)?;
            let (set, remove) = rank_headers(&target, None, headers);
            self.send(protocol::request_headers_reply(&address.to_string(), set, remove))
                .await?;
            return Ok(Some(Sent {
                routed: None,
                address,
                target,
            }));
        };
        routing::check_content_type(&header_map).map_err(Refused::Api)?;
        let routed = routing::route(state, &path, &header_map, bytes, &allowed)
            .await
            .map_err(Refused::Api)?;
        let target = routed.target().clone();
        let address = address(&target).ok_or(Refused::Gone)?;
        let (pieces, rank_header) = routed.upstream_body(&target, &path);
        let length: usize = pieces.iter().map(Bytes::len).sum();
        let (mut set, remove) = rank_headers(&target, rank_header.map(|(_, r)| r), headers);
        set.push(protocol::set_header("content-length", length.to_string()));
        let destination = self.destination(&routed, &target, address, &allowed);
        self.send(protocol::request_headers_reply(&destination, set, remove))
            .await?;
        for chunk in protocol::request_body_chunks(pieces, trailers) {
            self.send(chunk).await?;
        }
        Ok(Some(Sent {
            routed: Some(routed),
            address,
            target,
        }))
    }

    /// The destination header's value: the chosen endpoint, then fallbacks where no rank is injected (a rank
    /// chosen for one endpoint never goes to another): other workers' endpoints, routable and allowed, that take
    /// no rank either.
    fn destination(
        &self,
        routed: &Routed,
        target: &Target,
        chosen: SocketAddr,
        allowed: &dyn Fn(&Target) -> bool,
    ) -> String {
        let mut out = vec![chosen];
        if self.picker.fallbacks > 0 && !routing::injects_rank(target) {
            let membership = &routed.membership;
            for &rank in membership.snapshot.healthy() {
                if out.len() > self.picker.fallbacks {
                    break;
                }
                let other = &membership.targets[rank];
                if other.id.worker == target.id.worker
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
        out.iter().map(SocketAddr::to_string).collect::<Vec<_>>().join(",")
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
        if let Some(served) = protocol::served(metadata).filter(|a| *a != sent.address) {
            self.served_elsewhere(sent, served);
        }
        let label = sent.target.label();
        let branch = sent.routed.as_ref().map(|r| r.ticket.pick.branch);
        if status >= 500 {
            let failure = branch.map_or(Failure::Engine, Failure::engine);
            state.registry.record_failure(sent.target.id, failure, Instant::now());
        } else if (200..300).contains(&status) {
            sent.target.state.record_success();
        }
        let sse = protocol::header(headers, "content-type").is_some_and(|ct| ct.starts_with("text/event-stream"));
        let feedback = sent.routed.take().map(|routed| {
            let exchange = Exchange::new();
            exchange.routed(
                label.clone(),
                routed.ticket.pick.branch.as_str(),
                routed.served.clone().or(routed.model.clone()),
            );
            let remember = routed.responses_api && (200..300).contains(&status);
            let feedback = Feedback::new(routed.ticket, sse, received, exchange);
            if remember {
                feedback.remembering_the_response(Arc::clone(&state.responses))
            } else {
                feedback
            }
        });
        let reply = protocol::response_headers_reply(vec![protocol::set_header(protocol::ENDPOINT_HEADER, label)]);
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
        match routed
            .ticket
            .reroute(&membership.snapshot, &|r| r == rank, dprouter_gateway::clock::now_us())
        {
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

/// Why a request gets no route.
enum Refused {
    /// The data plane has gone: nothing to answer.
    Gone,
    /// The client's answer.
    Api(ApiError),
}

impl From<Gone> for Refused {
    fn from(_: Gone) -> Self {
        Refused::Gone
    }
}

/// The headers to set and remove so that the endpoint gets its rank the way its backend reads it (`rank`, a
/// header), never the client's, and an answer the picker can read (no compression: usage reports stay visible).
fn rank_headers(
    target: &Target,
    rank: Option<u32>,
    client: &[(String, Vec<u8>)],
) -> (
    Vec<envoy_types::pb::envoy::config::core::v3::HeaderValueOption>,
    Vec<String>,
) {
    let rank = rank.or_else(|| {
        // A request without a body still reaches the rank the policy chose.
        matches!(target.backend, dprouter_gateway::Backend::Vllm).then_some(target.id.dp_rank)
    });
    let mut set = Vec::new();
    let mut remove = Vec::new();
    match rank {
        Some(rank) => set.push(protocol::set_header(RANK_HEADER, rank.to_string())),
        None if protocol::header(client, RANK_HEADER).is_some() => remove.push(RANK_HEADER.to_string()),
        None => {}
    }
    for name in ["accept-encoding", protocol::SERVED] {
        if protocol::header(client, name).is_some() {
            remove.push(name.to_string());
        }
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
