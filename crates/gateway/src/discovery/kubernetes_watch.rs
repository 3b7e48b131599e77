//! A WATCH answer read: its body split into lines ([`Lines`], each at most [`MAX_EVENT_BYTES`]), each line an
//! event ([`parse_event`]), and the objects of the followed collection by name ([`Objects`]), whose changes are
//! what discovery publishes.

use std::collections::BTreeMap;

use bytes::{Bytes, BytesMut};
use serde::Deserialize;
use serde_json::Value;

use crate::common::throttled::clip;
use crate::discovery::kubernetes_objects::{Meta, Object};

/// The largest watch event read (one object's JSON line).
pub(super) const MAX_EVENT_BYTES: usize = 16 << 20;

/// One watch event.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Event<T> {
    Added(T),
    Modified(T),
    Deleted(T),
    Bookmark,
    /// An object of the collection that does not read as `T` (skipped).
    Unreadable(String),
    /// The object is a `Status`.
    Error(Value),
}

/// A watch event, and the resource version its object carries.
pub(super) fn parse_event<T: Object>(line: &[u8]) -> Result<(Event<T>, Option<String>), String> {
    #[derive(Deserialize)]
    struct Raw<'a> {
        #[serde(rename = "type")]
        kind: Option<String>,
        #[serde(borrow)]
        object: Option<&'a serde_json::value::RawValue>,
    }
    #[derive(Deserialize)]
    struct WithMeta {
        #[serde(default)]
        metadata: Meta,
    }
    let raw: Raw<'_> = serde_json::from_slice(line).map_err(|e| format!("a watch event that is not JSON: {e}"))?;
    let object = raw.object.map_or("{}", |o| o.get());
    let kind = raw.kind.as_deref();
    if kind == Some("ERROR") {
        let status = serde_json::from_str(object).unwrap_or_default();
        return Ok((Event::Error(status), None));
    }
    let version = serde_json::from_str::<WithMeta>(object)
        .ok()
        .and_then(|o| o.metadata.resource_version);
    let read = || match serde_json::from_str::<T>(object) {
        Ok(object) => Ok(object),
        Err(e) => Err(Event::Unreadable(e.to_string())),
    };
    let event = match kind {
        Some("ADDED") => read().map_or_else(|e| e, Event::Added),
        Some("MODIFIED") => read().map_or_else(|e| e, Event::Modified),
        Some("DELETED") => read().map_or_else(|e| e, Event::Deleted),
        Some("BOOKMARK") => Event::Bookmark,
        other => return Err(format!("a watch event of type {other:?}")),
    };
    Ok((event, version))
}

/// The watch body split into lines, each at most [`MAX_EVENT_BYTES`].
#[derive(Default)]
pub(super) struct Lines {
    pub(super) partial: BytesMut,
}

impl Lines {
    pub(super) fn push(&mut self, data: &Bytes) -> Result<Vec<Bytes>, String> {
        let mut lines = Vec::new();
        let mut rest = &data[..];
        while let Some(end) = rest.iter().position(|&b| b == b'\n') {
            self.partial.extend_from_slice(&rest[..end]);
            rest = &rest[end + 1..];
            let line = self.partial.split().freeze();
            if !line.iter().all(u8::is_ascii_whitespace) {
                lines.push(line);
            }
        }
        if self.partial.len() + rest.len() > MAX_EVENT_BYTES {
            return Err(format!("a watch event over {MAX_EVENT_BYTES} bytes"));
        }
        self.partial.extend_from_slice(rest);
        Ok(lines)
    }
}

/// What a followed collection did.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Change<T> {
    /// A LIST: these are all the objects now.
    Listed(Vec<T>),
    Event(Event<T>),
}

/// The objects of a followed collection by name, each with what it gives (`read`).
pub(super) struct Objects<O, F> {
    pub(super) by_name: BTreeMap<String, O>,
    read: F,
}

impl<O, F> Objects<O, F> {
    pub(super) fn new(read: F) -> Self {
        Self {
            by_name: BTreeMap::new(),
            read,
        }
    }

    /// Applies `change`; whether what the objects give changed (a LIST always counts: it may be the first). An
    /// object modified in what discovery does not read (its status's heartbeat, its annotations' other keys), or
    /// modified again the same, changes nothing, so a watch flooding the same object costs its parsing only.
    pub(super) fn apply<T: Object>(&mut self, change: Change<T>) -> bool
    where
        F: Fn(&T) -> O,
        O: PartialEq,
    {
        let name = |o: &T| o.meta().name.clone();
        match change {
            Change::Listed(items) => {
                self.by_name = items.iter().filter_map(|o| Some((name(o)?, (self.read)(o)))).collect();
            }
            Change::Event(Event::Added(o) | Event::Modified(o)) => {
                let Some(n) = name(&o) else { return false };
                let read = (self.read)(&o);
                if self.by_name.get(&n) == Some(&read) {
                    return false;
                }
                self.by_name.insert(n, read);
            }
            Change::Event(Event::Deleted(o)) => {
                let Some(n) = name(&o) else { return false };
                if self.by_name.remove(&n).is_none() {
                    return false;
                }
            }
            Change::Event(Event::Unreadable(e)) => {
                tracing::debug!(error = %clip(&e), "a watched object that does not read: skipped");
                return false;
            }
            Change::Event(Event::Bookmark | Event::Error(_)) => return false,
        }
        true
    }
}
