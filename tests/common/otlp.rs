//! An OTLP collector for the tests: OTLP's own service and messages (`opentelemetry-proto`) on tonic (gRPC) and
//! axum (HTTP with protobuf), keeping every span it gets.
#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
pub use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::common::v1::KeyValue;
pub use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;

use super::eventually;

/// The spans a collector got, each with its resource's `service.name`.
#[derive(Clone, Default)]
pub struct Collector(Arc<Mutex<Vec<(String, Span)>>>);

impl Collector {
    fn take(&self, request: ExportTraceServiceRequest) {
        let mut got = self.0.lock().unwrap();
        for resource in request.resource_spans {
            let service = resource
                .resource
                .as_ref()
                .and_then(|r| string(&r.attributes, "service.name"))
                .unwrap_or_default();
            for scope in resource.scope_spans {
                got.extend(scope.spans.into_iter().map(|s| (service.clone(), s)));
            }
        }
    }

    pub fn spans(&self) -> Vec<(String, Span)> {
        self.0.lock().unwrap().clone()
    }

    /// The spans of trace `trace_id` (hex), once there are `n`.
    pub async fn trace(&self, trace_id: &str, n: usize) -> Vec<(String, Span)> {
        let of_trace = || {
            self.spans()
                .into_iter()
                .filter(|(_, s)| hex(&s.trace_id) == trace_id)
                .collect::<Vec<_>>()
        };
        eventually(Duration::from_secs(20), || {
            let found = of_trace().len();
            async move { found >= n }
        })
        .await;
        of_trace()
    }
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.take(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// A collector over OTLP/gRPC: its spans and its endpoint.
pub async fn grpc_collector() -> (Collector, String) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let collector = Collector::default();
    let service = TraceServiceServer::new(collector.clone());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    (collector, url)
}

/// A collector over OTLP/HTTP with protobuf (`POST /v1/traces`): its spans and its base URL.
pub async fn http_collector() -> (Collector, String) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let collector = Collector::default();
    let keep = collector.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: bytes::Bytes| async move {
            keep.take(ExportTraceServiceRequest::decode(body).unwrap());
            let answer = ExportTraceServiceResponse::default().encode_to_vec();
            ([("content-type", "application/x-protobuf")], answer)
        }),
    );
    tokio::spawn(async move { axum::serve(listener, app).await });
    (collector, url)
}

/// A gRPC collector on a thread and runtime of its own, for callers outside a runtime: its spans and endpoint.
pub fn grpc_collector_thread() -> (Collector, String) {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            tx.send(grpc_collector().await).unwrap();
            std::future::pending::<()>().await;
        });
    });
    rx.recv().unwrap()
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn attribute<'a>(attributes: &'a [KeyValue], key: &str) -> Option<&'a AnyValue> {
    attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref()?.value.as_ref())
}

pub fn string(attributes: &[KeyValue], key: &str) -> Option<String> {
    match attribute(attributes, key)? {
        AnyValue::StringValue(s) => Some(s.clone()),
        _ => None,
    }
}

pub fn int(attributes: &[KeyValue], key: &str) -> Option<i64> {
    match attribute(attributes, key)? {
        AnyValue::IntValue(i) => Some(*i),
        _ => None,
    }
}
