//! Per-policy summaries of a simulation: the table `dprouter simulate` prints and its JSON.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet};

use serde::Serialize;

use crate::cost::MICROS_PER_SECOND;
use crate::simulator::{RankRemoval, RemovalMode, RequestRecord, SimOutcome};

/// One row of the results table (field names are the `--json` keys).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    pub policy: String,
    pub requests: usize,
    pub ttft_mean_ms: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    /// Median TTFT excluding the first request of each session (an agent's conversation; for workloads without
    /// sessions, a prefix group): the steady state after every session's cold start.
    pub steady_ttft_p50_ms: f64,
    /// The 99th percentile of the same.
    pub steady_ttft_p99_ms: f64,
    /// The queue-free floor: the mean TTFT the requests would have had with no queueing, given the cache hits they
    /// got (base + uncached tokens / prefill rate). TTFT above it is queueing; the floor itself is what misses
    /// cost. `None` (JSON `null`) for a run over HTTP.
    pub floor_mean_ms: Option<f64>,
    /// The 99th percentile of the same.
    pub floor_p99_ms: Option<f64>,
    /// The pooled wait: the mean time the same requests, each taking its floor's prefill time, would have waited in
    /// one first-come-first-served queue that every rank in service takes from as soon as it is free
    /// ([`pooled_waits`]). That is the queueing of a dispatcher that could hold each request until a rank frees,
    /// at this policy's hit rate; the queueing above it is what choosing at arrival cost. `None` (JSON `null`) for
    /// a run over HTTP.
    pub pooled_wait_mean_ms: Option<f64>,
    /// The same queue serving the shortest prefill first (none preempted): the order that shortens the mean wait
    /// most, short of preempting prefills (exactly so on one rank), at this hit rate.
    pub pooled_shortest_wait_mean_ms: Option<f64>,
    /// Cached prompt tokens over all prompt tokens.
    pub hit_rate: f64,
    /// The hit rate of one infinite cache fed the same requests (an upper bound for any routing); `None` (JSON
    /// `null`) for a run over HTTP, which does not compute it.
    pub oracle_hit_rate: Option<f64>,
    /// The hit rate of one LRU cache of all the ranks' capacity fed the same requests (what capacity allows,
    /// routing aside: a reference, not a bound); `None` (JSON `null`) for a run over HTTP.
    pub pooled_lru_hit_rate: Option<f64>,
    /// Completed requests per second of virtual time, first arrival to last finish.
    pub throughput_rps: f64,
    /// The busiest rank's routed requests over the mean per rank (1.0 is perfect balance); under disaggregation,
    /// of the prefill ranks.
    pub max_mean_load: f64,
    /// Under disaggregation, the same of the decode ranks; `None` (JSON `null`) otherwise.
    pub decode_max_mean_load: Option<f64>,
    pub errors: u64,
    /// With a rank removed mid-run: the fraction of prefix groups (with requests before and after the removal)
    /// whose rank changed, from their last request before it to their first after it.
    pub moved_groups: Option<f64>,
    /// Requests per routing branch (`hit`, `spill`, `cold`, `affine`, …).
    pub branches: BTreeMap<&'static str, usize>,
    /// Mean absolute difference between the cached tokens the policy predicted and those the rank had, over the
    /// requests it predicted for (`None` for a policy that does not predict).
    pub prediction_error: Option<f64>,
}

/// Of the groups with requests both before and at-or-after `at`, the fraction whose rank changed between their
/// last request before and their first request after. `None` when no group spans `at`.
pub fn moved_fraction(records: &[RequestRecord], at: u64) -> Option<f64> {
    let mut sorted: Vec<&RequestRecord> = records.iter().collect();
    sorted.sort_by_key(|r| (r.arrival, r.id));
    let mut before: HashMap<u64, usize> = HashMap::new();
    let mut after: HashMap<u64, usize> = HashMap::new();
    for r in sorted {
        if r.arrival < at {
            before.insert(r.group, r.rank);
        } else {
            after.entry(r.group).or_insert(r.rank);
        }
    }
    let spanning: Vec<bool> = before
        .iter()
        .filter_map(|(g, b)| after.get(g).map(|a| a != b))
        .collect();
    (!spanning.is_empty()).then(|| spanning.iter().filter(|&&m| m).count() as f64 / spanning.len() as f64)
}

/// In which order [`pooled_waits`]' one queue serves its requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolOrder {
    /// First come, first served: as the engines serve their own queues.
    Arrival,
    /// The shortest prefill first, without preempting one in progress (on one rank, the least mean wait of any
    /// such order; on several, close to it).
    Shortest,
}

/// Each record's wait (by index) in one queue served by `ranks` ranks, each request taking its floor (no floor:
/// none), in `order`. A rank the `removal` takes out stops taking requests from its time (the one that would be
/// free last: the pool loses its least available rank). An M/G/c queue over the run's own arrivals (equal
/// arrivals by id) and prefill times, without contention between ranks.
pub fn pooled_waits(
    records: &[RequestRecord],
    ranks: usize,
    removal: Option<RankRemoval>,
    order: PoolOrder,
) -> Vec<u64> {
    let mut arrivals: Vec<usize> = (0..records.len()).collect();
    arrivals.sort_by_key(|&i| (records[i].arrival, records[i].id));
    let mut arrivals = arrivals.into_iter().peekable();
    let floor = |i: usize| records[i].floor.unwrap_or(0);
    let key = |i: usize| match order {
        PoolOrder::Arrival => (records[i].arrival, records[i].id),
        PoolOrder::Shortest => (floor(i), records[i].id),
    };
    let mut free: BinaryHeap<Reverse<u64>> = (0..ranks.max(1)).map(|_| Reverse(0)).collect();
    let mut waiting: BinaryHeap<Reverse<((u64, u64), usize)>> = BinaryHeap::new();
    let mut removal = removal.filter(|m| m.mode != RemovalMode::Control).map(|m| m.at);
    let mut waits = vec![0; records.len()];
    // When the last request was taken: every one waiting arrived by then.
    let mut now = 0;
    while let Some(&Reverse(rank_free)) = free.peek() {
        now = match waiting.is_empty() {
            true => match arrivals.peek() {
                Some(&i) => rank_free.max(records[i].arrival),
                None => break,
            },
            false => rank_free.max(now),
        };
        if removal.is_some_and(|at| now >= at) && free.len() > 1 {
            let mut times = free.into_sorted_vec();
            times.remove(0);
            free = times.into_iter().collect();
            removal = None;
            continue;
        }
        while let Some(i) = arrivals.next_if(|&i| records[i].arrival <= now) {
            waiting.push(Reverse((key(i), i)));
        }
        let Some(Reverse((_, i))) = waiting.pop() else { break };
        free.pop();
        waits[i] = now - records[i].arrival;
        free.push(Reverse(now + floor(i)));
    }
    waits
}

/// Nearest-rank percentile of sorted values; 0 for none.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn ms(micros: u64) -> f64 {
    micros as f64 / 1000.0
}

impl Summary {
    pub fn new(policy: &str, outcome: &SimOutcome) -> Self {
        let mut records: Vec<_> = outcome.records.iter().collect();
        records.sort_by_key(|r| (r.arrival, r.id));
        let mut ttfts: Vec<f64> = records.iter().map(|r| ms(r.ttft())).collect();
        let mut seen = HashSet::new();
        let mut steady: Vec<f64> = records
            .iter()
            .filter(|r| !seen.insert(r.session))
            .map(|r| ms(r.ttft()))
            .collect();
        ttfts.sort_by(f64::total_cmp);
        steady.sort_by(f64::total_cmp);
        let mut floors: Option<Vec<f64>> = records.iter().map(|r| r.floor.map(ms)).collect();
        if let Some(f) = floors.as_mut() {
            f.sort_by(f64::total_cmp);
        }
        let floors = floors.filter(|f| !f.is_empty());
        let pooled = |order| {
            floors.as_ref().map(|_| {
                let waits = pooled_waits(&outcome.records, outcome.routed_per_rank.len(), outcome.removal, order);
                waits.iter().map(|&w| ms(w)).sum::<f64>() / waits.len() as f64
            })
        };
        let prompt: usize = records.iter().map(|r| r.prompt_tokens).sum();
        let cached: usize = records.iter().map(|r| r.cached_tokens).sum();
        let span = match (
            records.iter().map(|r| r.arrival).min(),
            records.iter().map(|r| r.finish).max(),
        ) {
            (Some(start), Some(end)) if end > start => (end - start) as f64 / MICROS_PER_SECOND,
            _ => 0.0,
        };
        let max_mean = |routed: &[u64]| {
            let mean = routed.iter().sum::<u64>() as f64 / routed.len().max(1) as f64;
            let max = routed.iter().copied().max().unwrap_or(0) as f64;
            if mean > 0.0 {
                max / mean
            } else {
                0.0
            }
        };
        Self {
            policy: policy.into(),
            requests: records.len(),
            ttft_mean_ms: if ttfts.is_empty() {
                0.0
            } else {
                ttfts.iter().sum::<f64>() / ttfts.len() as f64
            },
            ttft_p50_ms: percentile(&ttfts, 50.0),
            ttft_p99_ms: percentile(&ttfts, 99.0),
            steady_ttft_p50_ms: percentile(&steady, 50.0),
            steady_ttft_p99_ms: percentile(&steady, 99.0),
            floor_mean_ms: floors.as_ref().map(|f| f.iter().sum::<f64>() / f.len() as f64),
            floor_p99_ms: floors.as_ref().map(|f| percentile(f, 99.0)),
            pooled_wait_mean_ms: pooled(PoolOrder::Arrival),
            pooled_shortest_wait_mean_ms: pooled(PoolOrder::Shortest),
            hit_rate: if prompt == 0 {
                0.0
            } else {
                cached as f64 / prompt as f64
            },
            throughput_rps: if span > 0.0 { records.len() as f64 / span } else { 0.0 },
            max_mean_load: max_mean(&outcome.routed_per_rank),
            decode_max_mean_load: (!outcome.routed_per_decode_rank.is_empty())
                .then(|| max_mean(&outcome.routed_per_decode_rank)),
            errors: outcome.errors,
            oracle_hit_rate: outcome.oracle_hit_rate,
            pooled_lru_hit_rate: outcome.pooled_hit_rate,
            moved_groups: outcome
                .removal
                .and_then(|removal| moved_fraction(&outcome.records, removal.at)),
            branches: records.iter().fold(BTreeMap::new(), |mut m, r| {
                *m.entry(r.branch.as_str()).or_insert(0) += 1;
                m
            }),
            prediction_error: {
                let errors: Vec<u64> = records
                    .iter()
                    .filter_map(|r| Some(r.predicted_cached?.abs_diff(r.cached_tokens as u64)))
                    .collect();
                (!errors.is_empty()).then(|| errors.iter().sum::<u64>() as f64 / errors.len() as f64)
            },
        }
    }
}

/// The results as an aligned text table.
pub fn table(rows: &[Summary]) -> String {
    let moved = rows.iter().any(|r| r.moved_groups.is_some());
    let decode = rows.iter().any(|r| r.decode_max_mean_load.is_some());
    let width = rows.iter().map(|r| r.policy.len()).max().unwrap_or(0).max(22);
    let mut out = format!(
        "{:<width$} {:>8} {:>10} {:>10} {:>10} {:>10} {:>9} {:>11} {:>11} {:>6} {:>6} {:>6} {:>8} {:>8}{} {:>6}{}\n",
        "policy",
        "requests",
        "ttft_mean",
        "ttft_p50",
        "ttft_p99",
        "floor_mean",
        "floor_p99",
        "steady_p50",
        "steady_p99",
        "hit",
        "lru",
        "of_orc",
        "req/s",
        "max/mean",
        if decode { " dec_max/mean" } else { "" },
        "errors",
        if moved { "  moved" } else { "" }
    );
    for r in rows {
        let of_oracle = match r.oracle_hit_rate {
            Some(o) if o > 0.0 => format!("{:.3}", r.hit_rate / o),
            _ => "-".into(),
        };
        let floor = |v: Option<f64>| v.map_or_else(|| "-".to_string(), |v| format!("{v:.0}"));
        out.push_str(&format!(
            "{:<width$} {:>8} {:>10.0} {:>10.0} {:>10.0} {:>10} {:>9} {:>11.0} {:>11.0} {:>6.3} {:>6} {:>6} {:>8.3} {:>8.2}{} {:>6}{}\n",
            r.policy,
            r.requests,
            r.ttft_mean_ms,
            r.ttft_p50_ms,
            r.ttft_p99_ms,
            floor(r.floor_mean_ms),
            floor(r.floor_p99_ms),
            r.steady_ttft_p50_ms,
            r.steady_ttft_p99_ms,
            r.hit_rate,
            r.pooled_lru_hit_rate.map_or_else(|| "-".to_string(), |p| format!("{p:.3}")),
            of_oracle,
            r.throughput_rps,
            r.max_mean_load,
            match (decode, r.decode_max_mean_load) {
                (true, Some(m)) => format!(" {m:>12.2}"),
                (true, None) => format!(" {:>12}", "-"),
                _ => String::new(),
            },
            r.errors,
            match (moved, r.moved_groups) {
                (true, Some(m)) => format!(" {m:>6.3}"),
                (true, None) => format!(" {:>6}", "-"),
                _ => String::new(),
            }
        ));
    }
    let oracle: Vec<f64> = rows.iter().filter_map(|r| r.oracle_hit_rate).collect();
    let (lo, hi) = oracle.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &o| {
        (lo.min(o), hi.max(o))
    });
    if !oracle.is_empty() {
        let infinite = if hi - lo < 5e-4 {
            format!("{hi:.3}")
        } else {
            format!("{lo:.3}..{hi:.3} (the arrival order differs per policy)")
        };
        out.push_str(&format!(
            "hit-rate ladder: oracle (one infinite cache) {infinite} > lru (one LRU cache of every rank's capacity) > hit (the policy's)\n"
        ));
    }
    out.push_str("(TTFT in ms; floor_* = TTFT with no queueing, given the hits; steady_* leave out each session's (agent's or prefix group's) first request; of_orc = hit / oracle");
    if decode {
        out.push_str("; max/mean of the prefill ranks, dec_max/mean of the decode ranks");
    }
    out.push_str(if moved {
        "; moved = fraction of prefix groups whose rank changed at the removal)\n"
    } else {
        ")\n"
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(
            (percentile(&v, 50.0), percentile(&v, 99.0), percentile(&v, 100.0)),
            (50.0, 99.0, 100.0)
        );
        assert_eq!(percentile(&[7.0], 99.0), 7.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }

    fn record(id: u64, group: u64, rank: usize, arrival: u64) -> RequestRecord {
        RequestRecord {
            id,
            group,
            session: group,
            rank,
            branch: dprouter_core::Branch::Hashed,
            arrival,
            first_token: arrival,
            finish: arrival,
            prompt_tokens: 10,
            cached_tokens: 0,
            predicted_cached: None,
            floor: Some(0),
        }
    }

    #[test]
    fn steady_columns_leave_out_each_sessions_first_request() {
        // Two sessions on one prefix group: their first requests (10 s and 8 s) are cold; the rest take 1..=4 s.
        let mut records = Vec::new();
        for (id, session, arrival, ttft) in [(0, 0, 0, 10), (1, 1, 0, 8), (2, 0, 20, 1), (3, 1, 20, 2), (4, 0, 40, 4)] {
            let mut r = record(id, 7, 0, arrival * 1_000_000);
            r.session = session;
            r.first_token = r.arrival + ttft * 1_000_000;
            r.finish = r.first_token;
            records.push(r);
        }
        let outcome = SimOutcome {
            records,
            routed_per_rank: vec![5],
            ..SimOutcome::default()
        };
        let s = Summary::new("p", &outcome);
        assert_eq!(
            (s.ttft_p99_ms, s.steady_ttft_p50_ms, s.steady_ttft_p99_ms),
            (10_000.0, 2_000.0, 4_000.0)
        );
    }

    #[test]
    fn the_floor_is_each_requests_prefill_alone_and_unknown_over_http() {
        let mut records = Vec::new();
        for (id, floor_s) in [(0, 1), (1, 3)] {
            let mut r = record(id, 0, 0, 0);
            r.first_token = 5_000_000;
            r.floor = Some(floor_s * 1_000_000);
            records.push(r);
        }
        let mut outcome = SimOutcome {
            records,
            routed_per_rank: vec![2],
            ..SimOutcome::default()
        };
        let s = Summary::new("p", &outcome);
        assert_eq!((s.floor_mean_ms, s.floor_p99_ms), (Some(2_000.0), Some(3_000.0)));
        assert_eq!(s.ttft_mean_ms, 5_000.0);
        outcome.records[1].floor = None;
        let s = Summary::new("p", &outcome);
        assert_eq!((s.floor_mean_ms, s.floor_p99_ms), (None, None));
        assert!(table(&[s]).lines().nth(1).unwrap().contains(" - "));
    }

    /// Records of (arrival s, floor s), on rank 0.
    fn timed(requests: &[(u64, u64)]) -> Vec<RequestRecord> {
        let mut records = Vec::new();
        for (id, &(arrival_s, floor_s)) in requests.iter().enumerate() {
            let mut r = record(id as u64, 0, 0, arrival_s * 1_000_000);
            r.floor = Some(floor_s * 1_000_000);
            records.push(r);
        }
        records
    }

    #[test]
    fn the_pooled_wait_is_one_first_come_first_served_queue_over_every_rank() {
        // Two ranks: 5 s and 2 s from 0; at 1 s the next waits for the second rank (free at 2 s, then at 4 s);
        // at 3 s the next waits for it again (the first is busy until 5 s).
        let records = timed(&[(0, 5), (0, 2), (1, 2), (3, 1)]);
        let fifo = |records: &[RequestRecord], ranks| pooled_waits(records, ranks, None, PoolOrder::Arrival);
        assert_eq!(fifo(&records, 2), vec![0, 0, 1_000_000, 1_000_000]);
        assert_eq!(fifo(&records, 3), vec![0, 0, 0, 0]);
        // One rank: 5 s from 0, then 3 s (from 1 s) and 1 s (from 2 s) wait for it; shortest first takes the 1 s
        // one first.
        let records_one = timed(&[(0, 5), (1, 3), (2, 1)]);
        assert_eq!(fifo(&records_one, 1), vec![0, 4_000_000, 6_000_000]);
        assert_eq!(
            pooled_waits(&records_one, 1, None, PoolOrder::Shortest),
            vec![0, 5_000_000, 3_000_000]
        );
        let outcome = SimOutcome {
            records,
            routed_per_rank: vec![4, 0],
            ..SimOutcome::default()
        };
        let s = Summary::new("p", &outcome);
        assert_eq!(
            (s.pooled_wait_mean_ms, s.pooled_shortest_wait_mean_ms),
            (Some(500.0), Some(500.0))
        );
    }

    #[test]
    fn a_removed_rank_leaves_the_pool_but_a_control_removes_nothing() {
        let records = timed(&[(1, 2), (1, 2)]);
        let waits = |at, mode| pooled_waits(&records, 2, Some(RankRemoval { rank: 1, at, mode }), PoolOrder::Arrival);
        assert_eq!(waits(500_000, RemovalMode::Control), vec![0, 0]);
        assert_eq!(waits(500_000, RemovalMode::Down), vec![0, 2_000_000]);
        assert_eq!(waits(500_000, RemovalMode::Drop), vec![0, 2_000_000]);
        // A removal after the last arrival changes nothing.
        assert_eq!(waits(9_000_000, RemovalMode::Down), vec![0, 0]);
    }

    #[test]
    fn moved_compares_the_last_rank_before_with_the_first_after() {
        let records = [
            record(0, 1, 0, 5),
            record(1, 1, 3, 8),
            record(2, 1, 3, 10),
            record(3, 1, 0, 12),
            record(4, 2, 1, 1),
            record(5, 2, 2, 11),
            record(6, 3, 4, 20),
            record(7, 4, 5, 1),
        ];
        // Group 1: 3 then 3 (stays); group 2: 1 then 2 (moves); groups 3 and 4 do not span the removal at 10.
        assert_eq!(moved_fraction(&records, 10), Some(0.5));
        assert_eq!(moved_fraction(&records, 100), None);
    }
}
