//! The gateway's tokenizer (`tokenizers` and a minijinja chat template) against the reference: Python's `jinja2`
//! rendering the same template as Hugging Face's `apply_chat_template` does, and the `tokenizers` package, on the
//! SmolLM2 model files in `tests/data/smollm2`, over varied conversations and texts.
#![allow(clippy::unwrap_used)]

mod common;

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use common::memory;
use dprouter_tokenize::ModelTokenizer;
use serde_json::{json, Value};

const MODEL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/smollm2");

fn cases() -> Vec<Value> {
    let long = "The quick brown fox jumps over the lazy dog. ".repeat(60);
    vec![
        json!({"messages": [{"role": "user", "content": "Hello!"}]}),
        json!({"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]}),
        json!({"messages": [
            {"role": "system", "content": "You answer in French."},
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "Quatre."},
            {"role": "user", "content": "And 12345 * 678?"},
        ]}),
        json!({"messages": [{"role": "user", "content": "naïve café, 東京, Ελληνικά, 🦀🚀 and\ttabs\n\n  spaces   "}]}),
        json!({"messages": [{"role": "user", "content": "fn main() {\n    println!(\"{}\", 1 << 3);\n}\n"}]}),
        json!({"messages": [{"role": "user", "content": "special <|im_start|> and <|im_end|> inside"}]}),
        json!({"messages": [{"role": "user", "content": long}], "tools": [{"type": "function", "function": {"name": "f"}}]}),
        json!({"messages": [{"role": "tool", "content": "{\"temperature\": 21.5}"}]}),
        json!({"messages": []}),
        json!({"text": "Once upon a time"}),
        json!({"text": "  leading spaces, numbers 3.14159 and 2026-11-30"}),
        json!({"text": long}),
    ]
}

fn ours(tokenizer: &ModelTokenizer, case: &Value) -> Value {
    let result = match case.get("messages") {
        Some(messages) => tokenizer.chat_ids(messages, case.get("tools")),
        None => tokenizer.text_ids(case["text"].as_str().unwrap()),
    };
    match result {
        Ok(ids) => json!(ids),
        Err(e) => json!({"error": e}),
    }
}

#[test]
fn chat_and_text_token_ids_match_transformers_rendering_and_the_tokenizers_package() {
    let tokenizer = ModelTokenizer::load(Path::new(MODEL)).unwrap();
    assert!(tokenizer.has_chat_template());
    let cases = cases();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/tokenize_reference.py");
    let mut child = Command::new(common::python())
        .arg(script)
        .arg(MODEL)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    {
        let mut stdin = child.stdin.take().unwrap();
        for case in &cases {
            writeln!(stdin, "{case}").unwrap();
        }
    }
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let reference: Vec<Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(reference.len(), cases.len());
    for (case, expected) in cases.iter().zip(&reference) {
        assert!(expected.is_array(), "the reference refused {case}: {expected}");
        assert_eq!(&ours(&tokenizer, case), expected, "{case}");
    }
    // The rendering itself, for one conversation, as the template writes it.
    let text = tokenizer
        .render_chat(&json!([{"role": "user", "content": "Hi"}]), None)
        .unwrap();
    assert_eq!(
        text,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
}

/// A 20 MB chat through a gateway with a tokenizer: only its head is rendered and tokenized (counted as cut), the
/// request is answered, and the gateway's peak memory grows by at most 5 times the body (rendering the whole
/// conversation through the template took 8.5 times; tokenizing it whole, about 200 times). Once as one message,
/// once as 20,000 messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_chat_is_rendered_and_tokenized_only_as_far_as_keys_need() {
    // An engine that takes the whole 6-million-token prompt, to answer it.
    let engine = common::Proc::engine(&["--dp-size", "2", "--context-length", "100000000"]);
    let config = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("tokenizer-huge.toml");
    std::fs::write(&config, format!("tokenizer = {MODEL:?}\n")).unwrap();
    let gw = common::Proc::gateway(&[&engine], &["--config", config.to_str().unwrap()]);
    let c = common::client();
    let sentence = "Words and numbers 12345, again and again. ";
    let one = json!([{"role": "user", "content": sentence.repeat(500_000)}]);
    let many: Vec<serde_json::Value> = (0..20_000)
        .map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": sentence.repeat(25)}))
        .collect();
    for (n, (shape, messages)) in [("one message", one), ("20,000 messages", json!(many))]
        .into_iter()
        .enumerate()
    {
        memory::reset_peak_rss(gw.child.id());
        let before = memory::peak_rss(gw.child.id());
        let cpu = memory::cpu_seconds(gw.child.id());
        let body = json!({"model": "m", "max_tokens": 1, "messages": messages});
        let size = body.to_string().len() as u64;
        let reply = common::post(&c, &format!("{}/v1/chat/completions", gw.url), &[], &body).await;
        assert_eq!(reply.status, hyper::StatusCode::OK, "{}", reply.text);
        let metrics = common::get(&c, &format!("{}/metrics", gw.url)).await.text;
        let cut = format!("dprouter_tokenize_cut_total {}", n + 1);
        assert!(
            metrics.lines().any(|l| l == cut),
            "{}",
            metrics
                .lines()
                .filter(|l| l.contains("tokenize"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        let grown = memory::peak_rss(gw.child.id()).saturating_sub(before);
        eprintln!(
            "{shape}: peak RSS grew by {:.1} MB for a {:.1} MB chat ({:.2}x); the gateway's CPU for it: {:.0} ms",
            grown as f64 / 1e6,
            size as f64 / 1e6,
            grown as f64 / size as f64,
            (memory::cpu_seconds(gw.child.id()) - cpu) * 1e3
        );
        assert!(grown <= 5 * size, "{shape}: peak RSS grew by {} MB", grown >> 20);
    }
}
