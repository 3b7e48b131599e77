//! Flow control's settings (`[flow_control]`): when an endpoint counts as saturated, how much may wait in the central
//! queue and for how long, and the priorities of request objectives ([`crate::admission::flow`]).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// `[flow_control]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FlowControlConfig {
    /// Hold requests in the central queue while every endpoint they may use is saturated (off: every request is
    /// routed at once, as before).
    pub enabled: bool,
    /// An endpoint is saturated with this many requests waiting for their first token: those its engine reports
    /// waiting plus those sent since (SGLang's `/get_load`), or the gateway's own count (llm-d's queue depth
    /// threshold, 5).
    pub queue_depth_threshold: u64,
    /// ... or with its KV cache this full (used tokens over capacity, when the engine reports both; llm-d's 0.8).
    pub kv_cache_threshold: f64,
    /// ... or with this many requests in flight (servers with a fixed number of slots); 0: no such bound.
    pub max_in_flight_per_endpoint: u64,
    /// ... or when its engine's last load report is older than this, milliseconds (only for an engine that
    /// reports: a report that stops coming is a busy or a stuck engine; llm-d's 2 s).
    pub staleness_ms: u64,
    /// Requests waiting at once; one more is refused at once (503 with `Retry-After`).
    pub max_queued_requests: usize,
    /// Request body bytes waiting at once; a body that would pass it is refused at once.
    pub max_queued_bytes: usize,
    /// How long a request may wait, milliseconds; then it is answered 503.
    pub queue_timeout_ms: u64,
    /// Per priority band (its priority as a string key, `"-1"`, `"10"`), its own queue timeout.
    pub band_queue_timeout_ms: BTreeMap<String, u64>,
    /// The longest a request waits for the endpoint that holds its prefix while another has room, milliseconds:
    /// when its policy predicts the most of its prompt cached at a saturated endpoint (`cache_aware`), the request
    /// lets others pass until that endpoint has room, or this long from the first time it let one pass, then takes
    /// an endpoint with room (its prefix cold there). Set it near the prefill time of the prefixes you want kept
    /// together: waiting longer costs more than computing them again. 0: never wait.
    pub prefix_wait_ms: u64,
    /// Request objectives (the header `x-gateway-inference-objective`) and their priorities; a negative priority
    /// is sheddable: refused rather than queued while the pool is saturated.
    pub objectives: BTreeMap<String, i32>,
    /// Whether a request without a client key may name its objective. Objectives are the client's word: without
    /// `[[clients]]` anyone may send `x-gateway-inference-objective: critical`. `false`: an unkeyed request's
    /// objective is ignored (priority 0); a keyed client's still lowers its own priority.
    pub trust_unkeyed_objectives: bool,
}

impl Default for FlowControlConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            queue_depth_threshold: 5,
            kv_cache_threshold: 0.8,
            max_in_flight_per_endpoint: 0,
            staleness_ms: 2000,
            max_queued_requests: 1000,
            max_queued_bytes: 256 << 20,
            queue_timeout_ms: 60_000,
            band_queue_timeout_ms: BTreeMap::new(),
            prefix_wait_ms: 500,
            objectives: BTreeMap::new(),
            trust_unkeyed_objectives: true,
        }
    }
}

impl FlowControlConfig {
    /// Checks the values (the millisecond settings are checked with every other's).
    pub fn validate(&self) -> Result<(), String> {
        if self.queue_depth_threshold == 0 {
            return Err("flow_control.queue_depth_threshold must be at least 1".into());
        }
        if !(self.kv_cache_threshold > 0.0 && self.kv_cache_threshold <= 1.0) {
            return Err(format!(
                "flow_control.kv_cache_threshold must be above 0 and at most 1, got {}",
                self.kv_cache_threshold
            ));
        }
        if self.max_queued_requests == 0 || self.max_queued_bytes == 0 {
            return Err("flow_control.max_queued_requests and max_queued_bytes must be at least 1".into());
        }
        for key in self.band_queue_timeout_ms.keys() {
            if key.trim().parse::<i32>().is_err() {
                return Err(format!(
                    "flow_control.band_queue_timeout_ms: {key:?} is not a priority (an integer)"
                ));
            }
        }
        if let Some(name) = self.objectives.keys().find(|n| n.trim().is_empty()) {
            return Err(format!("flow_control.objectives: {name:?} is not a name"));
        }
        Ok(())
    }

    /// The queue timeout of a request of `priority`, milliseconds.
    pub fn timeout_ms(&self, priority: i32) -> u64 {
        self.band_queue_timeout_ms
            .iter()
            .find(|(key, _)| key.trim().parse::<i32>() == Ok(priority))
            .map_or(self.queue_timeout_ms, |(_, ms)| *ms)
    }

    /// The millisecond settings, named, for the config's bound on them.
    pub fn millisecond_settings(&self) -> Vec<(String, u64)> {
        let mut out = vec![
            ("flow_control.staleness_ms".to_string(), self.staleness_ms),
            ("flow_control.queue_timeout_ms".to_string(), self.queue_timeout_ms),
            ("flow_control.prefix_wait_ms".to_string(), self.prefix_wait_ms),
        ];
        for (band, ms) in &self.band_queue_timeout_ms {
            out.push((format!("flow_control.band_queue_timeout_ms.{band}"), *ms));
        }
        out
    }
}
