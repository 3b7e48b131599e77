//! End-to-end precise mode: a mock engine publishes its ranks' KV cache events over ZMQ, and the gateway's
//! `cache_aware` index follows them, so it knows what the engine cached behind its back and forgets what the
//! engine dropped.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::Duration;

use common::{client, eventually, get, post, Proc};
use hyper::StatusCode;
use serde_json::{json, Value};

/// A gateway whose `cache_aware` (16-token blocks) follows `engine`'s KV events (its endpoints read from its
/// `/get_server_info`); `top` goes at the top of its config.
async fn following_gateway(engine: &Proc, name: &str, top: &str) -> Proc {
    let info = get(&client(), &format!("{}/get_server_info", engine.url)).await.json;
    let config = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("kv-events-{name}.toml"));
    let toml = format!(
        "{top}\n[routing]\npolicy = \"cache_aware\"\nblock_tokens = 16\n\n[[workers]]\nurl = {:?}\ndp_size = 2\nkv_events = {}\nkv_events_replay = {}\n",
        engine.url, info["kv_events_endpoints"], info["kv_events_replay_endpoints"]
    );
    std::fs::write(&config, toml).unwrap();
    Proc::start(&["serve", "--listen", "127.0.0.1:0", "--config", config.to_str().unwrap()])
}

/// A mock engine with two ranks publishing their KV events and serving replays on free ports (listed in its
/// `/get_server_info`), with `extra` flags.
fn publishing_engine(extra: &[&str]) -> Proc {
    let mut args = vec![
        "--dp-size",
        "2",
        "--kv-events",
        "tcp://127.0.0.1:0",
        "--kv-events-replay",
        "tcp://127.0.0.1:0",
    ];
    args.extend_from_slice(extra);
    Proc::engine(&args)
}

/// A mock engine publishing its events (free ports, listed in `/get_server_info`), and a gateway following them.
async fn engine_and_gateway(name: &str, encoding: &str) -> (Proc, Proc) {
    let engine = publishing_engine(&["--kv-events-encoding", encoding]);
    let gw = following_gateway(&engine, name, "").await;
    (engine, gw)
}

fn ids(seed: u32, len: u32) -> Vec<u32> {
    (0..len).map(|i| (seed * 7_919 + i * 31) % 150_000).collect()
}

fn generate(ids: &[u32], rank: Option<u32>) -> Value {
    let mut body = json!({"input_ids": ids, "sampling_params": {"max_new_tokens": 1}});
    if let Some(rank) = rank {
        body["routed_dp_rank"] = json!(rank);
    }
    body
}

async fn feeds(gw: &Proc) -> Vec<Value> {
    get(&client(), &format!("{}/kv_events", gw.url)).await.json["feeds"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

/// Waits until the gateway's two feeds are connected.
async fn wait_for_both_feeds(gw: &Proc) {
    let subscribed = eventually(Duration::from_secs(10), || async {
        let feeds = feeds(gw).await;
        feeds.len() == 2 && feeds.iter().all(|f| f["connected"] == json!(true))
    });
    assert!(subscribed.await, "{:?}", feeds(gw).await);
}

/// Caches `prompt` at the engine directly (on `rank`), without the gateway.
async fn seed_at_engine(engine: &Proc, prompt: &[u32], rank: u32) {
    let seeded = post(
        &client(),
        &format!("{}/generate", engine.url),
        &[],
        &generate(prompt, Some(rank)),
    )
    .await;
    assert_eq!(seeded.status, StatusCode::OK, "{}", seeded.text);
}

/// Prompts cached at the engine directly (the gateway never routed them) are found where the engine put them;
/// a flush at the engine is seen too. Without events, the gateway would place each of the eight by its cold
/// rendezvous choice and find all eight by chance once in 256 runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_index_follows_what_the_engine_caches_behind_the_gateways_back() {
    for encoding in ["positional", "named"] {
        let (engine, gw) = engine_and_gateway(encoding, encoding).await;
        let c = client();
        wait_for_both_feeds(&gw).await;
        let prompts: Vec<Vec<u32>> = (0..8).map(|i| ids(i + 1, 200)).collect();
        for (i, prompt) in prompts.iter().enumerate() {
            seed_at_engine(&engine, prompt, i as u32 % 2).await;
        }
        // 8 prompts of 200 tokens plus one answer token each: 12 router blocks of 16 each.
        let followed = eventually(Duration::from_secs(10), || async {
            feeds(&gw)
                .await
                .iter()
                .map(|f| f["router_blocks"].as_u64().unwrap())
                .sum::<u64>()
                == 8 * 12
        });
        assert!(followed.await, "{:?}", feeds(&gw).await);
        for (i, prompt) in prompts.iter().enumerate() {
            let reply = post(&c, &format!("{}/generate", gw.url), &[], &generate(prompt, None)).await;
            assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
            assert_eq!(reply.rank, Some(i as u64 % 2), "{encoding}: prompt {i} went elsewhere");
            assert_eq!(reply.json["meta_info"]["cached_tokens"], json!(199), "{}", reply.text);
        }
        // The engine forgets everything: so does the index, and the same prompts are cold again.
        assert_eq!(
            post(&c, &format!("{}/flush_cache", engine.url), &[], &json!({}))
                .await
                .status,
            StatusCode::OK
        );
        let emptied = eventually(Duration::from_secs(10), || async {
            feeds(&gw).await.iter().all(|f| f["router_blocks"] == json!(0))
        });
        assert!(emptied.await, "{:?}", feeds(&gw).await);
        let workers = get(&c, &format!("{}/workers", gw.url)).await.json;
        let cold_before = workers["decisions"]["cold"].as_u64().unwrap_or(0);
        post(&c, &format!("{}/generate", gw.url), &[], &generate(&prompts[0], None)).await;
        let workers = get(&c, &format!("{}/workers", gw.url)).await.json;
        assert_eq!(
            workers["decisions"]["cold"].as_u64(),
            Some(cold_before + 1),
            "{workers}"
        );
        let scrape = get(&c, &format!("{}/metrics", gw.url)).await.text;
        assert!(scrape.contains("dprouter_kv_event_batches_total"), "{scrape}");
        assert!(
            scrape.contains("dprouter_cache_prediction_error_tokens_bucket"),
            "{scrape}"
        );
    }
}

/// A gateway that starts after the engine has cached prompts learns them from the engine's replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_gateway_learns_the_cache_from_the_replay() {
    let engine = publishing_engine(&[]);
    let c = client();
    let prompt = ids(99, 160);
    seed_at_engine(&engine, &prompt, 1).await;
    let gw = following_gateway(&engine, "late", "").await;
    let learned = eventually(Duration::from_secs(10), || async {
        feeds(&gw)
            .await
            .iter()
            .map(|f| f["router_blocks"].as_u64().unwrap())
            .sum::<u64>()
            == 10
    });
    assert!(learned.await, "{:?}", feeds(&gw).await);
    let reply = post(&c, &format!("{}/generate", gw.url), &[], &generate(&prompt, None)).await;
    assert_eq!(
        (reply.rank, reply.json["meta_info"]["cached_tokens"].as_u64()),
        (Some(1), Some(159))
    );
}

/// The Python publisher of `tests/kv_publisher.py`, driven line by line.
struct PythonPublisher {
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    stdout: std::io::BufReader<std::process::ChildStdout>,
    publisher: String,
    replay: String,
}

impl PythonPublisher {
    fn start() -> Self {
        Self::start_with(&[])
    }

    /// With `args` (`--connect ENDPOINT`).
    fn start_with(args: &[&str]) -> Self {
        use std::io::BufRead;
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/kv_publisher.py");
        let mut child = std::process::Command::new(common::python())
            .arg(script)
            .args(args)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let words: Vec<&str> = line.split_whitespace().collect();
        assert_eq!((words.len(), words[0], words[2]), (4, "pub", "replay"), "{line:?}");
        let (publisher, replay) = (words[1].to_string(), words[3].to_string());
        Self {
            child,
            stdin,
            stdout,
            publisher,
            replay,
        }
    }

    fn run(&mut self, command: &str) {
        use std::io::{BufRead, Write};
        writeln!(self.stdin, "{command}").unwrap();
        self.stdin.flush().unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "done", "{command}");
    }
}

impl Drop for PythonPublisher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The tokens `tests/kv_publisher.py` stores.
fn python_tokens(seed: u32, n: u32) -> Vec<u32> {
    ids(seed, n)
}

/// An independent publisher (pyzmq, msgspec structs as vLLM defines them) sends batches with a gap, a removal,
/// bytes hashes and an orphan, then restarts: the gateway's feed and index follow it exactly, and a rank whose
/// publisher never speaks routes as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vllm_style_publisher_written_in_python_is_followed() {
    let mut python = PythonPublisher::start();
    let engine = Proc::engine(&["--dp-size", "2"]);
    let (silent, silent_port) = common::hold_port(0);
    let config = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("kv-events-python.toml");
    let toml = format!(
        "[routing]\npolicy = \"cache_aware\"\nblock_tokens = 16\n\n[[workers]]\nurl = {:?}\ndp_size = 2\nkv_events = [{:?}, \"tcp://127.0.0.1:{silent_port}\"]\nkv_events_replay = [{:?}, \"tcp://127.0.0.1:{silent_port}\"]\n",
        engine.url, python.publisher, python.replay
    );
    std::fs::write(&config, toml).unwrap();
    let gw = Proc::start(&["serve", "--listen", "127.0.0.1:0", "--config", config.to_str().unwrap()]);
    let c = client();
    let feed = || async {
        feeds(&gw)
            .await
            .into_iter()
            .find(|f| f["endpoint"] == json!("w0r0"))
            .unwrap_or_default()
    };
    assert!(
        eventually(Duration::from_secs(10), || async {
            feed().await["connected"] == json!(true)
        })
        .await
    );
    python.run("script");
    // A: 64 tokens, 4 router blocks; B: 48 tokens less its last 16, 2; C (replayed after the gap): 2; D: orphan.
    let followed = eventually(Duration::from_secs(10), || async {
        feed().await["router_blocks"] == json!(8)
    });
    assert!(followed.await, "{}", feed().await);
    let status = feed().await;
    assert_eq!(status["gaps"], json!(1), "{status}");
    assert!(status["replayed_batches"].as_u64().unwrap() >= 1, "{status}");
    assert_eq!(status["orphans"], json!(1), "{status}");
    assert_eq!(status["last_seq"], json!(5), "{status}");
    // A and C are at rank 0 as far as the gateway knows (hits); D, an orphan, is nowhere (cold).
    for (prompt, rank, branch) in [
        (python_tokens(1, 70), 0, "hit"),
        (python_tokens(3, 40), 0, "hit"),
        (python_tokens(4, 40), 0, "cold"),
    ] {
        let before = get(&c, &format!("{}/workers", gw.url)).await.json["decisions"][branch]
            .as_u64()
            .unwrap_or(0);
        let reply = post(&c, &format!("{}/generate", gw.url), &[], &generate(&prompt, None)).await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
        let after = get(&c, &format!("{}/workers", gw.url)).await.json["decisions"][branch]
            .as_u64()
            .unwrap_or(0);
        assert_eq!(after, before + 1, "{branch}");
        if branch == "hit" {
            assert_eq!(reply.rank, Some(rank));
        }
    }
    // The publisher restarts: the index holds only what its new life published (E and F, one block each).
    python.run("restart");
    let restarted = eventually(Duration::from_secs(10), || async {
        let f = feed().await;
        f["restarts"] == json!(1) && f["router_blocks"] == json!(2)
    });
    assert!(restarted.await, "{}", feed().await);
    // Garbage (a truncated batch, an unknown event type): approximate mode, counted, then precise again with the
    // next stored blocks; routing goes on throughout.
    python.run("garbage");
    let recovered = eventually(Duration::from_secs(10), || async {
        let f = feed().await;
        f["decode_errors"] == json!(2) && f["precise"] == json!(true) && f["router_blocks"] == json!(1)
    });
    assert!(recovered.await, "{}", feed().await);
    let reply = post(
        &c,
        &format!("{}/generate", gw.url),
        &[],
        &generate(&python_tokens(7, 20), None),
    )
    .await;
    assert_eq!((reply.status, reply.rank), (StatusCode::OK, Some(0)), "{}", reply.text);
    let silent_feed = feeds(&gw).await.into_iter().find(|f| f["endpoint"] == json!("w0r1"));
    assert!(
        silent_feed.as_ref().is_none_or(|f| f["batches"] == json!(0)),
        "{silent_feed:?}"
    );
    drop(silent);
}

/// A gateway whose feed of the Python publisher's rank 0 has the given shape (`kv_events = ...` or
/// `kv_events_bind = ...` at `publisher`) in front of a mock engine of two ranks, and the feed's status.
async fn gateway_for_python(engine: &Proc, name: &str, events: &str, replay: &str) -> Proc {
    let config = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("kv-events-{name}.toml"));
    let toml = format!(
        "[routing]\npolicy = \"cache_aware\"\nblock_tokens = 16\n\n[[workers]]\nurl = {:?}\ndp_size = 2\n{events}\nkv_events_replay = [{replay:?}]\n",
        engine.url
    );
    std::fs::write(&config, toml).unwrap();
    Proc::start(&["serve", "--listen", "127.0.0.1:0", "--config", config.to_str().unwrap()])
}

async fn feed_of(gw: &Proc, endpoint: &str) -> Value {
    feeds(gw)
        .await
        .into_iter()
        .find(|f| f["endpoint"] == json!(endpoint))
        .unwrap_or_default()
}

/// The publisher goes away: its feed says so within seconds. It comes back as a new engine (its cache empty) and
/// publishes nothing: the feed notices the restart from the replay alone, and empties the endpoint's index before
/// any request or event, so the prompt it held goes cold. Both shapes: the gateway connecting to a publisher that
/// binds, and binding for one that connects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_that_goes_away_is_seen_gone_and_its_restart_is_noticed_without_a_request() {
    let engine = Proc::engine(&["--dp-size", "2"]);
    for shape in ["connect", "bind"] {
        let (held, port) = common::hold_port(0);
        drop(held);
        let mut python = match shape {
            "connect" => PythonPublisher::start(),
            _ => PythonPublisher::start_with(&["--connect", &format!("tcp://127.0.0.1:{port}")]),
        };
        let events = match shape {
            "connect" => format!("kv_events = [{:?}]", python.publisher),
            _ => format!("kv_events_bind = [\"tcp://127.0.0.1:{port}\"]"),
        };
        let gw = gateway_for_python(&engine, &format!("away-{shape}"), &events, &python.replay).await;
        // Listed at once, with its shape, before anything connected.
        let listed = feed_of(&gw, "w0r0").await;
        assert_eq!(listed["shape"], json!(shape), "{listed}");
        let connected = eventually(Duration::from_secs(10), || async {
            feed_of(&gw, "w0r0").await["connected"] == json!(true)
        });
        assert!(connected.await, "{shape}: {}", feed_of(&gw, "w0r0").await);
        python.run("script");
        let followed = eventually(Duration::from_secs(10), || async {
            feed_of(&gw, "w0r0").await["router_blocks"] == json!(8)
        });
        assert!(followed.await, "{shape}: {}", feed_of(&gw, "w0r0").await);
        python.run("stop");
        let gone = eventually(Duration::from_secs(5), || async {
            feed_of(&gw, "w0r0").await["connected"] == json!(false)
        });
        assert!(gone.await, "{shape}: {}", feed_of(&gw, "w0r0").await);
        python.run("start");
        let noticed = eventually(Duration::from_secs(10), || async {
            let f = feed_of(&gw, "w0r0").await;
            f["connected"] == json!(true) && f["restarts"] == json!(1) && f["router_blocks"] == json!(0)
        });
        assert!(noticed.await, "{shape}: {}", feed_of(&gw, "w0r0").await);
        let before = get(&client(), &format!("{}/workers", gw.url)).await.json["decisions"]["cold"]
            .as_u64()
            .unwrap_or(0);
        let reply = post(
            &client(),
            &format!("{}/generate", gw.url),
            &[],
            &generate(&python_tokens(1, 70), None),
        )
        .await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
        let after = get(&client(), &format!("{}/workers", gw.url)).await.json["decisions"]["cold"]
            .as_u64()
            .unwrap_or(0);
        assert_eq!(after, before + 1, "{shape}: the restarted engine holds nothing");
    }
}

/// Chat requests, with the model's tokenizer on both sides: the engine (the mock, with SmolLM2's tokenizer and chat
/// template) caches the chat's token ids and publishes them; the gateway renders and tokenizes the same chat the
/// same way, so its key is the events' blocks and it finds each conversation where the engine holds it. Keyed on
/// bytes, it would place each of the eight by its cold choice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chats_keyed_on_the_models_tokens_meet_the_engines_events() {
    let model = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/smollm2");
    let engine = publishing_engine(&["--tokenizer", model]);
    let c = client();
    let gw = following_gateway(&engine, "chat", &format!("tokenizer = {model:?}")).await;
    let chat = |i: u32| {
        json!({"model": "m", "max_tokens": 1, "messages": [
            {"role": "system", "content": format!("You are assistant number {i}. ").repeat(20)},
            {"role": "user", "content": "Say something."},
        ]})
    };
    for i in 0..8u32 {
        let mut seeded = chat(i);
        seeded["routed_dp_rank"] = json!(i % 2);
        let reply = post(&c, &format!("{}/v1/chat/completions", engine.url), &[], &seeded).await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    }
    let followed = eventually(Duration::from_secs(10), || async {
        let feeds = feeds(&gw).await;
        feeds.len() == 2 && feeds.iter().all(|f| f["router_blocks"].as_u64().unwrap() > 0)
    });
    assert!(followed.await, "{:?}", feeds(&gw).await);
    for i in 0..8u32 {
        let reply = post(&c, &format!("{}/v1/chat/completions", gw.url), &[], &chat(i)).await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
        assert_eq!(
            reply.rank,
            Some(u64::from(i % 2)),
            "chat {i} went elsewhere: {}",
            reply.text
        );
        let usage = &reply.json["usage"];
        assert_eq!(
            usage["prompt_tokens_details"]["cached_tokens"].as_u64(),
            usage["prompt_tokens"].as_u64().map(|n| n - 1),
            "{usage}"
        );
    }
}

/// A worker added at run time (`POST /workers`) with `kv_events` is followed like a configured one: its feeds are
/// listed and connected within seconds, its engine's cache is known, and removing it stops and unlists them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_added_at_run_time_is_followed_and_unfollowed_when_removed() {
    let first = Proc::engine(&["--dp-size", "1"]);
    let config = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("kv-events-added.toml");
    let toml = format!(
        "[routing]\npolicy = \"cache_aware\"\nblock_tokens = 16\n\n[[workers]]\nurl = {:?}\ndp_size = 1\n",
        first.url
    );
    std::fs::write(&config, toml).unwrap();
    let gw = Proc::start(&["serve", "--listen", "127.0.0.1:0", "--config", config.to_str().unwrap()]);
    assert!(feeds(&gw).await.is_empty());
    let engine = publishing_engine(&[]);
    let info = get(&client(), &format!("{}/get_server_info", engine.url)).await.json;
    let c = client();
    let worker = json!({"url": engine.url, "dp_size": 2, "kv_events": info["kv_events_endpoints"],
        "kv_events_replay": info["kv_events_replay_endpoints"]});
    let added = post(&c, &format!("{}/workers", gw.url), &[], &worker).await;
    assert_eq!(added.status, StatusCode::CREATED, "{}", added.text);
    let id = added.json["id"].as_u64().unwrap();
    wait_for_both_feeds(&gw).await;
    // A prompt cached at the engine directly is found where the engine put it.
    let prompt = ids(77, 200);
    seed_at_engine(&engine, &prompt, 1).await;
    let followed = eventually(Duration::from_secs(10), || async {
        feeds(&gw).await.iter().any(|f| f["router_blocks"].as_u64() == Some(12))
    });
    assert!(followed.await, "{:?}", feeds(&gw).await);
    let reply = post(&c, &format!("{}/generate", gw.url), &[], &generate(&prompt, None)).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    assert_eq!(
        reply.endpoint.as_deref(),
        Some(format!("w{id}r1").as_str()),
        "{}",
        reply.text
    );
    // Removed: its feeds stop and leave the list.
    let removed = common::call(
        &c,
        hyper::Method::DELETE,
        &format!("{}/workers/{id}", gw.url),
        &[],
        None,
    )
    .await;
    assert_eq!(removed.status, StatusCode::OK, "{}", removed.text);
    let gone = eventually(Duration::from_secs(5), || async { feeds(&gw).await.is_empty() });
    assert!(gone.await, "{:?}", feeds(&gw).await);
}
