//! `cache_aware` when the endpoints' prefills share compute (`prefill_contention`, expert parallelism): a prefill
//! runs slower while other endpoints prefill, so its predicted time grows by `prefill_contention` times the time it
//! overlaps the prefill work queued at each other endpoint.
//!
//! Cost: O(n log n) per decision to sort the other endpoints' queued work, O(log n) per candidate; nothing when
//! `prefill_contention` is 0.

/// The endpoints' queued prefill work, microseconds, sorted, with prefix sums.
#[derive(Debug, Default)]
pub(super) struct Overlap {
    sorted: Vec<u64>,
    /// `prefix[i]`: the sum of the `i` smallest.
    prefix: Vec<u64>,
}

impl Overlap {
    pub(super) fn new(mut work: Vec<u64>) -> Self {
        work.sort_unstable();
        let mut prefix = Vec::with_capacity(work.len() + 1);
        prefix.push(0u64);
        for &w in &work {
            prefix.push(prefix[prefix.len() - 1].saturating_add(w));
        }
        Self { sorted: work, prefix }
    }

    /// How long a prefill of `t` microseconds overlaps every endpoint's queued work: Σ min(t, work).
    pub(super) fn with_all(&self, t: u64) -> u64 {
        let shorter = self.sorted.partition_point(|&w| w < t);
        self.prefix[shorter].saturating_add(t.saturating_mul((self.sorted.len() - shorter) as u64))
    }

    /// [`Overlap::with_all`] less the endpoint's own queued `work`.
    pub(super) fn with_others(&self, t: u64, work: u64) -> u64 {
        self.with_all(t).saturating_sub(t.min(work))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::Snapshot;
    use crate::policy::{Branch, CacheAware, CacheAwareConfig};
    use crate::request::RouteRequest;
    use crate::ticket::dispatch;
    use proptest::prelude::*;

    #[test]
    fn a_cold_prefill_that_would_share_compute_waits_for_the_prefix_instead() {
        // A 5,010-token prompt is queued on one endpoint (1 + 5.01 s). A second one sharing its first 5,000 tokens
        // takes 6.01 + 1.01 s there, 6.01 s cold on the idle endpoint: it goes cold on independent ranks. When the
        // two prefills would share one pool, the cold one also runs at half speed while the first is queued
        // (6.01 s more), so it waits for the prefix.
        for (contention, second) in [(0.0, Branch::Spill), (1.0, Branch::Hit)] {
            let snap = Snapshot::single_worker(2);
            let p = CacheAware::new(CacheAwareConfig {
                block_tokens: 10,
                prefill_tokens_per_s: 1000.0,
                base_ms: 1000.0,
                congestion_weight: 0.0,
                prefill_contention: contention,
                ..CacheAwareConfig::default()
            });
            let shared: Vec<u32> = (0..5000).collect();
            let a = dispatch(&p, &snap, RouteRequest::tokens([shared.clone(), vec![1; 10]].concat())).unwrap();
            let b = dispatch(&p, &snap, RouteRequest::tokens([shared, vec![2; 10]].concat())).unwrap();
            assert_eq!(
                (a.pick.branch, b.pick.branch),
                (Branch::Cold, second),
                "contention {contention}"
            );
        }
    }

    proptest! {
        #[test]
        fn overlap_is_the_sum_of_minimums(work in proptest::collection::vec(0u64..1_000, 0..20), t in 0u64..1_200) {
            let overlap = Overlap::new(work.clone());
            prop_assert_eq!(overlap.with_all(t), work.iter().map(|&w| w.min(t)).sum::<u64>());
            if let Some(&own) = work.first() {
                let others: u64 = work[1..].iter().map(|&w| w.min(t)).sum();
                prop_assert_eq!(overlap.with_others(t, own), others);
            }
        }
    }
}
