//! Flow control end to end (`[flow_control]`): `dprouter serve` in front of a mock engine of one rank whose requests
//! take a while, with one request in flight per endpoint (`max_in_flight_per_endpoint = 1`), so that a second request
//! finds the pool saturated and waits in the central queue.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::envoy::Envoy;
use common::picker::Picker;
use common::{eventually, get, in_flight, post, Proc};
use serde_json::{json, Value};

/// An engine whose every answer takes `delay_ms` to its first byte, and the path of a config with flow control and
/// `extra` settings in `[flow_control]` for it (one request in flight per endpoint unless they say).
fn engine_and_config(name: &str, delay_ms: u64, extra: &str) -> (Proc, String) {
    let engine = Proc::engine(&["--dp-size", "1", "--first-byte-delay-ms", &delay_ms.to_string()]);
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("flow_control");
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join(format!("{name}.toml"));
    // One request in flight per endpoint, unless `extra` says otherwise.
    let slots = if extra.contains("max_in_flight_per_endpoint") {
        ""
    } else {
        "max_in_flight_per_endpoint = 1\n"
    };
    let text = format!(
        "[flow_control]\nenabled = true\n{slots}{extra}\n[flow_control.objectives]\ncritical = 10\nbatch = -1\n\n[[workers]]\nurl = {:?}\ndp_size = 1\n",
        engine.url
    );
    std::fs::write(&config, text).unwrap();
    (engine, config.to_str().unwrap().to_string())
}

/// The engine of [`engine_and_config`] behind `dprouter serve`.
fn fleet(name: &str, delay_ms: u64, extra: &str) -> (Proc, Proc) {
    let (engine, config) = engine_and_config(name, delay_ms, extra);
    let gw = Proc::start(&["serve", "--listen", "127.0.0.1:0", "--config", &config]);
    (engine, gw)
}

fn chat(n: usize) -> Value {
    json!({"model": "dprouter/mock", "max_tokens": 2, "messages": [{"role": "user", "content": format!("question {n}")}]})
}

/// Sends a chat in the background with `headers`; its status, body and when it ended.
fn send_later(
    c: &common::HttpClient,
    url: &str,
    n: usize,
    headers: &[(&str, &str)],
) -> tokio::task::JoinHandle<(u16, String, Instant)> {
    let (c, url) = (c.clone(), url.to_string());
    let headers: Vec<(String, String)> = headers.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    tokio::spawn(async move {
        let h: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let reply = post(&c, &url, &h, &chat(n)).await;
        (reply.status.as_u16(), reply.text, Instant::now())
    })
}

/// Whether the gateway's one endpoint says it is saturated.
async fn saturated(c: &common::HttpClient, gw: &Proc) -> bool {
    let workers = get(c, &format!("{}/workers", gw.url)).await.json;
    workers["workers"][0]["endpoints"][0]["saturated"] == true
}

/// The queue's refusals by reason, from the gateway's metrics.
async fn refusals(c: &common::HttpClient, gw: &Proc, reason: &str) -> u64 {
    let text = get(c, &format!("{}/metrics", gw.url)).await.text;
    let prefix = format!("dprouter_queue_refusals_total{{reason=\"{reason}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map_or(0, |v| v.trim().parse().unwrap())
}

async fn waiting(c: &common::HttpClient, gw: &Proc) -> u64 {
    let text = get(c, &format!("{}/metrics", gw.url)).await.text;
    text.lines()
        .filter(|l| l.starts_with("dprouter_queue_requests{"))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap() as u64)
        .sum()
}

async fn completed(c: &common::HttpClient, engine: &Proc) -> u64 {
    get(c, &format!("{}/get_server_info", engine.url)).await.json["completed_requests"]
        .as_u64()
        .unwrap()
}

/// A request that finds its pool saturated waits and is then served; what does not fit is refused at once with
/// `Retry-After` (a full queue, a sheddable objective), and a higher band goes before a lower one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saturated_pool_queues_by_priority_and_refuses_what_does_not_fit() {
    let c = common::client();
    let (engine, gw) = fleet("queue", 1500, "max_queued_requests = 2");
    let url = format!("{}/v1/chat/completions", gw.url);
    assert!(!saturated(&c, &gw).await);
    let first = send_later(&c, &url, 0, &[]);
    assert!(eventually(Duration::from_secs(5), || saturated(&c, &gw)).await);
    let low = send_later(&c, &url, 1, &[]);
    assert!(eventually(Duration::from_secs(5), || async { waiting(&c, &gw).await == 1 }).await);
    let high = send_later(&c, &url, 2, &[("x-gateway-inference-objective", "critical")]);
    assert!(eventually(Duration::from_secs(5), || async { waiting(&c, &gw).await == 2 }).await);
    // Two wait: a third is refused at once, as is a sheddable one.
    for (headers, reason, says) in [
        (vec![], "queue_full", "requests wait already"),
        (vec![("x-gateway-inference-objective", "batch")], "shed", "sheddable"),
    ] {
        let refused = post(&c, &url, &headers, &chat(3)).await;
        assert_eq!(refused.status, 503, "{}", refused.text);
        assert_eq!(refused.headers["retry-after"], "1");
        assert!(refused.text.contains(says), "{}", refused.text);
        assert_eq!(refusals(&c, &gw, reason).await, 1);
    }
    let (first, low, high) = (first.await.unwrap(), low.await.unwrap(), high.await.unwrap());
    for (status, text, _) in [&first, &low, &high] {
        assert_eq!(*status, 200, "{text}");
    }
    assert!(high.2 < low.2, "the higher band went first");
    assert_eq!(completed(&c, &engine).await, 3);
    assert_eq!(waiting(&c, &gw).await, 0);
    assert_eq!(in_flight(&c, &gw.url).await, 0);
    let metrics = get(&c, &format!("{}/metrics", gw.url)).await.text;
    assert!(
        metrics.contains("dprouter_queue_wait_seconds_count{band=\"0\"} 1"),
        "{metrics}"
    );
}

/// A chat sent in the background whose outcome may be a closed connection: its status and body, or the error.
fn send_or_cut(c: &common::HttpClient, url: &str, n: usize) -> tokio::task::JoinHandle<Result<(u16, String), String>> {
    let (c, url) = (c.clone(), url.to_string());
    tokio::spawn(async move {
        let req = hyper::Request::post(url)
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(bytes::Bytes::from(chat(n).to_string())))
            .unwrap();
        let response = c.request(req).await.map_err(|e| e.to_string())?;
        let status = response.status().as_u16();
        let body = http_body_util::BodyExt::collect(response.into_body())
            .await
            .map_err(|e| e.to_string())?;
        Ok((status, String::from_utf8_lossy(&body.to_bytes()).into_owned()))
    })
}

/// At shutdown the queue goes on releasing requests as the endpoint frees up, until `drain_timeout_ms`: new work is
/// refused (the listener is closed), the requests that reach the engine in time are answered, those still waiting
/// at the deadline are cut with the rest, and the process exits then.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_drain_lets_the_queue_go_on_until_its_deadline() {
    let c = common::client();
    let (engine, mut gw) = fleet("drain", 1000, "[server]\ndrain_timeout_ms = 2500");
    let url = format!("{}/v1/chat/completions", gw.url);
    let first = send_or_cut(&c, &url, 0);
    assert!(eventually(Duration::from_secs(5), || saturated(&c, &gw)).await);
    // Queued one after another, so that they wait in this order.
    let mut queued = Vec::new();
    for n in 1..=4 {
        queued.push(send_or_cut(&c, &url, n));
        assert!(eventually(Duration::from_secs(5), || async { waiting(&c, &gw).await == n as u64 }).await);
    }
    let addr = gw.url.trim_start_matches("http://").to_string();
    let exited = tokio::task::spawn_blocking(move || {
        let took = gw.terminate(Duration::from_secs(6));
        (took, gw)
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        std::net::TcpStream::connect(&addr).is_err(),
        "a new connection was accepted while draining"
    );
    let first = first.await.unwrap();
    assert_eq!(first.as_ref().map(|(s, _)| *s), Ok(200), "{first:?}");
    let mut outcomes = Vec::new();
    for q in queued {
        outcomes.push(q.await.unwrap());
    }
    // The first one waiting leaves the queue when the first answer frees the endpoint, well within the drain.
    assert_eq!(outcomes[0].as_ref().map(|(s, _)| *s), Ok(200), "{outcomes:?}");
    // A second each, one at a time: the last cannot be answered before the deadline (it would be at the fifth
    // second of the first), and is cut then.
    assert!(outcomes[3].is_err(), "{outcomes:?}");
    let (took, _gw) = exited.await.unwrap();
    assert!(
        took >= Duration::from_millis(2400) && took < Duration::from_millis(3500),
        "exited {took:?} after SIGTERM (the drain deadline is 2,500 ms)"
    );
    // What the engine answered: the first, the first waiting, and at most the next two.
    let served = completed(&c, &engine).await;
    assert!((2..=4).contains(&served), "{served}");
}

/// Flows of one band take turns: a small flow's one request goes after the first of a big flow's, not after all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flows_of_a_band_take_turns() {
    let c = common::client();
    let (_engine, gw) = fleet("turns", 800, "");
    let url = format!("{}/v1/chat/completions", gw.url);
    let first = send_later(&c, &url, 0, &[]);
    assert!(eventually(Duration::from_secs(5), || saturated(&c, &gw)).await);
    let mut big = Vec::new();
    for n in 1..4 {
        big.push(send_later(&c, &url, n, &[("x-gateway-inference-fairness-id", "big")]));
        assert!(eventually(Duration::from_secs(5), || async { waiting(&c, &gw).await == n as u64 }).await);
    }
    let small = send_later(&c, &url, 9, &[("x-gateway-inference-fairness-id", "small")]);
    first.await.unwrap();
    let small = small.await.unwrap();
    let mut ends = Vec::new();
    for b in big {
        let (status, text, end) = b.await.unwrap();
        assert_eq!(status, 200, "{text}");
        ends.push(end);
    }
    assert_eq!(small.0, 200, "{}", small.1);
    // big1, small, big2, big3.
    assert!(
        ends[0] < small.2 && small.2 < ends[1],
        "the small flow waited behind the big one"
    );
}

/// An agent program is one flow however many subagents it runs: fifty subagents of one Claude Code session wait in
/// one flow, and a second program's one request goes after the first of them, not after all fifty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_subagents_of_one_program_take_one_share() {
    let c = common::client();
    // Answers take 10 ms a token: the first, of 300 tokens, holds the one slot for 3 s while the others queue.
    let engine = Proc::engine(&["--dp-size", "1", "--tpot-ms", "10"]);
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("flow_control");
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("programs.toml");
    let text = format!(
        "[flow_control]\nenabled = true\nmax_in_flight_per_endpoint = 1\n\n[[workers]]\nurl = {:?}\ndp_size = 1\n",
        engine.url
    );
    std::fs::write(&config, text).unwrap();
    let gw = Proc::start(&["serve", "--listen", "127.0.0.1:0", "--config", config.to_str().unwrap()]);
    let url = format!("{}/v1/chat/completions", gw.url);
    let long = json!({"model": "dprouter/mock", "max_tokens": 300, "messages": [{"role": "user", "content": "a long answer"}]});
    let first = {
        let (c, url) = (c.clone(), url.clone());
        tokio::spawn(async move { post(&c, &url, &[], &long).await.status })
    };
    assert!(eventually(Duration::from_secs(5), || saturated(&c, &gw)).await);
    let mut subagents = Vec::new();
    for n in 1..=50 {
        let agent = format!("subagent-{n}");
        let headers = [
            ("x-claude-code-session-id", "program-a"),
            ("x-claude-code-agent-id", agent.as_str()),
        ];
        subagents.push(send_later(&c, &url, n, &headers));
    }
    assert!(eventually(Duration::from_secs(5), || async { waiting(&c, &gw).await == 50 }).await);
    let other = send_later(&c, &url, 99, &[("x-claude-code-session-id", "program-b")]);
    assert!(eventually(Duration::from_secs(5), || async { waiting(&c, &gw).await == 51 }).await);
    assert_eq!(first.await.unwrap(), 200);
    let other = other.await.unwrap();
    assert_eq!(other.0, 200, "{}", other.1);
    let mut before = 0;
    for subagent in subagents {
        let (status, text, end) = subagent.await.unwrap();
        assert_eq!(status, 200, "{text}");
        before += usize::from(end < other.2);
    }
    assert!(before <= 1, "program b waited behind {before} of program a's subagents");
}

/// A queued request's deadline passes into a clear 503, and one whose client goes away leaves the queue at once and
/// never reaches the engine; nothing is left in flight or queued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadlines_and_clients_that_leave_free_the_queue() {
    let c = common::client();
    let (engine, gw) = fleet("deadline", 1500, "queue_timeout_ms = 300");
    let url = format!("{}/v1/chat/completions", gw.url);
    let first = send_later(&c, &url, 0, &[]);
    assert!(eventually(Duration::from_secs(5), || saturated(&c, &gw)).await);
    let late = post(&c, &url, &[], &chat(1)).await;
    assert_eq!(late.status, 503, "{}", late.text);
    assert!(late.text.contains("waited 300 ms"), "{}", late.text);
    assert_eq!(refusals(&c, &gw, "timeout").await, 1);
    // A client that sends its request and hangs up while it waits.
    let gone = send_later(&c, &url, 2, &[]);
    assert!(eventually(Duration::from_secs(5), || async { waiting(&c, &gw).await == 1 }).await);
    gone.abort();
    assert!(
        eventually(Duration::from_secs(5), || async { waiting(&c, &gw).await == 0 }).await,
        "the request of a client that left still waits"
    );
    assert_eq!(refusals(&c, &gw, "client_gone").await, 1);
    assert_eq!(first.await.unwrap().0, 200);
    // Only the first request reached the engine.
    assert!(
        eventually(Duration::from_secs(5), || async { in_flight(&c, &gw.url).await == 0 }).await,
        "something was left in flight"
    );
    assert_eq!(completed(&c, &engine).await, 1);
}

/// The same queue in `dprouter epp` behind a real Envoy: a request that finds the pool saturated waits and is served,
/// with its fairness id and objective read from Envoy's request headers; a sheddable one is answered by the picker
/// (an immediate response with `Retry-After`) and Envoy returns that to the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pickers_queue_behind_envoy() {
    let c = common::client();
    let (engine, config) = engine_and_config("epp", 1500, "");
    let picker = Picker::start(&[], &["--config", &config]);
    let envoy = Envoy::start("flow", &[&picker.grpc]).await;
    envoy.wait_for_healthy_pickers(1).await;
    let url = format!("{}/v1/chat/completions", envoy.url);
    let first = send_later(&c, &url, 0, &[]);
    assert!(eventually(Duration::from_secs(5), || saturated(&c, &picker.proc)).await);
    let queued = send_later(
        &c,
        &url,
        1,
        &[
            ("x-gateway-inference-fairness-id", "tenant-a"),
            ("x-gateway-inference-objective", "critical"),
        ],
    );
    assert!(
        eventually(Duration::from_secs(5), || async {
            waiting(&c, &picker.proc).await == 1
        })
        .await
    );
    let shed = post(&c, &url, &[("x-gateway-inference-objective", "batch")], &chat(2)).await;
    assert_eq!(shed.status, 503, "{}", shed.text);
    assert_eq!(shed.headers["retry-after"], "1");
    assert!(shed.text.contains("sheddable"), "{}", shed.text);
    assert_eq!(first.await.unwrap().0, 200);
    let (status, text, _) = queued.await.unwrap();
    assert_eq!(status, 200, "{text}");
    let metrics = get(&c, &format!("{}/metrics", picker.proc.url)).await.text;
    assert!(
        metrics.contains("dprouter_queue_wait_seconds_count{band=\"10\"} 1"),
        "{metrics}"
    );
    assert_eq!(completed(&c, &engine).await, 2);
}

/// A burst of 2,000 clients at once against one slow engine (4 requests in flight, 1,000 may wait): every client
/// gets its answer or a clear 503 with `Retry-After`, and the gateway's memory grows by a bounded amount (the
/// bodies waiting plus tens of KiB per connection; `DPROUTER_FLOW_MEMORY=print` prints the figure).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_two_thousand_clients_gets_answers_or_clear_errors_in_bounded_memory() {
    let c = common::client();
    let (_engine, config) = engine_and_config(
        "burst",
        20,
        "max_in_flight_per_endpoint = 4\nmax_queued_requests = 1000\nqueue_timeout_ms = 60000",
    );
    let gw = Proc::start(&["serve", "--listen", "127.0.0.1:0", "--config", &config]);
    let pid = gw.child.id();
    // Warm: the first requests' allocations are not the burst's.
    for n in 0..20 {
        assert_eq!(
            post(&c, &format!("{}/v1/chat/completions", gw.url), &[], &chat(n))
                .await
                .status,
            200
        );
    }
    let idle = common::memory::rss(pid);
    common::memory::reset_peak_rss(pid);
    let url = format!("{}/v1/chat/completions", gw.url);
    let body = json!({"model": "dprouter/mock", "max_tokens": 2,
                      "messages": [{"role": "user", "content": "x".repeat(1000)}]});
    let clients: Vec<_> = (0..2000)
        .map(|_| {
            let (c, url, body) = (c.clone(), url.clone(), body.clone());
            tokio::spawn(async move {
                let reply = post(&c, &url, &[], &body).await;
                (
                    reply.status.as_u16(),
                    reply.headers.get("retry-after").is_some(),
                    reply.text,
                )
            })
        })
        .collect();
    let (mut served, mut refused) = (0, 0);
    for client in clients {
        let (status, retry_after, text) = client.await.unwrap();
        match status {
            200 => served += 1,
            503 => {
                assert!(retry_after, "a 503 without Retry-After: {text}");
                assert!(text.contains("overloaded"), "{text}");
                refused += 1;
            }
            other => panic!("{other}: {text}"),
        }
    }
    let grown = common::memory::peak_rss(pid).saturating_sub(idle);
    if std::env::var("DPROUTER_FLOW_MEMORY").is_ok() {
        println!("2,000 clients at once: {served} served, {refused} refused; peak RSS {idle} + {grown} bytes");
    }
    assert_eq!(served + refused, 2000);
    assert!(served >= 1000, "{served} served");
    // 2,000 connections (each with its buffers and its request's task) and 1,000 bodies of 1 KB waiting: within
    // 64 KiB a client (about 40 KiB measured).
    assert!(grown < 2000 * (64 << 10), "the burst grew the gateway by {grown} bytes");
    assert!(
        eventually(Duration::from_secs(10), || async { in_flight(&c, &gw.url).await == 0 }).await,
        "something was left in flight"
    );
    assert_eq!(waiting(&c, &gw).await, 0);
}
