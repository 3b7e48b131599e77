//! Names and limits that every layer of the gateway uses: the request-id header and the bounds of a request head.
//! The lowest layer: it imports nothing of the crate.

/// The request id header: taken from the client when it sends a usable one, generated otherwise; the worker gets
/// it and the client gets it back, on every answer.
pub const REQUEST_ID: &str = "x-request-id";

/// The longest request URI the gateway reads (nginx's default header buffer).
pub const MAX_URI_BYTES: usize = 8 << 10;
/// At most this many request headers (Envoy's default)...
pub const MAX_HEADERS: usize = 100;
/// ...and this many bytes of them (Envoy's `max_request_headers_kb` default).
pub const MAX_HEADER_BYTES: usize = 60 << 10;
