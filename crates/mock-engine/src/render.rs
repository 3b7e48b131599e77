//! Response bodies in the shape of the request's API: SGLang's `/generate`, OpenAI chat and text completions and
//! OpenAI Responses (typed `event:` lines ending with `response.incomplete`, since the mock always stops at its
//! token limit), whole or streamed as server-sent events, built from what the engine emits. A Responses answer
//! is stored once it ends ([`crate::responses`]).

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::engine::Emit;
use crate::responses::{Keep, Stored};

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Generate,
    Chat,
    Completion,
    Responses,
    /// Anthropic's Messages ([`crate::messages`]).
    Messages,
}

/// An error answer in the engines' shape (`{"error": {"message", "type", "code"}}`).
pub(crate) fn error(status: StatusCode, message: impl Into<String>) -> Response {
    let kind = if status.is_client_error() {
        "BadRequestError"
    } else {
        "InternalServerError"
    };
    let body = json!({"error": {"message": message.into(), "type": kind, "code": status.as_u16()}});
    (status, Json(body)).into_response()
}

/// Builds response bodies in the shape of the request's API.
pub(crate) struct Renderer {
    pub(crate) kind: Kind,
    pub(crate) id: String,
    pub(crate) model: String,
    pub(crate) created: u64,
    pub(crate) rank: usize,
    pub(crate) include_usage: bool,
    pub(crate) text: String,
    pub(crate) output_ids: Vec<u32>,
    pub(crate) prompt_tokens: usize,
    pub(crate) cached_tokens: usize,
    pub(crate) completion_tokens: u32,
    /// Responses: the next event's `sequence_number`.
    pub(crate) sequence: u64,
    /// Responses: where the answer is stored once it ends.
    pub(crate) keep: Option<Keep>,
    /// A vLLM prefill leg's `kv_transfer_params` for its decode server, in the whole answer.
    pub(crate) kv_transfer_params: Option<Value>,
    /// Messages: the tool the answer calls.
    pub(crate) tool: Option<String>,
}

impl Renderer {
    fn usage(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens as usize,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }

    fn meta_info(&self, finished: bool) -> Value {
        let finish = finished.then(|| json!({"type": "length", "length": self.completion_tokens}));
        json!({
            "id": self.id,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "dp_rank": self.rank,
            "finish_reason": finish,
        })
    }

    /// Records one emitted event; returns the text it added.
    fn absorb(&mut self, emit: &Emit) -> Option<String> {
        match emit {
            Emit::First {
                text,
                token,
                prompt_tokens,
                cached_tokens,
            } => {
                self.prompt_tokens = *prompt_tokens;
                self.cached_tokens = *cached_tokens;
                self.completion_tokens = 1;
                self.text.push_str(text);
                self.output_ids.push(*token);
                Some(text.clone())
            }
            Emit::Token { text, token } => {
                self.completion_tokens += 1;
                self.text.push_str(text);
                self.output_ids.push(*token);
                Some(text.clone())
            }
            Emit::Done { completion_tokens } => {
                self.completion_tokens = *completion_tokens;
                None
            }
            Emit::Drop | Emit::Fail { .. } => None,
        }
    }

    fn chunk(&self, delta: Option<&str>, first: bool, finished: bool) -> Value {
        let finish_reason = if finished { json!("length") } else { Value::Null };
        match self.kind {
            Kind::Generate if finished => {
                json!({"text": self.text, "output_ids": self.output_ids, "meta_info": self.meta_info(true), "index": 0})
            }
            Kind::Generate => json!({"text": self.text, "meta_info": self.meta_info(false), "index": 0}),
            Kind::Chat => {
                let delta = match (delta, first) {
                    (Some(d), true) => json!({"role": "assistant", "content": d}),
                    (Some(d), false) => json!({"content": d}),
                    (None, _) => json!({}),
                };
                json!({"id": format!("chatcmpl-{}", self.id), "object": "chat.completion.chunk", "created": self.created,
                       "model": self.model, "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]})
            }
            Kind::Completion => {
                json!({"id": format!("cmpl-{}", self.id), "object": "text_completion", "created": self.created,
                       "model": self.model, "choices": [{"index": 0, "text": delta.unwrap_or(""), "logprobs": null, "finish_reason": finish_reason}]})
            }
            Kind::Responses | Kind::Messages => {
                unreachable!("their events are built by `responses_events`, `messages_events`")
            }
        }
    }

    fn usage_chunk(&self) -> Value {
        let (object, id) = if self.kind == Kind::Chat {
            ("chat.completion.chunk", format!("chatcmpl-{}", self.id))
        } else {
            ("text_completion", format!("cmpl-{}", self.id))
        };
        json!({"id": id, "object": object, "created": self.created, "model": self.model, "choices": [], "usage": self.usage()})
    }

    fn whole(&self) -> Value {
        match self.kind {
            Kind::Generate => {
                json!({"text": self.text, "output_ids": self.output_ids, "meta_info": self.meta_info(true)})
            }
            Kind::Chat => {
                json!({"id": format!("chatcmpl-{}", self.id), "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": self.text}, "finish_reason": "length"}],
                "usage": self.usage()})
            }
            Kind::Completion => {
                json!({"id": format!("cmpl-{}", self.id), "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": self.text, "logprobs": null, "finish_reason": "length"}],
                "usage": self.usage()})
            }
            Kind::Responses => self.response(true),
            Kind::Messages => self.message_object(true),
        }
    }
}

fn sse(value: &Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}

pub(crate) async fn whole_response(mut render: Renderer, mut rx: mpsc::Receiver<Emit>) -> Response {
    while let Some(emit) = rx.recv().await {
        if let Emit::Fail { status, message } = emit {
            return error(
                StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
                message,
            );
        }
        if let Emit::Done { .. } = emit {
            render.absorb(&emit);
            render.keep_response();
            let mut whole = render.whole();
            if let (Some(params), Some(object)) = (render.kv_transfer_params.take(), whole.as_object_mut()) {
                object.insert("kv_transfer_params".into(), params);
            }
            return Json(whole).into_response();
        }
        render.absorb(&emit);
    }
    error(
        StatusCode::INTERNAL_SERVER_ERROR,
        "the request ended before it finished",
    )
}

enum StreamState {
    Running(Box<Renderer>, mpsc::Receiver<Emit>, bool),
    Ended,
}

pub(crate) fn stream_response(render: Renderer, rx: mpsc::Receiver<Emit>) -> Response {
    let events = stream::unfold(StreamState::Running(Box::new(render), rx, true), |state| async move {
        let StreamState::Running(mut render, mut rx, first) = state else {
            return None;
        };
        let emit = rx.recv().await?;
        match emit {
            Emit::Drop => {
                // Let the server write the events already sent (it flushes when the body is pending), so the
                // stream breaks after exactly the tokens the engine emitted.
                tokio::task::yield_now().await;
                Some((
                    Err(std::io::Error::other("injected fault: connection dropped")),
                    StreamState::Ended,
                ))
            }
            Emit::Fail { status, message } if render.kind == Kind::Messages => {
                let event = json!({"type": "error", "error": {"type": "api_error", "message": message}});
                let _ = status;
                Some((
                    Ok(Bytes::from(format!("event: error\ndata: {event}\n\n"))),
                    StreamState::Ended,
                ))
            }
            Emit::Fail { status, message } => {
                let event = json!({"error": {"message": message, "type": "InternalServerError", "code": status}});
                Some((Ok(sse(&event)), StreamState::Ended))
            }
            Emit::Done { .. } if render.kind == Kind::Responses => {
                render.absorb(&emit);
                render.keep_response();
                let out = render.responses_events(None, first, true);
                Some((Ok(Bytes::from(out)), StreamState::Ended))
            }
            Emit::Done { .. } if render.kind == Kind::Messages => {
                render.absorb(&emit);
                let out = render.messages_events(None, first, true);
                Some((Ok(Bytes::from(out)), StreamState::Ended))
            }
            Emit::Done { .. } => {
                render.absorb(&emit);
                let mut out = sse(&render.chunk(None, false, true)).to_vec();
                if render.include_usage && render.kind != Kind::Generate {
                    out.extend_from_slice(&sse(&render.usage_chunk()));
                }
                out.extend_from_slice(b"data: [DONE]\n\n");
                Some((Ok(Bytes::from(out)), StreamState::Ended))
            }
            _ => {
                let delta = render.absorb(&emit);
                let chunk = if render.kind == Kind::Responses {
                    Bytes::from(render.responses_events(delta.as_deref(), first, false))
                } else if render.kind == Kind::Messages {
                    Bytes::from(render.messages_events(delta.as_deref(), first, false))
                } else {
                    sse(&render.chunk(delta.as_deref(), first, false))
                };
                Some((Ok(chunk), StreamState::Running(render, rx, false)))
            }
        }
    });
    let mut response = Response::new(Body::from_stream(events));
    response
        .headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
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
