//! The `dprouter` Python package (`crates/python`): its wheel, built from this clone the way `pip install
//! crates/python` builds it (maturin, in its own target directory: the one `cargo test` holds is locked), passes
//! the package's own Python tests (`crates/python/tests`: the API, token id buffers, parity with the core, the
//! vLLM plugin against the vLLM package, the SGLang plugin driving SGLang's real DP controller code), and then a
//! real vLLM with the plugin enabled routes four multi-turn conversations to the ranks that hold them.
//!
//! The Python is the real-vLLM test's (`scripts/vllm_engine.py install`: Python 3.11 with vLLM, numpy and pip),
//! with SGLang's package beside it (`install-sglang`, a folder of its own); the wheel is installed with
//! `--no-deps --target` into `target/python/site`. Only these tests put those folders on `PYTHONPATH`, so the
//! other real-vLLM tests see the venv as it is. Skipped, with a message, only when the package index cannot be
//! reached at all.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Instant;

use common::conversations::{agent_pause, converse_paced, hits, summary};
use common::engines::{sglang_site, vllm_python, VllmEngine};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Runs `command`, failing the test with its output if it fails.
fn run(command: &mut Command, what: &str) -> String {
    let out = command.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{what} failed:\n{text}");
    text
}

/// The Python to test with, the folder the wheel is installed in, and SGLang's; built once per test binary.
struct Package {
    python: PathBuf,
    site: PathBuf,
    sglang: PathBuf,
}

fn package() -> Option<&'static Package> {
    static PACKAGE: OnceLock<Option<Package>> = OnceLock::new();
    PACKAGE
        .get_or_init(|| {
            let python = vllm_python()?;
            let sglang = sglang_site()?;
            let dir = root().join("target/python");
            let (wheels, site) = (dir.join("wheels"), dir.join("site"));
            for d in [&wheels, &site] {
                let _ = std::fs::remove_dir_all(d);
            }
            let started = Instant::now();
            run(
                Command::new(&python)
                    .args(["-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir"])
                    .arg(&wheels)
                    .arg(root().join("crates/python"))
                    .env("CARGO_TARGET_DIR", &dir),
                "building the wheel (pip wheel crates/python)",
            );
            let wheel = std::fs::read_dir(&wheels)
                .unwrap()
                .map(|e| e.unwrap().path())
                .find(|p| p.extension().is_some_and(|e| e == "whl"))
                .expect("a wheel");
            eprintln!("built {} in {:?}", wheel.display(), started.elapsed());
            run(
                Command::new(&python)
                    .args(["-m", "pip", "install", "--no-deps", "--quiet", "--target"])
                    .arg(&site)
                    .arg(&wheel),
                "installing the wheel",
            );
            Some(Package { python, site, sglang })
        })
        .as_ref()
}

#[test]
fn the_packages_own_python_tests_pass() {
    let Some(p) = package() else { return };
    let _one = ONE_AT_A_TIME.blocking_lock();
    let path = std::env::join_paths([&p.site, &p.sglang]).unwrap();
    let out = run(
        Command::new(&p.python)
            .args(["-m", "unittest", "discover", "-v", "-s"])
            .arg(root().join("crates/python/tests"))
            .env("PYTHONPATH", path),
        "the Python package's tests",
    );
    eprintln!("{out}");
    // Every test ran and passed (none skipped: this Python has vLLM, SGLang and numpy).
    assert!(!out.contains("skipped"), "{out}");
    assert!(
        out.contains("\nRan 25 tests") && out.trim_end().ends_with("OK"),
        "{out}"
    );
}

/// The policy the plugin routes with here: `prefix_match` (SGLang's proposal) keys every turn of a conversation on
/// its first 512 tokens, so each turn must go where the conversation's first did, whatever the timing. (`cache_aware`
/// hit 12 of 12 in quiet runs and 10 or 11 of 12 with the machine's CPU shared with the other tests: a turn queued
/// behind another conversation's cold prefill looked dearer than a cold prefill elsewhere: docs/in-engine.md.)
const POLICY: &str = "prefix_match";

/// The Python tests start Pythons of their own: one test at a time, so vLLM's turns do not share the CPU with them.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Inside a real vLLM (`--data-parallel-size 2`, no gateway), the plugin with [`POLICY`] sends each turn of
/// four concurrent conversations to the rank holding the conversation: every turn after the first finds at least
/// the previous prompt's whole blocks cached (vLLM's own balancer, on the same conversations:
/// `tests/real_vllm.rs`, `vllms_own_balancer_on_four_conversations`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_vllm_the_plugin_keeps_four_conversations_on_their_ranks() {
    let _one = ONE_AT_A_TIME.lock().await;
    let Some(p) = tokio::task::spawn_blocking(package).await.unwrap() else {
        return;
    };
    let site = p.site.to_str().unwrap().to_string();
    let engine =
        tokio::task::spawn_blocking(move || VllmEngine::start(&[("PYTHONPATH", &site), ("DPROUTER_POLICY", POLICY)]))
            .await
            .unwrap()
            .unwrap();
    let seen = converse_paced(&engine.url, 4, 4, agent_pause).await;
    let report = format!("{seen:#?}");
    let later: Vec<_> = seen.iter().flat_map(|turns| &turns[1..]).collect();
    let hit: usize = seen.iter().map(|turns| hits(turns)).sum();
    eprintln!(
        "in vLLM, dprouter {POLICY}: {hit} of {} later turns hit; {}",
        later.len(),
        summary(&seen)
    );
    for turns in &seen {
        assert!(turns[0].prompt > 300, "{report}");
        assert_eq!(hits(turns), turns.len() - 1, "{report}");
    }
    assert!(later.iter().all(|t| t.cached * 2 > t.prompt), "{report}");
}
