//! A request body read for routing without building a tree of it: the top-level members are located in the
//! original bytes, only the fields routing needs are parsed (token ids straight into integers), and the body a
//! worker gets is assembled from slices of the original bytes.
//!
//! Why: a 60 MB `input_ids` body parsed into a `serde_json::Value` costs about 20 bytes per token id, then as
//! much again to serialize it back; here the gateway holds the body once, plus 4 bytes per token id. The prompt
//! and the errors are exactly those of [`crate::prompt::parse_request`] (same precedence, same messages), which
//! the tests check against each other.
//!
//! Cost: one validating pass over the bytes (nested values are checked, not built), plus parsing the routing
//! fields themselves.

use std::borrow::Cow;
use std::fmt;
use std::ops::Range;

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

use crate::prompt::{self, PromptError};
use crate::request::{Prompt, RouteRequest};

/// The members that carry a client's rank override.
pub const OVERRIDE_FIELDS: [&str; 2] = ["routed_dp_rank", "data_parallel_rank"];

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
    /// Which members are rank overrides (the worker never sees the client's).
    overrides: Vec<bool>,
    /// Which members are `model` (replaced when the gateway maps an alias).
    models: Vec<bool>,
}

/// One top-level member: its key (unescaped) and its raw value.
struct Member<'a> {
    key: Cow<'a, str>,
    value: &'a RawValue,
}

/// Every top-level member of an object, in order, values unparsed.
struct Members<'a>(Vec<Member<'a>>);

/// An object key, borrowed from the input when it has no escapes.
pub(crate) struct Key<'a>(pub(crate) Cow<'a, str>);

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Key(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Key(Cow::Owned(v.to_owned())))
            }
        }
        d.deserialize_str(KeyVisitor)
    }
}

impl<'de> Deserialize<'de> for Members<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct MembersVisitor;
        impl<'de> Visitor<'de> for MembersVisitor {
            type Value = Members<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut members = Vec::new();
                while let Some(Key(key)) = map.next_key()? {
                    let value: &'de RawValue = map.next_value()?;
                    members.push(Member { key, value });
                }
                Ok(Members(members))
            }
        }
        d.deserialize_map(MembersVisitor)
    }
}

/// Parses `bytes` for routing. With `read_overrides` false the client's rank override fields are not read (nor
/// checked); either way they never reach the worker ([`Layout::forwarded`]).
pub fn parse_body(bytes: &[u8], read_overrides: bool) -> Result<RequestBody, PromptError> {
    let text = std::str::from_utf8(bytes).map_err(|e| PromptError::InvalidJson(format!("invalid UTF-8: {e}")))?;
    let Members(members) = serde_json::from_str(text).map_err(|e| match e.classify() {
        serde_json::error::Category::Data => PromptError::NotAnObject,
        _ => PromptError::InvalidJson(e.to_string()),
    })?;
    let field = |name: &str| -> Result<Option<&RawValue>, PromptError> {
        let mut found = members.iter().filter(|m| m.key == name).map(|m| m.value);
        let first = found.next();
        if found.next().is_some() {
            return Err(PromptError::Duplicate(name.to_owned()));
        }
        // `null` is as good as absent, as in `parse_request`.
        Ok(first.filter(|v| v.get() != "null"))
    };
    let prompt = if let Some(ids) = field("input_ids")? {
        token_ids(ids, "input_ids")?
    } else if let Some(text) = field("text")? {
        prompt::single_string(&value(text)?, "text")?
    } else if let Some(p) = field("prompt")? {
        if starts_with_number_array(p.get()) {
            token_ids(p, "prompt")?
        } else {
            prompt::single_string(&value(p)?, "prompt")?
        }
    } else if let Some(messages) = field("messages")? {
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
    if let Some(room) = field("bootstrap_room")? {
        route.bootstrap_room = Some(room.get().parse::<u64>().map_err(|_| PromptError::Field {
            field: "bootstrap_room",
            expected: "a non-negative integer",
        })?);
    }
    let base = text.as_ptr() as usize;
    let mut spans = Vec::with_capacity(members.len());
    let mut from = 0;
    for m in &members {
        let start = m.value.get().as_ptr() as usize - base;
        let end = start + m.value.get().len();
        // The member starts at its key: the first quote after the previous member (or the opening brace).
        let key_start = from + text[from..start].find('"').unwrap_or(0);
        spans.push(key_start..end);
        from = end;
    }
    // As the engine reads it (the last one, if repeated); anything but a string is left to the engine to refuse.
    let model = members
        .iter()
        .rev()
        .find(|m| m.key == "model")
        .and_then(|m| serde_json::from_str::<String>(m.value.get()).ok());
    let previous_response_id = field("previous_response_id")?.and_then(|v| serde_json::from_str(v.get()).ok());
    Ok(RequestBody {
        route,
        model,
        previous_response_id,
        layout: Layout {
            overrides: members
                .iter()
                .map(|m| OVERRIDE_FIELDS.contains(&m.key.as_ref()))
                .collect(),
            models: members.iter().map(|m| m.key == "model").collect(),
            members: spans,
        },
    })
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
    serde_json::from_str::<Vec<u32>>(text)
        .map(Prompt::Tokens)
        .map_err(|_| PromptError::Field {
            field,
            expected: "an array of token ids (integers in 0..2^32)",
        })
}

impl Layout {
    /// The body for a worker, as slices of `original` (the bytes this was parsed from): every member but the
    /// client's rank overrides (and its `model` when `drop_model`), after the members `first` (e.g.
    /// `"routed_dp_rank":3`, or a `model` the gateway maps). Nothing is copied.
    pub fn forwarded<B: Clone>(
        &self,
        original: &B,
        first: impl IntoIterator<Item = B>,
        drop_model: bool,
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
        for ((span, is_override), is_model) in self.members.iter().zip(&self.overrides).zip(&self.models) {
            if *is_override || (drop_model && *is_model) {
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
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn forwarded(body: &str, rank: Option<&str>) -> String {
        let parsed = parse_body(body.as_bytes(), true).unwrap();
        parsed
            .layout
            .forwarded(&body.to_string(), rank.map(str::to_owned), false, |s, r| {
                s[r].to_string()
            })
            .into_iter()
            .map(|p| match p {
                Piece::Text(t) => t.to_string(),
                Piece::Bytes(b) => b,
            })
            .collect()
    }

    #[test]
    fn the_worker_gets_every_member_but_the_overrides_and_the_rank_first() {
        let body = r#" { "routed_dp_rank" : 1 , "prompt": "x", "a": {"b": [1, {"c": "}"}]},"data_parallel_rank":2,"z":null } "#;
        let out = forwarded(body, Some(r#""routed_dp_rank":3"#));
        assert_eq!(
            out,
            r#"{"routed_dp_rank":3,"prompt": "x","a": {"b": [1, {"c": "}"}]},"z":null}"#
        );
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(
            v,
            json!({"routed_dp_rank": 3, "prompt": "x", "a": {"b": [1, {"c": "}"}]}, "z": null})
        );
        assert_eq!(forwarded(r#"{"prompt":"x"}"#, None), r#"{"prompt":"x"}"#);
        assert_eq!(forwarded(r#"{"routed_dp_rank":0,"text":"x"}"#, None), r#"{"text":"x"}"#);
    }

    #[test]
    fn keys_with_escapes_are_matched_and_kept_whole() {
        let body = r#"{"k\"ey": 1, "t\u0065xt": "x", "routed\u005fdp_rank": 4}"#;
        let parsed = parse_body(body.as_bytes(), true).unwrap();
        assert_eq!(parsed.route.prompt, Prompt::Bytes(b"x".to_vec()));
        assert_eq!(parsed.route.rank_override, Some(4));
        assert_eq!(forwarded(body, None), r#"{"k\"ey": 1,"t\u0065xt": "x"}"#);
    }

    #[test]
    fn the_model_member_can_be_replaced() {
        let body = r#"{"model": "alias", "prompt": "x"}"#.to_string();
        let parsed = parse_body(body.as_bytes(), true).unwrap();
        let out: String = parsed
            .layout
            .forwarded(&body, [r#""model":"served""#.to_string()], true, |s, r| {
                s[r].to_string()
            })
            .into_iter()
            .map(|p| match p {
                Piece::Text(t) => t.to_string(),
                Piece::Bytes(b) => b,
            })
            .collect();
        assert_eq!(out, r#"{"model":"served","prompt": "x"}"#);
    }

    #[test]
    fn a_prompt_cache_key_is_the_session_hint_and_the_model_is_read() {
        let body = parse_body(br#"{"prompt": "x", "prompt_cache_key": "user-7", "model": "m"}"#, true).unwrap();
        assert_eq!(body.route.session, Some(crate::request::session_hash("user-7")));
        assert_eq!(body.model.as_deref(), Some("m"));
        let next = parse_body(br#"{"input": "more", "previous_response_id": "resp_1"}"#, true).unwrap();
        assert_eq!(next.previous_response_id.as_deref(), Some("resp_1"));
        let odd = parse_body(br#"{"prompt": "x", "prompt_cache_key": 7, "model": 1}"#, true).unwrap();
        assert_eq!(
            (odd.route.session, odd.model),
            (None, None),
            "hints that are not strings are ignored"
        );
    }

    #[test]
    fn a_message_with_duplicate_keys_renders_as_its_tree_does() {
        let body = r#"{"messages":[{"role":7,"content":"a","role":"user","x":1,"content":"b\u0021","x":2}]}"#;
        let tree = prompt::parse_request(&serde_json::from_str(body).unwrap()).unwrap();
        let view = parse_body(body.as_bytes(), true).unwrap();
        assert_eq!(view.route.prompt, tree.prompt);
        assert_eq!(view.route.prompt, Prompt::Bytes(b"<|user|>\nb!\n{\"x\":2}\n".to_vec()));
    }

    #[test]
    fn overrides_are_not_read_when_not_allowed() {
        let body = br#"{"text": "x", "routed_dp_rank": "two"}"#;
        assert!(parse_body(body, true).is_err());
        let parsed = parse_body(body, false).unwrap();
        assert_eq!(parsed.route.rank_override, None);
    }

    #[test]
    fn duplicate_routing_fields_are_refused() {
        let err = parse_body(br#"{"text": "a", "text": "b"}"#, true).unwrap_err();
        assert_eq!(err, PromptError::Duplicate("text".into()));
        assert!(
            parse_body(br#"{"text": "a", "x": 1, "x": 2}"#, true).is_ok(),
            "other keys are the worker's business"
        );
    }

    /// Chat conversations with every kind of message the rendering distinguishes.
    fn messages() -> impl Strategy<Value = Value> {
        let role = prop_oneof![
            Just(json!("user")),
            Just(json!("as\"sis\u{e9}tant")),
            Just(json!(7)),
            Just(json!(null)),
        ];
        let content = prop_oneof![
            Just(json!("plain")),
            Just(json!("esc\\aped \"q\" \n \u{1F600}")),
            Just(json!(null)),
            Just(json!([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "u"}}])),
            Just(json!([])),
            Just(json!(3)),
            Just(json!({"text": "x"})),
        ];
        let extra = prop_oneof![
            Just(None),
            Just(Some(("name", json!("n")))),
            Just(Some((
                "tool_calls",
                json!([{"id": "c", "function": {"name": "f", "arguments": "{}"}}])
            ))),
        ];
        let message = (proptest::option::of(role), proptest::option::of(content), extra, 0u8..8).prop_map(
            |(role, content, extra, shape)| {
                if shape == 0 {
                    return json!("not an object");
                }
                let mut m = serde_json::Map::new();
                if let Some(r) = role {
                    m.insert("role".into(), r);
                }
                if let Some(c) = content {
                    m.insert("content".into(), c);
                }
                if let Some((k, v)) = extra {
                    m.insert(k.into(), v);
                }
                Value::Object(m)
            },
        );
        prop::collection::vec(message, 0..4).prop_map(Value::Array)
    }

    /// Request-shaped JSON, including the awkward cases of each field.
    fn body() -> impl Strategy<Value = Value> {
        let field = prop_oneof![
            Just(("input_ids", json!([1, 2, 3]))),
            Just(("input_ids", json!([[1], [2]]))),
            Just(("input_ids", json!([1.5]))),
            Just(("input_ids", json!([-1]))),
            Just(("input_ids", json!([4294967296u64]))),
            Just(("input_ids", json!("12"))),
            Just(("input_ids", json!([]))),
            Just(("text", json!("hello"))),
            Just(("text", json!(["one"]))),
            Just(("text", json!(["a", "b"]))),
            Just(("text", json!(5))),
            Just(("prompt", json!("p"))),
            Just(("prompt", json!([7, 8]))),
            Just(("prompt", json!(["only"]))),
            Just(("prompt", json!([]))),
            Just(("prompt", json!({"x": 1}))),
            Just(("messages", json!([{"role": "user", "content": "hi"}]))),
            Just((
                "messages",
                json!([{"role": "user", "content": [{"type": "text", "text": "a"}]}])
            )),
            Just(("messages", json!("hi"))),
            Just(("messages", json!([1]))),
            Just(("tools", json!([{"type": "function"}]))),
            Just(("tools", json!("x"))),
            Just(("routed_dp_rank", json!(2))),
            Just(("routed_dp_rank", json!(-1))),
            Just(("routed_dp_rank", json!("1"))),
            Just(("routed_dp_rank", json!(1.0))),
            Just(("data_parallel_rank", json!(3))),
            Just(("data_parallel_rank", json!(null))),
            Just(("bootstrap_room", json!(9))),
            Just(("bootstrap_room", json!(-9))),
            Just(("stream", json!(true))),
            Just(("text", json!(null))),
            Just(("input", json!("embed me"))),
            Just(("input", json!(["a", "b"]))),
            Just(("input", json!([1, 2, 3]))),
            Just(("input", json!([[1, 2], [3]]))),
            Just(("input", json!([{"role": "user", "content": "hi"}]))),
            Just(("input", json!([1, "a"]))),
            Just(("input", json!(5))),
            Just((
                "input",
                json!([{"type": "function_call_output", "call_id": "c", "output": "1"}])
            )),
            Just(("input", json!([{"content": "neither role nor type"}]))),
            Just(("instructions", json!("be brief"))),
            Just(("instructions", json!(7))),
        ];
        let field = prop_oneof![3 => field, 1 => messages().prop_map(|m| ("messages", m))];
        prop::collection::vec(field, 0..6).prop_map(|fields| {
            let mut map = serde_json::Map::new();
            for (k, v) in fields {
                map.insert(k.to_string(), v);
            }
            Value::Object(map)
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]

        /// The borrowed parse agrees with the tree parse on every request: same prompt, override and room, or
        /// the same error; and the forwarded body is the object without the overrides.
        #[test]
        fn agrees_with_the_tree_parse(value in body(), pretty in any::<bool>()) {
            let text = if pretty { serde_json::to_string_pretty(&value).unwrap() } else { value.to_string() };
            let tree = prompt::parse_request(&value);
            let view = parse_body(text.as_bytes(), true);
            match (&tree, &view) {
                (Ok(a), Ok(b)) => {
                    prop_assert_eq!(&a.prompt, &b.route.prompt);
                    prop_assert_eq!(a.rank_override, b.route.rank_override);
                    prop_assert_eq!(a.bootstrap_room, b.route.bootstrap_room);
                    let out: Value = serde_json::from_str(&forwarded(&text, None)).unwrap();
                    let mut expected = value.as_object().unwrap().clone();
                    for f in OVERRIDE_FIELDS {
                        expected.remove(f);
                    }
                    prop_assert_eq!(out, Value::Object(expected));
                }
                (Err(a), Err(b)) => prop_assert_eq!(a, b),
                _ => prop_assert!(false, "tree {:?} vs view {:?} for {}", tree, view, text),
            }
        }

        /// Any bytes: parsed or refused, never a panic.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256), overrides in any::<bool>()) {
            let _ = parse_body(&bytes, overrides);
        }
    }
}
