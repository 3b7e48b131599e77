//! What a KV event subscriber needs beyond the wire protocol, shared by the gateway's feeds and the Python
//! package's: the limits of a publisher's message, TCP keepalive (a vanished host is noticed), the handshake and
//! subscription, and reading a message's sequence number.

use std::time::Duration;

use bytes::Bytes;
use tokio::net::TcpStream;

use crate::{Connection, Limits, ZmtpError};

/// What one publisher's message may hold: a batch of events (a step's, a few KB to a few hundred KB even for a
/// long prefill) in a few frames. A message past it ends the publisher's connection.
pub const LIMITS: Limits = Limits {
    max_message: 4 << 20,
    max_frames: 8,
};

/// How long a publisher (or a replay endpoint) may take to greet.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// TCP keepalive on a publisher's connection: probes after 10 s without a byte, 3 of them 2 s apart; a host that
/// vanished answers none, and the connection fails about 16 s after its last byte. (ZMTP 3.1's heartbeats would
/// need every publisher to send them; the kernel's probes need nothing of it.)
pub const KEEPALIVE: socket2::TcpKeepalive = socket2::TcpKeepalive::new()
    .with_time(Duration::from_secs(10))
    .with_interval(Duration::from_secs(2))
    .with_retries(3);

/// Subscribes to `topic` (a prefix; empty: everything) on a publisher's connection: keepalive on, the ZMTP
/// handshake as a SUB within [`HANDSHAKE_TIMEOUT`], then the subscription.
pub async fn subscribe(stream: TcpStream, topic: &[u8]) -> Result<Connection, ZmtpError> {
    // Without keepalive a vanished host is only noticed when something is sent to it: still a working feed.
    let _ = socket2::SockRef::from(&stream).set_tcp_keepalive(&KEEPALIVE);
    let mut conn = Connection::handshake(stream, "SUB", LIMITS, HANDSHAKE_TIMEOUT).await?;
    conn.subscribe(topic).await?;
    Ok(conn)
}

/// The sequence number and payload of a message: `[topic, seq, payload]` (or without the topic).
pub fn sequenced(frames: &[Bytes]) -> Option<(u64, &[u8])> {
    let [.., seq, payload] = frames else { return None };
    let seq = <[u8; 8]>::try_from(seq.as_ref()).ok()?;
    Some((u64::from_be_bytes(seq), payload.as_ref()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequence_numbers_are_read_with_or_without_the_topic() {
        let seq = Bytes::copy_from_slice(&7u64.to_be_bytes());
        let payload = Bytes::from_static(b"p");
        assert_eq!(
            sequenced(&[Bytes::new(), seq.clone(), payload.clone()]),
            Some((7, &b"p"[..]))
        );
        assert_eq!(sequenced(&[seq, payload.clone()]), Some((7, &b"p"[..])));
        assert_eq!(sequenced(&[Bytes::from_static(b"short"), payload]), None);
        assert_eq!(sequenced(&[]), None);
    }
}
