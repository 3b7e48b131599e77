//! `agent`: agents holding multi-turn conversations over shared prefixes (closed loop).
//!
//! Agent `a` uses prefix `a % prefixes` (a system prompt plus tool definitions of `prefix_len` tokens). Its first
//! request is that prefix plus a new user turn; each later turn is the previous prompt, the engine's answer to it,
//! and a new user turn, sent `think_s` after the previous answer finished. Defaults reproduce the seed measurement:
//! one agent, one 22,651-token prefix, 30 requests, ~200 new tokens per turn (its warm TTFT of 1.29 s).

use serde::Deserialize;

use crate::cost::{to_micros, Micros};
use crate::tokens::{self, Namespace};
use crate::workload::{SimRequest, Workload, WorkloadError};

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgentConfig {
    pub agents: u64,
    /// Distinct prefixes the agents share round-robin.
    pub prefixes: u64,
    pub prefix_len: usize,
    /// Requests per agent (the most, when `min_turns` is set).
    pub turns: u32,
    /// When in 1..turns: each agent makes a number of requests drawn uniformly from `min_turns..=turns`, so
    /// conversations end at different lengths. 0: every agent makes `turns`.
    pub min_turns: u32,
    /// Tokens of each new user turn.
    pub user_tokens: usize,
    /// Tokens of each answer.
    pub output_tokens: u32,
    /// Mean pause between an answer and the next turn, seconds.
    pub think_s: f64,
    /// Each pause is drawn uniformly from `think_s · [1 − jitter, 1 + jitter]`, so agents do not move in lockstep.
    pub think_jitter: f64,
    /// Agent `a` starts at `a * stagger_s` seconds.
    pub stagger_s: f64,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            agents: 1,
            prefixes: 1,
            prefix_len: 22_651,
            turns: 30,
            min_turns: 0,
            user_tokens: 200,
            output_tokens: 150,
            think_s: 1.0,
            think_jitter: 0.5,
            stagger_s: 0.0,
        }
    }
}

pub struct AgentWorkload {
    config: AgentConfig,
    seed: u64,
    next_agent: u64,
}

impl AgentWorkload {
    pub fn new(config: AgentConfig, seed: u64) -> Result<Self, WorkloadError> {
        if config.agents == 0 || config.prefixes == 0 || config.turns == 0 {
            return Err(WorkloadError::Invalid {
                kind: "agent",
                message: "agents, prefixes and turns must be at least 1".into(),
            });
        }
        if !(0.0..=1.0).contains(&config.think_jitter) || config.think_s < 0.0 || config.stagger_s < 0.0 {
            return Err(WorkloadError::Invalid {
                kind: "agent",
                message: "think_jitter must be in [0, 1], think_s and stagger_s >= 0".into(),
            });
        }
        Ok(Self {
            config,
            seed,
            next_agent: 0,
        })
    }

    /// The number of requests agent `agent` makes.
    pub fn turns_of(&self, agent: u64) -> u32 {
        let (lo, hi) = (self.config.min_turns, self.config.turns);
        if lo == 0 || lo >= hi {
            return hi;
        }
        lo + (tokens::mix(self.seed ^ tokens::mix(agent ^ 0x7_0125)) % u64::from(hi - lo + 1)) as u32
    }

    fn request(&self, agent: u64, turn: u32, mut tokens: Vec<u32>, arrival: Micros) -> SimRequest {
        let id = agent * u64::from(self.config.turns) + u64::from(turn);
        tokens::extend(&mut tokens, self.seed, Namespace::UserTurn, id, self.config.user_tokens);
        SimRequest {
            id,
            arrival,
            tokens,
            output_tokens: self.config.output_tokens,
            group: agent % self.config.prefixes,
            session: agent,
            named_session: false,
            tool_call: false,
        }
    }
}

impl Workload for AgentWorkload {
    fn next_arrival(&mut self) -> Option<SimRequest> {
        let agent = self.next_agent;
        if agent >= self.config.agents {
            return None;
        }
        self.next_agent += 1;
        let prefix = tokens::sequence(
            self.seed,
            Namespace::SystemPrompt,
            agent % self.config.prefixes,
            self.config.prefix_len,
        );
        Some(self.request(agent, 0, prefix, to_micros(agent as f64 * self.config.stagger_s)))
    }

    fn on_finish(&mut self, finished: &SimRequest, output: &[u32], now: Micros) -> Vec<SimRequest> {
        let turns = u64::from(self.config.turns);
        let (agent, turn) = (finished.id / turns, (finished.id % turns) as u32);
        if turn + 1 >= self.turns_of(agent) {
            return Vec::new();
        }
        let mut conversation = finished.tokens.clone();
        conversation.extend_from_slice(output);
        // A uniform draw in [0, 1) from the request id: the same pauses for every policy.
        let u = (tokens::mix(self.seed ^ tokens::mix(finished.id ^ 0x7415)) >> 11) as f64 / (1u64 << 53) as f64;
        let think = self.config.think_s * (1.0 + self.config.think_jitter * (2.0 * u - 1.0));
        vec![self.request(agent, turn + 1, conversation, now + to_micros(think))]
    }

    /// Every agent's turns: O(agents).
    fn expected_requests(&self) -> Option<u64> {
        Some((0..self.config.agents).map(|a| u64::from(self.turns_of(a))).sum())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_turn_extends_the_previous_prompt_and_answer() {
        let config = AgentConfig {
            agents: 2,
            prefixes: 1,
            prefix_len: 100,
            turns: 3,
            think_jitter: 0.0,
            ..AgentConfig::default()
        };
        let mut w = AgentWorkload::new(config, 7).unwrap();
        let a0 = w.next_arrival().unwrap();
        let b0 = w.next_arrival().unwrap();
        assert!(w.next_arrival().is_none());
        assert_eq!(a0.tokens[..100], b0.tokens[..100], "agents share the prefix");
        assert_ne!(a0.tokens[100..], b0.tokens[100..], "but not their user turns");
        let out = tokens::output(7, 0, 150);
        let a1 = w.on_finish(&a0, &out, 5_000_000).pop().unwrap();
        assert_eq!(a1.arrival, 6_000_000);
        assert_eq!(a1.tokens[..a0.tokens.len()], a0.tokens[..]);
        assert_eq!(a1.tokens[a0.tokens.len()..a0.tokens.len() + 150], out[..]);
        assert_eq!(a1.tokens.len(), a0.tokens.len() + 150 + 200);
        let a2 = w.on_finish(&a1, &out, 9_000_000).pop().unwrap();
        assert!(w.on_finish(&a2, &out, 10_000_000).is_empty(), "three turns only");
        assert_eq!(w.expected_requests(), Some(6));
        assert_eq!((a1.id, a2.id, b0.id), (1, 2, 3));
    }

    #[test]
    fn min_turns_draws_each_agents_length_in_range() {
        let config = AgentConfig {
            agents: 200,
            turns: 9,
            min_turns: 4,
            ..AgentConfig::default()
        };
        let w = AgentWorkload::new(config, 1).unwrap();
        let lengths: Vec<u32> = (0..200).map(|a| w.turns_of(a)).collect();
        assert!(lengths.iter().all(|t| (4..=9).contains(t)));
        assert_eq!(w.expected_requests(), Some(lengths.iter().map(|&t| u64::from(t)).sum()));
        assert!(lengths.contains(&4) && lengths.contains(&9));
        let mut w = AgentWorkload::new(
            AgentConfig {
                turns: 2,
                min_turns: 1,
                ..AgentConfig::default()
            },
            1,
        )
        .unwrap();
        let first = w.next_arrival().unwrap();
        let done_after_one = w.turns_of(0) == 1;
        assert_eq!(w.on_finish(&first, &[], 0).is_empty(), done_after_one);
    }
}
