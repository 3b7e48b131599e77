//! `dprouter bench` as a process: Ctrl-C (SIGINT) stops a run cleanly and still reports what completed; `--quiet`
//! keeps stderr empty.
#![cfg(unix)]
#![allow(clippy::unwrap_used)]

use std::process::{Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use serde_json::Value;

#[test]
fn sigint_stops_the_run_prints_what_completed_and_exits_130() {
    let json = std::env::temp_dir().join(format!("dprouter-bench-sigint-{}.json", std::process::id()));
    // Against the embedded mock engine: each turn takes ~2.3 s of preset time (0.1 s prefill of 2,200 tokens, 150
    // output tokens at 8 ms, 1 s of thinking), 0.46 s of real time at scale 0.2; both agents' 200 turns take ~90 s.
    let mut child = Command::new(env!("CARGO_BIN_EXE_dprouter"))
        .args([
            "bench",
            "--workload",
            "agent:agents=2,turns=200,prefix_len=2000",
            "--preset",
            "h100-8b",
            "--time-scale",
            "0.2",
            "--json",
            json.to_str().unwrap(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    sleep(Duration::from_millis(2500));
    assert!(
        child.try_wait().unwrap().is_none(),
        "bench ended before it was interrupted"
    );
    let kill = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(kill.success());
    let deadline = Instant::now() + Duration::from_secs(20);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            child.kill().unwrap();
            panic!("bench still running 20 s after SIGINT");
        }
        sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(130), "{stdout}\n{stderr}");
    // The first policy's row, with what completed before the interrupt; the second policy never started.
    let row = stdout
        .lines()
        .find(|l| l.starts_with("http:round_robin "))
        .unwrap_or_else(|| panic!("no round_robin row: {stdout}\n{stderr}"));
    let requests: u64 = row.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert!(requests > 0, "{row}");
    assert!(!stdout.contains("http:prefix_match"), "{stdout}");
    assert!(stdout.contains("interrupted by Ctrl-C after"), "{stdout}");
    assert!(stdout.contains("not run: prefix_match"), "{stdout}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    std::fs::remove_file(&json).unwrap();
    let result = &doc["results"][0];
    assert_eq!(result["requests"].as_u64(), Some(requests));
    // Abandoned requests are not errors.
    assert_eq!(result["errors"].as_u64(), Some(0), "{doc}");
    let interrupted = &doc["interrupted"];
    assert!(interrupted["after_s"].as_f64().unwrap() >= 2.0, "{doc}");
    assert!(interrupted["cut_off"].as_u64().unwrap() <= 2, "{doc}");
}

#[test]
fn quiet_prints_only_the_results() {
    let out = Command::new(env!("CARGO_BIN_EXE_dprouter"))
        .args([
            "bench",
            "--workload",
            "agent:agents=1,turns=2,prefix_len=100",
            "--preset",
            "zero",
            "--policy",
            "round_robin",
            "--quiet",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stderr), "");
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(stdout.lines().any(|l| l.starts_with("http:round_robin ")), "{stdout}");
}

/// `--api completions`: the workload as OpenAI completions with token-id prompts (mapped into `--vocab`), TTFT from
/// the first chunk with text, cached tokens from the usage report; a closed-loop agent's later turns hit. `--api
/// chat`: the same as chats, one user message of a word per token id, TTFT from the first chunk with content. `--api
/// messages`: the same message to Anthropic's Messages API, TTFT from the first text delta.
#[test]
fn completions_chats_and_messages_reach_their_server_and_read_its_cache_report() {
    for api in ["completions", "chat", "messages"] {
        openai_api_run(api);
    }
}

fn openai_api_run(api: &str) {
    let out = Command::new(env!("CARGO_BIN_EXE_dprouter"))
        .args([
            "bench",
            "--workload",
            "agent:agents=1,turns=3,prefix_len=200",
            "--preset",
            "zero",
            "--dp-size",
            "1",
            "--policy",
            "round_robin",
            "--api",
            api,
            "--vocab",
            "49152",
            "--quiet",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let row: Vec<&str> = stdout
        .lines()
        .find(|l| l.starts_with("http:round_robin "))
        .unwrap()
        .split_whitespace()
        .collect();
    // requests, ..., hit (the 8th column), ..., errors (last).
    assert_eq!(row[1], "3", "{stdout}");
    assert_eq!(*row.last().unwrap(), "0", "{stdout}");
    let hit: f64 = row[7].parse().unwrap();
    assert!(hit > 0.5, "{api}: the later turns hit: {stdout}");
}

/// `--flow-control`: the workload through embedded gateways three times (the high band alone, everything forwarded,
/// everything through flow control), each request naming its tenant and band. A burst of ten times what the engine
/// serves: every request is answered or refused, the tenants are 10:1 by prefix group, and the high band's requests
/// go ahead of the low band's under flow control, not when forwarded.
#[test]
fn flow_control_puts_the_high_band_first_under_overload() {
    let json = std::env::temp_dir().join(format!("dprouter-bench-flow-{}.json", std::process::id()));
    // 22 groups of 10 prompts (2,048-token prefixes) in 0.55 s; two ranks at 50 ms a prefill serve ~40 a second.
    let out = Command::new(env!("CARGO_BIN_EXE_dprouter"))
        .args([
            "bench",
            "--flow-control",
            "--workload",
            "groups:groups=22,prompts_per_group=10,system_len=2048,question_len=64,output_tokens=4,rate=400",
            "--dp-size",
            "2",
            "--base-ms",
            "50",
            "--time-scale",
            "1",
            "--quiet",
            "--json",
            json.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert_eq!(stderr, "", "--quiet");
    for run in ["high alone ", "forward ", "flow control "] {
        assert!(stdout.lines().any(|l| l.starts_with(run)), "no {run}row: {stdout}");
    }
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    std::fs::remove_file(&json).unwrap();
    let results = doc["results"].as_array().unwrap();
    let field = |run: usize, name: &str| results[run][name].as_f64().unwrap();
    // Groups 0, 5, 10, 15 and 20 are the high band; 10 and 21 the small tenant.
    assert_eq!(field(0, "sent"), 50.0, "{doc}");
    for run in [1, 2] {
        assert_eq!(field(run, "sent"), 220.0, "{doc}");
        let ended = field(run, "completed") + field(run, "refused") + field(run, "failed");
        assert_eq!(ended, 220.0, "{doc}");
        assert!((field(run, "small_sent_share") - 20.0 / 220.0).abs() < 1e-9, "{doc}");
    }
    assert_eq!(
        field(1, "refused") + field(1, "failed"),
        0.0,
        "forwarded, all are served: {doc}"
    );
    let (forwarded, controlled) = (field(1, "high_ttft_p50_ms"), field(2, "high_ttft_p50_ms"));
    assert!(
        controlled < forwarded / 2.0,
        "high band p50 {controlled} ms under flow control, {forwarded} ms forwarded: {doc}"
    );
}
