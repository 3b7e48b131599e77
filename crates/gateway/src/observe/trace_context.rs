//! The client's trace context, passed on to the engine: W3C Trace Context's `traceparent` and `tracestate` and W3C
//! Baggage's `baggage`, so that an engine that traces (vLLM's `--otlp-traces-endpoint`, SGLang) joins the caller's
//! trace instead of starting an orphan one. With tracing on, the engine's `traceparent` names the gateway's own span
//! of the attempt instead ([`crate::observe::spans`]), in the same trace.
//!
//! As the specifications ask of a party in the middle: a `traceparent` that does not parse is dropped, and its
//! `tracestate` with it (a `tracestate` means nothing without its parent); one of a later version is passed on in
//! version `00`, its known fields kept; `tracestate` and `baggage` sent in several header lines are joined with
//! commas into one (RFC 9110), and dropped past the sizes the specifications bound them by.

use axum::http::{HeaderMap, HeaderName, HeaderValue};

pub const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
pub const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");
pub const BAGGAGE: HeaderName = HeaderName::from_static("baggage");

/// The most of `tracestate` passed on: 32 list members of at most 256 characters each, with their commas.
const MAX_TRACESTATE_BYTES: usize = 32 * 257;
/// The most of `baggage` passed on (W3C Baggage: 8,192 bytes).
const MAX_BAGGAGE_BYTES: usize = 8192;

/// The trace context headers to send the engine for a request that came with `headers`; with `own`, the
/// gateway's span (tracing on: [`crate::observe::spans`]) is the engine's parent instead of the client's.
pub fn propagated(headers: &HeaderMap, own: Option<HeaderValue>) -> Vec<(HeaderName, HeaderValue)> {
    let mut out = Vec::new();
    let parent = single(headers, &TRACEPARENT).and_then(traceparent);
    let client_state = parent.is_some().then(|| tracestate(headers)).flatten();
    if let Some(parent) = own.or(parent) {
        out.push((TRACEPARENT, parent));
        if let Some(state) = client_state {
            out.push((TRACESTATE, state));
        }
    }
    if let Some(baggage) = joined(headers, &BAGGAGE, MAX_BAGGAGE_BYTES) {
        out.push((BAGGAGE, baggage));
    }
    out
}

/// The client's `tracestate`, its lines joined, when within its bound.
pub(crate) fn tracestate(headers: &HeaderMap) -> Option<HeaderValue> {
    joined(headers, &TRACESTATE, MAX_TRACESTATE_BYTES)
}

/// The header's value when it is sent once (two `traceparent`s are not a trace context).
pub(crate) fn single<'a>(headers: &'a HeaderMap, name: &HeaderName) -> Option<&'a str> {
    let mut values = headers.get_all(name).iter();
    let value = values.next()?;
    if values.next().is_some() {
        return None;
    }
    value.to_str().ok()
}

/// The header's lines joined with commas, without empty members, when within `max` bytes.
fn joined(headers: &HeaderMap, name: &HeaderName, max: usize) -> Option<HeaderValue> {
    let mut text = String::new();
    for value in headers.get_all(name) {
        let value = value.to_str().ok()?;
        for member in value.split(',').map(str::trim).filter(|m| !m.is_empty()) {
            if !text.is_empty() {
                text.push(',');
            }
            text.push_str(member);
            if text.len() > max {
                return None;
            }
        }
    }
    if text.is_empty() {
        return None;
    }
    HeaderValue::from_str(&text).ok()
}

/// A valid `traceparent` as version `00` (`00-{trace id}-{parent id}-{flags}`), or `None`.
pub fn traceparent(value: &str) -> Option<HeaderValue> {
    let value = value.trim();
    let hex =
        |s: &str, len: usize| s.len() == len && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    let version = value.get(..2)?;
    if !hex(version, 2) || version == "ff" || value.as_bytes().get(2) != Some(&b'-') {
        return None;
    }
    let rest = value.get(3..)?;
    // Version 00 is exactly its four fields; a later version may add fields after a dash.
    let known = rest.get(..52)?;
    if version == "00" && rest.len() != 52 {
        return None;
    }
    if version != "00" && rest.len() > 52 && rest.as_bytes()[52] != b'-' {
        return None;
    }
    let mut fields = known.split('-');
    let (trace_id, parent_id, flags) = (fields.next()?, fields.next()?, fields.next()?);
    let valid = hex(trace_id, 32)
        && hex(parent_id, 16)
        && hex(flags, 2)
        && trace_id.bytes().any(|b| b != b'0')
        && parent_id.bytes().any(|b| b != b'0');
    if !valid {
        return None;
    }
    HeaderValue::from_str(&format!("00-{trace_id}-{parent_id}-{flags}")).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn traceparents_are_checked_as_the_specification_says() {
        assert_eq!(traceparent(VALID).unwrap(), VALID);
        // A later version: its known fields, as version 00.
        let later = "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-the-future-holds";
        assert_eq!(traceparent(later).unwrap(), VALID);
        for bad in [
            "",
            "00",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
            "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",
            "0x-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(traceparent(bad), None, "{bad:?}");
        }
    }

    fn headers(pairs: &[(&HeaderName, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append((*name).clone(), HeaderValue::from_str(value).unwrap());
        }
        map
    }

    fn names(out: &[(HeaderName, HeaderValue)]) -> Vec<(&str, &str)> {
        out.iter().map(|(n, v)| (n.as_str(), v.to_str().unwrap())).collect()
    }

    #[test]
    fn the_context_goes_on_joined_and_bounded() {
        let out = propagated(
            &headers(&[
                (&TRACEPARENT, VALID),
                (&TRACESTATE, "rojo=00f067aa0ba902b7"),
                (&TRACESTATE, "congo=t61rcWkgMzE, "),
                (&BAGGAGE, "userId=alice"),
                (&BAGGAGE, "serverNode=DF%2028"),
            ]),
            None,
        );
        assert_eq!(
            names(&out),
            [
                ("traceparent", VALID),
                ("tracestate", "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"),
                ("baggage", "userId=alice,serverNode=DF%2028"),
            ]
        );
        // A malformed traceparent takes its tracestate with it; baggage is its own.
        let out = propagated(
            &headers(&[(&TRACEPARENT, "00-xyz"), (&TRACESTATE, "rojo=1"), (&BAGGAGE, "k=v")]),
            None,
        );
        assert_eq!(names(&out), [("baggage", "k=v")]);
        // Two traceparents are none.
        let out = propagated(&headers(&[(&TRACEPARENT, VALID), (&TRACEPARENT, VALID)]), None);
        assert!(out.is_empty());
        // Over the bounds: dropped, not cut.
        let big = format!("k={}", "v".repeat(MAX_BAGGAGE_BYTES));
        assert!(propagated(&headers(&[(&BAGGAGE, &big)]), None).is_empty());
        assert!(propagated(&HeaderMap::new(), None).is_empty());
        // The gateway's own span as the parent: the client's tracestate goes with it, and only if the client's
        // traceparent was valid.
        let own = HeaderValue::from_static("00-4bf92f3577b34da6a3ce929d0e0e4736-b7ad6b7169203331-01");
        let out = propagated(
            &headers(&[(&TRACEPARENT, VALID), (&TRACESTATE, "rojo=1")]),
            Some(own.clone()),
        );
        assert_eq!(
            names(&out),
            [("traceparent", own.to_str().unwrap()), ("tracestate", "rojo=1")]
        );
        let out = propagated(&headers(&[(&TRACESTATE, "rojo=1")]), Some(own.clone()));
        assert_eq!(names(&out), [("traceparent", own.to_str().unwrap())]);
    }
}
