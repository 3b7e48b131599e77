//! What the simulated ranks tell the routers besides the answers: their load reports (every `report_interval`, as
//! SGLang's schedulers publish them) and, in precise mode, their KV events (each batch reaching the policies
//! `delay` after the cache changed, followed into their block hashes).

use dprouter_core::{EndpointId, EngineReport};

use super::{Event, Sim};
use crate::cost::Micros;

impl Sim<'_> {
    /// Sends rank `r`'s new KV events on their way to the policy.
    pub(super) fn publish_events(&mut self, r: usize, now: Micros) {
        let Some(events) = self.config.kv_events else { return };
        let batch = self.ranks[r].cache.take_events();
        if batch.is_empty() {
            return;
        }
        self.seq += 1;
        let number = self.seq;
        self.published.insert(number, (r, batch));
        self.schedule(now + events.delay, Event::KvEvents(number));
    }

    pub(super) fn deliver_events(&mut self, number: u64, now: Micros) {
        let Some((r, batch)) = self.published.remove(&number) else {
            return;
        };
        let Some(followed) = self.ranks[r].followed.as_mut() else {
            return;
        };
        let endpoint = EndpointId::new(0, r as u32);
        for event in &batch {
            // The simulator's own caches never skip an event: nothing is an orphan.
            if let Ok(Some(change)) = followed.apply(event) {
                for router in &self.routers {
                    router.policy.engine_cache(endpoint, &change, now);
                }
            }
        }
    }

    pub(super) fn publish_reports(&mut self, now: Micros) {
        if self.last_report.is_some_and(|t| now < t + self.config.report_interval) {
            return;
        }
        self.last_report = Some(now);
        for (r, rank) in self.ranks.iter().enumerate() {
            let waiting = rank.queue.len() as u64;
            let report = EngineReport {
                requests: waiting + u64::from(rank.prefilling.is_some()) + rank.decoding as u64,
                waiting,
                tokens: rank.cache.locked_size() as u64 + rank.queued_tokens,
                // Strictly increasing even for a report at time 0.
                timestamp: now + 1,
                queued_prefill_tokens: None,
            };
            for router in &self.routers {
                router.loads[r].apply_report(report);
            }
        }
        let Some(decoders) = &self.decoders else { return };
        for (r, rank) in decoders.ranks.iter().enumerate() {
            let report = EngineReport {
                requests: (rank.arriving + rank.decoding) as u64,
                waiting: rank.arriving as u64,
                tokens: rank.held_tokens,
                timestamp: now + 1,
                queued_prefill_tokens: None,
            };
            for router in &decoders.routers {
                router.loads[r].apply_report(report);
            }
        }
    }
}
