//! Token-exact prompt keys: a model's own tokenizer and chat template, so text and chat prompts are keyed on the
//! token ids the engine will cache (what its KV events name) instead of on their bytes.
//!
//! A model directory holds Hugging Face's `tokenizer.json` (read by the `tokenizers` crate) and, optionally,
//! `tokenizer_config.json` with its `chat_template` (Jinja2) and special tokens. A chat request is rendered as
//! `transformers`' `apply_chat_template(messages, tools=tools, add_generation_prompt=True)` renders it (a sandboxed
//! Jinja environment with `trim_blocks` and `lstrip_blocks`, loop controls, `raise_exception`, `strftime_now`, the
//! tokenizer's special tokens as variables, Python's string methods) and the text tokenized without special tokens
//! added, as `apply_chat_template(tokenize=True)` does; a completion's text is tokenized with them, as the engines
//! tokenize a prompt. `tests/tokenizer.rs` (in the `dprouter` package) checks the ids against Python's `jinja2` and
//! `tokenizers` packages. The gateway keys prompts with it; the mock engine can tokenize with it, as a real engine
//! serving the model would.
//!
//! A conversation is resent whole every turn, and tokenizing it whole costs about 1.5 µs per token on this machine
//! (30 ms for 90 KB). But a chat rendering is cut by special tokens (`<|im_start|>`, `<|im_end|>`, …), and the
//! tokenizer tokenizes the text between two of them on its own: so each such piece is tokenized once and its ids
//! kept (about 8 bytes a token, up to [`CACHED_TOKENS`] tokens, then the cache starts over), and a new turn costs
//! only its new messages. Only added tokens without stripping, whole-word or normalization rules cut, as they cut
//! in the tokenizer; the ids are the same either way (tested against the whole-text encoding). Rendering is linear
//! in the conversation and cheap (22 µs for 90 KB), but a router keys a long chat on its head only, so it renders
//! only as much of the conversation as the head needs (the `chat_head` module: a 20 MB chat costs what its head
//! does). Measured with `cargo bench -p dprouter-tokenize`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde_json::Value;

mod chat_head;

/// A model's tokenizer and chat template.
pub struct ModelTokenizer {
    tokenizer: tokenizers::Tokenizer,
    template: Option<minijinja::Environment<'static>>,
    /// Special tokens the template sees (`bos_token`, `eos_token`, …).
    special: serde_json::Map<String, Value>,
    path: PathBuf,
    /// The added tokens that cut a text (see the module documentation), and their ids.
    cutters: Option<(aho_corasick::AhoCorasick, Vec<u32>)>,
    /// Pieces between cutters already tokenized: ids by the piece's hash.
    pieces: Mutex<Pieces>,
}

/// A prompt's first token ids, when only its head was tokenized.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    /// The first ids of the prompt's tokenization (all of them when not `cut`).
    pub ids: Vec<u32>,
    /// Only a head was tokenized.
    pub cut: bool,
    /// The prompt's tokens: exact when not `cut`, else estimated from the head's bytes per token.
    pub total: u64,
}

/// Ids dropped from the end of a head cut inside a word: the tokenization of a word cut in two may differ from the
/// whole word's in its last tokens.
pub const UNSURE_TOKENS: usize = 16;

/// The most tokens the piece cache keeps before it starts over.
pub const CACHED_TOKENS: usize = 4 << 20;
/// Pieces shorter than this are tokenized every time (cheaper than caching them).
const MIN_CACHED_BYTES: usize = 64;

#[derive(Default)]
struct Pieces {
    ids: HashMap<(u64, usize), Arc<[u32]>>,
    tokens: usize,
}

impl std::fmt::Debug for ModelTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelTokenizer")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// The name the chat template is registered under.
const TEMPLATE: &str = "chat";

impl ModelTokenizer {
    /// Loads `tokenizer.json` and `tokenizer_config.json` from a model directory (or the directory of a given
    /// `tokenizer.json`).
    pub fn load(path: &Path) -> Result<Self, String> {
        let (dir, file) = if path.is_dir() {
            (path.to_path_buf(), path.join("tokenizer.json"))
        } else {
            (
                path.parent().map(Path::to_path_buf).unwrap_or_default(),
                path.to_path_buf(),
            )
        };
        let tokenizer =
            tokenizers::Tokenizer::from_file(&file).map_err(|e| format!("tokenizer {}: {e}", file.display()))?;
        let config_path = dir.join("tokenizer_config.json");
        let config: Value = match std::fs::read_to_string(&config_path) {
            Ok(text) => {
                serde_json::from_str(&text).map_err(|e| format!("tokenizer config {}: {e}", config_path.display()))?
            }
            Err(_) => Value::Null,
        };
        let mut special = serde_json::Map::new();
        for name in [
            "bos_token",
            "eos_token",
            "unk_token",
            "pad_token",
            "sep_token",
            "cls_token",
            "mask_token",
        ] {
            // A token is a string, or an object with its `content` (an `AddedToken`).
            let token = match &config[name] {
                Value::String(s) => Some(s.clone()),
                Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_owned),
                _ => None,
            };
            if let Some(token) = token {
                special.insert(name.to_owned(), Value::String(token));
            }
        }
        let template = match &config["chat_template"] {
            Value::String(source) => Some(environment(source.clone(), &config_path)?),
            // Several named templates: the default one.
            Value::Array(list) => {
                let source = list
                    .iter()
                    .find(|t| t["name"] == "default")
                    .and_then(|t| t["template"].as_str())
                    .ok_or_else(|| format!("{}: no `default` chat template", config_path.display()))?;
                Some(environment(source.to_owned(), &config_path)?)
            }
            _ => None,
        };
        let cutters = cutters(&tokenizer)?;
        Ok(Self {
            tokenizer,
            template,
            special,
            path: path.to_path_buf(),
            cutters,
            pieces: Mutex::default(),
        })
    }

    /// Whether a chat template was found.
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// The text a chat request becomes: its messages (and tools) through the chat template, with the generation
    /// prompt.
    pub fn render_chat(&self, messages: &Value, tools: Option<&Value>) -> Result<String, String> {
        let env = self
            .template
            .as_ref()
            .ok_or_else(|| format!("{} has no chat template", self.path.display()))?;
        let template = env.get_template(TEMPLATE).map_err(|e| e.to_string())?;
        let mut context = self.special.clone();
        context.insert("messages".into(), messages.clone());
        context.insert("add_generation_prompt".into(), Value::Bool(true));
        if let Some(tools) = tools.filter(|t| !t.is_null()) {
            context.insert("tools".into(), tools.clone());
        }
        template
            .render(minijinja::Value::from(minijinja::value::Serde(&context)))
            .map_err(|e| format!("the chat template failed: {e}"))
    }

    /// The chat template `source` in place of the model's, with these special tokens (tests of other models'
    /// templates over one tokenizer).
    #[cfg(test)]
    pub(crate) fn replace_template(&mut self, source: &str, bos: &str, eos: &str) -> Result<(), String> {
        self.template = Some(environment(source.to_owned(), Path::new("test"))?);
        self.special.insert("bos_token".into(), Value::String(bos.into()));
        self.special.insert("eos_token".into(), Value::String(eos.into()));
        Ok(())
    }

    /// A chat request's token ids: the rendering, tokenized without special tokens added (the template wrote them).
    pub fn chat_ids(&self, messages: &Value, tools: Option<&Value>) -> Result<Vec<u32>, String> {
        let text = self.render_chat(messages, tools)?;
        self.encode_pieces(&text)
    }

    /// The ids of a chat's head, from the request's raw `messages` and `tools` members: as [`Self::chat_ids`] for
    /// a rendering of at most `max_bytes`, else the ids of its first `max_bytes` or so only ([`Head`]), rendered
    /// from as much of the conversation as they need (the `chat_head` module). Tokenizing costs about
    /// 200 bytes of memory and 1.5 µs per token, and rendering a whole chat several times its size, so a router
    /// bounds its work by the head its keys need.
    pub fn chat_head(
        &self,
        messages: &serde_json::value::RawValue,
        tools: Option<&serde_json::value::RawValue>,
        max_bytes: usize,
    ) -> Result<Head, String> {
        let rendering = self.render_head(messages, tools, max_bytes)?;
        self.head(&rendering.text, rendering.full_len, max_bytes, |head| {
            self.encode_pieces(head)
        })
    }

    /// The ids of a text prompt's head, as [`Self::text_ids`] within `max_bytes` ([`Self::chat_head`]).
    pub fn text_head(&self, text: &str, max_bytes: usize) -> Result<Head, String> {
        self.head(text, text.len(), max_bytes, |head| self.encode(head, true))
    }

    /// `text` tokenized by `encode` whole when it is at most `max_bytes`; otherwise its head: up to the last cutter
    /// (special token) that ends within `max_bytes` when there is one, whose ids are exactly the whole text's first
    /// ids; else its first `max_bytes` (at a character boundary) less the last [`UNSURE_TOKENS`] ids, which a
    /// word cut in two may have changed. `full_len` is the length of the text `text` starts (`text` may be only its
    /// head), for the estimate of its tokens.
    fn head(
        &self,
        text: &str,
        full_len: usize,
        max_bytes: usize,
        encode: impl Fn(&str) -> Result<Vec<u32>, String>,
    ) -> Result<Head, String> {
        if text.len() <= max_bytes {
            let ids = encode(text)?;
            let total = ids.len() as u64;
            return Ok(Head { ids, cut: false, total });
        }
        let mut end = max_bytes;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        let at_cutter = self.cutters.as_ref().and_then(|(cutters, _)| {
            cutters
                .find_iter(&text[..end])
                .map(|m| m.end())
                .last()
                .filter(|&cut| cut * 2 >= end)
        });
        let (head, exact) = match at_cutter {
            Some(cut) => (&text[..cut], true),
            None => (&text[..end], false),
        };
        let mut ids = encode(head)?;
        if !exact {
            ids.truncate(ids.len().saturating_sub(UNSURE_TOKENS));
        }
        // The rest at the head's rate.
        let total = (ids.len() as f64 * full_len.max(text.len()) as f64 / head.len().max(1) as f64).ceil() as u64;
        Ok(Head { ids, cut: true, total })
    }

    /// `text`'s ids without special tokens added, piece by piece between cutters, the pieces cached.
    fn encode_pieces(&self, text: &str) -> Result<Vec<u32>, String> {
        let Some((cutters, cutter_ids)) = &self.cutters else {
            return self.encode(text, false);
        };
        let mut ids = Vec::with_capacity(text.len() / 3);
        let mut from = 0;
        for cut in cutters.find_iter(text) {
            self.encode_piece(&text[from..cut.start()], &mut ids)?;
            ids.push(cutter_ids[cut.pattern().as_usize()]);
            from = cut.end();
        }
        self.encode_piece(&text[from..], &mut ids)?;
        Ok(ids)
    }

    fn encode_piece(&self, piece: &str, ids: &mut Vec<u32>) -> Result<(), String> {
        if piece.len() < MIN_CACHED_BYTES {
            if !piece.is_empty() {
                ids.extend(self.encode(piece, false)?);
            }
            return Ok(());
        }
        let key = (xxhash_rust::xxh3::xxh3_64(piece.as_bytes()), piece.len());
        let cached = self.lock_pieces().ids.get(&key).cloned();
        let piece_ids = match cached {
            Some(piece_ids) => piece_ids,
            None => {
                let piece_ids: Arc<[u32]> = self.encode(piece, false)?.into();
                let mut pieces = self.lock_pieces();
                if pieces.tokens + piece_ids.len() > CACHED_TOKENS {
                    *pieces = Pieces::default();
                }
                pieces.tokens += piece_ids.len();
                pieces.ids.insert(key, Arc::clone(&piece_ids));
                piece_ids
            }
        };
        ids.extend_from_slice(&piece_ids);
        Ok(())
    }

    fn lock_pieces(&self) -> std::sync::MutexGuard<'_, Pieces> {
        self.pieces.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A text prompt's token ids, with the tokenizer's special tokens added as an engine adds them.
    pub fn text_ids(&self, text: &str) -> Result<Vec<u32>, String> {
        self.encode(text, true)
    }

    fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>, String> {
        self.tokenizer
            .encode_fast(text, special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| format!("tokenizing: {e}"))
    }
}

/// The added tokens that cut a text as the tokenizer cuts it (no stripping, whole-word or normalization rules), as
/// a leftmost-longest matcher (the tokenizer's own rule) and their ids; `None` when there are none.
fn cutters(tokenizer: &tokenizers::Tokenizer) -> Result<Option<(aho_corasick::AhoCorasick, Vec<u32>)>, String> {
    let added = tokenizer.get_added_tokens_decoder();
    if added.values().any(|t| t.normalized && !t.special) {
        // Normalized added tokens match after normalization: cutting the raw text could differ.
        return Ok(None);
    }
    let mut plain: Vec<(String, u32)> = added
        .into_iter()
        .filter(|(_, t)| !t.lstrip && !t.rstrip && !t.single_word && !t.normalized && !t.content.is_empty())
        .map(|(id, t)| (t.content, id))
        .collect();
    if plain.is_empty() {
        return Ok(None);
    }
    plain.sort();
    let matcher = aho_corasick::AhoCorasick::builder()
        .match_kind(aho_corasick::MatchKind::LeftmostLongest)
        .build(plain.iter().map(|(content, _)| content))
        .map_err(|e| format!("the added tokens: {e}"))?;
    Ok(Some((matcher, plain.into_iter().map(|(_, id)| id).collect())))
}

/// A Jinja environment as `transformers` builds it for chat templates.
fn environment(source: String, from: &Path) -> Result<minijinja::Environment<'static>, String> {
    let mut env = minijinja::Environment::new();
    let syntax = minijinja::syntax::SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .build()
        .map_err(|e| e.to_string())?;
    env.set_syntax(syntax);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |message: String| -> Result<(), minijinja::Error> {
        Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, message))
    });
    env.add_function("strftime_now", |format: String| -> String {
        // The date the engine would render at this moment; only its day can differ from the engine's, at midnight.
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        strftime_utc(&format, now)
    });
    env.add_template_owned(TEMPLATE, source)
        .map_err(|e| format!("{}: the chat template does not parse: {e}", from.display()))?;
    Ok(env)
}

/// A small `strftime` for the formats chat templates use (`%d %b %Y`, `%Y-%m-%d`, …), in UTC.
fn strftime_utc(format: &str, unix: u64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let days = (unix / 86_400) as i64;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let month_name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('b') => out.push_str(&month_name[..3]),
            Some('B') => out.push_str(month_name),
            Some('-') => match chars.next() {
                Some('d') => out.push_str(&day.to_string()),
                Some('m') => out.push_str(&month.to_string()),
                Some(other) => out.push(other),
                None => {}
            },
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn smollm2() -> ModelTokenizer {
        ModelTokenizer::load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/smollm2")).unwrap()
    }

    #[test]
    fn pieces_between_special_tokens_give_the_whole_texts_ids() {
        let t = smollm2();
        let long = "A sentence with numbers 1234 and spaces  , twice. ".repeat(8);
        let texts = [
            format!("<|im_start|>system\n{long}<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
            format!("{long}<|im_end|><|im_start|>{long}"),
            format!("no special token at all {long}"),
            format!("<|im_start|><|im_end|>{long}<|im_start|"),
            String::new(),
        ];
        for text in &texts {
            // Twice: the second time from the cache.
            for _ in 0..2 {
                assert_eq!(
                    t.encode_pieces(text).unwrap(),
                    t.encode(text, false).unwrap(),
                    "{text:?}"
                );
            }
        }
        assert!(t.lock_pieces().tokens > 0, "long pieces are kept");
    }

    #[test]
    fn a_head_is_the_first_ids_of_the_whole_tokenization() {
        let t = smollm2();
        let long = "A sentence with numbers 1234 and spaces  , twice. ".repeat(40);
        let messages = serde_json::json!([
            {"role": "system", "content": long},
            {"role": "user", "content": "A question?"},
            {"role": "assistant", "content": long},
            {"role": "user", "content": long},
        ]);
        let whole = t.chat_ids(&messages, None).unwrap();
        let raw = serde_json::value::RawValue::from_string(messages.to_string()).unwrap();
        let rendered = t.render_chat(&messages, None).unwrap().len();
        // Room for everything: the whole, exact.
        let all = t.chat_head(&raw, None, rendered).unwrap();
        assert_eq!(
            (all.ids.as_slice(), all.cut, all.total),
            (whole.as_slice(), false, whole.len() as u64)
        );
        // Cut after the second message: up to a special token, exactly the whole's first ids.
        let cut = t.chat_head(&raw, None, rendered * 2 / 3).unwrap();
        assert!(cut.cut && cut.ids.len() > whole.len() / 3, "{}", cut.ids.len());
        assert_eq!(cut.ids, whole[..cut.ids.len()]);
        assert!(
            cut.total.abs_diff(whole.len() as u64) * 10 < whole.len() as u64,
            "{}",
            cut.total
        );
        // Inside the first message, with no special token far enough in: a prefix of the whole's ids, less the
        // ids a cut word may have changed.
        for max in [100, 1_000, 1_999] {
            let cut = t.chat_head(&raw, None, max).unwrap();
            assert!(cut.cut && !cut.ids.is_empty(), "{max}");
            assert_eq!(cut.ids, whole[..cut.ids.len()], "{max}");
        }
        // A text prompt too, through a multi-byte character.
        let text = "é".repeat(3_000);
        let head = t.text_head(&text, 1_001).unwrap();
        let ids = t.text_ids(&text).unwrap();
        assert!(head.cut);
        assert_eq!(head.ids, ids[..head.ids.len()]);
    }

    #[test]
    fn dates_render_as_strftime_does() {
        // 2026-11-30 is day 20,787 since the epoch.
        let t = 20_787 * 86_400 + 3_600;
        assert_eq!(strftime_utc("%d %b %Y", t), "30 Nov 2026");
        assert_eq!(strftime_utc("%Y-%m-%d", t), "2026-11-30");
        assert_eq!(strftime_utc("%B %-d, %y %%", t), "November 30, 26 %");
        assert_eq!(strftime_utc("%d %b %Y", 0), "01 Jan 1970");
        assert_eq!(strftime_utc("%Y-%m-%d", 951_782_400), "2000-02-29");
    }
}
