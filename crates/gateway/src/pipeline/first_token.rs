//! Where a streamed answer's first token is. An OpenAI or SGLang stream's first event carries it; Anthropic's and
//! the Responses API's streams open with events sent before the engine has computed anything (`message_start`,
//! `content_block_start`, `ping`; `response.created`, `response.in_progress`, `response.output_item.added`: vLLM
//! and SGLang send `response.created` before running the model). Until the first token, the engine is still
//! prefilling: the request's queued-prefill share is held, and the time to it is the answer's TTFT and its prefill
//! sample ([`dprouter_core::cost_fit`]).
//!
//! The rule: an event without an `event:` line counts at its first `data:` line; a typed event counts when its
//! type ends in `delta` (`content_block_delta`, `response.output_text.delta`,
//! `response.function_call_arguments.delta`, …). Only the start of each line is looked at (at most [`KEEP`]
//! bytes), so a stream is read once, in bounded memory, at any cut; JSON strings cannot end a line, so nothing a
//! client wrote into a prompt can pass for an event.

/// The most bytes of a line kept (an `event:` line's type is a few dozen).
const KEEP: usize = 80;

/// Reads a stream's lines until its first token.
#[derive(Debug, Default)]
pub struct FirstToken {
    /// The current line's first bytes.
    line: Vec<u8>,
    /// The current event's type counts (`Some(true)`), does not (`Some(false)`), or was not given (`None`).
    counts: Option<bool>,
    seen: bool,
}

impl FirstToken {
    /// Whether the first token is in `data` or came before it.
    pub fn seen_in(&mut self, data: &[u8]) -> bool {
        for &byte in data {
            if self.seen {
                break;
            }
            match byte {
                b'\n' => self.end_line(),
                _ if self.line.len() < KEEP => {
                    self.line.push(byte);
                    // A data line counts as soon as it is known to be one.
                    if self.line == b"data:" && self.counts != Some(false) {
                        self.seen = true;
                    }
                }
                _ => {}
            }
        }
        self.seen
    }

    fn end_line(&mut self) {
        let line = self.line.strip_suffix(b"\r").unwrap_or(&self.line);
        if line.is_empty() {
            self.counts = None;
        } else if let Some(kind) = line.strip_prefix(b"event:") {
            self.counts = Some(kind.trim_ascii().ends_with(b"delta"));
        }
        self.line.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::FirstToken;

    /// Whether the stream's first token is seen by the end of `stream`.
    fn seen(stream: &[u8]) -> bool {
        FirstToken::default().seen_in(stream)
    }

    #[test]
    fn an_untyped_stream_counts_at_its_first_data_line() {
        assert!(seen(b"data: {\"choices\": []}\n\n"));
        assert!(seen(b": keep-alive\n\ndata: {}\n\n"));
        assert!(!seen(b": keep-alive\n\n"));
    }

    #[test]
    fn anthropics_stream_counts_at_its_first_content_block_delta() {
        let before = "event: message_start\ndata: {\"type\": \"message_start\", \"message\": {\"model\": \"x\"}}\n\n\
                      event: content_block_start\ndata: {}\n\nevent: ping\ndata: {}\n\n";
        assert!(!seen(before.as_bytes()));
        let stream = format!("{before}event: content_block_delta\ndata: {{}}\n\n");
        assert!(seen(stream.as_bytes()));
    }

    #[test]
    fn a_responses_stream_counts_at_its_first_delta_not_at_its_echo_of_the_request() {
        // `response.created` echoes the request: its instructions may contain anything a client wrote.
        let echo = r#"{"response": {"instructions": "event: response.output_text.delta\ndata: x"}}"#;
        let before = format!(
            "event: response.created\ndata: {echo}\n\nevent: response.in_progress\ndata: {echo}\n\n\
             event: response.output_item.added\ndata: {{}}\n\n"
        );
        assert!(!seen(before.as_bytes()));
        for first in ["response.output_text.delta", "response.function_call_arguments.delta"] {
            let stream = format!("{before}event: {first}\r\ndata: {{}}\r\n\r\n");
            assert!(seen(stream.as_bytes()), "{first}");
        }
    }

    #[test]
    fn the_first_token_is_seen_at_any_cut_and_never_before_it() {
        let before = "event: message_start\r\ndata: {}\r\n\r\nevent: ping\r\ndata: {}\r\n\r\n";
        let stream = format!("{before}event: content_block_delta\r\ndata: {{}}\r\n\r\n");
        let at = stream.rfind("data:").unwrap();
        for cut in 0..stream.len() {
            let mut first = FirstToken::default();
            let (a, b) = stream.as_bytes().split_at(cut);
            let early = first.seen_in(a);
            assert_eq!(early, cut >= at + 5, "cut at {cut}");
            assert!(first.seen_in(b), "cut at {cut}");
        }
        // A line longer than what is kept is read to its end without growing.
        let mut first = FirstToken::default();
        let long = format!("event: {}\ndata: {{}}\n\n", "x".repeat(10_000));
        assert!(!first.seen_in(long.as_bytes()));
        assert!(first.line.capacity() <= 128);
    }
}
