//! The picker's memory under streams of large body chunks (a `dprouter epp` process, its peak resident memory read
//! from `/proc`): 20 gRPC streams each sending 60 chunks of 1 MiB and no request headers are each refused at their
//! first chunk, and the picker's peak stays under 200 MB; 20 streams with headers and 60 MiB bodies are held by the
//! budget of all bodies arriving at once (`max_buffered_body_bytes`), the ones past it refused with a 503.
//! `DPROUTER_EPP_MEMORY=print` prints the figures of docs/operations.md.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::memory;
use common::picker::Picker;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Message;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Reply;
use envoy_types::pb::envoy::service::ext_proc::v3::{HttpBody, HttpHeaders, ProcessingRequest};

const STREAMS: usize = 20;
const CHUNKS: usize = 60;
const MIB: usize = 1 << 20;

fn message(request: Message) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(request),
        ..Default::default()
    }
}

fn headers() -> Message {
    let headers = [
        (":method", "POST"),
        (":path", "/v1/completions"),
        ("content-type", "application/json"),
    ]
    .into_iter()
    .map(|(key, value)| HeaderValue {
        key: key.into(),
        raw_value: value.as_bytes().to_vec(),
        ..Default::default()
    })
    .collect();
    Message::RequestHeaders(HttpHeaders {
        headers: Some(HeaderMap { headers }),
        ..Default::default()
    })
}

/// What one stream got: the immediate response's status, the gRPC status code it ended with, or nothing (`None`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Answer {
    Http(i32),
    Grpc(i32),
}

/// One stream: request headers first or not, then `CHUNKS` chunks of 1 MiB (a body that never ends); what it was
/// answered, and how long that took.
async fn stream(address: String, with_headers: bool) -> (Option<Answer>, Duration) {
    let mut client = ExternalProcessorClient::connect(address)
        .await
        .unwrap()
        .max_encoding_message_size(4 * MIB);
    let (tx, rx) = tokio::sync::mpsc::channel(2);
    let started = Instant::now();
    let sender = tokio::spawn(async move {
        if with_headers && tx.send(message(headers())).await.is_err() {
            return;
        }
        // A body of spaces (leading whitespace of a JSON body), never ended.
        for _ in 0..CHUNKS {
            let chunk = Message::RequestBody(HttpBody {
                body: vec![b' '; MIB],
                ..Default::default()
            });
            if tx.send(message(chunk)).await.is_err() {
                return;
            }
        }
        // Held open: the body does not end.
        tokio::time::sleep(Duration::from_secs(30)).await;
    });
    let replies = client.process(tokio_stream::wrappers::ReceiverStream::new(rx)).await;
    let answer = match replies {
        Err(status) => Some(Answer::Grpc(status.code() as i32)),
        Ok(replies) => {
            let mut replies = replies.into_inner();
            match tokio::time::timeout(Duration::from_secs(20), replies.message()).await {
                Ok(Ok(Some(reply))) => match reply.response {
                    Some(Reply::ImmediateResponse(r)) => Some(Answer::Http(r.status.unwrap().code)),
                    other => panic!("not an immediate response: {other:?}"),
                },
                Ok(Ok(None)) => Some(Answer::Grpc(0)),
                Ok(Err(status)) => Some(Answer::Grpc(status.code() as i32)),
                Err(_) => None,
            }
        }
    };
    sender.abort();
    (answer, started.elapsed())
}

/// `STREAMS` streams at once: the answers counted, the slowest answer, and the picker's peak memory growth.
async fn round(
    picker: &Picker,
    with_headers: bool,
) -> (std::collections::BTreeMap<Option<Answer>, usize>, Duration, u64) {
    let pid = picker.proc.child.id();
    tokio::time::sleep(Duration::from_millis(500)).await;
    memory::reset_peak_rss(pid);
    let idle = memory::rss(pid);
    let address = format!("http://{}", picker.grpc);
    let streams: Vec<_> = (0..STREAMS)
        .map(|_| tokio::spawn(stream(address.clone(), with_headers)))
        .collect();
    let mut answers = std::collections::BTreeMap::new();
    let mut slowest = Duration::ZERO;
    for s in streams {
        let (answer, took) = s.await.unwrap();
        *answers.entry(answer).or_insert(0) += 1;
        slowest = slowest.max(took);
    }
    (answers, slowest, memory::peak_rss(pid).saturating_sub(idle))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_of_large_chunks_are_refused_or_held_within_the_budget() {
    let config = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("epp-memory.toml");
    std::fs::write(
        &config,
        "max_buffered_body_bytes = 134217728\n[server]\nrequest_body_timeout_ms = 5000\n",
    )
    .unwrap();
    let picker = Picker::start(&[], &["--config", config.to_str().unwrap()]);
    let print = std::env::var("DPROUTER_EPP_MEMORY").is_ok_and(|v| v == "print");

    // No headers: each stream refused at its first chunk, nothing held.
    let (answers, slowest, grown) = round(&picker, false).await;
    let invalid = Some(Answer::Grpc(tonic::Code::InvalidArgument as i32));
    assert_eq!(answers.get(&invalid), Some(&STREAMS), "{answers:?}");
    assert!(
        slowest < Duration::from_secs(5),
        "answered after {slowest:?}, past the body timeout"
    );
    assert!(grown < 200_000_000, "peak RSS grew by {} MB", grown / 1_000_000);
    if print {
        println!(
            "no headers: {answers:?} within {slowest:?}; peak RSS +{} MB",
            grown / 1_000_000
        );
    }

    // Headers, then 60 MiB bodies that never end: at most 128 MiB held at once (two bodies), the rest a 503 at
    // once, and the held ones a 408 at the body timeout.
    let (answers, slowest, grown) = round(&picker, true).await;
    let refused = answers.get(&Some(Answer::Http(503))).copied().unwrap_or(0);
    let timed_out = answers.get(&Some(Answer::Http(408))).copied().unwrap_or(0);
    assert_eq!(refused + timed_out, STREAMS, "{answers:?}");
    assert!(refused >= STREAMS - 3, "{answers:?}");
    assert!(slowest < Duration::from_secs(10), "answered after {slowest:?}");
    assert!(grown < 500_000_000, "peak RSS grew by {} MB", grown / 1_000_000);
    if print {
        println!(
            "headers, 60 MiB bodies, a 128 MiB budget: {answers:?} within {slowest:?}; peak RSS +{} MB",
            grown / 1_000_000
        );
    }
}
