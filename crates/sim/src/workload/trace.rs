//! `trace:PATH`: replay of a Mooncake request trace (FAST'25), open loop at the trace's timestamps.
//!
//! Each JSONL line has `timestamp` (ms), `input_length`, `output_length` and `hash_ids`: the prompt's 512-token
//! blocks. Block `b` becomes 512 synthetic tokens that depend only on `b`, so two requests share tokens exactly as
//! far as their `hash_ids` agree; the last block is cut to `input_length`. `speedup` divides the timestamps. The
//! file is read lazily, one line per arrival: memory stays proportional to the requests in flight.
//!
//! A trace of agentic or multi-turn rows (Dynamo's agentic Mooncake format, with `request_id`, `wait_for`,
//! `session_id`, `delay`, `tool_wait_ms`) is replayed closed loop instead ([`open`], [`rows`]).

use std::fs::File;
use std::io::{BufRead, BufReader, Lines};

use serde::Deserialize;

use crate::cost::{to_micros, Micros};
use crate::tokens::{self, Namespace};
use crate::workload::agentic::{rows, PlanWorkload};
use crate::workload::{SimRequest, Workload, WorkloadError};

/// Tokens per `hash_ids` block in the Mooncake traces.
pub const BLOCK_TOKENS: usize = 512;

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TraceConfig {
    #[serde(skip)]
    pub path: String,
    /// Replay this many times faster than recorded.
    pub speedup: f64,
    /// Stop after this many requests (0 = all).
    pub limit: u64,
}

impl Default for TraceConfig {
    fn default() -> Self {
        Self {
            path: String::new(),
            speedup: 1.0,
            limit: 0,
        }
    }
}

#[derive(Debug, Deserialize)]
struct TraceLine {
    timestamp: f64,
    input_length: usize,
    output_length: u32,
    hash_ids: Vec<u64>,
}

pub struct TraceWorkload {
    config: TraceConfig,
    seed: u64,
    lines: Lines<BufReader<File>>,
    line: usize,
    next_id: u64,
    /// An error met while reading; reported by [`TraceWorkload::take_error`] and ends the replay.
    error: Option<WorkloadError>,
}

/// The replay of `config`'s trace: open loop for Mooncake rows, closed loop for agentic or multi-turn rows
/// ([`rows`]: a first row with `request_id`, `session_id` or `wait_for`).
pub fn open(config: TraceConfig, seed: u64) -> Result<Box<dyn Workload>, WorkloadError> {
    let io = |source| WorkloadError::Io {
        path: config.path.clone(),
        source,
    };
    let file = BufReader::new(File::open(&config.path).map_err(io)?);
    let mut first = None;
    for line in file.lines() {
        let line = line.map_err(io)?;
        if !line.trim().is_empty() {
            first = Some(line);
            break;
        }
    }
    if first.as_deref().is_some_and(rows::is_agentic) {
        if !(config.speedup > 0.0 && config.speedup.is_finite()) {
            return Err(WorkloadError::Invalid {
                kind: "trace",
                message: "speedup must be > 0".into(),
            });
        }
        let file = BufReader::new(File::open(&config.path).map_err(io)?);
        let plan = rows::read(file, &config)?;
        return Ok(Box::new(PlanWorkload::new(plan, seed, "trace")?));
    }
    Ok(Box::new(TraceWorkload::open(config, seed)?))
}

impl TraceWorkload {
    pub fn open(config: TraceConfig, seed: u64) -> Result<Self, WorkloadError> {
        if !(config.speedup > 0.0 && config.speedup.is_finite()) {
            return Err(WorkloadError::Invalid {
                kind: "trace",
                message: "speedup must be > 0".into(),
            });
        }
        let file = File::open(&config.path).map_err(|source| WorkloadError::Io {
            path: config.path.clone(),
            source,
        })?;
        Ok(Self {
            config,
            seed,
            lines: BufReader::new(file).lines(),
            line: 0,
            next_id: 0,
            error: None,
        })
    }

    fn read(&mut self) -> Result<Option<SimRequest>, WorkloadError> {
        if self.config.limit > 0 && self.next_id >= self.config.limit {
            return Ok(None);
        }
        loop {
            let Some(line) = self.lines.next() else { return Ok(None) };
            self.line += 1;
            let line = line.map_err(|source| WorkloadError::Io {
                path: self.config.path.clone(),
                source,
            })?;
            if line.trim().is_empty() {
                continue;
            }
            let parsed: TraceLine = serde_json::from_str(&line).map_err(|source| WorkloadError::TraceLine {
                path: self.config.path.clone(),
                line: self.line,
                source,
            })?;
            let mut tokens = Vec::with_capacity(parsed.hash_ids.len() * BLOCK_TOKENS);
            for &block in &parsed.hash_ids {
                tokens::extend(&mut tokens, self.seed, Namespace::TraceBlock, block, BLOCK_TOKENS);
            }
            tokens.truncate(parsed.input_length);
            let id = self.next_id;
            self.next_id += 1;
            return Ok(Some(SimRequest {
                id,
                arrival: to_micros(parsed.timestamp / 1000.0 / self.config.speedup),
                tokens,
                output_tokens: parsed.output_length.max(1),
                group: parsed.hash_ids.first().copied().unwrap_or(u64::MAX),
                session: parsed.hash_ids.first().copied().unwrap_or(u64::MAX),
                named_session: false,
                tool_call: false,
            }));
        }
    }
}

impl Workload for TraceWorkload {
    fn next_arrival(&mut self) -> Option<SimRequest> {
        match self.read() {
            Ok(next) => next,
            Err(e) => {
                self.error = Some(e);
                None
            }
        }
    }

    fn on_finish(&mut self, _finished: &SimRequest, _output: &[u32], _now: Micros) -> Vec<SimRequest> {
        Vec::new()
    }

    fn take_error(&mut self) -> Option<WorkloadError> {
        self.error.take()
    }

    /// The file's non-empty lines (capped at `limit`), counted by reading it once more: one sequential pass, a few
    /// milliseconds for a trace of tens of thousands of lines. `None` when the file cannot be read again.
    fn expected_requests(&self) -> Option<u64> {
        let file = File::open(&self.config.path).ok()?;
        let mut count = 0u64;
        for line in BufReader::new(file).lines() {
            if self.config.limit > 0 && count >= self.config.limit {
                break;
            }
            if !line.ok()?.trim().is_empty() {
                count += 1;
            }
        }
        Some(count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(name: &str, text: &str) -> String {
        let path = std::env::temp_dir().join(format!("dprouter-trace-{}-{name}.jsonl", std::process::id()));
        std::fs::write(&path, text).unwrap();
        path.to_string_lossy().into_owned()
    }

    #[test]
    fn shared_blocks_are_shared_tokens_and_timestamps_scale() {
        let path = write(
            "ok",
            "{\"timestamp\": 0, \"input_length\": 1000, \"output_length\": 5, \"hash_ids\": [0, 1]}\n\
             {\"timestamp\": 2000, \"input_length\": 600, \"output_length\": 0, \"hash_ids\": [0, 2]}\n",
        );
        let config = TraceConfig {
            path: path.clone(),
            speedup: 2.0,
            limit: 0,
        };
        let mut w = TraceWorkload::open(config.clone(), 3).unwrap();
        assert_eq!(w.expected_requests(), Some(2));
        let limited = TraceConfig { limit: 1, ..config };
        assert_eq!(TraceWorkload::open(limited, 3).unwrap().expected_requests(), Some(1));
        let (a, b) = (w.next_arrival().unwrap(), w.next_arrival().unwrap());
        assert!(w.next_arrival().is_none() && w.take_error().is_none());
        assert_eq!((a.tokens.len(), b.tokens.len()), (1000, 600));
        assert_eq!(a.tokens[..512], b.tokens[..512]);
        assert_ne!(a.tokens[512..600], b.tokens[512..600]);
        assert_eq!((a.arrival, b.arrival), (0, 1_000_000));
        assert_eq!((a.group, b.output_tokens), (0, 1));
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn a_malformed_line_is_reported_with_its_number() {
        let path = write(
            "bad",
            "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [0]}\n{oops\n",
        );
        let mut w = TraceWorkload::open(
            TraceConfig {
                path: path.clone(),
                ..TraceConfig::default()
            },
            0,
        )
        .unwrap();
        assert!(w.next_arrival().is_some());
        assert!(w.next_arrival().is_none());
        assert!(w.take_error().unwrap().to_string().contains("line 2"));
        std::fs::remove_file(path).unwrap();
    }
}
