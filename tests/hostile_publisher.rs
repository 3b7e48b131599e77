//! A hostile KV event publisher against a gateway in a child process (the `zeromq` crate's codec used to abort the
//! whole process on a frame declaring a petabyte): a ZMTP peer written here, byte by byte, that sends a frame
//! declaring 1 PiB, then a message whose frames never end, then a batch whose time is NaN, while its replay
//! endpoint answers every request with 1 MiB batches and no end marker. The gateway stays up and serving, counts
//! each as an error, stays in the approximate mode, and its peak memory grows by a small multiple of its caps
//! (a 4 MiB message, 16 queued, a 64 MiB replay), not by what the peer declared or sent.
#![allow(clippy::unwrap_used)]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{client, eventually, get, post, Proc};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A ZMTP 3.0 greeting with the NULL mechanism.
fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xFF;
    g[8] = 1;
    g[9] = 0x7F;
    g[10] = 3;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// Greets a connected gateway as a socket of `kind` and reads its greeting and READY.
async fn greet(s: &mut TcpStream, kind: &[u8]) {
    let mut theirs = [0u8; 64];
    s.read_exact(&mut theirs).await.unwrap();
    s.write_all(&greeting()).await.unwrap();
    let mut ready = vec![5];
    ready.extend_from_slice(b"READY");
    ready.push(11);
    ready.extend_from_slice(b"Socket-Type");
    ready.extend_from_slice(&(kind.len() as u32).to_be_bytes());
    ready.extend_from_slice(kind);
    s.write_all(&[0x04, ready.len() as u8]).await.unwrap();
    s.write_all(&ready).await.unwrap();
    // Their READY: a short command frame.
    let mut head = [0u8; 2];
    s.read_exact(&mut head).await.unwrap();
    let mut body = vec![0u8; usize::from(head[1])];
    s.read_exact(&mut body).await.unwrap();
}

/// A long frame of `len` bytes of `fill` (with MORE when `more`).
async fn frame(s: &mut TcpStream, more: bool, payload: &[u8]) -> std::io::Result<()> {
    s.write_all(&[0x02 | u8::from(more)]).await?;
    s.write_all(&(payload.len() as u64).to_be_bytes()).await?;
    s.write_all(payload).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_publisher_cannot_take_the_gateway_down() {
    let publisher = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let replay = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (pub_addr, replay_addr) = (publisher.local_addr().unwrap(), replay.local_addr().unwrap());
    let connections = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&connections);
    tokio::spawn(async move {
        while let Ok((mut s, _)) = publisher.accept().await {
            let n = seen.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                greet(&mut s, b"PUB").await;
                let _ = match n {
                    // A frame declaring a petabyte, and nothing after it.
                    0 => {
                        s.write_all(&[0x02]).await.unwrap();
                        s.write_all(&(1u64 << 50).to_be_bytes()).await
                    }
                    // A message whose 1 MiB frames never end.
                    1 => {
                        let chunk = vec![0u8; 1 << 20];
                        let mut sent = Ok(());
                        for _ in 0..300 {
                            sent = frame(&mut s, true, &chunk).await;
                            if sent.is_err() {
                                break;
                            }
                        }
                        sent
                    }
                    // A batch `[NaN, []]` (msgpack), as [topic, seq, payload].
                    _ => {
                        let payload = [0x92, 0xCB, 0x7F, 0xF8, 0, 0, 0, 0, 0, 0, 0x90];
                        let _ = frame(&mut s, true, b"kv").await;
                        let _ = frame(&mut s, true, &0u64.to_be_bytes()).await;
                        frame(&mut s, false, &payload).await
                    }
                };
                let mut sink = vec![0u8; 1024];
                while s.read(&mut sink).await.is_ok_and(|n| n > 0) {}
            });
        }
    });
    tokio::spawn(async move {
        while let Ok((mut s, _)) = replay.accept().await {
            tokio::spawn(async move {
                greet(&mut s, b"ROUTER").await;
                // The request, then 1 MiB batches for as long as the gateway reads, with no end marker.
                let chunk = vec![0x90u8; 1 << 20];
                for seq in 0u64..1_000 {
                    let sent = async {
                        frame(&mut s, true, b"").await?;
                        frame(&mut s, true, &seq.to_be_bytes()).await?;
                        frame(&mut s, false, &chunk).await
                    };
                    if sent.await.is_err() {
                        break;
                    }
                }
            });
        }
    });

    let engine = Proc::engine(&["--dp-size", "1"]);
    let config = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("hostile-publisher.toml");
    std::fs::write(
        &config,
        format!(
            "[routing]\npolicy = \"cache_aware\"\n[[workers]]\nurl = {:?}\nkv_events = \"tcp://{pub_addr}\"\nkv_events_replay = \"tcp://{replay_addr}\"\n",
            engine.url
        ),
    )
    .unwrap();
    let gw = Proc::start(&["serve", "--listen", "127.0.0.1:0", "--config", config.to_str().unwrap()]);
    let before = common::memory::peak_rss(gw.child.id());
    let c = client();
    let feed = || async { get(&c, &format!("{}/kv_events", gw.url)).await.json["feeds"][0].clone() };
    // Three connections: the huge frame and the endless message each end theirs, the NaN batch is refused.
    let all_seen = eventually(Duration::from_secs(20), || async {
        let f = feed().await;
        connections.load(Ordering::SeqCst) >= 3 && f["decode_errors"].as_u64().unwrap_or(0) >= 3
    });
    assert!(all_seen.await, "{}", feed().await);
    let status = feed().await;
    assert_eq!(status["precise"], json!(false), "{status}");
    let metrics = get(&c, &format!("{}/metrics", gw.url)).await.text;
    let replay_errors: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("dprouter_kv_event_errors_total") && l.contains("kind=\"replay\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(replay_errors >= 1.0, "the replay flood is cut and counted:\n{metrics}");
    // Still serving.
    let body = json!({"text": "still here", "sampling_params": {"max_new_tokens": 2}});
    let reply = post(&c, &format!("{}/generate", gw.url), &[], &body).await;
    assert_eq!(reply.status, hyper::StatusCode::OK, "{}", reply.text);
    let grown = common::memory::peak_rss(gw.child.id()).saturating_sub(before);
    eprintln!("peak RSS grew by {} MB", grown >> 20);
    assert!(grown < 512 << 20, "peak RSS grew by {} MB", grown >> 20);
}
