//! The `max_in_flight` limit on generation requests, and [`WithGuard`], the response body that holds a guard (an
//! in-flight permit, a connection's request mark) until it ends.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use hyper::body::{Body as HttpBody, Frame, SizeHint};
use tokio::sync::Semaphore;

use crate::common::error::ApiError;

/// A response body that holds `G` (a connection's request guard, an in-flight permit) until it ends.
pub struct WithGuard<G> {
    body: Body,
    guard: Option<G>,
}

impl<G> WithGuard<G> {
    pub fn new(body: Body, guard: G) -> Self {
        Self {
            body,
            guard: Some(guard),
        }
    }
}

impl<G: Unpin> HttpBody for WithGuard<G> {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        if matches!(polled, Poll::Ready(None)) {
            self.guard = None;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The `max_in_flight` limit on generation requests (the state of [`limit_in_flight`]).
pub struct InFlightLimit {
    permits: Arc<Semaphore>,
    max: u32,
}

impl InFlightLimit {
    pub fn new(max: u32) -> Arc<Self> {
        Arc::new(Self {
            permits: Arc::new(Semaphore::new(max as usize)),
            max,
        })
    }
}

/// Middleware: a request over the limit is answered 503 with `Retry-After: 1` at once, its body unread; the others
/// hold a permit until their response body ends (or the client goes away).
pub async fn limit_in_flight(State(limit): State<Arc<InFlightLimit>>, request: Request, next: Next) -> Response {
    match Arc::clone(&limit.permits).try_acquire_owned() {
        Ok(permit) => next
            .run(request)
            .await
            .map(|body| Body::new(WithGuard::new(body, permit))),
        Err(_) => {
            let message = format!(
                "the gateway is at its limit of {} requests in flight (server.max_in_flight); retry shortly",
                limit.max
            );
            let mut response = ApiError::Unavailable(message).into_response();
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            response
        }
    }
}
