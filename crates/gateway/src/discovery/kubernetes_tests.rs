//! The watch's pieces without a server: lines, events, what counts as a worker, an InferencePool's spec. The
//! LIST and WATCH loop is tested against a stand-in API server in `tests/discovery.rs`.

use super::*;
use crate::discovery::kubernetes_objects::pod_address;
use bytes::Bytes;
use serde_json::json;

use crate::discovery::kubernetes_watch::MAX_EVENT_BYTES;

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
    assert!(matches!(parse_event::<Pod>(&out[0]).unwrap().0, Event::Bookmark));
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
    assert!(matches!(parse_event::<Pod>(line.as_bytes()).unwrap().0, Event::Error(s) if s == status));
    let (deleted, version) =
        parse_event::<Pod>(br#"{"type":"DELETED","object":{"metadata":{"name":"a","resourceVersion":"7"}}}"#).unwrap();
    assert!(matches!(deleted, Event::Deleted(p) if p.metadata.name.as_deref() == Some("a")));
    assert_eq!(version.as_deref(), Some("7"));
    let (bookmark, version) =
        parse_event::<Pod>(br#"{"type":"BOOKMARK","object":{"metadata":{"resourceVersion":"9"}}}"#).unwrap();
    assert!(matches!(bookmark, Event::Bookmark));
    assert_eq!(version.as_deref(), Some("9"));
    // An object that does not read as a Pod is skipped, its version still followed.
    let (odd, version) =
        parse_event::<Pod>(br#"{"type":"ADDED","object":{"metadata":{"resourceVersion":"10"},"status":7}}"#).unwrap();
    assert!(matches!(odd, Event::Unreadable(_)), "{odd:?}");
    assert_eq!(version.as_deref(), Some("10"));
    assert!(parse_event::<Pod>(br#"{"type":"SYNC","object":{}}"#).is_err());
    assert!(parse_event::<Pod>(b"not json").is_err());
}

/// A LIST page keeps what reads and skips what does not, whatever else the objects carry.
#[test]
fn list_pages_read_only_the_fields_discovery_uses() {
    let page = json!({
        "metadata": {"resourceVersion": "5", "continue": "next"},
        "items": [
            {"metadata": {"name": "a", "managedFields": [{"x": "y".repeat(1000)}]}, "spec": {"containers": []},
             "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True", "reason": "r"}]}},
            {"metadata": {"name": 7}},
        ],
    });
    let bytes = serde_json::to_vec(&page).unwrap();
    let list = crate::discovery::kubernetes_objects::List::<Pod>::read(&bytes, 2).unwrap();
    assert_eq!(list.metadata.next.as_deref(), Some("next"));
    let items = list.items.unwrap();
    assert!(matches!(&items[0], crate::discovery::kubernetes_objects::Lenient::Read(p) if pod_address(p).is_some()));
    assert!(matches!(
        &items[1],
        crate::discovery::kubernetes_objects::Lenient::Unreadable(_)
    ));
    // A page with more items than asked for is refused as it is read; no items, or null, is an empty page.
    let err = crate::discovery::kubernetes_objects::List::<Pod>::read(&bytes, 1).unwrap_err();
    assert!(err.to_string().contains("more than the 1 items asked for"), "{err}");
    for empty in [r#"{"items": null}"#, r#"{"metadata": {}}"#] {
        let list = crate::discovery::kubernetes_objects::List::<Pod>::read(empty.as_bytes(), 1).unwrap();
        assert!(list.items.is_none(), "{empty}");
    }
    assert!(crate::discovery::kubernetes_objects::List::<Pod>::read(b"[]", 1).is_err());
}

/// Only a change in what discovery reads is a change: the same object modified again, or deleted twice, is not.
#[test]
fn an_object_modified_the_same_changes_nothing() {
    let ready = |name: &str, ip: &str| {
        pod(json!({"metadata": {"name": name},
                   "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}}))
    };
    let mut objects = Objects::new(|p: &Pod| pod_address(p));
    assert!(objects.apply(Change::Listed(Vec::new())));
    assert!(objects.apply(Change::Event(Event::Added(ready("a", "10.0.0.1")))));
    for _ in 0..3 {
        assert!(!objects.apply(Change::Event(Event::Modified(ready("a", "10.0.0.1")))));
    }
    assert!(objects.apply(Change::Event(Event::Modified(ready("a", "10.0.0.2")))));
    assert!(!objects.apply(Change::Event(Event::Bookmark)));
    assert!(objects.apply(Change::Event(Event::Deleted(ready("a", "10.0.0.2")))));
    assert!(!objects.apply(Change::Event(Event::Deleted(ready("a", "10.0.0.2")))));
}

fn pod(value: serde_json::Value) -> Pod {
    serde_json::from_value(value).unwrap()
}

#[test]
fn a_pod_counts_while_ready_with_an_ip_and_not_deleting() {
    let ready = json!({"metadata": {"name": "a"}, "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}});
    assert_eq!(pod_address(&pod(ready.clone())), Some(IpAddr::from([10, 0, 0, 1])));
    let mut not_ready = ready.clone();
    not_ready["status"]["conditions"][0]["status"] = json!("False");
    let mut no_ip = ready.clone();
    no_ip["status"]["podIP"] = json!(null);
    let mut deleting = ready.clone();
    deleting["metadata"]["deletionTimestamp"] = json!("2026-12-01T00:00:00Z");
    let pending = json!({"metadata": {"name": "a"}, "status": {"phase": "Pending"}});
    for value in [not_ready, no_ip, deleting, pending] {
        assert_eq!(pod_address(&pod(value.clone())), None, "{value}");
    }
    let mut bad = ready.clone();
    bad["metadata"]["annotations"] = json!({"dprouter.io/dp-size": "many"});
    assert!(pod_workers(&pod(bad), &[8000], &WorkerTemplate::default()).is_empty());
    assert_eq!(
        pod_workers(&pod(ready), &[8000, 8001], &WorkerTemplate::default()).len(),
        2
    );
}

#[test]
fn an_inference_pool_needs_labels_and_target_ports() {
    let pool = json!({"spec": {"selector": {"matchLabels": {"app": "llama", "tier": "gpu"}}, "targetPorts": [{"number": 8000}]}});
    let read = |value: serde_json::Value| PoolSpec::read(&serde_json::from_value(value).unwrap());
    let spec = read(pool).unwrap();
    assert_eq!(spec.ports, [8000]);
    assert_eq!(spec.selector(), "app=llama,tier=gpu");
    for bad in [
        json!({"spec": {"targetPorts": [{"number": 8000}]}}),
        json!({"spec": {"selector": {"matchLabels": {}}, "targetPorts": [{"number": 8000}]}}),
        json!({"spec": {"selector": {"matchLabels": {"app": "x"}}, "targetPorts": []}}),
        json!({"spec": {"selector": {"matchLabels": {"app": "x"}}, "targetPorts": [{"number": 70000}]}}),
        json!({"spec": {"selector": {"matchLabels": {"app": 1}}, "targetPorts": [{"number": 8000}]}}),
    ] {
        assert!(read(bad.clone()).is_err(), "{bad}");
    }
}

#[test]
fn query_values_are_percent_encoded() {
    assert_eq!(encode("app=vllm,tier in (a b)"), "app%3Dvllm%2Ctier%20in%20%28a%20b%29");
    assert_eq!(encode("metadata.name=pool-1"), "metadata.name%3Dpool-1");
}
