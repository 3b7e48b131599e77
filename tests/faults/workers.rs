//! Workers that come and go: one down at start, one killed mid-stream and restarted, a rank that stays dead, one
//! that answers garbage. The gateway adds, readmits or takes them out by its probes, and its clients see no more
//! than the requests in flight on them fail.

use super::*;

/// A rank that is dead for good (every request to it gets the engine's 503) is re-admitted after each ejection
/// for one request only, and after twice as long each time: over 4 s of steady traffic it costs a handful of
/// errors, where a fixed re-admission period would cost `threshold` errors every period.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_rank_is_readmitted_ever_more_rarely() {
    let engine = Proc::engine(&["--dp-size", "2", "--dead-rank", "1"]);
    let config = config_file(
        "dead-rank",
        "[health]\ninterval_ms = 100\nsuccess_threshold = 1\nbase_ejection_ms = 250\n",
    );
    let gw = gateway(&engine.url, Some(&config), &["--policy", "round_robin"]);
    let c = client();
    let (mut ok, mut failed) = (0, 0);
    let until = Instant::now() + Duration::from_secs(4);
    while Instant::now() < until {
        match post(&c, &format!("{}/generate", gw.url), &[], &generate("turn", false))
            .await
            .status
        {
            StatusCode::OK => ok += 1,
            StatusCode::SERVICE_UNAVAILABLE => failed += 1,
            other => panic!("unexpected status {other}"),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Three to eject it, then one per re-admission at 0.25, 0.75, 1.75 and 3.75 s: seven; allow a little slack.
    assert!(failed <= 9, "{failed} errors and {ok} answers");
    assert!(ok > 50, "{ok} answers");
    assert_eq!(in_flight(&c, &gw.url).await, 0);
}

/// An SGLang worker that is down when the gateway starts (its rank count unknown) does not stop the start: the
/// gateway serves with the others, and adds its ranks after theirs when it answers, renumbering nobody.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_down_at_start_is_added_when_it_answers() {
    // Held (refusing connections) until the late worker starts, so that no other test's server takes the port.
    let (held, port) = common::hold_port(0);
    let late_url = format!("http://127.0.0.1:{port}");
    let live = Proc::engine(&["--dp-size", "2"]);
    let config = config_file("pending", "[health]\ninterval_ms = 200\n");
    let gw = Proc::start(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--config",
        &config,
        "--worker",
        &late_url,
        "--worker",
        &live.url,
    ]);
    let c = client();
    let ranks_of = |workers: &Value, url: &str| -> Vec<u64> {
        workers["workers"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|w| w["url"] == url)
            .flat_map(|w| w["endpoints"].as_array().unwrap().iter())
            .map(|e| e["rank"].as_u64().unwrap())
            .collect()
    };
    let workers = get(&c, &format!("{}/workers", gw.url)).await.json;
    assert_eq!(workers["pending"], json!([late_url]));
    assert_eq!(ranks_of(&workers, &live.url), vec![0, 1]);
    let reply = post(&c, &format!("{}/generate", gw.url), &[], &generate("early", false)).await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.text);

    let listen = format!("127.0.0.1:{port}");
    drop(held);
    let late = Proc::start(&["mock-engine", "--listen", &listen, "--preset", "zero", "--dp-size", "3"]);
    assert_eq!(late.url, late_url);
    let added = common::eventually(Duration::from_secs(5), || async {
        get(&c, &format!("{}/workers", gw.url)).await.json["pending"] == json!([])
    })
    .await;
    assert!(added, "the late worker was never added");
    let workers = get(&c, &format!("{}/workers", gw.url)).await.json;
    assert_eq!(
        ranks_of(&workers, &live.url),
        vec![0, 1],
        "the live worker keeps its ranks"
    );
    assert_eq!(ranks_of(&workers, &late_url), vec![2, 3, 4]);
    let pinned = post(
        &c,
        &format!("{}/generate", gw.url),
        &[],
        &json!({"text": "late", "routed_dp_rank": 4, "sampling_params": {"max_new_tokens": 1}}),
    )
    .await;
    assert_eq!(pinned.status, StatusCode::OK, "{}", pinned.text);
}

/// A worker killed with streams in flight, then restarted on the same port: its streams end with an explicit
/// error event, requests meanwhile go to the other worker without a client-visible error, and it serves again
/// within a second of its restart (two good probes 200 ms apart).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_stream_and_restarted_is_back_within_a_second() {
    let mut a = Proc::start(&[
        "mock-engine",
        "--listen",
        "127.0.0.1:0",
        "--preset",
        "h100-8b",
        "--dp-size",
        "1",
    ]);
    let b = Proc::engine(&["--dp-size", "1"]);
    let listen = a.url.trim_start_matches("http://").to_string();
    let config = config_file("restart", "[health]\ninterval_ms = 200\n");
    let gw = Proc::start(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--config",
        &config,
        "--policy",
        "round_robin",
        "--worker",
        &a.url,
        "--worker",
        &b.url,
    ]);
    let c = client();
    let url = format!("{}/generate", gw.url);
    let long = json!({"text": "a long answer", "sampling_params": {"max_new_tokens": 400}, "stream": true});
    let streams: Vec<_> = (0..2)
        .map(|_| {
            let (c, url, body) = (c.clone(), url.clone(), long.to_string());
            tokio::spawn(async move { common::read(common::send(&c, &url, &[], body).await).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    a.kill();
    // Until the restart, the port refuses connections, as a dead engine's does, and no other test can take it.
    let (held, _) = common::hold_port(common::port_of(&a.url));
    let mut errors = 0;
    for s in streams {
        let reply = s.await.unwrap();
        if !reply.text.contains("[DONE]") {
            assert!(
                reply.text.contains(r#"data: {"error""#),
                "an explicit error: {:.300}",
                reply.text
            );
            errors += 1;
        }
    }
    assert_eq!(
        errors, 1,
        "the stream on the killed worker ends with an error event, the other completes"
    );
    for i in 0..10 {
        let reply = post(&c, &url, &[], &generate(&format!("meanwhile {i}"), false)).await;
        assert_eq!(
            reply.status,
            StatusCode::OK,
            "request {i} while the worker is down: {}",
            reply.text
        );
    }
    let restarted = Instant::now();
    drop(held);
    let _a = Proc::start(&["mock-engine", "--listen", &listen, "--preset", "zero", "--dp-size", "1"]);
    let back = common::eventually(Duration::from_secs(5), || async {
        let response = common::send(&c, &url, &[], generate("back?", false).to_string()).await;
        response
            .headers()
            .get("x-dprouter-endpoint")
            .is_some_and(|e| e == "w0r0")
    })
    .await;
    assert!(back, "the restarted worker never served again");
    assert!(
        restarted.elapsed() < Duration::from_secs(2),
        "back after {:?}",
        restarted.elapsed()
    );
    assert_eq!(in_flight(&c, &gw.url).await, 0);
}

/// A "worker" that answers garbage instead of HTTP: the first request that meets it gets a 502 (its exchange
/// broke before any answer, which asks for a probe), the probe fails too and confirms it, and every later request
/// goes to the healthy worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_speaking_garbage_is_taken_out_by_one_probe() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let garbage = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let _ = common::read_head(&mut socket).await;
                let _ = socket.write_all(b"HELLO? THIS IS NOT HTTP\r\n\r\n").await;
            });
        }
    });
    let good = Proc::engine(&["--dp-size", "1"]);
    let config = config_file("garbage", "[health]\ninterval_ms = 60000\n");
    let gw = Proc::start(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--config",
        &config,
        "--policy",
        "round_robin",
        "--dp-size",
        "1",
        "--worker",
        &garbage,
        "--worker",
        &good.url,
    ]);
    let c = client();
    let mut failed = 0;
    for i in 0..20 {
        let reply = post(
            &c,
            &format!("{}/generate", gw.url),
            &[],
            &generate(&format!("g{i}"), false),
        )
        .await;
        match reply.status {
            StatusCode::OK => {}
            StatusCode::BAD_GATEWAY => {
                assert!(reply.json["error"]["message"].is_string(), "{}", reply.text);
                failed += 1;
            }
            other => panic!("request {i}: {other} {}", reply.text),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!((1..=2).contains(&failed), "{failed} requests failed");
    assert_eq!(health(&c, &gw.url).await, vec![false, true]);
    assert_eq!(in_flight(&c, &gw.url).await, 0);
}
