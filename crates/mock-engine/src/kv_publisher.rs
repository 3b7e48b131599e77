//! The mock engine's KV event publisher, as vLLM's and SGLang's `ZmqEventPublisher` work.
//!
//! Each rank publishes on its own ZMQ PUB socket: the configured endpoint with the port plus the rank (as the
//! engines' `offset_endpoint_port` does), or, with port 0, a free port per rank (listed in `/get_server_info` as
//! `kv_events_endpoints`). Every message has three frames: the topic (empty), the batch's sequence number (8 bytes,
//! big-endian, from 0 per rank) and the msgpack `EventBatch` ([`dprouter_core::kv_events::encode_batch`]). The
//! events a cache change made leave together in one batch, with the rank in it.
//!
//! With a replay endpoint, each rank also serves a ROUTER socket that answers `[empty, start_seq]` with every
//! batch it still holds from that number on, as `[empty, seq, payload]`, then `[empty, -1, empty]`. It holds the
//! last [`REPLAY_BATCHES`] batches (vLLM's default buffer).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use dprouter_core::kv_events::{encode_batch, Encoding, EventBatch, KvEvent};
use tokio::sync::mpsc;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::engine::Engine;

/// Batches each rank keeps for replay.
pub const REPLAY_BATCHES: usize = 10_000;

/// The end-of-replay sequence number.
const END: [u8; 8] = (-1i64).to_be_bytes();

/// `tcp://host:port` with the port plus `offset` (port 0 stays 0: a free port each).
fn offset_endpoint(endpoint: &str, offset: u32) -> Result<String, String> {
    let (head, port) = endpoint
        .rsplit_once(':')
        .ok_or_else(|| format!("`{endpoint}` is not tcp://host:port"))?;
    let port: u32 = port.parse().map_err(|_| format!("`{endpoint}` has no port number"))?;
    if !endpoint.starts_with("tcp://") || port > 65_535 {
        return Err(format!("`{endpoint}` is not tcp://host:port"));
    }
    let port = if port == 0 { 0 } else { port + offset };
    if port > 65_535 {
        return Err(format!("`{endpoint}` plus rank {offset} is past port 65535"));
    }
    Ok(format!("{head}:{port}"))
}

/// Binds every rank's sockets and starts publishing `engine`'s events; returns each rank's bound endpoints (PUB,
/// and replay when asked for).
pub async fn start(
    engine: &Arc<Engine>,
    endpoint: &str,
    replay: Option<&str>,
    encoding: Encoding,
) -> Result<Vec<(String, Option<String>)>, String> {
    let streams = engine.take_event_streams();
    if streams.is_empty() {
        return Err("the engine keeps no KV events (EngineConfig::kv_events is off)".into());
    }
    let mut bound = Vec::new();
    for (rank, events) in streams.into_iter().enumerate() {
        let rank = rank as u32;
        let mut publisher = zeromq::PubSocket::new();
        let at = offset_endpoint(endpoint, rank)?;
        let pub_endpoint = publisher
            .bind(&at)
            .await
            .map_err(|e| format!("binding KV events publisher {at}: {e}"))?
            .to_string();
        let buffer = Arc::new(Mutex::new(VecDeque::new()));
        let replay_endpoint = match replay {
            None => None,
            Some(replay) => {
                let at = offset_endpoint(replay, rank)?;
                let mut router = zeromq::RouterSocket::new();
                let resolved = router
                    .bind(&at)
                    .await
                    .map_err(|e| format!("binding KV events replay {at}: {e}"))?
                    .to_string();
                tokio::spawn(serve_replay(router, Arc::clone(&buffer)));
                Some(resolved)
            }
        };
        tokio::spawn(publish(publisher, events, rank, encoding, buffer));
        bound.push((pub_endpoint, replay_endpoint));
    }
    let _ = engine.kv_endpoints.set(bound.clone());
    Ok(bound)
}

type Buffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

fn lock(buffer: &Buffer) -> std::sync::MutexGuard<'_, VecDeque<(u64, Bytes)>> {
    buffer.lock().unwrap_or_else(|e| e.into_inner())
}

async fn publish(
    mut socket: zeromq::PubSocket,
    mut events: mpsc::UnboundedReceiver<Vec<KvEvent>>,
    rank: u32,
    encoding: Encoding,
    buffer: Buffer,
) {
    let mut seq = 0u64;
    while let Some(first) = events.recv().await {
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let batch = EventBatch {
            ts,
            events: first,
            dp_rank: Some(rank),
        };
        let payload = Bytes::from(encode_batch(&batch, encoding));
        {
            let mut buffer = lock(&buffer);
            if buffer.len() == REPLAY_BATCHES {
                buffer.pop_front();
            }
            buffer.push_back((seq, payload.clone()));
        }
        let frames = vec![Bytes::new(), Bytes::copy_from_slice(&seq.to_be_bytes()), payload];
        if let Ok(message) = ZmqMessage::try_from(frames) {
            // No subscriber yet is not an error: PUB drops what nobody listens to, as the engines' does.
            let _ = socket.send(message).await;
        }
        seq += 1;
    }
}

async fn serve_replay(mut socket: zeromq::RouterSocket, buffer: Buffer) {
    while let Ok(request) = socket.recv().await {
        let frames = request.into_vec();
        let (Some(client), Some(start)) = (frames.first(), frames.last()) else {
            continue;
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_ref()) else {
            continue;
        };
        let start = u64::from_be_bytes(start);
        let held: Vec<(u64, Bytes)> = lock(&buffer).iter().filter(|(s, _)| *s >= start).cloned().collect();
        let replies = held
            .into_iter()
            .map(|(seq, payload)| vec![Bytes::copy_from_slice(&seq.to_be_bytes()), payload])
            .chain([vec![Bytes::copy_from_slice(&END), Bytes::new()]]);
        for reply in replies {
            let mut frames = vec![client.clone(), Bytes::new()];
            frames.extend(reply);
            let Ok(message) = ZmqMessage::try_from(frames) else {
                break;
            };
            if socket.send(message).await.is_err() {
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_offset_the_port_as_the_engines_do() {
        assert_eq!(
            offset_endpoint("tcp://127.0.0.1:5557", 3).unwrap(),
            "tcp://127.0.0.1:5560"
        );
        assert_eq!(offset_endpoint("tcp://127.0.0.1:0", 3).unwrap(), "tcp://127.0.0.1:0");
        assert!(offset_endpoint("tcp://127.0.0.1:65535", 1).is_err());
        assert!(offset_endpoint("ipc:///tmp/x", 0).is_err());
    }
}
