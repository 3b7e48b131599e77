//! The prefill costs `cache_aware` predicts with: each endpoint's own, fitted from its requests
//! ([`crate::cost_fit`], [`EndpointLoad::fitted_costs`]) once the fit has enough samples and `learn_costs` is on;
//! until then the median of the fitted endpoints' (the ranks of one fleet mostly run one model on one kind of GPU,
//! and a fleet fits sooner than each of its endpoints), and the configured `base_ms` and `prefill_tokens_per_s`
//! while no endpoint has a fit, or always with `learn_costs = false`. So an engine slower or faster than
//! configured is predicted as it is, and a fleet of unlike engines is compared fairly.

use crate::cost_fit::FittedCosts;
use crate::endpoint::Snapshot;
use crate::load::EndpointLoad;

use super::CacheAware;

/// One endpoint's prefill costs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Costs {
    pub(super) base_us: f64,
    pub(super) us_per_token: f64,
}

impl Costs {
    /// Prefill time in microseconds of `requests` requests of `tokens` uncached tokens in all.
    pub(super) fn prefill_us(self, requests: u64, tokens: u64) -> u64 {
        (self.base_us.max(0.0) * requests as f64 + self.us_per_token * tokens as f64).round() as u64
    }
}

impl CacheAware {
    /// The configured costs.
    pub(super) fn configured_costs(&self) -> Costs {
        let rate = self.config.prefill_tokens_per_s;
        Costs {
            base_us: self.config.base_ms * 1000.0,
            us_per_token: if rate > 0.0 { 1e6 / rate } else { 0.0 },
        }
    }

    /// The fitted costs of `load`'s endpoint, when it has them and they are to be used.
    fn fitted(&self, load: &EndpointLoad) -> Option<Costs> {
        let fitted: FittedCosts = self.config.learn_costs.then(|| load.fitted_costs()).flatten()?;
        Some(Costs {
            base_us: fitted.base_us,
            us_per_token: fitted.us_per_token,
        })
    }

    /// The costs to predict each endpoint of `snap` with, by rank.
    pub(super) fn costs_by_rank(&self, snap: &Snapshot) -> Vec<Costs> {
        let own: Vec<Option<Costs>> = (0..snap.len()).map(|r| self.fitted(snap.load(r))).collect();
        let fitted: Vec<Costs> = own.iter().flatten().copied().collect();
        let fleet = match fitted.is_empty() {
            true => self.configured_costs(),
            false => Costs {
                base_us: median(fitted.iter().map(|c| c.base_us).collect()),
                us_per_token: median(fitted.iter().map(|c| c.us_per_token).collect()),
            },
        };
        own.into_iter().map(|c| c.unwrap_or(fleet)).collect()
    }
}

/// The median of `values` (non-empty), the upper one of an even count.
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}
