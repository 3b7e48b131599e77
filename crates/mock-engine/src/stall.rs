//! The engine-wide decode clock behind `prefill_stalls_decode` (the simulator's
//! [`DecodeClock`](dprouter_sim::decode_clock::DecodeClock) in real time): with it, decode time stands still
//! while any rank prefills, as under SGLang's DP attention, where every rank runs each forward pass; without it,
//! decode time is real time.

use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

pub struct DecodeStall {
    enabled: bool,
    epoch: Instant,
    state: Mutex<State>,
    /// Bumped whenever decode stops or resumes, waking waiters to recompute.
    changed: watch::Sender<u64>,
}

#[derive(Default)]
struct State {
    prefilling: usize,
    /// Since when some rank has been prefilling.
    stalled_since: Option<Instant>,
    /// Stalled time before `stalled_since`.
    stalled: Duration,
}

impl DecodeStall {
    pub fn new(enabled: bool) -> Self {
        Self {
            enabled,
            epoch: Instant::now(),
            state: Mutex::new(State::default()),
            changed: watch::Sender::new(0),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A rank began prefilling.
    pub fn prefill_started(&self) {
        if !self.enabled {
            return;
        }
        let mut s = self.state();
        s.prefilling += 1;
        if s.prefilling == 1 {
            s.stalled_since = Some(Instant::now());
            self.changed.send_modify(|g| *g += 1);
        }
    }

    /// A rank stopped prefilling (finished, or its request was aborted).
    pub fn prefill_ended(&self) {
        if !self.enabled {
            return;
        }
        let mut s = self.state();
        s.prefilling = s.prefilling.saturating_sub(1);
        if s.prefilling == 0 {
            if let Some(since) = s.stalled_since.take() {
                s.stalled += since.elapsed();
            }
            self.changed.send_modify(|g| *g += 1);
        }
    }

    /// Decode time elapsed at `now`, and whether decode is stalled now.
    fn at(&self, now: Instant) -> (Duration, bool) {
        let s = self.state();
        let current = s
            .stalled_since
            .map_or(Duration::ZERO, |since| now.saturating_duration_since(since));
        (
            now.saturating_duration_since(self.epoch)
                .saturating_sub(s.stalled + current),
            s.stalled_since.is_some(),
        )
    }

    /// Decode time now.
    pub fn now(&self) -> Duration {
        self.at(Instant::now()).0
    }

    /// Returns once decode time reaches `target` (at once if it is less than a millisecond away: timers tick in
    /// milliseconds).
    pub async fn until(&self, target: Duration) {
        let mut changed = self.changed.subscribe();
        loop {
            changed.mark_unchanged();
            let now = Instant::now();
            let (elapsed, stalled) = self.at(now);
            let Some(left) = target.checked_sub(elapsed).filter(|d| *d > Duration::from_millis(1)) else {
                return;
            };
            if stalled {
                // The sender lives as long as `self`.
                let _ = changed.changed().await;
            } else {
                tokio::select! {
                    _ = tokio::time::sleep_until(now + left) => return,
                    _ = changed.changed() => {}
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn decode_time_stands_still_while_any_rank_prefills() {
        let stall = DecodeStall::new(true);
        tokio::time::advance(Duration::from_millis(100)).await;
        stall.prefill_started();
        stall.prefill_started();
        tokio::time::advance(Duration::from_millis(50)).await;
        stall.prefill_ended();
        tokio::time::advance(Duration::from_millis(50)).await;
        assert_eq!(
            stall.now(),
            Duration::from_millis(100),
            "two prefills, one still running"
        );
        stall.prefill_ended();
        let started = Instant::now();
        stall.until(Duration::from_millis(300)).await;
        assert_eq!(started.elapsed(), Duration::from_millis(200));
    }

    #[tokio::test(start_paused = true)]
    async fn a_prefill_starting_mid_wait_extends_it() {
        let stall = std::sync::Arc::new(DecodeStall::new(true));
        let prefill = {
            let stall = std::sync::Arc::clone(&stall);
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(10)).await;
                stall.prefill_started();
                tokio::time::sleep(Duration::from_millis(30)).await;
                stall.prefill_ended();
            })
        };
        let started = Instant::now();
        stall.until(Duration::from_millis(50)).await;
        assert_eq!(started.elapsed(), Duration::from_millis(80));
        prefill.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn disabled_it_is_real_time() {
        let stall = DecodeStall::new(false);
        stall.prefill_started();
        let started = Instant::now();
        stall.until(Duration::from_millis(40)).await;
        assert_eq!(started.elapsed(), Duration::from_millis(40));
    }
}
