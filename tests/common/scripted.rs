//! A scripted engine for the tests: it answers probes as an engine that is up and each POST as a test says, and
//! records every request's head and body, so a test can show what reached an engine and what did not.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What a scripted engine does with a POST.
#[derive(Clone, Copy)]
pub enum Act {
    /// Answers 200 with this JSON.
    Json(&'static str),
    /// Answers this status with a JSON body of about this many bytes.
    Status(u16, usize),
    /// Never answers (the connection is held open).
    Hang,
    /// Sends a stream's head and one event, then nothing more (held open).
    SseThenStall,
    /// Streams these events, each after its pause in milliseconds, then ends the stream.
    Events(&'static [(u64, &'static str)]),
}

/// A scripted engine: answers GETs as an engine that is up (`/get_server_info`: one rank; `/v1/models`: the model
/// `m`), POSTs by its [`Act`], and records every request's head (lower-cased) and body.
pub struct Scripted {
    pub url: String,
    pub seen: Arc<Mutex<Vec<(String, String)>>>,
}

impl Scripted {
    pub async fn start(act: Act) -> Scripted {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = Arc::clone(&seen);
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                tokio::spawn(answer(socket, act, Arc::clone(&log)));
            }
        });
        Scripted { url, seen }
    }

    /// The POSTs that reached it: head and body.
    pub fn posts(&self) -> Vec<(String, String)> {
        let seen = self.seen.lock().unwrap();
        seen.iter().filter(|(h, _)| h.starts_with("post ")).cloned().collect()
    }

    pub fn port(&self) -> u16 {
        super::port_of(&self.url)
    }
}

async fn answer(mut socket: TcpStream, act: Act, seen: Arc<Mutex<Vec<(String, String)>>>) {
    let Some((head, length)) = super::read_head(&mut socket).await else {
        return;
    };
    let mut body = vec![0u8; length];
    let _ = socket.read_exact(&mut body).await;
    seen.lock()
        .unwrap()
        .push((head.clone(), String::from_utf8_lossy(&body).into_owned()));
    if !head.starts_with("post ") {
        let reply = if head.starts_with("get /v1/models") {
            r#"{"object": "list", "data": [{"id": "m", "object": "model"}]}"#
        } else {
            r#"{"dp_size": 1}"#
        };
        let _ = socket.write_all(super::json_answer(reply).as_bytes()).await;
        return;
    }
    match act {
        Act::Json(reply) => {
            let _ = socket.write_all(super::json_answer(reply).as_bytes()).await;
        }
        Act::Status(status, bytes) => {
            let reply = format!(r#"{{"error": {{"message": "{}"}}}}"#, "x".repeat(bytes));
            let head = format!(
                "HTTP/1.1 {status} Bad\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                reply.len()
            );
            let _ = socket.write_all(head.as_bytes()).await;
            let _ = socket.write_all(reply.as_bytes()).await;
        }
        Act::Hang => tokio::time::sleep(Duration::from_secs(120)).await,
        Act::SseThenStall => {
            let event = "data: {\"choices\": [{\"text\": \"a\"}]}\n\n";
            let out = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{event}\r\n",
                event.len()
            );
            let _ = socket.write_all(out.as_bytes()).await;
            tokio::time::sleep(Duration::from_secs(120)).await;
        }
        Act::Events(events) => {
            let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
            let _ = socket.write_all(head.as_bytes()).await;
            for (pause_ms, event) in events {
                tokio::time::sleep(Duration::from_millis(*pause_ms)).await;
                let chunk = format!("{:x}\r\n{event}\r\n", event.len());
                let _ = socket.write_all(chunk.as_bytes()).await;
            }
            let _ = socket.write_all(b"0\r\n\r\n").await;
        }
    }
}

/// The header names of a recorded head (lower case), in order.
pub fn header_names(head: &str) -> Vec<String> {
    head.lines()
        .skip(1)
        .filter_map(|l| l.split_once(':').map(|(n, _)| n.trim().to_string()))
        .collect()
}
