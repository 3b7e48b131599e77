//! Whether an answer ended on tool calls: the model stopped to have a tool run, and its client (an agent) will send
//! the next turn, with the tool's result, once it has. Read from the answer's bytes as they pass, in pieces of any
//! size, looking for the finish reason each API gives such an answer:
//!
//! - OpenAI chat completions: `"finish_reason":"tool_calls"` (vLLM, SGLang, llama.cpp);
//! - Anthropic Messages: `"stop_reason":"tool_use"`;
//! - OpenAI Responses: an output item `"type":"function_call"`.
//!
//! With or without a space after the colon (Python's `json.dumps` writes one). Cost: one pass over the bytes with
//! `memchr`'s substring search, and the last few bytes of each piece kept to find a reason cut between pieces.

use memchr::memmem;

const REASONS: [&[u8]; 6] = [
    br#""finish_reason":"tool_calls""#,
    br#""finish_reason": "tool_calls""#,
    br#""stop_reason":"tool_use""#,
    br#""stop_reason": "tool_use""#,
    br#""type":"function_call""#,
    br#""type": "function_call""#,
];

/// The longest reason, less one: what a piece must keep for the next.
const CARRY: usize = 29;

const _: () = assert!(CARRY + 1 >= REASONS[1].len());

/// Reads an answer's bytes for a tool-call finish; see the module documentation.
#[derive(Debug, Default, Clone)]
pub struct ToolCallScanner {
    found: bool,
    tail: Vec<u8>,
}

impl ToolCallScanner {
    /// The next piece of the answer.
    pub fn feed(&mut self, data: &[u8]) {
        if self.found || data.is_empty() {
            return;
        }
        // Across the cut: the stream's last bytes before this piece, and this piece's head.
        self.tail.extend_from_slice(&data[..data.len().min(CARRY)]);
        self.found = REASONS.iter().any(|r| memmem::find(&self.tail, r).is_some())
            || REASONS.iter().any(|r| memmem::find(data, r).is_some());
        // The stream's last bytes, for the next piece.
        if data.len() >= CARRY {
            self.tail.clear();
            self.tail.extend_from_slice(&data[data.len() - CARRY..]);
        } else {
            let excess = self.tail.len().saturating_sub(CARRY);
            self.tail.drain(..excess);
        }
    }

    /// Whether the answer so far ended (or is ending) on tool calls.
    pub fn found(&self) -> bool {
        self.found
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_apis_tool_call_finish_is_found_at_every_cut() {
        let answers: [&[u8]; 4] = [
            br#"data: {"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#,
            br#"event: message_delta\ndata: {"type": "message_delta", "delta": {"stop_reason": "tool_use"}}"#,
            br#"{"output":[{"type":"function_call","name":"get_weather","arguments":"{}"}]}"#,
            br#"{"choices": [{"finish_reason": "tool_calls"}]}"#,
        ];
        for answer in answers {
            for cut in 0..=answer.len() {
                let mut s = ToolCallScanner::default();
                s.feed(&answer[..cut]);
                s.feed(&answer[cut..]);
                assert!(s.found(), "{} cut at {cut}", String::from_utf8_lossy(answer));
            }
            // And a byte at a time.
            let mut s = ToolCallScanner::default();
            answer.chunks(1).for_each(|b| s.feed(b));
            assert!(s.found());
        }
        for other in [
            &br#"data: {"choices":[{"finish_reason":"stop"}]}"#[..],
            br#"{"stop_reason":"end_turn","content":"call tool_calls later"}"#,
            br#"{"type":"message"}"#,
        ] {
            let mut s = ToolCallScanner::default();
            s.feed(other);
            assert!(!s.found(), "{}", String::from_utf8_lossy(other));
        }
    }
}
