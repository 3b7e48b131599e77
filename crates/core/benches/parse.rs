//! The request view: [`parse_body`] (the routing fields of a body, the members located for forwarding) and the
//! usage scanner a response passes through, at the body sizes of `dprouter overhead`'s cases and 1 MB.
//!
//! Run: `cargo bench -p dprouter-core --bench parse`. Throughput is in bytes, so the figures read as GB/s.
#![allow(clippy::unwrap_used)]

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use dprouter_core::request_body::parse_body;
use dprouter_core::UsageScanner;

/// A chat request of about `bytes` bytes: a system prompt and a user turn.
fn chat(bytes: usize) -> Vec<u8> {
    let text: String = "lorem ipsum dolor sit amet, \\\"quoted\\\" "
        .chars()
        .cycle()
        .take(bytes)
        .collect();
    format!(
        r#"{{"model":"m","messages":[{{"role":"system","content":"{text}"}},{{"role":"user","content":"hi"}}],"max_tokens":16,"stream":true,"routed_dp_rank":1}}"#
    )
    .into_bytes()
}

/// A `/generate` request with `tokens` token ids.
fn token_ids(tokens: usize) -> Vec<u8> {
    let ids: Vec<String> = (0..tokens).map(|i| (i * 7919 % 151_936).to_string()).collect();
    format!(
        r#"{{"input_ids":[{}],"sampling_params":{{"max_new_tokens":16}}}}"#,
        ids.join(",")
    )
    .into_bytes()
}

/// An OpenAI stream of `events` content events, the usage event and `[DONE]`.
fn stream(events: usize) -> Vec<u8> {
    let mut out = String::new();
    for i in 0..events {
        out.push_str(&format!(
            "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"t{i}\"}}}}],\"usage\":null}}\n\n"
        ));
    }
    out.push_str("data: {\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":50,\"completion_tokens\":16,\"prompt_tokens_details\":{\"cached_tokens\":48}}}\n\ndata: [DONE]\n\n");
    out.into_bytes()
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("parse_body");
    for (name, body) in [
        ("chat_200B", chat(60)),
        ("chat_90KB", chat(90_000)),
        ("chat_1MB", chat(1 << 20)),
        ("input_ids_1MB", token_ids(160_000)),
    ] {
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_with_input(BenchmarkId::from_parameter(name), &body, |b, body| {
            b.iter(|| parse_body(black_box(body), true).unwrap())
        });
    }
    group.finish();

    let mut group = c.benchmark_group("usage_scanner");
    let body = stream(16);
    group.throughput(Throughput::Bytes(body.len() as u64));
    group.bench_function("stream_18_events", |b| {
        b.iter(|| {
            let mut scanner = UsageScanner::new(true);
            // As it arrives: one event per piece.
            let mut found = None;
            for piece in body.split_inclusive(|&b| b == b'\n') {
                found = found.or(scanner.feed(black_box(piece)));
            }
            found.unwrap()
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
