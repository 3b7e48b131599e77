//! Workloads: the requests a simulation (or an HTTP benchmark) sends, with identical content for every policy.
//!
//! A workload yields open-loop arrivals in time order ([`Workload::next_arrival`]) and may answer a finished
//! request with a follow-up ([`Workload::on_finish`], closed loop: an agent's next turn). Specs on the command line:
//!
//! - `agentic[:k=v,...]`: generated agent programs with tool waits and subagents, closed loop
//!   ([`agentic::generator::AgenticConfig`]).
//! - `agent[:k=v,...]`: agents sending multi-turn conversations over shared prefixes ([`agent::AgentConfig`]).
//! - `groups[:k=v,...]`: SGLang's generated-shared-prefix benchmark ([`groups::GroupsConfig`]).
//! - `trace:PATH[,speedup=X]`: a Mooncake JSONL trace replayed at its timestamps ([`trace::TraceConfig`]), or an
//!   agentic one closed loop ([`agentic::rows`]).

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};
use thiserror::Error;

use crate::cost::Micros;

pub mod agent;
pub mod agentic;
pub mod groups;
pub mod trace;

/// One request as the simulated engine sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimRequest {
    /// Unique within a workload run and identical across policies (it also seeds the synthetic output).
    pub id: u64,
    pub arrival: Micros,
    pub tokens: Vec<u32>,
    pub output_tokens: u32,
    /// Requests of one group share a prefix; the first of each group to arrive is its cold start.
    pub group: u64,
    /// Requests of one session follow each other (an agent's conversation); a workload without sessions uses the
    /// group. The steady-state columns leave out each session's first request.
    pub session: u64,
    /// The client names its session (an agent's session header, as Claude Code sends it): routers are given
    /// `session` as the request's session hint.
    pub named_session: bool,
    /// Its answer ends on tool calls: its agent sends the next turn once the tool has run (the routers hear it
    /// when the request ends, as the gateway reads it from an answer's finish reason).
    pub tool_call: bool,
}

impl SimRequest {
    /// The `bootstrap_room` a PD-disaggregation router would attach: a random 63-bit value per request.
    pub fn bootstrap_room(&self, seed: u64) -> u64 {
        crate::tokens::mix(seed ^ crate::tokens::mix(self.id ^ 0xB007)) >> 1
    }
}

pub trait Workload {
    /// The next open-loop request, in nondecreasing arrival order; `None` when there are no more.
    fn next_arrival(&mut self) -> Option<SimRequest>;

    /// The follow-ups `finished` releases, which completed at `now` with the answer `output` (token ids, as the
    /// engine generated and cached them): an agent's next turn, the subagents it forks, the turn that joins them.
    /// Each arrives at its own `arrival` (never before `now`). Empty for open-loop workloads.
    fn on_finish(&mut self, finished: &SimRequest, output: &[u32], now: Micros) -> Vec<SimRequest>;

    /// An error that ended the arrivals early (a malformed trace line); the run must report it, not its results.
    fn take_error(&mut self) -> Option<WorkloadError> {
        None
    }

    /// How many requests a full run sends, when that is cheaply known before the run (for progress bars); `None`
    /// otherwise. Meant for display only: a run may end early (a trace's malformed line).
    fn expected_requests(&self) -> Option<u64> {
        None
    }
}

#[derive(Debug, Error)]
pub enum WorkloadError {
    #[error("unknown workload `{0}`: expected agent, agentic, groups or trace:PATH")]
    Unknown(String),
    #[error("workload option `{0}` must look like key=value")]
    Malformed(String),
    #[error("invalid options for workload `{kind}`: {source}")]
    Options {
        kind: &'static str,
        source: serde_json::Error,
    },
    #[error("workload `{kind}`: {message}")]
    Invalid { kind: &'static str, message: String },
    #[error("cannot read trace {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("trace {path} line {line}: {source}")]
    TraceLine {
        path: String,
        line: usize,
        source: serde_json::Error,
    },
}

/// A parsed `--workload` spec; builds a fresh, identical workload for each policy.
#[derive(Debug, Clone, PartialEq)]
pub enum WorkloadSpec {
    Agent(agent::AgentConfig),
    Agentic(agentic::generator::AgenticConfig),
    Groups(groups::GroupsConfig),
    Trace(trace::TraceConfig),
}

impl WorkloadSpec {
    pub fn parse(spec: &str) -> Result<Self, WorkloadError> {
        let (kind, rest) = spec.split_once(':').unwrap_or((spec, ""));
        match kind {
            "agent" => Ok(Self::Agent(options("agent", rest)?)),
            "agentic" => {
                let config: agentic::generator::AgenticConfig = options("agentic", rest)?;
                config.check()?;
                Ok(Self::Agentic(config))
            }
            "groups" => Ok(Self::Groups(options("groups", rest)?)),
            "trace" => {
                let (path, rest) = rest.split_once(',').unwrap_or((rest, ""));
                if path.is_empty() {
                    return Err(WorkloadError::Invalid {
                        kind: "trace",
                        message: "needs a path: trace:PATH".into(),
                    });
                }
                let mut config: trace::TraceConfig = options("trace", rest)?;
                config.path = path.into();
                Ok(Self::Trace(config))
            }
            other => Err(WorkloadError::Unknown(other.into())),
        }
    }

    /// A short name for reports.
    pub fn name(&self) -> String {
        match self {
            Self::Agent(c) => format!(
                "agent(agents={},prefixes={},prefix_len={},turns={}{})",
                c.agents,
                c.prefixes,
                c.prefix_len,
                c.turns,
                if c.min_turns > 0 {
                    format!(",min_turns={}", c.min_turns)
                } else {
                    String::new()
                }
            ),
            Self::Agentic(c) => format!(
                "agentic(programs={},apps={},turns={},fork_p={},fanout={})",
                c.programs, c.apps, c.turns, c.fork_p, c.fanout
            ),
            Self::Groups(c) => format!("groups({}x{},system={})", c.groups, c.prompts_per_group, c.system_len),
            Self::Trace(c) => format!("trace({})", c.path),
        }
    }

    pub fn build(&self, seed: u64) -> Result<Box<dyn Workload>, WorkloadError> {
        Ok(match self {
            Self::Agent(c) => Box::new(agent::AgentWorkload::new(c.clone(), seed)?),
            Self::Groups(c) => Box::new(groups::GroupsWorkload::new(c.clone(), seed)?),
            Self::Agentic(c) => Box::new(agentic::PlanWorkload::new(
                agentic::generator::plan(c, seed)?,
                seed,
                "agentic",
            )?),
            Self::Trace(c) => trace::open(c.clone(), seed)?,
        })
    }
}

/// Parses `k=v,k=v` into a config struct (unknown keys are errors; absent keys keep their defaults).
fn options<T: DeserializeOwned>(kind: &'static str, text: &str) -> Result<T, WorkloadError> {
    let mut map = Map::new();
    for pair in text.split(',').filter(|p| !p.trim().is_empty()) {
        let (k, v) = pair
            .split_once('=')
            .ok_or_else(|| WorkloadError::Malformed(pair.into()))?;
        let value = v
            .parse::<u64>()
            .map(Value::from)
            .or_else(|_| v.parse::<f64>().map(Value::from))
            .unwrap_or_else(|_| Value::from(v));
        map.insert(k.trim().into(), value);
    }
    serde_json::from_value(Value::Object(map)).map_err(|source| WorkloadError::Options { kind, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_with_defaults_and_reject_unknown_keys() {
        let WorkloadSpec::Agent(a) = WorkloadSpec::parse("agent").unwrap() else {
            panic!()
        };
        assert_eq!((a.agents, a.prefix_len, a.turns), (1, 22_651, 30));
        let WorkloadSpec::Agent(a) = WorkloadSpec::parse("agent:agents=4,think_s=0.5").unwrap() else {
            panic!()
        };
        assert_eq!((a.agents, a.think_s), (4, 0.5));
        let WorkloadSpec::Trace(t) = WorkloadSpec::parse("trace:/x/y.jsonl,speedup=2").unwrap() else {
            panic!()
        };
        assert_eq!((t.path.as_str(), t.speedup), ("/x/y.jsonl", 2.0));
        assert!(WorkloadSpec::parse("agent:agent=4")
            .unwrap_err()
            .to_string()
            .contains("agent"));
        assert!(WorkloadSpec::parse("agent:4").is_err());
        assert!(WorkloadSpec::parse("poisson").is_err());
        assert!(WorkloadSpec::parse("trace:").is_err());
    }
}
