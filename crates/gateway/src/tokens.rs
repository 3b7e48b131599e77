//! Token-exact keys: with the tokenizer of a request's model (config `tokenizer`, or `tokenizers` per model), a
//! text or chat prompt is routed on the token ids the engine will cache, the ids its KV events name, instead of on
//! its bytes ([`dprouter_tokenize`]). Token-id prompts are exact already. A request the tokenizer cannot take
//! (a template that refuses the conversation, a field of an unexpected shape) keeps its byte key: the engine judges
//! the request itself. Long prompts are tokenized on the blocking pool, off the async runtime.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use dprouter_core::{Prompt, RouteRequest};
use dprouter_tokenize::ModelTokenizer;
use serde::Deserialize;
use serde_json::value::RawValue;

use crate::config::GatewayConfig;

/// Bodies longer than this are tokenized on the blocking pool.
const BLOCKING_BYTES: usize = 16 << 10;

/// The tokenizers of the fleet's models.
#[derive(Debug, Default)]
pub struct Tokenizers {
    default: Option<Arc<ModelTokenizer>>,
    by_model: HashMap<String, Arc<ModelTokenizer>>,
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
    #[serde(borrow)]
    messages: Option<&'a RawValue>,
    #[serde(borrow)]
    tools: Option<&'a RawValue>,
    #[serde(borrow)]
    prompt: Option<&'a RawValue>,
    #[serde(borrow)]
    text: Option<&'a RawValue>,
}

/// The token ids of a body's text or chat prompt, if the tokenizer takes it.
fn token_ids(tokenizer: &ModelTokenizer, body: &[u8]) -> Option<Vec<u32>> {
    let fields: TextFields<'_> = serde_json::from_slice(body).ok()?;
    let value = |raw: Option<&RawValue>| raw.and_then(|r| serde_json::from_str::<serde_json::Value>(r.get()).ok());
    let ids = if let Some(messages) = value(fields.messages).filter(|m| !m.is_null()) {
        tokenizer.chat_ids(&messages, value(fields.tools).as_ref())
    } else {
        // SGLang's `text`, then a completion's `prompt`, when it is one string (or one string in a list).
        let text = value(fields.text)
            .filter(|t| !t.is_null())
            .or_else(|| value(fields.prompt))
            .and_then(|t| match t {
                serde_json::Value::String(s) => Some(s),
                serde_json::Value::Array(mut items) if items.len() == 1 => match items.pop() {
                    Some(serde_json::Value::String(s)) => Some(s),
                    _ => None,
                },
                _ => None,
            })?;
        tokenizer.text_ids(&text)
    };
    match ids {
        Ok(ids) => Some(ids),
        Err(e) => {
            tracing::debug!(error = %e, "the tokenizer did not take the prompt: routing on its bytes");
            None
        }
    }
}

/// Makes `route`'s prompt the token ids of the body's text or chat prompt (see the module documentation).
pub async fn exact_prompt(tokenizer: Arc<ModelTokenizer>, body: &Bytes, route: &mut RouteRequest) {
    if !matches!(route.prompt, Prompt::Bytes(_)) {
        return;
    }
    let ids = if body.len() > BLOCKING_BYTES {
        let body = body.clone();
        tokio::task::spawn_blocking(move || token_ids(&tokenizer, &body))
            .await
            .ok()
            .flatten()
    } else {
        token_ids(&tokenizer, body)
    };
    if let Some(ids) = ids {
        route.input_tokens = ids.len() as u64;
        route.prompt = Prompt::Tokens(ids);
    }
}
