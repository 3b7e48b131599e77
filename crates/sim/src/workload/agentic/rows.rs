//! Agentic Mooncake rows (Dynamo's trace format, `docs/dynosim/trace-formats.md` in `ai-dynamo/dynamo`), read
//! into a [`Plan`].
//!
//! Each JSONL row is one request: `hash_ids` (its prompt's 512-token blocks, as in a Mooncake trace),
//! `output_length`, optional `input_length` (at most `hash_ids` × 512; default that product). Scheduling:
//!
//! - a row with `wait_for` (a list of `request_id`s) is sent when every one of them has completed, plus `delay` and
//!   `tool_wait_ms` (milliseconds); its own `timestamp` is not used;
//! - a row with a `session_id` and no `wait_for` is the next turn of that session: sent when the session's previous
//!   row has completed, plus its `delay` if it has one, otherwise the difference of their `timestamp`s (Dynamo's
//!   multi-turn Mooncake rule); the session's first row arrives at its `timestamp`;
//! - any other row arrives at its `timestamp` (0 if absent), open loop.
//!
//! `branches`, `prefix_reset` and any other field are metadata that does not change scheduling, as in Dynamo's
//! replay; aliases `created_time`, `delay_ms`, `input_tokens`, `output_tokens` are accepted. Files whose first row
//! has a `request_id` need one, unique, on every row; files whose first row has only a `session_id` (multi-turn
//! Mooncake) name rows by line. A missing or duplicate id, an unknown or cyclic `wait_for`, a negative time, or an
//! `input_length` beyond its blocks is an error naming the row. `speedup` divides every time; `limit` keeps the
//! first rows (a kept row waiting for a dropped one is an error). The whole file is read at the start, to check
//! the graph: memory O(rows · blocks).

use std::collections::HashMap;
use std::io::BufRead;

use serde::Deserialize;

use super::{Part, Plan, Step};
use crate::cost::to_micros;
use crate::tokens::Namespace;
use crate::workload::trace::{TraceConfig, BLOCK_TOKENS};
use crate::workload::WorkloadError;

/// A request or session id: JSON text or a number.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Id {
    Text(String),
    Number(u64),
}

impl Id {
    fn text(self) -> String {
        match self {
            Self::Text(t) => t,
            Self::Number(n) => n.to_string(),
        }
    }
}

#[derive(Debug, Deserialize)]
struct Row {
    request_id: Option<Id>,
    session_id: Option<Id>,
    #[serde(alias = "created_time")]
    timestamp: Option<f64>,
    #[serde(alias = "input_tokens")]
    input_length: Option<usize>,
    #[serde(alias = "output_tokens")]
    output_length: u32,
    hash_ids: Vec<u64>,
    #[serde(default)]
    wait_for: Vec<Id>,
    #[serde(alias = "delay_ms")]
    delay: Option<f64>,
    tool_wait_ms: Option<f64>,
}

/// Whether a trace's first row (its text) is an agentic or multi-turn row, for [`read`] rather than the open-loop
/// replay.
pub fn is_agentic(first_row: &str) -> bool {
    serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(first_row).is_ok_and(|row| {
        ["request_id", "session_id", "wait_for"]
            .iter()
            .any(|k| row.contains_key(*k))
    })
}

fn invalid(message: String) -> WorkloadError {
    WorkloadError::Invalid { kind: "trace", message }
}

/// Milliseconds to microseconds at `speedup`; a negative or non-finite time is an error naming `what`.
fn time(ms: f64, speedup: f64, name: &str, what: &str) -> Result<u64, WorkloadError> {
    if !(ms >= 0.0 && ms.is_finite()) {
        return Err(invalid(format!("request `{name}` has an invalid {what}: {ms}")));
    }
    Ok(to_micros(ms / 1000.0 / speedup))
}

/// The plan of the rows in `lines` (the trace at `config.path`).
pub fn read(lines: impl BufRead, config: &TraceConfig) -> Result<Plan, WorkloadError> {
    let mut rows: Vec<(String, Row)> = Vec::new();
    let mut named = None;
    for (number, line) in lines.lines().enumerate() {
        let line = line.map_err(|source| WorkloadError::Io {
            path: config.path.clone(),
            source,
        })?;
        if line.trim().is_empty() {
            continue;
        }
        if config.limit > 0 && rows.len() as u64 >= config.limit {
            break;
        }
        let mut row: Row = serde_json::from_str(&line).map_err(|source| WorkloadError::TraceLine {
            path: config.path.clone(),
            line: number + 1,
            source,
        })?;
        // The first row decides whether rows are named by their `request_id` or by their line.
        let named = *named.get_or_insert(row.request_id.is_some());
        let name = match (named, row.request_id.take()) {
            (true, None) => return Err(invalid(format!("line {}: a row without `request_id`", number + 1))),
            (true, Some(id)) => id.text(),
            (false, _) => format!("line {}", number + 1),
        };
        if name.is_empty() {
            return Err(invalid(format!("line {}: an empty `request_id`", number + 1)));
        }
        rows.push((name, row));
    }
    if rows.is_empty() {
        return Err(invalid(format!("{} has no rows", config.path)));
    }
    let mut index = HashMap::with_capacity(rows.len());
    for (i, (name, _)) in rows.iter().enumerate() {
        if index.insert(name.clone(), i).is_some() {
            return Err(invalid(format!("request `{name}` appears twice")));
        }
    }
    let speedup = config.speedup;
    // Per session: its latest row and that row's timestamp.
    let mut sessions: HashMap<String, (usize, f64)> = HashMap::new();
    let mut steps = Vec::with_capacity(rows.len());
    for (i, (name, row)) in rows.into_iter().enumerate() {
        let capacity = row.hash_ids.len() * BLOCK_TOKENS;
        let input = row.input_length.unwrap_or(capacity);
        if input > capacity {
            return Err(invalid(format!(
                "request `{name}` has input_length {input}, more than its {} blocks hold ({capacity})",
                row.hash_ids.len()
            )));
        }
        let extra = time(row.tool_wait_ms.unwrap_or(0.0), speedup, &name, "tool_wait_ms")?;
        let session = row.session_id.map(Id::text);
        let previous = session.as_ref().and_then(|s| sessions.get(s).copied());
        let stamp = row.timestamp.unwrap_or(0.0);
        let (after, wait) = if !row.wait_for.is_empty() {
            let mut after = Vec::with_capacity(row.wait_for.len());
            for parent in row.wait_for {
                let parent = parent.text();
                let Some(&p) = index.get(&parent) else {
                    return Err(invalid(format!(
                        "request `{name}` waits for `{parent}`, which no row names"
                    )));
                };
                after.push(p);
            }
            (
                after,
                time(row.delay.unwrap_or(0.0), speedup, &name, "delay")?.saturating_add(extra),
            )
        } else if let Some((p, previous_stamp)) = previous {
            let gap = row.delay.unwrap_or((stamp - previous_stamp).max(0.0));
            (vec![p], time(gap, speedup, &name, "delay")?.saturating_add(extra))
        } else {
            if row.delay.is_some_and(|d| d != 0.0) {
                return Err(invalid(format!(
                    "request `{name}` sets `delay` but waits for nothing (no `wait_for`, first of its session)"
                )));
            }
            (
                Vec::new(),
                time(stamp, speedup, &name, "timestamp")?.saturating_add(extra),
            )
        };
        let session_number = match &session {
            Some(s) => {
                sessions.insert(s.clone(), (i, stamp));
                dprouter_core::request::session_hash(s)
            }
            None => row.hash_ids.first().copied().unwrap_or(u64::MAX),
        };
        let mut left = input;
        let parts = row
            .hash_ids
            .iter()
            .map_while(|&block| {
                let len = left.min(BLOCK_TOKENS);
                left -= len;
                (len > 0).then_some(Part {
                    ns: Namespace::TraceBlock,
                    id: block,
                    len,
                })
            })
            .collect();
        steps.push(Step {
            name,
            session: session_number,
            group: row.hash_ids.first().copied().unwrap_or(u64::MAX),
            named_session: session.is_some(),
            after,
            wait,
            continues: None,
            parts,
            output_tokens: row.output_length,
        });
    }
    Ok(Plan { steps })
}

#[cfg(test)]
#[path = "rows_tests.rs"]
mod tests;
