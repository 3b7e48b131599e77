//! Which session a request belongs to, in the agents' own words. Coding agents name their sessions in headers:
//! Claude Code `x-claude-code-session-id` (its subagents add `x-claude-code-agent-id`, their session being the
//! parent's), Codex `session_id` (or `session-id`), OpenCode `x-session-id` (its subagents `x-parent-session-id`
//! beside their own) or `x-session-affinity`; an operator may name one more (`session_header`). A header's session
//! comes first, then what the body says (Anthropic's `metadata.user_id`, OpenAI's `prompt_cache_key`:
//! [`dprouter_core::request_body`]).
//!
//! The placement key is the session, and for a subagent the session and the agent together: a subagent has its
//! own system prompt, so it is a session of its own where its cache is concerned, not its parent's. For flow
//! control's fairness a subagent is its program's, the root session's ([`program`]): one agent that spawns fifty
//! subagents takes one share, not fifty. These ids are
//! the client's word, untrusted: only their hash is kept (clipped to [`MAX_ID_BYTES`] first), and they appear in
//! no metric or log.

use axum::http::HeaderMap;

/// The agents' headers that name a session, in the order they are read.
pub const SESSION_HEADERS: [&str; 5] = [
    "x-claude-code-session-id",
    "session_id",
    "session-id",
    "x-session-id",
    "x-session-affinity",
];

/// The headers that name a subagent within the session its request names.
pub const AGENT_HEADERS: [&str; 1] = ["x-claude-code-agent-id"];

/// The headers that name a subagent's parent session, beside the subagent's own (OpenCode's).
pub const PARENT_HEADERS: [&str; 1] = ["x-parent-session-id"];

/// The most bytes of an id read.
pub const MAX_ID_BYTES: usize = 256;

fn id<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    let value = headers.get(name)?.to_str().ok()?.trim();
    let end = value
        .char_indices()
        .map(|(i, c)| i + c.len_utf8())
        .take_while(|&e| e <= MAX_ID_BYTES)
        .last();
    Some(&value[..end?])
}

/// The hash of the program the request belongs to, for flow control's fairness: the root session its headers
/// name (a subagent's parent's, whichever way the agent names it); `None` when no header names a session.
pub fn program(headers: &HeaderMap, configured: Option<&str>) -> Option<u64> {
    let root = PARENT_HEADERS
        .iter()
        .copied()
        .chain(SESSION_HEADERS)
        .chain(configured)
        .find_map(|name| id(headers, name).filter(|v| !v.is_empty()))?;
    Some(dprouter_core::request::session_hash(root))
}

/// The hash of the session the request's headers name (`configured`: the operator's own header, read after the
/// agents'), with its subagent when one is named; `None` when no header names one.
pub fn placement(headers: &HeaderMap, configured: Option<&str>) -> Option<u64> {
    let session = SESSION_HEADERS
        .iter()
        .copied()
        .chain(configured)
        .find_map(|name| id(headers, name).filter(|v| !v.is_empty()))?;
    let agent = AGENT_HEADERS
        .iter()
        .find_map(|name| id(headers, name).filter(|v| !v.is_empty()));
    Some(match agent {
        Some(agent) => dprouter_core::request::session_hash(&format!("{session}\u{0}{agent}")),
        None => dprouter_core::request::session_hash(session),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use dprouter_core::request::session_hash;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(
                axum::http::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                value.parse().unwrap(),
            );
        }
        map
    }

    #[test]
    fn each_agents_header_names_the_session_and_a_subagent_is_its_own() {
        for name in SESSION_HEADERS {
            assert_eq!(
                placement(&headers(&[(name, "s1")]), None),
                Some(session_hash("s1")),
                "{name}"
            );
        }
        assert_eq!(
            placement(&headers(&[("x-my-session", "s2")]), Some("x-my-session")),
            Some(session_hash("s2"))
        );
        assert_eq!(placement(&headers(&[("x-other", "s2")]), Some("x-my-session")), None);
        // Claude Code's first: its own header wins over a generic one.
        let both = headers(&[("x-session-id", "generic"), ("x-claude-code-session-id", "claude")]);
        assert_eq!(placement(&both, None), Some(session_hash("claude")));
        let parent = placement(&headers(&[("x-claude-code-session-id", "p")]), None);
        let sub = placement(
            &headers(&[("x-claude-code-session-id", "p"), ("x-claude-code-agent-id", "a1")]),
            None,
        );
        let other = placement(
            &headers(&[("x-claude-code-session-id", "p"), ("x-claude-code-agent-id", "a2")]),
            None,
        );
        assert!(sub.is_some() && sub != parent && sub != other);
        assert_eq!(
            placement(&headers(&[("x-session-id", "  ")]), None),
            None,
            "blank names none"
        );
    }

    #[test]
    fn a_programs_subagents_are_one_program() {
        let parent = headers(&[("x-claude-code-session-id", "p")]);
        let sub = headers(&[("x-claude-code-session-id", "p"), ("x-claude-code-agent-id", "a1")]);
        assert_eq!(program(&parent, None), program(&sub, None));
        assert_ne!(placement(&parent, None), placement(&sub, None));
        let opencode = headers(&[("x-session-id", "child"), ("x-parent-session-id", "root")]);
        assert_eq!(program(&opencode, None), Some(session_hash("root")));
        assert_eq!(placement(&opencode, None), Some(session_hash("child")));
        assert_eq!(program(&HeaderMap::new(), None), None);
    }

    #[test]
    fn a_long_id_is_clipped_before_it_is_hashed() {
        let long = "x".repeat(10_000);
        let clipped = "x".repeat(MAX_ID_BYTES);
        assert_eq!(
            placement(&headers(&[("x-session-id", &long)]), None),
            Some(session_hash(&clipped))
        );
    }
}
