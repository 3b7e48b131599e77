//! Logs that repeat (accept errors, a fleet of dead endpoints) written at most once per period, each line saying
//! how many it stands for; and messages from other programs cut to a bounded length before they are logged.

use tokio::time::{Duration, Instant};

/// Such logs are written at most this often.
pub const LOG_EVERY: Duration = Duration::from_secs(5);

/// The longest text from another program (an engine's or an API server's answer) written into a log line.
pub const MAX_LOGGED_BYTES: usize = 1024;

/// Logs at most once per [`LOG_EVERY`], counting what it skipped.
#[derive(Debug, Default)]
pub struct Throttled {
    last: Option<Instant>,
    suppressed: u64,
}

impl Throttled {
    pub fn new() -> Self {
        Self::default()
    }

    /// `Some(skipped since the last log)` when it is time to log again.
    pub fn ready(&mut self) -> Option<u64> {
        let now = Instant::now();
        if self.last.is_some_and(|last| now.duration_since(last) < LOG_EVERY) {
            self.suppressed += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.suppressed))
    }
}

/// `text` cut to at most [`MAX_LOGGED_BYTES`] (at a character boundary), saying how much was left out.
pub fn clip(text: &str) -> std::borrow::Cow<'_, str> {
    if text.len() <= MAX_LOGGED_BYTES {
        return text.into();
    }
    let mut end = MAX_LOGGED_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… ({} bytes more)", &text[..end], text.len() - end).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn throttled_logs_once_per_period() {
        let mut log = Throttled::new();
        assert_eq!(log.ready(), Some(0));
        assert_eq!(log.ready(), None);
        assert_eq!(log.ready(), None);
        tokio::time::advance(LOG_EVERY).await;
        assert_eq!(log.ready(), Some(2));
    }

    #[test]
    fn long_messages_are_clipped_at_a_character() {
        assert_eq!(clip("short"), "short");
        let long = "é".repeat(1000); // 2,000 bytes: cut at 1,024
        let clipped = clip(&long);
        assert!(clipped.len() < MAX_LOGGED_BYTES + 40, "{}", clipped.len());
        assert!(clipped.ends_with("(976 bytes more)"), "{clipped}");
    }
}
