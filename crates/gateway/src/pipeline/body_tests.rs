//! Tests of the guarded response body.
use super::*;
use crate::config::HealthConfig;
use dprouter_core::{dispatch, PolicyConfig, RouteRequest, Snapshot};
use std::collections::VecDeque;
use std::convert::Infallible;

/// An upstream body scripted step by step: `Some(bytes)` is a ready frame, `None` a `Pending` that never
/// wakes anyone (the body under test must not wait on it for long).
struct Scripted(VecDeque<Option<&'static str>>);

impl Body for Scripted {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.0.pop_front() {
            Some(Some(text)) => Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(text.as_bytes()))))),
            Some(None) => Poll::Pending,
            None => Poll::Ready(None),
        }
    }
}

fn body(steps: &[Option<&'static str>], snap: &Snapshot) -> GuardedBody<Scripted> {
    let policy: Arc<dyn Policy> = Arc::from(PolicyConfig::from_name("round_robin").unwrap().build());
    let ticket = dispatch(policy, snap, RouteRequest::text("x")).unwrap();
    let timing = Timing {
        received: Instant::now(),
        first_byte: tokio::time::Instant::now() + Duration::from_secs(60),
        idle: Duration::from_secs(60),
    };
    let registry = Arc::new(Registry::new(HealthConfig::default()));
    GuardedBody::new(
        Scripted(steps.iter().copied().collect()),
        ticket,
        registry,
        true,
        timing,
        Exchange::new(),
    )
}

/// Polls once: `Some(text)` for a data frame, `None` for the end, and `Pending` as `Err(())`.
fn poll(body: &mut GuardedBody<Scripted>) -> Result<Option<String>, ()> {
    let mut cx = Context::from_waker(std::task::Waker::noop());
    match Pin::new(body).poll_frame(&mut cx) {
        Poll::Pending => Err(()),
        Poll::Ready(None) => Ok(None),
        Poll::Ready(Some(frame)) => {
            let data = frame.unwrap().into_data().unwrap();
            Ok(Some(String::from_utf8(data.to_vec()).unwrap()))
        }
    }
}

#[tokio::test]
async fn events_ready_together_go_out_in_one_frame() {
    let snap = Snapshot::single_worker(1);
    let mut b = body(
        &[
            Some("data: 1\n\n"),
            Some("data: 2\n\n"),
            None,
            Some("data: 3\n\n"),
            None,
            None,
            None,
        ],
        &snap,
    );
    assert_eq!(poll(&mut b), Err(()), "a yield: more may be coming");
    // The third event came during the yield; then two more yields find nothing.
    assert_eq!(poll(&mut b), Err(()));
    assert_eq!(poll(&mut b), Err(()));
    assert_eq!(
        poll(&mut b),
        Ok(Some("data: 1\n\ndata: 2\n\ndata: 3\n\n".into())),
        "gathered over a yield"
    );
    assert_eq!(snap.load(0).in_flight_requests(), 1);
    assert_eq!(poll(&mut b), Ok(None));
    assert_eq!(snap.load(0).in_flight_requests(), 0, "the ticket ended with the body");
}

#[tokio::test]
async fn an_event_waits_at_most_two_scheduler_turns() {
    let snap = Snapshot::single_worker(1);
    let mut b = body(&[Some("data: 1\n\n"), None, None, None, None], &snap);
    assert_eq!(poll(&mut b), Err(()));
    assert_eq!(poll(&mut b), Err(()));
    assert_eq!(
        poll(&mut b),
        Ok(Some("data: 1\n\n".into())),
        "out after two yields, not held for more"
    );
    assert_eq!(poll(&mut b), Err(()), "then waiting on the upstream, holding nothing");
}

#[tokio::test]
async fn the_last_events_go_out_with_the_end() {
    let snap = Snapshot::single_worker(1);
    let mut b = body(&[Some("data: 1\n\n"), Some("data: [DONE]\n\n")], &snap);
    assert_eq!(poll(&mut b), Ok(Some("data: 1\n\ndata: [DONE]\n\n".into())));
    assert_eq!(poll(&mut b), Ok(None));
    assert!(b.is_end_stream());
}
