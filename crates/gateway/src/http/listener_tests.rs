//! Tests of the listener: connection limits, timeouts, reaping and drain.

use super::*;

fn shared(header_ms: u64, idle_ms: u64) -> Shared {
    Shared {
        protocol: Protocol::Http1,
        header_read_timeout: Duration::from_millis(header_ms),
        idle_timeout: Duration::from_millis(idle_ms),
        pressure: Notify::new(),
        tls: None,
    }
}

#[test]
fn deadlines_follow_the_connection() {
    let shared = shared(100, 1_000);
    let activity = Activity::new(true);
    let t = |ms: u64| activity.born + Duration::from_millis(ms);
    assert_eq!(activity.deadline(&shared), t(1_000), "idle from the accept");
    assert_eq!(activity.idle_for(t(300)), Some(Duration::from_millis(300)));
    activity.bytes_in(t(300));
    assert_eq!(activity.idle_for(t(300)), None);
    assert_eq!(activity.deadline(&shared), t(400), "the head from its first byte");
    activity.bytes_in(t(350));
    assert_eq!(activity.deadline(&shared), t(400), "more bytes do not extend it");
    assert_eq!(activity.expired(&shared, t(399)), None);
    activity.start_request();
    assert!(activity.deadline(&shared) > t(3_600_000), "none while in flight");
    activity.bytes_in(t(500));
    assert_eq!(activity.expired(&shared, t(5_000)), None);
    activity.end_request(t(6_300));
    assert_eq!(activity.deadline(&shared), t(7_300), "idle from the response's end");
    assert_eq!(activity.idle_for(t(6_300)), Some(Duration::ZERO));
    assert_eq!(activity.expired(&shared, t(7_299)), None);
    assert_eq!(activity.expired(&shared, t(7_300)), Some("idle timeout"));
    activity.bytes_in(t(7_000));
    assert_eq!(activity.expired(&shared, t(7_099)), None);
    assert_eq!(activity.expired(&shared, t(7_100)), Some("header read timeout"));
    // HTTP/2: bytes between streams (PINGs, SETTINGS) start no head; only idleness closes.
    let activity = Activity::new(false);
    let t = |ms: u64| activity.born + Duration::from_millis(ms);
    activity.bytes_in(t(300));
    assert_eq!(activity.deadline(&shared), t(1_000));
    assert_eq!(activity.expired(&shared, t(1_000)), Some("idle timeout"));
}

/// Handlers get `ConnectInfo<SocketAddr>` (what `into_make_service_with_connect_info` gave), and `run` returns
/// once its shutdown future completes and the connections are closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handlers_see_the_peer_and_shutdown_returns() {
    use std::io::{Read, Write};
    let peer = |ConnectInfo(peer): ConnectInfo<SocketAddr>| async move { peer.to_string() };
    let router = Router::new().route("/peer", axum::routing::get(peer));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let config = ServerConfig {
        drain_timeout_ms: 200,
        ..ServerConfig::default()
    };
    let server = tokio::spawn(async move {
        let shutdown = async {
            let _ = stopped.await;
        };
        run(
            listener,
            Protocol::Http1,
            router,
            &config,
            None,
            &DrainDeadline::default(),
            shutdown,
        )
        .await
    });
    let (local, reply, idle) = tokio::task::spawn_blocking(move || {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.write_all(b"GET /peer HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut reply = String::new();
        s.read_to_string(&mut reply).unwrap();
        // A connection that stays idle must not hold the shutdown up.
        let idle = std::net::TcpStream::connect(addr).unwrap();
        (s.local_addr().unwrap(), reply, idle)
    })
    .await
    .unwrap();
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    assert!(reply.ends_with(&local.to_string()), "{reply}");
    tokio::time::sleep(Duration::from_millis(50)).await;
    let started = std::time::Instant::now();
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(2), server)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_millis(150),
        "{:?}",
        started.elapsed()
    );
    drop(idle);
}

/// With TLS: a TLS client is served; a client that never says hello is closed after the header read timeout;
/// a plain-HTTP client is closed at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_connections_are_served_and_silent_ones_closed() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["localhost".to_string()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let dir = std::env::temp_dir().join(format!("dprouter-listener-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (cert_file, key_file) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert_file, cert.pem()).unwrap();
    std::fs::write(&key_file, key.serialize_pem()).unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(
        crate::http::tls::server_config(&cert_file, &key_file, None, crate::http::tls::HTTP1).unwrap(),
    );
    std::fs::remove_dir_all(&dir).unwrap();

    let router = Router::new().route("/", axum::routing::get(|| async { "over tls" }));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let config = ServerConfig {
        header_read_timeout_ms: 300,
        ..ServerConfig::default()
    };
    tokio::spawn(async move {
        run(
            listener,
            Protocol::Http1,
            router,
            &config,
            Some(acceptor),
            &DrainDeadline::default(),
            std::future::pending(),
        )
        .await
    });

    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.der().clone()).unwrap();
    let client = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(client));
    let tcp = TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let mut tls = connector.connect(name, tcp).await.unwrap();
    tls.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut reply = Vec::new();
    let _ = tls.read_to_end(&mut reply).await;
    let reply = String::from_utf8_lossy(&reply);
    assert!(
        reply.starts_with("HTTP/1.1 200") && reply.ends_with("over tls"),
        "{reply}"
    );

    // What the server sends before it closes (at most a TLS alert); a timeout if it never closes.
    let until_closed = |mut tcp: TcpStream| async move {
        let mut got = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut got)).await;
        read.map(|_| got)
    };
    let silent = until_closed(TcpStream::connect(addr).await.unwrap()).await;
    assert_eq!(
        silent.as_deref().ok(),
        Some(&[][..]),
        "closed after the header read timeout"
    );
    let mut plain = TcpStream::connect(addr).await.unwrap();
    plain.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    let plain = until_closed(plain).await.expect("not TLS: closed");
    assert!(!plain.starts_with(b"HTTP/"), "{plain:?}");
}

#[test]
fn the_open_files_limit_is_read_where_linux_tells_it() {
    if cfg!(target_os = "linux") {
        assert!(open_files_limit().is_some_and(|n| n > 0));
    }
}
