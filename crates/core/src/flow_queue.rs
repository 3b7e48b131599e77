//! Flow control's central queue, as a data structure: requests waiting while every endpoint they may use is
//! saturated, in **bands** by priority, within a band in **groups** (a keyed client, or an unkeyed flow alone), and
//! within a group in **flows** (a client's agent programs; [`FlowQueue::push_in`]).
//!
//! The order is the Gateway API Inference Extension's, with one more level: strict priority between bands (a higher
//! band's request always goes first), a fair share between the groups of a band, then between the flows of a group,
//! first come first served within a flow. The share is round robin by request: the groups of a band take turns, one
//! request each, and a group's turn goes to its flows in turn. So clients share the pool equally, however many
//! programs each runs, and a client's programs share its part. Deficit round robin by prompt tokens would
//! share the engines' prefill work more evenly between flows of very different prompt sizes, but a request's cost on
//! a cache-aware fleet is its *uncached* tokens, which are not known until it is routed (late binding); per request,
//! a small tenant's wait is bounded by the number of flows ahead of it, whatever the others send. The structure
//! holds what it is given ([`FlowQueue::push`]) and counts entries and bytes; bounding them is its owner's job.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

/// A flow: its group and its own name.
type FlowKey = (Arc<str>, Arc<str>);

/// One band: its flows' queues, each group's flows with requests in the order they take the group's turns, and the
/// groups with requests in the order they take turns.
#[derive(Debug)]
struct Band<T> {
    flows: HashMap<FlowKey, VecDeque<Entry<T>>>,
    groups: HashMap<Arc<str>, VecDeque<Arc<str>>>,
    turns: VecDeque<Arc<str>>,
    len: usize,
    bytes: usize,
}

impl<T> Default for Band<T> {
    fn default() -> Self {
        Self {
            flows: HashMap::new(),
            groups: HashMap::new(),
            turns: VecDeque::new(),
            len: 0,
            bytes: 0,
        }
    }
}

impl<T> Band<T> {
    /// The flow `key` has no entry left: out of its group's turns, and its group out of the band's when it has no
    /// flow left.
    fn emptied(&mut self, key: &FlowKey) {
        self.flows.remove(key);
        let (group, flow) = key;
        if let Some(flows) = self.groups.get_mut(group) {
            flows.retain(|f| f != flow);
            if flows.is_empty() {
                self.groups.remove(group);
                self.turns.retain(|g| g != group);
            }
        }
    }
}

#[derive(Debug)]
struct Entry<T> {
    id: u64,
    bytes: usize,
    item: T,
}

/// Requests waiting, by band and flow (see the module documentation).
#[derive(Debug)]
pub struct FlowQueue<T> {
    /// By priority; the highest is served first.
    bands: BTreeMap<i32, Band<T>>,
    /// Where each entry waits: its band and flow.
    places: HashMap<u64, (i32, FlowKey)>,
    next_id: u64,
    bytes: usize,
}

impl<T> Default for FlowQueue<T> {
    fn default() -> Self {
        Self {
            bands: BTreeMap::new(),
            places: HashMap::new(),
            next_id: 0,
            bytes: 0,
        }
    }
}

/// One band's size, for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BandSize {
    pub priority: i32,
    pub requests: usize,
    pub bytes: usize,
}

/// One group's size within a band, for metrics (its flows together: their number has no bound).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlowSize {
    pub priority: i32,
    /// The group's name.
    pub flow: Arc<str>,
    pub requests: usize,
    pub bytes: usize,
}

impl<T> FlowQueue<T> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Entries waiting.
    pub fn len(&self) -> usize {
        self.places.len()
    }

    pub fn is_empty(&self) -> bool {
        self.places.is_empty()
    }

    /// The bytes the entries hold, as their owners counted them.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Each band with entries, highest priority first.
    pub fn bands(&self) -> Vec<BandSize> {
        self.bands
            .iter()
            .rev()
            .map(|(&priority, band)| BandSize {
                priority,
                requests: band.len,
                bytes: band.bytes,
            })
            .collect()
    }

    /// Each group with entries, by band (highest priority first), in no particular order within a band.
    pub fn flows(&self) -> Vec<FlowSize> {
        let mut out: Vec<FlowSize> = Vec::new();
        for (&priority, band) in self.bands.iter().rev() {
            for (group, flows) in &band.groups {
                let entries = flows
                    .iter()
                    .filter_map(|f| band.flows.get(&(Arc::clone(group), Arc::clone(f))))
                    .flatten();
                let (requests, bytes) = entries.fold((0, 0), |(n, b), e| (n + 1, b + e.bytes));
                out.push(FlowSize {
                    priority,
                    flow: Arc::clone(group),
                    requests,
                    bytes,
                });
            }
        }
        out
    }

    /// Queues `item` of `flow` (a group of its own) at `priority`, holding `bytes`; returns its id (for
    /// [`FlowQueue::remove`]).
    pub fn push(&mut self, priority: i32, flow: &str, bytes: usize, item: T) -> u64 {
        self.push_in(priority, (flow, flow), bytes, item)
    }

    /// Queues `item` of `flow` in `group` at `priority`, holding `bytes`; returns its id.
    pub fn push_in(&mut self, priority: i32, (group, flow): (&str, &str), bytes: usize, item: T) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let band = self.bands.entry(priority).or_default();
        let group: Arc<str> = match band.groups.get_key_value(group) {
            Some((name, _)) => Arc::clone(name),
            None => Arc::from(group),
        };
        let flows = band.groups.entry(Arc::clone(&group)).or_default();
        if flows.is_empty() {
            band.turns.push_back(Arc::clone(&group));
        }
        let flow: Arc<str> = match flows.iter().find(|f| &***f == flow) {
            Some(name) => Arc::clone(name),
            None => {
                let name: Arc<str> = Arc::from(flow);
                flows.push_back(Arc::clone(&name));
                name
            }
        };
        let key = (group, flow);
        band.flows
            .entry(key.clone())
            .or_default()
            .push_back(Entry { id, bytes, item });
        band.len += 1;
        band.bytes += bytes;
        self.bytes += bytes;
        self.places.insert(id, (priority, key));
        id
    }

    /// The entry [`FlowQueue::pop`] would take, and its id.
    pub fn peek(&self) -> Option<(u64, &T)> {
        let band = self.bands.values().next_back()?;
        let group = band.turns.front()?;
        let flow = band.groups.get(group)?.front()?;
        let entry = band.flows.get(&(Arc::clone(group), Arc::clone(flow)))?.front()?;
        Some((entry.id, &entry.item))
    }

    /// Takes the next entry: the highest band's, of the flow whose turn it is, the oldest of that flow; the flow's
    /// turn passes to the next.
    pub fn pop(&mut self) -> Option<(u64, T)> {
        self.pop_first(|_| true)
    }

    /// Takes the first entry in service order that `ready` lets go: bands by priority, their groups in turn, a
    /// group's flows in turn, each flow's entries oldest first, skipping those `ready` holds back. Entries are held
    /// back by what they wait for (their pool's room), so those waiting for the same thing still go first come
    /// first served, and one for another pool need not wait behind them. The group and the flow it came from pass
    /// their turns to the next.
    pub fn pop_first(&mut self, ready: impl Fn(&T) -> bool) -> Option<(u64, T)> {
        let mut found = None;
        'bands: for (&priority, band) in self.bands.iter().rev() {
            for (group_turn, group) in band.turns.iter().enumerate() {
                for (flow_turn, flow) in band.groups.get(group)?.iter().enumerate() {
                    let key = (Arc::clone(group), Arc::clone(flow));
                    if let Some(at) = band.flows.get(&key)?.iter().position(|e| ready(&e.item)) {
                        found = Some((priority, group_turn, flow_turn, key, at));
                        break 'bands;
                    }
                }
            }
        }
        let (priority, group_turn, flow_turn, key, at) = found?;
        let band = self.bands.get_mut(&priority)?;
        let queue = band.flows.get_mut(&key)?;
        let entry = queue.remove(at)?;
        // The flow's turn in its group passes (or it leaves, empty), and the group's in the band (or it leaves).
        if queue.is_empty() {
            band.emptied(&key);
        } else if let Some(flows) = band.groups.get_mut(&key.0) {
            let flow = flows.remove(flow_turn);
            debug_assert_eq!(flow.as_ref(), Some(&key.1));
            flows.extend(flow);
        }
        if band.groups.contains_key(&key.0) {
            let group = band.turns.remove(group_turn);
            debug_assert_eq!(group.as_ref(), Some(&key.0));
            band.turns.extend(group);
        }
        self.taken(priority, entry.bytes);
        self.places.remove(&entry.id);
        Some((entry.id, entry.item))
    }

    /// Whether any entry waiting is one `matches` picks out.
    pub fn any(&self, matches: impl Fn(&T) -> bool) -> bool {
        self.bands
            .values()
            .flat_map(|band| band.flows.values())
            .flatten()
            .any(|e| matches(&e.item))
    }

    /// Takes the entry `id` out wherever it waits (its client went away, or its deadline passed).
    pub fn remove(&mut self, id: u64) -> Option<T> {
        let (priority, key) = self.places.remove(&id)?;
        let band = self.bands.get_mut(&priority)?;
        let queue = band.flows.get_mut(&key)?;
        let at = queue.iter().position(|e| e.id == id)?;
        let entry = queue.remove(at)?;
        if queue.is_empty() {
            band.emptied(&key);
        }
        self.taken(priority, entry.bytes);
        Some(entry.item)
    }

    /// An entry of `priority` holding `bytes` left.
    fn taken(&mut self, priority: i32, bytes: usize) {
        self.bytes -= bytes;
        if let Some(band) = self.bands.get_mut(&priority) {
            band.len -= 1;
            band.bytes -= bytes;
            if band.len == 0 {
                self.bands.remove(&priority);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_higher_band_goes_first_and_flows_take_turns() {
        let mut q = FlowQueue::new();
        for i in 0..4 {
            q.push(0, "big", 10, format!("big{i}"));
        }
        q.push(0, "small", 10, "small0".to_string());
        q.push(0, "small", 10, "small1".to_string());
        q.push(5, "urgent", 1, "urgent0".to_string());
        assert_eq!(q.len(), 7);
        assert_eq!(q.bytes(), 61);
        assert_eq!(
            q.bands(),
            [
                BandSize {
                    priority: 5,
                    requests: 1,
                    bytes: 1
                },
                BandSize {
                    priority: 0,
                    requests: 6,
                    bytes: 60
                }
            ]
        );
        let mut flows: Vec<_> = q
            .flows()
            .into_iter()
            .map(|f| (f.priority, f.flow.to_string(), f.requests, f.bytes))
            .collect();
        flows.sort();
        assert_eq!(
            flows,
            [
                (0, "big".into(), 4, 40),
                (0, "small".into(), 2, 20),
                (5, "urgent".into(), 1, 1)
            ]
        );
        assert_eq!(q.peek().map(|(_, s)| s.as_str()), Some("urgent0"));
        let order: Vec<String> = std::iter::from_fn(|| q.pop().map(|(_, s)| s)).collect();
        assert_eq!(order, ["urgent0", "big0", "small0", "big1", "small1", "big2", "big3"]);
        assert!(q.is_empty());
        assert_eq!(q.bytes(), 0);
        assert!(q.bands().is_empty());
    }

    #[test]
    fn an_entry_that_may_go_passes_those_that_may_not() {
        let mut q = FlowQueue::new();
        q.push(5, "a", 1, ("busy", 0));
        q.push(5, "a", 1, ("free", 1));
        q.push(0, "b", 1, ("free", 2));
        q.push(0, "c", 1, ("busy", 3));
        q.push(0, "d", 1, ("free", 4));
        let free = |item: &(&str, u32)| item.0 == "free";
        // The higher band first, past its busy oldest; then band 0's flows in turn, past c's busy one.
        assert_eq!(q.pop_first(free).map(|(_, i)| i.1), Some(1));
        assert_eq!(q.pop_first(free).map(|(_, i)| i.1), Some(2));
        assert_eq!(q.pop_first(free).map(|(_, i)| i.1), Some(4));
        assert_eq!(q.pop_first(free), None);
        assert!(q.any(|i| i.1 == 3));
        assert!(!q.any(|i| i.1 == 2));
        assert_eq!(q.len(), 2);
        assert_eq!(q.pop().map(|(_, i)| i.1), Some(0));
        assert_eq!(q.pop().map(|(_, i)| i.1), Some(3));
        assert!(q.is_empty() && q.bytes() == 0);
    }

    #[test]
    fn groups_take_turns_then_their_flows() {
        let mut q = FlowQueue::new();
        // Client `a` runs three programs with three requests each; client `b` one program with three.
        for i in 0..3 {
            for program in ["p1", "p2", "p3"] {
                q.push_in(0, ("a", program), 1, format!("a/{program}/{i}"));
            }
            q.push_in(0, ("b", "q"), 1, format!("b/q/{i}"));
        }
        let order: Vec<String> = std::iter::from_fn(|| q.pop().map(|(_, item)| item)).collect();
        assert_eq!(
            order,
            [
                "a/p1/0", "b/q/0", "a/p2/0", "b/q/1", "a/p3/0", "b/q/2", "a/p1/1", "a/p2/1", "a/p3/1", "a/p1/2",
                "a/p2/2", "a/p3/2"
            ]
        );
        assert!(q.is_empty() && q.flows().is_empty());
        q.push_in(0, ("a", "p1"), 2, "x".to_string());
        q.push_in(0, ("a", "p2"), 3, "y".to_string());
        let sizes = q.flows();
        assert_eq!(
            (sizes.len(), sizes[0].requests, sizes[0].bytes),
            (1, 2, 5),
            "one series per group"
        );
    }

    #[test]
    fn a_removed_entry_leaves_no_trace() {
        let mut q = FlowQueue::new();
        let a = q.push(0, "a", 3, 'a');
        let b = q.push(0, "b", 4, 'b');
        let c = q.push(0, "a", 5, 'c');
        assert_eq!(q.remove(b), Some('b'));
        assert_eq!(q.remove(b), None);
        assert_eq!(q.bytes(), 8);
        assert_eq!(q.pop(), Some((a, 'a')));
        assert_eq!(q.remove(c), Some('c'));
        assert!(q.is_empty());
        assert_eq!(q.pop(), None);
        assert_eq!(q.bytes(), 0);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Push { priority: i32, flow: u8, bytes: usize },
        Pop,
        Remove(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (-1i32..3, 0u8..4, 0usize..100).prop_map(|(priority, flow, bytes)| Op::Push { priority, flow, bytes }),
            2 => Just(Op::Pop),
            1 => (0usize..64).prop_map(Op::Remove),
        ]
    }

    proptest! {
        /// Whatever is pushed, popped and removed: a pop takes from the highest band waiting, the oldest of its
        /// flow; two pops of one flow in a band have every other flow of that band that waited throughout served
        /// in between; and the counts of entries and bytes are what is left.
        #[test]
        fn strict_priority_fair_turns_and_exact_counts(ops in proptest::collection::vec(op(), 1..200)) {
            let mut q = FlowQueue::new();
            // id -> (priority, flow, bytes)
            let mut waiting: BTreeMap<u64, (i32, u8, usize)> = BTreeMap::new();
            let mut ids = Vec::new();
            // Per band, the pops since each flow was last served, while the others waited.
            let mut since: HashMap<(i32, u8), HashMap<u8, bool>> = HashMap::new();
            for op in ops {
                match op {
                    Op::Push { priority, flow, bytes } => {
                        let id = q.push(priority, &flow.to_string(), bytes, (priority, flow));
                        waiting.insert(id, (priority, flow, bytes));
                        ids.push(id);
                    }
                    Op::Pop => {
                        let peeked = q.peek().map(|(id, _)| id);
                        let popped = q.pop();
                        prop_assert_eq!(peeked, popped.as_ref().map(|(id, _)| *id));
                        let Some((id, (priority, flow))) = popped else {
                            prop_assert!(waiting.is_empty());
                            continue;
                        };
                        let top = waiting.values().map(|w| w.0).max().unwrap();
                        prop_assert_eq!(priority, top, "a lower band went first");
                        let oldest = waiting.iter().find(|(_, w)| w.0 == priority && w.1 == flow).map(|(id, _)| *id);
                        prop_assert_eq!(Some(id), oldest, "not the oldest of its flow");
                        // Fair turns: every other flow of the band that has waited since this flow's last turn
                        // was served in between.
                        if let Some(others) = since.get(&(priority, flow)) {
                            for (other, served) in others {
                                let still = waiting.values().any(|w| w.0 == priority && w.1 == *other);
                                prop_assert!(*served || !still, "flow {} waited through two turns of {}", other, flow);
                            }
                        }
                        waiting.remove(&id);
                        for ((p, f), others) in since.iter_mut() {
                            if *p == priority && *f != flow {
                                others.insert(flow, true);
                            }
                        }
                        let waiting_others: HashMap<u8, bool> = waiting
                            .values()
                            .filter(|w| w.0 == priority && w.1 != flow)
                            .map(|w| (w.1, false))
                            .collect();
                        since.insert((priority, flow), waiting_others);
                    }
                    Op::Remove(i) => {
                        if let Some(&id) = ids.get(i) {
                            let removed = q.remove(id);
                            let gone = waiting.remove(&id);
                            prop_assert_eq!(removed.is_some(), gone.is_some());
                            // A flow removed to its last entry leaves its turn: what it sends next is new.
                            if let Some((priority, flow, _)) = gone {
                                if !waiting.values().any(|w| w.0 == priority && w.1 == flow) {
                                    for ((p, _), others) in since.iter_mut() {
                                        if *p == priority {
                                            others.insert(flow, true);
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
                prop_assert_eq!(q.len(), waiting.len());
                prop_assert_eq!(q.bytes(), waiting.values().map(|w| w.2).sum::<usize>());
            }
        }
    }
}
