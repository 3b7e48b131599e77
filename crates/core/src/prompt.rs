//! Prompt extraction shared by every front end: one request body (OpenAI chat or completions, SGLang `/generate`)
//! to a [`RouteRequest`].
//!
//! The prompt is taken from the first field present, in this order:
//!
//! 1. `input_ids`: token ids, used as given.
//! 2. `text` (SGLang) or `prompt` (OpenAI completions): the UTF-8 bytes of the string. A completions `prompt` that
//!    is an array of token ids is used as token ids; a one-element array of strings as that string.
//! 3. `messages` (OpenAI chat): the bytes of the canonical rendering below.
//! 4. `input` (OpenAI embeddings and Responses): a Responses request (input items, or `instructions` or `tools`
//!    given) is rendered as a chat: `instructions` as the system message, then a string `input` as the user
//!    message or each input item (an item without a `role` renders with its `type` in the role's place). Otherwise
//!    an embeddings input: a string's bytes; token ids; a batch of strings (joined by newlines) or of token-id lists
//!    (concatenated).
//!
//! Batches (several prompts in one request) are rejected: a router places one request on one rank.
//!
//! ## Canonical chat rendering
//!
//! The router never tokenizes; it keys on bytes that grow the way the engine's token sequence grows:
//!
//! ```text
//! if tools is a non-empty array:  "<|tools|>\n" + json(tools) + "\n"
//! for each message, in order:     "<|" + role + "|>\n" + content + extras + "\n"
//!   content: a string as is; an array of parts: each `text` (`input_text`, `output_text`) part's text, any
//!            other part as json(part), joined with "\n"; absent or null: nothing
//!   extras:  if the message has fields besides role and content (name, tool_calls, tool_call_id, …):
//!            "\n" + json(those fields as one object)
//! ```
//!
//! `json` is compact JSON with object keys sorted. Each message renders on its own, so the rendering of a
//! conversation is a prefix of the rendering of any continuation of it (same tools, more messages): a later turn's
//! key extends an earlier turn's. The whole conversation counts, not only its first or last message.
//!
//! Rank override: `routed_dp_rank`, or the deprecated `data_parallel_rank` when `routed_dp_rank` is absent or null.
//! Cost: linear in the request size.

use serde_json::{Map, Value};
use thiserror::Error;

use crate::request::{Prompt, RouteRequest};

/// Why a request body could not be turned into a [`RouteRequest`]. Always the client's fault (HTTP 400).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PromptError {
    #[error("the request body must be a JSON object")]
    NotAnObject,
    #[error("`{field}` must be {expected}")]
    Field {
        field: &'static str,
        expected: &'static str,
    },
    #[error("`{0}` holds several prompts; batched requests are not supported, send one prompt per request")]
    Batch(&'static str),
    #[error("the request has no prompt: expected one of `input_ids`, `text`, `prompt`, `messages` or `input`")]
    NoPrompt,
    #[error("the request body is not valid JSON: {0}")]
    InvalidJson(String),
    #[error("the request body has `{0}` more than once")]
    Duplicate(String),
}

/// Parses one request body.
pub fn parse_request(body: &Value) -> Result<RouteRequest, PromptError> {
    let obj = body.as_object().ok_or(PromptError::NotAnObject)?;
    let prompt = extract_prompt(obj)?;
    let mut req = RouteRequest::new(prompt);
    req.rank_override = rank_override(obj)?;
    req.bootstrap_room = match present(obj, "bootstrap_room") {
        None => None,
        Some(v) => Some(v.as_u64().ok_or(PromptError::Field {
            field: "bootstrap_room",
            expected: "a non-negative integer",
        })?),
    };
    Ok(req)
}

/// A field that is present and not `null`.
fn present<'a>(obj: &'a Map<String, Value>, field: &str) -> Option<&'a Value> {
    obj.get(field).filter(|v| !v.is_null())
}

fn rank_override(obj: &Map<String, Value>) -> Result<Option<i64>, PromptError> {
    for field in ["routed_dp_rank", "data_parallel_rank"] {
        if let Some(v) = present(obj, field) {
            return v.as_i64().map(Some).ok_or(PromptError::Field {
                field,
                expected: "an integer",
            });
        }
    }
    Ok(None)
}

fn extract_prompt(obj: &Map<String, Value>) -> Result<Prompt, PromptError> {
    if let Some(ids) = present(obj, "input_ids") {
        return token_ids(ids, "input_ids");
    }
    if let Some(text) = present(obj, "text") {
        return single_string(text, "text");
    }
    if let Some(prompt) = present(obj, "prompt") {
        return match prompt {
            Value::Array(items) if items.first().is_some_and(Value::is_number) => token_ids(prompt, "prompt"),
            _ => single_string(prompt, "prompt"),
        };
    }
    if let Some(messages) = present(obj, "messages") {
        return render_chat(present(obj, "tools"), messages).map(Prompt::Bytes);
    }
    if let Some(input) = present(obj, "input") {
        return input_prompt(input, present(obj, "instructions"), present(obj, "tools"));
    }
    Err(PromptError::NoPrompt)
}

/// `input` (OpenAI embeddings and Responses). A Responses request (input items, or `instructions` or `tools`
/// given) is rendered as a chat ([`responses_prompt`]); otherwise `input` is an embeddings input: a string's bytes;
/// token ids; or a batch of strings (keyed on all of them in order, joined by newlines) or of token-id lists
/// (concatenated).
pub(crate) fn input_prompt(
    input: &Value,
    instructions: Option<&Value>,
    tools: Option<&Value>,
) -> Result<Prompt, PromptError> {
    let items = matches!(input, Value::Array(items) if !items.is_empty() && items.iter().all(Value::is_object));
    if items || instructions.is_some() || tools.is_some() {
        return responses_prompt(input, instructions, tools).map(Prompt::Bytes);
    }
    let bad = PromptError::Field {
        field: "input",
        expected: "a string, token ids, an array of strings or of token-id arrays, or input items",
    };
    match input {
        Value::String(s) => Ok(Prompt::Bytes(s.as_bytes().to_vec())),
        Value::Array(items) if items.first().is_some_and(Value::is_number) => token_ids(input, "input"),
        Value::Array(items) if items.iter().all(Value::is_string) => Ok(Prompt::Bytes(
            items
                .iter()
                .filter_map(Value::as_str)
                .collect::<Vec<_>>()
                .join("\n")
                .into_bytes(),
        )),
        Value::Array(items) if items.iter().all(Value::is_array) => {
            let mut all = Vec::new();
            for item in items {
                match token_ids(item, "input")? {
                    Prompt::Tokens(ids) => all.extend(ids),
                    Prompt::Bytes(_) => return Err(bad),
                }
            }
            Ok(Prompt::Tokens(all))
        }
        _ => Err(bad),
    }
}

/// A Responses request as the chat the engine makes of it: `tools`, then `instructions` as a system message, then
/// a string `input` as a user message, or each input item. An item with a `role` is a message (its default
/// `"type": "message"` dropped, so a conversation sent back as items renders as it did as a string); any other
/// item (`function_call`, `function_call_output`, `reasoning`, ...) renders with its `type` in the role's place and
/// its other fields as extras.
fn responses_prompt(
    input: &Value,
    instructions: Option<&Value>,
    tools: Option<&Value>,
) -> Result<Vec<u8>, PromptError> {
    let mut messages = Vec::new();
    if let Some(system) = instructions {
        let system = system.as_str().ok_or(PromptError::Field {
            field: "instructions",
            expected: "a string",
        })?;
        messages.push(serde_json::json!({"role": "system", "content": system}));
    }
    match input {
        Value::String(text) => messages.push(serde_json::json!({"role": "user", "content": text})),
        Value::Array(items) => {
            for item in items {
                messages.push(Value::Object(responses_item(item)?));
            }
        }
        _ => {
            return Err(PromptError::Field {
                field: "input",
                expected: "a string or an array of input items",
            })
        }
    }
    render_chat(tools, &Value::Array(messages))
}

fn responses_item(item: &Value) -> Result<Map<String, Value>, PromptError> {
    let bad = PromptError::Field {
        field: "input",
        expected: "a string or an array of input items, each with a string `role` or `type`",
    };
    let mut item = item.as_object().ok_or(bad.clone())?.clone();
    if item.get("role").is_some_and(Value::is_string) {
        if item.get("type").and_then(Value::as_str) == Some("message") {
            item.remove("type");
        }
        return Ok(item);
    }
    if item.contains_key("role") {
        return Err(bad);
    }
    match item.remove("type") {
        Some(kind @ Value::String(_)) => {
            item.insert("role".to_owned(), kind);
            Ok(item)
        }
        _ => Err(bad),
    }
}

fn token_ids(value: &Value, field: &'static str) -> Result<Prompt, PromptError> {
    let items = value.as_array().ok_or(PromptError::Field {
        field,
        expected: "an array of token ids",
    })?;
    if items.first().is_some_and(Value::is_array) {
        return Err(PromptError::Batch(field));
    }
    items
        .iter()
        .map(|v| v.as_u64().and_then(|id| u32::try_from(id).ok()))
        .collect::<Option<Vec<u32>>>()
        .map(Prompt::Tokens)
        .ok_or(PromptError::Field {
            field,
            expected: "an array of token ids (integers in 0..2^32)",
        })
}

pub(crate) fn single_string(value: &Value, field: &'static str) -> Result<Prompt, PromptError> {
    match value {
        Value::String(s) => Ok(Prompt::Bytes(s.as_bytes().to_vec())),
        Value::Array(items) if items.len() == 1 && items[0].is_string() => single_string(&items[0], field),
        Value::Array(_) => Err(PromptError::Batch(field)),
        _ => Err(PromptError::Field {
            field,
            expected: "a string",
        }),
    }
}

/// Renders a chat conversation as described in the module docs.
pub fn render_chat(tools: Option<&Value>, messages: &Value) -> Result<Vec<u8>, PromptError> {
    let messages = messages.as_array().ok_or(PromptError::Field {
        field: "messages",
        expected: "an array of messages",
    })?;
    let mut out = String::new();
    render_tools(tools, &mut out)?;
    for message in messages {
        render_message(message, &mut out)?;
    }
    Ok(out.into_bytes())
}

/// The tools line: `"<|tools|>\n" + json(tools) + "\n"` for a non-empty array.
pub(crate) fn render_tools(tools: Option<&Value>, out: &mut String) -> Result<(), PromptError> {
    if let Some(tools) = tools {
        let list = tools.as_array().ok_or(PromptError::Field {
            field: "tools",
            expected: "an array",
        })?;
        if !list.is_empty() {
            out.push_str("<|tools|>\n");
            out.push_str(&tools.to_string());
            out.push('\n');
        }
    }
    Ok(())
}

/// Content parts: each `text` (`input_text`, `output_text`) part's text, any other part as json(part), joined with `"\n"`.
pub(crate) fn render_parts(parts: &[Value], out: &mut String) {
    for (i, part) in parts.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        match part.get("text").and_then(Value::as_str) {
            // Chat's `text` parts and Responses' `input_text` and `output_text` parts alike.
            Some(text)
                if matches!(
                    part.get("type").and_then(Value::as_str),
                    Some("text" | "input_text" | "output_text")
                ) =>
            {
                out.push_str(text)
            }
            _ => out.push_str(&part.to_string()),
        }
    }
}

fn render_message(message: &Value, out: &mut String) -> Result<(), PromptError> {
    let bad = PromptError::Field {
        field: "messages",
        expected: "an array of objects, each with a string `role`",
    };
    let obj = message.as_object().ok_or(bad.clone())?;
    let role = obj.get("role").and_then(Value::as_str).ok_or(bad)?;
    out.push_str("<|");
    out.push_str(role);
    out.push_str("|>\n");
    match obj.get("content") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => out.push_str(s),
        Some(Value::Array(parts)) => render_parts(parts, out),
        Some(_) => {
            return Err(PromptError::Field {
                field: "messages[].content",
                expected: "a string, an array of content parts, or null",
            })
        }
    }
    let extras: Map<String, Value> = obj
        .iter()
        .filter(|(k, _)| *k != "role" && *k != "content")
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    if !extras.is_empty() {
        out.push('\n');
        out.push_str(&Value::Object(extras).to_string());
    }
    out.push('\n');
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn bytes(req: &RouteRequest) -> String {
        match &req.prompt {
            Prompt::Bytes(b) => String::from_utf8(b.clone()).unwrap(),
            Prompt::Tokens(t) => panic!("expected bytes, got tokens {t:?}"),
        }
    }

    #[test]
    fn embeddings_inputs_key_on_their_text_or_tokens() {
        let req = |input| parse_request(&json!({"model": "e", "input": input})).unwrap();
        assert_eq!(bytes(&req(json!("embed me"))), "embed me");
        assert_eq!(bytes(&req(json!(["a", "b"]))), "a\nb");
        assert_eq!(req(json!([1, 2])).prompt, Prompt::Tokens(vec![1, 2]));
        assert_eq!(req(json!([[1, 2], [3]])).prompt, Prompt::Tokens(vec![1, 2, 3]));
    }

    #[test]
    fn a_responses_request_renders_as_the_chat_the_engine_makes_of_it() {
        let tools = json!([{"type": "function", "name": "f", "parameters": {}}]);
        let first = parse_request(&json!({"instructions": "Be terse.", "input": "hi", "tools": tools})).unwrap();
        let tools_line = format!("<|tools|>\n{tools}\n");
        assert_eq!(
            bytes(&first),
            format!("{tools_line}<|system|>\nBe terse.\n<|user|>\nhi\n")
        );
        // The next turn sends the conversation back as items: its key extends the first turn's.
        let next = parse_request(&json!({"instructions": "Be terse.", "tools": tools, "input": [
            {"type": "message", "role": "user", "content": "hi"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hello"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "42"},
            {"role": "user", "content": [{"type": "input_text", "text": "and?"}]},
        ]}))
        .unwrap();
        let next = bytes(&next);
        assert!(next.starts_with(&bytes(&first)), "{next}");
        assert!(next.ends_with(concat!(
            "<|assistant|>\nhello\n",
            "<|function_call|>\n\n{\"arguments\":\"{}\",\"call_id\":\"c1\",\"name\":\"f\"}\n",
            "<|function_call_output|>\n\n{\"call_id\":\"c1\",\"output\":\"42\"}\n",
            "<|user|>\nand?\n",
        )));
        // Without instructions or tools, a string input is keyed as it is (as for embeddings).
        assert_eq!(bytes(&parse_request(&json!({"input": "hi"})).unwrap()), "hi");
    }

    #[test]
    fn bad_responses_input_gives_a_clear_error() {
        for (body, field) in [
            (json!({"input": [{"content": "no role or type"}]}), "input"),
            (json!({"input": [{"role": 5, "content": "x"}]}), "input"),
            (json!({"input": "hi", "instructions": 5}), "instructions"),
            (json!({"input": ["a"], "instructions": "x"}), "input"),
        ] {
            match parse_request(&body) {
                Err(PromptError::Field { field: f, .. }) => assert_eq!(f, field, "{body}"),
                other => panic!("{body}: {other:?}"),
            }
        }
    }

    #[test]
    fn input_ids_win_over_text() {
        let req = parse_request(&json!({"input_ids": [1, 2, 3], "text": "ignored"})).unwrap();
        assert_eq!(req.prompt, Prompt::Tokens(vec![1, 2, 3]));
        assert_eq!(req.input_tokens, 3);
    }

    #[test]
    fn text_and_prompt_are_taken_as_given() {
        assert_eq!(bytes(&parse_request(&json!({"text": "héllo"})).unwrap()), "héllo");
        assert_eq!(bytes(&parse_request(&json!({"prompt": "abc"})).unwrap()), "abc");
        assert_eq!(bytes(&parse_request(&json!({"prompt": ["abc"]})).unwrap()), "abc");
        let ids = parse_request(&json!({"prompt": [5, 6]})).unwrap();
        assert_eq!(ids.prompt, Prompt::Tokens(vec![5, 6]));
    }

    #[test]
    fn chat_renders_tools_then_every_message() {
        let body = json!({
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "messages": [
                {"role": "system", "content": "sys"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "1"}]},
            ]
        });
        let expected = "<|tools|>\n[{\"function\":{\"name\":\"f\"},\"type\":\"function\"}]\n\
                        <|system|>\nsys\n\
                        <|user|>\na\nb\n\
                        <|assistant|>\n\n{\"tool_calls\":[{\"id\":\"1\"}]}\n";
        assert_eq!(bytes(&parse_request(&body).unwrap()), expected);
    }

    #[test]
    fn a_later_turn_extends_the_earlier_rendering() {
        let turn1 = json!({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"}]});
        let turn2 = json!({"messages": [
            {"role": "system", "content": "S"}, {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}
        ]});
        let (a, b) = (
            bytes(&parse_request(&turn1).unwrap()),
            bytes(&parse_request(&turn2).unwrap()),
        );
        assert!(b.starts_with(&a) && b.len() > a.len(), "{a:?} / {b:?}");
    }

    #[test]
    fn override_and_room_are_read() {
        let req = parse_request(&json!({"text": "x", "routed_dp_rank": 3, "bootstrap_room": 42})).unwrap();
        assert_eq!((req.rank_override, req.bootstrap_room), (Some(3), Some(42)));
        let old = parse_request(&json!({"text": "x", "data_parallel_rank": 1})).unwrap();
        assert_eq!(old.rank_override, Some(1));
        let both = parse_request(&json!({"text": "x", "routed_dp_rank": 2, "data_parallel_rank": 1})).unwrap();
        assert_eq!(both.rank_override, Some(2));
        let null = parse_request(&json!({"text": "x", "routed_dp_rank": null, "data_parallel_rank": 1})).unwrap();
        assert_eq!(null.rank_override, Some(1));
        let negative = parse_request(&json!({"text": "x", "routed_dp_rank": -1})).unwrap();
        assert_eq!(negative.rank_override, Some(-1));
    }

    #[test]
    fn bad_input_gives_a_clear_error() {
        let cases = [
            (json!([1, 2]), PromptError::NotAnObject),
            (json!({}), PromptError::NoPrompt),
            (json!({"input_ids": [[1], [2]]}), PromptError::Batch("input_ids")),
            (json!({"text": ["a", "b"]}), PromptError::Batch("text")),
            (
                json!({"input_ids": [-1]}),
                PromptError::Field {
                    field: "input_ids",
                    expected: "an array of token ids (integers in 0..2^32)",
                },
            ),
            (
                json!({"input_ids": [4294967296u64]}),
                PromptError::Field {
                    field: "input_ids",
                    expected: "an array of token ids (integers in 0..2^32)",
                },
            ),
            (
                json!({"text": 5}),
                PromptError::Field {
                    field: "text",
                    expected: "a string",
                },
            ),
            (
                json!({"text": "x", "routed_dp_rank": "2"}),
                PromptError::Field {
                    field: "routed_dp_rank",
                    expected: "an integer",
                },
            ),
            (
                json!({"text": "x", "routed_dp_rank": 1.5}),
                PromptError::Field {
                    field: "routed_dp_rank",
                    expected: "an integer",
                },
            ),
            (
                json!({"text": "x", "bootstrap_room": -3}),
                PromptError::Field {
                    field: "bootstrap_room",
                    expected: "a non-negative integer",
                },
            ),
            (
                json!({"messages": "hi"}),
                PromptError::Field {
                    field: "messages",
                    expected: "an array of messages",
                },
            ),
            (
                json!({"messages": [{"content": "x"}]}),
                PromptError::Field {
                    field: "messages",
                    expected: "an array of objects, each with a string `role`",
                },
            ),
        ];
        for (body, expected) in cases {
            assert_eq!(parse_request(&body), Err(expected), "{body}");
        }
    }

    mod arbitrary {
        use super::*;
        use proptest::prelude::*;

        /// Arbitrary JSON up to a few levels deep, biased towards the fields the parser reads.
        fn json() -> impl Strategy<Value = Value> {
            let leaf = prop_oneof![
                Just(Value::Null),
                any::<bool>().prop_map(Value::from),
                any::<i64>().prop_map(Value::from),
                any::<u64>().prop_map(Value::from),
                any::<f64>().prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
                ".{0,12}".prop_map(Value::from),
            ];
            leaf.prop_recursive(4, 64, 8, |inner| {
                let key = prop_oneof![
                    Just("input_ids".to_string()),
                    Just("text".to_string()),
                    Just("prompt".to_string()),
                    Just("messages".to_string()),
                    Just("tools".to_string()),
                    Just("role".to_string()),
                    Just("content".to_string()),
                    Just("routed_dp_rank".to_string()),
                    Just("data_parallel_rank".to_string()),
                    Just("bootstrap_room".to_string()),
                    "[a-z]{1,6}",
                ];
                prop_oneof![
                    prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                    prop::collection::btree_map(key, inner, 0..6).prop_map(|m| Value::Object(m.into_iter().collect())),
                ]
            })
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2000))]

            /// Any bytes: either not JSON, or a request, or a clear error; never a panic.
            #[test]
            fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
                if let Ok(value) = serde_json::from_slice::<Value>(&bytes) {
                    let _ = parse_request(&value);
                }
            }

            /// Any JSON shaped like a request: parsed or refused with a message, never a panic, and a parsed
            /// request came from an object.
            #[test]
            fn arbitrary_json_never_panics(value in json()) {
                match parse_request(&value) {
                    Ok(_) => prop_assert!(value.is_object()),
                    Err(e) => prop_assert!(!e.to_string().is_empty()),
                }
            }
        }
    }
}
