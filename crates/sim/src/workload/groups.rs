//! `groups`: SGLang's generated-shared-prefix benchmark (`bench_serving --dataset-name generated-shared-prefix`).
//!
//! `groups` system prompts of `system_len` tokens, each followed by `prompts_per_group` distinct questions of
//! `question_len` tokens; all prompts shuffled (deterministically by seed) and sent open loop, either at once
//! (`rate = 0`) or as a Poisson process of `rate` requests per second. Defaults are SGLang's.

use serde::Deserialize;

use crate::cost::{to_micros, Micros};
use crate::tokens::{self, mix, Namespace};
use crate::workload::{SimRequest, Workload, WorkloadError};

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GroupsConfig {
    pub groups: u64,
    pub prompts_per_group: u64,
    pub system_len: usize,
    pub question_len: usize,
    pub output_tokens: u32,
    /// Requests per second (Poisson); 0 sends everything at time 0.
    pub rate: f64,
}

impl Default for GroupsConfig {
    fn default() -> Self {
        Self {
            groups: 64,
            prompts_per_group: 16,
            system_len: 2048,
            question_len: 128,
            output_tokens: 256,
            rate: 0.0,
        }
    }
}

pub struct GroupsWorkload {
    config: GroupsConfig,
    seed: u64,
    /// `(group, question)` in sending order.
    order: Vec<(u64, u64)>,
    next: usize,
    clock: Micros,
}

impl GroupsWorkload {
    pub fn new(config: GroupsConfig, seed: u64) -> Result<Self, WorkloadError> {
        if config.groups == 0 || config.prompts_per_group == 0 || config.rate < 0.0 || !config.rate.is_finite() {
            return Err(WorkloadError::Invalid {
                kind: "groups",
                message: "groups and prompts_per_group must be at least 1, rate finite and >= 0".into(),
            });
        }
        let mut order: Vec<(u64, u64)> = (0..config.groups)
            .flat_map(|g| (0..config.prompts_per_group).map(move |q| (g, q)))
            .collect();
        // Fisher–Yates with a deterministic stream.
        for i in (1..order.len()).rev() {
            let j = (mix(seed ^ mix(i as u64)) % (i as u64 + 1)) as usize;
            order.swap(i, j);
        }
        Ok(Self {
            config,
            seed,
            order,
            next: 0,
            clock: 0,
        })
    }
}

impl Workload for GroupsWorkload {
    fn next_arrival(&mut self) -> Option<SimRequest> {
        let &(group, question) = self.order.get(self.next)?;
        let id = self.next as u64;
        self.next += 1;
        if self.config.rate > 0.0 && id > 0 {
            // Exponential inter-arrival time from a uniform in (0, 1].
            let u = ((mix(self.seed ^ 0xA11C_E5ED ^ mix(id)) >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
            self.clock += to_micros(-u.ln() / self.config.rate);
        }
        let mut tokens = tokens::sequence(self.seed, Namespace::SystemPrompt, group, self.config.system_len);
        let question_id = group * self.config.prompts_per_group + question;
        tokens::extend(
            &mut tokens,
            self.seed,
            Namespace::Question,
            question_id,
            self.config.question_len,
        );
        Some(SimRequest {
            id,
            arrival: self.clock,
            tokens,
            output_tokens: self.config.output_tokens,
            group,
            session: group,
            named_session: false,
            tool_call: false,
        })
    }

    fn on_finish(&mut self, _finished: &SimRequest, _output: &[u32], _now: Micros) -> Vec<SimRequest> {
        Vec::new()
    }

    fn expected_requests(&self) -> Option<u64> {
        Some(self.order.len() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_prompt_once_sharing_its_group_prefix() {
        let config = GroupsConfig {
            groups: 3,
            prompts_per_group: 4,
            system_len: 10,
            question_len: 5,
            rate: 2.0,
            ..GroupsConfig::default()
        };
        let mut w = GroupsWorkload::new(config, 1).unwrap();
        assert_eq!(w.expected_requests(), Some(12));
        let all: Vec<SimRequest> = std::iter::from_fn(|| w.next_arrival()).collect();
        assert_eq!(all.len(), 12);
        assert!(all.windows(2).all(|p| p[0].arrival <= p[1].arrival));
        assert!(all.last().unwrap().arrival > 0);
        for a in &all {
            for b in &all {
                assert_eq!(a.group == b.group, a.tokens[..10] == b.tokens[..10]);
                assert_eq!(a.id == b.id, a.tokens == b.tokens);
            }
        }
        let groups: Vec<u64> = all.iter().map(|r| r.group).collect();
        assert_ne!(
            groups,
            {
                let mut s = groups.clone();
                s.sort();
                s
            },
            "shuffled"
        );
    }
}
