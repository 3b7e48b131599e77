//! `dprouter route` as a process: the prefix_match reference vectors and the exit-status contract.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::io::Write;
use std::process::{Command, Output, Stdio};

use serde_json::Value;

const VECTORS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/crates/core/testdata/prefix_match.jsonl");

fn route(args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_dprouter"))
        .arg("route")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    child.wait_with_output().unwrap()
}

#[test]
fn every_prefix_match_vector_routes_to_its_expected_rank() {
    let text = std::fs::read_to_string(VECTORS).unwrap();
    // The vector lines are request bodies themselves (extra fields are ignored); group them by dp_size.
    let mut by_dp: BTreeMap<u64, Vec<(&str, u64)>> = BTreeMap::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let v: Value = serde_json::from_str(line).unwrap();
        by_dp
            .entry(v["dp_size"].as_u64().unwrap())
            .or_default()
            .push((line, v["rank"].as_u64().unwrap()));
    }
    let mut checked = 0;
    for (dp, vectors) in &by_dp {
        let input: String = vectors.iter().map(|(line, _)| format!("{line}\n")).collect();
        let out = route(&["--policy", "prefix_match", "--dp-size", &dp.to_string()], &input);
        assert!(
            out.status.success(),
            "dp {dp}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let got: Vec<Value> = String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(got.len(), vectors.len(), "dp {dp}: one output line per input");
        for ((line, rank), reply) in vectors.iter().zip(&got) {
            assert_eq!(reply["rank"].as_u64(), Some(*rank), "dp {dp}: {line:.100}");
            checked += 1;
        }
    }
    assert!(checked >= 50, "only {checked} vectors checked");
}

#[test]
fn input_file_and_override_and_errors_exit_one() {
    let dir = std::env::temp_dir().join(format!("dprouter-route-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("requests.jsonl");
    std::fs::write(
        &file,
        "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n{\"prompt\": \"x\", \"routed_dp_rank\": 3}\n{\"prompt\": \"x\"}\n",
    )
    .unwrap();
    let out = route(
        &[
            "--policy",
            "round_robin",
            "--dp-size",
            "4",
            "--input",
            file.to_str().unwrap(),
        ],
        "",
    );
    assert_eq!(
        String::from_utf8(out.stdout).unwrap(),
        "{\"rank\":0}\n{\"rank\":3}\n{\"rank\":1}\n"
    );
    assert_eq!(out.status.code(), Some(0));

    let out = route(
        &["--policy", "round_robin", "--dp-size", "4"],
        "{\"text\": \"x\", \"routed_dp_rank\": 4}\n{\"text\": \"y\"}\n",
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(stdout.starts_with("{\"error\":\"DP rank 4 is out of range"), "{stdout}");
    assert!(stdout.ends_with("{\"rank\":0}\n"), "{stdout}");
    assert_eq!(out.status.code(), Some(1));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn policies_take_options_and_two_replicas_agree() {
    // Two gateway replicas (two processes) route the same cold prompts to the same ranks; overrides still win.
    let input: String = (0..6)
        .map(|i| format!("{{\"text\": \"{i} {}\"}}\n", "s".repeat(500 * i)))
        .chain(std::iter::once(
            "{\"text\": \"x\", \"routed_dp_rank\": 3}\n".to_string(),
        ))
        .collect();
    for policy in ["cache_aware:block_tokens=32", "prefix_affinity:epsilon=1,load=requests"] {
        let run = || {
            let out = route(&["--policy", policy, "--dp-size", "8"], &input);
            assert_eq!(
                out.status.code(),
                Some(0),
                "{policy}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8(out.stdout).unwrap()
        };
        let (a, b) = (run(), run());
        assert_eq!(a, b, "{policy}");
        let lines: Vec<Value> = a.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len(), 7);
        assert_eq!(lines[6]["rank"].as_u64(), Some(3));
    }
}

#[test]
fn bad_arguments_exit_two() {
    for args in [
        &["--policy", "nope", "--dp-size", "4"][..],
        &["--policy", "round_robin", "--dp-size", "0"],
        &["--policy", "prefix_affinity:eps=2", "--dp-size", "4"],
        &["--policy", "cache_aware:block_tokens", "--dp-size", "4"],
        &["--policy", "round_robin"],
        &[
            "--policy",
            "round_robin",
            "--dp-size",
            "2",
            "--input",
            "/nonexistent/requests.jsonl",
        ],
    ] {
        let out = route(args, "");
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!out.stderr.is_empty());
    }
}
