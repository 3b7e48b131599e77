//! Anthropic's Messages API (`POST /v1/messages`) as the engines read it. SGLang and vLLM both serve it by
//! translating the request into a chat completion and rendering that with the model's chat template, so the
//! gateway keys a Messages prompt the same way: [`to_chat`] turns the request's `system`, `messages` and `tools`
//! into OpenAI chat `messages` and `tools` as vLLM 0.32 does (`vllm/entrypoints/anthropic/serving.py`,
//! `AnthropicServingMessages.to_chat_completion_request`), and the chat rendering (the canonical one, or the model's
//! template when the gateway tokenizes) takes it from there:
//!
//! - `system` (a string, or `text` blocks joined with nothing between them) becomes the leading system message;
//!   Claude Code's per-request `x-anthropic-billing-header` block is left out, as vLLM leaves it out (it carries a
//!   hash that changes every request and would defeat prefix caching);
//! - a message whose content is a string keeps it; a message of blocks gets its `text` blocks as content (one text
//!   alone as a string), its `tool_use` blocks as `tool_calls` (arguments as Python's `json.dumps` writes them), its
//!   `thinking` as `reasoning`; a user's `tool_result` blocks each become a `tool` message before it, an assistant's
//!   a text part `Tool result: …`; images become `image_url` parts;
//! - `tools` (`name`, `description`, `input_schema`) become function tools.
//!
//! `cache_control` breakpoints, which engines ignore, change nothing here: the key is the prompt's bytes, and a
//! client's breakpoints are where its prompt repeats, which the prefix key finds by itself.

use serde_json::{json, Map, Value};

use crate::prompt::PromptError;

/// The chat completion a Messages request is rendered as.
#[derive(Debug, Clone, PartialEq)]
pub struct Chat {
    pub messages: Value,
    pub tools: Option<Value>,
}

/// The text block Claude Code puts first in `system`, different on every request.
const BILLING_HEADER: &str = "x-anthropic-billing-header";

fn bad(field: &'static str, expected: &'static str) -> PromptError {
    PromptError::Field { field, expected }
}

/// Converts a Messages request's members (`system`, `messages`, `tools`; each absent or `null` alike) into the chat
/// completion the engines render (see the module documentation).
pub fn to_chat(system: Option<&Value>, messages: &Value, tools: Option<&Value>) -> Result<Chat, PromptError> {
    let mut out = Vec::new();
    match system {
        None | Some(Value::Null) => {}
        Some(Value::String(text)) if !text.is_empty() => {
            out.push(json!({"role": "system", "content": text}));
        }
        Some(Value::String(_)) => {}
        Some(Value::Array(blocks)) => {
            let text: String = blocks.iter().filter_map(system_text).collect();
            if !text.is_empty() {
                out.push(json!({"role": "system", "content": text}));
            }
        }
        Some(_) => return Err(bad("system", "a string or an array of text blocks")),
    }
    let messages = messages.as_array().ok_or(bad("messages", "an array of messages"))?;
    for message in messages {
        convert_message(message, &mut out)?;
    }
    let tools = match tools {
        None | Some(Value::Null) => None,
        Some(Value::Array(tools)) => Some(Value::Array(tools.iter().map(convert_tool).collect::<Result<_, _>>()?)),
        Some(_) => return Err(bad("tools", "an array of tools")),
    };
    Ok(Chat {
        messages: Value::Array(out),
        tools,
    })
}

/// A `text` block's text, unless it is empty or the billing header.
fn system_text(block: &Value) -> Option<&str> {
    let text = block.get("text").and_then(Value::as_str)?;
    let is_text = block.get("type").and_then(Value::as_str) == Some("text");
    (is_text && !text.is_empty() && !text.starts_with(BILLING_HEADER)).then_some(text)
}

fn convert_message(message: &Value, out: &mut Vec<Value>) -> Result<(), PromptError> {
    let expected = "an array of objects, each with a string `role` and a `content`";
    let object = message.as_object().ok_or(bad("messages", expected))?;
    let role = object
        .get("role")
        .and_then(Value::as_str)
        .ok_or(bad("messages", expected))?;
    let content = object.get("content").unwrap_or(&Value::Null);
    if role == "system" {
        let text = match content {
            Value::String(text) if !text.starts_with(BILLING_HEADER) => text.clone(),
            Value::Array(blocks) => blocks.iter().filter_map(system_text).collect(),
            _ => String::new(),
        };
        if !text.is_empty() {
            out.push(json!({"role": "system", "content": text}));
        }
        return Ok(());
    }
    let mut chat = Map::new();
    chat.insert("role".into(), Value::from(role));
    match content {
        Value::String(text) => {
            chat.insert("content".into(), Value::from(text.as_str()));
        }
        Value::Array(blocks) => convert_blocks(role, blocks, &mut chat, out)?,
        _ => {
            return Err(bad(
                "messages",
                "a message's `content` as a string or an array of blocks",
            ))
        }
    }
    // A user message made only of tool results is those results alone.
    if role != "user" || chat.contains_key("content") {
        out.push(Value::Object(chat));
    }
    Ok(())
}

/// A message's blocks: its content parts, tool calls and reasoning into `chat`; a user's tool results into `out`
/// (before the message itself).
fn convert_blocks(
    role: &str,
    blocks: &[Value],
    chat: &mut Map<String, Value>,
    out: &mut Vec<Value>,
) -> Result<(), PromptError> {
    let mut parts = Vec::new();
    let mut calls = Vec::new();
    let mut reasoning = String::new();
    let mut thought = false;
    for block in blocks {
        let kind = block.get("type").and_then(Value::as_str).unwrap_or_default();
        let text = |name| block.get(name).and_then(Value::as_str);
        match kind {
            "text" => {
                if let Some(text) = text("text").filter(|t| !t.is_empty()) {
                    parts.push(json!({"type": "text", "text": text}));
                }
            }
            "image" => {
                if let Some(url) = block.get("source").and_then(image_url) {
                    parts.push(json!({"type": "image_url", "image_url": {"url": url}}));
                }
            }
            "thinking" => {
                if let Some(thinking) = text("thinking") {
                    thought = true;
                    reasoning.push_str(thinking);
                }
            }
            "tool_use" => {
                let input = block
                    .get("input")
                    .filter(|v| !is_empty(v))
                    .cloned()
                    .unwrap_or_else(|| json!({}));
                calls.push(json!({
                    "id": text("id").unwrap_or_default(),
                    "type": "function",
                    "function": {"name": text("name").unwrap_or_default(), "arguments": python_dumps(&input)},
                }));
            }
            "tool_result" if role == "user" => tool_result(block, out),
            "tool_result" => {
                let result = match block.get("content") {
                    Some(Value::String(s)) => s.clone(),
                    Some(v) if !is_empty(v) => v.to_string(),
                    _ => String::new(),
                };
                parts.push(json!({"type": "text", "text": format!("Tool result: {result}")}));
            }
            // `redacted_thinking`, `tool_reference` and blocks the engines do not know: nothing.
            _ => {}
        }
    }
    if thought {
        chat.insert("reasoning".into(), Value::from(reasoning));
    }
    if !calls.is_empty() {
        chat.insert("tool_calls".into(), Value::Array(calls));
    }
    match parts.as_slice() {
        [] => {}
        [one] if one["type"] == "text" => {
            chat.insert("content".into(), one["text"].clone());
        }
        _ => {
            chat.insert("content".into(), Value::Array(parts));
        }
    }
    Ok(())
}

/// A user's `tool_result` block: a `tool` message with its text (text items joined with newlines), then its images
/// as a user message.
fn tool_result(block: &Value, out: &mut Vec<Value>) {
    let id = block.get("tool_use_id").and_then(Value::as_str).unwrap_or_default();
    let mut images = Vec::new();
    let text = match block.get("content") {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(items)) => {
            let mut texts = Vec::new();
            for item in items {
                match item.get("type").and_then(Value::as_str) {
                    Some("text") => texts.push(item.get("text").and_then(Value::as_str).unwrap_or_default()),
                    Some("image") => images.extend(item.get("source").and_then(image_url)),
                    _ => {}
                }
            }
            texts.join("\n")
        }
        _ => String::new(),
    };
    out.push(json!({"role": "tool", "tool_call_id": id, "content": text}));
    if !images.is_empty() {
        let parts: Vec<Value> = images
            .into_iter()
            .map(|url| json!({"type": "image_url", "image_url": {"url": url}}))
            .collect();
        out.push(json!({"role": "user", "content": parts}));
    }
}

/// An image source's URL: a `base64` source as a data URL, a `url` source as it is.
fn image_url(source: &Value) -> Option<String> {
    let get = |name| source.get(name).and_then(Value::as_str);
    match get("type")? {
        "base64" => Some(format!(
            "data:{};base64,{}",
            get("media_type").unwrap_or("image/jpeg"),
            get("data")?
        )),
        "url" => get("url").map(str::to_owned),
        _ => None,
    }
}

/// A tool as a chat function tool.
fn convert_tool(tool: &Value) -> Result<Value, PromptError> {
    let name = tool
        .get("name")
        .and_then(Value::as_str)
        .ok_or(bad("tools", "an array of tools, each with a string `name`"))?;
    let mut function = Map::new();
    function.insert("name".into(), Value::from(name));
    if let Some(description) = tool.get("description").filter(|d| !d.is_null()) {
        function.insert("description".into(), description.clone());
    }
    if let Some(schema) = tool.get("input_schema").filter(|s| !s.is_null()) {
        function.insert("parameters".into(), schema.clone());
    }
    Ok(json!({"type": "function", "function": function}))
}

/// Python's falsy JSON values (`None`, `{}`, `[]`, `""`, `0`, `false`), where vLLM writes `x or default`.
fn is_empty(value: &Value) -> bool {
    match value {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
    }
}

/// `value` as Python's `json.dumps` writes it (`", "` and `": "` between items, non-ASCII characters escaped as
/// `\uXXXX`), which is how vLLM writes a tool call's arguments. (Objects come out with their keys sorted, as the
/// gateway reads JSON; a client's tool inputs are the model's own earlier output, whose order this may change.)
pub fn python_dumps(value: &Value) -> String {
    let mut out = String::new();
    dump(value, &mut out);
    out
}

fn dump(value: &Value, out: &mut String) {
    match value {
        Value::Null | Value::Bool(_) | Value::Number(_) => out.push_str(&value.to_string()),
        Value::String(s) => dump_str(s, out),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                dump(item, out);
            }
            out.push(']');
        }
        Value::Object(members) => {
            out.push('{');
            for (i, (key, item)) in members.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                dump_str(key, out);
                out.push_str(": ");
                dump(item, out);
            }
            out.push('}');
        }
    }
}

fn dump_str(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if c.is_ascii() && !c.is_ascii_control() => out.push(c),
            c => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(request: Value) -> Chat {
        to_chat(request.get("system"), &request["messages"], request.get("tools")).unwrap()
    }

    #[test]
    fn system_blocks_join_without_the_billing_header() {
        let request = json!({
            "system": [
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=93f1"},
                {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": " Be brief."},
            ],
            "messages": [{"role": "user", "content": "hi"}],
        });
        assert_eq!(
            chat(request).messages,
            json!([
                {"role": "system", "content": "You are a coding agent. Be brief."},
                {"role": "user", "content": "hi"},
            ])
        );
    }

    #[test]
    fn tool_use_and_tool_result_become_tool_calls_and_tool_messages() {
        let request = json!({
            "system": "sys",
            "tools": [{"name": "read", "description": "Reads a file", "input_schema": {"type": "object"}}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "open a.txt"}]},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Reading it."},
                    {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {"path": "a.txt", "n": [1, 2]}},
                ]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]},
                    {"type": "text", "text": "and now?"},
                ]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "done"}]},
            ],
        });
        let chat = chat(request);
        assert_eq!(
            chat.messages,
            json!([
                {"role": "system", "content": "sys"},
                {"role": "user", "content": "open a.txt"},
                {"role": "assistant", "content": "Reading it.", "tool_calls": [
                    {"id": "toolu_1", "type": "function", "function": {"name": "read", "arguments": "{\"n\": [1, 2], \"path\": \"a.txt\"}"}},
                ]},
                {"role": "tool", "tool_call_id": "toolu_1", "content": "one\ntwo"},
                {"role": "user", "content": "and now?"},
                {"role": "tool", "tool_call_id": "toolu_2", "content": "done"},
            ])
        );
        assert_eq!(
            chat.tools,
            Some(
                json!([{"type": "function", "function": {"name": "read", "description": "Reads a file", "parameters": {"type": "object"}}}])
            )
        );
    }

    #[test]
    fn python_dumps_spaces_items_and_escapes_non_ascii() {
        assert_eq!(
            python_dumps(&json!({"b": "é😀\n\"", "a": [1, true, null, {}]})),
            r#"{"a": [1, true, null, {}], "b": "\u00e9\ud83d\ude00\n\""}"#
        );
        assert_eq!(python_dumps(&json!({})), "{}");
    }

    #[test]
    fn a_messages_body_is_keyed_by_its_chat_rendering_and_its_session_is_the_user() {
        use crate::request::Prompt;
        use crate::request_body::{parse_body, parse_body_as, Api};
        let body = json!({
            "model": "claude-x", "max_tokens": 64, "metadata": {"user_id": "user_1_session_7"},
            "system": [{"type": "text", "text": "You are a coding agent."}],
            "tools": [{"name": "read", "input_schema": {"type": "object"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}],
        });
        let bytes = body.to_string().into_bytes();
        let parsed = parse_body_as(&bytes, false, Api::Messages).unwrap();
        let chat = chat(body.clone());
        let expected = crate::prompt::render_chat(chat.tools.as_ref(), &chat.messages).unwrap();
        assert!(matches!(&parsed.route.prompt, Prompt::Bytes(b) if *b == expected));
        assert_eq!(
            parsed.route.session,
            Some(crate::request::session_hash("user_1_session_7"))
        );
        assert_eq!(parsed.model.as_deref(), Some("claude-x"));
        // Read as an OpenAI chat, the same body keys differently (its system prompt is not a message there).
        assert!(!matches!(parse_body(&bytes, false).unwrap().route.prompt, Prompt::Bytes(b) if b == expected));
        // `prompt_cache_key` names the session first.
        let mut keyed = body;
        keyed["prompt_cache_key"] = json!("k");
        let parsed = parse_body_as(keyed.to_string().as_bytes(), false, Api::Messages).unwrap();
        assert_eq!(parsed.route.session, Some(crate::request::session_hash("k")));
        let none = parse_body_as(br#"{"model": "m", "system": "s"}"#, false, Api::Messages);
        assert!(matches!(none, Err(PromptError::NoPrompt)), "{none:?}");
    }

    #[test]
    fn malformed_requests_are_refused_with_the_field_named() {
        for (system, messages) in [
            (json!(7), json!([])),
            (Value::Null, json!({"role": "user"})),
            (Value::Null, json!([{"content": "no role"}])),
            (Value::Null, json!([{"role": "user", "content": 7}])),
        ] {
            assert!(to_chat(Some(&system), &messages, None).is_err(), "{system} {messages}");
        }
        assert!(to_chat(None, &json!([]), Some(&json!([{"description": "no name"}]))).is_err());
    }
}
