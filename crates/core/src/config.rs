//! Typed policy configuration.
//!
//! A policy is named by the `policy` tag and configured by the fields of its own struct; an unknown policy name, an
//! unknown field or a value that makes no sense (`block_tokens = 0`, a negative ε, …: [`PolicyConfig::validate`])
//! is an error, never a silent default or clamp. Every way in (TOML, JSON, a command-line spec) deserializes
//! through the same check. In TOML:
//!
//! ```toml
//! [routing]
//! policy = "prefix_match"
//! max_tokens = 4096
//! window_tokens = 256
//! ```

use serde::{Deserialize, Serialize};

use crate::policy::{
    CacheAware, CacheAwareConfig, DynamoKv, DynamoKvConfig, FollowBootstrapRoom, LeastLoaded, LlmD, LlmDConfig, Policy,
    PrefixAffinity, PrefixAffinityConfig, PrefixMatch, Random, RandomConfig, RoundRobin, SmgCacheAware,
    SmgCacheAwareConfig, TotalRequests, TotalTokens,
};
use crate::prefix_key::PrefixWindow;

/// Fields of a policy that has none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoOptions {}

/// One policy and its options. Deserializing validates the options ([`PolicyConfig::validate`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "policy", rename_all = "snake_case", try_from = "UncheckedPolicyConfig")]
pub enum PolicyConfig {
    RoundRobin(NoOptions),
    FollowBootstrapRoom(NoOptions),
    TotalRequests(NoOptions),
    TotalTokens(NoOptions),
    LeastLoaded(NoOptions),
    Random(RandomConfig),
    PrefixMatch(PrefixWindow),
    PrefixAffinity(PrefixAffinityConfig),
    CacheAware(CacheAwareConfig),
    SmgCacheAware(SmgCacheAwareConfig),
    LlmD(LlmDConfig),
    DynamoKv(DynamoKvConfig),
}

/// [`PolicyConfig`] as written, before [`PolicyConfig::validate`].
#[derive(Deserialize)]
#[serde(tag = "policy", rename_all = "snake_case")]
enum UncheckedPolicyConfig {
    RoundRobin(NoOptions),
    FollowBootstrapRoom(NoOptions),
    TotalRequests(NoOptions),
    TotalTokens(NoOptions),
    LeastLoaded(NoOptions),
    Random(RandomConfig),
    PrefixMatch(PrefixWindow),
    PrefixAffinity(PrefixAffinityConfig),
    CacheAware(CacheAwareConfig),
    SmgCacheAware(SmgCacheAwareConfig),
    LlmD(LlmDConfig),
    DynamoKv(DynamoKvConfig),
}

impl TryFrom<UncheckedPolicyConfig> for PolicyConfig {
    type Error = InvalidOption;

    fn try_from(raw: UncheckedPolicyConfig) -> Result<Self, InvalidOption> {
        let config = match raw {
            UncheckedPolicyConfig::RoundRobin(o) => PolicyConfig::RoundRobin(o),
            UncheckedPolicyConfig::FollowBootstrapRoom(o) => PolicyConfig::FollowBootstrapRoom(o),
            UncheckedPolicyConfig::TotalRequests(o) => PolicyConfig::TotalRequests(o),
            UncheckedPolicyConfig::TotalTokens(o) => PolicyConfig::TotalTokens(o),
            UncheckedPolicyConfig::LeastLoaded(o) => PolicyConfig::LeastLoaded(o),
            UncheckedPolicyConfig::Random(o) => PolicyConfig::Random(o),
            UncheckedPolicyConfig::PrefixMatch(o) => PolicyConfig::PrefixMatch(o),
            UncheckedPolicyConfig::PrefixAffinity(o) => PolicyConfig::PrefixAffinity(o),
            UncheckedPolicyConfig::CacheAware(o) => PolicyConfig::CacheAware(o),
            UncheckedPolicyConfig::SmgCacheAware(o) => PolicyConfig::SmgCacheAware(o),
            UncheckedPolicyConfig::LlmD(o) => PolicyConfig::LlmD(o),
            UncheckedPolicyConfig::DynamoKv(o) => PolicyConfig::DynamoKv(o),
        };
        config.validate()?;
        Ok(config)
    }
}

/// The largest `cache_aware` block: a million tokens (any real context fits one block long before that).
pub const MAX_BLOCK_TOKENS: usize = 1 << 20;

/// The most requests `cache_aware`'s `session_turns` may expect of a conversation.
pub const MAX_SESSION_TURNS: u32 = 1_000_000;

/// A policy option whose value makes no sense; the message names the policy and the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{policy}: {field} {message}")]
pub struct InvalidOption {
    pub policy: &'static str,
    pub field: &'static str,
    pub message: String,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig::RoundRobin(NoOptions {})
    }
}

/// An unknown policy name, or options that do not fit the policy. (The cause is in the message, not a `source`,
/// so a chain of errors prints it once.)
#[derive(Debug, thiserror::Error)]
#[error("invalid policy config: {0}")]
pub struct ConfigError(serde_json::Error);

impl From<serde_json::Error> for ConfigError {
    fn from(e: serde_json::Error) -> Self {
        ConfigError(e)
    }
}

impl From<InvalidOption> for ConfigError {
    fn from(e: InvalidOption) -> Self {
        use serde::de::Error;
        ConfigError(serde_json::Error::custom(e))
    }
}

impl PolicyConfig {
    /// Every policy name, in the order the docs list them.
    pub const NAMES: &'static [&'static str] = &[
        "round_robin",
        "follow_bootstrap_room",
        "total_requests",
        "total_tokens",
        "least_loaded",
        "random",
        "prefix_match",
        "prefix_affinity",
        "cache_aware",
        "smg_cache_aware",
        "llm_d",
        "dynamo_kv",
    ];

    /// The peers' methods, ported to compare against ([`crate::policy::peers`]): not in a comparison unless named.
    pub const PEERS: &'static [&'static str] = &["smg_cache_aware", "llm_d", "dynamo_kv"];

    /// The named policy with default options.
    pub fn from_name(name: &str) -> Result<Self, ConfigError> {
        Ok(serde_json::from_value(serde_json::json!({ "policy": name }))?)
    }

    /// A command-line spec, `name` or `name:key=value,...`, as its config object (`{"policy": name, key: value}`).
    /// Values are read as JSON (numbers, booleans) or else taken as strings.
    pub fn spec_object(spec: &str) -> Result<serde_json::Map<String, serde_json::Value>, ConfigError> {
        use serde::de::Error;
        let (name, options) = spec.split_once(':').unwrap_or((spec, ""));
        let mut obj = serde_json::Map::new();
        obj.insert("policy".into(), name.into());
        for option in options.split(',').filter(|o| !o.is_empty()) {
            let (key, value) = option.split_once('=').ok_or_else(|| {
                serde_json::Error::custom(format!("policy option `{option}` must look like key=value"))
            })?;
            let value = serde_json::from_str(value).unwrap_or_else(|_| serde_json::Value::from(value));
            obj.insert(key.into(), value);
        }
        Ok(obj)
    }

    /// The policy of a config object such as [`PolicyConfig::spec_object`] returns.
    pub fn from_object(obj: serde_json::Map<String, serde_json::Value>) -> Result<Self, ConfigError> {
        Ok(serde_json::from_value(serde_json::Value::Object(obj))?)
    }

    /// A policy from a command-line spec (`prefix_affinity:epsilon=0.5,load=requests`).
    pub fn from_spec(spec: &str) -> Result<Self, ConfigError> {
        Self::from_object(Self::spec_object(spec)?)
    }

    /// Rejects options that make no sense, naming the field: zero windows, blocks or capacities, a prefill rate
    /// that is not a positive number, a negative (or NaN) ε, base time or congestion weight. Policies never clamp
    /// such values silently.
    pub fn validate(&self) -> Result<(), InvalidOption> {
        let policy = self.name();
        let fail = |field: &'static str, message: String| Err(InvalidOption { policy, field, message });
        match self {
            PolicyConfig::RoundRobin(_)
            | PolicyConfig::FollowBootstrapRoom(_)
            | PolicyConfig::TotalRequests(_)
            | PolicyConfig::LeastLoaded(_)
            | PolicyConfig::Random(_)
            | PolicyConfig::TotalTokens(_) => {}
            PolicyConfig::PrefixMatch(w) => {
                for (field, value) in [
                    ("max_tokens", w.max_tokens),
                    ("window_tokens", w.window_tokens),
                    ("max_bytes", w.max_bytes),
                    ("window_bytes", w.window_bytes),
                ] {
                    if value == 0 {
                        return fail(field, "must be at least 1, got 0".into());
                    }
                }
                if w.window_tokens > w.max_tokens {
                    return fail(
                        "window_tokens",
                        format!("({}) must be at most max_tokens ({})", w.window_tokens, w.max_tokens),
                    );
                }
                if w.window_bytes > w.max_bytes {
                    return fail(
                        "window_bytes",
                        format!("({}) must be at most max_bytes ({})", w.window_bytes, w.max_bytes),
                    );
                }
            }
            PolicyConfig::PrefixAffinity(c) => {
                for (field, value) in [("key_tokens", c.key_tokens), ("key_bytes", c.key_bytes)] {
                    if value == 0 {
                        return fail(field, "must be at least 1, got 0".into());
                    }
                }
                // +inf is allowed: no bound, pure affinity.
                if c.epsilon.is_nan() || c.epsilon < 0.0 {
                    return fail("epsilon", format!("must be at least 0, got {}", c.epsilon));
                }
            }
            PolicyConfig::CacheAware(c) => {
                if !(1..=MAX_BLOCK_TOKENS).contains(&c.block_tokens) {
                    return fail(
                        "block_tokens",
                        format!("must be between 1 and {MAX_BLOCK_TOKENS}, got {}", c.block_tokens),
                    );
                }
                if c.kv_capacity_tokens < c.block_tokens as u64 {
                    return fail(
                        "kv_capacity_tokens",
                        format!(
                            "({}) must be at least block_tokens ({}): the index holds whole blocks",
                            c.kv_capacity_tokens, c.block_tokens
                        ),
                    );
                }
                if !(c.prefill_tokens_per_s.is_finite() && c.prefill_tokens_per_s > 0.0) {
                    return fail(
                        "prefill_tokens_per_s",
                        format!("must be a positive number, got {}", c.prefill_tokens_per_s),
                    );
                }
                for (field, value) in [
                    ("base_ms", c.base_ms),
                    ("congestion_weight", c.congestion_weight),
                    ("eviction_weight", c.eviction_weight),
                    ("recent_epsilon", c.recent_epsilon),
                    ("cold_tolerance_ms", c.cold_tolerance_ms),
                    ("pause_weight", c.pause_weight),
                    ("session_home_margin_ms", c.session_home_margin_ms),
                ] {
                    if !(value.is_finite() && value >= 0.0) {
                        return fail(field, format!("must be a finite number at least 0, got {value}"));
                    }
                }
                if !(0.0..=1.0).contains(&c.prefill_contention) {
                    return fail(
                        "prefill_contention",
                        format!("must be from 0 to 1, got {}", c.prefill_contention),
                    );
                }
                if c.session_turns > MAX_SESSION_TURNS {
                    return fail(
                        "session_turns",
                        format!("must be at most {MAX_SESSION_TURNS}, got {}", c.session_turns),
                    );
                }
                if !(c.recent_half_life_s.is_finite() && c.recent_half_life_s > 0.0) {
                    return fail(
                        "recent_half_life_s",
                        format!("must be a positive number of seconds, got {}", c.recent_half_life_s),
                    );
                }
            }
            PolicyConfig::SmgCacheAware(c) => {
                if !(0.0..=1.0).contains(&c.cache_threshold) {
                    return fail(
                        "cache_threshold",
                        format!("must be from 0 to 1, got {}", c.cache_threshold),
                    );
                }
                for (field, value) in [
                    ("balance_rel_threshold", c.balance_rel_threshold),
                    ("eviction_interval_secs", c.eviction_interval_secs),
                ] {
                    if !(value.is_finite() && value >= 0.0) {
                        return fail(field, format!("must be a finite number at least 0, got {value}"));
                    }
                }
                if c.max_tree_size == 0 {
                    return fail("max_tree_size", "must be at least 1, got 0".into());
                }
            }
            PolicyConfig::LlmD(c) => {
                if !(1..=MAX_BLOCK_TOKENS).contains(&c.block_tokens) {
                    return fail(
                        "block_tokens",
                        format!("must be between 1 and {MAX_BLOCK_TOKENS}, got {}", c.block_tokens),
                    );
                }
                for (field, value) in [
                    ("max_prefix_blocks", c.max_prefix_blocks),
                    ("lru_capacity_per_server", c.lru_capacity_per_server),
                ] {
                    if value == 0 {
                        return fail(field, "must be at least 1, got 0".into());
                    }
                }
                for (field, value) in [
                    ("prefix_weight", c.prefix_weight),
                    ("queue_weight", c.queue_weight),
                    ("kv_weight", c.kv_weight),
                ] {
                    if !(value.is_finite() && value >= 0.0) {
                        return fail(field, format!("must be a finite number at least 0, got {value}"));
                    }
                }
            }
            PolicyConfig::DynamoKv(c) => {
                if !(1..=MAX_BLOCK_TOKENS).contains(&c.block_tokens) {
                    return fail(
                        "block_tokens",
                        format!("must be between 1 and {MAX_BLOCK_TOKENS}, got {}", c.block_tokens),
                    );
                }
                if !(c.overlap_score_weight.is_finite() && c.overlap_score_weight >= 0.0) {
                    return fail(
                        "overlap_score_weight",
                        format!("must be a finite number at least 0, got {}", c.overlap_score_weight),
                    );
                }
                if !(c.ttl_secs.is_finite() && c.ttl_secs > 0.0) {
                    return fail(
                        "ttl_secs",
                        format!("must be a positive number of seconds, got {}", c.ttl_secs),
                    );
                }
                if c.max_tree_blocks == 0 {
                    return fail("max_tree_blocks", "must be at least 1, got 0".into());
                }
            }
        }
        Ok(())
    }

    pub fn name(&self) -> &'static str {
        match self {
            PolicyConfig::RoundRobin(_) => "round_robin",
            PolicyConfig::FollowBootstrapRoom(_) => "follow_bootstrap_room",
            PolicyConfig::TotalRequests(_) => "total_requests",
            PolicyConfig::TotalTokens(_) => "total_tokens",
            PolicyConfig::LeastLoaded(_) => "least_loaded",
            PolicyConfig::Random(_) => "random",
            PolicyConfig::PrefixMatch(_) => "prefix_match",
            PolicyConfig::PrefixAffinity(_) => "prefix_affinity",
            PolicyConfig::CacheAware(_) => "cache_aware",
            PolicyConfig::SmgCacheAware(_) => "smg_cache_aware",
            PolicyConfig::LlmD(_) => "llm_d",
            PolicyConfig::DynamoKv(_) => "dynamo_kv",
        }
    }

    /// A fresh policy instance (its own counters).
    pub fn build(&self) -> Box<dyn Policy> {
        match self {
            PolicyConfig::RoundRobin(_) => Box::new(RoundRobin::default()),
            PolicyConfig::FollowBootstrapRoom(_) => Box::new(FollowBootstrapRoom),
            PolicyConfig::TotalRequests(_) => Box::new(TotalRequests),
            PolicyConfig::TotalTokens(_) => Box::new(TotalTokens),
            PolicyConfig::LeastLoaded(_) => Box::new(LeastLoaded::default()),
            PolicyConfig::Random(config) => Box::new(Random::new(*config)),
            PolicyConfig::PrefixMatch(window) => Box::new(PrefixMatch::new(*window)),
            PolicyConfig::PrefixAffinity(config) => Box::new(PrefixAffinity::new(*config)),
            PolicyConfig::CacheAware(config) => Box::new(CacheAware::new(*config)),
            PolicyConfig::SmgCacheAware(config) => Box::new(SmgCacheAware::new(*config)),
            PolicyConfig::LlmD(config) => Box::new(LlmD::new(*config)),
            PolicyConfig::DynamoKv(config) => Box::new(DynamoKv::new(*config)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_builds_a_policy_of_that_name() {
        for name in PolicyConfig::NAMES {
            let config = PolicyConfig::from_name(name).unwrap();
            assert_eq!(config.name(), *name);
            assert_eq!(config.build().name(), *name);
        }
    }

    #[test]
    fn command_line_specs_carry_typed_options() {
        assert_eq!(
            PolicyConfig::from_spec("prefix_affinity:epsilon=1,load=requests").unwrap(),
            PolicyConfig::PrefixAffinity(PrefixAffinityConfig {
                epsilon: 1.0,
                load: crate::policy::AffinityLoad::Requests,
                ..PrefixAffinityConfig::default()
            })
        );
        assert_eq!(
            PolicyConfig::from_spec("round_robin").unwrap(),
            PolicyConfig::from_name("round_robin").unwrap()
        );
        for bad in ["cache_aware:block_tokens", "cache_aware:nope=1", "round_robin:x=1"] {
            assert!(PolicyConfig::from_spec(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn senseless_option_values_are_errors_naming_the_field() {
        for (spec, field) in [
            ("cache_aware:block_tokens=0", "block_tokens"),
            ("cache_aware:block_tokens=2000000", "block_tokens"),
            ("cache_aware:kv_capacity_tokens=0", "kv_capacity_tokens"),
            (
                "cache_aware:block_tokens=64,kv_capacity_tokens=63",
                "kv_capacity_tokens",
            ),
            ("cache_aware:prefill_tokens_per_s=0", "prefill_tokens_per_s"),
            ("cache_aware:prefill_tokens_per_s=-1", "prefill_tokens_per_s"),
            ("cache_aware:base_ms=-0.5", "base_ms"),
            ("cache_aware:prefill_contention=1.5", "prefill_contention"),
            ("cache_aware:session_turns=1000001", "session_turns"),
            ("cache_aware:congestion_weight=-1", "congestion_weight"),
            ("cache_aware:eviction_weight=-1", "eviction_weight"),
            ("cache_aware:recent_half_life_s=0", "recent_half_life_s"),
            ("cache_aware:recent_epsilon=-0.1", "recent_epsilon"),
            ("prefix_affinity:epsilon=-0.1", "epsilon"),
            ("prefix_affinity:key_tokens=0", "key_tokens"),
            ("prefix_affinity:key_bytes=0", "key_bytes"),
            ("prefix_match:window_tokens=0", "window_tokens"),
            ("prefix_match:window_bytes=0", "window_bytes"),
            ("prefix_match:max_tokens=0", "max_tokens"),
            ("prefix_match:max_bytes=0", "max_bytes"),
            ("prefix_match:max_tokens=128", "window_tokens"),
        ] {
            let err = PolicyConfig::from_spec(spec).unwrap_err().to_string();
            let policy = spec.split(':').next().unwrap();
            assert!(err.contains(&format!("{policy}: {field} ")), "{spec}: {err}");
        }
        // The same check guards every way in: JSON objects, and values JSON cannot carry.
        let err = serde_json::from_str::<PolicyConfig>(r#"{"policy": "cache_aware", "block_tokens": 0}"#).unwrap_err();
        assert!(err.to_string().contains("block_tokens"), "{err}");
        for (config, field) in [
            (
                PolicyConfig::CacheAware(CacheAwareConfig {
                    prefill_tokens_per_s: f64::NAN,
                    ..CacheAwareConfig::default()
                }),
                "prefill_tokens_per_s",
            ),
            (
                PolicyConfig::CacheAware(CacheAwareConfig {
                    prefill_tokens_per_s: f64::INFINITY,
                    ..CacheAwareConfig::default()
                }),
                "prefill_tokens_per_s",
            ),
            (
                PolicyConfig::CacheAware(CacheAwareConfig {
                    base_ms: f64::INFINITY,
                    ..CacheAwareConfig::default()
                }),
                "base_ms",
            ),
            (
                PolicyConfig::PrefixAffinity(PrefixAffinityConfig {
                    epsilon: f64::NAN,
                    ..PrefixAffinityConfig::default()
                }),
                "epsilon",
            ),
        ] {
            assert_eq!(config.validate().unwrap_err().field, field, "{config:?}");
        }
        // Edge values that do make sense stay accepted.
        for spec in [
            "cache_aware:block_tokens=1,kv_capacity_tokens=1,base_ms=0,congestion_weight=0",
            "prefix_affinity:epsilon=0",
            "prefix_match:max_tokens=1,window_tokens=1,max_bytes=1,window_bytes=1",
        ] {
            assert!(PolicyConfig::from_spec(spec).is_ok(), "{spec}");
        }
        let unbounded = PolicyConfig::PrefixAffinity(PrefixAffinityConfig {
            epsilon: f64::INFINITY,
            ..PrefixAffinityConfig::default()
        });
        assert!(unbounded.validate().is_ok(), "an infinite epsilon is no bound");
        for name in PolicyConfig::NAMES {
            assert!(
                PolicyConfig::from_name(name).unwrap().validate().is_ok(),
                "{name}'s defaults"
            );
        }
    }

    #[test]
    fn an_error_carries_its_cause_in_the_message_only() {
        let err = PolicyConfig::from_spec("cache_aware:nope=1").unwrap_err();
        assert!(std::error::Error::source(&err).is_none());
        assert!(err.to_string().contains("nope"), "{err}");
    }

    #[test]
    fn unknown_policy_is_an_error_naming_the_choices() {
        let err = PolicyConfig::from_name("least_latency").unwrap_err().to_string();
        assert!(err.contains("least_latency") && err.contains("prefix_match"), "{err}");
    }

    #[test]
    fn options_are_typed_and_unknown_fields_rejected() {
        let config: PolicyConfig = serde_json::from_str(r#"{"policy": "prefix_match", "max_tokens": 1024}"#).unwrap();
        assert_eq!(
            config,
            PolicyConfig::PrefixMatch(PrefixWindow {
                max_tokens: 1024,
                ..PrefixWindow::default()
            })
        );
        let err = serde_json::from_str::<PolicyConfig>(r#"{"policy": "prefix_match", "max_token": 1}"#);
        assert!(err.unwrap_err().to_string().contains("max_token"));
        let err = serde_json::from_str::<PolicyConfig>(r#"{"policy": "round_robin", "window_tokens": 1}"#);
        assert!(err.is_err());
        let config: PolicyConfig =
            serde_json::from_str(r#"{"policy": "prefix_affinity", "epsilon": 0.5, "load": "requests"}"#).unwrap();
        assert_eq!(
            config,
            PolicyConfig::PrefixAffinity(PrefixAffinityConfig {
                epsilon: 0.5,
                load: crate::policy::AffinityLoad::Requests,
                ..PrefixAffinityConfig::default()
            })
        );
        let config: PolicyConfig = serde_json::from_str(r#"{"policy": "cache_aware", "block_tokens": 32}"#).unwrap();
        assert!(matches!(config, PolicyConfig::CacheAware(c) if c.block_tokens == 32 && c.base_ms == 25.0));
        for bad in [
            r#"{"policy": "cache_aware", "block": 32}"#,
            r#"{"policy": "prefix_affinity", "load": "tokens"}"#,
        ] {
            assert!(serde_json::from_str::<PolicyConfig>(bad).is_err(), "{bad}");
        }
    }
}
