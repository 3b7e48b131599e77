//! Typed policy configuration.
//!
//! A policy is named by the `policy` tag and configured by the fields of its own struct; an unknown policy name or
//! an unknown field is an error, never a silent default. In TOML:
//!
//! ```toml
//! [routing]
//! policy = "prefix_match"
//! max_tokens = 4096
//! window_tokens = 256
//! ```

use serde::{Deserialize, Serialize};

use crate::policy::{
    CacheAware, CacheAwareConfig, FollowBootstrapRoom, Policy, PrefixAffinity, PrefixAffinityConfig, PrefixMatch,
    RoundRobin, TotalRequests, TotalTokens,
};
use crate::prefix_key::PrefixWindow;

/// Fields of a policy that has none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NoOptions {}

/// One policy and its options.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "policy", rename_all = "snake_case")]
pub enum PolicyConfig {
    RoundRobin(NoOptions),
    FollowBootstrapRoom(NoOptions),
    TotalRequests(NoOptions),
    TotalTokens(NoOptions),
    PrefixMatch(PrefixWindow),
    PrefixAffinity(PrefixAffinityConfig),
    CacheAware(CacheAwareConfig),
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig::RoundRobin(NoOptions {})
    }
}

/// An unknown policy name, or options that do not fit the policy.
#[derive(Debug, thiserror::Error)]
#[error("invalid policy config: {0}")]
pub struct ConfigError(#[from] serde_json::Error);

impl PolicyConfig {
    /// Every policy name, in the order the docs list them.
    pub const NAMES: &'static [&'static str] = &[
        "round_robin",
        "follow_bootstrap_room",
        "total_requests",
        "total_tokens",
        "prefix_match",
        "prefix_affinity",
        "cache_aware",
    ];

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

    pub fn name(&self) -> &'static str {
        match self {
            PolicyConfig::RoundRobin(_) => "round_robin",
            PolicyConfig::FollowBootstrapRoom(_) => "follow_bootstrap_room",
            PolicyConfig::TotalRequests(_) => "total_requests",
            PolicyConfig::TotalTokens(_) => "total_tokens",
            PolicyConfig::PrefixMatch(_) => "prefix_match",
            PolicyConfig::PrefixAffinity(_) => "prefix_affinity",
            PolicyConfig::CacheAware(_) => "cache_aware",
        }
    }

    /// A fresh policy instance (its own counters).
    pub fn build(&self) -> Box<dyn Policy> {
        match self {
            PolicyConfig::RoundRobin(_) => Box::new(RoundRobin::default()),
            PolicyConfig::FollowBootstrapRoom(_) => Box::new(FollowBootstrapRoom),
            PolicyConfig::TotalRequests(_) => Box::new(TotalRequests),
            PolicyConfig::TotalTokens(_) => Box::new(TotalTokens),
            PolicyConfig::PrefixMatch(window) => Box::new(PrefixMatch::new(*window)),
            PolicyConfig::PrefixAffinity(config) => Box::new(PrefixAffinity::new(*config)),
            PolicyConfig::CacheAware(config) => Box::new(CacheAware::new(*config)),
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
