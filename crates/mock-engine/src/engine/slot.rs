//! One request's run on its rank: its prefill in the rank's turn, and its [`Slot`], the share of the rank's counters
//! and cache pin that it holds and gives back exactly once, whatever path the request takes (finished, or dropped
//! when its client went away).

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use dprouter_sim::radix::LockId;
use tokio::sync::mpsc;

use super::{Emit, Engine, Rank};

impl Engine {
    /// Prefills `tokens` on the slot's rank in its turn: returns the tokens its cache held, or `None` when the
    /// request went away first.
    pub(super) async fn prefill(&self, slot: &mut Slot, tokens: &[u32], tx: &mpsc::Sender<Emit>) -> Option<usize> {
        let r = &self.ranks[slot.rank];
        let prefill_turn = tokio::select! {
            turn = r.prefill.lock() => turn,
            _ = tx.closed() => return None,
        };
        slot.start_prefill();
        let cached = {
            let mut cache = r.cache();
            let cached = cache.match_prefix(tokens);
            slot.pin = Some(cache.lock(tokens, cached));
            cached
        };
        let service = self.scaled(self.config.cost.prefill(tokens.len() - cached));
        if !service.is_zero() && !wait(tokio::time::sleep(service), tx).await {
            return None;
        }
        {
            let mut cache = r.cache();
            cache.insert(tokens);
            let pin = cache.lock(tokens, tokens.len());
            if let Some(old) = slot.pin.replace(pin) {
                cache.unlock(old);
            }
        }
        slot.end_prefill();
        drop(prefill_turn);
        Some(cached)
    }
}

/// Waits for `fut` unless the receiver goes away first; false when it did.
pub(super) async fn wait(fut: impl std::future::Future<Output = ()>, tx: &mpsc::Sender<Emit>) -> bool {
    tokio::select! {
        _ = fut => true,
        _ = tx.closed() => false,
    }
}

/// One request's share of its rank's counters and cache pin, undone exactly once whatever path the request takes.
pub(super) struct Slot {
    engine: Arc<Engine>,
    rank: usize,
    prompt_tokens: u64,
    stage: Stage,
    pub(super) pin: Option<LockId>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Stage {
    Waiting,
    Prefilling,
    Decoding,
    Finished,
}

impl Slot {
    pub(super) fn new(engine: Arc<Engine>, rank: usize, prompt_tokens: u64) -> Self {
        let r = &engine.ranks[rank];
        r.waiting.fetch_add(1, Relaxed);
        r.pending_tokens.fetch_add(prompt_tokens, Relaxed);
        Self {
            engine,
            rank,
            prompt_tokens,
            stage: Stage::Waiting,
            pin: None,
        }
    }

    pub(super) fn rank(&self) -> &Rank {
        &self.engine.ranks[self.rank]
    }

    pub(super) fn start_prefill(&mut self) {
        self.rank().waiting.fetch_sub(1, Relaxed);
        self.rank().running.fetch_add(1, Relaxed);
        self.engine.stall.prefill_started();
        self.stage = Stage::Prefilling;
    }

    /// A decode server's request got its KV cache: it runs without a prefill of its own.
    pub(super) fn start_decoding(&mut self) {
        self.rank().waiting.fetch_sub(1, Relaxed);
        self.rank().running.fetch_add(1, Relaxed);
        self.rank().pending_tokens.fetch_sub(self.prompt_tokens, Relaxed);
        self.stage = Stage::Decoding;
    }

    pub(super) fn end_prefill(&mut self) {
        self.rank().pending_tokens.fetch_sub(self.prompt_tokens, Relaxed);
        self.engine.stall.prefill_ended();
        self.stage = Stage::Decoding;
    }

    pub(super) fn finish(&mut self) {
        self.rank().running.fetch_sub(1, Relaxed);
        self.engine.completed.fetch_add(1, Relaxed);
        self.stage = Stage::Finished;
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let r = &self.engine.ranks[self.rank];
        match self.stage {
            Stage::Finished => return,
            Stage::Waiting => {
                r.waiting.fetch_sub(1, Relaxed);
                r.pending_tokens.fetch_sub(self.prompt_tokens, Relaxed);
            }
            Stage::Prefilling => {
                r.running.fetch_sub(1, Relaxed);
                r.pending_tokens.fetch_sub(self.prompt_tokens, Relaxed);
                self.engine.stall.prefill_ended();
            }
            Stage::Decoding => {
                r.running.fetch_sub(1, Relaxed);
            }
        }
        if let Some(pin) = self.pin.take() {
            r.cache().unlock(pin);
        }
        self.engine.aborted.fetch_add(1, Relaxed);
    }
}
