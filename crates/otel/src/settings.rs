//! The `[tracing]` section of the config file and the OpenTelemetry environment variables, resolved into the
//! settings the exporter runs with.
//!
//! Each setting is taken from the config file when it is set there, else from its OpenTelemetry variable, else its
//! default (the specification's, but for the endpoint: tracing stays off until one is given):
//!
//! | `[tracing]` | variable | default |
//! |---|---|---|
//! | `endpoint` | `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, or `OTEL_EXPORTER_OTLP_ENDPOINT` (+ `/v1/traces` over HTTP) | none: off |
//! | `protocol` | `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`, `OTEL_EXPORTER_OTLP_PROTOCOL` | `grpc` (or `http/protobuf`) |
//! | `service_name` | `OTEL_SERVICE_NAME` | `dprouter` |
//! | `sampler` | `OTEL_TRACES_SAMPLER` | `parentbased_always_on` |
//! | `sampler_arg` | `OTEL_TRACES_SAMPLER_ARG` | 1.0 (the ratio of the `traceidratio` samplers) |
//! | `max_queue_spans` | `OTEL_BSP_MAX_QUEUE_SIZE` | 2048 |
//! | `max_batch_spans` | `OTEL_BSP_MAX_EXPORT_BATCH_SIZE` | 512 |
//! | `schedule_delay_ms` | `OTEL_BSP_SCHEDULE_DELAY` | 5000 |
//! | `export_timeout_ms` | `OTEL_EXPORTER_OTLP_TRACES_TIMEOUT`, `OTEL_EXPORTER_OTLP_TIMEOUT` | 10000 |
//!
//! `OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none` turn tracing off whatever the file says.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// `[tracing]`: where and how the gateway exports its spans (every field optional; see the module documentation).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TracingConfig {
    /// The OTLP collector: `http://host:4317` over gRPC, the full URL (`http://host:4318/v1/traces`) over HTTP.
    pub endpoint: Option<String>,
    /// `grpc` or `http/protobuf`.
    pub protocol: Option<String>,
    pub service_name: Option<String>,
    /// `always_on`, `always_off`, `traceidratio`, `parentbased_always_on`, `parentbased_always_off`,
    /// `parentbased_traceidratio`.
    pub sampler: Option<String>,
    pub sampler_arg: Option<f64>,
    /// Finished spans waiting for export; more are dropped (and counted).
    pub max_queue_spans: Option<usize>,
    pub max_batch_spans: Option<usize>,
    /// The longest a finished span waits for its batch to fill before it is sent.
    pub schedule_delay_ms: Option<u64>,
    /// The longest one export may take; a batch that does not make it is dropped (and counted).
    pub export_timeout_ms: Option<u64>,
}

/// OTLP's two transports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Grpc,
    HttpProtobuf,
}

/// Which traces are recorded and exported.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampler {
    AlwaysOn,
    AlwaysOff,
    /// This share of traces, by trace id.
    Ratio(f64),
    /// As the caller's `traceparent` says when it came with one, else the inner sampler.
    ParentBased(Root),
}

/// The sampler of a trace that starts here, under [`Sampler::ParentBased`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Root {
    AlwaysOn,
    AlwaysOff,
    Ratio(f64),
}

/// Tracing as it runs: the config file and the environment resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    pub endpoint: String,
    pub protocol: Protocol,
    pub service_name: String,
    pub sampler: Sampler,
    pub max_queue_spans: usize,
    pub max_batch_spans: usize,
    pub schedule_delay: Duration,
    pub export_timeout: Duration,
}

/// A setting that cannot be used, with what was wrong.
#[derive(Debug, thiserror::Error)]
#[error("tracing: {0}")]
pub struct SettingsError(String);

/// Most spans a queue may hold: at a few hundred bytes to a few KB each, a few hundred MB at most.
const MAX_QUEUE_SPANS: usize = 1 << 20;

impl TracingConfig {
    /// The settings, from this section and the variables `env` answers (`std::env::var` in the gateway); `None`
    /// when tracing is off.
    pub fn resolve(&self, env: &dyn Fn(&str) -> Option<String>) -> Result<Option<Settings>, SettingsError> {
        let var = |name: &str| env(name).map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
        if var("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true"))
            || var("OTEL_TRACES_EXPORTER").is_some_and(|v| v.eq_ignore_ascii_case("none"))
        {
            return Ok(None);
        }
        let protocol = match self
            .protocol
            .clone()
            .or_else(|| var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"))
            .or_else(|| var("OTEL_EXPORTER_OTLP_PROTOCOL"))
            .as_deref()
        {
            None | Some("grpc") => Protocol::Grpc,
            Some("http/protobuf") => Protocol::HttpProtobuf,
            Some(other) => {
                return Err(SettingsError(format!(
                    "protocol {other:?} is not supported: use \"grpc\" or \"http/protobuf\""
                )))
            }
        };
        let endpoint = match (&self.endpoint, var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")) {
            (Some(e), _) => e.trim().to_string(),
            (None, Some(e)) => e,
            // The variable for all signals is a base URL: over HTTP, traces go to its `/v1/traces`.
            (None, None) => match var("OTEL_EXPORTER_OTLP_ENDPOINT") {
                None => return Ok(None),
                Some(base) if protocol == Protocol::HttpProtobuf => {
                    format!("{}/v1/traces", base.trim_end_matches('/'))
                }
                Some(base) => base,
            },
        };
        if endpoint.is_empty() {
            return Ok(None);
        }
        check_endpoint(&endpoint)?;
        let number = |file: Option<u64>, names: &[&str], default: u64| -> Result<u64, SettingsError> {
            if let Some(v) = file {
                return Ok(v);
            }
            for name in names {
                if let Some(v) = var(name) {
                    return v
                        .parse()
                        .map_err(|_| SettingsError(format!("{name}={v:?} is not a whole number")));
                }
            }
            Ok(default)
        };
        let sampler_arg = match self.sampler_arg {
            Some(arg) => Some(arg),
            None => match var("OTEL_TRACES_SAMPLER_ARG") {
                Some(v) => Some(
                    v.parse::<f64>()
                        .map_err(|_| SettingsError(format!("OTEL_TRACES_SAMPLER_ARG={v:?} is not a number")))?,
                ),
                None => None,
            },
        };
        let sampler_name = self.sampler.clone().or_else(|| var("OTEL_TRACES_SAMPLER"));
        let sampler = sampler(sampler_name.as_deref().unwrap_or("parentbased_always_on"), sampler_arg)?;
        let settings = Settings {
            endpoint,
            protocol,
            service_name: self
                .service_name
                .clone()
                .or_else(|| var("OTEL_SERVICE_NAME"))
                .unwrap_or_else(|| "dprouter".into()),
            sampler,
            max_queue_spans: number(
                self.max_queue_spans.map(|n| n as u64),
                &["OTEL_BSP_MAX_QUEUE_SIZE"],
                2048,
            )? as usize,
            max_batch_spans: number(
                self.max_batch_spans.map(|n| n as u64),
                &["OTEL_BSP_MAX_EXPORT_BATCH_SIZE"],
                512,
            )? as usize,
            schedule_delay: Duration::from_millis(number(self.schedule_delay_ms, &["OTEL_BSP_SCHEDULE_DELAY"], 5000)?),
            export_timeout: Duration::from_millis(number(
                self.export_timeout_ms,
                &["OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"],
                10_000,
            )?),
        };
        if settings.max_queue_spans == 0 || settings.max_queue_spans > MAX_QUEUE_SPANS {
            return Err(SettingsError(format!(
                "max_queue_spans must be between 1 and {MAX_QUEUE_SPANS}"
            )));
        }
        if settings.max_batch_spans == 0 || settings.max_batch_spans > settings.max_queue_spans {
            return Err(SettingsError(
                "max_batch_spans must be at least 1 and at most max_queue_spans".into(),
            ));
        }
        // Under 7 days, as the gateway's other durations.
        const WEEK: Duration = Duration::from_secs(7 * 24 * 3600);
        if settings.schedule_delay.is_zero() || settings.schedule_delay > WEEK {
            return Err(SettingsError(
                "schedule_delay_ms must be between 1 ms and 7 days".into(),
            ));
        }
        if settings.export_timeout.is_zero() || settings.export_timeout > WEEK {
            return Err(SettingsError(
                "export_timeout_ms must be between 1 ms and 7 days".into(),
            ));
        }
        Ok(Some(settings))
    }
}

/// An `http://` URL with a host (TLS to the collector is not supported yet: a collector beside the gateway, or
/// its node's, takes plain OTLP).
fn check_endpoint(endpoint: &str) -> Result<(), SettingsError> {
    let uri: http::Uri = endpoint
        .parse()
        .map_err(|e| SettingsError(format!("endpoint {endpoint:?} is not a URL: {e}")))?;
    match (uri.scheme_str(), uri.host()) {
        (Some("http"), Some(_)) => Ok(()),
        (Some("https"), _) => Err(SettingsError(format!(
            "endpoint {endpoint:?}: TLS to the collector is not supported; use an http:// collector (a sidecar or \
             the node's) that forwards over TLS"
        ))),
        _ => Err(SettingsError(format!(
            "endpoint {endpoint:?} must be an http:// URL with a host, such as http://127.0.0.1:4317"
        ))),
    }
}

fn sampler(name: &str, arg: Option<f64>) -> Result<Sampler, SettingsError> {
    let ratio = || -> Result<f64, SettingsError> {
        let r = arg.unwrap_or(1.0);
        if (0.0..=1.0).contains(&r) {
            Ok(r)
        } else {
            Err(SettingsError(format!("the sampler's ratio {r} is not between 0 and 1")))
        }
    };
    Ok(match name {
        "always_on" => Sampler::AlwaysOn,
        "always_off" => Sampler::AlwaysOff,
        "traceidratio" => Sampler::Ratio(ratio()?),
        "parentbased_always_on" => Sampler::ParentBased(Root::AlwaysOn),
        "parentbased_always_off" => Sampler::ParentBased(Root::AlwaysOff),
        "parentbased_traceidratio" => Sampler::ParentBased(Root::Ratio(ratio()?)),
        other => {
            return Err(SettingsError(format!(
                "sampler {other:?} is not supported: use always_on, always_off, traceidratio, \
                 parentbased_always_on, parentbased_always_off or parentbased_traceidratio"
            )))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |name| pairs.iter().find(|(n, _)| *n == name).map(|(_, v)| v.to_string())
    }

    #[test]
    fn off_until_an_endpoint_is_given() {
        assert_eq!(TracingConfig::default().resolve(&env(&[])).unwrap(), None);
        let on = TracingConfig::default()
            .resolve(&env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")]))
            .unwrap()
            .unwrap();
        assert_eq!(on.endpoint, "http://127.0.0.1:4317");
        assert_eq!(on.protocol, Protocol::Grpc);
        assert_eq!(on.sampler, Sampler::ParentBased(Root::AlwaysOn));
        assert_eq!(on.service_name, "dprouter");
        assert_eq!((on.max_queue_spans, on.max_batch_spans), (2048, 512));
        // Disabled the OpenTelemetry way, whatever the file says.
        let file = TracingConfig {
            endpoint: Some("http://collector:4317".into()),
            ..TracingConfig::default()
        };
        assert_eq!(file.resolve(&env(&[("OTEL_SDK_DISABLED", "true")])).unwrap(), None);
        assert_eq!(file.resolve(&env(&[("OTEL_TRACES_EXPORTER", "none")])).unwrap(), None);
    }

    #[test]
    fn the_file_wins_over_the_environment_and_http_gets_its_path() {
        let vars = env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
            ("OTEL_SERVICE_NAME", "edge"),
            ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
            ("OTEL_TRACES_SAMPLER_ARG", "0.25"),
            ("OTEL_BSP_SCHEDULE_DELAY", "200"),
        ]);
        let s = TracingConfig::default().resolve(&vars).unwrap().unwrap();
        assert_eq!(s.endpoint, "http://collector:4318/v1/traces");
        assert_eq!(s.protocol, Protocol::HttpProtobuf);
        assert_eq!(s.service_name, "edge");
        assert_eq!(s.sampler, Sampler::ParentBased(Root::Ratio(0.25)));
        assert_eq!(s.schedule_delay, Duration::from_millis(200));
        let file = TracingConfig {
            endpoint: Some("http://other:4317".into()),
            protocol: Some("grpc".into()),
            sampler: Some("always_off".into()),
            ..TracingConfig::default()
        };
        let s = file.resolve(&vars).unwrap().unwrap();
        assert_eq!(
            (s.endpoint.as_str(), s.protocol, s.sampler),
            ("http://other:4317", Protocol::Grpc, Sampler::AlwaysOff)
        );
        // The traces variable is taken as it is.
        let s = TracingConfig::default()
            .resolve(&env(&[
                ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://c:4318/custom"),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
            ]))
            .unwrap()
            .unwrap();
        assert_eq!(s.endpoint, "http://c:4318/custom");
    }

    #[test]
    fn bad_settings_say_what_is_wrong() {
        let with = |f: fn(&mut TracingConfig)| {
            let mut c = TracingConfig {
                endpoint: Some("http://127.0.0.1:4317".into()),
                ..TracingConfig::default()
            };
            f(&mut c);
            c.resolve(&env(&[])).unwrap_err().to_string()
        };
        assert!(with(|c| c.protocol = Some("http/json".into())).contains("http/protobuf"));
        assert!(with(|c| c.sampler = Some("jaeger_remote".into())).contains("parentbased_always_on"));
        assert!(with(|c| {
            c.sampler = Some("traceidratio".into());
            c.sampler_arg = Some(1.5);
        })
        .contains("between 0 and 1"));
        assert!(with(|c| c.endpoint = Some("https://collector:4317".into())).contains("TLS"));
        assert!(with(|c| c.endpoint = Some("collector:4317".into())).contains("http://"));
        assert!(with(|c| c.max_queue_spans = Some(0)).contains("max_queue_spans"));
        assert!(with(|c| c.max_batch_spans = Some(4096)).contains("max_batch_spans"));
        assert!(with(|c| c.export_timeout_ms = Some(0)).contains("export_timeout_ms"));
        let vars = env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"),
            ("OTEL_BSP_MAX_QUEUE_SIZE", "many"),
        ]);
        let err = TracingConfig::default().resolve(&vars).unwrap_err().to_string();
        assert!(err.contains("OTEL_BSP_MAX_QUEUE_SIZE"), "{err}");
    }
}
