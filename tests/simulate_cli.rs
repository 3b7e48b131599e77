//! `dprouter simulate` as a process: the table, the JSON file and argument errors.
#![allow(clippy::unwrap_used)]

use std::process::Command;

use serde_json::Value;

fn simulate(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_dprouter"))
        .arg("simulate")
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn prints_a_row_per_policy_and_writes_json() {
    let json = std::env::temp_dir().join(format!("dprouter-sim-{}.json", std::process::id()));
    let out = simulate(&[
        "--workload",
        "agent:agents=2,prefix_len=2000,turns=6",
        "--dp-size",
        "16",
        "--policy",
        "round_robin,prefix_match",
        "--preset",
        "seed-moe",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(stdout.lines().any(|l| l.starts_with("round_robin ")), "{stdout}");
    assert!(stdout.lines().any(|l| l.starts_with("prefix_match ")), "{stdout}");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    std::fs::remove_file(&json).unwrap();
    assert_eq!(
        (doc["dp_size"].as_u64(), doc["preset"].as_str()),
        (Some(16), Some("seed-moe"))
    );
    let results = doc["results"].as_array().unwrap();
    assert_eq!(results.len(), 2);
    for key in [
        "policy",
        "requests",
        "ttft_mean_ms",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "floor_mean_ms",
        "floor_p99_ms",
        "pooled_wait_mean_ms",
        "pooled_shortest_wait_mean_ms",
        "steady_ttft_p50_ms",
        "steady_ttft_p99_ms",
        "hit_rate",
        "throughput_rps",
        "max_mean_load",
        "errors",
    ] {
        assert!(results.iter().all(|r| r.get(key).is_some()), "missing {key}");
    }
    assert_eq!(results[0]["requests"].as_u64(), Some(12));
    // With no queue a request's TTFT is its floor; with one it is above.
    for r in results {
        let (floor, mean) = (
            r["floor_mean_ms"].as_f64().unwrap(),
            r["ttft_mean_ms"].as_f64().unwrap(),
        );
        assert!(floor > 0.0 && floor <= mean + 1e-9, "floor {floor} vs mean {mean}");
        let pooled = r["pooled_wait_mean_ms"].as_f64().unwrap();
        assert!(pooled >= 0.0 && r["pooled_shortest_wait_mean_ms"].as_f64().unwrap() >= 0.0);
    }
    // Two agents on one prefix, 12 requests over 16 ranks: round_robin never meets a warm rank, prefix_match does.
    assert!(results[1]["hit_rate"].as_f64().unwrap() > results[0]["hit_rate"].as_f64().unwrap());
}

#[test]
fn policy_options_oracle_and_rank_removal_reach_the_json() {
    let json = std::env::temp_dir().join(format!("dprouter-sim-removal-{}.json", std::process::id()));
    let out = simulate(&[
        "--workload",
        "groups:groups=40,prompts_per_group=6,system_len=640,rate=20",
        "--dp-size",
        "4",
        "--policy",
        "prefix_match;prefix_affinity:load=requests,epsilon=0.5;cache_aware:block_tokens=32",
        "--remove-rank",
        "2@6",
        "--remove-mode",
        "drop",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(stdout.contains("rank 2 dropped at 6 s"), "{stdout}");
    assert!(
        stdout.contains("hit-rate ladder: oracle (one infinite cache) "),
        "{stdout}"
    );
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    std::fs::remove_file(&json).unwrap();
    assert_eq!(doc["removal"]["mode"].as_str(), Some("drop"));
    let results = doc["results"].as_array().unwrap();
    let names: Vec<&str> = results.iter().map(|r| r["policy"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "prefix_match",
            "prefix_affinity:load=requests,epsilon=0.5",
            "cache_aware:block_tokens=32"
        ]
    );
    for r in results {
        let (hit, oracle) = (r["hit_rate"].as_f64().unwrap(), r["oracle_hit_rate"].as_f64().unwrap());
        assert!(hit > 0.0 && hit <= oracle, "{r}");
        // The pooled LRU cache of every rank's capacity: within the oracle (up to its 16-token blocks).
        let pooled = r["pooled_lru_hit_rate"].as_f64().unwrap();
        assert!(pooled > 0.0 && pooled <= oracle + 0.02, "{r}");
        assert!(r["moved_groups"].as_f64().is_some(), "{r}");
    }
    // Dropping a rank renumbers the rest: `% 3` instead of `% 4` moves most of prefix_match's groups.
    assert!(results[0]["moved_groups"].as_f64().unwrap() > 0.5);

    let out = simulate(&["--workload", "agent", "--dp-size", "4", "--remove-rank", "4@1"]);
    assert_eq!(out.status.code(), Some(1));
    let out = simulate(&[
        "--workload",
        "agent",
        "--dp-size",
        "4",
        "--policy",
        "cache_aware:blocks=3",
    ]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn bad_arguments_exit_two_and_bad_traces_fail() {
    for args in [
        &["--workload", "agent", "--dp-size", "4", "--preset", "a100"][..],
        &["--workload", "agent:agentz=3", "--dp-size", "4"],
        &["--workload", "agent", "--dp-size", "4", "--policy", "fastest"],
        &["--workload", "agent", "--dp-size", "0"],
        &["--workload", "agent", "--dp-size", "4", "--prefill-contention", "1.5"],
        &["--workload", "agentic:rate=0", "--dp-size", "4"],
        &[
            "--workload",
            "agentic:tool_under_1s=0.99,tool_under_10s=0.9",
            "--dp-size",
            "4",
        ],
    ] {
        let out = simulate(args);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let out = simulate(&["--workload", "trace:/nonexistent/trace.jsonl", "--dp-size", "2"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read trace"));
    // Prefill contention is the simulator's alone: the mock engine says so rather than ignore it.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_dprouter"))
        .args(["mock-engine", "--listen", "127.0.0.1:0", "--prefill-contention", "0.5"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--prefill-contention is modelled by `simulate` alone"));
}

#[test]
fn plot_writes_an_svg_figure_and_quiet_keeps_stderr_empty() {
    let svg = std::env::temp_dir().join(format!("dprouter-sim-plot-{}.svg", std::process::id()));
    let out = simulate(&[
        "--workload",
        "agent:agents=2,prefix_len=2000,turns=6",
        "--dp-size",
        "4",
        "--policy",
        "round_robin,prefix_match,cache_aware",
        "--plot",
        svg.to_str().unwrap(),
        "--quiet",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stderr), "", "--quiet");
    let text = std::fs::read_to_string(&svg).unwrap();
    std::fs::remove_file(&svg).unwrap();
    assert!(
        text.starts_with("<svg") && text.trim_end().ends_with("</svg>"),
        "{text}"
    );
    assert!(text.contains("xmlns=\"http://www.w3.org/2000/svg\""));
    assert_eq!(text.matches("<text").count(), text.matches("</text>").count());
    for (i, name) in ["round_robin", "prefix_match", "cache_aware"].iter().enumerate() {
        assert!(
            text.contains(&format!("\n{}. {name}\n</text>", i + 1)),
            "no legend entry for {name}"
        );
    }
    // Three CDF lines (12 steps of 2 points each) and three load-share lines (4 ranks), at least.
    let polylines = text.matches("<polyline").count();
    assert!(polylines >= 6, "{polylines} polylines");

    // Without --quiet, each policy reports its run on stderr.
    let out = simulate(&[
        "--workload",
        "agent:turns=2",
        "--dp-size",
        "2",
        "--policy",
        "round_robin",
    ]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("round_robin: 2 requests simulated"));
}

#[test]
fn a_missing_plot_folder_is_made() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("plots-made-here");
    let _ = std::fs::remove_dir_all(&dir);
    let path = dir.join("figure.svg");
    let out = simulate(&[
        "--workload",
        "agent:turns=2",
        "--dp-size",
        "2",
        "--plot",
        path.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(std::fs::read_to_string(&path).unwrap().contains("<svg"));
}

#[test]
fn an_unwritable_plot_path_fails_with_a_message() {
    let out = simulate(&[
        "--workload",
        "agent:turns=2",
        "--dp-size",
        "2",
        "--plot",
        // A folder that cannot be made (its parent is a file), even by root.
        concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml/figure.svg"),
    ]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("cannot make the folder") && stderr.contains("Cargo.toml"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    // Checked before the run: no table.
    assert!(out.stdout.is_empty(), "{}", String::from_utf8_lossy(&out.stdout));
}

#[test]
fn agentic_rows_replay_closed_loop_and_a_cycle_names_its_row() {
    let dir = std::env::temp_dir().join(format!("dprouter-agentic-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("agentic.jsonl");
    // A main turn, two subagents forked from it, and the turn that joins them 500 ms after the later one.
    std::fs::write(
        &trace,
        r#"{"request_id": "m1", "session_id": "main", "timestamp": 0, "hash_ids": [1, 2, 3], "output_length": 20}
{"request_id": "s1", "session_id": "sub1", "wait_for": ["m1"], "hash_ids": [9, 10], "output_length": 20}
{"request_id": "s2", "session_id": "sub2", "wait_for": ["m1"], "hash_ids": [9, 11], "output_length": 20}
{"request_id": "m2", "session_id": "main", "wait_for": ["s1", "s2"], "tool_wait_ms": 500, "hash_ids": [1, 2, 3, 4], "output_length": 20}
"#,
    )
    .unwrap();
    let json = dir.join("out.json");
    let spec = format!("trace:{}", trace.display());
    let out = simulate(&[
        "--workload",
        &spec,
        "--dp-size",
        "2",
        "--policy",
        "round_robin",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(doc["results"][0]["requests"].as_u64(), Some(4));
    std::fs::write(
        &trace,
        "{\"request_id\": \"a\", \"hash_ids\": [1], \"output_length\": 1, \"wait_for\": [\"b\"]}\n\
         {\"request_id\": \"b\", \"hash_ids\": [1], \"output_length\": 1, \"wait_for\": [\"a\"]}\n",
    )
    .unwrap();
    let out = simulate(&["--workload", &spec, "--dp-size", "2"]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("cycle") && stderr.contains("request `"), "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}
