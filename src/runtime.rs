//! The worker's tokio runtime for HTTP I/O. Its threads block every signal, so SIGTERM and
//! SIGHUP always reach the worker's main thread, where Postgres' handlers run.

use std::time::Duration;

pub fn block_all_signals() -> libc::sigset_t {
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut previous: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut previous);
        previous
    }
}

pub fn restore_signals(previous: &libc::sigset_t) {
    unsafe {
        libc::pthread_sigmask(libc::SIG_SETMASK, previous, std::ptr::null_mut());
    }
}

/// Builds the worker's runtime (see [`build_with_threads`]).
pub fn build() -> std::io::Result<tokio::runtime::Runtime> {
    build_with_threads(2)
}

/// Builds a runtime of `threads` I/O threads while all signals are blocked, so that every
/// thread it spawns, now or later, inherits a full signal mask; the calling thread's mask is
/// restored.
pub fn build_with_threads(threads: usize) -> std::io::Result<tokio::runtime::Runtime> {
    let previous = block_all_signals();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .max_blocking_threads(2)
        .thread_name("outbox-http")
        .thread_keep_alive(Duration::from_secs(600))
        .on_thread_start(|| {
            block_all_signals();
        })
        .enable_all()
        .build();
    restore_signals(&previous);
    runtime
}
