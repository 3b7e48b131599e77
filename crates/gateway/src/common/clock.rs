//! The gateway's monotonic clock for the load model's prefill progress ([`dprouter_core::load`]): microseconds
//! since the process first read it. Routing stamps each request with it and the response body stamps the first
//! token, so both sides of [`dprouter_core::load::EndpointLoad::prefill_elapsed_us`] read the same clock.

use std::sync::OnceLock;
use std::time::Instant;

/// Microseconds since the first call in this process.
pub fn now_us() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    u64::try_from(START.get_or_init(Instant::now).elapsed().as_micros()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    #[test]
    fn never_goes_back() {
        let a = super::now_us();
        std::thread::sleep(std::time::Duration::from_millis(2));
        let b = super::now_us();
        assert!(b >= a + 2_000, "{a} then {b}");
    }
}
