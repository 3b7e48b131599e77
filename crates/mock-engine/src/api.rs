//! HTTP routes with SGLang's (and OpenAI's) request and response shapes.
//!
//! Generation: `POST /generate` (SGLang native), `/v1/chat/completions`, `/v1/completions`, streaming (`data: {...}`
//! events ending with `data: [DONE]`) or not, and `/v1/responses` (OpenAI Responses, stored: [`crate::responses`]). Every generation response carries the serving rank in the
//! `x-dp-rank` header (and `/generate` in `meta_info.dp_rank`). Control: `GET /health`, `/health_generate`,
//! `/get_server_info`, `/get_load`, `/v1/models`, `POST /flush_cache`.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::disagg::{Mode, Source};
use crate::engine::{Api, Engine, Leg, Refusal};
use crate::job::{parse_job, Job};
use crate::render::{error, stream_response, whole_response, Kind, Renderer};
use crate::responses::{Keep, ResponseStore};
use crate::tokenizer::encode;
use dprouter_sim::tokens::mix;

/// The header naming the rank that served a response.
pub const SERVED_RANK_HEADER: &str = "x-dp-rank";

#[derive(Clone)]
pub(crate) struct AppState {
    pub(crate) engine: Arc<Engine>,
    started: Instant,
    /// Response ids: a random prefix per process (ids from two engines never collide, as engines' uuids do not),
    /// then a counter.
    id_prefix: u64,
    next_id: Arc<AtomicU64>,
    pub(crate) responses: Arc<ResponseStore>,
}

/// The mock engine's routes.
pub fn router(engine: Arc<Engine>) -> Router {
    let state = AppState {
        engine,
        started: Instant::now(),
        id_prefix: {
            use std::hash::BuildHasher;
            std::collections::hash_map::RandomState::new().hash_one(std::process::id())
        },
        next_id: Arc::new(AtomicU64::new(0)),
        responses: Arc::default(),
    };
    Router::new()
        .route("/generate", post(generate))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/messages", post(messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .route("/v1/completions", post(completions))
        .route("/v1/responses", post(responses))
        .route("/v1/responses/{id}", get(get_response).delete(delete_response))
        .route("/v1/embeddings", post(embeddings))
        .route("/health", get(health))
        .route("/health_generate", get(health))
        .route("/get_server_info", get(server_info))
        .route("/server_info", get(server_info))
        .route("/get_load", get(get_load))
        .route("/v1/models", get(models))
        .route("/flush_cache", post(flush_cache))
        .fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(state.clone(), require_key))
        // Real engines take bodies far past axum's 2 MB default (SGLang and vLLM set no limit).
        .layer(axum::extract::DefaultBodyLimit::max(256 << 20))
        .with_state(state)
}

/// The engine's `--api-key`, checked where the engine checks it: SGLang every route but `/health*` and `/metrics`
/// (`add_api_key_middleware`), vLLM the `/v1` routes; a 401 `{"error": "Unauthorized"}` as both answer.
async fn require_key(
    State(state): State<AppState>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let config = state.engine.config();
    let Some(key) = config.api_key.as_deref() else {
        return next.run(request).await;
    };
    let path = request.uri().path();
    let open = match config.api {
        Api::Sglang => path.starts_with("/health") || path.starts_with("/metrics"),
        Api::Vllm => !path.starts_with("/v1"),
    };
    let given = request
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    if open || given.and_then(|g| g.strip_prefix("Bearer ")) == Some(key) {
        return next.run(request).await;
    }
    (StatusCode::UNAUTHORIZED, Json(json!({"error": "Unauthorized"}))).into_response()
}

async fn not_found() -> Response {
    error(StatusCode::NOT_FOUND, "no such route")
}

async fn health(State(s): State<AppState>) -> StatusCode {
    let delay = s.engine.config().faults.health_delay;
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    if s.engine.config().faults.unhealthy {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    }
}

async fn server_info(State(s): State<AppState>) -> Json<Value> {
    let c = s.engine.config();
    Json(json!({
        "dp_size": c.dp_size,
        "page_size": c.cost.page_size,
        "max_total_num_tokens": c.cost.kv_capacity,
        "model_path": c.model,
        "served_model_name": c.model,
        "api": match c.api { Api::Sglang => "sglang", Api::Vllm => "vllm" },
        "time_scale": c.time_scale,
        "cost": c.cost,
        "kv_events_endpoints": s.engine.kv_endpoints.get().map(|b| b.iter().map(|(p, _)| p.clone()).collect::<Vec<_>>()),
        "kv_events_replay_endpoints": s.engine.kv_endpoints.get().map(|b| b.iter().map(|(_, r)| r.clone()).collect::<Vec<_>>()),
        "aborted_requests": s.engine.aborted(),
        "completed_requests": s.engine.completed(),
        // SGLang's server args: "null" when the server prefills and decodes.
        "disaggregation_mode": c.disaggregation.as_ref().map_or("null", |d| d.mode.as_str()),
        "disaggregation_bootstrap_port": c.disaggregation.as_ref().map(|d| d.bootstrap_port),
        "open_bootstrap_rooms": s.engine.rooms().len(),
        "kv_transfers": s.engine.transfers(),
    }))
}

async fn get_load(State(s): State<AppState>) -> Json<Value> {
    let tic = s.started.elapsed().as_secs_f64();
    let ranks: Vec<Value> = s
        .engine
        .load()
        .iter()
        .enumerate()
        .map(|(rank, l)| {
            json!({
                "dp_rank": rank,
                "num_reqs": l.running + l.waiting,
                "num_waiting_reqs": l.waiting,
                "num_tokens": l.used_tokens,
                "num_pending_tokens": l.pending_tokens,
                "ts_tic": tic,
            })
        })
        .collect();
    Json(Value::Array(ranks))
}

/// `GET /v1/models`: the configured model, or each of a comma-separated list of them.
async fn models(State(s): State<AppState>) -> Json<Value> {
    let created = unix_time();
    let data: Vec<Value> = s
        .engine
        .config()
        .model
        .split(',')
        .map(|id| json!({"id": id.trim(), "object": "model", "created": created, "owned_by": "dprouter-mock"}))
        .collect();
    Json(json!({"object": "list", "data": data}))
}

async fn flush_cache(State(s): State<AppState>) -> &'static str {
    s.engine.flush_cache();
    "Cache flushed.\n"
}

fn unix_time() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn bad(message: impl Into<String>) -> Response {
    error(StatusCode::BAD_REQUEST, message)
}

async fn generate(State(s): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    serve_job(s, Kind::Generate, &headers, &body, None).await
}

async fn chat_completions(State(s): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    serve_job(s, Kind::Chat, &headers, &body, None).await
}

/// `POST /v1/messages`: Anthropic's Messages API ([`crate::messages`]).
async fn messages(State(s): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    crate::messages::anthropic_errors(serve_job(s, Kind::Messages, &headers, &body, None).await).await
}

/// `POST /v1/messages/count_tokens`: `{"input_tokens": n}`, the prompt's tokens as the engine renders it.
async fn count_tokens(State(s): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    let config = s.engine.config();
    match parse_job(
        Kind::Messages,
        config.api,
        config.tokenizer.as_deref(),
        &headers,
        &body,
        None,
    ) {
        Ok(job) => Json(json!({"input_tokens": job.tokens.len()})).into_response(),
        Err(message) => crate::messages::anthropic_errors(bad(message)).await,
    }
}

async fn completions(State(s): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    serve_job(s, Kind::Completion, &headers, &body, None).await
}

/// `POST /v1/responses`; one that continues a response this process does not have is a 404, as vLLM and SGLang
/// answer it.
async fn responses(State(s): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    let previous = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v.get("previous_response_id")?.as_str().map(str::to_owned));
    let prior = match previous {
        None => None,
        Some(id) => match s.responses.conversation(&id) {
            Some(conversation) => Some(conversation),
            None => return response_not_found(&id),
        },
    };
    serve_job(s, Kind::Responses, &headers, &body, prior).await
}

fn response_not_found(id: &str) -> Response {
    error(StatusCode::NOT_FOUND, format!("Response with id '{id}' not found."))
}

/// `GET /v1/responses/{id}`.
async fn get_response(State(s): State<AppState>, Path(id): Path<String>) -> Response {
    match s.responses.get(&id) {
        Some(object) => Json(object).into_response(),
        None => response_not_found(&id),
    }
}

/// `DELETE /v1/responses/{id}`.
async fn delete_response(State(s): State<AppState>, Path(id): Path<String>) -> Response {
    if !s.responses.remove(&id) {
        return response_not_found(&id);
    }
    Json(json!({"id": id, "object": "response", "deleted": true})).into_response()
}

/// The length of the mock's embedding vectors.
const EMBEDDING_DIM: u64 = 8;

/// `POST /v1/embeddings`: one deterministic vector per input (a string, token ids, or a list of either), as floats
/// or, with `encoding_format: "base64"` (the OpenAI SDK's default), as base64 of little-endian `f32`s; the usage
/// counts the inputs' tokens. No rank does any work for it.
async fn embeddings(State(s): State<AppState>, body: Bytes) -> Response {
    let Ok(value) = serde_json::from_slice::<Value>(&body) else {
        return bad("invalid JSON body");
    };
    let ids = |v: &Value| -> Option<Vec<u32>> {
        v.as_array()?
            .iter()
            .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect()
    };
    let inputs: Option<Vec<Vec<u32>>> = match value.get("input") {
        Some(Value::String(text)) => Some(vec![encode(text)]),
        Some(Value::Array(items)) if items.first().is_some_and(Value::is_number) => {
            ids(&value["input"]).map(|i| vec![i])
        }
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| match item {
                Value::String(text) => Some(encode(text)),
                other => ids(other),
            })
            .collect(),
        _ => None,
    };
    let Some(inputs) = inputs.filter(|i| !i.is_empty()) else {
        return bad("`input` must be a string, token ids, or an array of strings or of token-id arrays");
    };
    let base64 = value.get("encoding_format").and_then(Value::as_str) == Some("base64");
    let data: Vec<Value> = inputs
        .iter()
        .enumerate()
        .map(|(i, tokens)| {
            let seed = tokens
                .iter()
                .fold(s.engine.config().seed, |h, &t| mix(h ^ u64::from(t)));
            let vector: Vec<f32> = (0..EMBEDDING_DIM)
                .map(|d| (mix(seed ^ d) % 2001) as f32 / 1000.0 - 1.0)
                .collect();
            let embedding = if base64 {
                use base64::Engine as _;
                let bytes: Vec<u8> = vector.iter().flat_map(|x| x.to_le_bytes()).collect();
                json!(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(vector)
            };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    let tokens: usize = inputs.iter().map(Vec::len).sum();
    let model = value
        .get("model")
        .and_then(Value::as_str)
        .unwrap_or(&s.engine.config().model)
        .to_string();
    Json(json!({
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }))
    .into_response()
}

pub(crate) async fn serve_job(
    s: AppState,
    kind: Kind,
    headers: &HeaderMap,
    body: &[u8],
    prior: Option<String>,
) -> Response {
    let config = s.engine.config();
    let job = match parse_job(kind, config.api, config.tokenizer.as_deref(), headers, body, prior) {
        Ok(job) => job,
        Err(message) => return bad(message),
    };
    if job.tokens.len() >= config.context_length as usize {
        return bad(format!(
            "The input ({} tokens) is longer than the model's context length ({} tokens).",
            job.tokens.len(),
            config.context_length
        ));
    }
    let (leg, rank_override, max_new_tokens) = match disaggregated_leg(&s, &job) {
        Ok(leg) => leg,
        Err(message) => return bad(message),
    };
    let admission = match s.engine.admit(rank_override) {
        Ok(admission) => admission,
        Err(refusal @ Refusal::RankNotActive(_)) => return bad(refusal.to_string()),
        Err(refusal @ Refusal::Internal) => return error(StatusCode::INTERNAL_SERVER_ERROR, refusal.to_string()),
        Err(refusal) => return error(StatusCode::SERVICE_UNAVAILABLE, refusal.to_string()),
    };
    let id = format!("{:016x}{:x}", s.id_prefix, s.next_id.fetch_add(1, Relaxed));
    let (tx, rx) = mpsc::channel(64);
    // Greedy decoding: the same prompt always gets the same answer.
    let seed = job
        .tokens
        .iter()
        .fold(s.engine.config().seed, |h, &t| mix(h ^ u64::from(t)));
    let rank = admission.rank;
    // vLLM's prefill leg names its room in the answer's `kv_transfer_params`.
    let mut kv_transfer_params = None;
    let leg = match leg {
        PendingLeg::Whole => Leg::Whole,
        PendingLeg::Decode(source) => Leg::Decode(source),
        // The room is taken once the request is admitted: a refused request holds none.
        PendingLeg::Prefill(room) => match s.engine.rooms().open(room, admission.rank as u32) {
            Ok(guard) => Leg::Prefill(guard),
            Err(message) => return bad(message),
        },
        PendingLeg::Hand => {
            let room = mix(s.id_prefix ^ mix(admission.request)) & crate::disagg::MAX_ROOM;
            let guard = match s.engine.rooms().open(room, admission.rank as u32) {
                Ok(guard) => guard,
                Err(message) => return bad(message),
            };
            let d = s.engine.config().disaggregation.as_ref();
            kv_transfer_params = Some(json!({
                "do_remote_prefill": true, "do_remote_decode": false,
                "remote_engine_id": format!("{:016x}", s.id_prefix), "remote_block_ids": [admission.rank],
                "remote_host": d.map(|d| d.host.clone()), "remote_port": d.map(|d| d.bootstrap_port),
                "remote_request_id": room.to_string(),
            }));
            Leg::Hand(guard)
        }
    };
    tokio::spawn(Arc::clone(&s.engine).run(admission, job.tokens, max_new_tokens, seed, job.stream, leg, tx));
    let render = Renderer {
        kind: job.kind,
        id,
        model: s.engine.config().model.clone(),
        created: unix_time(),
        rank,
        include_usage: job.include_usage,
        text: String::new(),
        output_ids: Vec::new(),
        prompt_tokens: 0,
        cached_tokens: 0,
        completion_tokens: 0,
        sequence: 0,
        kv_transfer_params,
        tool: job.tool,
        keep: job.keep.map(|prompt| Keep {
            store: Arc::clone(&s.responses),
            prompt,
        }),
    };
    let mut response = if job.stream {
        stream_response(render, rx)
    } else {
        whole_response(render, rx).await
    };
    response
        .headers_mut()
        .insert(SERVED_RANK_HEADER, HeaderValue::from(rank));
    response
}

/// A request's leg, before it is admitted.
enum PendingLeg {
    Whole,
    Prefill(u64),
    Decode(Source),
    /// vLLM's prefill leg: its room is drawn once it is admitted.
    Hand,
}

/// The leg a disaggregated server runs of `job`, the rank it goes to (`None`: the engine's round robin) and the
/// tokens it generates; a request without a room is refused, as SGLang refuses it.
fn disaggregated_leg(s: &AppState, job: &Job) -> Result<(PendingLeg, Option<i64>, u32), String> {
    let Some(d) = &s.engine.config().disaggregation else {
        return Ok((PendingLeg::Whole, job.rank_override, job.max_new_tokens));
    };
    if s.engine.config().api == Api::Vllm {
        return vllm_leg(d, job).map(|leg| (leg, job.rank_override, job.max_new_tokens));
    }
    let room = job
        .room
        .ok_or("Invalid request: Disaggregated request received without bootstrap room id")?;
    match d.mode {
        Mode::Prefill => {
            // `follow_bootstrap_room`: the room's residue is the rank, and a pin that disagrees fails.
            let rank = (room % u64::from(s.engine.config().dp_size)) as i64;
            if let Some(pinned) = job.rank_override.filter(|&r| r != rank) {
                return Err(format!(
                    "routed_dp_rank {pinned} conflicts with bootstrap_room {room}: follow_bootstrap_room puts it on \
                     DP rank {rank}"
                ));
            }
            Ok((PendingLeg::Prefill(room), Some(rank), 1))
        }
        Mode::Decode => {
            let host = job
                .bootstrap_host
                .clone()
                .ok_or("a disaggregated request needs bootstrap_host (its prefill server)")?;
            let source = Source {
                host,
                port: job.bootstrap_port.unwrap_or(d.bootstrap_port),
                room,
                rank: job.prefill_rank,
            };
            Ok((PendingLeg::Decode(source), job.rank_override, job.max_new_tokens))
        }
    }
}

/// The leg a vLLM server in a PD role runs of `job`, by its `kv_transfer_params`: none, a whole request.
fn vllm_leg(d: &crate::disagg::Disaggregation, job: &Job) -> Result<PendingLeg, String> {
    let Some(params) = &job.kv_transfer else {
        return Ok(PendingLeg::Whole);
    };
    let flag = |name: &str| params.get(name).and_then(Value::as_bool) == Some(true);
    match d.mode {
        Mode::Prefill if flag("do_remote_decode") => Ok(PendingLeg::Hand),
        Mode::Decode if flag("do_remote_prefill") => {
            let host = params.get("remote_host").and_then(Value::as_str);
            let port = params
                .get("remote_port")
                .and_then(Value::as_u64)
                .and_then(|p| u16::try_from(p).ok());
            let room = params
                .get("remote_request_id")
                .and_then(Value::as_str)
                .and_then(|r| r.parse::<u64>().ok());
            match (host, port, room) {
                (Some(host), Some(port), Some(room)) => Ok(PendingLeg::Decode(Source {
                    host: host.to_string(),
                    port,
                    room,
                    rank: None,
                })),
                _ => Err(
                    "kv_transfer_params with do_remote_prefill need remote_host, remote_port and \
                          remote_request_id"
                        .into(),
                ),
            }
        }
        _ => Ok(PendingLeg::Whole),
    }
}
