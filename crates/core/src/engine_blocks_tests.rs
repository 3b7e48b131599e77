//! Tests of following an engine's KV events into router blocks.

use super::*;
use crate::hashing::block_hashes;
use crate::request::Prompt;
use proptest::prelude::*;

fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32], block_size: u32) -> KvEvent {
    KvEvent::Stored {
        hashes: hashes.to_vec(),
        parent,
        tokens: tokens.to_vec(),
        block_size,
        medium: None,
        plain: true,
    }
}

fn removed(hashes: &[u64]) -> KvEvent {
    KvEvent::Removed {
        hashes: hashes.to_vec(),
        medium: Some("GPU".into()),
        plain: true,
    }
}

fn router_blocks(tokens: &[u32], block: usize) -> Vec<u64> {
    let mut out = Vec::new();
    block_hashes(&Prompt::Tokens(tokens.to_vec()), block, &mut out);
    out
}

/// A change's blocks, and its tails as (seed, tokens).
fn parts(change: Result<Option<CacheChange>, FollowError>) -> (Vec<u64>, Vec<(u64, Vec<u32>)>) {
    match change {
        Ok(Some(CacheChange::Stored { blocks, tails, .. } | CacheChange::Removed { blocks, tails })) => {
            (blocks, tails.iter().map(|t| (t.seed, t.tokens().to_vec())).collect())
        }
        other => panic!("not a store or a removal: {other:?}"),
    }
}

#[test]
fn one_token_pages_gather_into_router_blocks() {
    // SGLang with page size 1: ten tokens in one event, then three more continuing from the tenth.
    let tokens: Vec<u32> = (100..113).collect();
    let mut blocks = EngineBlocks::new(4, 1000);
    let mut tails = HeldTails::default();
    let first = blocks.apply(&stored(&(0..10).collect::<Vec<_>>(), None, &tokens[..10], 1));
    tails.apply(first.as_ref().unwrap().as_ref().unwrap());
    let expected = router_blocks(&tokens, 4);
    let (got, got_tails) = parts(first);
    assert_eq!(got, expected[..2]);
    // Every page that does not end on a router boundary is a tail: three from the start, three after the first
    // router block, two after the second.
    assert_eq!(got_tails.len(), 8);
    assert_eq!(got_tails[7], (expected[1], vec![108, 109]));
    assert_eq!(tails.longest(expected[1], &[108, 109, 110, 111]), 2);
    assert_eq!(tails.longest(expected[1], &[108, 999]), 1);
    let next = blocks.apply(&stored(&[10, 11, 12], Some(9), &tokens[10..], 1));
    assert_eq!(
        parts(next),
        (
            expected[2..3].to_vec(),
            vec![(expected[1], vec![108, 109, 110]), (expected[2], vec![112])]
        )
    );
    // Removing the page that completed the third router block removes it; a page in the middle of a router
    // block removes its tail alone.
    assert_eq!(parts(blocks.apply(&removed(&[11]))), (vec![expected[2]], vec![]));
    let change = blocks.apply(&removed(&[9, 999]));
    tails.apply(change.as_ref().unwrap().as_ref().unwrap());
    assert_eq!(parts(change), (vec![], vec![(expected[1], vec![108, 109])]));
    assert_eq!(
        tails.longest(expected[1], &[108, 109, 110, 111]),
        1,
        "the page before it stays"
    );
    assert_eq!(parts(blocks.apply(&removed(&[7]))), (vec![expected[1]], vec![]));
    tails.apply(&CacheChange::Cleared);
    assert!(tails.is_empty());
}

#[test]
fn tails_whose_keys_collide_are_both_held() {
    let tail = |tokens: &[u32]| Tail {
        seed: 9,
        run: tokens.into(),
        from: 0,
        len: tokens.len() as u32,
    };
    let (a, b) = (tail(&[1, 2]), tail(&[3, 4]));
    let mut held = HeldTails::default();
    // Both under one key, as if their 64-bit keys collided.
    assert!(held.add(7, &a));
    assert!(held.add(7, &b));
    assert!(!held.add(7, &b), "counted twice");
    assert!(held.drop(7, &a));
    assert!(!held.drop(7, &b));
    assert!(held.drop(7, &b));
    assert!(!held.drop(7, &b), "no longer held");
    assert!(held.tails.is_empty() && held.collided.is_empty());
}

#[test]
fn large_engine_blocks_complete_several_router_blocks() {
    let tokens: Vec<u32> = (0..48).collect();
    let mut blocks = EngineBlocks::new(8, 1000);
    let expected = router_blocks(&tokens, 8);
    let got = blocks.apply(&stored(&[1, 2], None, &tokens[..32], 16));
    assert_eq!(parts(got), (expected[..4].to_vec(), vec![]));
    assert_eq!(parts(blocks.apply(&removed(&[2]))), (expected[2..4].to_vec(), vec![]));
    // Engine blocks of 16 tokens over router blocks of 12: the second ends 8 tokens into the third.
    let mut blocks = EngineBlocks::new(12, 1000);
    let expected = router_blocks(&tokens, 12);
    let got = blocks.apply(&stored(&[1, 2], None, &tokens[..32], 16));
    assert_eq!(
        parts(got),
        (
            expected[..2].to_vec(),
            vec![(expected[0], vec![12, 13, 14, 15]), (expected[1], (24..32).collect())]
        )
    );
}

#[test]
fn what_cannot_be_followed_is_said() {
    let mut blocks = EngineBlocks::new(4, 3);
    assert_eq!(
        blocks.apply(&stored(&[1], Some(77), &[1, 2, 3, 4], 4)),
        Err(FollowError::Orphan)
    );
    assert_eq!(
        blocks.apply(&stored(&[1, 2, 3, 4], None, &[0; 16], 4)),
        Err(FollowError::TooMany(3))
    );
    let cpu = KvEvent::Stored {
        hashes: vec![1],
        parent: None,
        tokens: vec![1, 2, 3, 4],
        block_size: 4,
        medium: Some("CPU".into()),
        plain: true,
    };
    assert_eq!(blocks.apply(&cpu), Ok(None), "another medium's copy");
    assert!(blocks.is_empty());
    // Fewer tokens than blocks: only the whole blocks are followed.
    assert!(blocks.apply(&stored(&[1, 2], None, &[1, 2, 3, 4, 5], 4)).is_ok());
    assert_eq!(blocks.len(), 1);
    assert_eq!(blocks.apply(&KvEvent::Cleared), Ok(Some(CacheChange::Cleared)));
    assert!(blocks.is_empty());
}

proptest! {
    /// A sequence stored in events of any sizes, with any engine and router block sizes, gives exactly the
    /// router blocks a prompt of the same tokens hashes to.
    #[test]
    fn any_split_gives_the_prompts_blocks(
        len in 0usize..300,
        engine in 1usize..20,
        router in 1usize..40,
        cuts in proptest::collection::vec(1usize..60, 1..10),
    ) {
        let tokens: Vec<u32> = (0..len as u32).map(|i| i.wrapping_mul(2_654_435_761) >> 8).collect();
        let whole = len / engine;
        let mut blocks = EngineBlocks::new(router, usize::MAX);
        let mut got = Vec::new();
        let (mut done, mut next_hash, mut parent) = (0usize, 1000u64, None);
        for cut in cuts.iter().cycle() {
            if done == whole {
                break;
            }
            let n = (*cut).min(whole - done);
            let hashes: Vec<u64> = (next_hash..next_hash + n as u64).collect();
            let change = blocks
                .apply(&stored(&hashes, parent, &tokens[done * engine..(done + n) * engine], engine as u32))
                .unwrap();
            if let Some(CacheChange::Stored { blocks: h, .. }) = change {
                got.extend(h);
            }
            parent = hashes.last().copied();
            next_hash += n as u64;
            done += n;
        }
        prop_assert_eq!(got, router_blocks(&tokens[..whole * engine], router));
    }
}
