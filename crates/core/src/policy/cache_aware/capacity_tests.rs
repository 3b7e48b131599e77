//! Where `cache_aware` places prompts when the index says an endpoint is full: cold placements that would
//! evict nothing, and the charge for what a choice makes an endpoint forget.

use super::*;
use crate::endpoint::Endpoint;
use crate::ticket::dispatch;

#[test]
fn a_cold_prompt_goes_where_it_evicts_nothing() {
    // Room for one 1,800-byte prompt (7 blocks of 256 bytes) per endpoint, not two.
    let snap = Snapshot::new(
        (0..2)
            .map(|r| Endpoint::new(EndpointId::new(r, 0)).with_kv_capacity(640))
            .collect(),
    );
    let text = |agent: u32| format!("You are agent number {agent}. {}", "tools and more ".repeat(118));
    for first in 0..8 {
        let p = CacheAware::default();
        let a = dispatch(&p, &snap, RouteRequest::text(&text(first))).unwrap();
        let a_rank = a.pick.rank;
        drop(a);
        let b = dispatch(&p, &snap, RouteRequest::text(&text(first + 100))).unwrap();
        assert_ne!(b.pick.rank, a_rank, "{first}: {:?}", p.index_stats());
    }
}

#[test]
fn a_choice_pays_for_what_it_makes_a_full_endpoint_forget() {
    // Two endpoints of 10 blocks (16 tokens each); endpoint 0 is full with one prompt. A new prompt shares its first
    // 2 blocks: there it would save 2 blocks of prefill and make endpoint 0 forget 8 of the other prompt's.
    let snap = Snapshot::new(
        (0..2)
            .map(|r| Endpoint::new(EndpointId::new(r, 0)).with_kv_capacity(160))
            .collect(),
    );
    let config = CacheAwareConfig {
        block_tokens: 16,
        ..CacheAwareConfig::default()
    };
    let held: Vec<u32> = (0..160).collect();
    let new: Vec<u32> = (0..32).chain(1000..1128).collect();
    for (weight, expected) in [(1.0, 1), (0.0, 0)] {
        let p = CacheAware::new(CacheAwareConfig {
            eviction_weight: weight,
            ..config
        });
        drop(dispatch(&p, &snap, RouteRequest::tokens(held.clone()).with_override(0)).unwrap());
        let pick = dispatch(&p, &snap, RouteRequest::tokens(new.clone())).unwrap().pick;
        assert_eq!(pick.rank, expected, "eviction_weight {weight}");
    }
}
