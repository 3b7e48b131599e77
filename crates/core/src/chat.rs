//! The canonical chat rendering ([`crate::prompt`]) of a request's `messages`, read from a borrowed view of the
//! raw JSON instead of a `serde_json::Value` tree: message roles and string contents are slices of the request's
//! bytes (copied once, into the rendering; unescaped only when they hold escapes), and only what the rendering
//! prints as JSON (content parts, a message's extra fields) is built as values. The result and the errors are
//! those of [`crate::prompt::render_chat`], which the tests check against each other.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::json_key::Key;
use crate::prompt::{self, PromptError};

/// Renders `tools` and a request's `messages` member, read as it was parsed (in the same pass as the body's other
/// members: [`crate::request_body`]).
pub(crate) fn render(tools: Option<&Value>, Messages(messages): Messages<'_>) -> Result<Vec<u8>, PromptError> {
    let messages = messages.ok_or(PromptError::Field {
        field: "messages",
        expected: "an array of messages",
    })?;
    // Room for the roles and string contents, so that a long prompt is not moved as it grows.
    let text: usize = messages
        .iter()
        .map(|m| match m {
            Message::Object { role, content, .. } => {
                let role = match role {
                    Some(Text::Str(r)) => r.len(),
                    _ => 0,
                };
                let content = match content {
                    Some(Content::Str(c)) => c.len(),
                    _ => 0,
                };
                role + content + 8
            }
            Message::NotObject => 0,
        })
        .sum();
    let mut out = String::with_capacity(text);
    prompt::render_tools(tools, &mut out)?;
    for message in messages {
        render_message(message, &mut out)?;
    }
    Ok(out.into_bytes())
}

fn render_message(message: Message<'_>, out: &mut String) -> Result<(), PromptError> {
    let bad = PromptError::Field {
        field: "messages",
        expected: "an array of objects, each with a string `role`",
    };
    let Message::Object { role, content, extras } = message else {
        return Err(bad);
    };
    let Some(Text::Str(role)) = role else {
        return Err(bad);
    };
    out.push_str("<|");
    out.push_str(&role);
    out.push_str("|>\n");
    match content {
        None | Some(Content::Null) => {}
        Some(Content::Str(text)) => out.push_str(&text),
        Some(Content::Parts(parts)) => prompt::render_parts(&parts, out),
        Some(Content::Other) => {
            return Err(PromptError::Field {
                field: "messages[].content",
                expected: "a string, an array of content parts, or null",
            })
        }
    }
    if !extras.is_empty() {
        out.push('\n');
        out.push_str(&Value::Object(extras).to_string());
    }
    out.push('\n');
    Ok(())
}

/// `messages`: an array of messages, or (`None`) anything else.
pub(crate) struct Messages<'a>(Option<Vec<Message<'a>>>);

/// One message: an object (its last `role` and `content`, and its other fields), or anything else.
enum Message<'a> {
    Object {
        role: Option<Text<'a>>,
        content: Option<Content<'a>>,
        extras: Map<String, Value>,
    },
    NotObject,
}

/// A string, or anything else.
enum Text<'a> {
    Str(Cow<'a, str>),
    NotStr,
}

/// A message's content as the rendering sees it.
enum Content<'a> {
    Str(Cow<'a, str>),
    Null,
    Parts(Vec<Value>),
    Other,
}

/// The number and boolean cases of a visitor that takes any JSON value: each is `$value`.
macro_rules! scalars_are {
    ($value:expr) => {
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("any JSON value")
        }
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
            Ok($value)
        }
        fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
            Ok($value)
        }
    };
}

/// A string visitor case: borrowed from the input when it has no escapes.
macro_rules! strings_are {
    ($variant:path) => {
        fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
            Ok($variant(Cow::Borrowed(v)))
        }
        fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
            Ok($variant(Cow::Owned(v)))
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
            Ok($variant(Cow::Owned(v.to_owned())))
        }
    };
}

fn skip_seq<'de, A: SeqAccess<'de>>(mut seq: A) -> Result<(), A::Error> {
    while seq.next_element::<IgnoredAny>()?.is_some() {}
    Ok(())
}

fn skip_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<(), A::Error> {
    while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
    Ok(())
}

impl<'de> Deserialize<'de> for Messages<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Messages<'de>;
            scalars_are!(Messages(None));
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(Messages(None))
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
                Ok(Messages(None))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut messages = Vec::new();
                while let Some(m) = seq.next_element()? {
                    messages.push(m);
                }
                Ok(Messages(Some(messages)))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                skip_map(map).map(|()| Messages(None))
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for Message<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Message<'de>;
            scalars_are!(Message::NotObject);
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(Message::NotObject)
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<Self::Value, E> {
                Ok(Message::NotObject)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
                skip_seq(seq).map(|()| Message::NotObject)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                // As a `Value` would hold it: the last of duplicate keys wins.
                let (mut role, mut content, mut extras) = (None, None, Map::new());
                while let Some(Key(key)) = map.next_key()? {
                    match key.as_ref() {
                        "role" => role = Some(map.next_value()?),
                        "content" => content = Some(map.next_value()?),
                        _ => {
                            extras.insert(key.into_owned(), map.next_value::<Value>()?);
                        }
                    }
                }
                Ok(Message::Object { role, content, extras })
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for Text<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Text<'de>;
            scalars_are!(Text::NotStr);
            strings_are!(Text::Str);
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(Text::NotStr)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
                skip_seq(seq).map(|()| Text::NotStr)
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                skip_map(map).map(|()| Text::NotStr)
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for Content<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Content<'de>;
            scalars_are!(Content::Other);
            strings_are!(Content::Str);
            fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
                Ok(Content::Null)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut parts = Vec::new();
                while let Some(part) = seq.next_element::<Value>()? {
                    parts.push(part);
                }
                Ok(Content::Parts(parts))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                skip_map(map).map(|()| Content::Other)
            }
        }
        d.deserialize_any(V)
    }
}
