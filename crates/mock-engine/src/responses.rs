//! OpenAI Responses on the mock engine: the response object and its stream events (typed `event:` lines ending
//! with `response.incomplete`, since the mock always stops at its token limit), and the responses it stores
//! (`store`, on by default, as in vLLM and SGLang): `previous_response_id` continues one (the new turn's prompt is
//! the stored prompt and answer followed by the new input, so it extends the stored one and hits the same rank's
//! cache), `GET` and `DELETE /v1/responses/{id}` read and remove one, and an unknown id is a 404, as the engines
//! answer. The store keeps the last [`KEPT`] responses of this process, like the engines' in-memory stores.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use crate::api::{error, AppState, Renderer};

/// How many responses the mock keeps.
pub const KEPT: usize = 10_000;

/// A stored response: the prompt it answered (as text), its answer, and the object `GET` returns.
struct Stored {
    prompt: String,
    output: String,
    object: Value,
}

/// The responses this process made, the oldest forgotten first.
#[derive(Default)]
pub struct ResponseStore {
    inner: Mutex<(HashMap<String, Stored>, VecDeque<String>)>,
}

impl ResponseStore {
    fn lock(&self) -> std::sync::MutexGuard<'_, (HashMap<String, Stored>, VecDeque<String>)> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn put(&self, id: String, stored: Stored) {
        let mut inner = self.lock();
        if inner.0.insert(id.clone(), stored).is_none() {
            inner.1.push_back(id);
        }
        while inner.1.len() > KEPT {
            if let Some(old) = inner.1.pop_front() {
                inner.0.remove(&old);
            }
        }
    }

    /// The conversation up to and including response `id`, as prompt text to continue.
    pub fn conversation(&self, id: &str) -> Option<String> {
        let inner = self.lock();
        let stored = inner.0.get(id)?;
        Some(format!("{}{}\n", stored.prompt, stored.output))
    }
}

/// What a Responses request keeps of itself once answered.
pub(crate) struct Keep {
    pub store: Arc<ResponseStore>,
    /// The prompt text its tokens were encoded from.
    pub prompt: String,
}

fn not_found(id: &str) -> Response {
    error(StatusCode::NOT_FOUND, format!("Response with id '{id}' not found."))
}

/// `GET /v1/responses/{id}`.
pub(crate) async fn get_response(State(s): State<AppState>, Path(id): Path<String>) -> Response {
    match s.responses.lock().0.get(&id) {
        Some(stored) => Json(stored.object.clone()).into_response(),
        None => not_found(&id),
    }
}

/// `DELETE /v1/responses/{id}`.
pub(crate) async fn delete_response(State(s): State<AppState>, Path(id): Path<String>) -> Response {
    let mut inner = s.responses.lock();
    if inner.0.remove(&id).is_none() {
        return not_found(&id);
    }
    inner.1.retain(|kept| *kept != id);
    Json(json!({"id": id, "object": "response", "deleted": true})).into_response()
}

impl Renderer {
    /// A Responses object: in progress (no output or usage yet) or ended at the token limit.
    pub(crate) fn response(&self, ended: bool) -> Value {
        let (status, output, usage, incomplete) = if ended {
            let usage = json!({
                "input_tokens": self.prompt_tokens,
                "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": self.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.prompt_tokens + self.completion_tokens as usize,
            });
            (
                "incomplete",
                json!([self.message(true)]),
                usage,
                json!({"reason": "max_output_tokens"}),
            )
        } else {
            ("in_progress", json!([]), Value::Null, Value::Null)
        };
        json!({"id": format!("resp_{}", self.id), "object": "response", "created_at": self.created, "model": self.model,
               "status": status, "incomplete_details": incomplete, "output": output, "usage": usage,
               "error": null, "instructions": null, "metadata": {}, "parallel_tool_calls": true,
               "temperature": 1.0, "top_p": 1.0, "tool_choice": "auto", "tools": []})
    }

    /// The Responses output message: the text so far, or none yet.
    pub(crate) fn message(&self, ended: bool) -> Value {
        let content = if ended {
            json!([{"type": "output_text", "text": self.text, "annotations": []}])
        } else {
            json!([])
        };
        let status = if ended { "incomplete" } else { "in_progress" };
        json!({"type": "message", "id": format!("msg_{}", self.id), "status": status, "role": "assistant", "content": content})
    }

    /// Responses stream events, as SSE: the opening events with the first token, a delta per token, the closing
    /// events at the end.
    pub(crate) fn responses_events(&mut self, delta: Option<&str>, first: bool, ended: bool) -> Vec<u8> {
        let item_id = format!("msg_{}", self.id);
        let mut events = Vec::new();
        if first {
            events.push(json!({"type": "response.created", "response": self.response(false)}));
            events.push(json!({"type": "response.in_progress", "response": self.response(false)}));
            events.push(json!({"type": "response.output_item.added", "output_index": 0, "item": self.message(false)}));
            events.push(
                json!({"type": "response.content_part.added", "item_id": item_id, "output_index": 0,
                               "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}}),
            );
        }
        if let Some(delta) = delta {
            events.push(
                json!({"type": "response.output_text.delta", "item_id": item_id, "output_index": 0,
                               "content_index": 0, "delta": delta, "logprobs": []}),
            );
        }
        if ended {
            let part = json!({"type": "output_text", "text": self.text, "annotations": []});
            events.push(
                json!({"type": "response.output_text.done", "item_id": item_id, "output_index": 0,
                               "content_index": 0, "text": self.text, "logprobs": []}),
            );
            events.push(
                json!({"type": "response.content_part.done", "item_id": item_id, "output_index": 0,
                               "content_index": 0, "part": part}),
            );
            events.push(json!({"type": "response.output_item.done", "output_index": 0, "item": self.message(true)}));
            events.push(json!({"type": "response.incomplete", "response": self.response(true)}));
        }
        let mut out = Vec::new();
        for mut event in events {
            event["sequence_number"] = json!(self.sequence);
            self.sequence += 1;
            let kind = event["type"].as_str().unwrap_or_default().to_owned();
            out.extend_from_slice(format!("event: {kind}\ndata: {event}\n\n").as_bytes());
        }
        out
    }

    /// The response ended: stored, when the request asked for it.
    pub(crate) fn keep_response(&mut self) {
        if let Some(keep) = self.keep.take() {
            let stored = Stored {
                prompt: keep.prompt,
                output: self.text.clone(),
                object: self.response(true),
            };
            keep.store.put(format!("resp_{}", self.id), stored);
        }
    }
}
