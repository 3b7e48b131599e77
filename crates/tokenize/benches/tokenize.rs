//! CPU per request of token-exact keys, rendered with SmolLM2's chat template and tokenized
//! (`cargo bench -p dprouter-tokenize`): a chat of about 200 bytes; a 90 KB conversation seen for the first time
//! (every piece tokenized); and the next turn of a 90 KB conversation (its history's pieces cached, the new message
//! tokenized); and the head a router keys a 20 MB chat on (128 KiB, the gateway's default `tokenize_max_bytes`), as one
//! message and as 20,000, and as one message of denser text (3 bytes a token), seen for the first time. With the `dprouter` binary's allocator, mimalloc.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use criterion::{criterion_group, criterion_main, Criterion};
use dprouter_tokenize::ModelTokenizer;
use serde_json::json;
use serde_json::value::RawValue;

/// The `dprouter` binary's allocator (`src/alloc.rs`): tokenizing allocates and frees many small strings, and
/// with glibc's malloc that was 45% of the time.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The gateway's default `tokenize_max_bytes`, in KiB (`HEAD_KIB` sets another).
const HEAD_KIB: usize = 128;

fn history(bytes: usize, seed: u64) -> String {
    let sentence = "The gateway keys each prompt on the tokens the engine caches, 42 times over. ";
    let text = format!("{seed} {}", sentence.repeat(bytes / sentence.len()));
    text.chars().take(bytes.saturating_sub(40)).collect()
}

fn bench(c: &mut Criterion) {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/smollm2");
    let tokenizer = ModelTokenizer::load(&model).expect("the test model's tokenizer");
    let small = json!([{"role": "system", "content": history(200, 0)}, {"role": "user", "content": "And now?"}]);
    c.bench_function("chat_200B", |b| {
        b.iter(|| tokenizer.chat_ids(&small, None).expect("ids"))
    });
    let n = AtomicU64::new(1);
    c.bench_function("chat_90KB_first_turn", |b| {
        b.iter(|| {
            let seed = n.fetch_add(1, Ordering::Relaxed);
            let messages =
                json!([{"role": "system", "content": history(90_000, seed)}, {"role": "user", "content": "And now?"}]);
            tokenizer.chat_ids(&messages, None).expect("ids")
        })
    });
    let system = history(90_000, 0);
    c.bench_function("chat_90KB_next_turn", |b| {
        b.iter(|| {
            let turn = n.fetch_add(1, Ordering::Relaxed);
            let messages = json!([
                {"role": "system", "content": system},
                {"role": "user", "content": "And now?"},
                {"role": "assistant", "content": "Now this."},
                {"role": "user", "content": format!("Turn {turn}: and then?")},
            ]);
            tokenizer.chat_ids(&messages, None).expect("ids")
        })
    });
    // Text of about 3 bytes a token (each digit is a token), where `history`'s is about 4.5.
    let dense = |bytes: usize, seed: u64| {
        let sentence = "Words and numbers 12345, again and again. ";
        format!("{seed} {}", sentence.repeat(bytes / sentence.len()))
    };
    let huge = |seed: u64, messages: usize, text: &dyn Fn(usize, u64) -> String| {
        let each = 20_000_000 / messages;
        let list: Vec<serde_json::Value> = (0..messages)
            .map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": text(each, seed + i as u64)}))
            .collect();
        RawValue::from_string(serde_json::Value::Array(list).to_string()).expect("JSON")
    };
    let head = std::env::var("HEAD_KIB")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(HEAD_KIB)
        << 10;
    for (name, messages, text) in [
        (
            "chat_20MB_head_one_message",
            1,
            &history as &dyn Fn(usize, u64) -> String,
        ),
        ("chat_20MB_head_20000_messages", 20_000, &history),
        ("chat_20MB_head_one_message_dense", 1, &dense),
    ] {
        c.bench_function(name, |b| {
            b.iter_batched(
                || huge(n.fetch_add(1, Ordering::Relaxed) * 1_000_000, messages, text),
                |raw| tokenizer.chat_head(&raw, None, head).expect("ids"),
                criterion::BatchSize::PerIteration,
            )
        });
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(std::time::Duration::from_secs(3));
    targets = bench
}
criterion_main!(benches);
