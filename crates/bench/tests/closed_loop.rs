//! A closed-loop workload over HTTP: each follow-up is sent after its parents' answers and its own wait, on a paused
//! clock (tokio's test clock: the waits pass at once, and the times the driver records are the workload's own).
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use dprouter_bench::{run, Api, BenchConfig, Routing};
use dprouter_sim::tokens::Namespace;
use dprouter_sim::workload::agentic::{Part, Plan, PlanWorkload, Step};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// An SGLang-like engine: every `/generate` gets one event with an output id and the usage, then `[DONE]`.
async fn engine() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                // The head, then the body its content-length announces.
                let mut request = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    let n = socket.read(&mut buf).await.unwrap();
                    if n == 0 {
                        return;
                    }
                    request.extend_from_slice(&buf[..n]);
                    let text = String::from_utf8_lossy(&request).to_string();
                    if let Some(head_end) = text.find("\r\n\r\n") {
                        let length: usize = text[..head_end]
                            .lines()
                            .find_map(|l| {
                                l.to_ascii_lowercase()
                                    .strip_prefix("content-length:")
                                    .map(|v| v.trim().parse().unwrap())
                            })
                            .unwrap_or(0);
                        if request.len() >= head_end + 4 + length {
                            break;
                        }
                    }
                }
                let body = "data: {\"text\":\"x\",\"output_ids\":[7],\"meta_info\":{\"prompt_tokens\":10,\"cached_tokens\":0,\"completion_tokens\":1}}\n\ndata: [DONE]\n\n";
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                socket.write_all(answer.as_bytes()).await.unwrap();
            });
        }
    });
    url
}

fn step(name: &str, after: Vec<usize>, wait_ms: u64) -> Step {
    Step {
        name: name.into(),
        session: 0,
        group: 0,
        named_session: true,
        after,
        wait: wait_ms * 1000,
        continues: None,
        parts: vec![Part {
            ns: Namespace::UserTurn,
            id: 1,
            len: 8,
        }],
        output_tokens: 1,
    }
}

#[tokio::test(start_paused = true)]
async fn a_follow_up_waits_for_all_its_parents_and_its_tool_wait() {
    let url = engine().await;
    // A root at 0; two subagents after it; a join 750 ms after the later of them; a turn 4 s after the join.
    let plan = Plan {
        steps: vec![
            step("root", vec![], 0),
            step("sub-a", vec![0], 0),
            step("sub-b", vec![0], 300),
            step("join", vec![1, 2], 750),
            step("next", vec![3], 4_000),
        ],
    };
    let mut workload = PlanWorkload::new(plan, 1, "test").unwrap();
    let config = BenchConfig {
        target: url,
        api: Api::Generate,
        seed: 1,
        time_scale: 1.0,
        routing: Routing::Server,
        headers: None,
    };
    let (_stop, stop) = tokio::sync::watch::channel(false);
    let started = tokio::time::Instant::now();
    let out = run(&mut workload, &config, stop, &mut |_| {}).await.unwrap();
    let records = &out.outcome.records;
    assert_eq!(records.len(), 5, "{records:?}");
    let by_id = |id: u64| records.iter().find(|r| r.id == id).unwrap();
    for (child, parents, wait) in [
        (1, vec![0], 0),
        (2, vec![0], 300_000),
        (3, vec![1, 2], 750_000),
        (4, vec![3], 4_000_000),
    ] {
        let ready = parents.iter().map(|&p| by_id(p).finish).max().unwrap();
        assert!(
            by_id(child).arrival >= ready + wait,
            "{child}: sent at {} before its parents' last answer at {ready} plus {wait}",
            by_id(child).arrival
        );
    }
    // The waits passed on the paused clock, in order: at least 300 + 750 + 4,000 ms of it.
    assert!(started.elapsed() >= Duration::from_millis(5_050));
    assert_eq!(out.outcome.errors, 0);
}
