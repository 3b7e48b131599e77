//! One request's routing decision, shared by the HTTP proxy ([`crate::api::proxy`]) and the Endpoint Picker
//! (`dprouter-epp`): read the routing fields of the body and the rank header, check the model, pick with the
//! model's policy (its ticket holds the request's load and its feedback), and lay out the body the chosen endpoint
//! gets (the client's rank overrides left out, the rank and a mapped model name put in).

use std::sync::Arc;

use axum::http::{HeaderMap, HeaderName};
use bytes::Bytes;
use dprouter_core::request_body::{parse_body_as, Api, Layout, MemberKind, Piece, RequestBody};
use dprouter_core::{dispatch_among, Branch, EndpointId, RouteRequest, WorkerId};

use crate::admission::clients::Client;
use crate::common::error::ApiError;
use crate::config::{Backend, Role};
use crate::fleet::registry::{Membership, Target};
use crate::observe::telemetry;
use crate::pipeline::body::GatewayTicket;
use crate::state::AppState;

/// The client header that pins a rank (SGLang `/v1/*` since PR #19832), and the one vLLM reads: the same name.
pub const RANK_HEADER: &str = "x-data-parallel-rank";

/// Bodies larger than this are parsed on the blocking pool, off the async runtime's threads.
const BLOCKING_PARSE_BYTES: usize = 1 << 20;

/// A routed request: its ticket and what its endpoint is sent.
pub struct Routed {
    pub ticket: GatewayTicket,
    /// The membership the decision was made in (the ticket's rank indexes its targets).
    pub membership: Arc<Membership>,
    /// The client's bytes.
    pub bytes: Bytes,
    pub layout: Layout,
    /// The `model` the client named.
    pub model: Option<String>,
    /// The model as the workers know it, when it differs from the client's or the fleet serves several.
    pub served: Option<String>,
    /// The `model` member the worker gets instead of the client's, when the client used an alias.
    pub model_member: Option<Bytes>,
    /// The request continues a stored Responses answer, or is a Responses request (its answer's id is remembered).
    pub responses_api: bool,
    /// A disaggregated request's prefill leg (`ticket` is then the decode leg's).
    pub pair: Option<Box<crate::pipeline::pairing::Pair>>,
    /// The client whose key the request carried, when clients are configured.
    pub client: Option<Arc<Client>>,
}

impl Routed {
    /// Whether an answer of `status` is a Responses answer whose id to remember, and for whom.
    pub fn remember(&self, status: u16) -> Option<crate::common::response_homes::Owner> {
        let success = (200..300).contains(&status);
        (self.responses_api && success).then(|| self.client.as_ref().map(|c| Arc::clone(&c.name)))
    }

    /// The access log's record of where the request went: `target`, chosen by `policy` on the ticket's branch,
    /// after `retries` refused connections.
    pub fn routing(&self, target: &Target, policy: &'static str, retries: u32) -> crate::observe::access::Routing {
        crate::observe::access::Routing {
            endpoint: target.label(),
            rank: target.id.dp_rank,
            policy,
            branch: self.ticket.pick.branch.as_str(),
            model: self.served.clone().or(self.model.clone()),
            retries,
        }
    }

    /// The target the ticket names.
    pub fn target(&self) -> &Target {
        &self.membership.targets[self.ticket.pick.rank]
    }

    /// Whether `rank` serves the request's model.
    pub fn serving(&self, rank: usize) -> bool {
        self.served
            .as_deref()
            .is_none_or(|m| self.membership.targets[rank].serves(m))
    }

    /// The request was served at `rank` rather than where it was sent (a data plane's fallback, which takes no
    /// rank): the ticket moves there, so that the policy learns where the prompt went. Refused when `rank` cannot
    /// take it now (its feedback is then lost, and its load released with it).
    pub fn served_at(mut self, rank: usize) -> Result<Self, dprouter_core::RouteError> {
        let now = crate::common::clock::now_us();
        self.ticket = self.ticket.reroute(&self.membership.snapshot, &|r| r == rank, now)?;
        Ok(self)
    }

    /// The prefill leg's target, for a disaggregated request.
    pub fn prefill_target(&self) -> Option<&Target> {
        let pair = self.pair.as_ref()?;
        Some(&self.membership.targets[pair.rank])
    }

    /// The members `target` gets to pair its leg with the other, for a disaggregated request: SGLang's bootstrap
    /// fields; vLLM's prefill leg's `kv_transfer_params` asking for a remote decode (and one token, not streamed),
    /// and its decode leg's the prefill answer's.
    fn pairing_members(&self, target: &Target, path: &str) -> Option<Bytes> {
        let (pair, prefill) = (self.pair.as_ref()?, self.prefill_target()?);
        match (target.backend, target.role) {
            (Backend::Sglang, role) => Some(crate::pipeline::pairing::bootstrap_members(
                prefill,
                pair.room,
                role == Role::Decode,
            )),
            (Backend::Vllm, Role::Prefill) => Some(crate::pipeline::pairing::vllm_prefill_members(path)),
            (Backend::Vllm, _) => pair.kv_transfer_params.as_ref().map(|params| {
                let mut member = b"\"kv_transfer_params\":".to_vec();
                member.extend_from_slice(params);
                Bytes::from(member)
            }),
            (Backend::Openai, _) => None,
        }
    }

    /// Whether `target` gets vLLM's prefill leg (its own `stream` and lengths instead of the client's).
    fn vllm_prefill_leg(&self, target: &Target) -> bool {
        self.pair.is_some() && target.backend == Backend::Vllm && target.role == Role::Prefill
    }

    /// The body `target` gets, as pieces of the client's bytes, and the rank header it needs (vLLM's, or
    /// SGLang's on a path without a body field), if any.
    pub fn upstream_body(&self, target: &Target, path: &str) -> (Vec<Bytes>, Option<(HeaderName, u32)>) {
        let rank = target.id.dp_rank;
        let (rank_member, rank_header) = match target.backend {
            Backend::Sglang => match target.rank_field.body_field(path) {
                Some(field) => (Some(Bytes::from(format!("\"{field}\":{rank}"))), None),
                None => (None, Some(rank)),
            },
            Backend::Vllm => (None, Some(rank)),
            Backend::Openai => (None, None),
        };
        let pieces = laid_out(
            &self.bytes,
            &self.layout,
            rank_member
                .into_iter()
                .chain(self.model_member.clone())
                .chain(self.pairing_members(target, path)),
            |kind| match kind {
                MemberKind::Model => self.model_member.is_some(),
                // What steers a KV transfer is never a client's (on aggregated workers too: a vLLM fleet with a KV
                // connector would fetch KV where a client says); the gateway sets its own on a pair's legs.
                MemberKind::Disaggregation => true,
                // A client's room may stay on an aggregated worker (`follow_bootstrap_room` routes by it); the
                // gateway pairs a disaggregated request's legs with its own.
                MemberKind::BootstrapRoom => self.pair.is_some() || target.role != Role::Aggregated,
                MemberKind::Streaming | MemberKind::Length => self.vllm_prefill_leg(target),
                _ => false,
            },
        );
        (pieces, rank_header.map(|r| (HeaderName::from_static(RANK_HEADER), r)))
    }
}

/// The client's `bytes` laid out for a worker as pieces of them: `first` members, then the client's but its rank
/// overrides and those `dropped` ([`Layout::forwarded`]).
pub fn laid_out(
    bytes: &Bytes,
    layout: &Layout,
    first: impl IntoIterator<Item = Bytes>,
    dropped: impl Fn(MemberKind) -> bool,
) -> Vec<Bytes> {
    layout
        .forwarded(bytes, first, dropped, |b: &Bytes, range| b.slice(range))
        .into_iter()
        .map(|p| match p {
            Piece::Text(t) => Bytes::from_static(t.as_bytes()),
            Piece::Bytes(b) => b,
        })
        .collect()
}

/// A body must be JSON: a request that says it is something else gets a 415.
pub fn check_content_type(headers: &HeaderMap) -> Result<(), ApiError> {
    if let Some(ct) = headers.get(axum::http::header::CONTENT_TYPE) {
        let ct = ct.to_str().unwrap_or("").to_ascii_lowercase();
        let essence = ct.split(';').next().unwrap_or("").trim();
        if essence != "application/json" {
            return Err(ApiError::UnsupportedMediaType(ct));
        }
    }
    Ok(())
}

/// Whether `target`'s requests carry its rank (a body field or a header): such a request must never reach
/// another endpoint.
pub fn injects_rank(target: &Target) -> bool {
    !matches!(target.backend, Backend::Openai)
}

/// Routes one request for `path` (the path the worker gets) with `headers` and body `bytes` among the healthy
/// endpoints that `allowed` lets through (every one, for the proxy; the proxy's subset hint, for the Endpoint
/// Picker). Counts the decision.
pub async fn route(
    state: &Arc<AppState>,
    (path, headers): (&str, &HeaderMap),
    bytes: Bytes,
    client: Option<Arc<Client>>,
    allowed: &(dyn Fn(&Target) -> bool + Sync),
) -> Result<Routed, ApiError> {
    // A pin passes the balancer by: a keyed client pins only if it may.
    let pins = state.config.allow_client_overrides && client.as_ref().is_none_or(|c| c.allow_pins);
    let api = api_of(path);
    let (bytes, body, program) = parse(state, (headers, api), bytes, pins).await?;
    let RequestBody {
        mut route,
        layout,
        model,
        previous_response_id,
    } = body;
    if let Some(client) = &client {
        client.may_use(model.as_deref())?;
    }
    let responses_api = path.split('?').next() == Some("/v1/responses");
    let membership = state.registry.membership();
    let served = served_model(state, &membership, model.as_deref())?;
    // The model's name as the worker knows it, when the client used an alias.
    let model_member = match (&served, &model) {
        (Some(s), Some(asked)) if s != asked => Some(Bytes::from(format!("\"model\":{}", serde_json::json!(s)))),
        _ => None,
    };
    let serving = |rank: usize| served.as_deref().is_none_or(|m| membership.targets[rank].serves(m));
    if api == Api::Messages && crate::pipeline::pairing::disaggregated(&membership, &serving) {
        // vLLM's Messages request carries no `kv_transfer_params` to pair its legs with; SGLang's pairs, but no test
        // here has run it through both legs.
        return Err(ApiError::NotImplemented(
            "the Messages API (/v1/messages) is not served on a prefill/decode pool yet: send the request to \
             /v1/chat/completions, or serve the model on aggregated workers"
                .into(),
        ));
    }
    // A rank the client pinned must serve the model too (a rank out of range is the policy's error).
    if let (Some(model), Some(rank)) = (
        served.as_deref(),
        route
            .rank_override
            .and_then(|r| usize::try_from(r).ok())
            .filter(|&r| r < membership.targets.len()),
    ) {
        if !serving(rank) {
            return Err(ApiError::BadRequest(format!(
                "DP rank {rank} does not serve model `{model}`"
            )));
        }
    }
    if let Some(tokenizer) = state
        .tokenizers
        .for_model(served.as_deref().or(membership.sole_model()))
    {
        crate::admission::tokens::exact_prompt(&state.tokenizers, tokenizer, (&bytes, api), &mut route).await;
    }
    if let Some(client) = &client {
        client.admit_tokens(route.input_tokens)?;
    }
    // A keyed client continues its own responses only: any other id is unknown to it, and never reaches an engine
    // (which would serve whoever names it).
    let asker = client.as_ref().map(|c| &*c.name);
    let previous = previous_response_id.filter(|_| responses_api);
    if let (Some(id), Some(_)) = (&previous, asker) {
        if state.responses.home(id, asker).is_none() {
            return Err(ApiError::NotFound(format!(
                "no response `{id}` of this client is known here: only the last {} responses made through this \
                 gateway are (a fair share of them for each client)",
                state.config.remembered_responses
            )));
        }
    }
    // Flow control: while every endpoint the request may use is saturated it waits here, and the pick below is made
    // with the load of the moment it leaves (late binding). A pin passes the queue by, as it passes the balancer.
    let admitted = match (&state.flow, route.rank_override) {
        (Some(flow), None) => {
            let (flow_id, priority) = flow.classify(client.as_deref(), headers, program)?;
            // An aggregated request may wait for the endpoint that holds its prefix (a disaggregated one takes the
            // decode endpoint with room: its prefix is the prefill leg's).
            let affinity = match flow.prefix_wait() && !crate::pipeline::pairing::disaggregated(&membership, &serving) {
                false => None,
                true => {
                    let known = served.as_deref().filter(|m| membership.models().iter().any(|k| k == m));
                    let policy = state.policies.for_model(known.or(membership.sole_model()));
                    // The request waits with its routing data, and gets it back when it leaves the queue.
                    let waiting = std::mem::replace(&mut route, RouteRequest::tokens(Vec::new()));
                    Some(crate::admission::flow_affinity::Affinity::new(policy, waiting))
                }
            };
            let demand = crate::admission::flow::Demand {
                model: served.as_deref(),
                priority,
                flow: &flow_id,
                bytes: bytes.len(),
                affinity,
            };
            let mut admitted = flow.admit(&state.registry, demand).await?;
            if let Some(taken) = admitted.route.take() {
                route = taken;
            }
            Some(admitted)
        }
        _ => None,
    };
    // Everything below reads the membership of the moment the request left the queue.
    let membership = match &admitted {
        Some(a) if a.waited => state.registry.membership(),
        _ => membership,
    };
    let serving = |rank: usize| served.as_deref().is_none_or(|m| membership.targets[rank].serves(m));
    // Per-model state for the models workers are known to serve only: a name a client makes up (taken by a worker
    // whose models are unknown) shares the default policy rather than growing the table.
    let known = served.as_deref().filter(|m| membership.models().iter().any(|k| k == m));
    route.now_us = crate::common::clock::now_us();
    let home = previous.and_then(|id| state.responses.home(&id, asker));
    let scope = Scope::of(home, &membership, &|rank| {
        serving(rank) && allowed(&membership.targets[rank])
    });
    let accept = |rank: usize| {
        serving(rank) && allowed(&membership.targets[rank]) && scope.contains(membership.targets[rank].id)
    };
    let model_key = known.or(membership.sole_model());
    let (ticket, pair) = if crate::pipeline::pairing::disaggregated(&membership, &serving) {
        // A stored Responses answer's home is a decode endpoint: the scope narrows the decode leg only.
        let unscoped = |rank: usize| serving(rank) && allowed(&membership.targets[rank]);
        let policies = (
            state.policies.for_role(Role::Prefill, model_key),
            state.policies.for_role(Role::Decode, model_key),
        );
        let conditions = &state.config.disaggregation;
        let (ticket, pair) =
            crate::pipeline::pairing::pick(&membership, policies, (&unscoped, &accept), route, conditions)?;
        if let Some(prefill) = pair.as_ref().and_then(|p| p.ticket.as_ref()) {
            count_decision(state, prefill.pick.branch);
        }
        (ticket, pair.map(Box::new))
    } else {
        crate::pipeline::pairing::check_pin(&membership, route.rank_override, &[Role::Aggregated])?;
        let aggregated = |rank: usize| membership.targets[rank].role == Role::Aggregated && accept(rank);
        // Under flow control a request goes to an endpoint with room while there is one: that is what it waited for.
        let full: Vec<bool> = match &state.flow {
            Some(flow) if admitted.is_some() => (0..membership.snapshot.len())
                .map(|r| flow.rank_saturated(&membership, r, route.now_us))
                .collect(),
            _ => Vec::new(),
        };
        let room = |rank: usize| !full.get(rank).copied().unwrap_or(false);
        let any_room = membership.snapshot.healthy().iter().any(|&r| aggregated(r) && room(r));
        let with_room = |rank: usize| aggregated(rank) && (!any_room || room(rank));
        let policy = state.policies.for_model(model_key);
        (dispatch_among(policy, &membership.snapshot, &with_room, route)?, None)
    };
    count_decision(state, ticket.pick.branch);
    if layout.has(MemberKind::Disaggregation) {
        crate::observe::refusals::refused("client_field", || {
            "a client's kv_transfer_params, bootstrap_host, bootstrap_port or disagg_prefill_dp_rank dropped: \
             only the gateway steers a KV transfer"
                .to_string()
        });
    }
    // The request holds its share of the load now: the queue's dispatcher may look again.
    drop(admitted);
    Ok(Routed {
        ticket,
        membership,
        bytes,
        layout,
        model,
        served,
        model_member,
        responses_api,
        pair,
        client,
    })
}

/// The API a request for `path` speaks: Anthropic's Messages on `/v1/messages`, OpenAI's (or SGLang's) elsewhere.
pub(crate) fn api_of(path: &str) -> Api {
    match path.split(['?', '#']).next() {
        Some("/v1/messages") => Api::Messages,
        _ => Api::OpenAi,
    }
}

/// Reads the routing fields of `bytes` as `api` reads them (on the blocking pool when the body is large), the rank
/// header, and the session and program ([`crate::admission::sessions`]). `allow_overrides`: the client may pin a
/// rank (otherwise its pins are ignored, and never reach a worker).
async fn parse(
    state: &AppState,
    (headers, api): (&HeaderMap, Api),
    bytes: Bytes,
    allow_overrides: bool,
) -> Result<(Bytes, RequestBody, Option<u64>), ApiError> {
    let (bytes, mut body) = if bytes.len() > BLOCKING_PARSE_BYTES {
        tokio::task::spawn_blocking(move || parse_body_as(&bytes, allow_overrides, api).map(|b| (bytes, b)))
            .await
            .map_err(|e| ApiError::Unavailable(format!("the request could not be parsed: {e}")))??
    } else {
        let body = parse_body_as(&bytes, allow_overrides, api)?;
        (bytes, body)
    };
    // The session the agent's headers name comes first, then what the body says; its program likewise, for flow
    // control's fairness.
    let configured = state.config.session_header.as_deref();
    let program = crate::admission::sessions::program(headers, configured).or(body.route.session);
    if let Some(session) = crate::admission::sessions::placement(headers, configured) {
        body.route.session = Some(session);
    }
    if let (true, Some(h)) = (allow_overrides, headers.get(RANK_HEADER)) {
        let rank = h.to_str().ok().and_then(|s| s.trim().parse::<i64>().ok());
        body.route.rank_override =
            Some(rank.ok_or_else(|| ApiError::BadRequest("X-Data-Parallel-Rank must be an integer".into()))?);
    }
    Ok((bytes, body, program))
}

/// The model a request is for, as the workers know it (after the config's aliases); `None` for a request that
/// names none, or when the fleet serves one model or unknown ones (any name goes then, as SGLang and llama.cpp
/// take any). In a fleet of several known models, a 404 for a model no worker serves (workers whose models are
/// unknown take any).
fn served_model(state: &AppState, membership: &Membership, asked: Option<&str>) -> Result<Option<String>, ApiError> {
    let Some(asked) = asked else { return Ok(None) };
    let served = state.config.model_aliases.get(asked).map_or(asked, String::as_str);
    if membership.models().len() < 2 {
        // One model (or none known): every worker serves the request whatever it names, with the alias mapped.
        return Ok((served != asked).then(|| served.to_string()));
    }
    if membership.targets.iter().any(|t| t.serves(served)) {
        return Ok(Some(served.to_string()));
    }
    Err(ApiError::ModelNotFound(
        crate::common::throttled::clip(asked).into_owned(),
    ))
}

/// Whether a request for `path` changes no engine's cache (Anthropic's `count_tokens`): it is placed by load alone
/// ([`route_uncached`]), with no ticket, and teaches no policy.
pub fn changes_no_cache(path: &str) -> bool {
    path.split(['?', '#']).next() == Some("/v1/messages/count_tokens")
}

/// A request placed by [`route_uncached`]: its endpoint and the body that endpoint gets.
pub struct Uncached {
    pub target: Target,
    pub pieces: Vec<Bytes>,
}

/// Places a request that changes no cache ([`changes_no_cache`]): the healthy endpoint with the fewest requests in
/// flight among those serving its model (read as a Messages body) that `allowed` lets through. Its body goes as
/// the client's, the model mapped when the client used an alias, the client's rank fields left out.
pub fn route_uncached(
    state: &AppState,
    bytes: Bytes,
    client: Option<&Client>,
    allowed: &(dyn Fn(&Target) -> bool + Sync),
) -> Result<Uncached, ApiError> {
    let body = parse_body_as(&bytes, false, Api::Messages)?;
    if let Some(client) = client {
        client.may_use(body.model.as_deref())?;
    }
    let membership = state.registry.membership();
    let served = served_model(state, &membership, body.model.as_deref())?;
    let rank = membership
        .snapshot
        .healthy()
        .iter()
        .copied()
        .filter(|&r| served.as_deref().is_none_or(|m| membership.targets[r].serves(m)))
        .filter(|&r| allowed(&membership.targets[r]))
        .min_by_key(|&r| membership.snapshot.load(r).in_flight_requests())
        .ok_or(ApiError::Route(dprouter_core::RouteError::NoHealthyEndpoint))?;
    let model_member = match (&served, &body.model) {
        (Some(s), Some(asked)) if s != asked => Some(Bytes::from(format!("\"model\":{}", serde_json::json!(s)))),
        _ => None,
    };
    let mapped = model_member.is_some();
    let pieces = laid_out(&bytes, &body.layout, model_member, |kind| match kind {
        MemberKind::Model => mapped,
        MemberKind::Disaggregation | MemberKind::BootstrapRoom => true,
        _ => false,
    });
    Ok(Uncached {
        target: membership.targets[rank].clone(),
        pieces,
    })
}

/// Counts a routing decision (metrics and `GET /workers`).
pub fn count_decision(state: &AppState, branch: Branch) {
    metrics::counter!(telemetry::DECISIONS, "policy" => state.policies.default_policy().name(), "branch" => branch.as_str()).increment(1);
    state.count_decision(branch);
}

/// Where a request may go besides its model's workers: anywhere, or, for the continuation of a stored Responses
/// answer, the endpoint that made it, else another routable rank of its worker, else anywhere (the engine's 404
/// then says the response is gone; [`crate::api::responses`]).
#[derive(Debug, Clone, Copy)]
enum Scope {
    Any,
    Worker(WorkerId),
    Endpoint(EndpointId),
}

impl Scope {
    fn of(home: Option<EndpointId>, membership: &Membership, routable_rank: &dyn Fn(usize) -> bool) -> Self {
        let Some(home) = home else { return Scope::Any };
        let routable = |scope: Scope| {
            membership
                .snapshot
                .healthy()
                .iter()
                .any(|&rank| routable_rank(rank) && scope.contains(membership.targets[rank].id))
        };
        [Scope::Endpoint(home), Scope::Worker(home.worker)]
            .into_iter()
            .find(|&scope| routable(scope))
            .unwrap_or(Scope::Any)
    }

    fn contains(self, id: EndpointId) -> bool {
        match self {
            Scope::Any => true,
            Scope::Worker(worker) => id.worker == worker,
            Scope::Endpoint(endpoint) => id == endpoint,
        }
    }
}
