//! The drain deadline as one signal. On shutdown the listener stops accepting and lets the requests in flight
//! finish for `server.drain_timeout_ms`; when that passes it fires this, and every response still streaming ends
//! with an error event (`body.rs`) before its connection closes, so its client can tell a stream cut by the
//! shutdown from one that finished.

use std::future::Future;
use std::pin::Pin;
use std::task::Context;

use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

/// Fired once, when the drain deadline passes (clones share it).
#[derive(Debug, Clone, Default)]
pub struct DrainDeadline(CancellationToken);

impl DrainDeadline {
    /// The deadline passed: streams still open end now.
    pub fn fire(&self) {
        self.0.cancel();
    }

    pub fn passed(&self) -> bool {
        self.0.is_cancelled()
    }

    /// A wait for the deadline, for a body to poll alongside its upstream.
    pub fn wait(&self) -> DeadlineWait {
        DeadlineWait {
            token: self.0.clone(),
            wait: Box::pin(self.0.clone().cancelled_owned()),
        }
    }
}

/// A response body's wait for the deadline.
pub struct DeadlineWait {
    token: CancellationToken,
    wait: Pin<Box<WaitForCancellationFutureOwned>>,
}

impl DeadlineWait {
    /// Whether the deadline passed (one atomic load: cheap enough for every frame).
    pub fn passed(&self) -> bool {
        self.token.is_cancelled()
    }

    /// Whether the deadline passed; if not, `cx` is woken when it does.
    pub fn poll_passed(&mut self, cx: &mut Context<'_>) -> bool {
        self.wait.as_mut().poll(cx).is_ready()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::task::Poll;

    #[tokio::test]
    async fn a_wait_wakes_when_the_deadline_fires() {
        let deadline = DrainDeadline::default();
        let mut wait = deadline.wait();
        assert!(!std::future::poll_fn(|cx| Poll::Ready(wait.poll_passed(cx))).await);
        let firing = deadline.clone();
        tokio::spawn(async move { firing.fire() });
        std::future::poll_fn(|cx| {
            if wait.poll_passed(cx) {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await;
        assert!(deadline.passed());
    }
}
