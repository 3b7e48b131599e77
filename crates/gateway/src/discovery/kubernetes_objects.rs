//! The Kubernetes objects discovery reads, typed with only the fields it uses (the rest of each object is skipped
//! as it is parsed, so what is kept is bounded by the items, not by the size of the API server's answers), and
//! what each gives: a Pod's workers, an EndpointSlice's addresses, an InferencePool's selector and ports.

use std::collections::BTreeMap;
use std::net::IpAddr;

use serde::de::{DeserializeOwned, IgnoredAny};
use serde::Deserialize;
use serde_json::Value;

use crate::config::discovery::WorkerTemplate;
use crate::config::worker::WorkerConfig;

/// An object's metadata, as far as discovery reads it.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct Meta {
    pub name: Option<String>,
    pub resource_version: Option<String>,
    pub deletion_timestamp: Option<IgnoredAny>,
    pub annotations: Option<BTreeMap<String, String>>,
}

/// An object of a followed collection: its metadata.
pub trait Object: DeserializeOwned {
    fn meta(&self) -> &Meta;
}

/// A LIST's answer: one page of items, the list's version and where the next page starts. Read with
/// [`List::read`], item by item, refusing a page with more items than were asked for: what a page costs is bounded
/// by the `limit` asked, not by what the API server sends.
#[derive(Debug)]
pub struct List<T> {
    pub metadata: ListMeta,
    pub items: Option<Vec<Lenient<T>>>,
}

impl<T: DeserializeOwned> List<T> {
    /// Reads a page of at most `max_items` items.
    pub fn read(bytes: &[u8], max_items: usize) -> Result<Self, serde_json::Error> {
        let mut deserializer = serde_json::Deserializer::from_slice(bytes);
        let list = serde::de::DeserializeSeed::deserialize(
            PageSeed::<T> {
                max_items,
                item: std::marker::PhantomData,
            },
            &mut deserializer,
        )?;
        deserializer.end()?;
        Ok(list)
    }
}

/// Reads a [`List`] with at most `max_items` items.
struct PageSeed<T> {
    max_items: usize,
    item: std::marker::PhantomData<T>,
}

impl<'de, T: DeserializeOwned> serde::de::DeserializeSeed<'de> for PageSeed<T> {
    type Value = List<T>;

    fn deserialize<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<List<T>, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de, T: DeserializeOwned> serde::de::Visitor<'de> for PageSeed<T> {
    type Value = List<T>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a Kubernetes list")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<List<T>, A::Error> {
        let mut list = List {
            metadata: ListMeta::default(),
            items: None,
        };
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            match key.as_ref() {
                "metadata" => list.metadata = map.next_value()?,
                "items" => {
                    list.items = map.next_value_seed(ItemsSeed::<T> {
                        max_items: self.max_items,
                        item: std::marker::PhantomData,
                    })?
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(list)
    }
}

/// A list's items, one by one, at most `max_items` of them (`null`: none).
struct ItemsSeed<T> {
    max_items: usize,
    item: std::marker::PhantomData<T>,
}

impl<'de, T: DeserializeOwned> serde::de::DeserializeSeed<'de> for ItemsSeed<T> {
    type Value = Option<Vec<Lenient<T>>>;

    fn deserialize<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_option(self)
    }
}

impl<'de, T: DeserializeOwned> serde::de::Visitor<'de> for ItemsSeed<T> {
    type Value = Option<Vec<Lenient<T>>>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a list's items")
    }

    fn visit_none<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: serde::Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_seq(self)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element::<Lenient<T>>()? {
            if items.len() == self.max_items {
                return Err(serde::de::Error::custom(format!(
                    "the page has more than the {} items asked for",
                    self.max_items
                )));
            }
            items.push(item);
        }
        Ok(Some(items))
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct ListMeta {
    pub resource_version: Option<String>,
    #[serde(rename = "continue")]
    pub next: Option<String>,
}

/// An item that reads as `T`, or one that does not (skipped: one odd object does not stop discovery).
#[derive(Debug)]
pub enum Lenient<T> {
    Read(T),
    Unreadable(String),
}

impl<'de, T: DeserializeOwned> Deserialize<'de> for Lenient<T> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        // The item's bytes, then the type from them: an error stays with the item.
        let raw = Box::<serde_json::value::RawValue>::deserialize(deserializer)?;
        Ok(match serde_json::from_str(raw.get()) {
            Ok(item) => Lenient::Read(item),
            Err(e) => Lenient::Unreadable(e.to_string()),
        })
    }
}

/// A Pod: its address when it counts, and its annotations.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct Pod {
    pub metadata: Meta,
    pub status: PodStatus,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct PodStatus {
    #[serde(rename = "podIP")]
    pub pod_ip: Option<String>,
    pub conditions: Option<Vec<Condition>>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Condition {
    #[serde(rename = "type")]
    pub kind: String,
    pub status: String,
}

impl Object for Pod {
    fn meta(&self) -> &Meta {
        &self.metadata
    }
}

/// An EndpointSlice: its ports and endpoints.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct EndpointSlice {
    pub metadata: Meta,
    pub ports: Option<Vec<SlicePort>>,
    pub endpoints: Option<Vec<SliceEndpoint>>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct SlicePort {
    pub name: Option<String>,
    pub port: Option<i64>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct SliceEndpoint {
    pub addresses: Option<Vec<String>>,
    pub conditions: Option<EndpointConditions>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct EndpointConditions {
    pub ready: Option<bool>,
    pub terminating: Option<bool>,
}

impl Object for EndpointSlice {
    fn meta(&self) -> &Meta {
        &self.metadata
    }
}

/// An InferencePool: small and read whole ([`PoolSpec::read`]).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Pool {
    pub metadata: Meta,
    pub spec: Value,
}

impl Object for Pool {
    fn meta(&self) -> &Meta {
        &self.metadata
    }
}

/// A Pod's address, when it counts: Ready, with an IP, not being deleted.
pub fn pod_address(pod: &Pod) -> Option<IpAddr> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let ready = pod
        .status
        .conditions
        .as_deref()?
        .iter()
        .any(|c| c.kind == "Ready" && c.status == "True");
    if !ready {
        return None;
    }
    pod.status.pod_ip.as_deref()?.parse().ok()
}

/// The workers of a Pod at `ports`; none when it does not count or its annotations do not parse (logged).
pub fn pod_workers(pod: &Pod, ports: &[u16], template: &WorkerTemplate) -> Vec<WorkerConfig> {
    let Some(ip) = pod_address(pod) else { return Vec::new() };
    let none = BTreeMap::new();
    let annotations = pod.metadata.annotations.as_ref().unwrap_or(&none);
    ports
        .iter()
        .filter_map(|&port| match template.worker(ip, port, annotations) {
            Ok(worker) => Some(worker),
            Err(e) => {
                tracing::warn!(pod = pod.metadata.name.as_deref().unwrap_or("?"), error = %e, "pod skipped");
                None
            }
        })
        .collect()
}

/// The ready, not terminating endpoints of an EndpointSlice, with the port chosen.
pub fn slice_addresses(slice: &EndpointSlice, port_name: Option<&str>) -> Vec<(IpAddr, u16)> {
    let port = slice
        .ports
        .iter()
        .flatten()
        .find(|p| port_name.is_none_or(|n| p.name.as_deref() == Some(n)))
        .and_then(|p| u16::try_from(p.port?).ok())
        .filter(|&p| p > 0);
    let Some(port) = port else { return Vec::new() };
    slice
        .endpoints
        .iter()
        .flatten()
        .filter(|e| {
            let conditions = e.conditions.clone().unwrap_or_default();
            // As kube-proxy reads them: unset `ready` is ready; a terminating endpoint is drained.
            conditions.ready != Some(false) && conditions.terminating != Some(true)
        })
        // "Consumers must use the first address" (EndpointSlice API).
        .filter_map(|e| e.addresses.as_deref()?.first()?.parse().ok())
        .map(|ip| (ip, port))
        .collect()
}

/// An InferencePool's selector and target ports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSpec {
    pub match_labels: BTreeMap<String, String>,
    pub ports: Vec<u16>,
}

impl PoolSpec {
    /// Reads `spec.selector.matchLabels` and `spec.targetPorts[].number` of an `inference.networking.k8s.io/v1`
    /// InferencePool.
    pub fn read(pool: &Pool) -> Result<Self, String> {
        let labels = pool
            .spec
            .pointer("/selector/matchLabels")
            .and_then(Value::as_object)
            .ok_or("spec.selector.matchLabels is missing")?;
        let match_labels: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| {
                Ok((
                    k.clone(),
                    v.as_str().ok_or("a label value is not a string")?.to_string(),
                ))
            })
            .collect::<Result<_, String>>()?;
        if match_labels.is_empty() {
            return Err("spec.selector.matchLabels is empty".into());
        }
        let ports: Vec<u16> = pool
            .spec
            .get("targetPorts")
            .and_then(Value::as_array)
            .ok_or("spec.targetPorts is missing")?
            .iter()
            .map(|p| {
                p.get("number")
                    .and_then(Value::as_u64)
                    .and_then(|n| u16::try_from(n).ok())
                    .filter(|&n| n > 0)
                    .ok_or("a target port's number is not a port")
            })
            .collect::<Result<_, _>>()?;
        if ports.is_empty() {
            return Err("spec.targetPorts is empty".into());
        }
        Ok(Self { match_labels, ports })
    }

    pub fn selector(&self) -> String {
        self.match_labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",")
    }
}
