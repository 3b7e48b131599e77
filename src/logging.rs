//! The process's log output (standard error, filtered by `RUST_LOG`, `info` by default) and, for `serve` and `epp`
//! with tracing on, the layer that exports the gateway's spans (`dprouter_otel`). The spans' target stays out of
//! the log output.

use std::io::IsTerminal;

use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// Installs the process's subscriber: the log output, and `tracing`'s layer when given.
pub fn init(tracing: Option<&dprouter_otel::Tracing>) {
    init_at(tracing, "info");
}

/// [`init`], logging at `level` and above unless `RUST_LOG` says otherwise.
pub fn init_at(tracing: Option<&dprouter_otel::Tracing>, level: &str) {
    let mut filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(level));
    if let Ok(spans_off) = format!("{}=off", dprouter_otel::SPAN_TARGET).parse() {
        filter = filter.add_directive(spans_off);
    }
    let log = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_filter(filter);
    let registry = tracing_subscriber::registry().with(log);
    match tracing {
        Some(tracing) => registry.with(tracing.layer()).init(),
        None => registry.init(),
    }
}
