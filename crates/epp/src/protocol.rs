//! The Endpoint Picker protocol (Gateway API Inference Extension, protocol v1) in Envoy's ext_proc messages: the
//! names it defines, the data plane's hints read from a request, and the replies built for it. No I/O.
//!
//! - The destination goes in the header `x-gateway-destination-endpoint` (`ip:port`, fallbacks after it, comma
//!   separated) and, with the same value, in the dynamic metadata `envoy.lb` / `x-gateway-destination-endpoint`.
//! - The data plane may restrict the choice with a subset hint: `envoy.lb.subset_hint` /
//!   `x-gateway-destination-endpoint-subset`, a list of `ip:port` (or bare `ip`).
//! - It may say which endpoint served: `envoy.lb` / `x-gateway-destination-endpoint-served`, on the response.
//! - Bodies are streamed back (`FULL_DUPLEX_STREAMED`) in chunks of at most [`BODY_CHUNK_BYTES`].

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};

use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption, Metadata};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_response, BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse,
    ImmediateResponse, ProcessingResponse, StreamedBodyResponse, TrailersResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, Struct, Value};

/// The header (and `envoy.lb` metadata key) naming the endpoint the request goes to.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The metadata namespace of the destination and of the served endpoint.
pub const DESTINATION_NAMESPACE: &str = "envoy.lb";
/// The metadata key (in [`DESTINATION_NAMESPACE`]) of the endpoint that served the request.
pub const SERVED: &str = "x-gateway-destination-endpoint-served";
/// The subset hint's namespace and key.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
pub const SUBSET: &str = "x-gateway-destination-endpoint-subset";
/// Streamed body chunks stay under the 64 KiB some data planes allow per chunk (the reference picker's margin).
pub const BODY_CHUNK_BYTES: usize = 62_000;
/// The header telling the client which endpoint answered (as `dprouter serve` does).
pub const ENDPOINT_HEADER: &str = "x-dprouter-endpoint";

/// A request's headers as Envoy sent them (names lower-cased; pseudo-headers such as `:path` included).
pub fn headers(map: Option<&envoy_types::pb::envoy::config::core::v3::HeaderMap>) -> Vec<(String, Vec<u8>)> {
    map.map(|m| {
        m.headers
            .iter()
            .map(|h| {
                let value = if h.raw_value.is_empty() {
                    h.value.clone().into_bytes()
                } else {
                    h.raw_value.clone()
                };
                (h.key.to_ascii_lowercase(), value)
            })
            .collect()
    })
    .unwrap_or_default()
}

/// The value of header `name` in `headers`, as text.
pub fn header<'a>(headers: &'a [(String, Vec<u8>)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .and_then(|(_, v)| std::str::from_utf8(v).ok())
}

/// The data plane's subset hint: `None` when it gave none (any endpoint may be chosen), otherwise the endpoints
/// it allows (possibly none).
pub fn subset_hint(metadata: Option<&Metadata>) -> Option<Vec<Allowed>> {
    let list = metadata?.filter_metadata.get(SUBSET_NAMESPACE)?.fields.get(SUBSET)?;
    let values = match &list.kind {
        Some(Kind::ListValue(list)) => list.values.iter().collect(),
        Some(Kind::StringValue(_)) => vec![list],
        _ => Vec::new(),
    };
    Some(
        values
            .into_iter()
            .filter_map(|v| match &v.kind {
                Some(Kind::StringValue(s)) => Allowed::parse(s),
                _ => None,
            })
            .collect(),
    )
}

/// The endpoint the data plane says served the request, when it says.
pub fn served(metadata: Option<&Metadata>) -> Option<SocketAddr> {
    let value = metadata?
        .filter_metadata
        .get(DESTINATION_NAMESPACE)?
        .fields
        .get(SERVED)?;
    match &value.kind {
        Some(Kind::StringValue(s)) => s.split(',').next()?.trim().parse().ok(),
        _ => None,
    }
}

/// One entry of a subset hint: an `ip:port`, or an IP (any port: the reference picker matches IPs only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Allowed {
    Address(SocketAddr),
    Ip(IpAddr),
}

impl Allowed {
    fn parse(s: &str) -> Option<Self> {
        let s = s.trim();
        s.parse()
            .map(Allowed::Address)
            .or_else(|_| s.trim_matches(['[', ']']).parse().map(Allowed::Ip))
            .ok()
    }

    pub fn contains(self, address: SocketAddr) -> bool {
        match self {
            Allowed::Address(a) => a == address,
            Allowed::Ip(ip) => ip == address.ip(),
        }
    }
}

/// A header to set (replacing any value the request had).
pub fn set_header(name: &str, value: impl Into<Vec<u8>>) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: name.to_string(),
            raw_value: value.into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The reply to the request headers once the endpoint is chosen: `destination` in the header and in the `envoy.lb`
/// metadata, the route cache cleared (the route may depend on the header), `set` headers set and `remove` removed.
pub fn request_headers_reply(
    destination: &str,
    set: Vec<HeaderValueOption>,
    remove: Vec<String>,
) -> ProcessingResponse {
    let mut set_headers = vec![set_header(DESTINATION, destination)];
    set_headers.extend(set);
    let metadata = Struct {
        fields: HashMap::from([(
            DESTINATION_NAMESPACE.to_string(),
            Value {
                kind: Some(Kind::StructValue(Struct {
                    fields: HashMap::from([(
                        DESTINATION.to_string(),
                        Value {
                            kind: Some(Kind::StringValue(destination.to_string())),
                        },
                    )]),
                })),
            },
        )]),
    };
    ProcessingResponse {
        response: Some(processing_response::Response::RequestHeaders(HeadersResponse {
            response: Some(CommonResponse {
                header_mutation: Some(HeaderMutation {
                    set_headers,
                    remove_headers: remove,
                }),
                clear_route_cache: true,
                ..Default::default()
            }),
        })),
        dynamic_metadata: Some(metadata),
        ..Default::default()
    }
}

/// The reply to the response headers: `set` headers set.
pub fn response_headers_reply(set: Vec<HeaderValueOption>) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(processing_response::Response::ResponseHeaders(HeadersResponse {
            response: Some(CommonResponse {
                header_mutation: Some(HeaderMutation {
                    set_headers: set,
                    remove_headers: Vec::new(),
                }),
                ..Default::default()
            }),
        })),
        ..Default::default()
    }
}

/// One streamed body chunk, of the request (`request`) or of the response.
pub fn body_chunk(request: bool, body: impl Into<Vec<u8>>, end_of_stream: bool) -> ProcessingResponse {
    let reply = BodyResponse {
        response: Some(CommonResponse {
            body_mutation: Some(BodyMutation {
                mutation: Some(body_mutation::Mutation::StreamedResponse(StreamedBodyResponse {
                    body: body.into(),
                    end_of_stream,
                    ..Default::default()
                })),
            }),
            ..Default::default()
        }),
    };
    let response = if request {
        processing_response::Response::RequestBody(reply)
    } else {
        processing_response::Response::ResponseBody(reply)
    };
    ProcessingResponse {
        response: Some(response),
        ..Default::default()
    }
}

/// A body as streamed chunks of at most [`BODY_CHUNK_BYTES`], the last one ending the stream unless `trailers`
/// follow. An empty body is one empty chunk. Each chunk is copied out when it is asked for, so a body is not
/// held twice while it goes out.
pub fn request_body_chunks(pieces: Vec<Bytes>, trailers: bool) -> impl Iterator<Item = ProcessingResponse> {
    let total: usize = pieces.iter().map(Bytes::len).sum();
    let count = total.div_ceil(BODY_CHUNK_BYTES).max(1);
    let mut pieces = pieces.into_iter();
    let mut current = Bytes::new();
    (0..count).map(move |i| {
        let size = (total - i * BODY_CHUNK_BYTES).min(BODY_CHUNK_BYTES);
        let mut chunk = Vec::with_capacity(size);
        while chunk.len() < size {
            if current.is_empty() {
                match pieces.next() {
                    Some(piece) => current = piece,
                    None => break,
                }
            }
            let take = (size - chunk.len()).min(current.len());
            chunk.extend_from_slice(&current.split_to(take));
        }
        body_chunk(true, chunk, i + 1 == count && !trailers)
    })
}

/// The reply to trailers (unchanged), of the request (`request`) or the response.
pub fn trailers_reply(request: bool) -> ProcessingResponse {
    let reply = TrailersResponse::default();
    let response = if request {
        processing_response::Response::RequestTrailers(reply)
    } else {
        processing_response::Response::ResponseTrailers(reply)
    };
    ProcessingResponse {
        response: Some(response),
        ..Default::default()
    }
}

/// The data plane answers the client itself with `status` and the JSON `body` (an OpenAI-style error).
pub fn immediate(status: u16, body: &serde_json::Value, retry_after: Option<u64>) -> ProcessingResponse {
    let mut set_headers = vec![set_header("content-type", "application/json")];
    if let Some(seconds) = retry_after {
        set_headers.push(set_header("retry-after", seconds.to_string()));
    }
    ProcessingResponse {
        response: Some(processing_response::Response::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus {
                code: i32::from(status),
            }),
            headers: Some(HeaderMutation {
                set_headers,
                remove_headers: Vec::new(),
            }),
            body: body.to_string().into_bytes(),
            details: "dprouter_epp".into(),
            ..Default::default()
        })),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::google::protobuf::ListValue;

    fn text(s: &str) -> Value {
        Value {
            kind: Some(Kind::StringValue(s.into())),
        }
    }

    fn metadata(namespace: &str, key: &str, value: Value) -> Metadata {
        Metadata {
            filter_metadata: HashMap::from([(
                namespace.to_string(),
                Struct {
                    fields: HashMap::from([(key.to_string(), value)]),
                },
            )]),
            ..Default::default()
        }
    }

    #[test]
    fn subset_hints_are_read_as_the_protocol_defines_them() {
        assert_eq!(subset_hint(None), None);
        assert_eq!(subset_hint(Some(&Metadata::default())), None);
        let list = Value {
            kind: Some(Kind::ListValue(ListValue {
                values: vec![text("10.0.0.1:8000"), text("10.0.0.2"), text("junk"), text("[::1]:80")],
            })),
        };
        let hint = subset_hint(Some(&metadata(SUBSET_NAMESPACE, SUBSET, list))).unwrap();
        let a: SocketAddr = "10.0.0.1:8000".parse().unwrap();
        assert_eq!(hint.len(), 3, "{hint:?}");
        assert!(hint[0].contains(a));
        assert!(!hint[0].contains("10.0.0.1:8001".parse().unwrap()));
        assert!(
            hint[1].contains("10.0.0.2:9".parse().unwrap()),
            "a bare IP allows any port"
        );
        assert!(hint[2].contains("[::1]:80".parse().unwrap()));
        let empty = Value {
            kind: Some(Kind::ListValue(ListValue::default())),
        };
        assert_eq!(
            subset_hint(Some(&metadata(SUBSET_NAMESPACE, SUBSET, empty))),
            Some(vec![]),
            "an empty list allows nothing"
        );
    }

    #[test]
    fn the_served_endpoint_is_read_from_envoy_lb() {
        let m = metadata(DESTINATION_NAMESPACE, SERVED, text("10.0.0.3:8000"));
        assert_eq!(served(Some(&m)), Some("10.0.0.3:8000".parse().unwrap()));
        assert_eq!(served(Some(&metadata(DESTINATION_NAMESPACE, SERVED, text("x")))), None);
        assert_eq!(served(None), None);
    }

    #[test]
    fn the_destination_is_in_the_header_and_the_metadata_alike() {
        let reply = request_headers_reply(
            "10.0.0.1:8000,10.0.0.2:8000",
            vec![set_header("x-data-parallel-rank", "3")],
            vec!["accept-encoding".into()],
        );
        let Some(processing_response::Response::RequestHeaders(h)) = &reply.response else {
            panic!()
        };
        let common = h.response.as_ref().unwrap();
        assert!(common.clear_route_cache);
        let mutation = common.header_mutation.as_ref().unwrap();
        let set: Vec<(&str, &[u8])> = mutation
            .set_headers
            .iter()
            .map(|o| {
                let h = o.header.as_ref().unwrap();
                (h.key.as_str(), h.raw_value.as_slice())
            })
            .collect();
        assert_eq!(
            set,
            [
                (DESTINATION, b"10.0.0.1:8000,10.0.0.2:8000".as_slice()),
                ("x-data-parallel-rank", b"3".as_slice())
            ]
        );
        assert_eq!(mutation.remove_headers, ["accept-encoding"]);
        let lb = &reply.dynamic_metadata.as_ref().unwrap().fields[DESTINATION_NAMESPACE];
        let Some(Kind::StructValue(lb)) = &lb.kind else {
            panic!()
        };
        assert_eq!(lb.fields[DESTINATION], text("10.0.0.1:8000,10.0.0.2:8000"));
    }

    fn chunk_of(r: &ProcessingResponse) -> (usize, bool) {
        let Some(processing_response::Response::RequestBody(b)) = &r.response else {
            panic!()
        };
        let Some(body_mutation::Mutation::StreamedResponse(s)) =
            &b.response.as_ref().unwrap().body_mutation.as_ref().unwrap().mutation
        else {
            panic!()
        };
        (s.body.len(), s.end_of_stream)
    }

    #[test]
    fn bodies_are_streamed_back_in_chunks_of_at_most_62000_bytes() {
        let pieces = vec![
            Bytes::from(vec![b'a'; 100_000]),
            Bytes::from_static(b"{}"),
            Bytes::from(vec![b'b'; 30_000]),
        ];
        let chunks: Vec<_> = request_body_chunks(pieces, false).map(|c| chunk_of(&c)).collect();
        assert_eq!(chunks, [(62_000, false), (62_000, false), (6_002, true)]);
        let chunks: Vec<_> = request_body_chunks(vec![Bytes::from(vec![0; 62_000])], true)
            .map(|c| chunk_of(&c))
            .collect();
        assert_eq!(chunks, [(62_000, false)], "trailers follow: no chunk ends the stream");
        let chunks: Vec<_> = request_body_chunks(Vec::new(), false).map(|c| chunk_of(&c)).collect();
        assert_eq!(chunks, [(0, true)]);
    }

    #[test]
    fn immediate_answers_carry_the_status_and_a_json_body() {
        let reply = immediate(503, &serde_json::json!({"error": {"code": 503}}), None);
        let Some(processing_response::Response::ImmediateResponse(i)) = &reply.response else {
            panic!()
        };
        assert_eq!(i.status.as_ref().unwrap().code, 503);
        assert_eq!(i.body, br#"{"error":{"code":503}}"#);
        let names = |reply: &ProcessingResponse| -> Vec<String> {
            let Some(processing_response::Response::ImmediateResponse(i)) = &reply.response else {
                panic!()
            };
            let set = &i.headers.as_ref().unwrap().set_headers;
            set.iter().map(|h| h.header.as_ref().unwrap().key.clone()).collect()
        };
        assert_eq!(names(&reply), ["content-type"]);
        let limited = immediate(429, &serde_json::json!({}), Some(7));
        assert_eq!(names(&limited), ["content-type", "retry-after"]);
    }
}
