//! A minimal ZMTP 3 peer (ZeroMQ's wire protocol, RFC 23/ZMTP, NULL security) for what the KV event feeds need: a
//! SUB that reads a publisher's messages, and a DEALER that asks a replay endpoint (a ROUTER) for past batches. It
//! speaks to libzmq (vLLM's and SGLang's pyzmq) and to the `zeromq` crate (the mock engine) alike. The gateway's
//! feeds (`crates/gateway/src/kv_feeds/mod.rs`) and the Python package's, inside an engine (`crates/python`), read
//! publishers through it; [`kv`] holds what both need beyond the wire protocol.
//!
//! Unlike a general ZMQ library it bounds every byte a peer sends before it allocates it: a frame or a message
//! longer than [`Limits::max_message`], more frames than [`Limits::max_frames`], a command over
//! [`MAX_COMMAND_BYTES`], or a greeting that is not ZMTP 3 is an error ([`ZmtpError`]) that ends the connection, so
//! a hostile or broken publisher costs at most one message's worth of memory (a frame declaring a petabyte aborted
//! the whole gateway inside the `zeromq` crate's codec). Connections are plain tokio TCP streams: whoever holds one
//! sees it close, with no library reconnecting behind its back.
//!
//! The greeting announces ZMTP 3.0, so a subscription is the 3.0 message `[0x01, topic]` that every ZMTP 3 publisher
//! accepts; commands from the peer (`READY` properties, `PING` when it has heartbeats on) are read and skipped.

pub mod kv;

use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How much a peer may send at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The most bytes of one message (all its frames).
    pub max_message: usize,
    /// The most frames of one message.
    pub max_frames: usize,
}

/// The most bytes of one command frame (a `READY` with its properties, a `PING`).
pub const MAX_COMMAND_BYTES: usize = 64 << 10;

const MORE: u8 = 0x01;
const LONG: u8 = 0x02;
const COMMAND: u8 = 0x04;

/// Why a connection ended.
#[derive(Debug, thiserror::Error)]
pub enum ZmtpError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("not a ZMTP 3 peer: {0}")]
    Greeting(String),
    #[error("{size} bytes, past the {limit} a message (or a command) may hold")]
    TooLarge { size: u64, limit: usize },
    #[error("a message of more than {0} frames")]
    TooManyFrames(usize),
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("the handshake took longer than {0:?}")]
    Timeout(Duration),
}

impl ZmtpError {
    /// The peer sent more than the limits allow (as opposed to closing, or speaking something else).
    pub fn is_too_large(&self) -> bool {
        matches!(self, ZmtpError::TooLarge { .. } | ZmtpError::TooManyFrames(_))
    }
}

/// One ZMTP connection, after its handshake.
pub struct Connection {
    stream: TcpStream,
    limits: Limits,
}

/// Our greeting: ZMTP 3.0, the NULL mechanism, not a server.
fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xFF;
    g[8] = 0x01;
    g[9] = 0x7F;
    g[10] = 3;
    g[11] = 0;
    g[12..16].copy_from_slice(b"NULL");
    g
}

impl Connection {
    /// Greets the peer on `stream` as a `socket_type` socket (`SUB`, `DEALER`) and reads its greeting and `READY`,
    /// within `timeout`.
    pub async fn handshake(
        stream: TcpStream,
        socket_type: &str,
        limits: Limits,
        timeout: Duration,
    ) -> Result<Self, ZmtpError> {
        let mut conn = Connection { stream, limits };
        tokio::time::timeout(timeout, conn.greet(socket_type))
            .await
            .map_err(|_| ZmtpError::Timeout(timeout))??;
        Ok(conn)
    }

    async fn greet(&mut self, socket_type: &str) -> Result<(), ZmtpError> {
        let _ = self.stream.set_nodelay(true);
        self.stream.write_all(&greeting()).await?;
        let mut theirs = [0u8; 64];
        self.stream.read_exact(&mut theirs).await?;
        if theirs[0] != 0xFF || theirs[9] != 0x7F {
            return Err(ZmtpError::Greeting("no ZMTP signature".into()));
        }
        if theirs[10] < 3 {
            return Err(ZmtpError::Greeting(format!("version {}.{}", theirs[10], theirs[11])));
        }
        let mechanism = &theirs[12..32];
        if !mechanism.starts_with(b"NULL") || mechanism[4..].iter().any(|&b| b != 0) {
            return Err(ZmtpError::Greeting("a security mechanism other than NULL".into()));
        }
        // READY, with our socket type (and an empty identity, which a ROUTER then makes up).
        let mut ready = Vec::with_capacity(64);
        ready.push(5);
        ready.extend_from_slice(b"READY");
        for (name, value) in [("Socket-Type", socket_type.as_bytes()), ("Identity", &b""[..])] {
            ready.push(name.len() as u8);
            ready.extend_from_slice(name.as_bytes());
            ready.extend_from_slice(&(value.len() as u32).to_be_bytes());
            ready.extend_from_slice(value);
        }
        self.write_frame(COMMAND, &ready).await?;
        self.stream.flush().await?;
        // Their READY (or ERROR): a command, with no room for message bytes before it.
        let (flags, body) = self.read_frame(self.limits.max_message).await?;
        if flags & COMMAND == 0 {
            return Err(ZmtpError::Protocol("a message before the peer's READY".into()));
        }
        match command_name(&body) {
            Some(b"READY") => Ok(()),
            Some(b"ERROR") => Err(ZmtpError::Protocol(format!(
                "the peer refused: {}",
                String::from_utf8_lossy(body.get(7..).unwrap_or_default())
            ))),
            _ => Err(ZmtpError::Protocol("the peer's first command is not READY".into())),
        }
    }

    async fn write_frame(&mut self, flags: u8, body: &[u8]) -> std::io::Result<()> {
        if body.len() < 256 {
            self.stream.write_all(&[flags, body.len() as u8]).await?;
        } else {
            self.stream.write_all(&[flags | LONG]).await?;
            self.stream.write_all(&(body.len() as u64).to_be_bytes()).await?;
        }
        self.stream.write_all(body).await
    }

    /// Sends one message of `frames`.
    pub async fn send(&mut self, frames: &[&[u8]]) -> std::io::Result<()> {
        for (i, frame) in frames.iter().enumerate() {
            let flags = if i + 1 < frames.len() { MORE } else { 0 };
            self.write_frame(flags, frame).await?;
        }
        self.stream.flush().await
    }

    /// Subscribes to every message whose first frame starts with `topic` (a SUB's only message).
    pub async fn subscribe(&mut self, topic: &[u8]) -> std::io::Result<()> {
        let mut message = Vec::with_capacity(1 + topic.len());
        message.push(0x01);
        message.extend_from_slice(topic);
        self.send(&[&message]).await
    }

    /// Reads one frame: its flags and body, of at most what a message with `used` bytes already may still hold
    /// for a message frame and [`MAX_COMMAND_BYTES`] for a command. The body is allocated only once its size is
    /// known to be within that.
    async fn read_frame(&mut self, used: usize) -> Result<(u8, Bytes), ZmtpError> {
        let flags = self.stream.read_u8().await?;
        if flags & !(MORE | LONG | COMMAND) != 0 {
            return Err(ZmtpError::Protocol(format!("frame flags {flags:#04x}")));
        }
        let size = match flags & LONG {
            0 => u64::from(self.stream.read_u8().await?),
            _ => self.stream.read_u64().await?,
        };
        let (limit, size_with_used) = match flags & COMMAND {
            0 => (self.limits.max_message, size.saturating_add(used as u64)),
            _ => (MAX_COMMAND_BYTES, size),
        };
        if size_with_used > limit as u64 {
            return Err(ZmtpError::TooLarge {
                size: size_with_used,
                limit,
            });
        }
        let mut body = vec![0u8; size as usize];
        self.stream.read_exact(&mut body).await?;
        Ok((flags, body.into()))
    }

    /// The next message, its frames (commands between messages are read and skipped).
    pub async fn recv(&mut self) -> Result<Vec<Bytes>, ZmtpError> {
        let mut frames = Vec::new();
        let mut total = 0usize;
        loop {
            let (flags, body) = self.read_frame(total).await?;
            if flags & COMMAND != 0 {
                if !frames.is_empty() {
                    return Err(ZmtpError::Protocol("a command inside a message".into()));
                }
                continue;
            }
            total += body.len();
            frames.push(body);
            if frames.len() > self.limits.max_frames {
                return Err(ZmtpError::TooManyFrames(self.limits.max_frames));
            }
            if flags & MORE == 0 {
                return Ok(frames);
            }
        }
    }
}

/// A command frame's name (its first byte is the name's length).
fn command_name(body: &[u8]) -> Option<&[u8]> {
    let len = usize::from(*body.first()?);
    body.get(1..1 + len)
}

/// The `host:port` of a `tcp://host:port` endpoint (`*` is every interface, as ZMQ writes it).
pub fn tcp_address(endpoint: &str) -> Option<String> {
    let rest = endpoint.strip_prefix("tcp://")?;
    let (host, port) = rest.rsplit_once(':')?;
    let host = if host == "*" { "0.0.0.0" } else { host };
    Some(format!("{host}:{port}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    const LIMITS: Limits = Limits {
        max_message: 1 << 20,
        max_frames: 8,
    };

    /// A scripted peer on loopback: it sends `greeting`, then `after` (raw bytes), and keeps the connection open
    /// until the client closes it; returns its address.
    async fn peer(after: Vec<u8>) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut theirs = [0u8; 64];
            s.read_exact(&mut theirs).await.unwrap();
            s.write_all(&greeting()).await.unwrap();
            // READY: a PUB.
            let mut ready = vec![5];
            ready.extend_from_slice(b"READY");
            ready.push(11);
            ready.extend_from_slice(b"Socket-Type");
            ready.extend_from_slice(&3u32.to_be_bytes());
            ready.extend_from_slice(b"PUB");
            s.write_all(&[COMMAND, ready.len() as u8]).await.unwrap();
            s.write_all(&ready).await.unwrap();
            s.write_all(&after).await.unwrap();
            let mut sink = Vec::new();
            let _ = s.read_to_end(&mut sink).await;
        });
        addr
    }

    async fn connect(addr: &str) -> Connection {
        let stream = TcpStream::connect(addr).await.unwrap();
        Connection::handshake(stream, "SUB", LIMITS, Duration::from_secs(5))
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn messages_are_read_and_commands_skipped() {
        // A PING command, then a message of two frames (the second long), then one of one.
        let mut bytes = vec![COMMAND, 5, 4, b'P', b'I', b'N', b'G'];
        bytes.extend([MORE, 3]);
        bytes.extend(b"abc");
        bytes.push(LONG);
        bytes.extend(300u64.to_be_bytes());
        bytes.extend(vec![7u8; 300]);
        bytes.extend([0, 1, b'z']);
        let mut conn = connect(&peer(bytes).await).await;
        let first = conn.recv().await.unwrap();
        assert_eq!(first.len(), 2);
        assert_eq!((&first[0][..], first[1].len()), (&b"abc"[..], 300));
        assert_eq!(conn.recv().await.unwrap(), vec![Bytes::from_static(b"z")]);
    }

    #[tokio::test]
    async fn a_frame_past_the_limit_is_an_error_before_anything_is_allocated() {
        // A frame declaring a petabyte.
        let mut bytes = vec![LONG];
        bytes.extend((1u64 << 50).to_be_bytes());
        let mut conn = connect(&peer(bytes).await).await;
        let err = conn.recv().await.unwrap_err();
        assert!(err.is_too_large(), "{err}");
        // Frames that add up past the limit, and too many frames.
        let mut bytes = Vec::new();
        for _ in 0..3 {
            bytes.push(MORE | LONG);
            bytes.extend((400_000u64).to_be_bytes());
            bytes.extend(vec![0u8; 400_000]);
        }
        let mut conn = connect(&peer(bytes).await).await;
        assert!(conn.recv().await.unwrap_err().is_too_large());
        let bytes: Vec<u8> = (0..20).flat_map(|_| [MORE, 1, b'x']).collect();
        let mut conn = connect(&peer(bytes).await).await;
        assert!(matches!(conn.recv().await.unwrap_err(), ZmtpError::TooManyFrames(8)));
    }

    #[tokio::test]
    async fn a_peer_that_is_not_zmtp_3_is_refused() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            s.write_all(&[b'H'; 64]).await.unwrap();
            let mut sink = Vec::new();
            let _ = s.read_to_end(&mut sink).await;
        });
        let stream = TcpStream::connect(addr).await.unwrap();
        let err = Connection::handshake(stream, "SUB", LIMITS, Duration::from_secs(5))
            .await
            .err()
            .unwrap();
        assert!(matches!(err, ZmtpError::Greeting(_)), "{err}");
    }

    #[test]
    fn endpoints_name_tcp_addresses() {
        assert_eq!(tcp_address("tcp://127.0.0.1:5557").as_deref(), Some("127.0.0.1:5557"));
        assert_eq!(tcp_address("tcp://*:5557").as_deref(), Some("0.0.0.0:5557"));
        assert_eq!(tcp_address("tcp://[::1]:5557").as_deref(), Some("[::1]:5557"));
        assert_eq!(tcp_address("ipc:///tmp/x"), None);
    }
}
