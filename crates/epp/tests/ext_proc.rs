//! The picker's ext_proc port as a hostile or broken data plane meets it: messages out of turn, undecodable or
//! oversized ones, paths `serve` does not serve, bodies over the budget of all bodies arriving at once, and each
//! phase's deadline. Driven with Envoy's generated client and, for what that client cannot send, raw HTTP/2.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use dprouter_gateway::{AppState, Backend, GatewayConfig, WorkerConfig};
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Message;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Reply;
use envoy_types::pb::envoy::service::ext_proc::v3::{HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Streaming};

/// A picker in this process over one mock SGLang engine (one rank), with `tune` applied to its config.
struct Picker {
    address: String,
    state: Arc<AppState>,
}

async fn picker(tune: impl FnOnce(&mut GatewayConfig)) -> Picker {
    let engine = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", engine.local_addr().unwrap());
    let mock = dprouter_mock_engine::Engine::new(Default::default());
    tokio::spawn(dprouter_mock_engine::serve(engine, mock, std::future::pending()));
    let mut config = GatewayConfig::default();
    config.workers.push(WorkerConfig {
        url,
        backend: Backend::Sglang,
        dp_size: Some(1),
        ..Default::default()
    });
    tune(&mut config);
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = format!("http://{}", grpc.local_addr().unwrap());
    let state = AppState::new(config).await.unwrap();
    let options = dprouter_epp::Options { fallbacks: 0 };
    tokio::spawn(dprouter_epp::run(
        grpc,
        http,
        Arc::clone(&state),
        options,
        std::future::pending(),
    ));
    Picker { address, state }
}

/// One ext_proc stream: what the test sends, and the picker's replies.
struct Exchange {
    tx: mpsc::Sender<ProcessingRequest>,
    replies: Streaming<ProcessingResponse>,
}

async fn open(address: &str) -> Exchange {
    let mut client = ExternalProcessorClient::connect(address.to_string()).await.unwrap();
    let (tx, rx) = mpsc::channel(64);
    let replies = client.process(ReceiverStream::new(rx)).await.unwrap().into_inner();
    Exchange { tx, replies }
}

impl Exchange {
    async fn send(&self, request: Message) {
        let message = ProcessingRequest {
            request: Some(request),
            ..Default::default()
        };
        self.tx.send(message).await.unwrap();
    }

    /// The next reply, or the status the stream ended with (`Code::Ok` for a plain end), within 10 s.
    async fn next(&mut self) -> Result<Reply, tonic::Status> {
        let next = tokio::time::timeout(Duration::from_secs(10), self.replies.message()).await;
        match next.expect("the picker answers within 10 s") {
            Ok(Some(reply)) => Ok(reply.response.unwrap()),
            Ok(None) => Err(tonic::Status::ok("ended")),
            Err(status) => Err(status),
        }
    }

    /// The status the stream ends with, skipping replies before it.
    async fn end(&mut self) -> tonic::Status {
        loop {
            if let Err(status) = self.next().await {
                return status;
            }
        }
    }
}

fn headers(method: &str, path: &str, end_of_stream: bool) -> Message {
    let mut list = vec![("content-type", "application/json")];
    if !method.is_empty() {
        list.push((":method", method));
    }
    if !path.is_empty() {
        list.push((":path", path));
    }
    let headers = list
        .into_iter()
        .map(|(key, value)| HeaderValue {
            key: key.into(),
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

fn body(bytes: &[u8], end_of_stream: bool) -> Message {
    Message::RequestBody(HttpBody {
        body: bytes.to_vec(),
        end_of_stream,
        ..Default::default()
    })
}

fn response_headers(status: &str) -> Message {
    Message::ResponseHeaders(HttpHeaders {
        headers: Some(HeaderMap {
            headers: vec![HeaderValue {
                key: ":status".into(),
                raw_value: status.as_bytes().to_vec(),
                ..Default::default()
            }],
        }),
        end_of_stream: true,
        ..Default::default()
    })
}

/// The status of an immediate response.
fn immediate(reply: Reply) -> i32 {
    match reply {
        Reply::ImmediateResponse(r) => r.status.unwrap().code,
        other => panic!("not an immediate response: {other:?}"),
    }
}

const CHAT: &[u8] = br#"{"model":"mock","messages":[{"role":"user","content":"hi"}]}"#;

#[tokio::test]
async fn messages_out_of_turn_end_the_stream_with_invalid_argument() {
    let p = picker(|_| {}).await;
    // A body first (the memory attack: chunks held before any headers) is refused at the first chunk.
    let mut x = open(&p.address).await;
    x.send(body(&vec![b'x'; 1 << 20], false)).await;
    let status = x.end().await;
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains("before the request headers"), "{status:?}");
    // Response headers before the request was routed.
    let mut x = open(&p.address).await;
    x.send(headers("POST", "/v1/chat/completions", false)).await;
    x.send(response_headers("200")).await;
    assert_eq!(x.end().await.code(), Code::InvalidArgument);
    // Headers without :path or :method.
    for (method, path) in [("", "/v1/chat/completions"), ("POST", "")] {
        let mut x = open(&p.address).await;
        x.send(headers(method, path, true)).await;
        assert_eq!(x.end().await.code(), Code::InvalidArgument, "{method:?} {path:?}");
    }
    // Request headers twice.
    let mut x = open(&p.address).await;
    x.send(headers("GET", "/v1/models", true)).await;
    x.send(headers("GET", "/v1/models", true)).await;
    assert_eq!(x.end().await.code(), Code::InvalidArgument);
}

#[tokio::test]
async fn paths_serve_does_not_serve_get_its_answer() {
    let p = picker(|_| {}).await;
    for (method, path, status) in [
        ("POST", "/nope", 404),
        ("GET", "/v1/chat/completions", 405),
        ("POST", "/v1/models", 405),
        ("POST", "/health", 404),
        ("POST", "%%garbage", 404),
    ] {
        let mut x = open(&p.address).await;
        x.send(headers(method, path, false)).await;
        assert_eq!(immediate(x.next().await.unwrap()), status, "{method} {path}");
        assert_eq!(x.end().await.code(), Code::Ok);
    }
    // A served path with a query string is routed.
    let mut x = open(&p.address).await;
    x.send(headers("POST", "/v1/chat/completions?x=1", false)).await;
    x.send(body(CHAT, true)).await;
    assert!(matches!(x.next().await.unwrap(), Reply::RequestHeaders(_)));
}

#[tokio::test]
async fn bodies_arriving_at_once_share_one_budget() {
    let p = picker(|c| {
        c.max_body_bytes = 64 << 10;
        c.max_buffered_body_bytes = Some(100 << 10);
    })
    .await;
    let chunk = vec![b' '; 60 << 10];
    let mut a = open(&p.address).await;
    a.send(headers("POST", "/v1/chat/completions", false)).await;
    a.send(body(&chunk, false)).await;
    // `a` holds 60 KiB: another 60 KiB body does not fit, and is refused at once with a 503.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(p.state.bodies.used(), 60 << 10);
    let mut b = open(&p.address).await;
    b.send(headers("POST", "/v1/chat/completions", false)).await;
    b.send(body(&chunk, false)).await;
    assert_eq!(immediate(b.next().await.unwrap()), 503);
    // `a` ends its body (JSON after leading spaces) and is routed; the budget is free again.
    a.send(body(CHAT, true)).await;
    assert!(matches!(a.next().await.unwrap(), Reply::RequestHeaders(_)));
    assert_eq!(p.state.bodies.used(), 0);
    // One body over max_body_bytes is a 413, whatever the budget.
    let mut c = open(&p.address).await;
    c.send(headers("POST", "/v1/chat/completions", false)).await;
    c.send(body(&chunk, false)).await;
    c.send(body(&chunk, false)).await;
    assert_eq!(immediate(c.next().await.unwrap()), 413);
    drop(c);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(p.state.bodies.used(), 0, "a stream that ends gives its bytes back");
}

#[tokio::test]
async fn each_phase_has_a_deadline() {
    let p = picker(|c| {
        c.server.header_read_timeout_ms = 300;
        c.server.request_body_timeout_ms = 300;
        c.first_byte_timeout_ms = 300;
        c.stream_idle_timeout_ms = 300;
    })
    .await;
    // No message at all.
    let mut x = open(&p.address).await;
    let status = x.end().await;
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    // Headers, then a body that never ends: the client's 408.
    let mut x = open(&p.address).await;
    x.send(headers("POST", "/v1/chat/completions", false)).await;
    x.send(body(b"{", false)).await;
    assert_eq!(immediate(x.next().await.unwrap()), 408);
    // Routed, and no response headers: the stream ends, the endpoint's load is released and the endpoint failed.
    let mut x = open(&p.address).await;
    x.send(headers("POST", "/v1/chat/completions", false)).await;
    x.send(body(CHAT, true)).await;
    assert!(matches!(x.next().await.unwrap(), Reply::RequestHeaders(_)));
    let load = || p.state.registry.membership().snapshot.load(0).in_flight_requests();
    assert_eq!(load(), 1);
    let status = x.end().await;
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(status.message().contains("first_byte_timeout_ms"), "{status:?}");
    assert_eq!(load(), 0, "the load is released when the deadline passes");
    // A response that started and went quiet.
    let mut x = open(&p.address).await;
    x.send(headers("GET", "/v1/models", true)).await;
    assert!(matches!(x.next().await.unwrap(), Reply::RequestHeaders(_)));
    x.send(Message::ResponseHeaders(HttpHeaders::default())).await;
    assert!(matches!(x.next().await.unwrap(), Reply::ResponseHeaders(_)));
    let status = x.end().await;
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(status.message().contains("stream_idle_timeout_ms"), "{status:?}");
}

/// Raw gRPC over HTTP/2, for messages Envoy's client cannot send: the stream's end status.
async fn raw(address: &str, frame: Vec<u8>) -> (String, String) {
    let tcp = tokio::net::TcpStream::connect(address.trim_start_matches("http://"))
        .await
        .unwrap();
    let (mut client, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(connection);
    let request = axum::http::Request::post(format!("{address}/envoy.service.ext_proc.v3.ExternalProcessor/Process"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let (response, mut send) = client.send_request(request, false).unwrap();
    send.send_data(frame.into(), false).unwrap();
    let response = tokio::time::timeout(Duration::from_secs(10), response)
        .await
        .unwrap()
        .unwrap();
    let mut body = response.into_body();
    while let Some(data) = body.data().await {
        drop(data);
    }
    let trailers = body.trailers().await.unwrap().unwrap_or_default();
    let text = |name: &str| {
        trailers
            .get(name)
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default()
    };
    (text("grpc-status"), text("grpc-message"))
}

#[tokio::test]
async fn undecodable_and_oversized_messages_are_errors_not_ok() {
    let p = picker(|_| {}).await;
    // A message whose bytes are not a ProcessingRequest.
    let mut frame = vec![0, 0, 0, 0, 4];
    frame.extend_from_slice(&[0xff; 4]);
    let (status, message) = raw(&p.address, frame).await;
    assert_eq!(status, (Code::InvalidArgument as i32).to_string(), "{message}");
    // A message declaring more bytes than the picker reads.
    let too_long = u32::try_from(dprouter_epp::max_message_bytes(64 << 20) + 1).unwrap();
    let mut frame = vec![0];
    frame.extend_from_slice(&too_long.to_be_bytes());
    let (status, message) = raw(&p.address, frame).await;
    assert_eq!(status, (Code::ResourceExhausted as i32).to_string(), "{message}");
}

/// A connection to the picker at `address` that sends the HTTP/2 preface and an empty SETTINGS, then nothing.
async fn preface_only(address: &str) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let mut tcp = tokio::net::TcpStream::connect(address.trim_start_matches("http://"))
        .await
        .unwrap();
    tcp.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .await
        .unwrap();
    tcp
}

/// The gRPC port is the gateway's listener in HTTP/2: 1,000 connections that open no stream (the preface and
/// SETTINGS, then nothing) are each told to go away (GOAWAY) and closed at the idle timeout, not kept forever.
#[tokio::test]
async fn idle_connections_are_closed_at_the_idle_timeout() {
    use tokio::io::AsyncReadExt;
    let p = picker(|c| c.server.idle_timeout_ms = 300).await;
    let started = std::time::Instant::now();
    let mut connections = Vec::new();
    for _ in 0..1000 {
        connections.push(preface_only(&p.address).await);
    }
    for mut tcp in connections {
        let mut read = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut read))
            .await
            .expect("closed within 5 s")
            .unwrap();
        // The frames the picker sent: a 9-byte head (length, type, flags, stream), then the payload.
        let mut types = Vec::new();
        let mut rest = &read[..];
        while rest.len() >= 9 {
            let length = usize::from(rest[0]) << 16 | usize::from(rest[1]) << 8 | usize::from(rest[2]);
            types.push(rest[3]);
            rest = &rest[(9 + length).min(rest.len())..];
        }
        assert!(types.contains(&0x7), "a GOAWAY before the close: frame types {types:?}");
    }
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "{:?}",
        started.elapsed()
    );
}

/// The gRPC port holds at most `max_connections`: with every slot taken by connections that open no stream, a
/// data plane's new connection waits to be accepted while the idle ones are asked to go (GOAWAY) and close, then
/// is served; the idle ones are closed long before their own idle timeout.
#[tokio::test]
async fn at_max_connections_idle_ones_make_room_for_a_new_one() {
    use tokio::io::AsyncReadExt;
    let p = picker(|c| {
        c.server.max_connections = 8;
        c.server.idle_timeout_ms = 60_000;
    })
    .await;
    let mut idle = Vec::new();
    for _ in 0..8 {
        idle.push(preface_only(&p.address).await);
    }
    // Past the grace an idle connection gets before it may be reaped.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let started = std::time::Instant::now();
    let mut x = tokio::time::timeout(Duration::from_secs(10), open(&p.address))
        .await
        .expect("the new connection was served");
    x.send(headers("GET", "/v1/models", true)).await;
    assert!(matches!(x.next().await.unwrap(), Reply::RequestHeaders(_)));
    assert!(started.elapsed() < Duration::from_secs(10));
    // The idle connections were closed to make room (their idle timeout is a minute away).
    let mut closed = 0;
    for mut tcp in idle {
        let mut read = Vec::new();
        if tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut read))
            .await
            .is_ok()
        {
            closed += 1;
        }
    }
    assert!(closed >= 1, "no idle connection was closed to make room");
}
