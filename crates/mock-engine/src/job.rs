//! A generation request as the mock engine reads it: its prompt in tokens (the gateway's own parser reads the
//! prompt and the rank override: [`parse_body_as`], token ids straight into integers, never a tree of the whole
//! body; a chat or a Messages request through the model's template when the engine has one), its length, its
//! streaming and disaggregation fields.

use axum::http::HeaderMap;
use dprouter_core::request_body::{parse_body_as, Api as BodyApi};
use dprouter_core::Prompt;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

use crate::engine::Api;
use crate::render::Kind;
use crate::tokenizer::encode;

/// One generation request, parsed.
pub(crate) struct Job {
    pub(crate) kind: Kind,
    pub(crate) tokens: Vec<u32>,
    pub(crate) max_new_tokens: u32,
    pub(crate) stream: bool,
    pub(crate) include_usage: bool,
    pub(crate) rank_override: Option<i64>,
    /// Responses: the prompt text, when the answer is to be stored.
    pub(crate) keep: Option<String>,
    /// The disaggregation fields: `bootstrap_room`, `bootstrap_host`, `bootstrap_port`, `disagg_prefill_dp_rank`.
    pub(crate) room: Option<u64>,
    pub(crate) bootstrap_host: Option<String>,
    pub(crate) bootstrap_port: Option<u16>,
    pub(crate) prefill_rank: Option<u32>,
    /// vLLM's `kv_transfer_params`.
    pub(crate) kv_transfer: Option<Value>,
    /// Messages: the tool the request forces, which the answer calls.
    pub(crate) tool: Option<String>,
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
