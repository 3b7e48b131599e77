//! Prefill/decode disaggregation's decision: a request for a model that decode workers serve gets a **pair**, a
//! prefill endpoint picked by the prefill policy (by its cached prefix, `cache_aware` by default) among the
//! prefill workers and a decode endpoint picked by the decode policy (by load, `least_loaded` by default) among the
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
//! Under vLLM the legs are paired by `kv_transfer_params` instead ([`vllm_prefill_members`], [`crate::disagg::legs`]), and
//! each leg's rank goes in its own `X-data-parallel-rank`. A vLLM decode server prefills a prompt that comes
//! without KV, so with no healthy prefill endpoint its request goes to the decode server alone, and so does one
//! that [`DisaggregationConfig`] keeps local: few uncached tokens on its decode endpoint, or every prefill endpoint
//! busy (conditional disaggregation, as Dynamo's `isl_bounding` and `prefill_load` rules and llm-d's
//! `nonCachedTokens`).

use std::sync::Arc;

use bytes::Bytes;
use dprouter_core::{dispatch_among, Policy, RouteRequest};

use crate::common::error::ApiError;
use crate::config::{Backend, DisaggregationConfig, Role};
use crate::fleet::registry::{Membership, Target};
use crate::pipeline::body::GatewayTicket;

/// The largest bootstrap room: SGLang's routers draw rooms in [0, 2^63 − 1].
pub const MAX_ROOM: u64 = (1 << 63) - 1;

/// A disaggregated request's prefill leg: its endpoint, the room that pairs it with the decode leg (SGLang), its
/// ticket until the leg is sent ([`crate::disagg::legs`]), and what the prefill answer said to tell the decode server
/// (vLLM's `kv_transfer_params`, as JSON).
pub struct Pair {
    /// The prefill endpoint's rank in the membership.
    pub rank: usize,
    pub room: u64,
    pub ticket: Option<GatewayTicket>,
    pub kv_transfer_params: Option<Bytes>,
}

/// Whether every endpoint `accept`ed among `membership`'s healthy ones has `conditions.prefill_busy_tokens` prompt
/// tokens waiting for their first token (the prefill pool is saturated; never when that is 0).
fn prefill_saturated(
    conditions: &DisaggregationConfig,
    membership: &Membership,
    accept: &dyn Fn(usize) -> bool,
) -> bool {
    let mut prefill = membership
        .snapshot
        .healthy()
        .iter()
        .copied()
        .filter(|&r| accept(r))
        .peekable();
    conditions.prefill_busy_tokens > 0
        && prefill.peek().is_some()
        && prefill.all(|r| membership.snapshot.load(r).queued_prefill_tokens() >= conditions.prefill_busy_tokens)
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
/// the decode leg's ticket, and the prefill leg; none when the decode server is vLLM's, which then prefills the
/// prompt itself, and no prefill endpoint is healthy or `conditions` keep the request local (unless the client
/// pinned a prefill rank). A client's pin applies to the leg whose role its rank has.
pub fn pick(
    membership: &Membership,
    (prefill_policy, decode_policy): (Arc<dyn Policy>, Arc<dyn Policy>),
    accept: (&dyn Fn(usize) -> bool, &dyn Fn(usize) -> bool),
    route: RouteRequest,
    conditions: &DisaggregationConfig,
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
    let prompt = decode_route.input_tokens;
    let decode = dispatch_among(decode_policy, &membership.snapshot, &decode_accept, decode_route)
        .map_err(unavailable(Role::Decode))?;
    if membership.targets[decode.pick.rank].backend == Backend::Vllm && prefill_route.rank_override.is_none() {
        let uncached = decode.pick.prefill_tokens.unwrap_or(prompt);
        if conditions.few_uncached(uncached, prompt) || prefill_saturated(conditions, membership, &prefill_accept) {
            return Ok((decode, None));
        }
    }
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

    fn vllm_pd_fleet() -> crate::fleet::registry::Registry {
        let registry = crate::fleet::registry::Registry::new(Default::default());
        for (url, role) in [("http://p:1", Role::Prefill), ("http://d:1", Role::Decode)] {
            let worker = crate::config::WorkerConfig {
                url: url.into(),
                backend: Backend::Vllm,
                role,
                ..Default::default()
            };
            let info = crate::fleet::upstream::WorkerInfo {
                dp_size: 1,
                kv_capacity: None,
                models: Vec::new(),
            };
            registry.add_worker(&worker, info).unwrap();
        }
        registry
    }

    fn conditions(below: u64, share: f64, busy: u64) -> DisaggregationConfig {
        DisaggregationConfig {
            local_prefill_below_tokens: below,
            local_prefill_max_share: share,
            prefill_busy_tokens: busy,
            ..Default::default()
        }
    }

    /// Whether a request with `cached` of 3,000 tokens on the decode endpoint (told to `cache_aware` as the usage of
    /// an earlier request) gets a prefill leg.
    fn paired(rules: &DisaggregationConfig, cached: usize) -> bool {
        let membership = vllm_pd_fleet().membership();
        let decode: Arc<dyn Policy> = Arc::from(dprouter_core::PolicyConfig::from_name("cache_aware").unwrap().build());
        let prefill: Arc<dyn Policy> =
            Arc::from(dprouter_core::PolicyConfig::from_name("round_robin").unwrap().build());
        let all = |_: usize| true;
        let prompt: Vec<u32> = (0..3000).collect();
        if cached > 0 {
            let mut earlier = RouteRequest::tokens(prompt[..cached].to_vec());
            earlier.now_us = 1;
            let (mut ticket, _) = pick(
                &membership,
                (prefill.clone(), decode.clone()),
                (&all, &all),
                earlier,
                &conditions(0, 1.0, 0),
            )
            .unwrap();
            ticket.usage(dprouter_core::Usage {
                prompt_tokens: cached as u64,
                cached_tokens: 0,
            });
        }
        let (_, pair) = pick(
            &membership,
            (prefill, decode),
            (&all, &all),
            RouteRequest::tokens(prompt),
            rules,
        )
        .unwrap();
        pair.is_some()
    }

    #[test]
    fn a_vllm_request_with_few_uncached_tokens_on_its_decode_endpoint_is_prefilled_there() {
        // Off by default.
        assert!(paired(&DisaggregationConfig::default(), 2990));
        // 10 uncached of 3,000: under 100 and under 70%.
        assert!(!paired(&conditions(100, 0.7, 0), 2990));
        // 1,000 uncached: over 100.
        assert!(paired(&conditions(100, 0.7, 0), 2000));
        // Nothing cached: 3,000 under 5,000, but all of the prompt; any share is allowed at 1.
        assert!(paired(&conditions(5000, 0.7, 0), 0));
        assert!(!paired(&conditions(5000, 1.0, 0), 0));
    }

    #[test]
    fn a_vllm_request_skips_a_saturated_prefill_pool() {
        let registry = vllm_pd_fleet();
        let membership = registry.membership();
        let decode: Arc<dyn Policy> =
            Arc::from(dprouter_core::PolicyConfig::from_name("least_loaded").unwrap().build());
        let prefill: Arc<dyn Policy> =
            Arc::from(dprouter_core::PolicyConfig::from_name("round_robin").unwrap().build());
        let all = |_: usize| true;
        let busy = conditions(0, 1.0, 5000);
        let request = || RouteRequest::tokens((0..3000).collect());
        let (_first, pair) = pick(
            &membership,
            (prefill.clone(), decode.clone()),
            (&all, &all),
            request(),
            &busy,
        )
        .unwrap();
        // Its prefill leg holds 3,000 tokens waiting for their first token: not yet 5,000.
        let held = pair.unwrap();
        let (_second, pair) = pick(
            &membership,
            (prefill.clone(), decode.clone()),
            (&all, &all),
            request(),
            &busy,
        )
        .unwrap();
        let _also_held = pair.unwrap();
        // 6,000 waiting on the only prefill endpoint: the third goes to the decode server alone.
        let (_third, pair) = pick(
            &membership,
            (prefill.clone(), decode.clone()),
            (&all, &all),
            request(),
            &busy,
        )
        .unwrap();
        assert!(pair.is_none());
        // A prefill endpoint frees up: pairs again.
        drop(held);
        let (_fourth, pair) = pick(&membership, (prefill, decode), (&all, &all), request(), &busy).unwrap();
        assert!(pair.is_some());
    }

    #[test]
    fn the_bootstrap_host_is_the_urls_host() {
        assert_eq!(bootstrap_host("http://10.0.0.5:30000"), "10.0.0.5");
        assert_eq!(bootstrap_host("http://prefill-0.svc:8000"), "prefill-0.svc");
        assert_eq!(bootstrap_host("http://[fd00::1]:8000"), "fd00::1");
    }
}
