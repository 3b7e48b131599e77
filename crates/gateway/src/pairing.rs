//! Prefill/decode disaggregation's decision: a request for a model that decode workers serve gets a **pair**, a
//! prefill endpoint picked by the prefill policy (by its cached prefix, `cache_aware` by default) among the
//! prefill workers and a decode endpoint picked by the decode policy (by load, `total_tokens` by default) among the
//! decode workers: two ordinary picks over two role-filtered views of one membership, each with its own ticket
//! (`docs/disaggregation.md`).
//!
//! Under SGLang the legs are paired by a **bootstrap room**: both get `bootstrap_host` (the prefill server's
//! host), `bootstrap_port` (its configured bootstrap port, else `null`: the decode server's own setting) and the
//! room; the decode leg also gets `disagg_prefill_dp_rank`, the prefill rank, so it does not have to ask. A
//! prefill server's default DP dispatch (`follow_bootstrap_room`) puts a request on rank `room % dp_size` and fails
//! one whose `routed_dp_rank` disagrees, so the room is drawn at random in [0, 2^63 − 1] among those whose residue
//! is the chosen prefill rank ([`room_for`]), and `routed_dp_rank` says the same.
//!
//! Under vLLM the legs are paired by `kv_transfer_params` instead ([`vllm_prefill_members`], [`crate::legs`]), and
//! each leg's rank goes in its own `X-data-parallel-rank`. A vLLM decode server prefills a prompt that comes
//! without KV, so with no healthy prefill endpoint its request goes to the decode server alone.

use std::sync::Arc;

use bytes::Bytes;
use dprouter_core::{dispatch_among, Policy, RouteRequest};

use crate::body::GatewayTicket;
use crate::config::{Backend, Role};
use crate::error::ApiError;
use crate::registry::{Membership, Target};

/// The largest bootstrap room: SGLang's routers draw rooms in [0, 2^63 − 1].
pub const MAX_ROOM: u64 = (1 << 63) - 1;

/// A disaggregated request's prefill leg: its endpoint, the room that pairs it with the decode leg (SGLang), its
/// ticket until the leg is sent ([`crate::legs`]), and what the prefill answer said to tell the decode server
/// (vLLM's `kv_transfer_params`, as JSON).
pub struct Pair {
    /// The prefill endpoint's rank in the membership.
    pub rank: usize,
    pub room: u64,
    pub ticket: Option<GatewayTicket>,
    pub kv_transfer_params: Option<Bytes>,
}

/// A bootstrap room whose residue modulo `dp_size` is `rank`, from a uniform 64-bit `draw`: uniform over such
/// rooms in [0, [`MAX_ROOM`]] up to a bias of `dp_size / 2^63`.
pub fn room_for(draw: u64, rank: u32, dp_size: u32) -> u64 {
    let dp = u64::from(dp_size.max(1));
    let rank = u64::from(rank) % dp;
    let base = (draw & MAX_ROOM) / dp * dp;
    let room = base + rank;
    if room > MAX_ROOM {
        room - dp
    } else {
        room
    }
}

/// A fresh uniform 64-bit draw: a process-wide counter through a randomly keyed hash.
pub fn draw() -> u64 {
    use std::hash::BuildHasher;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;
    static KEY: OnceLock<std::collections::hash_map::RandomState> = OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(0);
    KEY.get_or_init(Default::default)
        .hash_one(NEXT.fetch_add(1, Ordering::Relaxed))
}

/// The host part of a worker's base URL, without an IPv6 address's brackets (what SGLang's router sends as
/// `bootstrap_host`: Python's `urlparse(url).hostname`).
pub fn bootstrap_host(base: &str) -> String {
    let host = base
        .parse::<hyper::Uri>()
        .ok()
        .and_then(|u| u.host().map(str::to_owned))
        .unwrap_or_default();
    host.trim_start_matches('[').trim_end_matches(']').to_string()
}

/// The bootstrap members both SGLang legs get (one piece of JSON, no braces); the decode leg's also name the
/// prefill rank.
pub fn bootstrap_members(prefill: &Target, room: u64, decode_leg: bool) -> Bytes {
    let host = serde_json::Value::from(bootstrap_host(&prefill.base));
    let port = prefill
        .bootstrap_port
        .map_or_else(|| "null".to_string(), |p| p.to_string());
    let mut members = format!(r#""bootstrap_host":{host},"bootstrap_port":{port},"bootstrap_room":{room}"#);
    if decode_leg {
        members.push_str(&format!(r#","disagg_prefill_dp_rank":{}"#, prefill.id.dp_rank));
    }
    Bytes::from(members)
}

/// What vLLM's prefill leg gets (after the client's body without its `stream`, `stream_options` and lengths), as
/// vLLM's own disaggregation proxies send it: `kv_transfer_params` asking for a remote decode, one token (in each
/// of the path's length fields), not streamed.
pub fn vllm_prefill_members(path: &str) -> Bytes {
    let mut members = String::from(
        r#""kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null},"stream":false,"max_tokens":1"#,
    );
    let path = path.split('?').next().unwrap_or(path);
    if path.ends_with("/chat/completions") {
        members.push_str(r#","max_completion_tokens":1"#);
    } else if path.ends_with("/responses") {
        members.push_str(r#","max_output_tokens":1"#);
    }
    Bytes::from(members)
}

/// Whether a request for a model that `serving` says a rank serves is disaggregated: some decode worker serves
/// it. Its legs then go to prefill and decode workers only; otherwise it goes to aggregated workers only.
pub fn disaggregated(membership: &Membership, serving: &dyn Fn(usize) -> bool) -> bool {
    membership
        .targets
        .iter()
        .enumerate()
        .any(|(rank, t)| t.role == Role::Decode && serving(rank))
}

/// A client's rank pin must name a worker of the role its request goes to (a rank out of range is the policy's
/// error): a pin that names another role's endpoint is refused.
pub fn check_pin(membership: &Membership, pin: Option<i64>, roles: &[Role]) -> Result<(), ApiError> {
    let Some(rank) = pin.and_then(|r| usize::try_from(r).ok()) else {
        return Ok(());
    };
    match membership.targets.get(rank) {
        Some(t) if !roles.contains(&t.role) => Err(ApiError::BadRequest(format!(
            "DP rank {rank} is a {} endpoint, which this request does not go to",
            t.role.as_str()
        ))),
        _ => Ok(()),
    }
}

/// Picks the pair for `route` among the endpoints `accept` lets through (the prefill leg's, the decode leg's):
/// the decode leg's ticket, and the prefill leg; none when no prefill endpoint is healthy and the decode server
/// is vLLM's, which then prefills the prompt itself. A client's pin applies to the leg whose role its rank has.
pub fn pick(
    membership: &Membership,
    prefill_policy: Arc<dyn Policy>,
    decode_policy: Arc<dyn Policy>,
    accept: (&dyn Fn(usize) -> bool, &dyn Fn(usize) -> bool),
    route: RouteRequest,
) -> Result<(GatewayTicket, Option<Pair>), ApiError> {
    check_pin(membership, route.rank_override, &[Role::Prefill, Role::Decode])?;
    let pinned_role = route
        .rank_override
        .and_then(|r| usize::try_from(r).ok())
        .and_then(|r| membership.targets.get(r))
        .map(|t| t.role);
    let mut prefill_route = route.clone();
    let mut decode_route = route;
    match pinned_role {
        Some(Role::Prefill) => decode_route.rank_override = None,
        Some(_) => prefill_route.rank_override = None,
        None => {}
    }
    let role_of = |rank: usize| membership.targets[rank].role;
    let prefill_accept = |rank: usize| role_of(rank) == Role::Prefill && accept.0(rank);
    let decode_accept = |rank: usize| role_of(rank) == Role::Decode && accept.1(rank);
    let unavailable = |role: Role| {
        move |e: dprouter_core::RouteError| match e {
            dprouter_core::RouteError::NoHealthyEndpoint => {
                ApiError::Unavailable(format!("no healthy {} endpoint serves this request", role.as_str()))
            }
            other => other.into(),
        }
    };
    let decode = dispatch_among(decode_policy, &membership.snapshot, &decode_accept, decode_route)
        .map_err(unavailable(Role::Decode))?;
    let prefill = match dispatch_among(prefill_policy, &membership.snapshot, &prefill_accept, prefill_route) {
        Ok(prefill) => prefill,
        // A vLLM decode server prefills a prompt that comes without KV itself.
        Err(dprouter_core::RouteError::NoHealthyEndpoint)
            if membership.targets[decode.pick.rank].backend == Backend::Vllm =>
        {
            return Ok((decode, None));
        }
        Err(e) => return Err(unavailable(Role::Prefill)(e)),
    };
    let pair = Pair {
        rank: prefill.pick.rank,
        room: room_of(membership, &prefill),
        ticket: Some(prefill),
        kv_transfer_params: None,
    };
    Ok((decode, Some(pair)))
}

/// A fresh room for the prefill leg of `ticket`.
pub fn room_of(membership: &Membership, ticket: &GatewayTicket) -> u64 {
    let target = &membership.targets[ticket.pick.rank];
    room_for(draw(), target.id.dp_rank, target.dp_size)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn a_room_names_its_rank_and_stays_in_range(draw in any::<u64>(), dp in 1u32..4096, rank in 0u32..4096) {
            let rank = rank % dp;
            let room = room_for(draw, rank, dp);
            prop_assert!(room <= MAX_ROOM);
            prop_assert_eq!(room % u64::from(dp), u64::from(rank));
        }
    }

    #[test]
    fn rooms_near_the_top_stay_in_range() {
        assert_eq!(room_for(u64::MAX, 0, 3) % 3, 0);
        assert!(room_for(u64::MAX, 2, 3) <= MAX_ROOM);
        assert_eq!(room_for(MAX_ROOM, 6, 7) % 7, 6);
        assert_eq!(room_for(0, 5, 8), 5);
    }

    #[test]
    fn draws_differ() {
        let draws: std::collections::HashSet<u64> = (0..1000).map(|_| draw()).collect();
        assert_eq!(draws.len(), 1000);
    }

    #[test]
    fn the_bootstrap_host_is_the_urls_host() {
        assert_eq!(bootstrap_host("http://10.0.0.5:30000"), "10.0.0.5");
        assert_eq!(bootstrap_host("http://prefill-0.svc:8000"), "prefill-0.svc");
        assert_eq!(bootstrap_host("http://[fd00::1]:8000"), "fd00::1");
    }
}
