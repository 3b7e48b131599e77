//! The HTTP benchmark driver: replays a simulator [`Workload`] against a live server (a mock or real SGLang
//! engine, or a dprouter gateway in front of engines) in scaled real time, measuring TTFT from the response stream.
//!
//! Requests go to `POST /generate` with `input_ids`, `stream: true` ([`Api::Generate`], SGLang's native API), or to
//! `POST /v1/completions` with the token ids as the `prompt` ([`Api::Completions`], any OpenAI-compatible server:
//! vLLM, llama.cpp, SGLang), or to `POST /v1/chat/completions` with one user message whose words stand for the
//! token ids ([`Api::Chat`]), or to Anthropic's `POST /v1/messages` the same way ([`Api::Messages`]). TTFT is the
//! time to the first event that carries output (SGLang's first event, the first completion chunk with text, the
//! first chat chunk with content, the first text delta). Cached tokens come from the engine's usage report,
//! whichever form it takes ([`UsageScanner`]). A completion's output token ids are not returned by OpenAI servers,
//! so a closed-loop workload's next turn carries the simulator's output tokens for it instead of the engine's: the
//! engine's cache still holds the previous prompt, not the previous answer.
//! Arrivals and think times are the workload's virtual times multiplied by `time_scale`, and measured times are
//! divided by it, so results compare one to one with `dprouter simulate` on the same workload. With
//! [`Routing::Client`] the driver itself routes with a core policy and pins the rank (`routed_dp_rank`): the engine
//! is measured alone, and the policy gets its feedback as in the gateway and the simulator, through the request's
//! [`Ticket`]: the first token when the first event arrives, the engine's usage report as soon as it is read.
//! With [`Routing::Server`] requests go out unpinned and the target (a gateway) routes.
//!
//! The outcome is the simulator's own [`SimOutcome`], so [`dprouter_sim::Summary`] reports both the same way.
//! A stop signal (Ctrl-C in `dprouter bench`) ends a run early: no request is sent after it, the ones in flight are
//! abandoned (their tasks aborted, not counted as errors), and the outcome holds what completed before it.
//! [`plot`] draws the outcomes of a run as one SVG figure.

use std::collections::HashMap;
use std::time::Duration;

pub mod plot;

use bytes::Bytes;
use dprouter_core::{dispatch, Policy, RouteRequest, Snapshot, Ticket, Usage, UsageScanner};
use dprouter_sim::{Micros, RequestRecord, SimOutcome, SimRequest, Workload, WorkloadError};
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

/// Who chooses each request's rank.
pub enum Routing<'a> {
    /// The driver routes with `policy` over `dp_size` ranks and pins the choice with `routed_dp_rank`.
    Client { policy: &'a dyn Policy, dp_size: u32 },
    /// Requests go out unpinned; the target routes.
    Server,
}

/// Which API the requests use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Api {
    /// SGLang's `POST /generate` with `input_ids`.
    Generate,
    /// `POST /v1/completions` with the token ids as `prompt`, naming `model`; with `vocab`, every id is mapped into
    /// `256..vocab` (`256 + id % (vocab - 256)`: the workload's ids come from a 151,936-token vocabulary, a smaller
    /// model refuses ids it does not have, and the first ids are often special tokens). Prompts that share a
    /// prefix still do.
    Completions { model: String, vocab: Option<u32> },
    /// `POST /v1/chat/completions` naming `model`, with one user message: a word per token id of the prompt
    /// ([`words`]), so prompts that share a prefix of ids share a prefix of text, and the engine's chat template and
    /// tokenizer make of it what they make of any chat.
    Chat { model: String },
    /// Anthropic's `POST /v1/messages` naming `model`, with one user message as [`Api::Chat`]'s: any
    /// Anthropic-compatible server (vLLM, SGLang, a gateway in front of them); TTFT at the first text delta, the
    /// stream's end at `message_stop`.
    Messages { model: String },
}

/// Three lowercase letters per token id (17,576 words), space-separated: a text that grows as the ids do.
pub fn words(ids: &[u32]) -> String {
    let mut text = String::with_capacity(ids.len() * 4);
    for &id in ids {
        let n = id % (26 * 26 * 26);
        for letter in [n / 676, n / 26 % 26, n % 26] {
            text.push(char::from(b'a' + letter as u8));
        }
        text.push(' ');
    }
    text
}

/// The header that names a request's session when its workload does ([`SimRequest::named_session`]): one the
/// gateway reads as a session (docs/gateway.md).
pub const SESSION_HEADER: &str = "x-session-id";

/// The lowest token id a mapped prompt uses.
const FIRST_MAPPED_ID: u32 = 256;

pub struct BenchConfig<'a> {
    /// Base URL of the target, e.g. `http://127.0.0.1:30000`; several, comma-separated, share the requests (request
    /// `i` to the `i mod n`-th).
    pub target: String,
    pub api: Api,
    /// The workload's seed (a completion's stand-in output tokens).
    pub seed: u64,
    /// Real seconds per virtual second.
    pub time_scale: f64,
    pub routing: Routing<'a>,
    /// Headers to send with each request (a tenant's fairness id, an objective), chosen per request.
    pub headers: Option<&'a Tagger>,
}

/// Chooses a request's extra headers from the request.
pub type Tagger = dyn Fn(&SimRequest) -> Vec<(&'static str, String)> + Sync;

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(transparent)]
    Workload(#[from] WorkloadError),
    #[error("invalid target URL {0}")]
    Target(String),
}

/// What one request's task reports back.
enum Report {
    /// The first event of request `id` arrived.
    FirstToken {
        id: u64,
        at: Instant,
    },
    /// The engine's usage report of request `id` was read.
    Usage {
        id: u64,
        usage: Usage,
    },
    Finished(Finished),
}

struct Finished {
    req: SimRequest,
    rank: usize,
    /// A failure's status (when a response came) and what went wrong.
    result: Result<Measured, (Option<u16>, String)>,
}

struct Measured {
    first_token: Instant,
    finish: Instant,
    cached_tokens: usize,
    /// The rank that served it, as the engine says (SGLang's `meta_info.dp_rank`, the mock's `x-dp-rank`).
    served_rank: Option<usize>,
    /// The endpoint that served it, as a gateway says (`x-dprouter-endpoint`).
    served_endpoint: Option<String>,
    output_ids: Vec<u32>,
}

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// The result of [`run`].
#[derive(Debug, Clone, Default)]
pub struct BenchOutcome {
    /// The requests that completed (all of them, unless the run was stopped).
    pub outcome: SimOutcome,
    /// Set when the stop signal ended the run before the workload did.
    pub stopped: Option<Stopped>,
    /// The requests that failed (`outcome.errors` of them), in the order they ended.
    pub failures: Vec<Failure>,
}

/// A request that did not complete.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub id: u64,
    pub group: u64,
    pub session: u64,
    /// The response's status when one came (a refusal: 429, 503), `None` for a broken exchange.
    pub status: Option<u16>,
    pub message: String,
}

/// How a stopped run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stopped {
    /// Real time from the start of the run to the stop.
    pub after: Duration,
    /// Requests in flight at the stop, abandoned: neither records nor errors.
    pub cut_off: usize,
}

/// Replays `workload` against the target until every request has finished, or until `stop` holds `true` (a sender
/// dropped without ever sending `true` never stops the run). Failed requests count as errors. `on_progress` is
/// called with the number of requests finished so far (completed or failed) after each one.
pub async fn run(
    workload: &mut dyn Workload,
    config: &BenchConfig<'_>,
    mut stop: watch::Receiver<bool>,
    on_progress: &mut dyn FnMut(usize),
) -> Result<BenchOutcome, BenchError> {
    let path = match config.api {
        Api::Generate => "/generate",
        Api::Completions { .. } => "/v1/completions",
        Api::Chat { .. } => "/v1/chat/completions",
        Api::Messages { .. } => "/v1/messages",
    };
    // Several targets (comma-separated): request `i` goes to target `i mod n`, as a load balancer in front of
    // gateway replicas would spread them.
    let urls: Vec<hyper::Uri> = config
        .target
        .split(',')
        .map(|target| {
            format!("{}{path}", target.trim().trim_end_matches('/'))
                .parse()
                .map_err(|_| BenchError::Target(target.to_string()))
        })
        .collect::<Result<_, _>>()?;
    // Endpoints named by a gateway (`x-dprouter-endpoint`), numbered as they are first seen.
    let mut endpoints: HashMap<String, usize> = HashMap::new();
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let client: HttpClient = Client::builder(TokioExecutor::new()).build(connector);
    let snapshot = match config.routing {
        Routing::Client { dp_size, .. } => Snapshot::single_worker(dp_size),
        Routing::Server => Snapshot::default(),
    };
    let scale = config.time_scale.max(1e-9);
    let start = Instant::now();
    let to_virtual = |t: Instant| (t.saturating_duration_since(start).as_secs_f64() / scale * 1e6) as Micros;
    let to_real = |v: Micros| start + Duration::from_secs_f64(v as f64 / 1e6 * scale);

    let (done_tx, mut done_rx) = mpsc::unbounded_channel::<Report>();
    let mut outcome = SimOutcome {
        routed_per_rank: vec![0; snapshot.len()],
        ..SimOutcome::default()
    };
    let mut tickets: HashMap<u64, Ticket<&dyn Policy>> = HashMap::new();
    let mut in_flight = 0usize;
    // The request tasks: dropping the set aborts whatever is still in flight.
    let mut tasks = JoinSet::new();
    let mut stopped = None;
    let mut failures = Vec::new();
    let stop_signal = async move {
        if stop.wait_for(|s| *s).await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    tokio::pin!(stop_signal);
    // Closed-loop follow-ups wait here for their arrival time, ordered by it.
    let mut delayed: Vec<SimRequest> = Vec::new();
    let mut next_open = workload.next_arrival();

    loop {
        // The earliest pending arrival: the next open-loop one or a delayed follow-up.
        delayed.sort_by_key(|r| std::cmp::Reverse(r.arrival));
        let due = match (&next_open, delayed.last()) {
            (Some(a), Some(b)) => Some(a.arrival.min(b.arrival)),
            (Some(a), None) => Some(a.arrival),
            (None, Some(b)) => Some(b.arrival),
            (None, None) => None,
        };
        if due.is_none() && in_flight == 0 {
            break;
        }
        let sleep = async {
            match due {
                Some(v) => tokio::time::sleep_until(to_real(v)).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            () = &mut stop_signal => {
                stopped = Some(Stopped {
                    after: start.elapsed(),
                    cut_off: in_flight,
                });
                break;
            }
            _ = sleep => {
                let req = match (&next_open, delayed.last()) {
                    (Some(a), Some(b)) if b.arrival < a.arrival => delayed.pop(),
                    (Some(_), _) => {
                        let req = next_open.take();
                        next_open = workload.next_arrival();
                        req
                    }
                    (None, Some(_)) => delayed.pop(),
                    (None, None) => None,
                };
                let Some(req) = req else { continue };
                let mut body = match &config.api {
                    Api::Generate => json!({
                        "input_ids": req.tokens,
                        "sampling_params": {"max_new_tokens": req.output_tokens, "ignore_eos": true},
                        "stream": true,
                    }),
                    Api::Completions { model, vocab } => json!({
                        "model": model,
                        "prompt": match vocab {
                            Some(v) if *v > FIRST_MAPPED_ID => req
                                .tokens
                                .iter()
                                .map(|&id| FIRST_MAPPED_ID + id % (v - FIRST_MAPPED_ID))
                                .collect(),
                            _ => req.tokens.clone(),
                        },
                        "max_tokens": req.output_tokens,
                        "ignore_eos": true,
                        "temperature": 0,
                        "stream": true,
                        "stream_options": {"include_usage": true},
                    }),
                    Api::Chat { model } => json!({
                        "model": model,
                        "messages": [{"role": "user", "content": words(&req.tokens)}],
                        "max_tokens": req.output_tokens,
                        "ignore_eos": true,
                        "temperature": 0,
                        "stream": true,
                        "stream_options": {"include_usage": true},
                    }),
                    Api::Messages { model } => json!({
                        "model": model,
                        "messages": [{"role": "user", "content": words(&req.tokens)}],
                        "max_tokens": req.output_tokens,
                        "temperature": 0,
                        "stream": true,
                    }),
                };
                let mut rank = 0;
                if let Routing::Client { policy, .. } = config.routing {
                    let mut route_req = RouteRequest::tokens(req.tokens.clone()).at(to_virtual(Instant::now()));
                    if req.named_session {
                        route_req = route_req.with_session(&req.session.to_string());
                    }
                    match dispatch(policy, &snapshot, route_req) {
                        Ok(ticket) => {
                            rank = ticket.pick.rank;
                            body["routed_dp_rank"] = json!(rank);
                            tickets.insert(req.id, ticket);
                        }
                        Err(e) => {
                            outcome.errors += 1;
                            failures.push(Failure { id: req.id, group: req.group, session: req.session, status: None, message: e.to_string() });
                            on_progress(outcome.records.len() + outcome.errors as usize);
                            continue;
                        }
                    }
                }
                let mut headers = config.headers.map(|tag| tag(&req)).unwrap_or_default();
                if let Api::Messages { .. } = config.api {
                    headers.push(("anthropic-version", "2023-06-01".into()));
                }
                if req.named_session {
                    // An agent names its session, as Claude Code's `x-claude-code-session-id` does.
                    headers.push((SESSION_HEADER, req.session.to_string()));
                }
                in_flight += 1;
                let url = urls[(req.id % urls.len() as u64) as usize].clone();
                let (client, tx, api) = (client.clone(), done_tx.clone(), config.api.clone());
                let stand_in = match api {
                    Api::Generate => None,
                    Api::Completions { .. } | Api::Chat { .. } | Api::Messages { .. } => {
                        Some(dprouter_sim::tokens::output(config.seed, req.id, req.output_tokens as usize))
                    }
                };
                tasks.spawn(async move {
                    let result = send(&client, url, body, headers, req.id, &tx, stand_in).await;
                    let _ = tx.send(Report::Finished(Finished { req, rank, result }));
                });
            }
            Some(report) = done_rx.recv() => {
                let done = match report {
                    Report::FirstToken { id, at } => {
                        if let Some(ticket) = tickets.get_mut(&id) {
                            ticket.first_token(to_virtual(at));
                        }
                        continue;
                    }
                    Report::Usage { id, usage } => {
                        if let Some(ticket) = tickets.get_mut(&id) {
                            ticket.usage(usage);
                        }
                        continue;
                    }
                    Report::Finished(done) => done,
                };
                in_flight -= 1;
                if let Some(ticket) = tickets.remove(&done.req.id) {
                    match &done.result {
                        Ok(m) => ticket.end(to_virtual(m.finish), done.req.tool_call),
                        Err(_) => drop(ticket),
                    }
                }
                // Reap finished tasks so the set stays as small as the requests in flight.
                while tasks.try_join_next().is_some() {}
                let measured = match done.result {
                    Ok(m) => m,
                    Err((status, message)) => {
                        failures.push(Failure {
                            id: done.req.id,
                            group: done.req.group,
                            session: done.req.session,
                            status,
                            message,
                        });
                        outcome.errors += 1;
                        on_progress(outcome.records.len() + outcome.errors as usize);
                        continue;
                    }
                };
                let rank = match (&measured.served_endpoint, measured.served_rank) {
                    (Some(label), _) => {
                        let next = endpoints.len();
                        *endpoints.entry(label.clone()).or_insert(next)
                    }
                    (None, Some(rank)) => rank,
                    (None, None) => done.rank,
                };
                if outcome.routed_per_rank.len() <= rank {
                    outcome.routed_per_rank.resize(rank + 1, 0);
                }
                outcome.routed_per_rank[rank] += 1;
                let finish = to_virtual(measured.finish);
                outcome.records.push(RequestRecord {
                    id: done.req.id,
                    group: done.req.group,
                    session: done.req.session,
                    rank,
                    branch: dprouter_core::Branch::Turn,
                    arrival: done.req.arrival,
                    first_token: to_virtual(measured.first_token).max(done.req.arrival),
                    finish: finish.max(done.req.arrival),
                    prompt_tokens: done.req.tokens.len(),
                    cached_tokens: measured.cached_tokens,
                    predicted_cached: None,
                    floor: None,
                });
                delayed.extend(workload.on_finish(&done.req, &measured.output_ids, finish));
                on_progress(outcome.records.len() + outcome.errors as usize);
            }
        }
    }
    tasks.abort_all();
    if let Some(err) = workload.take_error() {
        return Err(err.into());
    }
    Ok(BenchOutcome {
        outcome,
        stopped,
        failures,
    })
}

/// Sends one streaming request and reads it to the end, reporting its first token and its usage report on
/// `reports` as they arrive. `stand_in` is the output a completion's answer stands for (`None`: SGLang's
/// `/generate`, whose last event carries the output ids).
async fn send(
    client: &HttpClient,
    url: hyper::Uri,
    body: Value,
    headers: Vec<(&'static str, String)>,
    id: u64,
    reports: &mpsc::UnboundedSender<Report>,
    stand_in: Option<Vec<u32>>,
) -> Result<Measured, (Option<u16>, String)> {
    let mut request = Request::post(url).header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(name, value);
    }
    let request = request
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| (None, e.to_string()))?;
    let mut response = client.request(request).await.map_err(|e| (None, e.to_string()))?;
    if response.status() != StatusCode::OK {
        let status = response.status();
        return Err((Some(status.as_u16()), format!("status {status}")));
    }
    let broken = |e: String| (None, e);
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let served_endpoint = header("x-dprouter-endpoint");
    let header_rank = header("x-dp-rank").and_then(|r| r.parse::<usize>().ok());
    let mut first_token = None;
    let mut buffer = Vec::new();
    let mut scanner = UsageScanner::new(true);
    let mut usage = None;
    while let Some(frame) = response.body_mut().frame().await {
        let frame = frame.map_err(|e| broken(e.to_string()))?;
        if let Ok(data) = frame.into_data() {
            buffer.extend_from_slice(&data);
            if first_token.is_none() && has_output(&buffer, stand_in.is_none()) {
                let at = Instant::now();
                first_token = Some(at);
                let _ = reports.send(Report::FirstToken { id, at });
            }
            if let Some(u) = scanner.feed(&data) {
                usage = Some(u);
                let _ = reports.send(Report::Usage { id, usage: u });
            }
        }
    }
    let finish = Instant::now();
    let text = String::from_utf8_lossy(&buffer);
    // OpenAI's and SGLang's streams end with `[DONE]`, Anthropic's with a `message_stop` event.
    let ended = text.trim_end().ends_with("data: [DONE]") || text.contains("\"type\":\"message_stop\"");
    if !ended {
        return Err(broken("the stream ended without [DONE] or message_stop".into()));
    }
    // Each event's data line (an Anthropic event has its `event:` line first).
    let last: Value = text
        .split("\n\n")
        .filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: ")))
        .filter(|e| *e != "[DONE]")
        .last()
        .and_then(|e| serde_json::from_str(e).ok())
        .ok_or_else(|| broken("no data events".into()))?;
    let meta = &last["meta_info"];
    let output_ids = match stand_in {
        Some(ids) => ids,
        None => last["output_ids"]
            .as_array()
            .map(|ids| ids.iter().filter_map(|v| v.as_u64().map(|id| id as u32)).collect())
            .unwrap_or_default(),
    };
    Ok(Measured {
        first_token: first_token.unwrap_or(finish),
        finish,
        cached_tokens: usage.map_or(0, |u| u.cached_tokens as usize),
        served_rank: meta["dp_rank"].as_u64().map(|r| r as usize).or(header_rank),
        served_endpoint,
        output_ids,
    })
}

/// Whether the stream so far holds a complete event with output: any event for SGLang's `/generate`; a
/// completion chunk with non-empty `text`, a chat chunk with non-empty `delta.content`, or an Anthropic text delta,
/// otherwise (the first chunks of some servers carry none: a chat's first says only the role).
fn has_output(buffer: &[u8], any_event: bool) -> bool {
    let text = String::from_utf8_lossy(buffer);
    // Complete events only: those before the last blank line.
    let complete = text.rfind("\n\n").map_or("", |end| &text[..end]);
    complete
        .split("\n\n")
        .filter_map(|e| e.lines().find_map(|l| l.trim().strip_prefix("data:")).map(str::trim))
        .filter(|e| *e != "[DONE]")
        .any(|e| {
            any_event
                || serde_json::from_str::<Value>(e)
                    .ok()
                    .and_then(|v| {
                        let choice = &v["choices"][0];
                        let text = choice["text"]
                            .as_str()
                            .or(choice["delta"]["content"].as_str())
                            // Anthropic's `content_block_delta`.
                            .or(v["delta"]["text"].as_str());
                        text.map(|t| !t.is_empty())
                    })
                    .unwrap_or(false)
        })
}
