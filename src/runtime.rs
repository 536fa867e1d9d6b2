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

/// The runtime a worker's sends (and a backend's calls) run on, with `threads` I/O threads.
///
/// With one thread, the default (`outbox.http_threads = 1`), it is tokio's current-thread
/// scheduler driven by a thread of its own: tokio's multi-thread scheduler with a single
/// worker costs each request about a sixth more CPU (each spawn from the backend crosses
/// threads through its injection queue, and its work-stealing bookkeeping runs for nothing),
/// which is parallelism only more threads can use. With more, the multi-thread scheduler.
/// Every thread of either is named `outbox-http` and starts with every signal blocked.
pub struct IoRuntime {
    handle: tokio::runtime::Handle,
    kind: Scheduler,
}

enum Scheduler {
    Threads(#[allow(dead_code)] tokio::runtime::Runtime),
    Driven {
        stop: Option<tokio::sync::oneshot::Sender<()>>,
        driver: Option<std::thread::JoinHandle<()>>,
    },
}

/// The name of every thread of an [`IoRuntime`] (scripts count their CPU by it).
pub const THREAD_NAME: &str = "outbox-http";

impl IoRuntime {
    /// Builds the runtime while all signals are blocked, so that every thread it starts,
    /// now or later, inherits a full signal mask; the calling thread's mask is restored.
    pub fn build(threads: usize) -> std::io::Result<IoRuntime> {
        let previous = block_all_signals();
        let built = if threads <= 1 {
            Self::driven()
        } else {
            Self::threads(threads)
        };
        restore_signals(&previous);
        built
    }

    fn threads(threads: usize) -> std::io::Result<IoRuntime> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .max_blocking_threads(2)
            .thread_name(THREAD_NAME)
            .thread_keep_alive(Duration::from_secs(600))
            .on_thread_start(|| {
                block_all_signals();
            })
            .enable_all()
            .build()?;
        Ok(IoRuntime {
            handle: runtime.handle().clone(),
            kind: Scheduler::Threads(runtime),
        })
    }

    fn driven() -> std::io::Result<IoRuntime> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .max_blocking_threads(2)
            .thread_name(THREAD_NAME)
            .thread_keep_alive(Duration::from_secs(600))
            .on_thread_start(|| {
                block_all_signals();
            })
            .enable_all()
            .build()?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let driver = std::thread::Builder::new()
            .name(THREAD_NAME.into())
            .spawn(move || {
                // Until the runtime is dropped (or its owner is gone); then its tasks are.
                let _ = runtime.block_on(stopped);
            })?;
        Ok(IoRuntime {
            handle,
            kind: Scheduler::Driven {
                stop: Some(stop),
                driver: Some(driver),
            },
        })
    }

    pub fn handle(&self) -> &tokio::runtime::Handle {
        &self.handle
    }

    pub fn spawn<F>(&self, future: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.handle.spawn(future)
    }

    /// Waits on the calling thread for `future`, whose I/O and timers the runtime's own
    /// threads drive.
    pub fn block_on<F: std::future::Future>(&self, future: F) -> F::Output {
        self.handle.block_on(future)
    }
}

impl Drop for IoRuntime {
    fn drop(&mut self) {
        if let Scheduler::Driven { stop, driver } = &mut self.kind {
            if let Some(stop) = stop.take() {
                let _ = stop.send(());
            }
            if let Some(driver) = driver.take() {
                let _ = driver.join();
            }
        }
    }
}

thread_local! {
    /// A backend's own runtime for calls to a destination on demand (`outbox.reconcile`,
    /// reading a stream's configuration): one I/O thread, built on first use.
    static BACKEND_RUNTIME: std::cell::RefCell<Option<IoRuntime>> =
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
            *slot = IoRuntime::build(1).ok();
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

#[cfg(test)]
mod tests {
    use super::*;

    fn thread_names() -> Vec<String> {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .map(|c| c.trim().to_string())
            .collect()
    }

    /// Both schedulers run spawned tasks with timers and sockets, answer `block_on` on the
    /// calling thread, and name their threads for the scripts that count their CPU.
    #[test]
    fn either_scheduler_runs_sends_and_names_its_threads() {
        for threads in [1, 2] {
            let rt = IoRuntime::build(threads).unwrap();
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap();
            let task = rt.spawn(async move {
                tokio::time::sleep(Duration::from_millis(5)).await;
                let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
                stream.peer_addr().unwrap()
            });
            assert_eq!(rt.block_on(task).unwrap(), addr);
            let (tx, rx) = std::sync::mpsc::channel();
            rt.handle().spawn(async move { tx.send(7).unwrap() });
            assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(7));
            assert!(
                thread_names().iter().filter(|n| *n == THREAD_NAME).count() >= threads,
                "{threads} thread(s) named {THREAD_NAME}: {:?}",
                thread_names()
            );
        }
    }

    /// Dropping the one-thread runtime stops its driving thread and drops its tasks.
    #[test]
    fn dropping_the_driven_runtime_ends_its_thread_and_tasks() {
        let rt = IoRuntime::build(1).unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let pending = rt.spawn(async move {
            let _keep = tx;
            std::future::pending::<()>().await
        });
        let thread = match &rt.kind {
            Scheduler::Driven { driver, .. } => driver.as_ref().unwrap().thread().id(),
            Scheduler::Threads(_) => panic!("one thread is the driven scheduler"),
        };
        drop(rt);
        assert_ne!(std::thread::current().id(), thread);
        // The task was dropped with the runtime: its sender is gone.
        assert!(rx.blocking_recv().is_err());
        assert!(pending.is_finished());
    }
}
