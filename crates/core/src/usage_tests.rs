//! Tests of the usage scanner: each engine's report, whole and streamed, cut anywhere.

use super::*;
use proptest::prelude::*;

fn whole(body: &[u8], sse: bool) -> Option<Usage> {
    let mut s = UsageScanner::new(sse);
    s.feed(body).or_else(|| s.finish())
}

fn output_tokens(body: &[u8], sse: bool) -> Option<u64> {
    let mut s = UsageScanner::new(sse);
    s.feed(body).or_else(|| s.finish())?;
    s.output_tokens()
}

#[test]
fn output_tokens_come_with_the_report() {
    let openai = br#"{"usage":{"prompt_tokens":9,"completion_tokens":2}}"#;
    assert_eq!(output_tokens(openai, false), Some(2));
    let responses = br#"{"usage":{"input_tokens":40,"input_tokens_details":{"cached_tokens":32},"output_tokens":3}}"#;
    assert_eq!(output_tokens(responses, false), Some(3));
    let llama = b"data: {\"choices\":[],\"timings\":{\"cache_n\":5,\"prompt_n\":3,\"predicted_n\":7}}\n\n";
    assert_eq!(output_tokens(llama, true), Some(7));
    let sglang = br#"{"text":"hi","meta_info":{"prompt_tokens":5,"cached_tokens":0,"completion_tokens":4}}"#;
    assert_eq!(output_tokens(sglang, false), Some(4));
    // SGLang's stream reports in its first event, whose count is not the answer's.
    let sglang_stream = b"data: {\"text\":\"h\",\"meta_info\":{\"prompt_tokens\":5,\"completion_tokens\":1}}\n\n";
    assert_eq!(output_tokens(sglang_stream, true), None);
    // No report, no count.
    let mut s = UsageScanner::new(false);
    assert_eq!(s.feed(br#"{"usage":{"completion_tokens":2}}"#), None);
    assert_eq!(s.output_tokens(), None);
}

fn usage(prompt_tokens: u64, cached_tokens: u64) -> Option<Usage> {
    Some(Usage {
        prompt_tokens,
        cached_tokens,
    })
}

#[test]
fn reads_openai_sglang_and_llama_cpp_reports() {
    let openai = br#"{"choices": [], "usage": {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 64}}}"#;
    assert_eq!(whole(openai, false), usage(100, 64));
    let no_details = br#"{"usage":{"prompt_tokens":9,"completion_tokens":2}}"#;
    assert_eq!(whole(no_details, false), usage(9, 0));
    let sglang = br#"{"text": "x", "meta_info": {"prompt_tokens": 9, "cached_tokens": 8}}"#;
    assert_eq!(whole(sglang, false), usage(9, 8));
    let llama = br#"{"choices":[],"usage":{"prompt_tokens":30},"timings":{"cache_n":20,"prompt_n":10}}"#;
    assert_eq!(
        whole(llama, false),
        usage(30, 20),
        "timings beat a usage without details"
    );
    let stream = b"data: {\"choices\": [{\"delta\": {}}], \"usage\": null}\n\ndata: {\"choices\": [], \"usage\": {\"prompt_tokens\": 7}}\n\ndata: [DONE]\n\n";
    assert_eq!(whole(stream, true), usage(7, 0));
    let llama_stream = b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: {\"choices\":[{\"finish_reason\":\"stop\"}],\"timings\":{\"cache_n\":5,\"prompt_n\":3}}\n\ndata: [DONE]\n\n";
    assert_eq!(whole(llama_stream, true), usage(8, 5));
    assert_eq!(whole(b"data: [DONE]\n\n", true), None);
    assert_eq!(whole(b"{\"usage\": null}", false), None);
}

#[test]
fn reads_responses_reports_whole_and_streamed() {
    let whole_response = br#"{"id":"resp_1","object":"response","output":[{"type":"message","content":[{"type":"output_text","text":"usage"}]}],"usage":{"input_tokens":40,"input_tokens_details":{"cached_tokens":32},"output_tokens":3}}"#;
    assert_eq!(whole(whole_response, false), usage(40, 32));
    // A stream: `response.created` has `"usage": null`; the text deltas look like usage reports but are not
    // top-level members; `response.completed` carries it inside `response`, after the whole output.
    let stream = concat!(
        "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"r\",\"usage\":null}}\n\n",
        "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"{\\\"usage\\\":1}\",\"item\":{\"usage\":{\"input_tokens\":1}}}\n\n",
        "event: response.completed\ndata: {\"type\":\"response.completed\",\"sequence_number\":9,\"response\":{\"id\":\"r\",",
        "\"output\":[{\"content\":[{\"text\":\"usage\",\"usage\":{\"input_tokens\":2}}]}],\"metadata\":{},",
        "\"usage\":{\"input_tokens\":12,\"input_tokens_details\":{\"cached_tokens\":8},\"output_tokens\":2},\"user\":null},\"x\":1}\n\n",
    );
    assert_eq!(whole(stream.as_bytes(), true), usage(12, 8));
    // Only a top-level `response`, and only its own members.
    let nested = br#"{"a":{"response":{"usage":{"input_tokens":1}}},"response":{"b":{"usage":{"input_tokens":2}}}}"#;
    assert_eq!(whole(nested, false), None);
    assert_eq!(
        whole(br#"{"response":"usage","usage":{"input_tokens":3}}"#, false),
        usage(3, 0)
    );
}

#[test]
fn reads_anthropic_reports_whole_and_streamed() {
    let message = br#"{"id":"msg_1","type":"message","content":[{"type":"text","text":"usage"}],"usage":{"input_tokens":40,"cache_read_input_tokens":60,"cache_creation_input_tokens":4,"output_tokens":3}}"#;
    assert_eq!(whole(message, false), usage(104, 60));
    let stream = concat!(
        "event: message_start\n",
        r#"data: {"type":"message_start","message":{"id":"msg_1","content":[],"usage":{"input_tokens":10,"cache_read_input_tokens":90,"output_tokens":1}}}"#,
        "\n\nevent: content_block_delta\n",
        r#"data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"hi"}}"#,
        "\n\n",
    );
    let mut scanner = UsageScanner::new(true);
    let at_start = stream.find("event: content_block_delta").unwrap();
    assert_eq!(
        scanner.feed(&stream.as_bytes()[..at_start]),
        usage(100, 90),
        "read from message_start"
    );
    // vLLM's `message_start` says nothing of the cache: its `message_delta`, at the end, has the whole report.
    let vllm = concat!(
        "event: message_start\n",
        r#"data: {"type":"message_start","message":{"id":"msg_2","content":[],"usage":{"input_tokens":600,"output_tokens":0}}}"#,
        "\n\nevent: content_block_delta\n",
        r#"data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"hi"}}"#,
        "\n\nevent: message_delta\n",
        r#"data: {"type":"message_delta","delta":{"stop_reason":"max_tokens"},"usage":{"input_tokens":88,"cache_read_input_tokens":512,"output_tokens":4}}"#,
        "\n\n",
    );
    let mut scanner = UsageScanner::new(true);
    let at_delta = vllm.find("event: message_delta").unwrap();
    assert_eq!(
        scanner.feed(&vllm.as_bytes()[..at_delta]),
        None,
        "the start's report may be partial"
    );
    assert_eq!(scanner.feed(&vllm.as_bytes()[at_delta..]), usage(600, 512));
    assert_eq!(scanner.output_tokens(), Some(4));
    // A stream that ends without a later report: the start's stands.
    let mut scanner = UsageScanner::new(true);
    assert_eq!(scanner.feed(&vllm.as_bytes()[..at_delta]), None);
    assert_eq!(scanner.finish(), usage(600, 0));
    // Without the cache fields, `input_tokens` is the whole prompt and nothing was cached.
    assert_eq!(
        whole(
            br#"{"type":"message","usage":{"input_tokens":12,"output_tokens":3}}"#,
            false
        ),
        usage(12, 0)
    );
}

#[test]
fn a_responses_id_is_kept_when_wanted() {
    let whole = br#"{"id":"resp_1","output":[{"id":"msg_1"}],"usage":{"input_tokens":4}}"#;
    let mut s = UsageScanner::with_response_id(false);
    assert_eq!(s.feed(whole), usage(4, 0));
    assert_eq!(s.take_response_id().as_deref(), Some("resp_1"));
    assert_eq!(s.take_response_id(), None, "taken once");
    let mut plain = UsageScanner::new(false);
    plain.feed(whole);
    assert_eq!(plain.take_response_id(), None, "not wanted");
    // Streamed: the first event's `response.id`, read before the report; item ids are not it.
    let mut s = UsageScanner::with_response_id(true);
    let first = "event: response.output_item.added\ndata: {\"item\":{\"id\":\"msg_1\"}}\n\n";
    assert_eq!(s.feed(first.as_bytes()), None);
    assert_eq!(s.take_response_id(), None);
    let created = "data: {\"type\":\"response.created\",\"response\":{\"id\":\"resp_2\",\"usage\":null}}\n\n";
    assert_eq!(s.feed(created.as_bytes()), None);
    assert_eq!(s.take_response_id().as_deref(), Some("resp_2"));
    let done = "data: {\"response\":{\"id\":\"resp_2\",\"usage\":{\"input_tokens\":5}}}\n\n";
    assert_eq!(s.feed(done.as_bytes()), usage(5, 0));
    assert_eq!(s.take_response_id(), None, "kept once");
}

#[test]
fn only_top_level_members_count() {
    let nested = br#"{"choices":[{"message":{"content":"{\"usage\":{\"prompt_tokens\":1}}","usage":{"prompt_tokens":2}}}],"x":{"usage":{"prompt_tokens":3}}}"#;
    assert_eq!(whole(nested, false), None);
    let key_in_value = br#"{"a":"usage","b":{"prompt_tokens":4},"usage":{"prompt_tokens":5}}"#;
    assert_eq!(whole(key_in_value, false), usage(5, 0));
}

#[test]
fn a_stream_reports_as_soon_as_the_event_is_read() {
    let mut s = UsageScanner::new(true);
    assert_eq!(
        s.feed(b"data: {\"text\":\"a\",\"meta_info\":{\"prompt_tokens\":3,\"cached"),
        None
    );
    assert_eq!(
        s.feed(b"_tokens\":2}}\n"),
        usage(3, 2),
        "reported at the end of the line"
    );
    assert_eq!(
        s.feed(b"\ndata: {\"meta_info\":{\"prompt_tokens\":3,\"cached_tokens\":2}}\n\n"),
        None,
        "once"
    );
    assert!(s.found());
}

#[test]
fn other_lines_and_comments_are_skipped() {
    let s = b": keep-alive\nevent: x\nid: 1\ndata:{\"usage\":{\"prompt_tokens\":4,\"prompt_tokens_details\":{\"cached_tokens\":1}}}\n\n";
    assert_eq!(whole(s, true), usage(4, 1));
    assert_eq!(whole(b"dat: {\"usage\":{\"prompt_tokens\":4}}\n", true), None);
    assert_eq!(
        whole(b"data: {\"usage\":{\"prompt_tokens\":4}}", true),
        usage(4, 0),
        "no final newline"
    );
}

#[test]
fn a_huge_member_is_not_kept() {
    let big = format!(
        r#"{{"usage":{{"prompt_tokens":1,"pad":"{}"}}}}"#,
        "x".repeat(MAX_MEMBER_BYTES)
    );
    assert_eq!(whole(big.as_bytes(), false), None);
    let mut s = UsageScanner::new(false);
    s.feed(&big.as_bytes()[..big.len() - 2]);
    assert!(
        matches!(s.json.keeping, Some((Member::Usage, None))),
        "the member's bytes were dropped once over the bound"
    );
}

#[test]
fn framing_follows_the_last_bytes() {
    let mut s = UsageScanner::new(true);
    assert_eq!(s.framing(), Framing::EventEnded);
    s.feed(b"data: {\"a\"");
    assert_eq!(s.framing(), Framing::InLine);
    s.feed(b":1}\n");
    assert_eq!(s.framing(), Framing::LineEnded);
    s.feed(b"\n");
    assert_eq!(s.framing(), Framing::EventEnded);
}

proptest! {
    /// Split anywhere, a response gives the report it gives whole.
    #[test]
    fn pieces_give_the_same_report(cuts in proptest::collection::vec(0usize..400, 0..12), sse in any::<bool>(), cached in 0u64..1000, responses in any::<bool>()) {
        let json = format!(r#"{{"id":"x","choices":[{{"message":{{"content":"a \"q\" \\ {{usage}}"}}}}],"usage":{{"prompt_tokens":1000,"prompt_tokens_details":{{"cached_tokens":{cached}}}}}}}"#);
        // A Responses event: the same report inside `response`, after a member that holds a decoy.
        let json = if responses { format!(r#"{{"type":"response.completed","response" : {{"output":[{{"usage":1}}],"response":{{"usage":2}}, "usage" : {{"input_tokens":1000,"input_tokens_details":{{"cached_tokens":{cached}}}}}}}}}"#) } else { json };
        let body = if sse { format!(": c\n\ndata: {{\"choices\":[]}}\r\n\r\ndata: {json}\n\ndata: [DONE]\n\n") } else { json };
        let bytes = body.as_bytes();
        let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(bytes.len())).collect();
        cuts.sort_unstable();
        let mut s = UsageScanner::new(sse);
        let mut got = None;
        let mut from = 0;
        for cut in cuts.into_iter().chain([bytes.len()]) {
            if let Some(u) = s.feed(&bytes[from..cut]) {
                prop_assert!(got.is_none());
                got = Some(u);
            }
            from = cut;
        }
        got = got.or_else(|| s.finish());
        prop_assert_eq!(got, usage(1000, cached));
    }

    /// Arbitrary bytes in arbitrary pieces: no panic, and memory stays bounded.
    #[test]
    fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..2000), sse in any::<bool>(), step in 1usize..64) {
        let mut s = UsageScanner::new(sse);
        for piece in data.chunks(step) {
            let _ = s.feed(piece);
            if let Some((_, Some(kept))) = &s.json.keeping {
                prop_assert!(kept.len() <= MAX_MEMBER_BYTES);
            }
        }
        let _ = s.finish();
    }
}
