//! A stand-in Kubernetes API server for discovery's tests (no real one can be installed on this machine): LIST and
//! WATCH of any collection path on the real wire format. A LIST answers `{"kind": "List", "metadata":
//! {"resourceVersion"}, "items"}`; a WATCH (`watch=true`) streams JSON lines `{"type", "object"}` from the version
//! asked, then every change as it happens; a LIST with `limit` is paged (`metadata.continue`), filtered by `labelSelector` (`k=v,…`) and `fieldSelector`
//! (`metadata.name=…`). Versions are one counter over every collection, as etcd's. A watch from a version at or
//! below the compaction point is a `410 Gone` with a `Status` body; [`ApiServer::expire_watches`] sends open
//! watches an `ERROR` event with a 410 `Status` instead; [`ApiServer::bookmark`] a `BOOKMARK`;
//! [`ApiServer::end_watches`] ends them as the server's `timeoutSeconds` does. Every request is recorded with its
//! bearer token.
#![allow(clippy::unwrap_used, dead_code)]

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use tokio::sync::{broadcast, mpsc};

/// What open watches are told.
#[derive(Clone, Debug)]
enum Push {
    Event {
        path: String,
        kind: &'static str,
        object: Value,
    },
    Bookmark,
    Expire,
    End,
}

#[derive(Default)]
struct Inner {
    version: u64,
    compacted: u64,
    collections: BTreeMap<String, BTreeMap<String, Value>>,
    /// Every change: version, collection, type, object.
    log: Vec<(u64, String, &'static str, Value)>,
    requests: Vec<Recorded>,
}

/// One request the server got.
#[derive(Clone, Debug, PartialEq)]
pub struct Recorded {
    /// `LIST` or `WATCH`.
    pub verb: &'static str,
    pub path: String,
    pub query: BTreeMap<String, String>,
    pub token: Option<String>,
}

#[derive(Clone)]
pub struct ApiServer {
    inner: Arc<Mutex<Inner>>,
    push: broadcast::Sender<Push>,
    pub url: String,
}

impl ApiServer {
    pub async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let server = Self {
            inner: Default::default(),
            push: broadcast::channel(1024).0,
            url,
        };
        let app = axum::Router::new().fallback(handle).with_state(server.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });
        server
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap()
    }

    /// Creates or replaces `object` (by its `metadata.name`) in the collection at `path`.
    pub fn put(&self, path: &str, mut object: Value) {
        let mut inner = self.lock();
        inner.version += 1;
        let version = inner.version;
        object["metadata"]["resourceVersion"] = json!(version.to_string());
        let name = object["metadata"]["name"].as_str().unwrap().to_string();
        let existed = inner
            .collections
            .entry(path.to_string())
            .or_default()
            .insert(name, object.clone())
            .is_some();
        let kind = if existed { "MODIFIED" } else { "ADDED" };
        inner.log.push((version, path.to_string(), kind, object.clone()));
        let _ = self.push.send(Push::Event {
            path: path.to_string(),
            kind,
            object,
        });
    }

    pub fn delete(&self, path: &str, name: &str) {
        let mut inner = self.lock();
        inner.version += 1;
        let version = inner.version;
        let Some(mut object) = inner.collections.get_mut(path).and_then(|c| c.remove(name)) else {
            return;
        };
        object["metadata"]["resourceVersion"] = json!(version.to_string());
        inner.log.push((version, path.to_string(), "DELETED", object.clone()));
        let _ = self.push.send(Push::Event {
            path: path.to_string(),
            kind: "DELETED",
            object,
        });
    }

    /// Open watches get a `BOOKMARK` at the current version (which moves on by one, as other collections' writes
    /// move it).
    pub fn bookmark(&self) -> u64 {
        let mut inner = self.lock();
        inner.version += 1;
        let _ = self.push.send(Push::Bookmark);
        inner.version
    }

    /// Open watches end, as at the server's timeout.
    pub fn end_watches(&self) {
        let _ = self.push.send(Push::End);
    }

    /// Open watches get an `ERROR` event with a `410 Gone` status and end.
    pub fn expire_watches(&self) {
        let _ = self.push.send(Push::Expire);
    }

    /// Every version so far is compacted (after a write elsewhere moved the version on): a watch from one of them
    /// is a `410 Gone` (the HTTP status), a watch from a new list's version is not.
    pub fn compact(&self) {
        let mut inner = self.lock();
        inner.version += 1;
        inner.compacted = inner.version;
    }

    pub fn requests(&self) -> Vec<Recorded> {
        self.lock().requests.clone()
    }

    pub fn count(&self, verb: &str) -> usize {
        self.lock().requests.iter().filter(|r| r.verb == verb).count()
    }
}

fn query_of(request: &Request) -> BTreeMap<String, String> {
    let decode = |s: &str| {
        let mut out = Vec::new();
        let mut bytes = s.bytes();
        while let Some(b) = bytes.next() {
            match b {
                b'%' => {
                    let hex: String = bytes.by_ref().take(2).map(char::from).collect();
                    out.push(u8::from_str_radix(&hex, 16).unwrap());
                }
                b'+' => out.push(b' '),
                b => out.push(b),
            }
        }
        String::from_utf8(out).unwrap()
    };
    request
        .uri()
        .query()
        .unwrap_or_default()
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (decode(k), decode(v))
        })
        .collect()
}

/// Whether `object` matches the request's `labelSelector` and `fieldSelector` (equality terms only).
fn selected(object: &Value, query: &BTreeMap<String, String>) -> bool {
    let terms = |key: &str| -> Vec<(String, String)> {
        query
            .get(key)
            .map(|s| {
                s.split(',')
                    .filter(|t| !t.is_empty())
                    .map(|t| {
                        let (k, v) = t.split_once('=').unwrap();
                        (k.to_string(), v.to_string())
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    let labels_match = terms("labelSelector")
        .iter()
        .all(|(k, v)| object["metadata"]["labels"][k].as_str() == Some(v));
    let fields_match = terms("fieldSelector").iter().all(|(k, v)| {
        assert_eq!(k, "metadata.name", "only metadata.name is a field selector here");
        object["metadata"]["name"].as_str() == Some(v)
    });
    labels_match && fields_match
}

fn line(kind: &str, object: &Value) -> Bytes {
    let mut text = json!({"type": kind, "object": object}).to_string();
    text.push('\n');
    Bytes::from(text)
}

fn gone() -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Expired", "code": 410,
           "message": "too old resource version"})
}

async fn handle(State(server): State<ApiServer>, request: Request) -> Response {
    let path = request.uri().path().to_string();
    let query = query_of(&request);
    let token = request
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::to_string);
    let watching = query.get("watch").is_some_and(|w| w == "true" || w == "1");
    let mut inner = server.lock();
    inner.requests.push(Recorded {
        verb: if watching { "WATCH" } else { "LIST" },
        path: path.clone(),
        query: query.clone(),
        token,
    });
    if !watching {
        // Paged as the real server pages (`limit`, `continue`); the token here is the offset of the next item.
        let start: usize = query.get("continue").map_or(0, |c| c.parse().unwrap());
        let limit: usize = query.get("limit").map_or(usize::MAX, |l| l.parse().unwrap());
        let selected: Vec<&Value> = inner
            .collections
            .get(&path)
            .map(|c| c.values().filter(|o| selected(o, &query)).collect())
            .unwrap_or_default();
        let end = start.saturating_add(limit).min(selected.len());
        let items: Vec<&Value> = selected[start.min(end)..end].to_vec();
        let mut metadata = json!({"resourceVersion": inner.version.to_string()});
        if end < selected.len() {
            metadata["continue"] = json!(end.to_string());
        }
        let list = json!({"kind": "List", "apiVersion": "v1", "metadata": metadata, "items": items});
        return axum::Json(list).into_response();
    }
    let from: u64 = query.get("resourceVersion").and_then(|v| v.parse().ok()).unwrap_or(0);
    if from < inner.compacted {
        return (StatusCode::GONE, axum::Json(gone())).into_response();
    }
    let mut pushes = server.push.subscribe();
    let (lines, out) = mpsc::unbounded_channel::<Bytes>();
    for (version, at, kind, object) in &inner.log {
        if *version > from && *at == path && selected(object, &query) {
            let _ = lines.send(line(kind, object));
        }
    }
    drop(inner);
    let server_for_bookmarks = server.clone();
    tokio::spawn(async move {
        while let Ok(push) = pushes.recv().await {
            let sent = match push {
                Push::Event { path: at, kind, object } if at == path && selected(&object, &query) => {
                    lines.send(line(kind, &object))
                }
                Push::Event { .. } => Ok(()),
                Push::Bookmark => {
                    let version = server_for_bookmarks.lock().version;
                    lines.send(line(
                        "BOOKMARK",
                        &json!({"kind": "Pod", "metadata": {"resourceVersion": version.to_string()}}),
                    ))
                }
                Push::Expire => {
                    let _ = lines.send(line("ERROR", &gone()));
                    return;
                }
                Push::End => return,
            };
            if sent.is_err() {
                return;
            }
        }
    });
    let stream = futures_util::stream::unfold(out, |mut out| async move {
        out.recv().await.map(|b| (Ok::<_, Infallible>(b), out))
    });
    Response::builder()
        .header("content-type", "application/json")
        .body(Body::from_stream(stream))
        .unwrap()
}
