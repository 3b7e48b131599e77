//! The Grafana dashboard (`deploy/grafana/dprouter.json`) charts exactly the metrics the gateway exports, and a
//! running gateway, after ordinary traffic and the usual faults, exports every series the dashboard queries.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::{BTreeMap, BTreeSet};

use std::time::Duration;

use common::{client, eventually, get, read, send, Proc};
use dprouter_gateway::telemetry;
use hyper::StatusCode;
use serde_json::{json, Value};

const DASHBOARD: &str = include_str!("../deploy/grafana/dprouter.json");
/// Where the metric names are defined: the gateway's, and tracing's span counters.
const TELEMETRY_SOURCE: &str = concat!(
    include_str!("../crates/gateway/src/observe/telemetry.rs"),
    include_str!("../crates/otel/src/queue.rs")
);
const HISTOGRAM_SUFFIXES: [&str; 3] = ["_bucket", "_sum", "_count"];

fn dashboard() -> Value {
    serde_json::from_str(DASHBOARD).expect("deploy/grafana/dprouter.json is not valid JSON")
}

/// Every panel, those inside collapsed rows included.
fn panels(dashboard: &Value) -> Vec<&Value> {
    fn walk<'a>(list: &'a Value, out: &mut Vec<&'a Value>) {
        for panel in list.as_array().into_iter().flatten() {
            out.push(panel);
            if let Some(inner) = panel.get("panels") {
                walk(inner, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    out
}

/// `(where, query)`: every `expr` of every panel's targets, and every template variable's query.
fn queries(dashboard: &Value) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for panel in panels(dashboard) {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().unwrap_or_default();
            let title = panel["title"].as_str().unwrap_or_default();
            assert!(
                !expr.trim().is_empty(),
                "panel {title:?} has a target without an expr: {target}"
            );
            out.push((format!("panel {title:?}"), expr.to_string()));
        }
    }
    for var in dashboard["templating"]["list"].as_array().unwrap() {
        if var["type"] != "query" {
            continue;
        }
        let name = var["name"].as_str().unwrap_or_default();
        // A plain string, or the object newer Grafana writes (`{"query": ..., "refId": ...}`).
        let query = var["query"].as_str().or_else(|| var["query"]["query"].as_str());
        for q in query.into_iter().chain(var["definition"].as_str()) {
            out.push((format!("variable ${name}"), q.to_string()));
        }
    }
    out
}

/// Every `dprouter_[a-z0-9_]+` name in `text`, as written (histogram suffixes kept).
fn metric_names(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = text;
    let mut before: Option<char> = None;
    while let Some(at) = rest.find("dprouter_") {
        let prev = rest[..at].chars().next_back().or(before);
        let tail = &rest[at..];
        let len = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        if !prev.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':') {
            names.push(tail[..len].to_string());
        }
        before = tail[..len].chars().next_back();
        rest = &tail[len..];
    }
    names
}

/// The exported metric a queried name belongs to: itself, or a histogram's base name without `_bucket`, `_sum` or
/// `_count`.
fn base(name: &str) -> &str {
    if telemetry::ALL.contains(&name) {
        return name;
    }
    HISTOGRAM_SUFFIXES
        .iter()
        .find_map(|suffix| name.strip_suffix(suffix))
        .unwrap_or(name)
}

/// Queried name (as written) → where it is queried.
fn used_names(dashboard: &Value) -> BTreeMap<String, BTreeSet<String>> {
    let mut used: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (place, query) in queries(dashboard) {
        for name in metric_names(&query) {
            used.entry(name).or_default().insert(place.clone());
        }
    }
    used
}

#[test]
fn the_dashboard_charts_exactly_the_metrics_the_gateway_exports() {
    let all: BTreeSet<&str> = telemetry::ALL.iter().copied().collect();
    assert_eq!(all.len(), telemetry::ALL.len(), "telemetry::ALL has a duplicate");
    // Every metric name the telemetry module defines is in ALL (a new const must be added there too).
    let defined: BTreeSet<String> = metric_names(TELEMETRY_SOURCE)
        .into_iter()
        .filter(|n| TELEMETRY_SOURCE.contains(&format!("\"{n}\"")))
        .collect();
    let listed: BTreeSet<String> = all.iter().map(|n| n.to_string()).collect();
    assert_eq!(
        defined, listed,
        "telemetry.rs defines these metric names; telemetry::ALL lists these"
    );

    let dashboard = dashboard();
    let used = used_names(&dashboard);
    for (name, places) in &used {
        assert!(
            all.contains(base(name)),
            "the dashboard queries {name}, which the gateway does not export (in {places:?}); exported: {all:?}"
        );
    }
    let charted: BTreeSet<&str> = used.keys().map(|n| base(n)).collect();
    for name in &all {
        assert!(
            charted.contains(name),
            "the gateway exports {name} but no panel of deploy/grafana/dprouter.json queries it"
        );
    }

    // Importable and readable: a Prometheus datasource variable, the endpoint variable, unique panel ids, and a
    // description and a query on every panel.
    let vars = dashboard["templating"]["list"].as_array().unwrap();
    assert!(
        vars.iter()
            .any(|v| v["type"] == "datasource" && v["query"] == "prometheus"),
        "a datasource variable of type prometheus"
    );
    let endpoint = vars
        .iter()
        .find(|v| v["name"] == "endpoint")
        .expect("an endpoint variable");
    assert!(
        endpoint["definition"]
            .as_str()
            .unwrap()
            .starts_with("label_values(dprouter_endpoint_healthy"),
        "{endpoint}"
    );
    let mut ids = BTreeSet::new();
    for panel in panels(&dashboard) {
        let title = panel["title"].as_str().unwrap_or_default();
        assert!(
            ids.insert(panel["id"].as_u64().unwrap()),
            "duplicate panel id: {title:?}"
        );
        if panel["type"] == "row" {
            continue;
        }
        assert!(!title.is_empty(), "a panel without a title: {panel}");
        let description = panel["description"].as_str().unwrap_or_default();
        assert!(
            description.len() > 40,
            "panel {title:?} needs a description of what it shows and how to read it"
        );
        assert!(
            !panel["targets"].as_array().unwrap().is_empty(),
            "panel {title:?} has no query"
        );
        assert_eq!(
            panel["datasource"]["uid"], "${datasource}",
            "panel {title:?} uses the datasource variable"
        );
    }
}

#[test]
fn metric_names_are_found_where_promql_puts_them() {
    assert_eq!(
        metric_names("sum by (le) (rate(dprouter_ttft_seconds_bucket{endpoint=~\"$endpoint\"}[5m]))/dprouter_x2"),
        ["dprouter_ttft_seconds_bucket", "dprouter_x2"]
    );
    assert!(metric_names("not_dprouter_x + my:dprouter_y").is_empty());
    assert_eq!(base("dprouter_ttft_seconds_bucket"), "dprouter_ttft_seconds");
    assert_eq!(base("dprouter_requests_total"), "dprouter_requests_total");
    assert_eq!(base("dprouter_nothing_count"), "dprouter_nothing");
}

/// A scrape's sample names and `# TYPE` kinds.
fn parse_scrape(text: &str) -> (BTreeSet<String>, BTreeMap<String, String>) {
    let mut samples = BTreeSet::new();
    let mut kinds = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut words = rest.split_whitespace();
            if let (Some(name), Some(kind)) = (words.next(), words.next()) {
                kinds.insert(name.to_string(), kind.to_string());
            }
        } else if !line.starts_with('#') && !line.trim().is_empty() {
            let end = line.find(['{', ' ']).unwrap_or(line.len());
            samples.insert(line[..end].to_string());
        }
    }
    (samples, kinds)
}

/// Ordinary traffic through a gateway whose first worker refuses connections (one retry) in front of an engine that
/// answers 30% of generations with a 500 (a fixed seed makes which ones deterministic); then every series the
/// dashboard queries is in the scrape.
/// A gateway whose `cache_aware` follows a mock engine's KV events (and keys prompts with a tokenizer), after a
/// few requests: its scrape.
async fn precise_mode_scrape(c: &common::HttpClient) -> String {
    let engine = Proc::engine(&["--dp-size", "2", "--kv-events", "tcp://127.0.0.1:0"]);
    let info = get(c, &format!("{}/get_server_info", engine.url)).await.json;
    let config = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard-precise.toml");
    let tokenizer = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/smollm2");
    let toml = format!(
        "tokenizer = {tokenizer:?}\n[[workers]]\nurl = {:?}\ndp_size = 2\nkv_events = {}\n",
        engine.url, info["kv_events_endpoints"]
    );
    std::fs::write(&config, toml).unwrap();
    let gw = Proc::start(&["serve", "--listen", "127.0.0.1:0", "--config", config.to_str().unwrap()]);
    let sent = std::sync::atomic::AtomicU32::new(0);
    // Requests until one's events arrive (the subscription starts within a second of the gateway, and events
    // published before it are lost without a replay endpoint).
    let batches = eventually(Duration::from_secs(10), || async {
        // A new prompt each time: only new blocks make events.
        let n = sent.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let body = json!({"text": format!("prompt {n} long enough to fill a block or two of the index"), "sampling_params": {"max_new_tokens": 2}});
        let reply = read(send(c, &format!("{}/generate", gw.url), &[], body.to_string()).await).await;
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
        get(c, &format!("{}/metrics", gw.url))
            .await
            .text
            .lines()
            .any(|l| l.starts_with(telemetry::KV_EVENT_BATCHES) && !l.ends_with(" 0"))
    });
    assert!(batches.await, "no KV event batch was applied");
    get(c, &format!("{}/metrics", gw.url)).await.text
}

/// A gateway whose endpoint's prefill costs are fitted, after a dozen requests of different lengths: its scrape.
async fn learned_costs_scrape(c: &common::HttpClient) -> String {
    let engine = Proc::engine(&["--dp-size", "1", "--prefill-rate", "200000"]);
    let gw = Proc::start(&["serve", "--listen", "127.0.0.1:0", "--worker", &engine.url]);
    common::spread_prompts(c, &gw.url, 0, 12).await;
    get(c, &format!("{}/metrics", gw.url)).await.text
}

/// A gateway with one client (`[[clients]]`), after a request with its key and one without: its scrape.
async fn clients_scrape(c: &common::HttpClient) -> String {
    let engine = Proc::engine(&["--dp-size", "1"]);
    let config = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard-clients.toml");
    // `printf %s key-alice | sha256sum`
    let toml = format!(
        "[[clients]]\nname = \"alice\"\nkey_sha256 = \"87844ec0b0d738e89628640588acaa48537b814a5c4f9697e3b352d11ffedaef\"\n[[workers]]\nurl = {:?}\n",
        engine.url
    );
    std::fs::write(&config, toml).unwrap();
    let gw = Proc::start(&["serve", "--listen", "127.0.0.1:0", "--config", config.to_str().unwrap()]);
    let body = json!({"text": "a keyed prompt", "sampling_params": {"max_new_tokens": 2}}).to_string();
    let url = format!("{}/generate", gw.url);
    let keyed = read(send(c, &url, &[("authorization", "Bearer key-alice")], body.clone()).await).await;
    assert_eq!(keyed.status, StatusCode::OK, "{}", keyed.text);
    let stranger = read(send(c, &url, &[], body).await).await;
    assert_eq!(stranger.status, StatusCode::UNAUTHORIZED, "{}", stranger.text);
    get(c, &format!("{}/metrics", gw.url)).await.text
}

/// A gateway with flow control, one request in flight per endpoint, after two requests at once (the second waits
/// for the first): its scrape.
async fn flow_control_scrape(c: &common::HttpClient) -> String {
    let engine = Proc::engine(&["--dp-size", "1", "--first-byte-delay-ms", "300"]);
    let config = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard-flow.toml");
    let toml = format!(
        "[flow_control]\nenabled = true\nmax_in_flight_per_endpoint = 1\n[[workers]]\nurl = {:?}\ndp_size = 1\n",
        engine.url
    );
    std::fs::write(&config, toml).unwrap();
    let gw = Proc::start(&["serve", "--listen", "127.0.0.1:0", "--config", config.to_str().unwrap()]);
    let url = format!("{}/generate", gw.url);
    let body = json!({"text": "queued", "sampling_params": {"max_new_tokens": 2}}).to_string();
    let first = tokio::spawn({
        let (c, url, body) = (c.clone(), url.clone(), body.clone());
        async move { read(send(&c, &url, &[], body).await).await }
    });
    let saturated = eventually(Duration::from_secs(5), || async {
        get(c, &format!("{}/workers", gw.url)).await.json["workers"][0]["endpoints"][0]["saturated"] == true
    });
    assert!(saturated.await, "the endpoint never looked saturated");
    let second = read(send(c, &url, &[], body).await).await;
    for reply in [first.await.unwrap(), second] {
        assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);
    }
    get(c, &format!("{}/metrics", gw.url)).await.text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_exports_every_series_the_dashboard_queries() {
    let engine = Proc::engine(&["--dp-size", "2", "--error-rate", "0.3", "--seed", "7"]);
    let refused = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", listener.local_addr().unwrap())
    };
    // Probes far apart: the refused connection of the first request, not a probe, takes the dead worker out.
    let config = std::env::temp_dir().join(format!("dprouter-dashboard-{}.toml", std::process::id()));
    // Tracing on, towards a collector that refuses connections: the span counters are exported.
    let toml = "[health]\ninterval_ms = 60000\n[tracing]\nendpoint = \"http://127.0.0.1:1\"\n";
    std::fs::write(&config, toml).unwrap();
    let gw = Proc::start(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--config",
        config.to_str().unwrap(),
        "--worker",
        &refused,
        "--worker",
        &engine.url,
        "--dp-size",
        "2",
        "--policy",
        "round_robin",
    ]);
    std::fs::remove_file(&config).unwrap();
    let c = client();
    let mut statuses = Vec::new();
    for i in 0..12 {
        let stream = i % 2 == 0;
        let (path, body) = match i % 3 {
            0 => (
                "/generate",
                json!({"text": format!("prompt {i}"), "stream": stream, "sampling_params": {"max_new_tokens": 4}}),
            ),
            1 => (
                "/v1/chat/completions",
                json!({"messages": [{"role": "user", "content": format!("question {i}")}], "max_tokens": 4,
                       "stream": stream, "stream_options": {"include_usage": true}}),
            ),
            _ => (
                "/v1/completions",
                json!({"prompt": format!("text {i}"), "max_tokens": 4, "stream": stream,
                       "stream_options": {"include_usage": true}}),
            ),
        };
        let reply = read(send(&c, &format!("{}{path}", gw.url), &[], body.to_string()).await).await;
        statuses.push((path, stream, reply.status));
    }
    assert!(
        statuses
            .iter()
            .all(|(_, _, s)| [StatusCode::OK, StatusCode::INTERNAL_SERVER_ERROR].contains(s)),
        "{statuses:?}"
    );
    assert!(
        statuses.iter().any(|(_, _, s)| *s == StatusCode::INTERNAL_SERVER_ERROR),
        "the engine answered no 500 (pick another --seed): {statuses:?}"
    );
    assert!(
        statuses.iter().any(|(_, stream, s)| *stream && *s == StatusCode::OK),
        "no streamed request succeeded, so there is no TTFT: {statuses:?}"
    );

    // A client's pairing field, dropped (`dprouter_refused_input_total`).
    let steering = json!({"prompt": "text", "max_tokens": 4, "bootstrap_host": "10.9.9.9"});
    read(send(&c, &format!("{}/v1/completions", gw.url), &[], steering.to_string()).await).await;
    let scrape = get(&c, &format!("{}/metrics", gw.url)).await;
    assert_eq!(scrape.status, StatusCode::OK);
    let (mut samples, mut kinds) = parse_scrape(&scrape.text);
    // Precise mode's series come from a second gateway, with cache_aware following an engine's KV events.
    let precise = precise_mode_scrape(&c).await;
    let (more_samples, more_kinds) = parse_scrape(&precise);
    samples.extend(more_samples);
    kinds.extend(more_kinds);
    // Clients' series from a third, with a client's key; flow control's from a fourth, with a request queued.
    // Learned prefill costs' from a fifth, after requests of different lengths.
    for scrape in [
        clients_scrape(&c).await,
        flow_control_scrape(&c).await,
        learned_costs_scrape(&c).await,
    ] {
        let (more_samples, more_kinds) = parse_scrape(&scrape);
        samples.extend(more_samples);
        kinds.extend(more_kinds);
    }
    let used = used_names(&dashboard());
    // The names exactly as the dashboard writes them (so `_bucket` on a histogram, no suffix on a counter).
    for (name, places) in &used {
        assert!(
            samples.contains(name),
            "the dashboard queries {name} (in {places:?}), which the gateway's scrape does not have:\n{}",
            scrape.text
        );
    }
    // And every metric they belong to, a histogram by its buckets.
    for name in used.keys().map(|n| base(n)).collect::<BTreeSet<_>>() {
        let series = match kinds.get(name).map(String::as_str) {
            Some("histogram") => format!("{name}_bucket"),
            _ => name.to_string(),
        };
        assert!(samples.contains(&series), "no {series} in the scrape:\n{}", scrape.text);
    }
    for kind in ["connect", "status_5xx"] {
        assert!(
            scrape
                .text
                .lines()
                .any(|l| l.starts_with(telemetry::UPSTREAM_ERRORS) && l.contains(&format!("kind=\"{kind}\""))),
            "no upstream error of kind {kind}:\n{}",
            scrape.text
        );
    }
    assert!(
        scrape.text.lines().any(|l| l == format!("{} 1", telemetry::RETRIES)),
        "one retry, after the refused connection:\n{}",
        scrape.text
    );
}
