//! Reading an engine's usage report (prompt and cached tokens) from its response as the bytes pass by.
//!
//! A response is relayed in pieces and never kept: [`UsageScanner`] looks at each piece once, in bounded memory,
//! and yields the report as soon as it has been read, which for a stream is before the stream ends (SGLang puts
//! `meta_info` in every event; OpenAI-style engines put `usage` in the last event before `[DONE]`, which clients
//! like the OpenAI SDK read and then hang up on).
//!
//! Where the numbers are, per engine:
//! - OpenAI-style `usage` (vLLM, SGLang `/v1/*`, llama.cpp): `prompt_tokens`, and the cached part in
//!   `prompt_tokens_details.cached_tokens` (0 when absent: engines omit it when nothing was cached or when the
//!   feature is off, such as vLLM without `--enable-prompt-tokens-details`).
//! - OpenAI Responses (`/v1/responses`): `usage` with `input_tokens` and `input_tokens_details.cached_tokens`; in a
//!   stream, inside the `response` member of the `response.completed` (or `.incomplete`, `.failed`) event.
//! - Anthropic Messages (`/v1/messages`, SGLang's and vLLM's): `usage` with `input_tokens` (the uncached part),
//!   `cache_read_input_tokens` (the cached part) and `cache_creation_input_tokens`; the prompt is their sum. In a
//!   stream, inside the `message` member of the `message_start` event (and again in `message_delta`).
//! - SGLang `/generate`: `meta_info.prompt_tokens` and `meta_info.cached_tokens`.
//! - llama.cpp: `timings.prompt_n` (tokens evaluated) and `timings.cache_n` (tokens reused from its cache); the
//!   prompt is their sum. A llama.cpp stream carries no `usage` unless the client set
//!   `stream_options.include_usage`, but its last event always has `timings`.
//!
//! Only top-level members of a JSON body, or of an SSE event's `data:` JSON (and the members of a top-level
//! `response` object, for Responses events), count: the same names inside a message's content or a tool's
//! arguments are skipped. A top-level member's value is kept while it is read, up to
//! [`MAX_MEMBER_BYTES`] (a usage report is a few hundred bytes); everything else is passed over without copying.
//!
//! A scanner made with [`UsageScanner::with_response_id`] also keeps the first `id` member read at that level: a
//! Responses answer's id (top level when whole, inside `response.created`'s `response` when streamed), which the
//! gateway needs to send the conversation's next turn (`previous_response_id`) to the worker that stored it.
//!
//! Cost: one pass over the bytes; outside strings byte by byte, inside strings a `memchr` jump to the next quote
//! or backslash. Once a report is found the scanner stops looking (its framing state stays current).

use memchr::{memchr, memchr2};
use serde::Deserialize;

/// Prompt tokens and how many of them the engine had cached, as the engine reported them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
}

/// The most bytes of one top-level member (`usage`, `meta_info`, `timings`) kept to parse it.
pub const MAX_MEMBER_BYTES: usize = 64 << 10;

/// Where a relayed SSE stream stands, for a gateway that must end it with an event of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// Nothing sent yet, or the last event ended (a blank line).
    EventEnded,
    /// A line ended but its event did not.
    LineEnded,
    /// Inside a line.
    InLine,
}

/// Reads the usage report of one response, fed in pieces (see the module documentation).
#[derive(Debug)]
pub struct UsageScanner {
    sse: bool,
    found: bool,
    /// Keep the first `id` member.
    want_id: bool,
    response_id: Option<String>,
    /// The tokens generated, as the report says ([`Self::output_tokens`]).
    output_tokens: Option<u64>,
    /// SSE: the current line's state.
    line: Line,
    /// The JSON object being read (the whole body, or the current event's data).
    json: TopLevel,
    /// The last two bytes seen (SSE framing).
    last: [u8; 2],
    seen: u64,
    /// A report that may be partial ([`TopLevel::partial`]), used when no later one comes: with its output tokens.
    provisional: Option<(Usage, Option<u64>)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Line {
    /// At the start of a line, `n` bytes of `data:` matched so far.
    Start(u8),
    /// In a `data:` line: its bytes go to the JSON reader.
    Data,
    /// In any other line (`event:`, `id:`, a comment): skipped.
    Other,
}

const DATA: &[u8] = b"data:";

impl UsageScanner {
    /// A scanner for an SSE stream (`text/event-stream`) or, with `sse = false`, for one JSON body.
    pub fn new(sse: bool) -> Self {
        Self {
            sse,
            found: false,
            want_id: false,
            response_id: None,
            output_tokens: None,
            line: Line::Start(0),
            json: TopLevel::default(),
            last: [b'\n', b'\n'],
            seen: 0,
            provisional: None,
        }
    }

    /// A scanner that also keeps the response's id (see the module documentation).
    pub fn with_response_id(sse: bool) -> Self {
        let mut scanner = Self::new(sse);
        scanner.want_id = true;
        scanner.json.want_id = true;
        scanner
    }

    /// The response's id, once read (only with [`Self::with_response_id`]); taken once.
    pub fn take_response_id(&mut self) -> Option<String> {
        self.response_id.take()
    }

    /// The object being read ended: its id (when one is wanted) and its report.
    fn end_object(&mut self) -> Option<Usage> {
        let mut object = std::mem::take(&mut self.json);
        if self.want_id && self.response_id.is_none() {
            self.response_id = object.id.take();
            self.want_id = self.response_id.is_none();
        }
        self.json.want_id = self.want_id;
        let output_tokens = object.output_tokens(self.sse);
        let partial = object.partial();
        let report = object.report();
        if partial {
            // A later event may have the whole report; this one stands if none does.
            if self.provisional.is_none() {
                self.provisional = report.map(|r| (r, output_tokens));
            }
            return None;
        }
        self.output_tokens = output_tokens;
        report
    }

    /// The tokens generated, from the object that held the report: `usage.completion_tokens` (`output_tokens` in
    /// the Responses API), llama.cpp's `timings.predicted_n`, or SGLang's `meta_info.completion_tokens` in a whole
    /// answer (a stream's first event already has SGLang's report, and its count of one). A stream that reports
    /// usage in every event (vLLM's `continuous_usage_stats`) gives its first event's count.
    pub fn output_tokens(&self) -> Option<u64> {
        self.output_tokens.filter(|_| self.found)
    }

    /// Reads the next piece of the response; returns the report when this piece completes it (once per response).
    pub fn feed(&mut self, data: &[u8]) -> Option<Usage> {
        match data {
            [] => {}
            [b] => self.last = [self.last[1], *b],
            [.., a, b] => self.last = [*a, *b],
        }
        self.seen += data.len() as u64;
        if self.found {
            return None;
        }
        let report = if self.sse {
            self.feed_sse(data)
        } else {
            self.json.feed(data);
            if self.json.complete() {
                self.end_object()
            } else {
                None
            }
        };
        self.found = report.is_some();
        report
    }

    /// The response ended: a report completed only by its end (an SSE line with no final newline), else one that
    /// may have been partial but is all there is.
    pub fn finish(&mut self) -> Option<Usage> {
        if self.found {
            return None;
        }
        if self.sse && self.line == Line::Data {
            self.line = Line::Start(0);
            if let Some(report) = self.end_object() {
                self.found = true;
                return Some(report);
            }
        }
        let (report, output_tokens) = self.provisional.take()?;
        self.output_tokens = output_tokens;
        self.found = true;
        Some(report)
    }

    /// Whether the report was read.
    pub fn found(&self) -> bool {
        self.found
    }

    /// Where an SSE stream stands after the bytes fed so far.
    pub fn framing(&self) -> Framing {
        match self.last {
            _ if self.seen == 0 => Framing::EventEnded,
            [b'\n', b'\n'] => Framing::EventEnded,
            [_, b'\n'] => Framing::LineEnded,
            _ => Framing::InLine,
        }
    }

    fn feed_sse(&mut self, mut data: &[u8]) -> Option<Usage> {
        while !data.is_empty() {
            match self.line {
                Line::Start(matched) => {
                    let matched = usize::from(matched);
                    if data[0] == b'\n' {
                        data = &data[1..];
                        self.line = Line::Start(0);
                        continue;
                    }
                    let want = &DATA[matched..];
                    let n = want.len().min(data.len());
                    if data[..n] != want[..n] {
                        self.line = Line::Other;
                        continue;
                    }
                    data = &data[n..];
                    self.line = if matched + n == DATA.len() {
                        self.json = TopLevel {
                            want_id: self.want_id,
                            ..TopLevel::default()
                        };
                        Line::Data
                    } else {
                        Line::Start((matched + n) as u8)
                    };
                }
                Line::Other => match memchr(b'\n', data) {
                    Some(end) => {
                        data = &data[end + 1..];
                        self.line = Line::Start(0);
                    }
                    None => return None,
                },
                Line::Data => {
                    let end = memchr(b'\n', data);
                    let (this, rest) = match end {
                        Some(end) => (&data[..end], &data[end + 1..]),
                        None => (data, &data[data.len()..]),
                    };
                    self.json.feed(this);
                    data = rest;
                    if end.is_some() {
                        self.line = Line::Start(0);
                        if let Some(report) = self.end_object() {
                            return Some(report);
                        }
                    }
                }
            }
        }
        None
    }
}

/// Which top-level member is being kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Member {
    Usage,
    MetaInfo,
    Timings,
    /// A Responses stream event's `response`: its own members are read as the top level's are.
    Response,
    /// An Anthropic `message_start` event's `message`: read as `response` is.
    Message,
    /// The response's id, when it is wanted.
    Id,
}

impl Member {
    fn from_key(key: &[u8]) -> Option<Self> {
        match key {
            b"usage" => Some(Member::Usage),
            b"meta_info" => Some(Member::MetaInfo),
            b"timings" => Some(Member::Timings),
            b"response" => Some(Member::Response),
            b"message" => Some(Member::Message),
            b"id" => Some(Member::Id),
            _ => None,
        }
    }
}

/// The longest key compared (`meta_info`); longer keys are not interesting.
const KEY_BYTES: usize = 9;

/// Follows one JSON value's structure incrementally and keeps the values of its interesting top-level members.
#[derive(Debug, Default)]
struct TopLevel {
    /// Open objects and arrays; the top-level object's members are at depth 1.
    depth: u32,
    /// The value of a top-level `response` member comes next: if it is an object, its members count too.
    opening_response: bool,
    /// Inside the top-level `response` object: the members that count are at depth 2.
    in_response: bool,
    /// The object read as `response` is an Anthropic `message` (its report may be partial: [`Self::report`]).
    nested_message: bool,
    in_string: bool,
    /// A backslash ended the last piece inside a string.
    escaped: bool,
    /// At depth 1, the next string is a key.
    expect_key: bool,
    /// The string being read is a depth-1 key.
    reading_key: bool,
    key: [u8; KEY_BYTES],
    /// Bytes of the key read; more than `KEY_BYTES` (or an escape) makes it uninteresting.
    key_len: usize,
    /// An interesting key was read; its value starts after the colon.
    pending: Option<Member>,
    /// The member whose value is being kept, and the bytes so far; `None` in the buffer once it grew too long.
    keeping: Option<(Member, Option<Vec<u8>>)>,
    /// The top-level value ended.
    done: bool,
    /// Keep the first `id` member.
    want_id: bool,
    id: Option<String>,
    usage: Option<UsageMember>,
    meta_info: Option<MetaInfoMember>,
    timings: Option<TimingsMember>,
}

#[derive(Debug, Deserialize)]
struct UsageMember {
    #[serde(alias = "input_tokens")]
    prompt_tokens: Option<u64>,
    #[serde(alias = "output_tokens")]
    completion_tokens: Option<u64>,
    #[serde(alias = "input_tokens_details")]
    prompt_tokens_details: Option<Details>,
    /// Anthropic's Messages usage: `input_tokens` is the uncached part only.
    cache_read_input_tokens: Option<u64>,
    cache_creation_input_tokens: Option<u64>,
}

#[derive(Debug, Deserialize)]
struct Details {
    cached_tokens: Option<u64>,
}

#[derive(Debug, Deserialize)]
struct MetaInfoMember {
    prompt_tokens: Option<u64>,
    cached_tokens: Option<u64>,
    completion_tokens: Option<u64>,
}

#[derive(Debug, Deserialize)]
struct TimingsMember {
    prompt_n: Option<u64>,
    cache_n: Option<u64>,
    predicted_n: Option<u64>,
}

impl TopLevel {
    fn complete(&self) -> bool {
        self.done
    }

    /// The depth of the members that count.
    fn members_depth(&self) -> u32 {
        if self.in_response {
            2
        } else {
            1
        }
    }

    fn feed(&mut self, data: &[u8]) {
        let mut i = 0;
        // Where in `data` the kept member's bytes start.
        let mut keep_from = self.keeping.as_ref().map(|_| 0);
        while i < data.len() && !self.done {
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                    i += 1;
                    continue;
                }
                match memchr2(b'"', b'\\', &data[i..]) {
                    None => {
                        self.key_bytes(&data[i..]);
                        i = data.len();
                    }
                    Some(off) => {
                        let at = i + off;
                        self.key_bytes(&data[i..at]);
                        if data[at] == b'\\' {
                            // An escaped key is none of ours.
                            self.key_len = KEY_BYTES + 1;
                            self.escaped = true;
                        } else {
                            self.in_string = false;
                            if self.reading_key {
                                self.reading_key = false;
                                self.pending = if self.key_len <= KEY_BYTES {
                                    Member::from_key(&self.key[..self.key_len])
                                        .filter(|m| *m != Member::Id || (self.want_id && self.id.is_none()))
                                } else {
                                    None
                                };
                            }
                        }
                        i = at + 1;
                    }
                }
                continue;
            }
            let byte = data[i];
            if self.opening_response && !byte.is_ascii_whitespace() {
                self.opening_response = false;
                if byte == b'{' && self.depth == 1 {
                    self.in_response = true;
                    self.depth = 2;
                    self.expect_key = true;
                    i += 1;
                    continue;
                }
            }
            match byte {
                b'"' => {
                    self.in_string = true;
                    self.reading_key = self.depth == self.members_depth() && self.expect_key;
                    self.key_len = 0;
                }
                b'{' | b'[' => {
                    self.depth += 1;
                    if self.depth == 1 {
                        self.expect_key = byte == b'{';
                    }
                }
                b'}' | b']' => {
                    if self.depth == 1 {
                        self.end_member(data, &mut keep_from, i);
                        self.done = true;
                    } else if self.in_response && self.depth == 2 {
                        // The `response` object ended: back among the top level's members.
                        self.end_member(data, &mut keep_from, i);
                        self.in_response = false;
                        self.expect_key = false;
                    }
                    self.depth = self.depth.saturating_sub(1);
                }
                b':' if self.depth == self.members_depth() => {
                    self.expect_key = false;
                    match self.pending.take() {
                        Some(nested @ (Member::Response | Member::Message)) => {
                            self.opening_response = !self.in_response;
                            self.nested_message = nested == Member::Message;
                        }
                        Some(member) => {
                            self.keeping = Some((member, Some(Vec::new())));
                            keep_from = Some(i + 1);
                        }
                        None => {}
                    }
                }
                b',' if self.depth == self.members_depth() => {
                    self.end_member(data, &mut keep_from, i);
                    self.expect_key = true;
                }
                _ => {}
            }
            i += 1;
        }
        if let Some(from) = keep_from {
            self.keep(&data[from.min(data.len())..]);
        }
    }

    fn key_bytes(&mut self, bytes: &[u8]) {
        if !self.reading_key {
            return;
        }
        let end = self.key_len + bytes.len();
        if end <= KEY_BYTES {
            self.key[self.key_len..end].copy_from_slice(bytes);
        }
        self.key_len = end;
    }

    fn keep(&mut self, bytes: &[u8]) {
        if let Some((_, buffer)) = &mut self.keeping {
            if let Some(kept) = buffer {
                if kept.len() + bytes.len() > MAX_MEMBER_BYTES {
                    *buffer = None;
                } else {
                    kept.extend_from_slice(bytes);
                }
            }
        }
    }

    /// The member being kept (if any) ended at `data[end]`: parse it.
    fn end_member(&mut self, data: &[u8], keep_from: &mut Option<usize>, end: usize) {
        let Some(from) = keep_from.take() else { return };
        self.keep(&data[from.min(end)..end]);
        let Some((member, Some(bytes))) = self.keeping.take() else {
            return;
        };
        match member {
            Member::Usage => self.usage = serde_json::from_slice(&bytes).ok(),
            Member::MetaInfo => self.meta_info = serde_json::from_slice(&bytes).ok(),
            Member::Timings => self.timings = serde_json::from_slice(&bytes).ok(),
            Member::Id => self.id = serde_json::from_slice(&bytes).ok(),
            Member::Response | Member::Message => {}
        }
    }

    /// The tokens generated, as this object reports them (see [`UsageScanner::output_tokens`]).
    fn output_tokens(&self, sse: bool) -> Option<u64> {
        let usage = self.usage.as_ref().and_then(|u| u.completion_tokens);
        let timings = self.timings.as_ref().and_then(|t| t.predicted_n);
        let meta = self
            .meta_info
            .as_ref()
            .filter(|_| !sse)
            .and_then(|m| m.completion_tokens);
        usage.or(timings).or(meta)
    }

    /// Whether this object's report may be partial: an Anthropic `message_start` whose usage says nothing of the
    /// cache (vLLM's, whose `message_delta` at the end of the stream has the whole usage).
    fn partial(&self) -> bool {
        self.nested_message
            && self.usage.as_ref().is_some_and(|u| {
                u.cache_read_input_tokens.is_none()
                    && u.cache_creation_input_tokens.is_none()
                    && u.prompt_tokens_details.is_none()
            })
    }

    /// The report of a complete object: `usage` with its cached tokens, else llama.cpp's `timings`, else
    /// `usage` alone (nothing cached), else SGLang's `meta_info`.
    fn report(self) -> Option<Usage> {
        if !self.done {
            return None;
        }
        let usage = self.usage.and_then(|u| {
            if u.cache_read_input_tokens.is_some() || u.cache_creation_input_tokens.is_some() {
                // Anthropic's: the prompt is the uncached, the read and the written parts together.
                let read = u.cache_read_input_tokens.unwrap_or(0);
                let prompt = u
                    .prompt_tokens?
                    .checked_add(read)?
                    .checked_add(u.cache_creation_input_tokens.unwrap_or(0))?;
                return Some((prompt, Some(read)));
            }
            let cached = u.prompt_tokens_details.and_then(|d| d.cached_tokens);
            Some((u.prompt_tokens?, cached))
        });
        let timings = self.timings.and_then(|t| {
            let cached = t.cache_n.unwrap_or(0);
            Some(Usage {
                prompt_tokens: t.prompt_n?.checked_add(cached)?,
                cached_tokens: cached,
            })
        });
        let meta = self.meta_info.and_then(|m| {
            Some(Usage {
                prompt_tokens: m.prompt_tokens?,
                cached_tokens: m.cached_tokens.unwrap_or(0),
            })
        });
        match (usage, timings) {
            (Some((prompt_tokens, Some(cached_tokens))), _) => Some(Usage {
                prompt_tokens,
                cached_tokens,
            }),
            (_, Some(timings)) => Some(timings),
            (Some((prompt_tokens, None)), None) => Some(Usage {
                prompt_tokens,
                cached_tokens: 0,
            }),
            (None, None) => meta,
        }
    }
}

#[cfg(test)]
#[path = "usage_tests.rs"]
mod tests;
