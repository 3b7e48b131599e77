//! The span queue between the requests and the collector: bounded, batched, and never in a request's way.
//!
//! A finished span goes into a bounded queue with `try_send` (no lock, no wait); when the queue is full it is
//! dropped and counted (`dprouter_trace_spans_dropped_total{reason="queue_full"}`). One task takes spans off in
//! batches of at most `max_batch_spans`, sending a batch when it is full or when its first span has waited
//! `schedule_delay`, one export at a time, each bounded by `export_timeout`; a batch the collector refuses or does
//! not answer in time is dropped and counted (`reason="export_failed"`). So a collector that is down or slow costs
//! the requests nothing, and memory at most the queue. (The SDK's own batch processor drops the same way but only
//! logs the count; this one is the processor the gateway registers.)

use std::sync::Arc;
use std::time::Duration;

use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SpanData, SpanExporter, SpanProcessor};
use opentelemetry_sdk::Resource;
use tokio::sync::{mpsc, Notify};

/// Spans dropped, by `reason`: `queue_full`, `export_failed`.
pub const SPANS_DROPPED: &str = "dprouter_trace_spans_dropped_total";
/// Spans the collector accepted.
pub const SPANS_EXPORTED: &str = "dprouter_trace_spans_exported_total";

/// The processor the tracer provider calls as spans end (see the module documentation).
#[derive(Debug)]
pub struct Queue {
    spans: mpsc::Sender<SpanData>,
}

impl SpanProcessor for Queue {
    fn on_start(&self, _span: &mut opentelemetry_sdk::trace::Span, _cx: &opentelemetry::Context) {}

    fn on_end(&self, span: SpanData) {
        if !span.span_context.is_sampled() {
            return;
        }
        if self.spans.try_send(span).is_err() {
            metrics::counter!(SPANS_DROPPED, "reason" => "queue_full").increment(1);
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    /// Nothing here: [`Exporting::finish`] sends what is queued, within a deadline, from the runtime.
    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Ok(())
    }

    fn set_resource(&mut self, _resource: &Resource) {}
}

/// The exporting task, to stop at shutdown.
pub struct Exporting {
    finish: Arc<Notify>,
    task: tokio::task::JoinHandle<()>,
}

/// How spans are batched and sent.
#[derive(Debug, Clone, Copy)]
pub struct Batching {
    pub max_queue_spans: usize,
    pub max_batch_spans: usize,
    pub schedule_delay: Duration,
    pub export_timeout: Duration,
}

/// The queue, and its task exporting to `exporter` (spawned on the current runtime).
pub fn start<E: SpanExporter + 'static>(exporter: E, batching: Batching) -> (Queue, Exporting) {
    let (tx, rx) = mpsc::channel(batching.max_queue_spans);
    let finish = Arc::new(Notify::new());
    let task = tokio::spawn(export(exporter, rx, batching, Arc::clone(&finish)));
    (Queue { spans: tx }, Exporting { finish, task })
}

impl Exporting {
    /// Sends what is queued (one export bounded by the export timeout) and stops, waiting at most `within`.
    pub async fn finish(self, within: Duration) {
        self.finish.notify_one();
        let _ = tokio::time::timeout(within, self.task).await;
    }
}

async fn export<E: SpanExporter>(
    exporter: E,
    mut spans: mpsc::Receiver<SpanData>,
    batching: Batching,
    finish: Arc<Notify>,
) {
    let mut batch = Vec::with_capacity(batching.max_batch_spans);
    let mut finishing = false;
    while !finishing {
        // The batch's first span, then more until it is full or has waited the schedule delay.
        tokio::select! {
            first = spans.recv() => match first {
                Some(span) => batch.push(span),
                None => return,
            },
            () = finish.notified() => finishing = true,
        }
        let due = tokio::time::sleep(batching.schedule_delay);
        tokio::pin!(due);
        while !finishing && batch.len() < batching.max_batch_spans {
            tokio::select! {
                next = spans.recv() => match next {
                    Some(span) => batch.push(span),
                    None => break,
                },
                () = &mut due => break,
                () = finish.notified() => finishing = true,
            }
        }
        if finishing {
            while batch.len() < batching.max_batch_spans {
                match spans.try_recv() {
                    Ok(span) => batch.push(span),
                    Err(_) => break,
                }
            }
        }
        if batch.is_empty() {
            continue;
        }
        let sent = std::mem::replace(&mut batch, Vec::with_capacity(batching.max_batch_spans));
        let n = sent.len() as u64;
        match tokio::time::timeout(batching.export_timeout, exporter.export(sent)).await {
            Ok(Ok(())) => metrics::counter!(SPANS_EXPORTED).increment(n),
            Ok(Err(err)) => failed(n, &err.to_string()),
            Err(_) => failed(n, &format!("no answer within {:?}", batching.export_timeout)),
        }
    }
}

fn failed(spans: u64, why: &str) {
    metrics::counter!(SPANS_DROPPED, "reason" => "export_failed").increment(spans);
    static THROTTLE: std::sync::Mutex<Option<std::time::Instant>> = std::sync::Mutex::new(None);
    // At most one warning every 10 s: a collector that is down fails every batch.
    let mut last = THROTTLE.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if last.is_none_or(|t| t.elapsed() >= Duration::from_secs(10)) {
        *last = Some(std::time::Instant::now());
        tracing::warn!(spans, error = %why, "could not export spans to the OTLP collector: dropped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState};
    use std::sync::Mutex;

    /// An exporter that records what it got, and can be told to hang.
    #[derive(Debug, Default, Clone)]
    struct Recorder {
        batches: Arc<Mutex<Vec<usize>>>,
        hang: bool,
    }

    impl SpanExporter for Recorder {
        async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
            if self.hang {
                std::future::pending::<()>().await;
            }
            self.batches.lock().unwrap().push(batch.len());
            Ok(())
        }
    }

    fn span(sampled: bool) -> SpanData {
        let flags = if sampled {
            TraceFlags::SAMPLED
        } else {
            TraceFlags::default()
        };
        SpanData {
            span_context: SpanContext::new(TraceId::from(1), SpanId::from(1), flags, false, TraceState::default()),
            parent_span_id: SpanId::INVALID,
            parent_span_is_remote: false,
            span_kind: SpanKind::Internal,
            name: "test".into(),
            start_time: std::time::SystemTime::UNIX_EPOCH,
            end_time: std::time::SystemTime::UNIX_EPOCH,
            attributes: Vec::new(),
            dropped_attributes_count: 0,
            events: Default::default(),
            links: Default::default(),
            status: Status::Unset,
            instrumentation_scope: Default::default(),
        }
    }

    const BATCHING: Batching = Batching {
        max_queue_spans: 8,
        max_batch_spans: 3,
        schedule_delay: Duration::from_millis(100),
        export_timeout: Duration::from_secs(1),
    };

    #[tokio::test(start_paused = true)]
    async fn spans_go_in_batches_full_or_on_schedule_and_the_rest_at_finish() {
        let recorder = Recorder::default();
        let (queue, exporting) = start(recorder.clone(), BATCHING);
        for _ in 0..4 {
            queue.on_end(span(true));
        }
        // Not sampled: never queued.
        queue.on_end(span(false));
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(*recorder.batches.lock().unwrap(), [3, 1]);
        queue.on_end(span(true));
        queue.on_end(span(true));
        exporting.finish(Duration::from_secs(1)).await;
        assert_eq!(*recorder.batches.lock().unwrap(), [3, 1, 2]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_collector_that_never_answers_costs_a_bounded_queue_and_no_wait() {
        let recorder = Recorder {
            hang: true,
            ..Recorder::default()
        };
        let (queue, exporting) = start(recorder.clone(), BATCHING);
        // While one export hangs, the queue takes 8 and drops the rest at once.
        let started = tokio::time::Instant::now();
        for _ in 0..100 {
            queue.on_end(span(true));
            tokio::task::yield_now().await;
        }
        assert_eq!(started.elapsed(), Duration::ZERO);
        assert!(
            queue.spans.capacity() == 0,
            "the queue is full: {}",
            queue.spans.capacity()
        );
        // The hung export is given up after the timeout, and the next batch goes.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        assert!(queue.spans.capacity() > 0);
        exporting.finish(Duration::from_secs(5)).await;
        assert!(recorder.batches.lock().unwrap().is_empty());
    }
}
