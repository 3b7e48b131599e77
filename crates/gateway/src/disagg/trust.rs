//! What the decode sidecar takes from whoever reaches its port, and what it does not: the prefill endpoints a
//! request may name (`--prefill-allow`), a client's pairing fields, its secrets, and how much of a prefill
//! server's error it reflects ([`crate::disagg::sidecar`] applies these).

use std::borrow::Cow;
use std::net::{IpAddr, SocketAddr};

use bytes::Bytes;
use serde_json::value::RawValue;

use crate::common::error::ApiError;

/// The most of a prefill server's error answer passed to the client.
pub const MAX_REFLECTED_BYTES: usize = 4 << 10;

/// One entry of `--prefill-allow`: an address (`ip:port`), an IP (any port), or a network (CIDR).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillAllow {
    Address(SocketAddr),
    Net(ipnet::IpNet),
}

impl PrefillAllow {
    /// Parses `10.0.0.5:8000`, `[fd00::1]:80`, `10.0.0.5`, `fd00::1` or `10.0.0.0/16`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if let Ok(address) = text.parse::<SocketAddr>() {
            return Ok(PrefillAllow::Address(address));
        }
        if let Ok(ip) = text.trim_matches(['[', ']']).parse::<IpAddr>() {
            return Ok(PrefillAllow::Net(ipnet::IpNet::from(ip)));
        }
        text.parse::<ipnet::IpNet>()
            .map(|net| PrefillAllow::Net(net.trunc()))
            .map_err(|_| format!("{text:?} is not an address (ip:port), an IP or a network (CIDR)"))
    }

    pub fn allows(&self, address: SocketAddr) -> bool {
        match self {
            PrefillAllow::Address(a) => *a == address,
            PrefillAllow::Net(net) => net.contains(&address.ip()),
        }
    }
}

/// Whether a bootstrap host (a JSON string) names `ip`.
pub fn names_ip(host: &RawValue, ip: IpAddr) -> bool {
    serde_json::from_str::<Cow<'_, str>>(host.get())
        .ok()
        .and_then(|h| h.trim_matches(['[', ']']).parse::<IpAddr>().ok())
        == Some(ip)
}

/// A POST body that goes to the decode server alone, without the members that steer a KV transfer
/// ([`dprouter_core::request_body::DISAGGREGATION_FIELDS`]): only a picker pairs legs, through the prefill
/// header. An empty body goes as it came; one that is not a JSON object is refused.
pub fn without_pairing_fields(bytes: Bytes) -> Result<Bytes, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(bytes);
    }
    let members: Members<'_> = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::BadRequest(format!("the request body is not a JSON object: {e}")))?;
    let pairing = |key: &str| dprouter_core::request_body::DISAGGREGATION_FIELDS.contains(&key);
    if !members.0.iter().any(|(key, _)| pairing(key)) {
        return Ok(bytes);
    }
    crate::observe::refusals::refused("client_field", || {
        "a request's kv_transfer_params or bootstrap fields dropped: only a picker pairs the legs".to_string()
    });
    let mut out = Vec::with_capacity(bytes.len());
    out.push(b'{');
    for (key, value) in members.0.iter().filter(|(key, _)| !pairing(key)) {
        if out.len() > 1 {
            out.push(b',');
        }
        out.extend_from_slice(&serde_json::to_vec(key.as_ref()).unwrap_or_default());
        out.push(b':');
        out.extend_from_slice(value.get().as_bytes());
    }
    out.push(b'}');
    Ok(Bytes::from(out))
}

/// A JSON object's members in order, their values as they came.
struct Members<'a>(Vec<(Cow<'a, str>, &'a RawValue)>);

impl<'de> serde::Deserialize<'de> for Members<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = Members<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut out = Vec::new();
                while let Some(entry) = map.next_entry::<Cow<'de, str>, &'de RawValue>()? {
                    out.push(entry);
                }
                Ok(Members(out))
            }
        }
        deserializer.deserialize_map(Visitor)
    }
}
