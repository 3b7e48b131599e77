//! Token-exact keys: with the tokenizer of a request's model (config `tokenizer`, or `tokenizers` per model), a
//! text or chat prompt is routed on the token ids the engine will cache, the ids its KV events name, instead of on
//! its bytes ([`dprouter_tokenize`]). Token-id prompts are exact already. A request the tokenizer cannot take
//! (a template that refuses the conversation, a field of an unexpected shape) keeps its byte key: the engine judges
//! the request itself.
//!
//! Tokenizing costs about 200 bytes of memory and 1.5 µs per prompt byte, so the work is bounded twice: a prompt
//! is tokenized up to `tokenize_max_bytes` of its rendering only (a longer one is keyed on that head, and its
//! token count estimated from it; `dprouter_tokenize_cut_total`), and at most one tokenization per core runs at
//! once (others wait their turn). A chat is rendered only as far as that head needs, from the body's own bytes
//! (`ModelTokenizer::chat_head`), and a text prompt is copied only when it holds escapes. Long prompts are
//! tokenized on the blocking pool, off the async runtime.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use dprouter_core::request_body::Api;
use dprouter_core::{Prompt, RouteRequest};
use dprouter_tokenize::{Head, ModelTokenizer};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

use crate::config::GatewayConfig;

/// Bodies longer than this are tokenized on the blocking pool.
const BLOCKING_BYTES: usize = 16 << 10;

/// The tokenizers of the fleet's models.
#[derive(Debug)]
pub struct Tokenizers {
    default: Option<Arc<ModelTokenizer>>,
    by_model: HashMap<String, Arc<ModelTokenizer>>,
    /// The most of a prompt's rendering tokenized, bytes.
    max_bytes: usize,
    /// One permit per tokenization at once.
    running: Arc<tokio::sync::Semaphore>,
}

impl Default for Tokenizers {
    fn default() -> Self {
        Self {
            default: None,
            by_model: HashMap::new(),
            max_bytes: GatewayConfig::default().tokenize_max_bytes,
            running: Arc::new(tokio::sync::Semaphore::new(concurrency())),
        }
    }
}

/// Tokenizations at once: one per core the process may use.
fn concurrency() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

impl Tokenizers {
    /// Loads every tokenizer the config names.
    pub fn load(config: &GatewayConfig) -> Result<Self, String> {
        let load = |path: &std::path::Path| ModelTokenizer::load(path).map(Arc::new);
        Ok(Self {
            default: config.tokenizer.as_deref().map(load).transpose()?,
            by_model: config
                .tokenizers
                .iter()
                .map(|(model, path)| Ok((model.clone(), load(path)?)))
                .collect::<Result<_, String>>()?,
            max_bytes: config.tokenize_max_bytes,
            running: Arc::new(tokio::sync::Semaphore::new(concurrency())),
        })
    }

    /// The tokenizer of `model` (the served name), else the default one.
    pub fn for_model(&self, model: Option<&str>) -> Option<Arc<ModelTokenizer>> {
        model
            .and_then(|m| self.by_model.get(m))
            .or(self.default.as_ref())
            .cloned()
    }

    pub fn is_empty(&self) -> bool {
        self.default.is_none() && self.by_model.is_empty()
    }
}

/// The members a text or chat prompt comes from.
#[derive(Deserialize)]
struct TextFields<'a> {
    /// Anthropic's Messages: the system prompt.
    #[serde(borrow)]
    system: Option<&'a RawValue>,
    #[serde(borrow)]
    messages: Option<&'a RawValue>,
    #[serde(borrow)]
    tools: Option<&'a RawValue>,
    #[serde(borrow)]
    prompt: Option<&'a RawValue>,
    #[serde(borrow)]
    text: Option<&'a RawValue>,
}

/// The token ids of a body's text or chat prompt (its head of `max_bytes`), if the tokenizer takes it. The members
/// are read as slices of the body: a chat is rendered only as far as its head needs, and a text prompt is copied
/// only when it holds escapes.
fn token_ids(tokenizer: &ModelTokenizer, (body, api): (&[u8], Api), max_bytes: usize) -> Option<Head> {
    let fields: TextFields<'_> = serde_json::from_slice(body).ok()?;
    let ids = if api == Api::Messages {
        // Rendered as the engine renders it: its chat completion, through the model's template.
        let value = |raw: Option<&RawValue>| present(raw).and_then(|r| serde_json::from_str::<Value>(r.get()).ok());
        let messages = value(fields.messages)?;
        let chat =
            dprouter_core::anthropic::to_chat(value(fields.system).as_ref(), &messages, value(fields.tools).as_ref())
                .ok()?;
        let messages = RawValue::from_string(chat.messages.to_string()).ok()?;
        let tools = chat.tools.and_then(|t| RawValue::from_string(t.to_string()).ok());
        tokenizer.chat_head(&messages, tools.as_deref(), max_bytes)
    } else if let Some(messages) = present(fields.messages) {
        tokenizer.chat_head(messages, present(fields.tools), max_bytes)
    } else {
        // SGLang's `text`, then a completion's `prompt`, when it is one string (or one string in a list).
        let raw = present(fields.text).or(fields.prompt)?;
        let text = match serde_json::from_str::<Cow<'_, str>>(raw.get()) {
            Ok(text) => text,
            Err(_) => {
                let [one]: [Cow<'_, str>; 1] = serde_json::from_str::<Vec<Cow<'_, str>>>(raw.get())
                    .ok()?
                    .try_into()
                    .ok()?;
                one
            }
        };
        tokenizer.text_head(&text, max_bytes)
    };
    match ids {
        Ok(ids) => Some(ids),
        Err(e) => {
            tracing::debug!(error = %e, "the tokenizer did not take the prompt: routing on its bytes");
            None
        }
    }
}

/// A member that is there and not `null`.
fn present(raw: Option<&RawValue>) -> Option<&RawValue> {
    raw.filter(|r| r.get() != "null")
}

/// Makes `route`'s prompt the token ids of the body's text or chat prompt (see the module documentation).
pub async fn exact_prompt(
    tokenizers: &Tokenizers,
    tokenizer: Arc<ModelTokenizer>,
    (body, api): (&Bytes, Api),
    route: &mut RouteRequest,
) {
    if !matches!(route.prompt, Prompt::Bytes(_)) {
        return;
    }
    let Ok(_turn) = Arc::clone(&tokenizers.running).acquire_owned().await else {
        return;
    };
    let max_bytes = tokenizers.max_bytes;
    let head = if body.len() > BLOCKING_BYTES {
        let body = body.clone();
        tokio::task::spawn_blocking(move || token_ids(&tokenizer, (&body, api), max_bytes))
            .await
            .ok()
            .flatten()
    } else {
        token_ids(&tokenizer, (body, api), max_bytes)
    };
    if let Some(head) = head {
        if head.cut {
            metrics::counter!(crate::observe::telemetry::TOKENIZE_CUT).increment(1);
        }
        route.input_tokens = head.total.max(head.ids.len() as u64);
        route.prompt = Prompt::Tokens(head.ids);
    }
}
