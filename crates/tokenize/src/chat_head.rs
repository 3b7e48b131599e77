//! The head of a chat's rendering without rendering the whole chat: a router keys a prompt on its first
//! `max_bytes` only, so a 20 MB conversation need not be parsed, copied into the template's values and rendered
//! whole (that took 8.5 times the body in memory and 0.7 s of CPU).
//!
//! The messages are read as raw JSON slices of the request (16 bytes each, nothing parsed), and a *cut*
//! conversation is rendered: the messages in order until their JSON passes a budget `w`, the last one's content cut
//! to what is left of `w`, and every later `system` message whole (DeepSeek V3's template gathers all system
//! messages at the top); `tools` likewise, in order until their JSON passes `w`. Its rendering starts as the whole
//! conversation's does, up to about where the cut content ends, past `max_bytes` for a template that prints the
//! contents.
//!
//! That is checked, not assumed: a second cut at `2w`, with at least one message more, must render the same first
//! `max_bytes + 1` bytes (a template that prints something else before the last message, such as a marker for the
//! last turn, renders the two differently); else `w` doubles, up to the whole conversation. A template that fails
//! on a cut conversation gets the whole one. `tests` checks the heads against whole renderings for SmolLM2's,
//! Llama 3.1's, Qwen 2.5's and DeepSeek V3's templates.
//!
//! Cost: two renderings of about `2w` and `4w` bytes and the JSON of the messages kept, whatever the chat's size
//! (plus one pass over the messages' raw JSON to split it).

use serde_json::value::RawValue;
use serde_json::Value;

use crate::ModelTokenizer;

/// A rendering's first bytes, from a cut conversation or from the whole one.
#[derive(Debug)]
pub(crate) struct Rendering {
    /// The rendering of the whole conversation, or of a cut one whose first `max_bytes + 1` bytes are the whole
    /// rendering's.
    pub text: String,
    /// The whole rendering's length: exact for the whole rendering, else estimated.
    pub full_len: usize,
}

/// A list member (`messages`, `tools`) as slices of the request's JSON, or a value that is not a list.
enum List<'a> {
    Items(Vec<&'a RawValue>),
    Other(&'a RawValue),
}

impl<'a> List<'a> {
    fn read(raw: &'a RawValue) -> Self {
        match serde_json::from_str::<Vec<&RawValue>>(raw.get()) {
            Ok(items) => List::Items(items),
            Err(_) => List::Other(raw),
        }
    }

    /// The JSON bytes of its items (of the whole value when it is no list).
    fn weight(&self) -> usize {
        match self {
            List::Items(items) => items.iter().map(|i| i.get().len()).sum(),
            List::Other(raw) => raw.get().len(),
        }
    }
}

/// The starting budget, JSON bytes per list: a little over the head, for the template's own text is about what
/// the JSON spends on names and quotes.
fn first_budget(max_bytes: usize) -> usize {
    max_bytes + max_bytes / 4 + 1024
}

impl ModelTokenizer {
    /// The rendering of `messages` (and `tools`) whose first `max_bytes + 1` bytes are the whole rendering's, cut
    /// when the conversation is long (see the module documentation).
    pub(crate) fn render_head(
        &self,
        messages: &RawValue,
        tools: Option<&RawValue>,
        max_bytes: usize,
    ) -> Result<Rendering, String> {
        let list = List::read(messages);
        let tools = tools.filter(|t| t.get() != "null").map(List::read);
        // JSON bytes of each list, summed once.
        let (list_weight, tools_weight) = (list.weight(), tools.as_ref().map_or(0, List::weight));
        let total = list_weight + tools_weight;
        let mut w = first_budget(max_bytes);
        // The system messages, found once (only a cut conversation needs them).
        let mut systems = None;
        loop {
            if list_weight <= w && tools_weight <= w {
                break;
            }
            let systems: &[usize] = systems.get_or_insert_with(|| match &list {
                List::Items(items) => (0..items.len()).filter(|&i| is_system(items[i])).collect(),
                List::Other(_) => Vec::new(),
            });
            let (Ok(first), Ok(second)) = (
                self.render_cut(&list, systems, tools.as_ref(), w, 0),
                self.render_cut(&list, systems, tools.as_ref(), 2 * w, 1),
            ) else {
                // The template refused a cut conversation: the whole one decides.
                break;
            };
            let agree = first.len() > max_bytes
                && second.len() > max_bytes
                && first.as_bytes()[..=max_bytes] == second.as_bytes()[..=max_bytes];
            if agree {
                // The rest at the rate the second cut's extra JSON rendered.
                let kept = |w: usize| list_weight.min(w) + tools_weight.min(w);
                let (w1, w2) = (kept(w), kept(2 * w));
                let rate =
                    (second.len().saturating_sub(first.len()) as f64 / w2.saturating_sub(w1).max(1) as f64).min(4.0);
                let full_len = second.len() + (rate * total.saturating_sub(w2) as f64) as usize;
                return Ok(Rendering { text: first, full_len });
            }
            w *= 2;
        }
        let messages: Value = serde_json::from_str(messages.get()).map_err(|e| format!("messages: {e}"))?;
        let tools: Option<Value> = match tools {
            Some(List::Items(items)) => Some(Value::Array(parse_all(&items)?)),
            Some(List::Other(raw)) => Some(serde_json::from_str(raw.get()).map_err(|e| format!("tools: {e}"))?),
            None => None,
        };
        let text = self.render_chat(&messages, tools.as_ref())?;
        Ok(Rendering {
            full_len: text.len(),
            text,
        })
    }

    /// The rendering of the conversation cut at `w` JSON bytes per list, keeping at least `more` messages past the
    /// cut message.
    fn render_cut(
        &self,
        messages: &List<'_>,
        systems: &[usize],
        tools: Option<&List<'_>>,
        w: usize,
        more: usize,
    ) -> Result<String, String> {
        let messages = match messages {
            List::Items(items) => Value::Array(cut_messages(items, systems, w, more)?),
            List::Other(raw) => serde_json::from_str(raw.get()).map_err(|e| format!("messages: {e}"))?,
        };
        let tools = match tools {
            None => None,
            Some(List::Items(items)) => {
                let kept = kept(items, w, 0);
                Some(Value::Array(parse_all(&items[..kept])?))
            }
            Some(List::Other(raw)) => Some(serde_json::from_str(raw.get()).map_err(|e| format!("tools: {e}"))?),
        };
        self.render_chat(&messages, tools.as_ref())
    }
}

/// How many of `items` a budget of `w` keeps: those that start within it, and `more` after them.
fn kept(items: &[&RawValue], w: usize, more: usize) -> usize {
    let mut before = 0;
    let mut n = 0;
    for item in items {
        if before >= w {
            break;
        }
        before += item.get().len();
        n += 1;
    }
    (n + more).min(items.len())
}

fn parse_all(items: &[&RawValue]) -> Result<Vec<Value>, String> {
    items
        .iter()
        .map(|i| serde_json::from_str(i.get()).map_err(|e| format!("{e}")))
        .collect()
}

/// The messages a budget of `w` keeps, the last of the budget's own cut to what is left of it (and each of the
/// `more` after it to nothing), then every later system message (of `systems`, their indexes) whole.
fn cut_messages(items: &[&RawValue], systems: &[usize], w: usize, more: usize) -> Result<Vec<Value>, String> {
    let within = kept(items, w, 0);
    let n = kept(items, w, more);
    let mut out = Vec::with_capacity(n);
    let mut before = 0;
    for (i, item) in items[..n].iter().enumerate() {
        let len = item.get().len();
        let message = if i + 1 == within && before + len > w {
            parse_cut(item, w - before)?
        } else if i >= within {
            parse_cut(item, 0)?
        } else {
            serde_json::from_str(item.get()).map_err(|e| format!("messages: {e}"))?
        };
        before += len;
        out.push(message);
    }
    for &i in systems.iter().filter(|&&i| i >= n) {
        out.push(serde_json::from_str(items[i].get()).map_err(|e| format!("messages: {e}"))?);
    }
    Ok(out)
}

/// A message with its content cut to at most `left` bytes: a string content is cut in its JSON text before it is
/// read (a 20 MB message costs what its first `left` bytes do), content parts after reading
/// ([`cut_content`]).
fn parse_cut(item: &RawValue, left: usize) -> Result<Value, String> {
    struct Fields<'a>(Vec<(String, &'a RawValue)>);
    impl<'de> serde::Deserialize<'de> for Fields<'de> {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> serde::de::Visitor<'de> for V {
                type Value = Fields<'de>;
                fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                    f.write_str("a message object")
                }
                fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Fields<'de>, A::Error> {
                    let mut fields = Vec::new();
                    while let Some(field) = map.next_entry::<String, &'de RawValue>()? {
                        fields.push(field);
                    }
                    Ok(Fields(fields))
                }
            }
            d.deserialize_map(V)
        }
    }
    let Ok(Fields(fields)) = serde_json::from_str::<Fields<'_>>(item.get()) else {
        // Not an object: as it is, for the template to judge.
        return serde_json::from_str(item.get()).map_err(|e| format!("messages: {e}"));
    };
    let mut message = serde_json::Map::new();
    for (key, raw) in fields {
        let value = if key == "content" && raw.get().starts_with('"') {
            Value::String(cut_string(raw.get(), left)?)
        } else {
            let mut value: Value = serde_json::from_str(raw.get()).map_err(|e| format!("messages: {e}"))?;
            if key == "content" {
                let mut holder = serde_json::json!({"content": value});
                cut_content(&mut holder, left);
                value = holder["content"].take();
            }
            value
        };
        // As a `Value` holds an object: the last of a repeated key wins.
        message.insert(key, value);
    }
    Ok(Value::Object(message))
}

/// The string a JSON string literal (`raw`, quotes included) starts with, at most `max` bytes of it: the literal
/// is cut after at most `max` of its own bytes, at the end of a character or an escape (never between the two
/// halves of an escaped surrogate pair), then read.
fn cut_string(raw: &str, max: usize) -> Result<String, String> {
    let bytes = raw.as_bytes();
    let body_end = bytes.len().saturating_sub(1);
    let mut cut = 1;
    let mut at = 1;
    while at < body_end && at - 1 < max {
        let step = if bytes[at] == b'\\' {
            let escape = if bytes.get(at + 1) == Some(&b'u') { 6 } else { 2 };
            // A high surrogate is only whole with the low one after it.
            let high = escape == 6
                && raw
                    .get(at + 2..at + 6)
                    .and_then(|h| u16::from_str_radix(h, 16).ok())
                    .is_some_and(|u| (0xD800..0xDC00).contains(&u));
            if high {
                12
            } else {
                escape
            }
        } else {
            // A UTF-8 character: its length from its first byte.
            match bytes[at] {
                b if b < 0x80 => 1,
                b if b >= 0xF0 => 4,
                b if b >= 0xE0 => 3,
                _ => 2,
            }
        };
        if at + step - 1 > max || at + step > body_end {
            break;
        }
        at += step;
        cut = at;
    }
    let literal = format!("{}\"", &raw[..cut]);
    serde_json::from_str(&literal).map_err(|e| format!("messages: {e}"))
}

/// Whether a message's `role` is `system`, read without parsing its content.
fn is_system(item: &RawValue) -> bool {
    #[derive(serde::Deserialize)]
    struct Role<'a> {
        #[serde(borrow)]
        role: Option<std::borrow::Cow<'a, str>>,
    }
    serde_json::from_str::<Role<'_>>(item.get()).is_ok_and(|r| r.role.as_deref() == Some("system"))
}

/// Cuts a message's content (a string, or the text of its content parts, in order) to at most `left` bytes; the
/// parts stay.
fn cut_content(message: &mut Value, mut left: usize) {
    match message.get_mut("content") {
        Some(Value::String(text)) => truncate(text, left),
        Some(Value::Array(parts)) => {
            for part in parts {
                if let Some(Value::String(text)) = part.get_mut("text") {
                    truncate(text, left);
                    left -= text.len();
                }
            }
        }
        _ => {}
    }
}

/// `text` cut to at most `max` bytes, at a character boundary.
fn truncate(text: &mut String, max: usize) {
    if text.len() <= max {
        return;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use serde_json::json;

    use super::*;

    fn data() -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data")
    }

    /// SmolLM2's tokenizer with each template of the tests: its own and those of `tests/data/templates`.
    fn tokenizers() -> Vec<(&'static str, ModelTokenizer)> {
        let smollm2 = || ModelTokenizer::load(&data().join("smollm2")).unwrap();
        let mut all = vec![("smollm2", smollm2())];
        for (name, file, bos, eos) in [
            ("llama3.1", "llama3.1.jinja", "<|begin_of_text|>", "<|eot_id|>"),
            ("qwen2.5", "qwen2.5.jinja", "", "<|im_end|>"),
            (
                "deepseek-v3",
                "deepseek-v3.jinja",
                "<｜begin▁of▁sentence｜>",
                "<｜end▁of▁sentence｜>",
            ),
        ] {
            let source = std::fs::read_to_string(data().join("templates").join(file)).unwrap();
            let mut t = smollm2();
            t.replace_template(&source, bos, eos).unwrap();
            all.push((name, t));
        }
        all
    }

    fn raw(value: &Value) -> Box<RawValue> {
        RawValue::from_string(value.to_string()).unwrap()
    }

    fn words(n: usize, seed: usize) -> String {
        (0..n).map(|i| format!("w{} ", (i * 7 + seed) % 97)).collect()
    }

    /// Conversations of the shapes templates treat differently: a system prompt or none, tools, tool calls and
    /// results, content parts, a late system message, one long message, many short ones.
    fn conversations() -> Vec<(Value, Option<Value>)> {
        let tool = |name: &str, pad: usize| {
            json!({"type": "function", "function": {"name": name, "description": words(pad, 3),
                   "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})
        };
        let mut many = vec![json!({"role": "system", "content": words(50, 1)})];
        for i in 0..400 {
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            many.push(json!({"role": role, "content": words(20 + i % 30, i)}));
        }
        vec![
            (
                json!([{"role": "system", "content": words(100, 1)}, {"role": "user", "content": words(4_000, 2)},
                       {"role": "assistant", "content": words(300, 3)}, {"role": "user", "content": "And?"}]),
                None,
            ),
            (json!([{"role": "user", "content": words(5_000, 4)}]), None),
            (Value::Array(many), None),
            (
                json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": words(3_000, 5)},
                       {"role": "assistant", "content": "Done."}, {"role": "system", "content": "A late rule."},
                       {"role": "user", "content": words(50, 6)}]),
                None,
            ),
            (
                json!([{"role": "user", "content": words(200, 7)},
                       {"role": "assistant", "content": null, "tool_calls": [{"type": "function", "id": "c1",
                         "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
                       {"role": "tool", "content": words(3_000, 8), "tool_call_id": "c1"},
                       {"role": "user", "content": words(800, 9)}]),
                Some(json!([tool("weather", 30), tool("time", 20)])),
            ),
            (
                json!([{"role": "user", "content": words(100, 10)}]),
                Some(Value::Array((0..200).map(|i| tool(&format!("tool{i}"), 40)).collect())),
            ),
        ]
    }

    #[test]
    fn a_cut_rendering_starts_as_the_whole_one_for_every_template() {
        for (name, t) in tokenizers() {
            let mut cuts = 0;
            for (c, (messages, tools)) in conversations().into_iter().enumerate() {
                let whole = t.render_chat(&messages, tools.as_ref());
                let tools_raw = tools.as_ref().map(raw);
                for max_bytes in [64, 1_000, 4_096, 10_000, 1 << 20] {
                    let head = t.render_head(&raw(&messages), tools_raw.as_deref(), max_bytes);
                    let (whole, head) = match (&whole, head) {
                        (Ok(whole), Ok(head)) => (whole, head),
                        // A template that refuses a conversation refuses it whole or cut.
                        (Err(_), Err(_)) => continue,
                        (whole, head) => panic!("{name} #{c} at {max_bytes}: {whole:?} vs {head:?}"),
                    };
                    if whole.len() <= max_bytes {
                        assert_eq!(&head.text, whole, "{name} #{c} at {max_bytes}");
                        continue;
                    }
                    cuts += usize::from(head.text != *whole);
                    assert_eq!(
                        head.text.as_bytes()[..=max_bytes],
                        whole.as_bytes()[..=max_bytes],
                        "{name} #{c} at {max_bytes}: the cut rendering starts otherwise"
                    );
                    assert!(
                        head.text.len() <= whole.len() && head.full_len.abs_diff(whole.len()) * 4 < whole.len(),
                        "{name} #{c} at {max_bytes}: {} of {} bytes rendered, {} estimated",
                        head.text.len(),
                        whole.len(),
                        head.full_len
                    );
                }
            }
            assert!(cuts >= 15, "{name}: only {cuts} cut renderings");
        }
    }

    #[test]
    fn the_ids_of_a_cut_head_are_those_of_the_whole_ones() {
        for (name, t) in tokenizers() {
            for (c, (messages, tools)) in conversations().into_iter().enumerate() {
                let Ok(whole) = t.render_chat(&messages, tools.as_ref()) else {
                    continue;
                };
                let tools_raw = tools.as_ref().map(raw);
                for max_bytes in [1_000, 8_192] {
                    let from_whole = t.head(&whole, whole.len(), max_bytes, |h| t.encode_pieces(h)).unwrap();
                    let head = t.chat_head(&raw(&messages), tools_raw.as_deref(), max_bytes).unwrap();
                    assert_eq!(head.ids, from_whole.ids, "{name} #{c} at {max_bytes}");
                    assert_eq!(head.cut, from_whole.cut, "{name} #{c} at {max_bytes}");
                }
            }
        }
    }

    #[test]
    fn a_template_that_marks_the_last_message_gets_a_longer_cut() {
        // Prints a marker before the last message: a cut conversation's last message is not the real last one,
        // and the second cut (a message more) shows it.
        let source = "{% for m in messages %}{% if loop.last %}[LAST]{% endif %}<{{ m.role }}>{{ m.content }}\n\
                      {% endfor %}";
        let mut t = ModelTokenizer::load(&data().join("smollm2")).unwrap();
        t.replace_template(source, "", "").unwrap();
        let messages: Value = (0..50)
            .map(|i| json!({"role": "user", "content": words(200, i)}))
            .collect();
        let whole = t.render_chat(&messages, None).unwrap();
        for max_bytes in [500, 5_000, 20_000] {
            let head = t.render_head(&raw(&messages), None, max_bytes).unwrap();
            assert_eq!(
                head.text.as_bytes()[..=max_bytes],
                whole.as_bytes()[..=max_bytes],
                "at {max_bytes}"
            );
        }
    }

    #[test]
    fn a_string_literal_is_cut_between_characters_and_escapes() {
        let text = "aé\n\"b😀c\u{1}";
        let raw = serde_json::to_string(text).unwrap();
        for max in 0..raw.len() + 2 {
            let cut = cut_string(&raw, max).unwrap();
            assert!(text.starts_with(&cut), "{max}: {cut:?}");
            assert!(cut.len() <= max, "{max}: {cut:?}");
        }
        assert_eq!(cut_string(&raw, raw.len()).unwrap(), text);
        // An escaped surrogate pair is kept whole or left out.
        let pair = r#""x\ud83d\ude00y""#;
        assert_eq!(cut_string(pair, 7).unwrap(), "x");
        assert_eq!(cut_string(pair, 13).unwrap(), "x😀");
        let m = parse_cut(&raw_of(r#"{"role": "user", "content": "abcdef", "name": "n"}"#), 3).unwrap();
        assert_eq!(m, json!({"role": "user", "content": "abc", "name": "n"}));
    }

    fn raw_of(text: &str) -> Box<RawValue> {
        RawValue::from_string(text.to_owned()).unwrap()
    }

    #[test]
    fn content_is_cut_at_a_character_boundary_and_parts_in_order() {
        let mut m = json!({"role": "user", "content": "ééé"});
        cut_content(&mut m, 3);
        assert_eq!(m["content"], "é");
        let mut m = json!({"role": "user", "content": [{"type": "text", "text": "abcd"}, {"type": "image_url"},
                                                       {"type": "text", "text": "efgh"}, {"type": "text", "text": "ij"}]});
        cut_content(&mut m, 6);
        assert_eq!(
            m["content"],
            json!([{"type": "text", "text": "abcd"}, {"type": "image_url"}, {"type": "text", "text": "ef"},
                   {"type": "text", "text": ""}])
        );
        assert!(is_system(&raw(&json!({"content": "x", "role": "system"}))));
        assert!(!is_system(&raw(&json!({"role": "user"}))));
        assert!(!is_system(&raw(&json!("system"))));
    }
}
