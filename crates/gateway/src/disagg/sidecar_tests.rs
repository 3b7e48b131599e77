//! The decode sidecar's units: its prefill targets, its legs' headers, the pairing fields it drops.
use super::*;

fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (k, v) in pairs {
        map.append(
            HeaderName::from_bytes(k.as_bytes()).unwrap(),
            HeaderValue::from_str(v).unwrap(),
        );
    }
    map
}

#[test]
fn the_prefill_endpoint_is_an_ip_and_a_port() {
    assert_eq!(prefill_address(&headers(&[])).unwrap(), None);
    let named = prefill_address(&headers(&[(PREFILLER_HEADER, "10.0.0.5:8000")])).unwrap();
    assert_eq!(named, Some("10.0.0.5:8000".parse().unwrap()));
    // A list takes its first; the older name is read when the header is absent.
    let listed = prefill_address(&headers(&[(OLD_PREFILLER_HEADER, "[fd00::1]:80, 10.0.0.6:80")])).unwrap();
    assert_eq!(listed, Some("[fd00::1]:80".parse().unwrap()));
    for bad in ["prefill-0.svc:8000", "10.0.0.5", "http://10.0.0.5:8000"] {
        let err = prefill_address(&headers(&[(PREFILLER_HEADER, bad)])).unwrap_err();
        assert_eq!(err.status(), 400, "{bad}");
    }
}

fn sidecar(api_key: Option<&str>) -> Sidecar {
    let config = SidecarConfig {
        decode: "http://d:1".into(),
        backend: Backend::Vllm,
        bootstrap_port: None,
        prefill_allow: vec![],
        api_key: api_key.map(str::to_string),
        max_body_bytes: 1 << 20,
        max_buffered_body_bytes: 1 << 21,
        request_body_timeout: Duration::from_secs(10),
        connect_timeout: Duration::from_secs(1),
        first_byte_timeout: Duration::from_secs(10),
        prefill_first_byte_timeout: Duration::from_secs(5),
        idle_timeout: Duration::from_secs(10),
    };
    let tls = crate::http::tls::client_config(None, "test").unwrap();
    Sidecar {
        bodies: BodyBudget::new(1 << 21),
        authorization: api_key.map(|k| HeaderValue::from_str(&format!("Bearer {k}")).unwrap()),
        config: Arc::new(config),
        upstream: Upstream::new(Duration::from_secs(1), Duration::from_secs(1), tls),
    }
}

#[test]
fn a_leg_gets_the_clients_headers_by_the_one_rule_and_the_sidecars_own_key() {
    let client = headers(&[
        (PREFILLER_HEADER, "10.0.0.5:8000"),
        (PREFILL_RANK_HEADER, "1"),
        ("x-data-parallel-rank", "3"),
        ("x-request-id", "abc"),
        ("connection", "keep-alive"),
        ("host", "decode"),
        ("content-length", "99"),
        ("authorization", "Bearer client-secret"),
        ("x-api-key", "client-secret"),
        ("cookie", "session=1"),
    ]);
    let plain = sidecar(None);
    let decode = plain
        .leg_request(&Method::POST, "http://d:1/", "/v1/completions", &client, None, vec![])
        .unwrap();
    assert_eq!(decode.uri(), "http://d:1/v1/completions");
    let mut names: Vec<&str> = decode.headers().keys().map(HeaderName::as_str).collect();
    names.sort_unstable();
    assert_eq!(names, ["x-data-parallel-rank", "x-request-id"]);
    assert_eq!(decode.headers()["x-data-parallel-rank"], "3");
    let keyed = sidecar(Some("engine-key"));
    let prefill = keyed
        .leg_request(
            &Method::POST,
            "http://p:1",
            "/v1/completions",
            &client,
            Some(client.get(PREFILL_RANK_HEADER).cloned()),
            vec![],
        )
        .unwrap();
    assert_eq!(prefill.headers()["x-data-parallel-rank"], "1");
    assert_eq!(prefill.headers()["x-request-id"], "abc");
    assert_eq!(prefill.headers()["authorization"], "Bearer engine-key");
    assert_eq!(prefill.headers().get_all("authorization").iter().count(), 1);
    let unranked = plain
        .leg_request(&Method::POST, "http://p:1", "/", &client, Some(None), vec![])
        .unwrap();
    assert!(unranked.headers().get("x-data-parallel-rank").is_none());
}

#[test]
fn prefill_targets_are_allowed_by_address_ip_or_network() {
    let allow = |s: &str, a: &str| PrefillAllow::parse(s).unwrap().allows(a.parse().unwrap());
    assert!(allow("10.0.0.5:8000", "10.0.0.5:8000"));
    assert!(!allow("10.0.0.5:8000", "10.0.0.5:8001"));
    assert!(allow("10.0.0.5", "10.0.0.5:9"));
    assert!(allow("10.0.0.0/16", "10.0.200.1:80"));
    assert!(!allow("10.0.0.0/16", "10.1.0.1:80"));
    assert!(allow("[fd00::1]", "[fd00::1]:80"));
    assert!(allow("fd00::/8", "[fd12::1]:80"));
    assert!(!allow("127.0.0.1", "[::1]:80"));
    for bad in ["", "prefill-0:8000", "10.0.0.0/33", "http://10.0.0.5"] {
        assert!(PrefillAllow::parse(bad).is_err(), "{bad}");
    }
}

#[test]
fn a_body_for_the_decode_server_alone_loses_its_pairing_fields() {
    let kept = Bytes::from_static(br#"{"prompt": "x", "max_tokens": 2}"#);
    assert_eq!(without_pairing_fields(kept.clone()).unwrap(), kept);
    assert_eq!(without_pairing_fields(Bytes::new()).unwrap(), Bytes::new());
    let steered = Bytes::from_static(
        br#"{"prompt":"x","kv_transfer_params":{"remote_host":"10.9.9.9"},"bootstrap_host":"10.9.9.9","bootstrap_room":7,"kv_transfer\u005fparams":1,"n":1}"#,
    );
    let out = without_pairing_fields(steered).unwrap();
    assert_eq!(out, Bytes::from_static(br#"{"prompt":"x","n":1}"#));
    assert_eq!(
        without_pairing_fields(Bytes::from_static(b"[1]")).unwrap_err().status(),
        400
    );
    assert_eq!(
        without_pairing_fields(Bytes::from_static(b"{\"a\":NaN}"))
            .unwrap_err()
            .status(),
        400
    );
}

#[test]
fn a_bootstrap_host_names_an_ip() {
    let raw = |s: &str| serde_json::from_str::<Box<RawValue>>(s).unwrap();
    assert!(names_ip(&raw(r#""10.0.0.5""#), "10.0.0.5".parse().unwrap()));
    assert!(names_ip(&raw(r#""[fd00::1]""#), "fd00::1".parse().unwrap()));
    assert!(!names_ip(&raw(r#""10.0.0.6""#), "10.0.0.5".parse().unwrap()));
    assert!(!names_ip(&raw("5"), "10.0.0.5".parse().unwrap()));
}
