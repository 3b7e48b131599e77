//! Closed-loop agent workloads: a [`Plan`] of steps, each a request sent once the steps it waits for have
//! completed, plus its own wait (a tool running, a user thinking).
//!
//! Two sources build plans: agentic Mooncake rows read from a file ([`rows`], Dynamo's format: `wait_for`,
//! `session_id`, `delay`, `tool_wait_ms`), and the `agentic:` generator ([`generator`]: programs whose main agent's
//! turns grow by each tool result, subagents forked with their own prompts and joined back). [`PlanWorkload`]
//! runs either: the steps that wait for nothing arrive open loop at their times; every other step is released by
//! [`Workload::on_finish`] of the last step it waits for, at that completion plus its wait. A step may continue a
//! finished step's conversation (its prompt and the answer the engine gave, token for token, as an agent's next
//! turn does); that conversation is kept only until every step continuing it has been released.
//!
//! Cost: O(steps) memory for the plan, plus the conversations still to be continued; O(prompt) per release.

use std::collections::HashMap;

use crate::cost::Micros;
use crate::tokens::{self, Namespace};
use crate::workload::{SimRequest, Workload, WorkloadError};

pub mod generator;
pub mod rows;

/// `len` tokens of sequence `id` in `ns` ([`tokens::extend`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    pub ns: Namespace,
    pub id: u64,
    pub len: usize,
}

/// One request of a plan.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    /// How errors name it (a row's `request_id`).
    pub name: String,
    pub session: u64,
    /// Steps of one group share a prefix (an application's system prompt and tools).
    pub group: u64,
    /// The client names its session ([`SimRequest::named_session`]).
    pub named_session: bool,
    /// The steps that must all complete before this one is sent (indices into the plan).
    pub after: Vec<usize>,
    /// With `after`: how long after the last of them completes it is sent. Without: when it arrives.
    pub wait: Micros,
    /// Its prompt starts with this step's conversation (its prompt, then its answer); the step must be in `after`.
    pub continues: Option<usize>,
    /// Then these tokens.
    pub parts: Vec<Part>,
    pub output_tokens: u32,
}

/// Steps in any order; [`Plan::check`] finds a missing parent or a cycle.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Plan {
    pub steps: Vec<Step>,
}

impl Plan {
    /// Each step's `after` and `continues` name steps of the plan, a continued step is waited for, and no step
    /// waits for itself through others. `kind` names the workload in the error. O(steps + edges).
    pub fn check(&self, kind: &'static str) -> Result<(), WorkloadError> {
        let invalid = |message: String| WorkloadError::Invalid { kind, message };
        let n = self.steps.len();
        let mut pending = vec![0usize; n];
        let mut dependents: Vec<Vec<usize>> = vec![Vec::new(); n];
        for (i, step) in self.steps.iter().enumerate() {
            if let Some(c) = step.continues.filter(|c| !step.after.contains(c)) {
                return Err(invalid(format!(
                    "request `{}` continues step {c}, which it does not wait for",
                    step.name
                )));
            }
            for &p in &step.after {
                if p >= n {
                    return Err(invalid(format!("request `{}` waits for a missing request", step.name)));
                }
                pending[i] += 1;
                dependents[p].push(i);
            }
        }
        // Kahn's algorithm: whatever is never released lies on a cycle or after one.
        let mut ready: Vec<usize> = (0..n).filter(|&i| pending[i] == 0).collect();
        let mut released = 0;
        while let Some(i) = ready.pop() {
            released += 1;
            for &d in &dependents[i] {
                pending[d] -= 1;
                if pending[d] == 0 {
                    ready.push(d);
                }
            }
        }
        if released < n {
            let stuck = (0..n).find(|&i| pending[i] > 0).unwrap_or(0);
            return Err(invalid(format!(
                "request `{}` waits for itself: its `wait_for` chain has a cycle",
                self.steps[stuck].name
            )));
        }
        Ok(())
    }
}

/// Runs a checked [`Plan`] closed loop; see the module documentation.
pub struct PlanWorkload {
    steps: Vec<Step>,
    seed: u64,
    /// Steps that wait for nothing, latest first (popped from the end).
    roots: Vec<usize>,
    /// Per step: the steps it waits for that have not completed yet.
    pending: Vec<u32>,
    /// Per step: when the last of its completed parents completed.
    ready_at: Vec<Micros>,
    dependents: Vec<Vec<usize>>,
    /// Per step: the steps not yet released that continue its conversation.
    continuations: Vec<u32>,
    /// The conversations (prompt, then answer) that released steps will still continue.
    kept: HashMap<usize, Vec<u32>>,
}

impl PlanWorkload {
    pub fn new(plan: Plan, seed: u64, kind: &'static str) -> Result<Self, WorkloadError> {
        plan.check(kind)?;
        let n = plan.steps.len();
        let mut dependents = vec![Vec::new(); n];
        let mut continuations = vec![0u32; n];
        let mut pending = vec![0u32; n];
        for (i, step) in plan.steps.iter().enumerate() {
            pending[i] = step.after.len() as u32;
            for &p in &step.after {
                dependents[p].push(i);
            }
            if let Some(c) = step.continues {
                continuations[c] += 1;
            }
        }
        let mut roots: Vec<usize> = (0..n).filter(|&i| plan.steps[i].after.is_empty()).collect();
        roots.sort_by_key(|&i| std::cmp::Reverse((plan.steps[i].wait, i)));
        Ok(Self {
            steps: plan.steps,
            seed,
            roots,
            pending,
            ready_at: vec![0; n],
            dependents,
            continuations,
            kept: HashMap::new(),
        })
    }

    fn request(&mut self, i: usize, arrival: Micros) -> SimRequest {
        let step = &self.steps[i];
        let mut tokens = match step.continues {
            Some(c) => {
                self.continuations[c] -= 1;
                if self.continuations[c] == 0 {
                    self.kept.remove(&c).unwrap_or_default()
                } else {
                    self.kept.get(&c).cloned().unwrap_or_default()
                }
            }
            None => Vec::new(),
        };
        for part in &step.parts {
            tokens::extend(&mut tokens, self.seed, part.ns, part.id, part.len);
        }
        SimRequest {
            id: i as u64,
            arrival,
            tokens,
            output_tokens: step.output_tokens.max(1),
            group: step.group,
            session: step.session,
            named_session: step.named_session,
            // Something waits for its answer: the agent's next turn after a tool, or its subagents.
            tool_call: !self.dependents[i].is_empty(),
        }
    }
}

impl Workload for PlanWorkload {
    fn next_arrival(&mut self) -> Option<SimRequest> {
        let i = self.roots.pop()?;
        let at = self.steps[i].wait;
        Some(self.request(i, at))
    }

    fn on_finish(&mut self, finished: &SimRequest, output: &[u32], now: Micros) -> Vec<SimRequest> {
        let i = finished.id as usize;
        if i >= self.steps.len() {
            return Vec::new();
        }
        if self.continuations[i] > 0 {
            let mut conversation = Vec::with_capacity(finished.tokens.len() + output.len());
            conversation.extend_from_slice(&finished.tokens);
            conversation.extend_from_slice(output);
            self.kept.insert(i, conversation);
        }
        let mut released = Vec::new();
        for d in std::mem::take(&mut self.dependents[i]) {
            self.pending[d] -= 1;
            self.ready_at[d] = self.ready_at[d].max(now);
            if self.pending[d] == 0 {
                let at = self.ready_at[d].saturating_add(self.steps[d].wait);
                released.push(self.request(d, at));
            }
        }
        released
    }

    fn expected_requests(&self) -> Option<u64> {
        Some(self.steps.len() as u64)
    }
}

#[cfg(test)]
#[path = "tests.rs"]
mod tests;
