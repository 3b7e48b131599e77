//! One way to read a request body, for every front end (`serve`, the picker's ext_proc stream, the decode
//! sidecar): under the size limit (`max_body_bytes`, a 413), within the shared budget of all bodies arriving at
//! once ([`crate::admission::body_budget`], a 503), and, over HTTP, within the body timeout (a 408).
//!
//! The body is held once: one buffer, grown by doubling as bytes arrive but never past the declared length, so a
//! client makes the gateway allocate only what it actually sends. Its capacity is held in the budget until the
//! body is taken ([`BodyReader::finish`]) or dropped.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, HeaderMap};
use bytes::Bytes;
use http_body_util::BodyExt;

use crate::admission::body_budget::{BodyBudget, Held};
use crate::common::error::ApiError;

/// The smallest buffer grown for a body.
const FIRST_BUFFER: usize = 16 << 10;

/// How long the rest of a body refused as too large is read, at most in all and between two of its frames.
const LINGER: Duration = Duration::from_secs(5);
const LINGER_IDLE: Duration = Duration::from_secs(1);

/// A body being read, chunk by chunk.
#[derive(Debug)]
pub struct BodyReader {
    buf: Vec<u8>,
    held: Held,
    limit: usize,
    declared: Option<usize>,
}

impl BodyReader {
    /// A body of at most `limit` bytes (`declared`: its `Content-Length`, if any), in `budget`.
    pub fn new(budget: &Arc<BodyBudget>, limit: usize, declared: Option<usize>) -> Self {
        Self {
            buf: Vec::new(),
            held: budget.hold(),
            limit,
            declared,
        }
    }

    /// The next bytes: refused past the limit (413) or past the budget (503), the buffer then given back.
    pub fn push(&mut self, data: &[u8]) -> Result<(), ApiError> {
        let needed = self.buf.len() + data.len();
        if needed > self.limit {
            self.buf = Vec::new();
            return Err(ApiError::TooLarge { limit: self.limit });
        }
        if needed > self.buf.capacity() {
            let grown = needed.max(2 * self.buf.capacity()).max(FIRST_BUFFER);
            let target = self
                .declared
                .map_or(grown, |d| grown.min(d).max(needed))
                .min(self.limit);
            if let Err(full) = self.held.grow(target.saturating_sub(self.held.bytes())) {
                self.buf = Vec::new();
                return Err(full);
            }
            self.buf.reserve_exact(target - self.buf.len());
        }
        self.buf.extend_from_slice(data);
        Ok(())
    }

    /// The body's bytes so far.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// The whole body; its bytes leave the budget (it no longer counts as arriving).
    pub fn finish(self) -> Bytes {
        Bytes::from(self.buf)
    }
}

/// Reads an HTTP request's body whole (see the module documentation): a `Content-Length` over `limit` is refused
/// before a byte is read; a body that does not end within `timeout` is a 408. A body refused as too large is read
/// on and dropped a little longer ([`discard`]), so that the client reads the 413 rather than a reset.
pub async fn read(
    budget: &Arc<BodyBudget>,
    limit: usize,
    timeout: Duration,
    headers: &HeaderMap,
    mut body: Body,
) -> Result<Bytes, ApiError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > limit) {
        // A client that waits for `100 Continue` sends nothing more; any other is sending its body already.
        let waits = headers
            .get(header::EXPECT)
            .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
        if !waits {
            discard(&mut body).await;
        }
        return Err(ApiError::TooLarge { limit });
    }
    let collect = async {
        let mut reader = BodyReader::new(budget, limit, declared);
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| ApiError::BadRequest(format!("could not read the request body: {e}")))?;
            if let Ok(data) = frame.into_data() {
                if let Err(refused) = reader.push(&data) {
                    drop(reader);
                    discard(&mut body).await;
                    return Err(refused);
                }
            }
        }
        Ok(reader.finish())
    };
    // A client that declares more than it sends would hold the request (and its connection) open forever.
    tokio::time::timeout(timeout, collect)
        .await
        .map_err(|_| ApiError::BodyTimeout {
            after_ms: timeout.as_millis() as u64,
        })?
}

/// Reads and drops the rest of a body refused as too large (at most [`LINGER`], and no longer than
/// [`LINGER_IDLE`] without a frame), as nginx's lingering close does: a client that sends its whole body before it
/// reads the answer (most do) otherwise gets its connection reset mid-body instead of the 413. Nothing is kept;
/// the answer closes the connection.
async fn discard(body: &mut Body) {
    let deadline = tokio::time::Instant::now() + LINGER;
    loop {
        let next = tokio::time::timeout_at(deadline.min(tokio::time::Instant::now() + LINGER_IDLE), body.frame());
        match next.await {
            Ok(Some(Ok(_))) => {}
            _ => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_is_held_once_in_the_budget_and_refused_past_its_limits() {
        let budget = BodyBudget::new(100_000);
        let mut reader = BodyReader::new(&budget, 50_000, Some(20_000));
        reader.push(&[b'x'; 10_000]).unwrap();
        // The first buffer is 16 KiB; then it grows by doubling, but never past the declared length.
        assert_eq!(budget.used(), FIRST_BUFFER);
        reader.push(&[b'x'; 10_000]).unwrap();
        assert_eq!(budget.used(), 20_000);
        assert_eq!(reader.finish().len(), 20_000);
        assert_eq!(budget.used(), 0, "a finished body leaves the budget");

        let mut over = BodyReader::new(&budget, 50_000, None);
        assert_eq!(over.push(&[b'x'; 50_001]).unwrap_err().status(), 413);
        let mut a = BodyReader::new(&budget, 100_000, None);
        a.push(&[b'x'; 90_000]).unwrap();
        let mut b = BodyReader::new(&budget, 100_000, None);
        assert_eq!(b.push(&[b'x'; 20_000]).unwrap_err().status(), 503, "the budget is full");
        drop(a);
        b.push(&[b'x'; 20_000]).unwrap();
    }
}
