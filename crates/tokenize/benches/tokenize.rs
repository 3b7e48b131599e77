//! CPU per request of token-exact keys, rendered with SmolLM2's chat template and tokenized
//! (`cargo bench -p dprouter-tokenize`): a chat of about 200 bytes; a 90 KB conversation seen for the first time
//! (every piece tokenized); and the next turn of a 90 KB conversation (its history's pieces cached, the new message
//! tokenized).

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

use criterion::{criterion_group, criterion_main, Criterion};
use dprouter_tokenize::ModelTokenizer;
use serde_json::json;

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
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(std::time::Duration::from_secs(3));
    targets = bench
}
criterion_main!(benches);
