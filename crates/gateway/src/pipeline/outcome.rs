//! One place that records how an attempt at an engine ended, for every path that talks to one (the aggregated
//! relay, a pair's prefill leg, a relayed answer's body, the Endpoint Picker's stream): the count in
//! `dprouter_upstream_errors_total` and the endpoint's passive health (`crate::fleet::registry`).
//!
//! A request's own fault never counts against its endpoint: a 4xx counts for nothing; an engine that fails a
//! request pinned to its rank, or an exchange that broke after the request was sent and before any answer (the
//! engine may have refused this request's body by closing the connection), only asks for a probe.

use std::time::Instant;

use dprouter_core::{Branch, EndpointId};

use crate::fleet::registry::{Failure, Registry, Target};
use crate::observe::telemetry;

/// How an attempt ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// No response head by the first-byte deadline.
    NoHead,
    /// The engine answered this status: a 5xx is its failure, a 2xx its success.
    Answered(u16),
    /// The exchange failed before any answer; `connect`: the connection was never made (safe to retry).
    Failed { connect: bool },
    /// The answer broke after its head; `stalled`: it went silent past the stream's idle timeout.
    Cut { stalled: bool },
}

/// The endpoint an attempt went to, and how it was chosen.
#[derive(Clone, Copy)]
pub struct Attempt<'a> {
    endpoint: Endpoint<'a>,
    /// The pick's branch (`None`: a request without a ticket, a `GET` the picker placed).
    branch: Option<Branch>,
}

#[derive(Clone, Copy)]
enum Endpoint<'a> {
    /// A target of the membership: its own state records a success without the registry's lock.
    Target(&'a Target),
    /// An endpoint by id, and its label.
    Named(EndpointId, &'a str),
}

impl<'a> Attempt<'a> {
    /// An attempt at `target`, chosen by `branch`.
    pub fn at(target: &'a Target, branch: Option<Branch>) -> Self {
        Self {
            endpoint: Endpoint::Target(target),
            branch,
        }
    }

    /// An attempt at the endpoint `id`, labelled `label`, chosen by `branch`.
    pub fn of(id: EndpointId, label: &'a str, branch: Option<Branch>) -> Self {
        Self {
            endpoint: Endpoint::Named(id, label),
            branch,
        }
    }
}

/// Records `outcome` of `attempt`: its metric and what it tells of the endpoint's health.
pub fn record(registry: &Registry, attempt: Attempt<'_>, outcome: Outcome) {
    let engine = attempt.branch.map_or(Failure::Engine, Failure::engine);
    let (kind, failure) = match outcome {
        Outcome::NoHead => ("timeout", engine),
        Outcome::Answered(status) if status >= 500 => ("status_5xx", engine),
        Outcome::Answered(status) => {
            if (200..300).contains(&status) {
                match attempt.endpoint {
                    Endpoint::Target(target) => target.state.record_success(),
                    Endpoint::Named(id, _) => registry.record_success(id),
                }
            }
            return;
        }
        Outcome::Failed { connect: true } => ("connect", Failure::Connect),
        Outcome::Failed { connect: false } => ("server", Failure::Ambiguous),
        Outcome::Cut { stalled: true } => ("timeout", engine),
        Outcome::Cut { stalled: false } => ("stream", engine),
    };
    let (id, label) = match attempt.endpoint {
        Endpoint::Target(target) => (target.id, target.label()),
        Endpoint::Named(id, label) => (id, label.to_string()),
    };
    metrics::counter!(telemetry::UPSTREAM_ERRORS, "endpoint" => label, "kind" => kind).increment(1);
    registry.record_failure(id, failure, Instant::now());
}
