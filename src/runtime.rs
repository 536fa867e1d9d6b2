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

thread_local! {
    /// A backend's own runtime for calls to a destination on demand (`outbox.reconcile`,
    /// reading a stream's configuration): one I/O thread, built on first use.
    static BACKEND_RUNTIME: std::cell::RefCell<Option<tokio::runtime::Runtime>> =
        const { std::cell::RefCell::new(None) };
}

/// How often a backend waiting for a call looks at its interrupts (a cancel, a terminate,
/// `statement_timeout`) and at the call.
const INTERRUPT_CHECK: Duration = Duration::from_millis(10);

/// Ends a call that is still running when the backend stops waiting for it (an error raised
/// by an interrupt unwinds through here).
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Runs `call` from a backend. It runs on the backend's runtime thread, whose signals are
/// blocked (the backend's signals must reach its main thread, where PostgreSQL's handlers
/// run); the backend waits on its latch and checks for interrupts every
/// [`INTERRUPT_CHECK`], so that a cancel, a terminate or `statement_timeout` ends the wait
/// at once. `Err` when there is no runtime or the call ended without an answer.
pub fn wait_in_backend<T: Send + 'static>(
    call: impl std::future::Future<Output = T> + Send + 'static,
) -> Result<T, String> {
    let (answer, mut answered) = tokio::sync::oneshot::channel();
    let spawned = BACKEND_RUNTIME.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            *slot = build_with_threads(1).ok();
        }
        slot.as_ref().map(|rt| {
            rt.spawn(async move {
                let _ = answer.send(call.await);
            })
            .abort_handle()
        })
    });
    let Some(task) = spawned else {
        return Err("no runtime for the call".into());
    };
    let _abort = AbortOnDrop(task);
    loop {
        match answered.try_recv() {
            Ok(result) => return Ok(result),
            Err(tokio::sync::oneshot::error::TryRecvError::Closed) => {
                return Err("the call ended abnormally".into())
            }
            Err(tokio::sync::oneshot::error::TryRecvError::Empty) => {}
        }
        unsafe {
            pgrx::pg_sys::WaitLatch(
                pgrx::pg_sys::MyLatch,
                (pgrx::pg_sys::WL_LATCH_SET
                    | pgrx::pg_sys::WL_TIMEOUT
                    | pgrx::pg_sys::WL_EXIT_ON_PM_DEATH) as i32,
                INTERRUPT_CHECK.as_millis() as std::ffi::c_long,
                pgrx::pg_sys::PG_WAIT_EXTENSION,
            );
            pgrx::pg_sys::ResetLatch(pgrx::pg_sys::MyLatch);
        }
        pgrx::pg_sys::check_for_interrupts!();
    }
}
