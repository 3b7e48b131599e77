//! The watch's pieces without a server: lines, events, what counts as a worker, an InferencePool's spec. The
//! LIST and WATCH loop is tested against a stand-in API server in `tests/discovery.rs`.

use super::*;
use serde_json::json;

#[test]
fn watch_lines_are_split_across_frames_and_bounded() {
    let mut lines = Lines::default();
    assert!(lines
        .push(&Bytes::from_static(b"{\"type\":\"ADDED\","))
        .unwrap()
        .is_empty());
    let out = lines
        .push(&Bytes::from_static(b"\"object\":{}}\n\n{\"type\":\"BOOKMARK\""))
        .unwrap();
    assert_eq!(out, [Bytes::from_static(b"{\"type\":\"ADDED\",\"object\":{}}")]);
    let out = lines.push(&Bytes::from_static(b",\"object\":{}}\n")).unwrap();
    assert_eq!(parse_event(&out[0]).unwrap(), Event::Bookmark(json!({})));
    let mut endless = Lines::default();
    let chunk = Bytes::from(vec![b'x'; 1 << 20]);
    let error = (0..20)
        .find_map(|_| endless.push(&chunk).err())
        .expect("an endless line was taken");
    assert!(error.contains("over"), "{error}");
    assert!(endless.partial.len() <= MAX_EVENT_BYTES);
}

#[test]
fn events_of_every_type_parse_and_others_do_not() {
    let status = json!({"kind": "Status", "code": 410});
    let line = json!({"type": "ERROR", "object": status}).to_string();
    assert_eq!(parse_event(line.as_bytes()).unwrap(), Event::Error(status));
    assert!(parse_event(br#"{"type":"DELETED","object":{"metadata":{"name":"a"}}}"#).is_ok());
    assert!(parse_event(br#"{"type":"SYNC","object":{}}"#).is_err());
    assert!(parse_event(b"not json").is_err());
}

#[test]
fn a_pod_counts_while_ready_with_an_ip_and_not_deleting() {
    let ready = json!({"metadata": {"name": "a"}, "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}});
    assert_eq!(pod_address(&ready), Some(IpAddr::from([10, 0, 0, 1])));
    let mut not_ready = ready.clone();
    not_ready["status"]["conditions"][0]["status"] = json!("False");
    let mut no_ip = ready.clone();
    no_ip["status"]["podIP"] = json!(null);
    let mut deleting = ready.clone();
    deleting["metadata"]["deletionTimestamp"] = json!("2026-12-01T00:00:00Z");
    let pending = json!({"metadata": {"name": "a"}, "status": {"phase": "Pending"}});
    for pod in [not_ready, no_ip, deleting, pending] {
        assert_eq!(pod_address(&pod), None, "{pod}");
    }
    let mut bad = ready.clone();
    bad["metadata"]["annotations"] = json!({"dprouter.io/dp-size": "many"});
    assert!(pod_workers(&bad, &[8000], &WorkerTemplate::default()).is_empty());
    assert_eq!(pod_workers(&ready, &[8000, 8001], &WorkerTemplate::default()).len(), 2);
}

#[test]
fn an_inference_pool_needs_labels_and_target_ports() {
    let pool = json!({"spec": {"selector": {"matchLabels": {"app": "llama", "tier": "gpu"}}, "targetPorts": [{"number": 8000}]}});
    let spec = PoolSpec::read(&pool).unwrap();
    assert_eq!(spec.ports, [8000]);
    assert_eq!(spec.selector(), "app=llama,tier=gpu");
    for bad in [
        json!({"spec": {"targetPorts": [{"number": 8000}]}}),
        json!({"spec": {"selector": {"matchLabels": {}}, "targetPorts": [{"number": 8000}]}}),
        json!({"spec": {"selector": {"matchLabels": {"app": "x"}}, "targetPorts": []}}),
        json!({"spec": {"selector": {"matchLabels": {"app": "x"}}, "targetPorts": [{"number": 70000}]}}),
        json!({"spec": {"selector": {"matchLabels": {"app": 1}}, "targetPorts": [{"number": 8000}]}}),
    ] {
        assert!(PoolSpec::read(&bad).is_err(), "{bad}");
    }
}

#[test]
fn query_values_are_percent_encoded() {
    assert_eq!(encode("app=vllm,tier in (a b)"), "app%3Dvllm%2Ctier%20in%20%28a%20b%29");
    assert_eq!(encode("metadata.name=pool-1"), "metadata.name%3Dpool-1");
}
