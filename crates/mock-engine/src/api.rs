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
use dprouter_core::request_body::{parse_body_as, Api as BodyApi};
use dprouter_core::Prompt;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::disagg::{Mode, Source};
use crate::engine::{Api, Engine, Leg, Refusal};
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
        .route("/v1/messages", post(crate::messages::messages))
        .route("/v1/messages/count_tokens", post(crate::messages::count_tokens))
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

/// One generation request, parsed.
pub(crate) struct Job {
    kind: Kind,
    pub(crate) tokens: Vec<u32>,
    max_new_tokens: u32,
    stream: bool,
    include_usage: bool,
    rank_override: Option<i64>,
    /// Responses: the prompt text, when the answer is to be stored.
    keep: Option<String>,
    /// The disaggregation fields: `bootstrap_room`, `bootstrap_host`, `bootstrap_port`, `disagg_prefill_dp_rank`.
    room: Option<u64>,
    bootstrap_host: Option<String>,
    bootstrap_port: Option<u16>,
    prefill_rank: Option<u32>,
    /// vLLM's `kv_transfer_params`.
    kv_transfer: Option<Value>,
    /// Messages: the tool the request forces, which the answer calls.
    tool: Option<String>,
}

fn bad(message: impl Into<String>) -> Response {
    error(StatusCode::BAD_REQUEST, message)
}

/// The members a generation request is read for besides its prompt, as slices of the body (the prompt and the rank
/// override are read by the gateway's own parser, [`parse_body`]: token ids straight into integers, never a tree
/// of the whole body).
#[derive(Deserialize)]
struct Members<'a> {
    #[serde(borrow)]
    messages: Option<&'a RawValue>,
    #[serde(borrow)]
    tools: Option<&'a RawValue>,
    /// Messages: the system prompt and the tool choice.
    #[serde(borrow)]
    system: Option<&'a RawValue>,
    #[serde(borrow)]
    tool_choice: Option<&'a RawValue>,
    #[serde(borrow)]
    instructions: Option<&'a RawValue>,
    #[serde(borrow)]
    input: Option<&'a RawValue>,
    #[serde(borrow)]
    sampling_params: Option<&'a RawValue>,
    #[serde(borrow)]
    max_completion_tokens: Option<&'a RawValue>,
    #[serde(borrow)]
    max_tokens: Option<&'a RawValue>,
    #[serde(borrow)]
    max_output_tokens: Option<&'a RawValue>,
    #[serde(borrow)]
    stream: Option<&'a RawValue>,
    #[serde(borrow)]
    stream_options: Option<&'a RawValue>,
    #[serde(borrow)]
    store: Option<&'a RawValue>,
    #[serde(borrow)]
    bootstrap_host: Option<&'a RawValue>,
    #[serde(borrow)]
    bootstrap_port: Option<&'a RawValue>,
    #[serde(borrow)]
    disagg_prefill_dp_rank: Option<&'a RawValue>,
    #[serde(borrow)]
    kv_transfer_params: Option<&'a RawValue>,
}

/// A member's value, when it is there and not `null`.
fn present(raw: Option<&RawValue>) -> Option<Value> {
    raw.filter(|r| r.get() != "null")
        .and_then(|r| serde_json::from_str(r.get()).ok())
}

/// Parses a generation request; `prior` is the conversation a Responses request continues.
pub(crate) fn parse_job(
    kind: Kind,
    api: Api,
    tokenizer: Option<&dprouter_tokenize::ModelTokenizer>,
    headers: &HeaderMap,
    body: &[u8],
    prior: Option<String>,
) -> Result<Job, String> {
    let body_api = if kind == Kind::Messages {
        BodyApi::Messages
    } else {
        BodyApi::OpenAi
    };
    let req = parse_body_as(body, api == Api::Sglang, body_api)
        .map_err(|e| e.to_string())?
        .route;
    let room = req.bootstrap_room;
    let members: Members<'_> = serde_json::from_slice(body).map_err(|e| format!("invalid JSON body: {e}"))?;
    let mut responses_prompt = None;
    let tokens = match (req.prompt, kind, tokenizer) {
        (Prompt::Tokens(ids), _, _) => ids,
        // With a model's tokenizer: its chat template, and its tokens, as an engine serving the model has them.
        (Prompt::Bytes(_), Kind::Chat, Some(t)) => {
            let messages = present(members.messages).unwrap_or(Value::Null);
            t.chat_ids(&messages, present(members.tools).as_ref())?
        }
        // A Messages request is the chat completion the engines make of it, through the model's template.
        (Prompt::Bytes(_), Kind::Messages, Some(t)) => {
            let messages = present(members.messages).unwrap_or(Value::Null);
            let (system, tools) = (present(members.system), present(members.tools));
            let chat = dprouter_core::anthropic::to_chat(system.as_ref(), &messages, tools.as_ref())
                .map_err(|e| e.to_string())?;
            t.chat_ids(&chat.messages, chat.tools.as_ref())?
        }
        (Prompt::Bytes(b), Kind::Generate | Kind::Completion, Some(t)) => t.text_ids(&String::from_utf8_lossy(&b))?,
        (Prompt::Bytes(b), Kind::Responses, _) => {
            // The conversation so far, then the request rendered as a chat (a lone string input is the user's
            // message), then the generation prompt.
            let chat = present(members.instructions).is_some()
                || present(members.tools).is_some()
                || !members.input.is_some_and(|i| i.get().starts_with('"'));
            let text = String::from_utf8_lossy(&b);
            let prompt = if chat {
                format!("{}{text}<|assistant|>\n", prior.unwrap_or_default())
            } else {
                format!("{}<|user|>\n{text}\n<|assistant|>\n", prior.unwrap_or_default())
            };
            let tokens = encode(&prompt);
            responses_prompt = Some(prompt);
            tokens
        }
        // The fixed chat template: the canonical rendering (the prompt's bytes) plus the generation prompt.
        (Prompt::Bytes(mut b), Kind::Chat | Kind::Messages, None) => {
            b.extend_from_slice(b"<|assistant|>\n");
            encode(&String::from_utf8_lossy(&b))
        }
        (Prompt::Bytes(b), _, _) => encode(&String::from_utf8_lossy(&b)),
    };
    let max = match kind {
        Kind::Generate => present(members.sampling_params).and_then(|p| p.get("max_new_tokens").cloned()),
        Kind::Chat => present(members.max_completion_tokens).or(present(members.max_tokens)),
        Kind::Messages => present(members.max_tokens),
        Kind::Completion => present(members.max_tokens),
        Kind::Responses => present(members.max_output_tokens),
    };
    let max_new_tokens = match max.filter(|v| !v.is_null()) {
        None => {
            if kind == Kind::Completion {
                16
            } else {
                128
            }
        }
        Some(v) => v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .filter(|&n| n >= 1)
            .ok_or("the maximum number of new tokens must be an integer >= 1")?,
    };
    let rank_override = match api {
        Api::Sglang => {
            let header = headers.get("x-data-parallel-rank").filter(|_| kind != Kind::Generate);
            match header {
                Some(h) => Some(
                    h.to_str()
                        .ok()
                        .and_then(|s| s.trim().parse::<i64>().ok())
                        .ok_or("X-Data-Parallel-Rank must be an integer")?,
                ),
                None => req.rank_override,
            }
        }
        // vLLM reads only the header and ignores a value it cannot parse.
        Api::Vllm => headers
            .get("x-data-parallel-rank")
            .and_then(|h| h.to_str().ok())
            .and_then(|s| s.trim().parse::<i64>().ok()),
    };
    let flag = |raw: Option<&RawValue>| present(raw).and_then(|v| v.as_bool());
    let tool = match kind {
        Kind::Messages => {
            crate::messages::forced_tool(present(members.tool_choice).as_ref(), present(members.tools).as_ref())
        }
        _ => None,
    };
    Ok(Job {
        tool,
        kind,
        tokens,
        max_new_tokens,
        stream: flag(members.stream).unwrap_or(false),
        // Stored unless `"store": false`.
        keep: responses_prompt.filter(|_| flag(members.store) != Some(false)),
        include_usage: present(members.stream_options)
            .and_then(|o| o.get("include_usage")?.as_bool())
            .unwrap_or(false),
        rank_override,
        room,
        bootstrap_host: present(members.bootstrap_host)
            .map(|v| v.as_str().map(str::to_owned).ok_or("bootstrap_host must be a string"))
            .transpose()?,
        bootstrap_port: present(members.bootstrap_port)
            .map(|v| {
                v.as_u64()
                    .and_then(|p| u16::try_from(p).ok())
                    .ok_or("bootstrap_port must be a port number")
            })
            .transpose()?,
        kv_transfer: present(members.kv_transfer_params),
        prefill_rank: present(members.disagg_prefill_dp_rank)
            .map(|v| {
                v.as_u64()
                    .and_then(|r| u32::try_from(r).ok())
                    .ok_or("disagg_prefill_dp_rank must be a rank")
            })
            .transpose()?,
    })
}

async fn generate(State(s): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    serve_job(s, Kind::Generate, &headers, &body, None).await
}

async fn chat_completions(State(s): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    serve_job(s, Kind::Chat, &headers, &body, None).await
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
