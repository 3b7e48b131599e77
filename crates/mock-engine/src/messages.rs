//! Anthropic Messages answers (`POST /v1/messages`), as SGLang and vLLM serve them over their chat serving: a
//! `message` object whole, or streamed as `message_start`, `content_block_start`, a `content_block_delta` per
//! token, `content_block_stop`, `message_delta` (the stop reason and the usage) and `message_stop`, each an SSE
//! event with its `event:` line. Usage in Anthropic's terms: `input_tokens` is the uncached part of the prompt,
//! `cache_read_input_tokens` the cached part (the prompt is their sum, with `cache_creation_input_tokens`, 0
//! here), as vLLM computes them.
//!
//! A request that forces a tool (`tool_choice` `{"type": "tool", "name": …}`, or `{"type": "any"}` with tools)
//! gets one `tool_use` block calling it (the first tool for `any`), its `input` `{"text": …}` the generated text,
//! and `stop_reason` `tool_use`; any other answer is one text block stopped at the token limit (`max_tokens`).

use axum::response::{IntoResponse, Response};
use axum::Json;
use http_body_util::BodyExt;
use serde_json::{json, Value};

use crate::render::Renderer;

/// An error answer in Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`), as the engines answer
/// the Messages routes; any other answer as it is.
pub(crate) async fn anthropic_errors(response: Response) -> Response {
    let status = response.status();
    if status.is_success() {
        return response;
    }
    let Ok(bytes) = response.into_body().collect().await.map(|b| b.to_bytes()) else {
        return status.into_response();
    };
    let message = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_owned))
        .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned());
    let kind = match status.as_u16() {
        404 => "not_found_error",
        400..=499 => "invalid_request_error",
        503 => "overloaded_error",
        _ => "api_error",
    };
    (
        status,
        Json(json!({"type": "error", "error": {"type": kind, "message": message}})),
    )
        .into_response()
}

/// Which tool a Messages request forces, if any: from its `tool_choice` and `tools`.
pub(crate) fn forced_tool(tool_choice: Option<&Value>, tools: Option<&Value>) -> Option<String> {
    let choice = tool_choice?;
    match choice.get("type").and_then(Value::as_str)? {
        "tool" => choice.get("name").and_then(Value::as_str).map(str::to_owned),
        "any" => tools?.as_array()?.first()?.get("name")?.as_str().map(str::to_owned),
        _ => None,
    }
}

impl Renderer {
    /// The usage in Anthropic's terms.
    pub(crate) fn messages_usage(&self) -> Value {
        json!({
            "input_tokens": self.prompt_tokens.saturating_sub(self.cached_tokens),
            "cache_read_input_tokens": self.cached_tokens,
            "cache_creation_input_tokens": 0,
            "output_tokens": self.completion_tokens,
        })
    }

    fn stop_reason(&self) -> &'static str {
        if self.tool.is_some() {
            "tool_use"
        } else {
            "max_tokens"
        }
    }

    /// The answer's one content block: as it ends, or as it starts (empty) in a stream.
    fn block(&self, ended: bool) -> Value {
        let text = if ended { self.text.as_str() } else { "" };
        match &self.tool {
            Some(name) => {
                let input = if ended { json!({"text": text}) } else { json!({}) };
                json!({"type": "tool_use", "id": format!("toolu_{}", self.id), "name": name, "input": input})
            }
            None => json!({"type": "text", "text": text}),
        }
    }

    /// The `message` object: whole, or as `message_start` carries it (no content yet).
    pub(crate) fn message_object(&self, ended: bool) -> Value {
        let (content, stop) = if ended {
            (json!([self.block(true)]), json!(self.stop_reason()))
        } else {
            (json!([]), Value::Null)
        };
        json!({"id": format!("msg_{}", self.id), "type": "message", "role": "assistant", "model": self.model,
               "content": content, "stop_reason": stop, "stop_sequence": null, "usage": self.messages_usage()})
    }

    /// Messages stream events, as SSE: the opening events with the first token, a delta per token, the closing
    /// events at the end.
    pub(crate) fn messages_events(&mut self, delta: Option<&str>, first: bool, ended: bool) -> Vec<u8> {
        let mut events = Vec::new();
        if first {
            events.push(json!({"type": "message_start", "message": self.message_object(false)}));
            events.push(json!({"type": "content_block_start", "index": 0, "content_block": self.block(false)}));
        }
        if let Some(delta) = delta {
            let delta = match self.tool {
                // The tool's input as JSON, a piece per token: `{"text": "` first, the text escaped, `"}` last.
                Some(_) => {
                    let escaped = serde_json::to_string(delta).unwrap_or_default();
                    let inner = &escaped[1..escaped.len() - 1];
                    let piece = if first {
                        format!("{{\"text\": \"{inner}")
                    } else {
                        inner.to_string()
                    };
                    json!({"type": "input_json_delta", "partial_json": piece})
                }
                None => json!({"type": "text_delta", "text": delta}),
            };
            events.push(json!({"type": "content_block_delta", "index": 0, "delta": delta}));
        }
        if ended {
            if self.tool.is_some() {
                let close = json!({"type": "input_json_delta", "partial_json": "\"}"});
                events.push(json!({"type": "content_block_delta", "index": 0, "delta": close}));
            }
            events.push(json!({"type": "content_block_stop", "index": 0}));
            events.push(
                json!({"type": "message_delta", "delta": {"stop_reason": self.stop_reason(), "stop_sequence": null},
                               "usage": self.messages_usage()}),
            );
            events.push(json!({"type": "message_stop"}));
        }
        let mut out = Vec::new();
        for event in events {
            let kind = event["type"].as_str().unwrap_or_default().to_owned();
            out.extend_from_slice(format!("event: {kind}\ndata: {event}\n\n").as_bytes());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forced_tool_is_named_by_the_choice_or_is_the_first_tool() {
        let tools = json!([{"name": "read"}, {"name": "write"}]);
        assert_eq!(
            forced_tool(Some(&json!({"type": "tool", "name": "write"})), Some(&tools)).as_deref(),
            Some("write")
        );
        assert_eq!(
            forced_tool(Some(&json!({"type": "any"})), Some(&tools)).as_deref(),
            Some("read")
        );
        assert_eq!(forced_tool(Some(&json!({"type": "auto"})), Some(&tools)), None);
        assert_eq!(forced_tool(None, Some(&tools)), None);
    }
}
