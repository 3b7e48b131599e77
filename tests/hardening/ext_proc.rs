//! E2 and F9: the picker's gRPC port driven by a raw client, as a hostile peer would (Envoy refuses these first).

use super::*;
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Message;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Reply;
use envoy_types::pb::envoy::service::ext_proc::v3::{HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value as PbValue};

fn message(request: Message, metadata: Option<Metadata>) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(request),
        metadata_context: metadata,
        ..Default::default()
    }
}

fn headers(pairs: &[(String, String)], end_of_stream: bool) -> Message {
    let headers = pairs
        .iter()
        .map(|(key, value)| HeaderValue {
            key: key.clone(),
            raw_value: value.as_bytes().to_vec(),
            ..Default::default()
        })
        .collect();
    Message::RequestHeaders(HttpHeaders {
        headers: Some(HeaderMap { headers }),
        end_of_stream,
        ..Default::default()
    })
}

fn request_head() -> Vec<(String, String)> {
    [
        (":method", "POST"),
        (":path", "/v1/completions"),
        ("content-type", "application/json"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

fn body(end_of_stream: bool) -> Message {
    Message::RequestBody(HttpBody {
        body: completion(json!({})).to_string().into_bytes(),
        end_of_stream,
        ..Default::default()
    })
}

/// The data plane's word on which endpoint served the request.
fn served(address: &str) -> Metadata {
    let value = PbValue {
        kind: Some(Kind::StringValue(address.to_string())),
    };
    let fields = [("x-gateway-destination-endpoint-served".to_string(), value)].into();
    Metadata {
        filter_metadata: [("envoy.lb".to_string(), Struct { fields })].into(),
        ..Default::default()
    }
}

/// One stream: `messages` sent one by one, each after the picker's reply to the one before (when it sends
/// one); the replies, and the gRPC status the stream ended with (`None`: it ended cleanly).
async fn stream(grpc: &str, messages: Vec<ProcessingRequest>) -> (Vec<ProcessingResponse>, Option<tonic::Status>) {
    let mut client = ExternalProcessorClient::connect(format!("http://{grpc}"))
        .await
        .unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    let mut replies = client
        .process(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let mut out = Vec::new();
    for m in messages {
        tx.send(m).await.unwrap();
        match tokio::time::timeout(Duration::from_millis(500), replies.message()).await {
            Ok(Ok(Some(reply))) => out.push(reply),
            Ok(Ok(None)) => return (out, None),
            Ok(Err(status)) => return (out, Some(status)),
            // No reply to this message (a response body chunk is answered as it goes): on to the next.
            Err(_) => {}
        }
        // The replies to a body come as chunks: read what is there.
        while let Ok(Ok(Some(reply))) = tokio::time::timeout(Duration::from_millis(100), replies.message()).await {
            out.push(reply);
        }
    }
    drop(tx);
    match tokio::time::timeout(Duration::from_secs(5), replies.message()).await {
        Ok(Err(status)) => (out, Some(status)),
        _ => (out, None),
    }
}

/// The address the picker chose, from its reply to the headers.
fn destination(replies: &[ProcessingResponse]) -> String {
    replies
        .iter()
        .find_map(|r| match &r.response {
            Some(Reply::RequestHeaders(h)) => h.response.as_ref()?.header_mutation.as_ref().and_then(|m| {
                m.set_headers.iter().find_map(|h| {
                    let h = h.header.as_ref()?;
                    (h.key == "x-gateway-destination-endpoint")
                        .then(|| String::from_utf8_lossy(&h.raw_value).into_owned())
                })
            }),
            _ => None,
        })
        .unwrap_or_default()
}

fn healthy(workers: &Value) -> usize {
    workers["workers"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|w| w["endpoints"].as_array().unwrap().iter())
        .filter(|e| e["healthy"] == true)
        .count()
}

/// E2: 5xx reports that name an endpoint the picker did not offer on their stream change nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_naming_an_endpoint_not_offered_ejects_nothing() {
    let c = client();
    let engines: Vec<Proc> = (0..4).map(|_| Proc::engine(&[])).collect();
    let refs: Vec<&Proc> = engines.iter().collect();
    let picker = Picker::start(&refs, &["--backend", "openai", "--fallbacks", "0"]);
    let addresses: Vec<String> = engines
        .iter()
        .map(|e| e.url.trim_start_matches("http://").to_string())
        .collect();
    let status_503 = Message::ResponseHeaders(HttpHeaders {
        headers: Some(HeaderMap {
            headers: vec![HeaderValue {
                key: ":status".into(),
                raw_value: b"503".to_vec(),
                ..Default::default()
            }],
        }),
        end_of_stream: true,
        ..Default::default()
    });
    for round in 0..54 {
        let mut client = ExternalProcessorClient::connect(format!("http://{}", picker.grpc))
            .await
            .unwrap();
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let mut replies = client
            .process(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        tx.send(message(headers(&request_head(), false), None)).await.unwrap();
        tx.send(message(body(true), None)).await.unwrap();
        let head = tokio::time::timeout(Duration::from_secs(5), replies.message()).await;
        let chosen = destination(&[head.unwrap().unwrap().unwrap()]);
        assert!(!chosen.is_empty(), "round {round}");
        // The report: another endpoint served it, and failed.
        let other = addresses.iter().find(|a| **a != chosen).unwrap();
        tx.send(message(status_503.clone(), Some(served(other)))).await.unwrap();
        while let Ok(Ok(Some(_))) = tokio::time::timeout(Duration::from_millis(300), replies.message()).await {}
    }
    let workers = get(&c, &format!("{}/workers", picker.proc.url)).await.json;
    assert_eq!(healthy(&workers), 4, "{workers}");
    assert!(refused(&c, &picker.proc.url, "served_elsewhere").await >= 54);
}

/// F9: a request body chunk after the body's end is refused (`INVALID_ARGUMENT`); a head of 10,000 headers
/// gets `serve`'s answer (431); the open-file warning is written once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_body_chunks_and_oversized_heads_are_refused() {
    let c = client();
    let engine = Proc::engine(&[]);
    let picker = Picker::start(&[&engine], &["--backend", "openai"]);
    let (replies, ended) = stream(
        &picker.grpc,
        vec![
            message(headers(&request_head(), false), None),
            message(body(true), None),
            message(body(false), None),
        ],
    )
    .await;
    assert!(!destination(&replies).is_empty(), "{replies:?}");
    let status = ended.expect("the stream ends with a status");
    assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("after the body's end"), "{status:?}");
    assert_eq!(refused(&c, &picker.proc.url, "late_body").await, 1);

    let mut many = request_head();
    many.extend((0..10_000).map(|i| (format!("x-h{i}"), "v".to_string())));
    let (replies, _) = stream(&picker.grpc, vec![message(headers(&many, true), None)]).await;
    let immediate = replies.iter().find_map(|r| match &r.response {
        Some(Reply::ImmediateResponse(i)) => Some(i.status.as_ref().unwrap().code),
        _ => None,
    });
    assert_eq!(immediate, Some(431), "{replies:?}");
}

#[test]
fn the_open_file_warning_is_written_once() {
    let output = std::process::Command::new("prlimit")
        .args(["--nofile=256", "--"])
        .arg(env!("CARGO_BIN_EXE_dprouter"))
        .args([
            "epp",
            "--listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
            "--worker",
            "http://127.0.0.1:9",
            "--backend",
            "openai",
        ])
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = output.id();
    std::thread::sleep(Duration::from_secs(2));
    let _ = std::process::Command::new("kill").arg(pid.to_string()).status();
    let output = output.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&output.stderr);
    assert_eq!(text.matches("exceeds the open-file limit").count(), 1, "{text}");
}
