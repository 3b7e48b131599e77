//! A feed's connections: to a publisher that binds (reconnecting each [`RECONNECT`]), from publishers that connect
//! (at most [`MAX_PUBLISHERS`] at once), each read in a task of its own into the feed's queue, and the replay
//! endpoint asked for missed batches (bounded by [`MAX_REPLAY_BYTES`] and [`MAX_REPLAY_BATCHES`]).

use std::time::Duration;

use bytes::Bytes;
use dprouter_core::EndpointId;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use super::{kv, zmtp, END, HANDSHAKE_TIMEOUT, MAX_PUBLISHERS, MAX_REPLAY_BATCHES, MAX_REPLAY_BYTES, RECONNECT};

/// Asks a replay endpoint for every batch from `from`; returns them in order. Replies are
/// `[empty, seq, payload]` or, from newer vLLM, `[empty, topic, seq, payload]`, ending with sequence -1. At most
/// [`MAX_REPLAY_BYTES`] in all, and [`MAX_REPLAY_BATCHES`] batches.
pub(super) async fn fetch_replay(endpoint: &str, from: u64) -> Result<Vec<(u64, Bytes)>, String> {
    let address = zmtp::tcp_address(endpoint).ok_or_else(|| format!("{endpoint} is not tcp://host:port"))?;
    let stream = TcpStream::connect(&address).await.map_err(|e| e.to_string())?;
    let mut conn = zmtp::Connection::handshake(stream, "DEALER", kv::LIMITS, HANDSHAKE_TIMEOUT)
        .await
        .map_err(|e| e.to_string())?;
    conn.send(&[b"", &from.to_be_bytes()])
        .await
        .map_err(|e| e.to_string())?;
    let mut batches = Vec::new();
    let mut total = 0usize;
    loop {
        let frames = conn.recv().await.map_err(|e| e.to_string())?;
        let (seq, payload) = kv::sequenced(&frames).ok_or("a replay reply without a sequence number")?;
        if seq == END {
            return Ok(batches);
        }
        total += payload.len();
        if total > MAX_REPLAY_BYTES || batches.len() >= MAX_REPLAY_BATCHES {
            return Err(format!(
                "a replay of more than {MAX_REPLAY_BATCHES} batches or {MAX_REPLAY_BYTES} bytes"
            ));
        }
        batches.push((seq, Bytes::copy_from_slice(payload)));
    }
}

/// What a publisher's connection tells its feed.
pub(super) enum Peer {
    /// Connected and subscribed.
    Up,
    Message(Vec<Bytes>),
    /// The connection ended (with the error, when there was one).
    Down(Option<zmtp::ZmtpError>),
}

/// Reads one publisher's connection into `tell` until it ends (with TCP keepalive: [`kv::KEEPALIVE`]).
async fn pump(stream: TcpStream, tell: &mpsc::Sender<Peer>) {
    let mut conn = match kv::subscribe(stream, b"").await {
        Ok(conn) => conn,
        Err(e) => {
            tracing::debug!(error = %e, "KV events: a publisher's handshake failed");
            return;
        }
    };
    if tell.send(Peer::Up).await.is_err() {
        return;
    }
    let ended = loop {
        match conn.recv().await {
            Ok(frames) => {
                if tell.send(Peer::Message(frames)).await.is_err() {
                    return;
                }
            }
            Err(zmtp::ZmtpError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => break None,
            Err(e) => break Some(e),
        }
    };
    let _ = tell.send(Peer::Down(ended)).await;
}

/// Connects to a publisher that binds, and again each [`RECONNECT`] after its connection ends.
pub(super) async fn connect_loop(publisher: String, tell: mpsc::Sender<Peer>) {
    let Some(address) = zmtp::tcp_address(&publisher) else {
        return;
    };
    loop {
        match tokio::time::timeout(HANDSHAKE_TIMEOUT, TcpStream::connect(&address)).await {
            Ok(Ok(stream)) => pump(stream, &tell).await,
            Ok(Err(e)) => tracing::debug!(%publisher, error = %e, "KV events: cannot connect yet"),
            Err(_) => tracing::debug!(%publisher, "KV events: connecting timed out"),
        }
        if tell.is_closed() {
            return;
        }
        tokio::time::sleep(RECONNECT).await;
    }
}

/// Binds where publishers connect, and reads each that does (several may, each in a task of its own).
pub(super) async fn accept_loop(endpoint: EndpointId, address: String, tell: mpsc::Sender<Peer>) {
    let Some(bind) = zmtp::tcp_address(&address) else {
        return;
    };
    let listener = loop {
        match TcpListener::bind(&bind).await {
            Ok(listener) => break listener,
            Err(e) => {
                tracing::warn!(%endpoint, %address, error = %e, "KV events: cannot bind");
                tokio::time::sleep(RECONNECT).await;
            }
        }
    };
    tracing::info!(%endpoint, %address, "KV events: waiting for the publisher to connect");
    let mut connections = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) if connections.len() < MAX_PUBLISHERS => {
                    let tell = tell.clone();
                    connections.spawn(async move { pump(stream, &tell).await });
                }
                Ok(_) => tracing::warn!(%endpoint, %address, "KV events: too many publishers connected: refused one"),
                Err(e) => {
                    tracing::warn!(%endpoint, %address, error = %e, "KV events: accepting failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some(_) = connections.join_next() => {}
            () = tell.closed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_publishers_connection_is_kept_alive_by_tcp() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let connecting = tokio::spawn(TcpStream::connect(listener.local_addr().unwrap()));
        let (publisher, _) = listener.accept().await.unwrap();
        let stream = connecting.await.unwrap().unwrap().into_std().unwrap();
        // Another descriptor of the same socket, to read its options while the pump has it.
        let same = stream.try_clone().unwrap();
        assert!(!socket2::SockRef::from(&same).keepalive().unwrap());
        let (tell, _told) = mpsc::channel(4);
        let pumping = tokio::spawn(async move { pump(TcpStream::from_std(stream).unwrap(), &tell).await });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(socket2::SockRef::from(&same).keepalive().unwrap());
        drop(publisher);
        pumping.await.unwrap();
    }
}
