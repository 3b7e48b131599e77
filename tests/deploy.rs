//! The deploy folder: every YAML manifest parses, each Kubernetes object has the fields its API version requires,
//! and the objects agree with each other and with dprouter (the pool's picker is the Service, the Service selects
//! the picker's Pods, the role grants what discovery reads, the pool selects the model servers, their annotations
//! and the picker's config read as dprouter reads them, the image is the one the Dockerfile names). No cluster and
//! no schema download are available here: this checks the fields by hand (docs/deploy.md says what it covers).
//! `tests/epp.rs` runs `deploy/envoy.yaml` in a real Envoy.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use dprouter_gateway::config::discovery::WorkerTemplate;
use dprouter_gateway::GatewayConfig;
use serde_json::Value;

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy")
}

/// Every document of every YAML file under `deploy/`, with its file's name.
fn documents() -> Vec<(String, Value)> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
                out.push(path);
            }
        }
    }
    let mut files = Vec::new();
    walk(&deploy(), &mut files);
    files.sort();
    let mut docs = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let name = file.strip_prefix(deploy()).unwrap().display().to_string();
        for document in serde_norway::Deserializer::from_str(&text) {
            let value = serde_json::to_value(
                <serde_norway::Value as serde::Deserialize>::deserialize(document)
                    .unwrap_or_else(|e| panic!("{name} does not parse: {e}")),
            )
            .unwrap();
            if !value.is_null() {
                docs.push((name.clone(), value));
            }
        }
    }
    docs
}

/// The Kubernetes objects (documents with a `kind`), by kind and name.
fn objects() -> BTreeMap<(String, String), Value> {
    let mut objects = BTreeMap::new();
    for (file, doc) in documents() {
        let Some(kind) = doc["kind"].as_str().map(str::to_string) else {
            continue;
        };
        let name = doc["metadata"]["name"]
            .as_str()
            .unwrap_or_else(|| panic!("{file}: a {kind} without metadata.name"))
            .to_string();
        assert!(doc["apiVersion"].is_string(), "{file}: {kind} {name} has no apiVersion");
        assert_eq!(
            doc["metadata"]["namespace"], "llm",
            "{file}: {kind} {name} is not in namespace llm"
        );
        let old = objects.insert((kind.clone(), name.clone()), doc);
        assert!(old.is_none(), "{file}: {kind} {name} twice");
    }
    objects
}

fn get<'a>(objects: &'a BTreeMap<(String, String), Value>, kind: &str, name: &str) -> &'a Value {
    objects
        .get(&(kind.to_string(), name.to_string()))
        .unwrap_or_else(|| panic!("no {kind} {name} in deploy/"))
}

fn labels(value: &Value) -> BTreeMap<String, String> {
    serde_json::from_value(value.clone()).unwrap_or_default()
}

/// Whether every label of `selector` is in `labels`.
fn selects(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

fn arg<'a>(args: &'a [Value], flag: &str) -> Option<&'a str> {
    args.iter()
        .filter_map(Value::as_str)
        .find_map(|a| a.strip_prefix(flag)?.strip_prefix('='))
}

#[test]
fn every_manifest_parses_and_envoys_config_is_there() {
    let docs = documents();
    let files: Vec<&str> = docs.iter().map(|(f, _)| f.as_str()).collect();
    for file in [
        "envoy.yaml",
        "kubernetes/epp.yaml",
        "kubernetes/inferencepool.yaml",
        "kubernetes/vllm.yaml",
    ] {
        assert!(files.contains(&file), "deploy/{file} is missing or empty");
    }
    let envoy = &docs.iter().find(|(f, _)| f == "envoy.yaml").unwrap().1;
    assert!(envoy["static_resources"]["listeners"].is_array());
}

#[test]
fn the_inference_pool_has_what_v1_requires_and_names_the_picker_and_its_pods() {
    let objects = objects();
    let pool = get(&objects, "InferencePool", "vllm-llama");
    assert_eq!(pool["apiVersion"], "inference.networking.k8s.io/v1");
    let spec = &pool["spec"];
    let match_labels = labels(&spec["selector"]["matchLabels"]);
    assert!(!match_labels.is_empty(), "spec.selector.matchLabels is required");
    let ports = spec["targetPorts"].as_array().expect("spec.targetPorts is required");
    assert!((1..=8).contains(&ports.len()), "targetPorts: 1 to 8 items");
    for port in ports {
        assert!(
            (1..=65535).contains(&port["number"].as_u64().unwrap()),
            "targetPorts[].number is a port"
        );
    }
    let picker = &spec["endpointPickerRef"];
    let picker_name = picker["name"].as_str().expect("endpointPickerRef.name is required");
    assert!(picker["kind"].is_null() || picker["kind"] == "Service");
    let picker_port = picker["port"]["number"]
        .as_u64()
        .expect("endpointPickerRef.port.number: required for a Service");
    assert!(["FailOpen", "FailClose"].contains(&picker["failureMode"].as_str().unwrap_or("FailClose")));

    // The picker's Service has that port, and selects the picker's Pods, which serve gRPC there.
    let service = get(&objects, "Service", picker_name);
    assert_eq!(service["apiVersion"], "v1");
    let service_port = service["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["port"].as_u64() == Some(picker_port))
        .expect("the Service has the endpointPickerRef's port");
    assert_eq!(
        service_port["appProtocol"], "http2",
        "ext_proc is gRPC: HTTP/2 to the picker"
    );
    let epp = get(&objects, "Deployment", picker_name);
    let template = &epp["spec"]["template"];
    assert!(selects(
        &labels(&service["spec"]["selector"]),
        &labels(&template["metadata"]["labels"])
    ));
    let container = &template["spec"]["containers"][0];
    let args = container["args"].as_array().unwrap();
    assert_eq!(args[0], "epp");
    let listen: std::net::SocketAddr = arg(args, "--listen").unwrap().parse().unwrap();
    assert_eq!(service_port["targetPort"].as_u64(), Some(u64::from(listen.port())));
    assert_eq!(
        arg(args, "--inference-pool"),
        pool["metadata"]["name"].as_str(),
        "the picker follows this pool"
    );

    // The pool selects the model servers' Pods, at a port they listen on; their annotations read as dprouter reads them.
    let servers = get(&objects, "Deployment", "vllm-llama");
    let pod = &servers["spec"]["template"];
    assert!(
        selects(&match_labels, &labels(&pod["metadata"]["labels"])),
        "the pool selects no model server"
    );
    let container_ports: Vec<u64> = pod["spec"]["containers"][0]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["containerPort"].as_u64().unwrap())
        .collect();
    assert!(container_ports.contains(&ports[0]["number"].as_u64().unwrap()));
    let annotations = labels(&pod["metadata"]["annotations"]);
    let worker = WorkerTemplate::default()
        .worker("10.0.0.1".parse().unwrap(), 8000, &annotations)
        .unwrap();
    assert_eq!((worker.backend.as_str(), worker.dp_size), ("vllm", Some(2)));
    assert!(
        worker.kv_events.is_some(),
        "the model servers publish KV events for the replicas"
    );
}

#[test]
fn the_pickers_deployment_role_and_config_are_what_dprouter_needs() {
    let objects = objects();
    let epp = get(&objects, "Deployment", "dprouter-epp");
    assert_eq!(epp["apiVersion"], "apps/v1");
    let spec = &epp["spec"];
    assert!(selects(
        &labels(&spec["selector"]["matchLabels"]),
        &labels(&spec["template"]["metadata"]["labels"])
    ));
    let pod = &spec["template"]["spec"];
    let container = &pod["containers"][0];
    assert!(container["name"].is_string() && container["image"].is_string());
    for (probe, service) in [("livenessProbe", "liveness"), ("readinessProbe", "readiness")] {
        assert_eq!(
            container[probe]["grpc"]["service"], service,
            "{probe}: the gRPC health name dprouter answers"
        );
        assert_eq!(container[probe]["grpc"]["port"], 9002);
    }

    // The service account may get, list and watch what discovery reads.
    let account = pod["serviceAccountName"].as_str().unwrap();
    get(&objects, "ServiceAccount", account);
    let binding = get(&objects, "RoleBinding", account);
    assert_eq!(binding["subjects"][0]["name"], account);
    let role = get(&objects, "Role", binding["roleRef"]["name"].as_str().unwrap());
    assert_eq!(role["apiVersion"], "rbac.authorization.k8s.io/v1");
    let allowed = |group: &str, resource: &str| {
        role["rules"].as_array().unwrap().iter().any(|rule| {
            let has = |field: &str, v: &str| rule[field].as_array().unwrap().iter().any(|x| x == v);
            has("apiGroups", group)
                && has("resources", resource)
                && ["get", "list", "watch"].iter().all(|v| has("verbs", v))
        })
    };
    assert!(allowed("inference.networking.k8s.io", "inferencepools"));
    assert!(allowed("", "pods"));
    assert!(allowed("discovery.k8s.io", "endpointslices"));

    // Its config file is a valid dprouter config, with the flags' discovery applied.
    let config_map = get(
        &objects,
        "ConfigMap",
        pod["volumes"][0]["configMap"]["name"].as_str().unwrap(),
    );
    let mut config = GatewayConfig::from_toml(config_map["data"]["dprouter.toml"].as_str().unwrap()).unwrap();
    config.validate().unwrap();
    assert!(config.admin_key.is_some(), "admin from other pods needs a key");
    config
        .discovery
        .kubernetes
        .push(dprouter_gateway::config::discovery::KubernetesSource {
            inference_pool: arg(container["args"].as_array().unwrap(), "--inference-pool").map(str::to_string),
            ..Default::default()
        });
    config.validate().unwrap();
    // The drain fits in the grace period.
    let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
    assert!(
        grace * 1000 > config.server.drain_timeout_ms,
        "terminationGracePeriodSeconds below the drain"
    );

    // The image is the one the Dockerfile says to build, named after the crate's version.
    let dockerfile = std::fs::read_to_string(deploy().join("Dockerfile")).unwrap();
    let image = format!("dprouter:{}", env!("CARGO_PKG_VERSION"));
    assert!(
        dockerfile.contains(&format!("-t {image} .")),
        "the Dockerfile names another image"
    );
    assert!(container["image"].as_str().unwrap().starts_with(&image));
}

/// Only the Gateway's proxies reach the picker's gRPC port: a NetworkPolicy selects the picker's pods, and every
/// ingress rule that admits 9002 admits it only from pods labelled with the name of the Gateway the route hangs on.
#[test]
fn only_the_gateways_proxies_reach_the_pickers_grpc_port() {
    let objects = objects();
    let epp = get(&objects, "Deployment", "dprouter-epp");
    let pod_labels = labels(&epp["spec"]["template"]["metadata"]["labels"]);
    let policy = get(&objects, "NetworkPolicy", "dprouter-epp");
    assert_eq!(policy["apiVersion"], "networking.k8s.io/v1");
    let spec = &policy["spec"];
    assert!(selects(&labels(&spec["podSelector"]["matchLabels"]), &pod_labels));
    assert!(spec["policyTypes"].as_array().unwrap().iter().any(|t| t == "Ingress"));
    let gateway = get(&objects, "HTTPRoute", "llm")["spec"]["parentRefs"][0]["name"].clone();
    let rules = spec["ingress"].as_array().unwrap();
    let admits_grpc = |rule: &Value| {
        rule["ports"]
            .as_array()
            .is_none_or(|ports| ports.iter().any(|p| p["port"] == 9002))
    };
    let grpc_rules: Vec<&Value> = rules.iter().filter(|r| admits_grpc(r)).collect();
    assert!(!grpc_rules.is_empty(), "no rule admits the gateway to 9002");
    for rule in grpc_rules {
        let from = rule["from"].as_array().expect("a rule admitting 9002 from anywhere");
        for peer in from {
            let selector = &peer["podSelector"]["matchLabels"];
            assert_eq!(
                selector["gateway.networking.k8s.io/gateway-name"], gateway,
                "9002 admits pods other than the Gateway's: {peer}"
            );
            assert!(peer.get("ipBlock").is_none(), "{peer}");
        }
    }
}

#[test]
fn the_route_sends_a_gateways_traffic_to_the_pool() {
    let objects = objects();
    let route = get(&objects, "HTTPRoute", "llm");
    assert_eq!(route["apiVersion"], "gateway.networking.k8s.io/v1");
    let parent = &route["spec"]["parentRefs"][0];
    assert!(parent["name"].is_string(), "parentRefs[].name is required");
    let backend = &route["spec"]["rules"][0]["backendRefs"][0];
    assert_eq!(backend["group"], "inference.networking.k8s.io");
    assert_eq!(backend["kind"], "InferencePool");
    get(&objects, "InferencePool", backend["name"].as_str().unwrap());
}

/// Each prefill/decode pool (`pd-*.yaml`): its gateway's config is valid, routes each role with its own policy and
/// finds both Deployments' Pods (and not its own) by its `pods` selector; their annotations read as prefill and
/// decode workers (the SGLang prefill with its bootstrap port) at a port they listen on; its Service selects the
/// gateway's Pods at a port they expose; it runs as `serve-rbac.yaml`'s account, which may read Pods; its image is
/// the Dockerfile's, and the drain fits in its grace period.
#[test]
fn each_prefill_decode_pool_is_found_by_its_gateway_in_both_roles() {
    use dprouter_gateway::Role;
    let objects = objects();
    let image = format!("dprouter:{}", env!("CARGO_PKG_VERSION"));
    for (gateway, prefill, decode, backend, bootstrap) in [
        (
            "dprouter-pd-sglang",
            "sglang-qwen-prefill",
            "sglang-qwen-decode",
            "sglang",
            Some(8998),
        ),
        (
            "dprouter-pd-vllm",
            "vllm-llama-prefill",
            "vllm-llama-decode",
            "vllm",
            None,
        ),
    ] {
        let deployment = get(&objects, "Deployment", gateway);
        let template = &deployment["spec"]["template"];
        let pod = &template["spec"];
        let container = &pod["containers"][0];
        assert!(container["image"].as_str().unwrap().starts_with(&image), "{gateway}");
        let config_map = get(
            &objects,
            "ConfigMap",
            pod["volumes"][0]["configMap"]["name"].as_str().unwrap(),
        );
        let config = GatewayConfig::from_toml(config_map["data"]["dprouter.toml"].as_str().unwrap()).unwrap();
        assert_eq!(config.routing_of(Role::Prefill).name(), "cache_aware", "{gateway}");
        assert_eq!(config.routing_of(Role::Decode).name(), "least_loaded", "{gateway}");
        let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
        assert!(
            grace * 1000 > config.server.drain_timeout_ms,
            "{gateway}: grace below the drain"
        );

        // Its one Pods source selects both pools' Pods, not the gateway's own.
        let [source] = config.discovery.kubernetes.as_slice() else {
            panic!("{gateway}: one Kubernetes source")
        };
        let selector: BTreeMap<String, String> = source
            .pods
            .as_deref()
            .unwrap()
            .split(',')
            .map(|kv| {
                let (k, v) = kv.split_once('=').unwrap();
                (k.trim().to_string(), v.trim().to_string())
            })
            .collect();
        assert!(
            !selects(&selector, &labels(&template["metadata"]["labels"])),
            "{gateway} finds itself"
        );
        let port = source.port.unwrap();
        for (name, role) in [(prefill, Role::Prefill), (decode, Role::Decode)] {
            let servers = get(&objects, "Deployment", name);
            let server = &servers["spec"]["template"];
            assert!(
                selects(&selector, &labels(&server["metadata"]["labels"])),
                "{gateway} misses {name}"
            );
            assert!(
                selects(
                    &labels(&servers["spec"]["selector"]["matchLabels"]),
                    &labels(&server["metadata"]["labels"])
                ),
                "{name}"
            );
            let listens = server["spec"]["containers"][0]["ports"]
                .as_array()
                .unwrap()
                .iter()
                .any(|p| p["containerPort"].as_u64() == Some(u64::from(port)));
            assert!(listens, "{name} does not listen at {port}");
            let worker = source
                .worker
                .worker(
                    "10.0.0.1".parse().unwrap(),
                    port,
                    &labels(&server["metadata"]["annotations"]),
                )
                .unwrap();
            assert_eq!((worker.role, worker.backend.as_str()), (role, backend), "{name}");
            assert_eq!(worker.dp_size, Some(2), "{name}");
            let expected = if role == Role::Prefill { bootstrap } else { None };
            assert_eq!(worker.bootstrap_port, expected, "{name}");
        }
        // Prefill and decode Pods are told apart by their Deployments.
        let prefill_selector = labels(&get(&objects, "Deployment", prefill)["spec"]["selector"]["matchLabels"]);
        let decode_pod = labels(&get(&objects, "Deployment", decode)["spec"]["template"]["metadata"]["labels"]);
        assert!(
            !selects(&prefill_selector, &decode_pod),
            "{prefill} selects {decode}'s Pods"
        );

        // Its Service reaches it.
        let service = get(&objects, "Service", gateway);
        assert!(selects(
            &labels(&service["spec"]["selector"]),
            &labels(&template["metadata"]["labels"])
        ));
        let target = service["spec"]["ports"][0]["targetPort"].clone();
        let exposes = container["ports"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["containerPort"] == target || (target.is_string() && p["name"] == target));
        assert!(exposes, "{gateway}'s Service targets a port its Pods do not expose");

        // Its account may read Pods.
        let account = pod["serviceAccountName"].as_str().unwrap();
        let binding = get(&objects, "RoleBinding", account);
        let role = get(&objects, "Role", binding["roleRef"]["name"].as_str().unwrap());
        let reads_pods = role["rules"].as_array().unwrap().iter().any(|rule| {
            let has = |field: &str, v: &str| rule[field].as_array().unwrap().iter().any(|x| x == v);
            has("apiGroups", "") && has("resources", "pods") && ["get", "list", "watch"].iter().all(|v| has("verbs", v))
        });
        assert!(reads_pods, "{account} cannot read Pods");
    }
}

/// The decode sidecar's manifest: the sidecar in front of a decode engine that listens on loopback only, with an
/// allow-list of prefill endpoints that dprouter reads, and a NetworkPolicy that lets only the Gateway's proxies
/// (and the prefill Pods, for the KV transfer) reach the decode Pods.
#[test]
fn the_decode_sidecar_runs_with_an_allow_list_and_only_the_gateway_reaches_it() {
    use dprouter_gateway::decode_sidecar::PrefillAllow;
    let objects = objects();
    let deployment = get(&objects, "Deployment", "vllm-llama-decode-sidecar");
    let template = &deployment["spec"]["template"];
    let containers = template["spec"]["containers"].as_array().unwrap();
    let sidecar = containers.iter().find(|c| c["name"] == "decode-sidecar").unwrap();
    let args = sidecar["args"].as_array().unwrap();
    assert_eq!(args[0], "decode-sidecar");
    let allow = arg(args, "--prefill-allow").expect("an allow-list of prefill endpoints");
    for entry in allow.split(',') {
        PrefillAllow::parse(entry).unwrap();
    }
    let decode = arg(args, "--decode").unwrap();
    assert!(decode.starts_with("http://127.0.0.1:"), "{decode}");
    let engine_port = decode.rsplit(':').next().unwrap();
    let engine = containers.iter().find(|c| c["name"] == "vllm").unwrap();
    let engine_args = engine["args"].as_array().unwrap();
    assert_eq!(
        arg(engine_args, "--host"),
        Some("127.0.0.1"),
        "the engine on loopback only"
    );
    assert_eq!(arg(engine_args, "--port"), Some(engine_port));
    let listen = arg(args, "--listen").unwrap();
    let port: u64 = listen.rsplit(':').next().unwrap().parse().unwrap();
    assert_eq!(template["metadata"]["annotations"]["dprouter.io/role"], "decode");

    let pod_labels = labels(&template["metadata"]["labels"]);
    let policy = get(&objects, "NetworkPolicy", "vllm-llama-decode-sidecar");
    let spec = &policy["spec"];
    assert!(selects(&labels(&spec["podSelector"]["matchLabels"]), &pod_labels));
    assert!(spec["policyTypes"].as_array().unwrap().iter().any(|t| t == "Ingress"));
    let gateway = get(&objects, "HTTPRoute", "llm")["spec"]["parentRefs"][0]["name"].clone();
    let mut gateway_reaches_the_sidecar = false;
    for rule in spec["ingress"].as_array().unwrap() {
        let from = rule["from"].as_array().expect("a rule admitting anyone");
        let ports = rule["ports"].as_array();
        for peer in from {
            assert!(peer.get("ipBlock").is_none(), "{peer}");
            let selector = labels(&peer["podSelector"]["matchLabels"]);
            let from_gateway = selector
                .get("gateway.networking.k8s.io/gateway-name")
                .map(String::as_str)
                == gateway.as_str();
            let from_prefill = selector.get("role").map(String::as_str) == Some("prefill");
            assert!(
                from_gateway || from_prefill,
                "only the Gateway's proxies and the prefill Pods: {peer}"
            );
            gateway_reaches_the_sidecar |= from_gateway && ports.is_some_and(|p| p.iter().all(|p| p["port"] == port));
        }
    }
    assert!(
        gateway_reaches_the_sidecar,
        "the Gateway's proxies reach the sidecar's port, and no other"
    );
}
