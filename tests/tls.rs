//! End-to-end TLS: a gateway serving HTTPS with a certificate made here, in front of a mock engine, is the
//! `https://` worker of a second gateway that trusts the certificate's authority; a third gateway, which trusts only
//! the system's roots, refuses it.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::{client, eventually, get, post, Proc};
use hyper::StatusCode;
use serde_json::json;

/// A certificate authority and a certificate it signed for `localhost` and 127.0.0.1, as PEM files in `dir`:
/// (the authority, the certificate, its key).
fn certificates(dir: &str) -> (PathBuf, PathBuf, PathBuf) {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(dir);
    std::fs::create_dir_all(&dir).unwrap();
    let ca_key = rcgen::KeyPair::generate().unwrap();
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, "dprouter test authority");
    let ca = ca.self_signed(&ca_key).unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let leaf = rcgen::CertificateParams::new(vec!["localhost".to_string(), "127.0.0.1".to_string()])
        .unwrap()
        .signed_by(&key, &ca, &ca_key)
        .unwrap();
    let paths = (dir.join("ca.pem"), dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&paths.0, ca.pem()).unwrap();
    std::fs::write(&paths.1, leaf.pem()).unwrap();
    std::fs::write(&paths.2, key.serialize_pem()).unwrap();
    paths
}

fn config(name: &str, text: &str) -> String {
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_worker_is_served_and_checked() {
    let (ca, cert, key) = certificates("tls-certs");
    let engine = Proc::engine(&["--dp-size", "2"]);
    let listener = config(
        "tls-listener.toml",
        &format!(
            "[server]\ntls_cert_file = {:?}\ntls_key_file = {:?}\n",
            cert.display(),
            key.display()
        ),
    );
    let tls = Proc::gateway(&[&engine], &["--config", &listener]);
    assert!(tls.url.starts_with("https://127.0.0.1:"), "{}", tls.url);

    let trusting = config("tls-trusting.toml", &format!("upstream_ca_file = {:?}\n", ca.display()));
    let front = Proc::gateway(&[&tls], &["--config", &trusting, "--backend", "openai"]);
    let c = client();
    // Long enough to be indexed (a prompt shorter than a block is placed cold every time, spread by recent load),
    // so that the second request goes where the first did, and hits.
    let content = "over TLS, ".repeat(60);
    let chat = json!({"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": content}]});
    let url = format!("{}/v1/chat/completions", front.url);
    // The worker is up once a probe has gone through TLS.
    assert!(
        eventually(Duration::from_secs(10), || async {
            post(&c, &url, &[], &chat).await.status == StatusCode::OK
        })
        .await
    );
    let reply = post(&c, &url, &[], &chat).await;
    assert_eq!(
        reply.json["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .split_whitespace()
            .count(),
        3
    );
    assert_eq!(
        reply.json["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .map(|n| n > 0),
        Some(true)
    );

    // Without the authority, the certificate is not trusted: no request reaches the worker, and the log says why.
    let log = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("tls-doubting.log");
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_dprouter"));
    command
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--backend",
            "openai",
            "--worker",
            &tls.url,
        ])
        .env("RUST_LOG", "warn")
        .stderr(std::fs::File::create(&log).unwrap());
    let doubting = Proc::spawn(command);
    let refused = post(&c, &format!("{}/v1/chat/completions", doubting.url), &[], &chat).await;
    // A 502 from the failed handshake, or a 503 once a probe's handshake has failed too.
    assert!(
        [StatusCode::BAD_GATEWAY, StatusCode::SERVICE_UNAVAILABLE].contains(&refused.status),
        "{}",
        refused.text
    );
    let workers = format!("{}/workers", doubting.url);
    let down = eventually(Duration::from_secs(10), || async {
        get(&c, &workers).await.json["workers"][0]["healthy"] == json!(false)
    });
    assert!(down.await, "the probes' handshakes fail");
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(
        logged
            .lines()
            .any(|l| l.contains("WARN") && l.contains("health probe failed") && l.contains("certificate")),
        "{logged}"
    );
}

#[test]
fn bad_tls_files_stop_the_start_with_a_message_naming_them() {
    let (_, cert, _) = certificates("tls-bad");
    for (text, expected) in [
        (
            format!("upstream_ca_file = {:?}\n", "/nonexistent/ca.pem"),
            "upstream_ca_file /nonexistent/ca.pem",
        ),
        (
            format!("[server]\ntls_cert_file = {:?}\n", cert.display()),
            "go together",
        ),
        (
            format!(
                "[server]\ntls_cert_file = {:?}\ntls_key_file = {:?}\n",
                cert.display(),
                cert.display()
            ),
            "server.tls_key_file",
        ),
    ] {
        let path = config("tls-bad.toml", &text);
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_dprouter"))
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--worker",
                "http://127.0.0.1:9",
                "--config",
                &path,
            ])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{text}");
        assert!(stderr.contains(expected), "{text}: {stderr}");
    }
}
