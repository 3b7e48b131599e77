//! The gateway's clients as the config file names them (`[[clients]]`): each an API key kept as its SHA-256
//! digest, a name, a default priority, the models it may use, its rate limits and whether it may pin a rank
//! (`docs/operations.md`, "Clients and keys"). [`crate::admission::clients`] serves them.

use serde::{Deserialize, Serialize};

/// One client.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClientConfig {
    /// Who the client is: its fairness id, and its label in metrics and logs.
    pub name: String,
    /// The SHA-256 digest of its API key, 64 hex digits (`printf %s "$KEY" | sha256sum`): the key itself is
    /// never written down.
    pub key_sha256: String,
    /// Its requests' priority (higher first; negative: sheddable).
    pub priority: i32,
    /// The models it may ask for (as it names them); empty: any.
    pub models: Vec<String>,
    /// Requests per second, a token bucket holding `burst` (default: one second's worth, at least 1); unset: no
    /// limit.
    pub requests_per_second: Option<f64>,
    pub burst: Option<u32>,
    /// Prompt tokens per minute, a token bucket holding one minute's worth; unset: no limit.
    pub prompt_tokens_per_minute: Option<u32>,
    /// Whether its requests may pin a DP rank (`routed_dp_rank`, `X-Data-Parallel-Rank`): a pin passes the
    /// balancer by, so keyed clients may not unless allowed.
    pub allow_pins: bool,
}

impl ClientConfig {
    /// The key's digest as bytes, if it is 64 hex digits.
    pub fn digest(&self) -> Option<[u8; 32]> {
        let hex = self.key_sha256.trim().as_bytes();
        if hex.len() != 64 || !hex.iter().all(u8::is_ascii_hexdigit) {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, pair) in hex.chunks(2).enumerate() {
            let text = std::str::from_utf8(pair).ok()?;
            out[i] = u8::from_str_radix(text, 16).ok()?;
        }
        Some(out)
    }
}

/// Checks a list of clients: names and digests present, well formed and unique, limits positive.
pub fn validate_clients(clients: &[ClientConfig]) -> Result<(), String> {
    let mut names = std::collections::HashSet::new();
    let mut digests = std::collections::HashSet::new();
    for c in clients {
        if c.name.trim().is_empty() {
            return Err("every [[clients]] entry needs a name".into());
        }
        let who = &c.name;
        if !names.insert(c.name.as_str()) {
            return Err(format!("client `{who}` is listed twice"));
        }
        let digest = c.digest().ok_or_else(|| {
            format!("client `{who}`: key_sha256 must be 64 hex digits (`printf %s \"$KEY\" | sha256sum`)")
        })?;
        if !digests.insert(digest) {
            return Err(format!("client `{who}` has the key of another client"));
        }
        if c.models.iter().any(|m| m.trim().is_empty()) {
            return Err(format!("client `{who}`: a model name is empty"));
        }
        if let Some(rate) = c.requests_per_second {
            if !(rate.is_finite() && (1e-6..=1e6).contains(&rate)) {
                return Err(format!(
                    "client `{who}`: requests_per_second must be from 0.000001 to 1,000,000, got {rate}"
                ));
            }
        }
        if c.burst == Some(0) || (c.burst.is_some() && c.requests_per_second.is_none()) {
            return Err(format!(
                "client `{who}`: burst must be at least 1, beside requests_per_second"
            ));
        }
        if c.prompt_tokens_per_minute == Some(0) {
            return Err(format!("client `{who}`: prompt_tokens_per_minute must be at least 1"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client(name: &str, digest: &str) -> ClientConfig {
        ClientConfig {
            name: name.into(),
            key_sha256: digest.into(),
            ..Default::default()
        }
    }

    const A: &str = "2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae";
    const B: &str = "fcde2b2edba56bf408601fb721fe9b5c338d10ee429ea04fae5511b68fbf8fb9";

    #[test]
    fn digests_are_64_hex_digits() {
        assert_eq!(client("a", A).digest().unwrap()[..2], [0x2c, 0x26]);
        for bad in [
            "",
            "2c26",
            &A[..63],
            &format!("{}g", &A[..63]),
            &format!("{A}00"),
            &format!("+a{}", &A[2..]),
        ] {
            assert!(client("a", bad).digest().is_none(), "{bad}");
        }
    }

    #[test]
    fn names_and_keys_are_unique_and_limits_positive() {
        assert!(validate_clients(&[client("a", A), client("b", B)]).is_ok());
        let twice = validate_clients(&[client("a", A), client("a", B)]).unwrap_err();
        assert!(twice.contains("listed twice"), "{twice}");
        let shared = validate_clients(&[client("a", A), client("b", A)]).unwrap_err();
        assert!(shared.contains("key of another"), "{shared}");
        assert!(validate_clients(&[client("", A)]).is_err());
        assert!(validate_clients(&[client("a", "secret")])
            .unwrap_err()
            .contains("sha256sum"));
        for rate in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let c = ClientConfig {
                requests_per_second: Some(rate),
                ..client("a", A)
            };
            assert!(validate_clients(&[c]).is_err(), "{rate}");
        }
        let no_rate = ClientConfig {
            burst: Some(5),
            ..client("a", A)
        };
        assert!(validate_clients(&[no_rate]).is_err());
        let no_tokens = ClientConfig {
            prompt_tokens_per_minute: Some(0),
            ..client("a", A)
        };
        assert!(validate_clients(&[no_tokens]).is_err());
    }
}
