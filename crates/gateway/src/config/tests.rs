//! The gateway configuration's unit tests: defaults, parsing, validation and their messages.

use super::*;

#[test]
fn full_config_parses() {
    let config = GatewayConfig::from_toml(
        r#"
        listen = "127.0.0.1:9000"
        admin_key = "k"
        allow_client_overrides = false
        [routing]
        policy = "prefix_match"
        window_tokens = 128
        [health]
        interval_ms = 500
        [load]
        poll_interval_ms = 50
        [[workers]]
        url = "http://127.0.0.1:30000"
        [[workers]]
        url = "http://127.0.0.1:30001"
        backend = "vllm"
        dp_size = 2
        "#,
    )
    .unwrap();
    assert_eq!(config.listen.port(), 9000);
    assert_eq!(config.routing.name(), "prefix_match");
    assert_eq!(config.workers[1].backend, Backend::Vllm);
    assert_eq!(config.health.interval_ms, 500);
    assert_eq!(config.health.failure_threshold, 2);
    assert!(!config.allow_client_overrides);
}

#[test]
fn roles_parse_and_their_settings_are_checked() {
    let config = GatewayConfig::from_toml(
        r#"
        [prefill_routing]
        policy = "prefix_match"
        [[workers]]
        url = "http://127.0.0.1:30000"
        role = "prefill"
        bootstrap_port = 8999
        [[workers]]
        url = "http://127.0.0.1:30001"
        role = "decode"
        "#,
    )
    .unwrap();
    assert_eq!(config.workers[0].role, Role::Prefill);
    assert_eq!(config.workers[0].bootstrap_port, Some(8999));
    assert_eq!(config.routing_of(Role::Prefill).name(), "prefix_match");
    assert_eq!(config.routing_of(Role::Decode).name(), "least_loaded");
    assert_eq!(config.routing_of(Role::Aggregated).name(), "cache_aware");
    for (toml_text, expected) in [
        (
            "url = \"http://x:1\"\nrole = \"decode\"\nbootstrap_port = 1",
            "bootstrap_port",
        ),
        (
            "url = \"http://x:1\"\nrole = \"prefill\"\nbootstrap_port = 0",
            "bootstrap_port",
        ),
        (
            "url = \"http://x:1\"\nrole = \"prefill\"\nbackend = \"openai\"",
            "backend sglang",
        ),
        ("url = \"http://x:1\"\nrole = \"both\"", "role"),
    ] {
        let err = GatewayConfig::from_toml(&format!("[[workers]]\n{toml_text}"))
            .unwrap_err()
            .to_string();
        assert!(err.contains(expected), "{toml_text}: {err}");
    }
    let err = GatewayConfig::from_toml("[decode_routing]\npolicy = \"prefix_match\"\nwindow_tokens = 0")
        .unwrap_err()
        .to_string();
    assert!(err.contains("decode_routing"), "{err}");
}

#[test]
fn the_documented_example_parses_and_shows_every_field() {
    let doc = include_str!("../../../../docs/gateway.md");
    let section = doc.split("## Configuration file").nth(1).unwrap();
    let toml_text = section.split("```toml").nth(1).unwrap().split("```").next().unwrap();
    let config = GatewayConfig::from_toml(toml_text).unwrap();
    assert_eq!(config.workers.len(), 1);
    let documented = |key: &str| {
        toml_text
            .lines()
            .any(|l| l.trim_start().trim_start_matches("# ").starts_with(key))
    };
    let defaults = toml::to_string(&GatewayConfig {
        workers: config.workers.clone(),
        admin_key: Some("k".into()),
        ..GatewayConfig::default()
    })
    .unwrap();
    // Policy options are documented with each policy, not in this example.
    let mut table = "";
    for line in defaults.lines() {
        if line.starts_with('[') {
            table = line;
        } else if line.contains(" = ") && !table.ends_with("routing]") {
            let key = line.split(" = ").next().unwrap().trim();
            assert!(documented(key), "docs/gateway.md's config example lacks `{key}`");
        }
    }
}

#[test]
fn the_discovery_docs_example_parses() {
    let doc = include_str!("../../../../docs/discovery.md");
    let text = doc.split("```toml").nth(1).unwrap().split("```").next().unwrap();
    let config: GatewayConfig = toml::from_str(text).unwrap();
    config.validate().unwrap();
    assert_eq!(
        config.discovery.kubernetes[0].watched(),
        crate::config::discovery::Watched::InferencePool("vllm-llama")
    );
    assert_eq!(config.discovery.kubernetes[0].worker.kv_events_port, Some(5557));
    assert_eq!(config.discovery.dns[0].port, 8000);
}

#[test]
fn the_readme_example_parses() {
    let readme = include_str!("../../../../README.md");
    let toml_text = readme.split("```toml").nth(1).unwrap().split("```").next().unwrap();
    let config = GatewayConfig::from_toml(toml_text).unwrap();
    assert_eq!(config.workers.len(), 2);
    assert_eq!(config.workers[1].backend, Backend::Vllm);
    assert_eq!(config.routing.name(), "cache_aware");
    assert_eq!(config.admin_key.as_deref(), Some("change-me"));
}

#[test]
fn senseless_values_are_errors_naming_the_field() {
    for (text, needle) in [
        ("max_body_bytes = 0", "max_body_bytes"),
        ("admin_key = \"\"", "admin_key"),
        ("admin_key = \"  \"", "admin_key"),
        ("admin_key = \" k\"", "admin_key"),
        ("admin_key = \"k\\n\"", "admin_key"),
        ("[routing]\npolicy = \"cache_aware\"\nblock_tokens = 0", "block_tokens"),
        (
            "[routing]\npolicy = \"cache_aware\"\nprefill_tokens_per_s = 0",
            "prefill_tokens_per_s",
        ),
        (
            "[routing]\npolicy = \"cache_aware\"\nprefill_tokens_per_s = inf",
            "prefill_tokens_per_s",
        ),
        ("[routing]\npolicy = \"cache_aware\"\nbase_ms = -1", "base_ms"),
        ("[routing]\npolicy = \"prefix_affinity\"\nepsilon = -0.5", "epsilon"),
        ("[routing]\npolicy = \"prefix_affinity\"\nepsilon = nan", "epsilon"),
        (
            "[routing]\npolicy = \"prefix_match\"\nwindow_tokens = 0",
            "window_tokens",
        ),
        ("[[workers]]\nurl = \"http://x:1\"\ndp_size = 4294967295", "dp_size"),
        ("[[workers]]\nurl = \"http://x:1\"\ndp_size = 1025", "dp_size"),
        (
            "[[workers]]\nurl = \"http://x:1\"\n[[workers]]\nurl = \"http://X:1/\"",
            "listed twice",
        ),
        (
            "[[workers]]\nurl = \"http://x:1\"\nkv_events = \"tcp://x:5\"\nkv_events_bind = \"tcp://x:5\"",
            "exclude each other",
        ),
        (
            "[[workers]]\nurl = \"http://x:1\"\nkv_events_replay = \"tcp://x:6\"",
            "kv_events_replay needs",
        ),
        (
            "[[workers]]\nurl = \"http://x:1\"\nkv_events_bind = \"x:5\"",
            "kv_events_bind",
        ),
        (
            "[routing]\npolicy = \"round_robin\"\n[[workers]]\nurl = \"http://x:1\"\nkv_events = \"tcp://x:5\"",
            "KV events are followed under cache_aware only",
        ),
        (
            "[routing]\npolicy = \"prefix_match\"\n[[discovery.dns]]\nname = \"x\"\nport = 8000\n[discovery.dns.worker]\nkv_events_port = 5557",
            "discovery dns x:8000: KV events are followed under cache_aware only",
        ),
        ("[[workers]]\nurl = \"http://user:pw@x:1\"", "no user, path or query"),
        ("[[workers]]\nurl = \"http://x:1/v1\"", "no user, path or query"),
        ("[[workers]]\nurl = \"http://x:1/?a=b\"", "no user, path or query"),
        (
            "[[workers]]\nurl = \"http://x:0\"",
            "port must be a number from 1 to 65535",
        ),
        (
            "[[workers]]\nurl = \"http://x:99999\"",
            "port must be a number from 1 to 65535",
        ),
        (
            "[[workers]]\nurl = \"http://[::1]:70000\"",
            "port must be a number from 1 to 65535",
        ),
        (
            "[[workers]]\nurl = \"http://0.0.0.0:8000\"",
            "0.0.0.0 is no address to connect to",
        ),
        (
            "[[workers]]\nurl = \"http://0:8000\"",
            "0.0.0.0 is no address to connect to",
        ),
        (
            "[[workers]]\nurl = \"http://[::]:8000\"",
            "[::] is no address to connect to",
        ),
        (
            "[[workers]]\nurl = \"http://127.0.0.1:8000\"\n[[workers]]\nurl = \"http://127.1:8000\"",
            "listed twice",
        ),
        (
            "first_byte_timeout_ms = 9223372036854775807",
            "first_byte_timeout_ms is 9223372036854775807: at most",
        ),
        (
            "[server]\ndrain_timeout_ms = 604800001",
            "server.drain_timeout_ms is 604800001: at most 604800000",
        ),
        ("[health]\nmax_ejection_ms = 1000000000000", "health.max_ejection_ms"),
        ("[load]\npoll_interval_ms = 1000000000000", "load.poll_interval_ms"),
    ] {
        let err = GatewayConfig::from_toml(text).unwrap_err().to_string();
        assert!(err.contains(needle), "{text}: {err}");
    }
    let config = |f: fn(&mut GatewayConfig)| {
        let mut c = GatewayConfig::default();
        f(&mut c);
        c.validate().map_err(|e| e.to_string())
    };
    assert!(config(|_| {}).is_ok());
    assert!(config(|c| c.admin_key = Some("s3cret key-1".into())).is_ok());
    assert!(config(|c| c.workers.push(WorkerConfig {
        url: "http://x:1".into(),
        backend: Backend::Vllm,
        dp_size: Some(MAX_DP_SIZE),
        ..WorkerConfig::default()
    }))
    .is_ok());
    // A config built in code (the command line's flags) gets the same checks.
    let err = config(|c| {
        c.routing = PolicyConfig::CacheAware(dprouter_core::policy::CacheAwareConfig {
            block_tokens: 0,
            ..Default::default()
        })
    })
    .unwrap_err();
    assert!(err.contains("block_tokens"), "{err}");
    assert!(config(|c| c.admin_key = Some(String::new()))
        .unwrap_err()
        .contains("admin_key"));
}

#[test]
fn worker_urls_compare_normalized() {
    for (a, b) in [
        ("http://h:1", "http://h:1/"),
        ("http://H:1", "http://h:1"),
        ("http://h", "http://h:80"),
        ("http://h:1/v/", "http://h:1/v"),
        ("https://h", "HTTPS://h:443/"),
    ] {
        assert_eq!(worker_url_key(a), worker_url_key(b), "{a} {b}");
    }
    // One address however it is spelled (E8 of issue 36: seven spellings were seven workers).
    for spelling in [
        "http://127.1:8000",
        "http://2130706433:8000",
        "http://0x7f000001:8000",
        "http://0177.0.0.1:8000",
        "http://127.0.0.1.:8000",
        "http://[::ffff:127.0.0.1]:8000",
        "http://[::FFFF:7f00:1]:8000/",
    ] {
        assert_eq!(worker_url_key(spelling), "http://127.0.0.1:8000", "{spelling}");
    }
    assert_eq!(worker_url_key("http://[0:0::1]:1"), "http://[::1]:1");
    assert_eq!(worker_url_key("http://Engine.Example.:1"), "http://engine.example:1");
    // Names that only look numeric in part stay names; out-of-range numbers are not addresses.
    assert_eq!(worker_url_key("http://1.2.3.x:1"), "http://1.2.3.x:1");
    assert_eq!(worker_url_key("http://256.1.1.1:1"), "http://256.1.1.1:1");
    assert_eq!(worker_url_key("http://localhost:1"), "http://localhost:1");
    assert_ne!(worker_url_key("http://h:443"), worker_url_key("https://h:443"));
    assert_ne!(worker_url_key("http://h:1"), worker_url_key("http://h:2"));
    assert_ne!(worker_url_key("http://h:1/a"), worker_url_key("http://h:1/b"));
}

#[test]
fn a_config_error_prints_its_cause_once() {
    let errors = [
        GatewayConfig::from_file(Path::new("/nonexistent/dprouter.toml")).unwrap_err(),
        GatewayConfig::from_toml("listn = 1").unwrap_err(),
    ];
    for err in errors {
        assert!(std::error::Error::source(&err).is_none(), "{err}");
    }
}

#[test]
fn unknown_fields_and_policies_are_errors() {
    for (text, needle) in [
        ("[routing]\npolicy = \"fastest\"", "fastest"),
        ("listn = \"127.0.0.1:1\"", "listn"),
        ("[[workers]]\nurl = \"http://x:1\"\nbackend = \"tgi\"", "tgi"),
        ("[[workers]]\nurl = \"ftp://x:1\"", "http://host:port"),
        ("[[workers]]\nurl = \"http://x:1\"\ndp_size = 0", "dp_size"),
        ("[health]\nfailure_threshold = 0", "thresholds"),
        ("[server]\nidle_timeout_ms = 0", "server.idle_timeout_ms"),
        ("[server]\nmax_in_flight = 0", "server.max_in_flight"),
        ("[server]\nmax_conections = 9", "max_conections"),
    ] {
        let err = GatewayConfig::from_toml(text).unwrap_err().to_string();
        assert!(err.contains(needle), "{text}: {err}");
    }
}

#[test]
fn the_clients_docs_example_parses() {
    let doc = include_str!("../../../../docs/operations.md");
    let section = doc.split("## Clients and keys").nth(1).unwrap();
    let text = section.split("```toml").nth(1).unwrap().split("```").next().unwrap();
    let config = GatewayConfig::from_toml(text).unwrap();
    config.validate().unwrap();
    let client = &config.clients[0];
    assert_eq!(client.requests_per_second, Some(20.0));
    assert_eq!(client.burst, Some(40));
    assert_eq!(client.models, ["llama-3.1-8b"]);
    assert!(config.workers[0].api_key.is_some());
    // The key is never shown.
    assert!(!format!("{:?}", config.workers[0]).contains("\"...\""));
}
