//! The process's allocator: mimalloc, told to give memory back to the OS as soon as it is free.
//!
//! mimalloc instead of glibc's malloc: the gateway allocates and frees small buffers on every request, and glibc's
//! allocator took 11% of its CPU at 200 B chat requests (`docs/operations.md`, "Overhead").
//!
//! mimalloc returns freed memory to the OS (`madvise(MADV_DONTNEED)`) only after a delay (`purge_delay`, 1 s), and
//! only when the allocator runs again after it: a gateway that went idle after a burst of large bodies kept the
//! burst's memory (138 MB of a 200 MB peak, 30 s later). With no delay it is returned when it is freed, which also
//! lowers the peak (a buffer outgrown during a request is returned before the next one is filled), at no CPU cost
//! measurable by `dprouter overhead` (`docs/operations.md`, "Memory under large bodies"). An operator's own
//! `MIMALLOC_PURGE_DELAY` is kept.
//!
//! One of the workspace's two places allowed `unsafe` code (`tests/layers.rs` keeps it so; the other reads Python
//! lists in place, `crates/python/src/small_ints.rs`).

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `mi_option_purge_delay` in mimalloc's `mi_option_t` (`mimalloc.h`, the same in its versions 2 and 3; the
/// Rust crate names only the options before it).
const PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Sets the allocator's options; call once, first thing in `main`.
pub fn configure() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
        return;
    }
    // SAFETY: `mi_option_set` stores a value in mimalloc's option table (an atomic store); the option exists in
    // the mimalloc this crate links, and any value is valid for it.
    #[allow(unsafe_code)]
    unsafe {
        libmimalloc_sys::mi_option_set(PURGE_DELAY, 0);
    }
}
