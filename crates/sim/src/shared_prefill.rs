//! When prefills end, when the ranks' prefills share compute (`prefill_contention`).
//!
//! Under expert parallelism (the seed's tp16/dp16/ep16) every rank's MoE layers run on experts spread over all the
//! GPUs, so prefills on different ranks are not independent: the tokens of every rank's prefill pass through the
//! same experts. The model: while `k` ranks prefill, each prefill advances at `1 / (1 + contention · (k − 1))` of
//! its own speed. `contention` 0 is independent ranks (each prefill takes its service time); 1 is one pool shared by
//! all (k prefills together take as long as the k one after another). A prefill's end moves whenever another
//! starts or ends, so each start and end gives new due times for the prefills in progress, numbered so the
//! simulator can drop the ones they replace.
//!
//! Cost: O(ranks prefilling) per start and end; with `contention` 0 nothing moves, O(1).

use crate::cost::Micros;

#[derive(Debug, Clone, Copy, PartialEq)]
struct Active {
    rank: usize,
    /// Its own service time still to do, microseconds.
    remaining: f64,
    version: u64,
}

/// The prefills in progress and how fast each advances; see the module documentation.
#[derive(Debug, Default)]
pub struct SharedPrefill {
    contention: f64,
    active: Vec<Active>,
    /// When `remaining` was last brought up to date.
    at: Micros,
    versions: u64,
}

/// A prefill's (new) due time: at `at`, the prefill of `rank` numbered `version` ends unless a later due time
/// replaced it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Due {
    pub at: Micros,
    pub rank: usize,
    pub version: u64,
}

impl SharedPrefill {
    pub fn new(contention: f64) -> Self {
        Self {
            contention: contention.max(0.0),
            ..Self::default()
        }
    }

    fn speed(&self) -> f64 {
        1.0 / (1.0 + self.contention * self.active.len().saturating_sub(1) as f64)
    }

    fn advance(&mut self, now: Micros) {
        let elapsed = now.saturating_sub(self.at) as f64 * self.speed();
        for a in &mut self.active {
            a.remaining = (a.remaining - elapsed).max(0.0);
        }
        self.at = self.at.max(now);
    }

    /// The due times of every prefill in progress (all move when the number of prefills changes).
    fn all_due(&mut self, now: Micros) -> Vec<Due> {
        let speed = self.speed();
        self.active
            .iter_mut()
            .map(|a| {
                self.versions += 1;
                a.version = self.versions;
                Due {
                    at: now + (a.remaining / speed).ceil() as Micros,
                    rank: a.rank,
                    version: a.version,
                }
            })
            .collect()
    }

    /// `rank` starts a prefill of `service` microseconds of its own at `now`: the due times to schedule.
    pub fn start(&mut self, rank: usize, service: Micros, now: Micros) -> Vec<Due> {
        self.advance(now);
        self.versions += 1;
        let started = Active {
            rank,
            remaining: service as f64,
            version: self.versions,
        };
        self.active.push(started);
        if self.contention == 0.0 {
            return vec![Due {
                at: now + service,
                rank,
                version: started.version,
            }];
        }
        self.all_due(now)
    }

    /// The prefill numbered `version` came due at `now`: `None` if a later due time replaced it, else it ended:
    /// its rank, and the new due times of the others.
    pub fn end(&mut self, version: u64, now: Micros) -> Option<(usize, Vec<Due>)> {
        let i = self.active.iter().position(|a| a.version == version)?;
        self.advance(now);
        let ended = self.active.swap_remove(i);
        if self.contention == 0.0 {
            return Some((ended.rank, Vec::new()));
        }
        Some((ended.rank, self.all_due(now)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs prefills of `services` starting at `starts` on ranks 0, 1, … to the end; returns each one's end.
    fn run(contention: f64, starts: &[Micros], services: &[Micros]) -> Vec<Micros> {
        let mut shared = SharedPrefill::new(contention);
        let mut pending: Vec<Due> = Vec::new();
        let mut ends = vec![0; starts.len()];
        let mut next_start = 0;
        loop {
            let due = pending.iter().copied().min_by_key(|d| (d.at, d.version));
            if let Some(&s) = starts.get(next_start).filter(|&&s| due.is_none_or(|d| s < d.at)) {
                pending.extend(shared.start(next_start, services[next_start], s));
                next_start += 1;
                continue;
            }
            let Some(d) = due else { return ends };
            pending.retain(|p| p.version != d.version);
            if let Some((rank, moved)) = shared.end(d.version, d.at) {
                ends[rank] = d.at;
                pending.retain(|p| !moved.iter().any(|m| m.rank == p.rank));
                pending.extend(moved);
            }
        }
    }

    #[test]
    fn independent_ranks_take_their_service_times() {
        assert_eq!(run(0.0, &[0, 100, 150], &[1_000, 500, 2_000]), vec![1_000, 600, 2_150]);
    }

    #[test]
    fn one_shared_pool_takes_as_long_as_the_prefills_one_after_another() {
        // Two prefills of 1 s together: both at half speed, both end at 2 s.
        assert_eq!(run(1.0, &[0, 0], &[1_000_000, 1_000_000]), vec![2_000_000, 2_000_000]);
        // The second starts half-way through the first: the first has 0.5 s left at half speed (ends at 1.5 s),
        // the second did 0.5 s of its 1 s by then, and ends alone at 2 s.
        assert_eq!(
            run(1.0, &[0, 500_000], &[1_000_000, 1_000_000]),
            vec![1_500_000, 2_000_000]
        );
    }

    #[test]
    fn partial_contention_lies_in_between() {
        // Half contention: two together each advance at 2/3 speed; 1 s each ends at 1.5 s.
        assert_eq!(run(0.5, &[0, 0], &[1_000_000, 1_000_000]), vec![1_500_000, 1_500_000]);
    }
}
