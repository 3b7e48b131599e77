//! Which endpoint made each of the last Responses answers the gateway relayed (for `previous_response_id`: see
//! [`crate::api::responses`]), and for which keyed client. A store the state holds; it imports nothing of the crate.
//!
//! The store is shared fairly: each owner (a keyed client, or every unkeyed request together) keeps its own ids,
//! oldest first, and when the store is full the new id pushes out the oldest id of the owner that holds the most
//! (max-min fairness). An owner at or below an equal share of the store (capacity / owners holding ids) never
//! loses an id to another's requests: one tenant cannot end another's conversations by sending many of its own.
//! Cost: a scan of the owners per id pushed out (owners are the configured clients, and one for the unkeyed).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use dprouter_core::EndpointId;

/// How many response ids a gateway remembers (about 100 bytes each).
pub const REMEMBERED: usize = 65_536;

/// The longest response id remembered (engines' ids are `resp_` and 32 hex digits or so).
const MAX_ID_BYTES: usize = 256;

/// The keyed client a response was made for (`None`: no key; every unkeyed request shares one owner).
pub type Owner = Option<Arc<str>>;

/// Response id to the endpoint that made it, each owner's oldest forgotten first.
pub struct ResponseHomes {
    capacity: usize,
    inner: Mutex<Homes>,
}

#[derive(Default)]
struct Homes {
    by_id: HashMap<Arc<str>, (EndpointId, Owner)>,
    /// Each owner's ids, oldest first.
    order: HashMap<Owner, VecDeque<Arc<str>>>,
}

impl Homes {
    /// Forgets the oldest id of the owner holding the most (`owner`, the one adding, when it is among them).
    fn forget_one(&mut self, owner: &Owner) {
        let own = self.order.get(owner).map_or(0, VecDeque::len);
        let largest = self
            .order
            .iter()
            .filter(|(_, ids)| ids.len() > own)
            .max_by_key(|(_, ids)| ids.len())
            .map(|(o, _)| o.clone())
            .unwrap_or_else(|| owner.clone());
        let Some(ids) = self.order.get_mut(&largest) else {
            return;
        };
        if let Some(old) = ids.pop_front() {
            self.by_id.remove(&old);
        }
        if ids.is_empty() {
            self.order.remove(&largest);
        }
    }
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

    /// `endpoint` made the response `id` for `owner` (an id already known keeps its first owner).
    pub fn record(&self, id: String, endpoint: EndpointId, owner: Owner) {
        if id.is_empty() || id.len() > MAX_ID_BYTES {
            return;
        }
        let id: Arc<str> = Arc::from(id);
        let mut homes = self.lock();
        if homes.by_id.contains_key(&id) {
            return;
        }
        if homes.by_id.len() >= self.capacity {
            homes.forget_one(&owner);
        }
        homes.by_id.insert(Arc::clone(&id), (endpoint, owner.clone()));
        homes.order.entry(owner).or_default().push_back(id);
    }

    /// The endpoint that made the response `id`, if it is remembered and was made for `asker` (a keyed client's
    /// name; `None` without a key): another client's response is unknown to it.
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

    #[test]
    fn one_client_cannot_push_out_anothers_responses() {
        let homes = ResponseHomes::new(4);
        let (alice, bob) = (Some(Arc::from("alice")), Some(Arc::from("bob")));
        homes.record("a1".into(), endpoint(0, 1), alice.clone());
        for i in 0..100 {
            homes.record(format!("b{i}"), endpoint(0, 0), bob.clone());
        }
        assert_eq!(homes.len(), 4);
        assert_eq!(
            homes.home("a1", Some("alice")),
            Some(endpoint(0, 1)),
            "alice's one id stays"
        );
        assert_eq!(homes.home("b99", Some("bob")), Some(endpoint(0, 0)));
        assert_eq!(homes.home("b96", Some("bob")), None, "bob's oldest go first");
        // Alice may grow to her share (2 of 4) at bob's expense, then pushes out her own oldest.
        for i in 2..6 {
            homes.record(format!("a{i}"), endpoint(0, 1), alice.clone());
        }
        assert_eq!(homes.len(), 4);
        assert_eq!(homes.home("a5", Some("alice")), Some(endpoint(0, 1)));
        assert_eq!(homes.home("a4", Some("alice")), Some(endpoint(0, 1)));
        assert_eq!(homes.home("a1", Some("alice")), None);
        assert_eq!(homes.home("b99", Some("bob")), Some(endpoint(0, 0)));
        assert_eq!(homes.home("b98", Some("bob")), Some(endpoint(0, 0)));
        // The unkeyed share one owner among the others.
        homes.record("u".into(), endpoint(1, 0), None);
        assert_eq!(homes.home("u", None), Some(endpoint(1, 0)));
        assert_eq!(homes.len(), 4);
    }
}
