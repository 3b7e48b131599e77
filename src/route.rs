//! `dprouter route`: offline routing decisions for JSON Lines requests.
//!
//! Each input line is one request body (`input_ids`, `text`, `prompt` or `messages`, optionally `routed_dp_rank`,
//! `data_parallel_rank`, `bootstrap_room`). Requests are routed in order by one policy instance over `dp_size`
//! healthy ranks, as if none completes. Each line prints `{"rank": R}` or `{"error": "…"}`; blank lines are
//! skipped. Exit status: 0, or 1 if any line was an error; bad arguments exit 2 (clap's usage status).

use std::fs::File;
use std::io::{self, BufRead, BufReader, BufWriter, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use dprouter_core::prompt::parse_request;
use dprouter_core::{dispatch, Policy, PolicyConfig, Snapshot};
use serde_json::{json, Value};

#[derive(Debug, Args)]
pub struct RouteArgs {
    /// Load-balancing method: round_robin, follow_bootstrap_room, total_requests, total_tokens, prefix_match,
    /// prefix_affinity, cache_aware; options as NAME:key=value,...
    #[arg(long, value_parser = parse_policy)]
    policy: PolicyConfig,
    /// Number of data-parallel ranks (all healthy).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    dp_size: u32,
    /// JSON Lines file of requests; standard input when absent.
    #[arg(long, value_parser = readable_file)]
    input: Option<PathBuf>,
}

/// A policy spec: `name` or `name:key=value,...` (the policy's typed options).
pub fn parse_policy(spec: &str) -> Result<PolicyConfig, String> {
    let name = spec.split_once(':').map_or(spec, |(name, _)| name);
    if !PolicyConfig::NAMES.contains(&name) {
        return Err(format!(
            "unknown policy `{name}`; expected one of: {}",
            PolicyConfig::NAMES.join(", ")
        ));
    }
    PolicyConfig::from_spec(spec).map_err(|e| e.to_string())
}

fn readable_file(path: &str) -> Result<PathBuf, String> {
    File::open(path).map_err(|e| format!("cannot open {path}: {e}"))?;
    Ok(PathBuf::from(path))
}

pub fn run(args: RouteArgs) -> anyhow::Result<ExitCode> {
    let input: Box<dyn BufRead> = match &args.input {
        Some(path) => Box::new(BufReader::new(
            File::open(path).with_context(|| format!("cannot open {}", path.display()))?,
        )),
        None => Box::new(io::stdin().lock()),
    };
    let mut out = BufWriter::new(io::stdout().lock());
    let failed = route_lines(args.policy.build().as_ref(), args.dp_size, input, &mut out)?;
    out.flush().context("writing to standard output")?;
    Ok(if failed { ExitCode::FAILURE } else { ExitCode::SUCCESS })
}

/// Routes every non-blank line and writes one result line each. Returns whether any line was an error.
fn route_lines(policy: &dyn Policy, dp_size: u32, input: impl BufRead, out: &mut impl Write) -> anyhow::Result<bool> {
    let snap = Snapshot::single_worker(dp_size);
    // Every request stays in flight until the end, as if none completes.
    let mut in_flight = Vec::new();
    let mut failed = false;
    for (number, line) in input.lines().enumerate() {
        let line = line.with_context(|| format!("reading input line {}", number + 1))?;
        if line.trim().is_empty() {
            continue;
        }
        let result = serde_json::from_str::<Value>(&line)
            .map_err(|e| format!("invalid JSON: {e}"))
            .and_then(|body| parse_request(&body).map_err(|e| e.to_string()))
            .and_then(|req| dispatch(policy, &snap, req).map_err(|e| e.to_string()));
        let reply = match result {
            Ok(routed) => {
                let reply = json!({ "rank": routed.pick.rank });
                in_flight.push(routed);
                reply
            }
            Err(message) => {
                failed = true;
                json!({ "error": message })
            }
        };
        writeln!(out, "{reply}").context("writing to standard output")?;
    }
    Ok(failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_lines(policy: &str, dp: u32, input: &str) -> (String, bool) {
        let policy = PolicyConfig::from_name(policy).unwrap().build();
        let mut out = Vec::new();
        let failed = route_lines(policy.as_ref(), dp, input.as_bytes(), &mut out).unwrap();
        (String::from_utf8(out).unwrap(), failed)
    }

    #[test]
    fn routes_in_order_as_if_nothing_completes() {
        let input = "{\"text\": \"a\"}\n\n{\"text\": \"b\"}\n{\"text\": \"c\"}\n";
        let (out, failed) = run_lines("total_requests", 2, input);
        assert_eq!(out, "{\"rank\":0}\n{\"rank\":1}\n{\"rank\":0}\n");
        assert!(!failed);
    }

    #[test]
    fn bad_lines_are_reported_and_the_rest_still_routed() {
        let input = "not json\n{\"text\": \"x\", \"routed_dp_rank\": 9}\n{\"text\": \"x\"}\n{\"text\": \"x\"}\n";
        let (out, failed) = run_lines("follow_bootstrap_room", 4, input);
        let lines: Vec<Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert!(failed);
        assert!(lines[0]["error"].as_str().unwrap().starts_with("invalid JSON"));
        assert!(lines[1]["error"]
            .as_str()
            .unwrap()
            .contains("DP rank 9 is out of range"));
        assert!(lines[2]["error"].as_str().unwrap().contains("bootstrap_room"));
        assert_eq!(lines.len(), 4);
    }
}
