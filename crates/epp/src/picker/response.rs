//! The response's head: which endpoint served it (the data plane's word, when believed), its outcome, and the
//! feedback that reads its bytes.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use dprouter_gateway::front_end::{self as gateway, Feedback, Routed};
use envoy_types::pb::envoy::service::ext_proc::v3::ProcessingResponse;

use super::routing::address;
use super::{Sent, Stream};
use crate::protocol;

impl Stream {
    /// The response's head: which endpoint served (the data plane's word when it gives it), its health, and the
    /// feedback that reads the response's bytes.
    pub(super) fn response_headers(
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
            Some(served) => gateway::refused("served_elsewhere", || {
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
        let prefill_failed = protocol::header(headers, gateway::FAILED_LEG_HEADER) == Some("prefill");
        let prefill = sent.routed.as_ref().and_then(|r| {
            let ticket = r.pair.as_ref()?.ticket.as_ref()?;
            Some((r.prefill_target()?, ticket.pick.branch))
        });
        // Not believed: neither the choice (the data plane says another served) nor the endpoint it names (never
        // offered) is told anything.
        if believed {
            let attempt = match prefill.filter(|_| prefill_failed && status >= 500) {
                Some((target, branch)) => gateway::Attempt::at(target, Some(branch)),
                None => gateway::Attempt::at(&sent.target, branch),
            };
            gateway::record(&state.registry, attempt, gateway::Outcome::Answered(status));
        }
        let sse = protocol::header(headers, "content-type").is_some_and(|ct| ct.starts_with("text/event-stream"));
        let mut set = vec![protocol::set_header(protocol::ENDPOINT_HEADER, label.clone())];
        if let Some(prefill) = sent.routed.as_ref().and_then(Routed::prefill_target) {
            set.push(protocol::set_header(gateway::PREFILL_ENDPOINT_HEADER, prefill.label()));
        }
        let shape = self.trace.shape.get().copied().unwrap_or_default();
        let feedback = sent.routed.take().map(|routed| {
            let (feedback, exchange) = gateway::feedback(state, routed, &sent.target, (status, sse, shape), received);
            let _ = self.trace.exchange.set(exchange);
            feedback
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
            .position(|t| !gateway::injects_rank(t) && address(t) == Some(served));
        let Some(rank) = found else {
            tracing::warn!(%served, chosen = %sent.address, "the data plane served a request on an endpoint the picker does not know");
            sent.routed = Some(routed);
            return;
        };
        match routed.served_at(rank) {
            Ok(routed) => {
                sent.target = membership.targets[rank].clone();
                sent.address = served;
                sent.routed = Some(routed);
            }
            // The endpoint that served is not routable now: the request's feedback is lost, its load released.
            Err(e) => tracing::debug!(%served, error = %e, "the served endpoint cannot take the ticket"),
        }
    }
}
