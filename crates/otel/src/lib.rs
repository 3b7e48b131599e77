//! OpenTelemetry for dprouter: its trace settings, the OTLP exporter behind a bounded queue, and the `tracing`
//! layer that turns the gateway's spans into OpenTelemetry spans.
//!
//! The gateway makes its spans with `tracing` under the target [`SPAN_TARGET`] (the gateway's `observe::spans`); the
//! layer of a running [`Tracing`] is the only one that records them, through `tracing-opentelemetry`, into a tracer
//! provider with the configured sampler, whose one processor is [`queue::Queue`]: spans never wait for the
//! collector, and what cannot be sent is dropped and counted. The exporter is `opentelemetry-otlp`'s, over gRPC
//! (tonic) or HTTP with protobuf (hyper). Its own crate because it is the heavy part (OTLP's generated protos and
//! their clients); the gateway only needs `tracing-opentelemetry`'s span extension.

pub mod queue;
pub mod settings;

use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanExporter as _};
use opentelemetry_sdk::Resource;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

pub use queue::{SPANS_DROPPED, SPANS_EXPORTED};
pub use settings::{Protocol, Root, Sampler, Settings, SettingsError, TracingConfig};

/// The `tracing` target of the spans that are exported; the log output leaves it out.
pub const SPAN_TARGET: &str = "dprouter::trace";

/// The exporter could not be made.
#[derive(Debug, thiserror::Error)]
#[error("tracing: cannot export to {endpoint}: {message}")]
pub struct StartError {
    endpoint: String,
    message: String,
}

/// Tracing on: the tracer provider and its exporting task.
pub struct Tracing {
    provider: SdkTracerProvider,
    exporting: queue::Exporting,
}

impl Tracing {
    /// Starts exporting as `settings` say. Inside a Tokio runtime: the exporting task runs on it.
    pub fn start(settings: &Settings) -> Result<Self, StartError> {
        let failed = |e: &dyn std::fmt::Display| StartError {
            endpoint: settings.endpoint.clone(),
            message: e.to_string(),
        };
        let exporter = match settings.protocol {
            Protocol::Grpc => opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_endpoint(&settings.endpoint)
                .with_timeout(settings.export_timeout)
                .build(),
            Protocol::HttpProtobuf => opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                .with_endpoint(&settings.endpoint)
                .with_timeout(settings.export_timeout)
                .with_http_client(opentelemetry_http::hyper::HyperClient::with_default_connector(
                    settings.export_timeout,
                    None,
                ))
                .build(),
        };
        let mut exporter = exporter.map_err(|e| failed(&e))?;
        let resource = Resource::builder()
            .with_service_name(settings.service_name.clone())
            .build();
        exporter.set_resource(&resource);
        let batching = queue::Batching {
            max_queue_spans: settings.max_queue_spans,
            max_batch_spans: settings.max_batch_spans,
            schedule_delay: settings.schedule_delay,
            export_timeout: settings.export_timeout,
        };
        let (queue, exporting) = queue::start(exporter, batching);
        let provider = SdkTracerProvider::builder()
            .with_resource(resource)
            .with_sampler(sdk_sampler(settings.sampler))
            .with_span_processor(queue)
            .build();
        Ok(Self { provider, exporting })
    }

    /// The layer that records the gateway's spans (and only them) into this provider.
    pub fn layer<S>(&self) -> impl Layer<S> + Send + Sync
    where
        S: tracing::Subscriber + for<'a> LookupSpan<'a> + Send + Sync,
    {
        tracing_opentelemetry::layer()
            .with_tracer(self.provider.tracer("dprouter"))
            .with_location(false)
            .with_threads(false)
            .with_target(false)
            .with_level(false)
            .with_tracked_inactivity(false)
            .with_context_activation(false)
            .with_filter(Targets::new().with_target(SPAN_TARGET, tracing::Level::INFO))
    }

    /// Sends what is queued and stops, within `within`.
    pub async fn finish(self, within: Duration) {
        self.exporting.finish(within).await;
        drop(self.provider);
    }
}

fn sdk_sampler(sampler: Sampler) -> opentelemetry_sdk::trace::Sampler {
    use opentelemetry_sdk::trace::Sampler as Sdk;
    let root = |root: Root| match root {
        Root::AlwaysOn => Sdk::AlwaysOn,
        Root::AlwaysOff => Sdk::AlwaysOff,
        Root::Ratio(r) => Sdk::TraceIdRatioBased(r),
    };
    match sampler {
        Sampler::AlwaysOn => Sdk::AlwaysOn,
        Sampler::AlwaysOff => Sdk::AlwaysOff,
        Sampler::Ratio(r) => Sdk::TraceIdRatioBased(r),
        Sampler::ParentBased(r) => Sdk::ParentBased(Box::new(root(r))),
    }
}
