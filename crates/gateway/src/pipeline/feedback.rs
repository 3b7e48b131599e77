//! What one answer tells the policy and the metrics as its bytes pass, whoever carries them: `serve`'s guarded body
//! ([`crate::pipeline::body::GuardedBody`]) or the Endpoint Picker's response stream. The pipeline's feedback step:
//! the first byte (the prefill is over: the ticket's queued-prefill share is released, TTFT recorded), the engine's
//! usage report (to the metrics, the access log and the ticket, which teaches the policy), a Responses answer's id.

use std::sync::Arc;
use std::time::Instant;

use dprouter_core::{EndpointId, Framing, Usage, UsageScanner};

use crate::common::error_shape::ErrorShape;
use crate::common::response_homes::{Owner, ResponseHomes};
use crate::fleet::registry::Failure;
use crate::observe::access::Exchange;
use crate::observe::telemetry;
use crate::pipeline::body::GatewayTicket;
use crate::pipeline::first_token::FirstToken;

/// What one answer tells the policy and the metrics as its bytes pass, whoever carries them (this crate's
/// [`GuardedBody`], or the Endpoint Picker's response stream): the first byte (the prefill is over), the engine's
/// usage report, and a Responses answer's id. Holds the request's ticket until the answer ends or breaks.
pub struct Feedback {
    ticket: Option<GatewayTicket>,
    endpoint: EndpointId,
    label: String,
    received: Instant,
    first_byte: bool,
    sse: bool,
    scanner: UsageScanner,
    /// Whether the answer ends on tool calls (its agent comes back once the tool has run).
    tool_calls: dprouter_core::tool_calls::ToolCallScanner,
    exchange: Exchange,
    /// Where a Responses answer's id goes, once read.
    homes: Option<(Arc<ResponseHomes>, Owner)>,
    /// A disaggregated request's prefill leg that runs where the answer's carrier cannot see it
    /// ([`Feedback::with_prefill_leg`]).
    prefill: Option<Box<GatewayTicket>>,
    /// The route's error shape ([`Feedback::in_shape`]).
    shape: ErrorShape,
    /// A stream's first token ([`FirstToken`]): the time to it is the answer's TTFT and its prefill's. `None` once
    /// seen, or on an answer sent whole.
    first_token: Option<FirstToken>,
    /// The time to the first token was recorded.
    ttft_recorded: bool,
}

/// The cached tokens the policy predicted for the ticket's request, when it predicted.
fn predicted_cached_tokens(ticket: &GatewayTicket) -> Option<u64> {
    let prefill = ticket.pick.prefill_tokens?;
    Some(ticket.request().input_tokens.saturating_sub(prefill))
}

impl Feedback {
    /// For an answer to the request of `ticket` that arrived at `received`; `sse` when the answer is a stream.
    pub fn new(ticket: GatewayTicket, sse: bool, received: Instant, exchange: Exchange) -> Self {
        let endpoint = ticket.endpoint;
        if let Some(predicted) = predicted_cached_tokens(&ticket) {
            exchange.predicted(predicted);
        }
        Self {
            ticket: Some(ticket),
            endpoint,
            label: endpoint.to_string(),
            received,
            first_byte: false,
            sse,
            scanner: UsageScanner::new(sse),
            tool_calls: Default::default(),
            exchange,
            homes: None,
            prefill: None,
            shape: ErrorShape::OpenAi,
            first_token: sse.then(FirstToken::default),
            ttft_recorded: false,
        }
    }

    /// An answer on a route whose errors take `shape`.
    pub fn in_shape(mut self, shape: ErrorShape) -> Self {
        self.shape = shape;
        self
    }

    /// The route's error shape.
    pub fn shape(&self) -> ErrorShape {
        self.shape
    }

    /// Holds the ticket of a prefill leg run by someone else (a decode sidecar behind a data plane) until the
    /// answer's first byte: by then the prefill is over and its KV cache transferred, so the prefill endpoint's
    /// load is released. Its usage report is never seen: the prefill policy learns from its own pick (and from the
    /// prefill servers' KV events, when they publish them).
    pub fn with_prefill_leg(mut self, prefill: Option<GatewayTicket>) -> Self {
        self.prefill = prefill.map(Box::new);
        self
    }

    /// Remembers the endpoint of the response's id (a Responses answer) for `owner`, once the scanner has read it.
    pub fn remembering_the_response(mut self, homes: Arc<ResponseHomes>, owner: Owner) -> Self {
        self.scanner = UsageScanner::with_response_id(self.sse);
        self.homes = Some((homes, owner));
        self
    }

    /// The endpoint the answer comes from.
    pub fn endpoint(&self) -> EndpointId {
        self.endpoint
    }

    /// The request's ticket, until the answer ended.
    pub fn ticket(&self) -> Option<&GatewayTicket> {
        self.ticket.as_ref()
    }

    /// What this answer counts as when its engine fails it: a pinned request's failure never ejects the rank.
    pub fn failure(&self) -> Failure {
        self.ticket
            .as_ref()
            .map_or(Failure::Engine, |t| Failure::engine(t.pick.branch))
    }

    /// Bytes of the answer arrived: the first byte's and the first token's bookkeeping, the usage scanner, the
    /// response's id.
    pub fn on_data(&mut self, data: &[u8]) {
        if !self.first_byte && !data.is_empty() {
            self.first_byte = true;
            // A whole answer's first byte is also its last token: the request's queued-prefill share is released,
            // but the time is no sample of its prefill.
            if let (Some(ticket), false) = (self.ticket.as_mut(), self.sse) {
                ticket.whole_answer(crate::common::clock::now_us());
            }
            // A disaggregated answer's first byte: the prefill leg is over.
            if let Some(mut prefill) = self.prefill.take() {
                prefill.first_token(crate::common::clock::now_us());
            }
        }
        if self.first_byte && !self.ttft_recorded {
            let seen = match self.first_token.as_mut() {
                None => true,
                Some(first) => first.seen_in(data),
            };
            if seen {
                self.ttft_recorded = true;
                self.first_token = None;
                self.exchange.first_byte(self.received.elapsed());
                if self.sse {
                    // The engine finished prefill: the share is released and the time sampled.
                    if let Some(ticket) = self.ticket.as_mut() {
                        ticket.first_token(crate::common::clock::now_us());
                    }
                    let ttft = self.received.elapsed().as_secs_f64();
                    metrics::histogram!(telemetry::TTFT, "endpoint" => self.label.clone()).record(ttft);
                }
            }
        }
        self.tool_calls.feed(data);
        if let Some(usage) = self.scanner.feed(data) {
            self.report(usage);
        }
        if let Some((homes, owner)) = &self.homes {
            if let Some(id) = self.scanner.take_response_id() {
                homes.record(id, self.endpoint, owner.clone());
            }
        }
    }

    /// The engine's usage report was read: to the metrics and to the policy.
    fn report(&mut self, usage: Usage) {
        self.exchange.usage(&usage, self.scanner.output_tokens());
        metrics::counter!(telemetry::PROMPT_TOKENS, "endpoint" => self.label.clone()).increment(usage.prompt_tokens);
        metrics::counter!(telemetry::CACHED_TOKENS, "endpoint" => self.label.clone()).increment(usage.cached_tokens);
        if let Some(ticket) = self.ticket.as_mut() {
            // How far the policy's prediction of cached tokens was from the engine's report.
            if let Some(predicted) = predicted_cached_tokens(ticket) {
                metrics::histogram!(telemetry::PREDICTION_ERROR, "endpoint" => self.label.clone())
                    .record(predicted.abs_diff(usage.cached_tokens) as f64);
            }
            ticket.usage(usage);
        }
    }

    /// The answer ended whole: a report at its very end is read, and the ticket ends.
    pub fn finish(&mut self) {
        if let Some(usage) = self.scanner.finish() {
            self.report(usage);
        }
        // The policy hears how it ended: on tool calls, the session pauses where its prefix is.
        if let Some(ticket) = self.ticket.take() {
            ticket.end(crate::common::clock::now_us(), self.tool_calls.found());
        }
        self.prefill = None;
    }

    /// The answer ends as `status` (it broke, stalled or was cut) and the ticket with it.
    pub fn failed(&mut self, status: u16) {
        self.ticket = None;
        self.prefill = None;
        self.exchange.failed(status);
    }

    /// Where the answer's SSE bytes so far stopped (to end them before an error event).
    pub fn framing(&self) -> Framing {
        self.scanner.framing()
    }

    /// Whether the first byte of the answer has come.
    pub fn started(&self) -> bool {
        self.first_byte
    }

    /// `w{worker}r{rank}`, for logs and metric labels.
    pub fn label(&self) -> &str {
        &self.label
    }
}
