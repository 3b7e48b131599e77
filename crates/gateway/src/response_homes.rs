//! Which endpoint made each of the last Responses answers the gateway relayed (for `previous_response_id`: see
//! [`crate::responses`]), and for which keyed client, the oldest forgotten first. A store the state holds; it imports
//! nothing of the crate.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use dprouter_core::EndpointId;

/// How many response ids a gateway remembers (about 100 bytes each).
pub const REMEMBERED: usize = 65_536;

/// The longest response id remembered (engines' ids are `resp_` and 32 hex digits or so).
const MAX_ID_BYTES: usize = 256;

/// The keyed client a response was made for (`None`: no clients are configured).
pub type Owner = Option<Arc<str>>;

/// Response id to the endpoint that made it, the oldest forgotten first.
pub struct ResponseHomes {
    capacity: usize,
    inner: Mutex<Homes>,
}

#[derive(Default)]
struct Homes {
    by_id: HashMap<Arc<str>, (EndpointId, Owner)>,
    order: VecDeque<Arc<str>>,
}

impl ResponseHomes {
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            inner: Mutex::new(Homes::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Homes> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `endpoint` made the response `id` for `owner`.
    pub fn record(&self, id: String, endpoint: EndpointId, owner: Owner) {
        if id.is_empty() || id.len() > MAX_ID_BYTES {
            return;
        }
        let id: Arc<str> = Arc::from(id);
        let mut homes = self.lock();
        if homes.by_id.insert(Arc::clone(&id), (endpoint, owner)).is_some() {
            return;
        }
        homes.order.push_back(id);
        while homes.order.len() > self.capacity {
            if let Some(old) = homes.order.pop_front() {
                homes.by_id.remove(&old);
            }
        }
    }

    /// The endpoint that made the response `id`, if it is remembered and was made for `asker` (a keyed client's
    /// name; `None` without clients): another client's response is unknown to it.
    pub fn home(&self, id: &str, asker: Option<&str>) -> Option<EndpointId> {
        let homes = self.lock();
        let (endpoint, owner) = homes.by_id.get(id)?;
        (owner.as_deref() == asker).then_some(*endpoint)
    }

    pub fn len(&self) -> usize {
        self.lock().by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint(worker: u32, rank: u32) -> EndpointId {
        EndpointId::new(worker, rank)
    }

    #[test]
    fn the_oldest_ids_are_forgotten_first() {
        let homes = ResponseHomes::new(2);
        homes.record("a".into(), endpoint(0, 1), None);
        homes.record("b".into(), endpoint(1, 0), None);
        homes.record("a".into(), endpoint(0, 1), None);
        assert_eq!(homes.len(), 2, "the same id twice is one");
        homes.record("c".into(), endpoint(2, 0), None);
        assert_eq!(homes.home("a", None), None);
        assert_eq!(homes.home("b", None), Some(endpoint(1, 0)));
        assert_eq!(homes.home("c", None), Some(endpoint(2, 0)));
        homes.record(String::new(), endpoint(0, 0), None);
        homes.record("x".repeat(MAX_ID_BYTES + 1), endpoint(0, 0), None);
        assert_eq!(homes.len(), 2, "empty and oversized ids are not kept");
    }

    #[test]
    fn a_keyed_clients_responses_are_its_own() {
        let homes = ResponseHomes::new(4);
        homes.record("a".into(), endpoint(0, 1), Some(Arc::from("alice")));
        assert_eq!(homes.home("a", Some("alice")), Some(endpoint(0, 1)));
        assert_eq!(homes.home("a", Some("bob")), None);
        assert_eq!(homes.home("a", None), None);
    }
}
