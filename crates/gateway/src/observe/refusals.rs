//! What the gateway drops, clips or refuses of its untrusted inputs (a client's fields and strings, a picker's
//! prefill target, a data plane's reports, a control plane's answers): each counted in
//! `dprouter_refused_input_total{what}` and logged at most once per [`crate::common::throttled::LOG_EVERY`] for each
//! `what`, so that an operator sees after an upgrade what is no longer taken (docs/operations.md).

use std::collections::HashMap;
use std::sync::Mutex;

use crate::common::throttled::{clip, Throttled};
use crate::observe::telemetry::REFUSED_INPUT;

/// The longest client string kept in a span attribute or a log field (OpenTelemetry's attribute value limits are
/// of this order); a longer one is clipped ([`clip_client`]).
pub const MAX_CLIENT_STRING_BYTES: usize = 256;

/// Something untrusted was dropped, clipped or refused: counted with `what` (a fixed name: `client_field`,
/// `client_string`, `prefill_target`, `kubernetes_answer`, `served_elsewhere`, `late_body`, `unkeyed_objective`,
/// `prefill_leg_cut`), and `detail` logged unless one of the same `what` was logged within the period.
pub fn refused(what: &'static str, detail: impl FnOnce() -> String) {
    static LOGS: Mutex<Option<HashMap<&'static str, Throttled>>> = Mutex::new(None);
    metrics::counter!(REFUSED_INPUT, "what" => what).increment(1);
    let ready = {
        let mut logs = LOGS.lock().unwrap_or_else(|e| e.into_inner());
        logs.get_or_insert_with(HashMap::new).entry(what).or_default().ready()
    };
    if let Some(skipped) = ready {
        let detail = detail();
        tracing::warn!(what, skipped, "{}", clip(&detail));
    }
}

/// A client's string as spans and logs keep it: at most [`MAX_CLIENT_STRING_BYTES`] (at a character boundary,
/// with `…` at the cut); a clipped one is counted ([`refused`], `client_string`).
pub fn clip_client<'a>(field: &'static str, text: &'a str) -> std::borrow::Cow<'a, str> {
    if text.len() <= MAX_CLIENT_STRING_BYTES {
        return text.into();
    }
    let mut end = MAX_CLIENT_STRING_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    refused("client_string", || {
        format!(
            "a client's {field} of {} bytes clipped to {end} in spans and logs",
            text.len()
        )
    });
    format!("{}…", &text[..end]).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_strings_are_clipped_at_a_character() {
        assert_eq!(clip_client("model", "m"), "m");
        let long = "é".repeat(200); // 400 bytes: cut at 256
        let clipped = clip_client("model", &long);
        assert_eq!(clipped, format!("{}…", "é".repeat(128)));
    }
}
