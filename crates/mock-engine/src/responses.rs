//! The OpenAI Responses this engine stores (`store`, on by default, as in vLLM and SGLang): `previous_response_id`
//! continues one (the new turn's prompt is the stored prompt and answer followed by the new input, so it extends
//! the stored one and hits the same rank's cache), `GET` and `DELETE /v1/responses/{id}` read and remove one
//! ([`crate::api`]). The store keeps the last [`KEPT`] responses of this process, like the engines' in-memory
//! stores.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use serde_json::Value;

/// How many responses the mock keeps.
pub const KEPT: usize = 10_000;

/// A stored response: the prompt it answered (as text), its answer, and the object `GET` returns.
pub(crate) struct Stored {
    pub prompt: String,
    pub output: String,
    pub object: Value,
}

/// The responses this process made, the oldest forgotten first.
#[derive(Default)]
pub struct ResponseStore {
    inner: Mutex<(HashMap<String, Stored>, VecDeque<String>)>,
}

impl ResponseStore {
    fn lock(&self) -> std::sync::MutexGuard<'_, (HashMap<String, Stored>, VecDeque<String>)> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn put(&self, id: String, stored: Stored) {
        let mut inner = self.lock();
        if inner.0.insert(id.clone(), stored).is_none() {
            inner.1.push_back(id);
        }
        while inner.1.len() > KEPT {
            if let Some(old) = inner.1.pop_front() {
                inner.0.remove(&old);
            }
        }
    }

    /// The object of response `id`, as `GET` returns it.
    pub fn get(&self, id: &str) -> Option<Value> {
        self.lock().0.get(id).map(|stored| stored.object.clone())
    }

    /// Forgets response `id`; whether it was kept.
    pub fn remove(&self, id: &str) -> bool {
        let mut inner = self.lock();
        if inner.0.remove(id).is_none() {
            return false;
        }
        inner.1.retain(|kept| kept != id);
        true
    }

    /// The conversation up to and including response `id`, as prompt text to continue.
    pub fn conversation(&self, id: &str) -> Option<String> {
        let inner = self.lock();
        let stored = inner.0.get(id)?;
        Some(format!("{}{}\n", stored.prompt, stored.output))
    }
}

/// What a Responses request keeps of itself once answered.
pub(crate) struct Keep {
    pub store: Arc<ResponseStore>,
    /// The prompt text its tokens were encoded from.
    pub prompt: String,
}
