//! A request body read for routing without building a tree of it: the top-level members are located in the
//! original bytes, only the fields routing needs are parsed (token ids straight into integers), and the body a
//! worker gets is assembled from slices of the original bytes.
//!
//! Why: a 60 MB `input_ids` body parsed into a `serde_json::Value` costs about 20 bytes per token id, then as
//! much again to serialize it back; here the gateway holds the body once, plus 4 bytes per token id. The prompt
//! and the errors are exactly those of [`crate::prompt::parse_request`] (same precedence, same messages), which
//! the tests check against each other.
//!
//! Cost: one validating pass over the bytes (nested values are checked, not built; a chat's `messages` are read
//! for rendering in that same pass), plus parsing the other routing fields themselves.

use std::borrow::Cow;
use std::fmt;
use std::ops::Range;

use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

use crate::json_key::Key;
use crate::prompt::{self, PromptError};
use crate::request::{Prompt, RouteRequest};

/// The members that carry a client's rank override.
pub const OVERRIDE_FIELDS: [&str; 2] = ["routed_dp_rank", "data_parallel_rank"];

/// The members that pair a request's prefill and decode legs under disaggregation: SGLang's bootstrap fields and
/// vLLM's `kv_transfer_params`. The gateway sets them on a disaggregated request's legs, never the client.
pub const DISAGGREGATION_FIELDS: [&str; 5] = [
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "disagg_prefill_dp_rank",
    "kv_transfer_params",
];

/// What a top-level member is to the gateway.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemberKind {
    /// A client's rank override ([`OVERRIDE_FIELDS`]): the worker never sees the client's.
    RankOverride,
    /// `model` (replaced when the gateway maps an alias).
    Model,
    /// A disaggregation field ([`DISAGGREGATION_FIELDS`]) but `bootstrap_room`: what steers a KV transfer (where
    /// from, which rank, the connector's parameters), never a client's to set.
    Disaggregation,
    /// `bootstrap_room`: pairs SGLang's legs, and `follow_bootstrap_room` routes by a client's.
    BootstrapRoom,
    /// `stream`, `stream_options`: what vLLM's prefill leg gets its own of (not streamed).
    Streaming,
    /// `max_tokens`, `max_completion_tokens`, `max_output_tokens`, `min_tokens`: what vLLM's prefill leg gets its
    /// own of (one token).
    Length,
    /// Anything else.
    Other,
}

impl MemberKind {
    /// A member that pairs a disaggregated request's legs ([`DISAGGREGATION_FIELDS`]).
    pub fn is_pairing(self) -> bool {
        matches!(self, MemberKind::Disaggregation | MemberKind::BootstrapRoom)
    }

    fn of(key: &str) -> Self {
        if OVERRIDE_FIELDS.contains(&key) {
            MemberKind::RankOverride
        } else if key == "model" {
            MemberKind::Model
        } else if key == "bootstrap_room" {
            MemberKind::BootstrapRoom
        } else if DISAGGREGATION_FIELDS.contains(&key) {
            MemberKind::Disaggregation
        } else if matches!(key, "stream" | "stream_options") {
            MemberKind::Streaming
        } else if matches!(
            key,
            "max_tokens" | "max_completion_tokens" | "max_output_tokens" | "min_tokens"
        ) {
            MemberKind::Length
        } else {
            MemberKind::Other
        }
    }
}

/// A request body, parsed for routing.
#[derive(Debug)]
pub struct RequestBody {
    pub route: RouteRequest,
    /// Where its members are, to forward it.
    pub layout: Layout,
    /// The `model` member, when it is a string (for logs; routing does not read it).
    pub model: Option<String>,
    /// OpenAI Responses' `previous_response_id`, when it is a string: the conversation continues a response that
    /// one worker stored.
    pub previous_response_id: Option<String>,
}

/// Where a body's top-level members are in its bytes, and which ones the worker never sees.
#[derive(Debug, Clone)]
pub struct Layout {
    /// Byte range of each top-level member (`"key": value`), in order.
    members: Vec<Range<usize>>,
    /// What each member is.
    kinds: Vec<MemberKind>,
}

/// One top-level member: its key (unescaped) and its raw value.
struct Member<'a> {
    key: Cow<'a, str>,
    value: Value_<'a>,
}

/// A member's value: raw, or (the first `messages` member only) read for rendering as it was parsed, which spares
/// a second pass over what is most of a chat body's bytes.
enum Value_<'a> {
    Raw(&'a RawValue),
    /// Taken out for rendering once the members are all read.
    Messages(Option<crate::chat::Messages<'a>>),
}

impl<'a> Member<'a> {
    fn raw(&self) -> Option<&'a RawValue> {
        match self.value {
            Value_::Raw(raw) => Some(raw),
            Value_::Messages(_) => None,
        }
    }
}

/// Every top-level member of an object, in order, values unparsed.
struct Members<'a>(Vec<Member<'a>>);

impl<'de> Deserialize<'de> for Members<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct MembersVisitor;
        impl<'de> Visitor<'de> for MembersVisitor {
            type Value = Members<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut members: Vec<Member<'de>> = Vec::new();
                let mut messages_read = false;
                while let Some(Key(key)) = map.next_key()? {
                    let value = if key == "messages" && !messages_read {
                        messages_read = true;
                        Value_::Messages(Some(map.next_value()?))
                    } else {
                        Value_::Raw(map.next_value()?)
                    };
                    members.push(Member { key, value });
                }
                Ok(Members(members))
            }
        }
        d.deserialize_map(MembersVisitor)
    }
}

/// Which API a body speaks: what its members mean.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Api {
    /// OpenAI's (chat and text completions, Responses, embeddings) and SGLang's `/generate`: the prompt is the
    /// first of `input_ids`, `text`, `prompt`, `messages` (with `tools`), `input` that the body has.
    #[default]
    OpenAi,
    /// Anthropic's Messages API (`/v1/messages`): the prompt is its `system`, `messages` and `tools`, rendered as
    /// the engines render them ([`crate::anthropic`]); the session, when no `prompt_cache_key` names one, is
    /// `metadata.user_id`.
    Messages,
}

/// Parses `bytes` for routing. With `read_overrides` false the client's rank override fields are not read (nor
/// checked); either way they never reach the worker ([`Layout::forwarded`]).
pub fn parse_body(bytes: &[u8], read_overrides: bool) -> Result<RequestBody, PromptError> {
    parse_body_as(bytes, read_overrides, Api::OpenAi)
}

/// [`parse_body`] for a body of `api`.
pub fn parse_body_as(bytes: &[u8], read_overrides: bool, api: Api) -> Result<RequestBody, PromptError> {
    let text = std::str::from_utf8(bytes).map_err(|e| PromptError::InvalidJson(format!("invalid UTF-8: {e}")))?;
    let Members(mut members) = serde_json::from_str(text).map_err(|e| match e.classify() {
        serde_json::error::Category::Data => PromptError::NotAnObject,
        _ => PromptError::InvalidJson(e.to_string()),
    })?;
    let spans = spans(text, &members);
    let messages = members.iter_mut().find_map(|m| match &mut m.value {
        Value_::Messages(parsed) => parsed.take(),
        Value_::Raw(_) => None,
    });
    let field = |name: &str| -> Result<Option<&RawValue>, PromptError> {
        let mut found = members.iter().filter(|m| m.key == name).filter_map(Member::raw);
        let first = found.next();
        if found.next().is_some() {
            return Err(PromptError::Duplicate(name.to_owned()));
        }
        // `null` is as good as absent, as in `parse_request`.
        Ok(first.filter(|v| v.get() != "null"))
    };
    let prompt = if api == Api::Messages {
        let (_, messages) = chat_messages(&members, &spans, text, messages)?.ok_or(PromptError::NoPrompt)?;
        let messages: Value = serde_json::from_str(messages).map_err(|e| PromptError::InvalidJson(e.to_string()))?;
        let system = field("system")?.map(value).transpose()?;
        let tools = field("tools")?.map(value).transpose()?;
        let chat = crate::anthropic::to_chat(system.as_ref(), &messages, tools.as_ref())?;
        Prompt::Bytes(prompt::render_chat(chat.tools.as_ref(), &chat.messages)?)
    } else if let Some(ids) = field("input_ids")? {
        token_ids(ids, "input_ids")?
    } else if let Some(text) = field("text")? {
        prompt::single_string(&value(text)?, "text")?
    } else if let Some(p) = field("prompt")? {
        if starts_with_number_array(p.get()) {
            token_ids(p, "prompt")?
        } else {
            prompt::single_string(&value(p)?, "prompt")?
        }
    } else if let Some((messages, _)) = chat_messages(&members, &spans, text, messages)? {
        let tools = field("tools")?.map(value).transpose()?;
        Prompt::Bytes(crate::chat::render(tools.as_ref(), messages)?)
    } else if let Some(input) = field("input")? {
        let instructions = field("instructions")?.map(value).transpose()?;
        let tools = field("tools")?.map(value).transpose()?;
        prompt::input_prompt(&value(input)?, instructions.as_ref(), tools.as_ref())?
    } else {
        return Err(PromptError::NoPrompt);
    };
    let mut route = RouteRequest::new(prompt);
    if read_overrides {
        for name in OVERRIDE_FIELDS {
            if let Some(v) = field(name)? {
                route.rank_override = Some(v.get().parse::<i64>().map_err(|_| PromptError::Field {
                    field: name,
                    expected: "an integer",
                })?);
                break;
            }
        }
    }
    // OpenAI's `prompt_cache_key`: a hint, so anything but a string is ignored (the engine judges it).
    route.session = field("prompt_cache_key")?
        .and_then(|k| serde_json::from_str::<String>(k.get()).ok())
        .map(|k| crate::request::session_hash(&k));
    if api == Api::Messages && route.session.is_none() {
        // Anthropic's clients name their user (Claude Code: its user, account and session) here.
        #[derive(Deserialize)]
        struct Metadata {
            user_id: Option<String>,
        }
        route.session = field("metadata")?
            .and_then(|m| serde_json::from_str::<Metadata>(m.get()).ok()?.user_id)
            .map(|id| crate::request::session_hash(&id));
    }
    if let Some(room) = field("bootstrap_room")? {
        route.bootstrap_room = Some(room.get().parse::<u64>().map_err(|_| PromptError::Field {
            field: "bootstrap_room",
            expected: "a non-negative integer",
        })?);
    }
    // As the engine reads it (the last one, if repeated). A model that is not a string is refused here: the
    // gateway chooses the workers by it.
    let model = match members.iter().rev().find(|m| m.key == "model").and_then(Member::raw) {
        Some(v) if v.get() != "null" => {
            Some(serde_json::from_str::<String>(v.get()).map_err(|_| PromptError::Field {
                field: "model",
                expected: "a string",
            })?)
        }
        _ => None,
    };
    let previous_response_id = field("previous_response_id")?.and_then(|v| serde_json::from_str(v.get()).ok());
    Ok(RequestBody {
        route,
        model,
        previous_response_id,
        layout: Layout {
            kinds: members.iter().map(|m| MemberKind::of(&m.key)).collect(),
            members: spans,
        },
    })
}

/// Byte range of each member (`"key": value`) in `text`, the object the members were read from.
///
/// A raw value is a slice of `text`, so its end is known; a member starts at its key, the first quote after the
/// previous member (or the opening brace). The `messages` member read for rendering has no slice: it ends at
/// the last non-blank byte before the comma that precedes the next member's key (found backwards from that
/// member's raw value), or before the closing brace. Only the first `messages` is read so, so the member after
/// it is always raw.
fn spans(text: &str, members: &[Member<'_>]) -> Vec<Range<usize>> {
    let base = text.as_ptr() as usize;
    let mut spans = Vec::with_capacity(members.len());
    let mut from = 0;
    for (i, m) in members.iter().enumerate() {
        let key_start = from + text[from..].find('"').unwrap_or(0);
        let end = match m.raw() {
            Some(raw) => raw.get().as_ptr() as usize - base + raw.get().len(),
            None => {
                let next = match members.get(i + 1).and_then(Member::raw) {
                    Some(raw) => key_start_before(text, raw.get().as_ptr() as usize - base),
                    None => text.trim_end().len().saturating_sub(1),
                };
                let before = text[..next].trim_end();
                before.strip_suffix(',').unwrap_or(before).trim_end().len()
            }
        };
        spans.push(key_start..end);
        from = end;
    }
    spans
}

/// Where the key of the member whose value starts at `value_start` begins: back over `"key" :`, where the key's
/// opening quote is the first quote found backwards that an even number of backslashes precedes.
fn key_start_before(text: &str, value_start: usize) -> usize {
    let bytes = text.as_bytes();
    let colon = text[..value_start].trim_end().len().saturating_sub(1);
    let closing = text[..colon].trim_end().len().saturating_sub(1);
    let mut at = closing;
    while let Some(quote) = bytes[..at].iter().rposition(|&b| b == b'"') {
        let backslashes = bytes[..quote].iter().rev().take_while(|&&b| b == b'\\').count();
        if backslashes % 2 == 0 {
            return quote;
        }
        at = quote;
    }
    0
}

/// The chat's `messages`, read in the members' pass, and its raw JSON, with `parse_request`'s rules: absent or
/// `null` is no messages, and twice is an error.
fn chat_messages<'a, 't>(
    members: &[Member<'_>],
    spans: &[Range<usize>],
    text: &'t str,
    messages: Option<crate::chat::Messages<'a>>,
) -> Result<Option<(crate::chat::Messages<'a>, &'t str)>, PromptError> {
    let mut found = members.iter().zip(spans).filter(|(m, _)| m.key == "messages");
    let Some((_, span)) = found.next() else {
        return Ok(None);
    };
    if found.next().is_some() {
        return Err(PromptError::Duplicate("messages".to_owned()));
    }
    // The value after the key's closing quote and the colon.
    let member = &text[span.clone()];
    let value = member.split_once(':').map_or("", |(_, v)| v).trim();
    Ok(messages.filter(|_| value != "null").map(|m| (m, value)))
}

fn value(raw: &RawValue) -> Result<Value, PromptError> {
    serde_json::from_str(raw.get()).map_err(|e| PromptError::InvalidJson(e.to_string()))
}

/// `[` then, after any whitespace, a number: a completions `prompt` given as token ids.
fn starts_with_number_array(raw: &str) -> bool {
    let mut rest = raw.trim_start().strip_prefix('[').unwrap_or("").trim_start().bytes();
    rest.next().is_some_and(|b| b == b'-' || b.is_ascii_digit())
}

/// Token ids parsed straight into integers, with `parse_request`'s errors.
fn token_ids(raw: &RawValue, field: &'static str) -> Result<Prompt, PromptError> {
    let text = raw.get();
    if text
        .trim_start()
        .strip_prefix('[')
        .is_some_and(|r| r.trim_start().starts_with('['))
    {
        return Err(PromptError::Batch(field));
    }
    if !text.starts_with('[') {
        return Err(PromptError::Field {
            field,
            expected: "an array of token ids",
        });
    }
    // Sized once, to the ids the array can hold (one more than its commas): a vector grown by doubling would hold
    // up to twice that, and both its old and new buffers at the last growth (4 bytes an id, against as few as 2
    // bytes of body).
    // (A valid array has at most one id per two bytes, whatever its commas.)
    let commas = text.bytes().filter(|&b| b == b',').count();
    let mut ids = Vec::with_capacity((commas + 1).min(text.len() / 2 + 1));
    let mut de = serde_json::Deserializer::from_str(text);
    IdsInto(&mut ids)
        .deserialize(&mut de)
        .and_then(|()| de.end())
        .map_err(|_| PromptError::Field {
            field,
            expected: "an array of token ids (integers in 0..2^32)",
        })?;
    Ok(Prompt::Tokens(ids))
}

/// Reads a JSON array of `u32` into a vector the caller sized.
struct IdsInto<'v>(&'v mut Vec<u32>);

impl<'de> DeserializeSeed<'de> for IdsInto<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for IdsInto<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an array of token ids")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while let Some(id) = seq.next_element::<u32>()? {
            self.0.push(id);
        }
        Ok(())
    }
}

impl Layout {
    /// The body for a worker, as slices of `original` (the bytes this was parsed from): every member but the
    /// client's rank overrides and those `dropped` (its `model` when the gateway maps it, say), after the members
    /// `first` (e.g. `"routed_dp_rank":3`, or a `model` the gateway maps). Nothing is copied.
    /// Whether the body has a member of `kind`.
    pub fn has(&self, kind: MemberKind) -> bool {
        self.kinds.contains(&kind)
    }

    pub fn forwarded<B: Clone>(
        &self,
        original: &B,
        first: impl IntoIterator<Item = B>,
        dropped: impl Fn(MemberKind) -> bool,
        slice: impl Fn(&B, Range<usize>) -> B,
    ) -> Vec<Piece<B>> {
        let mut out = vec![Piece::Text("{")];
        let mut empty = true;
        for member in first {
            if !empty {
                out.push(Piece::Text(","));
            }
            out.push(Piece::Bytes(member));
            empty = false;
        }
        for (span, &kind) in self.members.iter().zip(&self.kinds) {
            if kind == MemberKind::RankOverride || dropped(kind) {
                continue;
            }
            if !empty {
                out.push(Piece::Text(","));
            }
            empty = false;
            out.push(Piece::Bytes(slice(original, span.clone())));
        }
        out.push(Piece::Text("}"));
        out
    }
}

/// One piece of a forwarded body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece<B> {
    Text(&'static str),
    Bytes(B),
}

#[cfg(test)]
#[path = "request_body_tests.rs"]
mod tests;
