//! The bytes of request bodies held across all requests while they arrive (`max_buffered_body_bytes`).
//!
//! `max_body_bytes` bounds one body; this bounds their sum, so that many clients sending large bodies slowly at
//! once cannot make the process hold `max_in_flight × max_body_bytes`. Each body being read holds a [`Held`] that
//! grows with the bytes kept and gives them back when dropped (the body routed, refused or abandoned, whichever
//! way its task ends). A body that would take the sum past the budget is refused with a 503 at once: the client
//! may retry, and the bodies already arriving are not slowed. `serve` and `epp` share one budget per process.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::common::error::ApiError;

/// The budget: its limit and the bytes held now.
#[derive(Debug)]
pub struct BodyBudget {
    limit: usize,
    used: AtomicUsize,
}

impl BodyBudget {
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self {
            limit,
            used: AtomicUsize::new(0),
        })
    }

    /// Bytes held now, by all bodies.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// A hold of no bytes yet, for one body.
    pub fn hold(self: &Arc<Self>) -> Held {
        Held {
            budget: Arc::clone(self),
            bytes: 0,
        }
    }
}

/// One body's bytes in the budget; given back on drop.
#[derive(Debug)]
pub struct Held {
    budget: Arc<BodyBudget>,
    bytes: usize,
}

impl Held {
    /// Takes `more` bytes, or refuses (taking nothing) when the budget has not that many left.
    pub fn grow(&mut self, more: usize) -> Result<(), ApiError> {
        let budget = &self.budget;
        let taken = budget.used.fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
            used.checked_add(more).filter(|&after| after <= budget.limit)
        });
        match taken {
            Ok(_) => {
                self.bytes += more;
                Ok(())
            }
            Err(_) => Err(ApiError::Unavailable(format!(
                "the gateway is holding its limit of request bodies (max_buffered_body_bytes = {}); retry shortly",
                budget.limit
            ))),
        }
    }

    /// Bytes this hold has taken.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn bodies_share_the_limit_and_give_it_back() {
        let budget = BodyBudget::new(100);
        let mut a = budget.hold();
        let mut b = budget.hold();
        a.grow(60).unwrap();
        let refused = b.grow(41).unwrap_err();
        assert_eq!(refused.status().as_u16(), 503);
        assert!(
            refused.to_string().contains("max_buffered_body_bytes = 100"),
            "{refused}"
        );
        assert_eq!((b.bytes(), budget.used()), (0, 60), "a refusal takes nothing");
        b.grow(40).unwrap();
        assert_eq!(budget.used(), 100);
        drop(a);
        assert_eq!(budget.used(), 40);
        b.grow(60).unwrap();
        drop(b);
        assert_eq!(budget.used(), 0);
        assert!(budget.hold().grow(usize::MAX).is_err(), "no overflow");
    }

    proptest! {
        /// Whatever the holds take and however they end, the sum never passes the limit and all of it comes back.
        #[test]
        fn the_sum_stays_within_the_limit(steps in proptest::collection::vec((0usize..4, 0usize..50, any::<bool>()), 0..60)) {
            let budget = BodyBudget::new(100);
            let mut holds: Vec<Option<Held>> = (0..4).map(|_| Some(budget.hold())).collect();
            for (which, bytes, end) in steps {
                if end {
                    holds[which] = Some(budget.hold());
                } else if let Some(h) = holds[which].as_mut() {
                    let before = budget.used();
                    let ok = h.grow(bytes).is_ok();
                    prop_assert_eq!(ok, before + bytes <= 100);
                }
                let sum: usize = holds.iter().flatten().map(Held::bytes).sum();
                prop_assert_eq!(budget.used(), sum);
                prop_assert!(budget.used() <= 100);
            }
            drop(holds);
            prop_assert_eq!(budget.used(), 0);
        }
    }
}
