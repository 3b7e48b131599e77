//! DNS discovery: a name's addresses (a headless Service's, or any name with several A or AAAA records), resolved
//! again every `interval_ms`, each one a worker at the source's port. For fleets without Kubernetes API access.
//!
//! A resolution that fails (no answer, a timeout, no such name) keeps the workers last found, as HAProxy holds its
//! last valid answer: an engine that went away fails its health probes instead, and the next answer that names
//! other addresses replaces them. The resolver is the system's (`getaddrinfo`, through tokio), or any
//! [`Resolve`] (tests inject one).

use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::config::discovery::{DnsSource, Found};

/// A name's addresses.
pub trait Resolve: Send + Sync + 'static {
    fn resolve<'a>(&'a self, name: &'a str) -> Pin<Box<dyn Future<Output = std::io::Result<Vec<IpAddr>>> + Send + 'a>>;
}

/// The system's resolver (`/etc/hosts`, `resolv.conf`), as every other program on the host resolves.
pub struct SystemResolver;

impl Resolve for SystemResolver {
    fn resolve<'a>(&'a self, name: &'a str) -> Pin<Box<dyn Future<Output = std::io::Result<Vec<IpAddr>>> + Send + 'a>> {
        Box::pin(async move { Ok(tokio::net::lookup_host((name, 0)).await?.map(|a| a.ip()).collect()) })
    }
}

/// Resolves `source` every interval until `stop`, sending what it finds to `found`.
pub async fn run(
    source: DnsSource,
    resolver: Arc<dyn Resolve>,
    found: watch::Sender<Option<Found>>,
    mut stop: watch::Receiver<bool>,
) {
    let interval = Duration::from_millis(source.interval_ms);
    let label = source.label();
    let mut failing = false;
    loop {
        let answer = tokio::time::timeout(interval.max(Duration::from_secs(1)), resolver.resolve(&source.name)).await;
        match answer.unwrap_or_else(|_| Err(std::io::Error::other("no answer in time"))) {
            Ok(addresses) if !addresses.is_empty() => {
                failing = false;
                let mut workers = Found::new();
                for ip in addresses {
                    match source.worker.worker(ip, source.port, &Default::default()) {
                        Ok(w) => drop(workers.insert(w.url.clone(), w)),
                        Err(e) => tracing::warn!(source = %label, error = %e, "address skipped"),
                    }
                }
                found.send_if_modified(|f| {
                    let changed = f.as_ref() != Some(&workers);
                    *f = Some(workers);
                    changed
                });
            }
            result => {
                let error = result.err().map_or("no address".to_string(), |e| e.to_string());
                if !failing {
                    tracing::warn!(source = %label, %error, "resolution failed: keeping the workers last found");
                }
                failing = true;
            }
        }
        tokio::select! {
            () = tokio::time::sleep(interval) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;
    use std::sync::Mutex;

    /// Answers from a script, one per resolution; the last one again once the script ends.
    struct Scripted(Mutex<VecDeque<std::io::Result<Vec<IpAddr>>>>);

    impl Resolve for Scripted {
        fn resolve<'a>(
            &'a self,
            name: &'a str,
        ) -> Pin<Box<dyn Future<Output = std::io::Result<Vec<IpAddr>>> + Send + 'a>> {
            assert_eq!(name, "vllm.serving.svc");
            let mut script = self.0.lock().unwrap();
            let answer = if script.len() > 1 {
                script.pop_front().unwrap()
            } else {
                match script.front().unwrap() {
                    Ok(a) => Ok(a.clone()),
                    Err(e) => Err(std::io::Error::new(e.kind(), e.to_string())),
                }
            };
            Box::pin(async move { answer })
        }
    }

    fn ips(list: &[&str]) -> Vec<IpAddr> {
        list.iter().map(|s| s.parse().unwrap()).collect()
    }

    #[tokio::test(start_paused = true)]
    async fn each_resolution_replaces_the_workers_and_a_failure_keeps_them() {
        let script = vec![
            Ok(ips(&["10.0.0.1", "10.0.0.2", "10.0.0.1"])),
            Err(std::io::Error::other("temporary failure in name resolution")),
            Ok(Vec::new()),
            Ok(ips(&["10.0.0.2", "fd00::3"])),
            Ok(ips(&["10.0.0.2", "fd00::3"])),
        ];
        let source = DnsSource {
            name: "vllm.serving.svc".into(),
            port: 8000,
            interval_ms: 1000,
            worker: crate::config::discovery::WorkerTemplate {
                backend: crate::config::worker::Backend::Vllm,
                dp_size: Some(2),
                ..Default::default()
            },
        };
        let (found, mut seen) = watch::channel(None);
        let (stop, stopped) = watch::channel(false);
        let task = tokio::spawn(run(
            source,
            Arc::new(Scripted(Mutex::new(script.into()))),
            found,
            stopped,
        ));
        let mut sets = Vec::new();
        let mut times = Vec::new();
        let start = tokio::time::Instant::now();
        for _ in 0..2 {
            seen.changed().await.unwrap();
            let urls: Vec<String> = seen.borrow_and_update().as_ref().unwrap().keys().cloned().collect();
            sets.push(urls);
            times.push(start.elapsed().as_millis());
        }
        // Unchanged answers send nothing: nothing comes in the next 10 intervals.
        let quiet = tokio::time::timeout(Duration::from_secs(10), seen.changed()).await;
        assert!(quiet.is_err(), "an unchanged answer was sent again");
        assert_eq!(sets[0], ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]);
        // The failure and the empty answer kept the first set; the fourth resolution (3 intervals on) replaced it.
        assert_eq!(sets[1], ["http://10.0.0.2:8000", "http://[fd00::3]:8000"]);
        assert_eq!(times, [0, 3000]);
        let dp_size = seen.borrow().as_ref().unwrap()["http://10.0.0.2:8000"].dp_size;
        assert_eq!(dp_size, Some(2));
        stop.send_replace(true);
        task.await.unwrap();
    }

    #[tokio::test]
    async fn the_system_resolver_finds_localhost() {
        let addresses = SystemResolver.resolve("localhost").await.unwrap();
        assert!(addresses.iter().any(IpAddr::is_loopback), "{addresses:?}");
    }
}
