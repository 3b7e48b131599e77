//! One endpoint's KV event feed, without its I/O: the batches' sequence checked, their events followed into the
//! router's blocks ([`EngineBlocks`]), and what the policies must do handed on.
//!
//! Engines number their event batches from 0 and restart from 0 when they restart. [`classify`] tells, from the
//! last batch applied, whether the next one applies, was seen already, follows a gap, is the first one seen of a
//! running engine (a join), or comes from a restarted engine (its number went back and its time forward). What to
//! do about a gap or a join depends on what can reach the engine: the gateway asks the engine's replay endpoint
//! for the missing batches (`crates/gateway/src/kv_feeds/mod.rs`); a caller with no replay calls
//! [`Feed::receive_without_replay`], for which a gap makes the endpoint approximate until its next stored blocks,
//! and a restart empties it. Both use the same [`Feed`]: one decoder, one follower, one set of rules.

use crate::engine_blocks::{CacheChange, EngineBlocks, FollowError};
use crate::kv_events::{decode_batch, DecodeError, EventBatch};

/// Engine blocks followed per endpoint at most: 16M tokens of vLLM's 16-token blocks, 1M of SGLang's one-token
/// pages (a large rank's whole cache). An engine block costs 170 to 340 bytes in the follower and 270 to 630 with
/// one policy's index (`tests/follow_memory.rs`): at most about 660 MB per endpoint at the cap.
pub const MAX_ENGINE_BLOCKS: usize = 1 << 20;

/// What to do with a batch, given the last one applied.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    Apply,
    /// Already applied (a replay and the live stream overlap).
    Duplicate,
    /// The engine restarted: its cache is empty; its batches from 0 are replayed, then this one applies.
    Restart,
    /// The first batch seen, not the engine's first: the earlier ones are replayed first, if the engine has them.
    Join,
    /// Batches `from..to` were missed: replay them first.
    Gap {
        from: u64,
        to: u64,
    },
}

/// Checks a batch's sequence number `seq` and time `ts` against the last batch applied.
pub fn classify(last: Option<(u64, f64)>, seq: u64, ts: f64) -> Verdict {
    match last {
        None if seq > 0 => Verdict::Join,
        None => Verdict::Apply,
        Some((last, last_ts)) if seq <= last => {
            if ts > last_ts {
                Verdict::Restart
            } else {
                Verdict::Duplicate
            }
        }
        Some((last, _)) if seq > last + 1 => Verdict::Gap {
            from: last + 1,
            to: seq,
        },
        Some(_) => Verdict::Apply,
    }
}

/// What applying one batch found.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Applied {
    /// Stored blocks whose parent was never seen (not followed).
    pub orphans: u64,
    /// The endpoint passed the most engine blocks followed: it is approximate now.
    pub overflow: bool,
    /// At least one change made the endpoint's blocks known (precise).
    pub precise: bool,
}

/// What [`Feed::receive_without_replay`] did with a batch.
#[derive(Debug, Clone, PartialEq)]
pub enum Received {
    Applied(Applied),
    Duplicate,
    /// The engine restarted: the endpoint was emptied, then the batch applied.
    Restarted(Applied),
    /// Batches were missed (or the feed joined a running engine): the endpoint is approximate, and the batch
    /// applied.
    Gap {
        missed: u64,
        applied: Applied,
    },
    /// The batch could not be read: the endpoint is approximate.
    Undecodable(DecodeError),
}

/// One endpoint's feed: its engine blocks, followed, and the last batch applied.
#[derive(Debug)]
pub struct Feed {
    blocks: EngineBlocks,
    /// The last sequence number applied, and its batch's time.
    last: Option<(u64, f64)>,
}

impl Feed {
    /// A feed following events into router blocks of `block_tokens`, for at most `max_blocks` engine blocks.
    pub fn new(block_tokens: usize, max_blocks: usize) -> Self {
        Self {
            blocks: EngineBlocks::new(block_tokens, max_blocks),
            last: None,
        }
    }

    /// The last batch applied: its sequence number and time.
    pub fn last(&self) -> Option<(u64, f64)> {
        self.last
    }

    /// Marks batch `seq` as seen without applying it (it could not be read), keeping the last time.
    pub fn skip(&mut self, seq: u64) {
        let ts = self.last.map_or(0.0, |(_, ts)| ts);
        self.last = Some((seq, ts));
    }

    /// Starts over: no batch applied (after a restart, before its batches are replayed).
    pub fn forget_sequence(&mut self) {
        self.last = None;
    }

    /// Engine blocks followed.
    pub fn engine_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Router blocks the endpoint holds, as its events tell.
    pub fn router_blocks(&self) -> usize {
        self.blocks.router_blocks()
    }

    pub fn verdict(&self, seq: u64, ts: f64) -> Verdict {
        classify(self.last, seq, ts)
    }

    /// Applies batch `seq`, handing every change to `deliver`. On overflow the endpoint becomes approximate
    /// (`deliver` gets [`CacheChange::Untracked`]).
    pub fn apply(&mut self, seq: u64, batch: &EventBatch, mut deliver: impl FnMut(&CacheChange)) -> Applied {
        self.last = Some((seq, batch.ts));
        let mut applied = Applied::default();
        for event in &batch.events {
            match self.blocks.apply(event) {
                Ok(Some(change)) => {
                    deliver(&change);
                    applied.precise |= !matches!(change, CacheChange::Untracked);
                }
                Ok(None) => {}
                Err(FollowError::Orphan) => applied.orphans += 1,
                Err(FollowError::TooMany(_)) => applied.overflow = true,
            }
        }
        if applied.overflow {
            self.untrack(deliver);
            applied.precise = false;
        }
        applied
    }

    /// The engine's cache is empty (it restarted): so is the endpoint's.
    pub fn clear(&mut self, mut deliver: impl FnMut(&CacheChange)) {
        self.blocks.clear();
        deliver(&CacheChange::Cleared);
    }

    /// Events were lost: the endpoint is approximate until the next stored blocks, followed afresh.
    pub fn untrack(&mut self, mut deliver: impl FnMut(&CacheChange)) {
        self.blocks.clear();
        deliver(&CacheChange::Untracked);
    }

    /// Receives batch `seq` where no replay can fill a gap: a gap or a join makes the endpoint approximate (the
    /// engine's earlier blocks are unknown) and the batch applies; a restart empties the endpoint first; an
    /// undecodable batch makes it approximate.
    pub fn receive_without_replay(
        &mut self,
        seq: u64,
        payload: &[u8],
        mut deliver: impl FnMut(&CacheChange),
    ) -> Received {
        let batch = match decode_batch(payload) {
            Ok(batch) => batch,
            Err(e) => {
                self.untrack(&mut deliver);
                self.skip(seq);
                return Received::Undecodable(e);
            }
        };
        match self.verdict(seq, batch.ts) {
            Verdict::Apply => Received::Applied(self.apply(seq, &batch, deliver)),
            Verdict::Duplicate => Received::Duplicate,
            Verdict::Restart => {
                self.clear(&mut deliver);
                self.forget_sequence();
                Received::Restarted(self.apply(seq, &batch, deliver))
            }
            Verdict::Join => Received::Gap {
                missed: seq,
                applied: self.apply(seq, &batch, deliver),
            },
            Verdict::Gap { from, to } => {
                self.untrack(&mut deliver);
                Received::Gap {
                    missed: to - from,
                    applied: self.apply(seq, &batch, deliver),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rmpv::Value;

    #[test]
    fn sequences_tell_gaps_duplicates_and_restarts() {
        assert_eq!(classify(None, 0, 1.0), Verdict::Apply);
        assert_eq!(classify(None, 5, 1.0), Verdict::Join);
        assert_eq!(classify(Some((4, 1.0)), 5, 1.0), Verdict::Apply);
        assert_eq!(classify(Some((4, 1.0)), 9, 2.0), Verdict::Gap { from: 5, to: 9 });
        assert_eq!(
            classify(Some((9, 2.0)), 7, 1.5),
            Verdict::Duplicate,
            "an older batch seen again"
        );
        assert_eq!(classify(Some((9, 2.0)), 9, 2.0), Verdict::Duplicate);
        assert_eq!(
            classify(Some((9, 2.0)), 0, 3.0),
            Verdict::Restart,
            "numbered from 0 again, and newer"
        );
    }

    /// A batch at time `ts` storing one 4-token block `hash` after `parent` (vLLM's positional encoding).
    fn batch(ts: f64, hash: u64, parent: Option<u64>) -> Vec<u8> {
        let tokens: Vec<Value> = (0..4).map(|t| Value::from(hash * 10 + t)).collect();
        let stored = Value::Array(vec![
            "BlockStored".into(),
            Value::Array(vec![Value::from(hash)]),
            parent.map_or(Value::Nil, Value::from),
            Value::Array(tokens),
            Value::from(4),
            Value::Nil,
        ]);
        let batch = Value::Array(vec![Value::F64(ts), Value::Array(vec![stored])]);
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, &batch).expect("encoded");
        out
    }

    fn changes(feed: &mut Feed, seq: u64, payload: &[u8]) -> (Received, Vec<CacheChange>) {
        let mut seen = Vec::new();
        let received = feed.receive_without_replay(seq, payload, |c| seen.push(c.clone()));
        (received, seen)
    }

    #[test]
    fn without_a_replay_gaps_go_approximate_and_restarts_empty_the_endpoint() {
        let mut feed = Feed::new(4, 100);
        let (r, c) = changes(&mut feed, 0, &batch(1.0, 1, None));
        assert!(matches!(r, Received::Applied(Applied { precise: true, .. })), "{r:?}");
        assert!(matches!(c[..], [CacheChange::Stored { .. }]), "{c:?}");
        assert_eq!((feed.engine_blocks(), feed.last()), (1, Some((0, 1.0))));
        // The same batch again.
        assert_eq!(changes(&mut feed, 0, &batch(1.0, 1, None)).0, Received::Duplicate);
        // Batches 1 and 2 missed: approximate first, then the batch (whose parent was lost with them).
        let (r, c) = changes(&mut feed, 3, &batch(2.0, 3, Some(2)));
        assert!(
            matches!(
                r,
                Received::Gap {
                    missed: 2,
                    applied: Applied { orphans: 1, .. }
                }
            ),
            "{r:?}"
        );
        assert!(matches!(c[..], [CacheChange::Untracked]), "{c:?}");
        // Numbered from 0 again, later: a restart empties the endpoint.
        let (r, c) = changes(&mut feed, 0, &batch(3.0, 7, None));
        assert!(matches!(r, Received::Restarted(Applied { precise: true, .. })), "{r:?}");
        assert!(
            matches!(c[..], [CacheChange::Cleared, CacheChange::Stored { .. }]),
            "{c:?}"
        );
        // Not msgpack: approximate, and the sequence moves on.
        let (r, c) = changes(&mut feed, 1, b"\xc1");
        assert!(matches!(r, Received::Undecodable(_)), "{r:?}");
        assert!(matches!(c[..], [CacheChange::Untracked]), "{c:?}");
        assert_eq!(feed.last(), Some((1, 3.0)));
    }

    #[test]
    fn an_overflow_makes_the_endpoint_approximate() {
        let mut feed = Feed::new(4, 1);
        changes(&mut feed, 0, &batch(1.0, 1, None));
        let (r, c) = changes(&mut feed, 1, &batch(1.5, 2, Some(1)));
        assert!(
            matches!(
                r,
                Received::Applied(Applied {
                    overflow: true,
                    precise: false,
                    ..
                })
            ),
            "{r:?}"
        );
        assert!(matches!(c.last(), Some(CacheChange::Untracked)), "{c:?}");
        assert_eq!(feed.engine_blocks(), 0);
    }
}
