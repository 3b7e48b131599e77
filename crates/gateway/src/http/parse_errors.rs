//! JSON bodies for the requests hyper answers itself.
//!
//! A request hyper cannot parse never reaches the gateway's handlers: a malformed request line or header, an
//! invalid `Content-Length` (400), a URI past the `http` crate's 65,534 bytes (414), a head past hyper's buffer or
//! header count (431). hyper writes an empty answer for those and closes the connection. [`JsonParseErrors`] sits
//! between hyper and the client's stream and rewrites exactly those answers (one of these statuses, `connection:
//! close`, `content-length: 0` and no content type, which no handler of the gateway writes) into the gateway's
//! OpenAI-style JSON errors ([`ApiError`]), so every error a client can cause has a body that says what is wrong.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::common::error::ApiError;
use crate::common::names::{MAX_HEADERS, MAX_HEADER_BYTES, MAX_URI_BYTES};

/// A client's stream whose automatic parse-error answers from hyper become JSON errors.
pub struct JsonParseErrors<S> {
    inner: S,
    /// An answer being written in place of hyper's.
    pending: Option<Rewritten>,
}

struct Rewritten {
    bytes: Vec<u8>,
    written: usize,
    /// How many of hyper's bytes it stands for.
    replaces: usize,
}

impl<S> JsonParseErrors<S> {
    pub fn new(inner: S) -> Self {
        Self { inner, pending: None }
    }
}

/// The answer to write instead of `head`, if `head` is hyper's automatic answer to a request it could not parse;
/// and how many bytes of `head` it replaces.
fn rewrite(head: &[u8]) -> Option<(Vec<u8>, usize)> {
    let status = head.get(..13).and_then(|line| match line {
        b"HTTP/1.1 400 " | b"HTTP/1.0 400 " => Some(400),
        b"HTTP/1.1 414 " | b"HTTP/1.0 414 " => Some(414),
        b"HTTP/1.1 431 " | b"HTTP/1.0 431 " => Some(431),
        _ => None,
    })?;
    let end = head.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let lower = std::str::from_utf8(&head[..end]).ok()?.to_ascii_lowercase();
    let automatic = lower.contains("\r\nconnection: close\r\n")
        && lower.contains("\r\ncontent-length: 0\r\n")
        && !lower.contains("\r\ncontent-type:");
    if !automatic {
        return None;
    }
    let error = match status {
        414 => ApiError::UriTooLong(MAX_URI_BYTES),
        431 => ApiError::HeadersTooLarge(format!(
            "request headers too large (at most {MAX_HEADERS} headers and {MAX_HEADER_BYTES} bytes)"
        )),
        _ => ApiError::BadRequest(
            "the request is not valid HTTP/1.1: a malformed request line or header, or an invalid Content-Length"
                .into(),
        ),
    };
    let body = error.body().to_string();
    let code = error.status();
    let answer = format!(
        "{} {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        String::from_utf8_lossy(&head[..8]),
        code.as_u16(),
        code.canonical_reason().unwrap_or(""),
        body.len(),
    );
    Some((answer.into_bytes(), end))
}

impl<S: AsyncWrite + Unpin> JsonParseErrors<S> {
    /// Writes the pending answer to its end; then reports hyper's bytes it replaced as written.
    fn poll_pending(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        let Some(p) = self.pending.as_mut() else {
            return Poll::Ready(Ok(0));
        };
        while p.written < p.bytes.len() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &p.bytes[p.written..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            p.written += n;
        }
        let replaces = p.replaces;
        self.pending = None;
        Poll::Ready(Ok(replaces))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for JsonParseErrors<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for JsonParseErrors<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.pending.is_none() {
            match rewrite(buf) {
                Some((bytes, replaces)) => {
                    this.pending = Some(Rewritten {
                        bytes,
                        written: 0,
                        replaces,
                    })
                }
                None => return Pin::new(&mut this.inner).poll_write(cx, buf),
            }
        }
        this.poll_pending(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let first = bufs.iter().find(|b| !b.is_empty()).map_or(&[][..], |b| &b[..]);
        if this.pending.is_none() && rewrite(first).is_none() {
            return Pin::new(&mut this.inner).poll_write_vectored(cx, bufs);
        }
        // hyper's answer is in the first buffer: written as one (a short write of the slices is allowed).
        Pin::new(this).poll_write(cx, first)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.pending.is_some() {
            ready!(self.poll_pending(cx))?;
        }
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.pending.is_some() {
            ready!(self.poll_pending(cx))?;
        }
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYPER_414: &[u8] =
        b"HTTP/1.1 414 URI Too Long\r\nconnection: close\r\ncontent-length: 0\r\ndate: Tue, 01 Dec 2026 15:31:49 GMT\r\n\r\n";

    #[test]
    fn hypers_automatic_answers_become_json_errors() {
        for (head, status) in [
            (HYPER_414.to_vec(), 414),
            (
                b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: 0\r\n\r\n".to_vec(),
                400,
            ),
            (
                b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"
                    .to_vec(),
                431,
            ),
        ] {
            let (answer, replaces) = rewrite(&head).expect("rewritten");
            assert_eq!(replaces, head.len());
            let text = String::from_utf8(answer).expect("utf-8");
            let (head, body) = text.split_once("\r\n\r\n").expect("a head");
            assert!(head.starts_with(&format!("HTTP/1.1 {status} ")), "{head}");
            assert!(head.contains(&format!("content-length: {}", body.len())), "{head}");
            let json: serde_json::Value = serde_json::from_str(body).expect("json");
            assert_eq!(json["error"]["code"], status);
            assert_eq!(json["error"]["type"], "invalid_request_error");
        }
    }

    #[test]
    fn the_gateways_own_answers_pass_unchanged() {
        for head in [
            &b"HTTP/1.1 414 URI Too Long\r\ncontent-type: application/json\r\ncontent-length: 107\r\n\r\n{}"[..],
            b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n",
            b"HTTP/1.1 414 URI Too Long\r\nconnection: close\r\ncontent-length: 0\r\n",
            b"data: {\"x\": 1}\n\n",
            b"",
        ] {
            assert!(rewrite(head).is_none(), "{}", String::from_utf8_lossy(head));
        }
    }

    #[tokio::test]
    async fn a_rewritten_answer_is_written_whole_through_short_writes() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        // A pipe of 7 bytes: every write of the answer is short.
        let (client, server) = tokio::io::duplex(7);
        let mut stream = JsonParseErrors::new(server);
        let writer = tokio::spawn(async move {
            stream.write_all(HYPER_414).await.expect("written");
            stream.shutdown().await.expect("shut down");
        });
        let mut got = String::new();
        let mut client = client;
        client.read_to_string(&mut got).await.expect("read");
        writer.await.expect("joined");
        assert!(
            got.starts_with("HTTP/1.1 414 URI Too Long\r\ncontent-type: application/json\r\n"),
            "{got}"
        );
        assert!(got.ends_with("\"type\":\"invalid_request_error\"}}"), "{got}");
    }
}
