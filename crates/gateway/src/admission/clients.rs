//! Who calls ([`crate::config::clients`]): with clients configured, every inference request must carry one's API key
//! (`Authorization: Bearer KEY`, as the OpenAI SDKs send it), is counted against that client's rate limits, may ask
//! only for its models and may pin a rank only if it is allowed to. A key is known by its SHA-256 digest, compared
//! with every client's in constant time (no early exit, so the time says nothing of which client, or how much of a
//! digest, matched). The key is never sent on to an engine: a worker gets its own (`api_key`) or none.
//!
//! Rate limits are GCRA token buckets (`governor`): requests per second with a burst, checked when the request's
//! headers arrive, and prompt tokens per minute, checked once the prompt is read. Over a limit the client gets a 429
//! with `Retry-After`; other clients are not affected.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use axum::http::{header, HeaderMap};
use governor::clock::{Clock, DefaultClock};
use governor::{Quota, RateLimiter};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::common::error::ApiError;
use crate::config::clients::ClientConfig;
use crate::observe::telemetry::{CLIENT_PROMPT_TOKENS, CLIENT_REQUESTS};

/// The `client` label of requests without a known key.
const NO_CLIENT: &str = "(none)";

/// Counts a request of `client` by its outcome.
fn count(client: &str, outcome: &'static str) {
    metrics::counter!(CLIENT_REQUESTS, "client" => client.to_string(), "outcome" => outcome).increment(1);
}

type Bucket = governor::DefaultDirectRateLimiter;

/// One client, as its requests are checked.
pub struct Client {
    pub name: Arc<str>,
    pub priority: i32,
    /// Whether its requests may pin a rank.
    pub allow_pins: bool,
    digest: [u8; 32],
    models: Vec<String>,
    requests: Option<Bucket>,
    tokens: Option<(Bucket, u32)>,
}

/// Every configured client.
#[derive(Default)]
pub struct Clients {
    list: Vec<Arc<Client>>,
}

impl Clients {
    /// The clients of a validated config ([`crate::config::clients::validate_clients`]).
    pub fn new(configs: &[ClientConfig]) -> Self {
        let list = configs
            .iter()
            .filter_map(|c| {
                let digest = c.digest()?;
                let requests = c.requests_per_second.map(|rate| {
                    let period = Duration::from_secs_f64(1.0 / rate);
                    let burst = c
                        .burst
                        .unwrap_or_else(|| rate.ceil().clamp(1.0, u32::MAX as f64) as u32);
                    let quota = Quota::with_period(period)
                        .unwrap_or_else(|| Quota::per_second(NonZeroU32::MAX))
                        .allow_burst(NonZeroU32::new(burst).unwrap_or(NonZeroU32::MIN));
                    RateLimiter::direct(quota)
                });
                let tokens = c
                    .prompt_tokens_per_minute
                    .and_then(NonZeroU32::new)
                    .map(|per_minute| (RateLimiter::direct(Quota::per_minute(per_minute)), per_minute.get()));
                Some(Arc::new(Client {
                    name: Arc::from(c.name.as_str()),
                    priority: c.priority,
                    allow_pins: c.allow_pins,
                    digest,
                    models: c.models.clone(),
                    requests,
                    tokens,
                }))
            })
            .collect();
        Self { list }
    }

    /// Whether no client is configured (then no key is asked for, and a client's `Authorization` goes on to the
    /// engine as it came).
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// The client whose key the request carries, admitted by its requests-per-second limit; `None` when no client
    /// is configured.
    pub fn admit(&self, headers: &HeaderMap) -> Result<Option<Arc<Client>>, ApiError> {
        if self.list.is_empty() {
            return Ok(None);
        }
        let key = client_key(headers).ok_or_else(|| {
            count(NO_CLIENT, "no_key");
            ApiError::NoClientKey("no API key: send it as `Authorization: Bearer KEY` or `x-api-key: KEY`".into())
        })?;
        let digest = Sha256::digest(key.as_bytes());
        let mut found = None;
        for client in &self.list {
            if bool::from(client.digest.ct_eq(digest.as_slice())) {
                found = Some(client);
            }
        }
        let client = found.ok_or_else(|| {
            count(NO_CLIENT, "unknown_key");
            ApiError::NoClientKey("the API key is not one this gateway knows".into())
        })?;
        if let Some(bucket) = &client.requests {
            bucket.check().map_err(|not_until| {
                count(&client.name, "rate_limited");
                let wait = not_until.wait_time_from(DefaultClock::default().now());
                ApiError::RateLimited {
                    message: format!("client `{}` is over its requests_per_second", client.name),
                    retry_after_s: Some(seconds(wait)),
                }
            })?;
        }
        Ok(Some(Arc::clone(client)))
    }
}

impl Client {
    /// Whether it may ask for `model` (as it named it).
    pub fn may_use(&self, model: Option<&str>) -> Result<(), ApiError> {
        if self.models.is_empty() {
            return Ok(());
        }
        if !model.is_some_and(|m| self.models.iter().any(|allowed| allowed == m)) {
            count(&self.name, "model_refused");
        }
        match model {
            Some(m) if self.models.iter().any(|allowed| allowed == m) => Ok(()),
            Some(m) => Err(ApiError::Forbidden(format!(
                "client `{}` may not use the model `{m}`",
                self.name
            ))),
            None => Err(ApiError::Forbidden(format!(
                "client `{}` must name its model (one of {})",
                self.name,
                self.models.join(", ")
            ))),
        }
    }

    /// Counts a request's prompt tokens against its tokens-per-minute limit; admitted, the request is counted.
    pub fn admit_tokens(&self, tokens: u64) -> Result<(), ApiError> {
        let admitted = self.check_tokens(tokens);
        match &admitted {
            Ok(()) => {
                count(&self.name, "admitted");
                metrics::counter!(CLIENT_PROMPT_TOKENS, "client" => self.name.to_string()).increment(tokens);
            }
            Err(_) => count(&self.name, "tokens_limited"),
        }
        admitted
    }

    fn check_tokens(&self, tokens: u64) -> Result<(), ApiError> {
        let Some((bucket, per_minute)) = &self.tokens else {
            return Ok(());
        };
        let Some(n) = u32::try_from(tokens).ok().and_then(NonZeroU32::new) else {
            return if tokens == 0 {
                Ok(())
            } else {
                Err(self.too_large(tokens, *per_minute))
            };
        };
        match bucket.check_n(n) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(not_until)) => Err(ApiError::RateLimited {
                message: format!(
                    "client `{}` is over its prompt_tokens_per_minute ({per_minute}): this request has {tokens}",
                    self.name
                ),
                retry_after_s: Some(seconds(not_until.wait_time_from(DefaultClock::default().now()))),
            }),
            Err(_) => Err(self.too_large(tokens, *per_minute)),
        }
    }

    /// A request larger than a whole minute's tokens: no wait would let it through.
    fn too_large(&self, tokens: u64, per_minute: u32) -> ApiError {
        ApiError::RateLimited {
            message: format!(
                "client `{}`: this request's {tokens} prompt tokens are more than its prompt_tokens_per_minute ({per_minute})",
                self.name
            ),
            retry_after_s: None,
        }
    }
}

/// A wait as `Retry-After` seconds, rounded up (at least 1).
fn seconds(wait: Duration) -> u64 {
    (wait.as_millis().div_ceil(1000) as u64).max(1)
}

/// The client's key: `Authorization: Bearer KEY` (OpenAI's clients), else `x-api-key: KEY` (Anthropic's).
fn client_key(headers: &HeaderMap) -> Option<&str> {
    bearer(headers).or_else(|| {
        let key = headers.get("x-api-key")?.to_str().ok()?.trim();
        (!key.is_empty()).then_some(key)
    })
}

/// The key of `Authorization: Bearer KEY`.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?.trim();
    let (scheme, key) = value.split_once(' ')?;
    let key = key.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !key.is_empty()).then_some(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest_of(key: &str) -> String {
        Sha256::digest(key.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    fn config(name: &str, key: &str) -> ClientConfig {
        ClientConfig {
            name: name.into(),
            key_sha256: digest_of(key),
            ..Default::default()
        }
    }

    fn with_key(key: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::AUTHORIZATION, format!("Bearer {key}").parse().unwrap());
        headers
    }

    #[test]
    fn a_key_names_its_client() {
        let clients = Clients::new(&[config("a", "key-a"), config("b", "key-b")]);
        assert_eq!(&*clients.admit(&with_key("key-b")).unwrap().unwrap().name, "b");
        assert_eq!(&*clients.admit(&with_key("key-a")).unwrap().unwrap().name, "a");
        for headers in [HeaderMap::new(), with_key("key-c"), with_key("")] {
            let err = clients.admit(&headers).err().unwrap();
            assert_eq!(err.status(), 401, "{err}");
        }
        let mut basic = HeaderMap::new();
        basic.insert(header::AUTHORIZATION, "Basic key-a".parse().unwrap());
        assert_eq!(clients.admit(&basic).err().unwrap().status(), 401);
        // No client configured: no key asked for.
        assert!(Clients::default().admit(&HeaderMap::new()).unwrap().is_none());
    }

    #[test]
    fn a_rate_limit_refuses_its_client_and_no_other() {
        let slow = ClientConfig {
            requests_per_second: Some(1.0 / 3600.0),
            burst: Some(2),
            ..config("slow", "key-slow")
        };
        let clients = Clients::new(&[slow, config("free", "key-free")]);
        for _ in 0..2 {
            clients.admit(&with_key("key-slow")).unwrap();
        }
        let refused = clients.admit(&with_key("key-slow")).err().unwrap();
        assert_eq!(refused.status(), 429);
        let after = refused.retry_after().unwrap();
        assert!((3000..=3600).contains(&after), "{after}");
        for _ in 0..100 {
            clients.admit(&with_key("key-free")).unwrap();
        }
    }

    #[test]
    fn prompt_tokens_per_minute_are_counted() {
        let limited = ClientConfig {
            prompt_tokens_per_minute: Some(1000),
            ..config("t", "key-t")
        };
        let clients = Clients::new(&[limited]);
        let client = clients.admit(&with_key("key-t")).unwrap().unwrap();
        client.admit_tokens(600).unwrap();
        client.admit_tokens(0).unwrap();
        let over = client.admit_tokens(600).unwrap_err();
        assert_eq!(over.status(), 429);
        assert!(over.retry_after().is_some_and(|s| (1..=60).contains(&s)), "{over:?}");
        // More than a minute's worth: never, so no Retry-After.
        let never = client.admit_tokens(5000).unwrap_err();
        assert_eq!(never.status(), 429);
        assert_eq!(never.retry_after(), None);
    }

    #[test]
    fn a_clients_models_are_enforced() {
        let picky = ClientConfig {
            models: vec!["small".into()],
            ..config("p", "key-p")
        };
        let clients = Clients::new(&[picky]);
        let client = clients.admit(&with_key("key-p")).unwrap().unwrap();
        client.may_use(Some("small")).unwrap();
        assert_eq!(client.may_use(Some("large")).unwrap_err().status(), 403);
        assert_eq!(client.may_use(None).unwrap_err().status(), 403);
    }

    #[test]
    fn waits_round_up_to_whole_seconds() {
        assert_eq!(seconds(Duration::ZERO), 1);
        assert_eq!(seconds(Duration::from_millis(1)), 1);
        assert_eq!(seconds(Duration::from_secs(2)), 2);
        assert_eq!(seconds(Duration::from_millis(2001)), 3);
    }
}
