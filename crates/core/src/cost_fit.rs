//! Prefill costs learned from an endpoint's own first tokens.
//!
//! An engine prefills a request's uncached prompt tokens in about `base + per_token · uncached`; `cache_aware`
//! predicts time to first token from those two numbers, and they differ by engine, model, GPU and load. Each
//! endpoint therefore fits them online: every request whose first token the router saw come (a stream's first
//! token at a gateway; inside an engine, the engine's own) and whose usage the engine reported gives one sample,
//! `(uncached tokens, service time)`, where the service time is how long the endpoint worked on it: from when it
//! could start (its arrival, or the previous first token there, whichever is later) to its own first token
//! ([`crate::load::LoadGuard::first_token`]). Queueing behind other requests is not in it. An answer sent whole
//! gives none: its first byte comes after its whole decode ([`crate::Ticket::whole_answer`]).
//! An engine that leaves its cached tokens out of its usage (vLLM without `--enable-prompt-tokens-details`)
//! reports none cached, so its samples count every prompt token as prefilled: run it with the flag.
//!
//! The fit is Theil–Sen over the last [`WINDOW`] samples: the slope is the median of the slopes between pairs of
//! samples whose token counts differ by at least [`MIN_SPREAD`] tokens, the intercept the median of `service −
//! slope · tokens`. Medians make it robust: up to about a quarter of the samples may be anything (a request that
//! waited on a batch, a stalled engine, a clock jump) without moving it much, and the window makes it follow an
//! engine whose speed drifts. It is refitted every [`REFIT_EVERY`] samples, and is `None` until it has
//! [`MIN_SAMPLES`] samples and [`MIN_PAIRS`] pairs far enough apart (a fleet that only sends one prompt length
//! cannot tell the base from the rate), or if the slope it finds is not positive. Cost: O(1) per sample, O(WINDOW²)
//! per refit (8,128 pairs, tens of microseconds) once per [`REFIT_EVERY`] samples; memory 16 bytes per sample.

/// Samples the fit keeps.
pub const WINDOW: usize = 128;
/// Samples before the fit is used.
pub const MIN_SAMPLES: usize = 8;
/// Pairs with different enough token counts before the fit is used.
pub const MIN_PAIRS: usize = 12;
/// Two samples' token counts must differ by this much for their slope to count.
pub const MIN_SPREAD: u64 = 32;
/// Samples between refits.
pub const REFIT_EVERY: usize = 8;

/// An endpoint's fitted prefill costs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FittedCosts {
    /// Fixed time per prefill, microseconds.
    pub base_us: f64,
    /// Time per uncached prompt token, microseconds.
    pub us_per_token: f64,
    /// Samples the fit was made from.
    pub samples: usize,
}

impl FittedCosts {
    /// The prefill rate, tokens per second.
    pub fn tokens_per_s(&self) -> f64 {
        1e6 / self.us_per_token
    }
}

/// The online fit; see the module documentation.
#[derive(Debug, Default, Clone)]
pub struct CostFit {
    samples: Vec<(u64, u64)>,
    /// Where the next sample goes once the window is full.
    next: usize,
    since_refit: usize,
    fitted: Option<FittedCosts>,
}

impl CostFit {
    /// One request: `tokens` uncached prompt tokens took `service_us` to prefill.
    pub fn add(&mut self, tokens: u64, service_us: u64) {
        if self.samples.len() < WINDOW {
            self.samples.push((tokens, service_us));
        } else {
            self.samples[self.next] = (tokens, service_us);
            self.next = (self.next + 1) % WINDOW;
        }
        self.since_refit += 1;
        if self.since_refit >= REFIT_EVERY {
            self.since_refit = 0;
            self.fitted = self.fit();
        }
    }

    /// The current fit, once there is one.
    pub fn fitted(&self) -> Option<FittedCosts> {
        self.fitted
    }

    /// How many samples it holds.
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    fn fit(&self) -> Option<FittedCosts> {
        if self.samples.len() < MIN_SAMPLES {
            return None;
        }
        let mut slopes = Vec::with_capacity(self.samples.len() * (self.samples.len() - 1) / 2);
        for (i, &(x1, y1)) in self.samples.iter().enumerate() {
            for &(x2, y2) in &self.samples[i + 1..] {
                if x1.abs_diff(x2) >= MIN_SPREAD {
                    slopes.push((y2 as f64 - y1 as f64) / (x2 as f64 - x1 as f64));
                }
            }
        }
        if slopes.len() < MIN_PAIRS {
            return None;
        }
        let slope = median(&mut slopes);
        if !(slope > 0.0 && slope.is_finite()) {
            return None;
        }
        let mut intercepts: Vec<f64> = self.samples.iter().map(|&(x, y)| y as f64 - slope * x as f64).collect();
        Some(FittedCosts {
            base_us: median(&mut intercepts).max(0.0),
            us_per_token: slope,
            samples: self.samples.len(),
        })
    }
}

/// The median of `values` (non-empty; reordered).
fn median(values: &mut [f64]) -> f64 {
    let mid = values.len() / 2;
    let (_, upper, _) = values.select_nth_unstable_by(mid, f64::total_cmp);
    let upper = *upper;
    if values.len() % 2 == 1 {
        return upper;
    }
    let lower = values[..mid].iter().copied().fold(f64::NEG_INFINITY, f64::max);
    (lower + upper) / 2.0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hashing::mix64;

    /// A synthetic engine: `base + per_token · tokens`, with ±`noise` relative jitter, and a share `outliers` of
    /// requests that waited 2–10 times as long (a batch, a stall).
    fn engine(fit: &mut CostFit, n: u64, base_us: f64, us_per_token: f64, noise: f64, outliers: f64, seed: u64) {
        for i in 0..n {
            let u = |k: u64| (mix64(seed ^ (i << 8) ^ k) >> 11) as f64 / (1u64 << 53) as f64;
            let tokens = 1 + (u(1) * 8_000.0) as u64;
            let mut service = (base_us + us_per_token * tokens as f64) * (1.0 + noise * (2.0 * u(2) - 1.0));
            if u(3) < outliers {
                service *= 2.0 + 8.0 * u(4);
            }
            fit.add(tokens, service as u64);
        }
    }

    #[test]
    fn recovers_known_constants_within_five_percent_through_noise_and_outliers() {
        for (base_us, per_token, seed) in [(25_000.0, 40.0, 1), (200_000.0, 330.0, 2), (5_000.0, 4.0, 3)] {
            let mut fit = CostFit::default();
            engine(&mut fit, 500, base_us, per_token, 0.05, 0.15, seed);
            let f = fit.fitted().unwrap();
            assert!((f.us_per_token / per_token - 1.0).abs() < 0.05, "{f:?} vs {per_token}");
            // The base is small next to the token cost at these lengths: within 5% of the mean service time.
            let mean = base_us + per_token * 4_000.0;
            assert!((f.base_us - base_us).abs() < 0.05 * mean, "{f:?} vs {base_us}");
            assert_eq!(f.samples, WINDOW);
        }
    }

    #[test]
    fn follows_an_engine_that_slows_down() {
        let mut fit = CostFit::default();
        engine(&mut fit, 300, 20_000.0, 40.0, 0.02, 0.0, 4);
        assert!((fit.fitted().unwrap().us_per_token / 40.0 - 1.0).abs() < 0.05);
        engine(&mut fit, 300, 20_000.0, 120.0, 0.02, 0.0, 5);
        assert!((fit.fitted().unwrap().us_per_token / 120.0 - 1.0).abs() < 0.05);
    }

    #[test]
    fn no_fit_without_enough_samples_or_spread() {
        let mut fit = CostFit::default();
        engine(&mut fit, (MIN_SAMPLES - 1) as u64, 1_000.0, 10.0, 0.0, 0.0, 6);
        assert!(fit.fitted().is_none(), "too few samples");
        let mut same = CostFit::default();
        for _ in 0..200 {
            same.add(500, 30_000);
        }
        assert!(
            same.fitted().is_none(),
            "one prompt length: the base and the rate cannot be told apart"
        );
        let mut backwards = CostFit::default();
        for i in 0..200u64 {
            backwards.add(100 + i * 50, 1_000_000 - i * 1_000);
        }
        assert!(backwards.fitted().is_none(), "a negative rate is no fit");
    }

    #[test]
    fn the_median_of_even_and_odd_counts() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
    }
}
