//! The request's decision, sent to the data plane: the destination (the choice, then its fallbacks), the headers
//! it sets and removes, and the body as the chosen endpoint must get it.

use std::net::SocketAddr;

use bytes::Bytes;
use dprouter_gateway::front_end::{self as gateway, ApiError, Backend, Membership, Routed, Target, RANK_HEADER};

use super::{header_map, Arriving, End, Sent, Stream};
use crate::protocol::{self, Allowed};

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

impl Stream {
    /// Routes the request whose headers and body have arrived and sends the replies to its headers and body
    /// (`trailers`: trailers follow, the body's last chunk does not end the stream). A request of a method that
    /// takes no body (a GET) goes to the least loaded endpoint allowed, with no ticket (there is no prompt to learn
    /// from); its body, if it had one, goes on unchanged.
    pub(super) async fn route(&self, arriving: Arriving, trailers: bool) -> Result<Sent, End> {
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
            // Its body, if it had one, goes on unchanged.
            let pieces = if body.is_empty() { Vec::new() } else { vec![body] };
            return self.without_ticket(target, &headers, keyed, (pieces, trailers)).await;
        }
        gateway::check_content_type(&header_map).map_err(End::Answer)?;
        if gateway::changes_no_cache(&path) {
            // Counted by the least loaded endpoint serving its model, with no ticket: it changes no cache.
            let placed = gateway::route_uncached(state, body, client.as_deref(), &allowed).map_err(End::Answer)?;
            return self
                .without_ticket(placed.target, &headers, keyed, (placed.pieces, trailers))
                .await;
        }
        // Routing may wait in flow control's queue: a data plane that closes the stream meanwhile (its client went
        // away) takes the request out of it.
        let routed = tokio::select! {
            routed = gateway::route(state, (&path, &header_map), body, client, &allowed) => routed.map_err(End::Answer)?,
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
            set.push(protocol::set_header(gateway::PREFILLER_HEADER, at.to_string()));
            set.push(protocol::set_header(
                gateway::PREFILL_RANK_HEADER,
                prefill.id.dp_rank.to_string(),
            ));
            remove.retain(|name| name != gateway::PREFILLER_HEADER && name != gateway::PREFILL_RANK_HEADER);
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

    /// Sends a request that holds no ticket to `target`: its headers by the one rule, then `pieces` of its body
    /// (`trailers`: trailers follow), its length said when it has one.
    async fn without_ticket(
        &self,
        target: Target,
        headers: &[(String, Vec<u8>)],
        keyed: bool,
        (pieces, trailers): (Vec<Bytes>, bool),
    ) -> Result<Sent, End> {
        let address = address(&target).ok_or(End::Gone)?;
        let (mut set, remove) = rank_headers(&target, None, headers, keyed);
        if !pieces.is_empty() {
            let length: usize = pieces.iter().map(Bytes::len).sum();
            set.push(protocol::set_header("content-length", length.to_string()));
        }
        self.trace_header(&mut set);
        self.send(protocol::request_headers_reply(&address.to_string(), set, remove))
            .await?;
        if !pieces.is_empty() {
            for chunk in protocol::request_body_chunks(pieces, trailers) {
                self.send(chunk).await?;
            }
        }
        Ok(Sent {
            routed: None,
            address,
            target,
            offered: vec![address],
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
        if self.picker.fallbacks > 0 && !gateway::injects_rank(target) {
            let membership = &routed.membership;
            for &rank in membership.snapshot.healthy() {
                if out.len() > self.picker.fallbacks {
                    break;
                }
                let other = &membership.targets[rank];
                // A fallback must take the same key: the headers carry the chosen worker's.
                if other.id.worker == target.id.worker
                    || other.auth != target.auth
                    || gateway::injects_rank(other)
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
}

/// The headers to set and remove so that the endpoint gets the client's headers by the one rule `serve` follows
/// (`dprouter_gateway::front_end::reaches_engine`: every other client header removed, the data plane's own kept),
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
        matches!(target.backend, Backend::Vllm).then_some(target.id.dp_rank)
    });
    let mut set = Vec::new();
    // The picker's own (set by it, or Envoy's destination) are never removed.
    let own = |name: &str| {
        name == protocol::DESTINATION || name == "content-length" || (rank.is_some() && name == RANK_HEADER)
    };
    let mut remove: Vec<String> = Vec::new();
    for (name, _) in client.iter().filter(|(n, _)| !n.starts_with(':')) {
        let dropped = !gateway::reaches_engine(name) && !gateway::data_planes(name) && !own(name);
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
