//! `agentic:`: generated agent programs, closed loop, with tool waits and subagents.
//!
//! Programs (sessions) start as a Poisson process of `rate` per second. Program `p` belongs to application
//! `p % apps`, whose system prompt and tool definitions (`app_prefix_len` tokens) every program of it shares. Its
//! main agent's first request is that prefix plus a user message; each later turn is the previous prompt, the
//! engine's answer, and a tool result (`tool_tokens`), sent when the tool has run: a wait drawn so that a share
//! `tool_under_1s` of them take under a second and `tool_under_10s` under ten (the vLLM router's measurement of
//! agents: 86% and 95%), log-uniform within each band (0.05–1 s, 1–10 s, 10 s–`tool_max_s`). The number of main
//! turns is log-normal with mean `turns` (σ = `turns_sigma`), at most `max_turns`.
//!
//! After a main turn, with probability `fork_p`, the agent forks 1..=`fanout` subagents at once: each starts from its
//! own prompt (one of `subagent_types` per application, `subagent_prefix_len` tokens, shared like the app's) and a
//! task, runs its own closed loop of log-normal `subagent_turns` turns with tool waits, and the main agent's next
//! turn waits for all of them and appends each one's result (`result_tokens`). A main prompt that would outgrow
//! `context_limit` is compacted: the next turn starts over from the app's prefix and a summary (`summary_tokens`),
//! as Claude Code's auto-compact does. Answers are `output_tokens` long (uniform within ±50%, as are tool results).
//! Every request names its session (a subagent's is its own), as Claude Code's session header does.

use serde::Deserialize;

use super::{Part, Plan, Step};
use crate::cost::{to_micros, Micros};
use crate::tokens::{mix, Namespace};
use crate::workload::WorkloadError;

/// The most subagents one fork may start: a step's fresh parts are numbered in 8 bits (255 is its summary).
const MAX_FANOUT: u32 = 254;

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgenticConfig {
    /// Programs (main agents' sessions).
    pub programs: u64,
    /// New programs per second (Poisson).
    pub rate: f64,
    /// Applications: each has its own system prompt and tools, shared by its programs.
    pub apps: u64,
    pub app_prefix_len: usize,
    /// Tokens of a program's first user message.
    pub user_tokens: usize,
    /// Mean main-agent turns per program.
    pub turns: f64,
    /// The spread of turns per program (σ of the log-normal).
    pub turns_sigma: f64,
    pub max_turns: u32,
    /// Mean tokens of a tool result.
    pub tool_tokens: usize,
    /// Mean tokens of an answer.
    pub output_tokens: u32,
    /// The share of tool waits under 1 s, and under 10 s.
    pub tool_under_1s: f64,
    pub tool_under_10s: f64,
    /// The longest tool wait, seconds.
    pub tool_max_s: f64,
    /// Probability that a main turn forks subagents.
    pub fork_p: f64,
    /// The most subagents one fork starts (uniform in 1..=fanout).
    pub fanout: u32,
    /// Subagent prompts per application.
    pub subagent_types: u64,
    pub subagent_prefix_len: usize,
    /// Tokens of a subagent's task.
    pub task_tokens: usize,
    /// Mean turns of a subagent.
    pub subagent_turns: f64,
    /// Tokens of each subagent's result in its parent's next turn.
    pub result_tokens: usize,
    /// A main prompt longer than this is compacted.
    pub context_limit: usize,
    pub summary_tokens: usize,
}

impl Default for AgenticConfig {
    fn default() -> Self {
        Self {
            programs: 32,
            rate: 0.5,
            apps: 2,
            app_prefix_len: 12_000,
            user_tokens: 300,
            turns: 40.0,
            turns_sigma: 0.8,
            max_turns: 1_000,
            tool_tokens: 500,
            output_tokens: 150,
            tool_under_1s: 0.86,
            tool_under_10s: 0.95,
            tool_max_s: 60.0,
            fork_p: 0.05,
            fanout: 4,
            subagent_types: 2,
            subagent_prefix_len: 3_000,
            task_tokens: 400,
            subagent_turns: 8.0,
            result_tokens: 300,
            context_limit: 64_000,
            summary_tokens: 2_000,
        }
    }
}

impl AgenticConfig {
    pub fn check(&self) -> Result<(), WorkloadError> {
        let fail = |message: &str| {
            Err(WorkloadError::Invalid {
                kind: "agentic",
                message: message.into(),
            })
        };
        if self.programs == 0 || self.apps == 0 || self.subagent_types == 0 || self.max_turns == 0 {
            return fail("programs, apps, subagent_types and max_turns must be at least 1");
        }
        if !(self.rate > 0.0 && self.rate.is_finite()) {
            return fail("rate must be > 0");
        }
        if !(self.turns >= 1.0 && self.subagent_turns >= 1.0 && self.turns_sigma >= 0.0 && self.turns_sigma <= 3.0) {
            return fail("turns and subagent_turns must be >= 1, turns_sigma in [0, 3]");
        }
        let shares =
            0.0 <= self.tool_under_1s && self.tool_under_1s <= self.tool_under_10s && self.tool_under_10s <= 1.0;
        if !(shares && self.tool_max_s >= 10.0 && self.tool_max_s.is_finite()) {
            return fail("need 0 <= tool_under_1s <= tool_under_10s <= 1 and tool_max_s >= 10");
        }
        if !(0.0..=1.0).contains(&self.fork_p) || (self.fork_p > 0.0 && self.fanout == 0) {
            return fail("fork_p must be in [0, 1] and fanout >= 1 when it is not 0");
        }
        if self.fanout > MAX_FANOUT {
            return fail("fanout must be at most 254");
        }
        if self.context_limit <= self.app_prefix_len + self.summary_tokens {
            return fail("context_limit must exceed app_prefix_len + summary_tokens");
        }
        Ok(())
    }

    /// One tool wait, from a uniform draw `band` (which band) and `within` (where in it).
    pub fn tool_wait(&self, band: f64, within: f64) -> Micros {
        let (lo, hi) = if band < self.tool_under_1s {
            (0.05, 1.0)
        } else if band < self.tool_under_10s {
            (1.0, 10.0)
        } else {
            (10.0, self.tool_max_s)
        };
        to_micros(lo * (hi / lo).powf(within))
    }
}

/// A deterministic stream of uniform draws (SplitMix64).
struct Draws(u64);

impl Draws {
    fn unit(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        (mix(self.0) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `mean · [0.5, 1.5]`, at least 1.
    fn around(&mut self, mean: usize) -> usize {
        ((mean as f64 * (0.5 + self.unit())).round() as usize).max(1)
    }

    /// Log-normal with mean `mean` and spread `sigma`, rounded, in `1..=max`.
    fn turns(&mut self, mean: f64, sigma: f64, max: u32) -> u32 {
        // Box–Muller; `1 - unit` is in (0, 1].
        let z = (-2.0 * (1.0 - self.unit()).ln()).sqrt() * (std::f64::consts::TAU * self.unit()).cos();
        let x = (mean.ln() - sigma * sigma / 2.0 + sigma * z).exp();
        (x.round() as u32).clamp(1, max)
    }
}

/// The plan of `config` under `seed`.
pub fn plan(config: &AgenticConfig, seed: u64) -> Result<Plan, WorkloadError> {
    config.check()?;
    let mut builder = Builder {
        config,
        draws: Draws(mix(seed ^ 0xA9E7_71C5)),
        steps: Vec::new(),
        sessions: config.programs,
    };
    let mut start = 0.0f64;
    for program in 0..config.programs {
        builder.program(program, to_micros(start));
        start += -(1.0 - builder.draws.unit()).ln() / config.rate;
    }
    Ok(Plan { steps: builder.steps })
}

struct Builder<'c> {
    config: &'c AgenticConfig,
    draws: Draws,
    steps: Vec<Step>,
    /// The next free session number (programs take `0..programs`, subagents the ones after).
    sessions: u64,
}

impl Builder<'_> {
    /// A part of fresh content, unique to step `step` (its `k`-th).
    fn fresh(step: usize, k: u64, len: usize) -> Part {
        Part {
            ns: Namespace::UserTurn,
            id: ((step as u64) << 8) | k,
            len,
        }
    }

    fn push(&mut self, mut step: Step) -> usize {
        step.name = format!("{}#{}", step.name, self.steps.len());
        self.steps.push(step);
        self.steps.len() - 1
    }

    fn tool_wait(&mut self) -> Micros {
        let (band, within) = (self.draws.unit(), self.draws.unit());
        self.config.tool_wait(band, within)
    }

    fn program(&mut self, program: u64, start: Micros) {
        let c = self.config;
        let app = program % c.apps;
        let turns = self.draws.turns(c.turns, c.turns_sigma, c.max_turns);
        let output = self.draws.around(c.output_tokens as usize) as u32;
        let first = self.steps.len();
        let mut prev = self.push(Step {
            name: format!("p{program}.main"),
            session: program,
            group: app,
            named_session: true,
            after: Vec::new(),
            wait: start,
            continues: None,
            parts: vec![
                Part {
                    ns: Namespace::SystemPrompt,
                    id: app,
                    len: c.app_prefix_len,
                },
                Self::fresh(first, 0, c.user_tokens),
            ],
            output_tokens: output,
        });
        let mut length = c.app_prefix_len + c.user_tokens + output as usize;
        for _ in 1..turns {
            let mut after = vec![prev];
            let forks = c.fork_p > 0.0 && self.draws.unit() < c.fork_p;
            let subagents = if forks {
                let n = (1 + (self.draws.unit() * f64::from(c.fanout)) as u32).min(c.fanout);
                for _ in 0..n {
                    after.push(self.subagent(app, prev));
                }
                n
            } else {
                0
            };
            // This turn's index, after its subagents' steps: its fresh parts are its own.
            let here = self.steps.len();
            let (mut parts, wait) = if forks {
                let results = (0..subagents).map(|k| Self::fresh(here, u64::from(k), c.result_tokens));
                (results.collect(), 0)
            } else {
                let tool = self.draws.around(c.tool_tokens);
                (vec![Self::fresh(here, 0, tool)], self.tool_wait())
            };
            let output = self.draws.around(c.output_tokens as usize) as u32;
            let app_prefix = Part {
                ns: Namespace::SystemPrompt,
                id: app,
                len: c.app_prefix_len,
            };
            let continues = self.grow(&mut length, app_prefix, here, prev, &mut parts, output);
            prev = self.push(Step {
                name: format!("p{program}.main"),
                session: program,
                group: app,
                named_session: true,
                after,
                wait,
                continues,
                parts,
                output_tokens: output,
            });
        }
    }

    /// A turn that adds `parts` and an answer of `output` tokens to a conversation of `length` tokens whose last
    /// step is `prev`: it continues `prev`, or, past `context_limit`, is compacted to `prefix` and a summary
    /// (`parts` replaced). Returns the step it continues; `length` becomes the new conversation's.
    fn grow(
        &self,
        length: &mut usize,
        prefix: Part,
        here: usize,
        prev: usize,
        parts: &mut Vec<Part>,
        output: u32,
    ) -> Option<usize> {
        let c = self.config;
        let added: usize = parts.iter().map(|p| p.len).sum();
        if *length + added + output as usize > c.context_limit {
            *parts = vec![prefix, Self::fresh(here, 255, c.summary_tokens)];
            *length = prefix.len + c.summary_tokens + output as usize;
            None
        } else {
            *length += added + output as usize;
            Some(prev)
        }
    }

    /// A subagent forked after step `parent` of a program of `app`; returns its last step.
    fn subagent(&mut self, app: u64, parent: usize) -> usize {
        let c = self.config;
        let session = self.sessions;
        self.sessions += 1;
        let kind = (self.draws.unit() * c.subagent_types as f64) as u64 % c.subagent_types;
        let turns = self.draws.turns(c.subagent_turns, c.turns_sigma, c.max_turns);
        let here = self.steps.len();
        let prefix = Part {
            ns: Namespace::SystemPrompt,
            id: (1 << 32) | (app * c.subagent_types + kind),
            len: c.subagent_prefix_len,
        };
        let output = self.draws.around(c.output_tokens as usize) as u32;
        let mut length = prefix.len + c.task_tokens + output as usize;
        let mut prev = self.push(Step {
            name: format!("s{session}.sub"),
            session,
            group: app,
            named_session: true,
            after: vec![parent],
            wait: 0,
            continues: None,
            parts: vec![prefix, Self::fresh(here, 0, c.task_tokens)],
            output_tokens: output,
        });
        for _ in 1..turns {
            let here = self.steps.len();
            let mut parts = vec![Self::fresh(here, 0, self.draws.around(c.tool_tokens))];
            let wait = self.tool_wait();
            let output = self.draws.around(c.output_tokens as usize) as u32;
            let continues = self.grow(&mut length, prefix, here, prev, &mut parts, output);
            prev = self.push(Step {
                name: format!("s{session}.sub"),
                session,
                group: app,
                named_session: true,
                after: vec![prev],
                wait,
                continues,
                parts,
                output_tokens: output,
            });
        }
        prev
    }
}

#[cfg(test)]
#[path = "generator_tests.rs"]
mod tests;
