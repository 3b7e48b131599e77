//! The async runtime both front doors (`serve` and `epp`) run on: tokio's multi-threaded runtime, with its
//! blocking pool (where large bodies are parsed and prompts tokenized) sized to the machine's cores and its idle
//! threads ended after [`BLOCKING_KEEP_ALIVE`].
//!
//! Why: that work is CPU-bound, so threads past the cores only add stacks and allocator caches (tokio's default is
//! up to 512 threads, each kept 10 s once idle); and a thread's caches go back to the OS only when it ends. Eight
//! 60 MB bodies at once held 24 MB more than idle 10 s later with the defaults (`tests/body_memory.rs`).

use std::time::Duration;

/// How long an idle blocking thread lives.
pub const BLOCKING_KEEP_ALIVE: Duration = Duration::from_secs(2);

/// Builds the runtime.
pub fn build() -> std::io::Result<tokio::runtime::Runtime> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .max_blocking_threads(cores.max(2))
        .thread_keep_alive(BLOCKING_KEEP_ALIVE)
        .build()
}
