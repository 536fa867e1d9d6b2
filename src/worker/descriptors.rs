//! File descriptors: PostgreSQL's own files and the worker's connections to providers
//! share one limit per process.
//!
//! PostgreSQL sizes its file cache at server start from the soft `RLIMIT_NOFILE` (about
//! 1,000 descriptors under a soft limit of 1,024, the usual default) and knows nothing of
//! the sockets the HTTP client opens. A worker that holds a few hundred connections to
//! providers left PostgreSQL without descriptors: every relation file it opened failed
//! with "Too many open files; release and retry", and a drain ran at two thirds of its
//! speed until the idle connections closed. At start the worker therefore raises its soft
//! limit to the hard one, so that its sockets live above PostgreSQL's budget, and warns
//! when the hard limit leaves too little room for them.

use pgrx::pg_sys;

/// A soft limit asked for never exceeds this, whatever the hard limit (it may be
/// unlimited): far more sockets than a worker can use, and few enough for any kernel.
pub const MOST_ASKED: u64 = 1 << 20;

/// Descriptors PostgreSQL keeps outside its file cache (fd.c's NUM_RESERVED_FDS) plus a few
/// for the runtime's own pipes and event queue.
pub const RESERVED: u64 = 16;

/// The soft limit to ask for: the hard limit (at most `MOST_ASKED`), never lower than the
/// current soft limit.
pub fn wanted_soft(soft: u64, hard: u64) -> u64 {
    soft.max(hard.min(MOST_ASKED))
}

/// Descriptors left for provider connections under `soft`, once PostgreSQL has the
/// `postgres_files` its file cache may hold.
pub fn room_for_sockets(soft: u64, postgres_files: u64) -> u64 {
    soft.saturating_sub(postgres_files.saturating_add(RESERVED))
}

/// Raises the soft limit of this process and tells the log what the sockets have;
/// `needed` is how many connections the worker can hold open at once.
pub fn make_room_for_sockets(index: usize, needed: u64) {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return;
    }
    let (soft, hard): (u64, u64) = (limit.rlim_cur, limit.rlim_max);
    let wanted = wanted_soft(soft, hard);
    let mut now = soft;
    if wanted > soft {
        let raised = libc::rlimit {
            rlim_cur: wanted as libc::rlim_t,
            rlim_max: limit.rlim_max,
        };
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            now = wanted;
        }
    }
    let postgres_files = unsafe { pg_sys::max_safe_fds }.max(0) as u64;
    let room = room_for_sockets(now, postgres_files);
    if room < needed {
        pgrx::warning!(
            "outbox_delivery worker {index}: only {room} file descriptors are left for connections to providers (open files limit {now}, hard limit {hard}, PostgreSQL's own files {postgres_files}); the batches in flight and the connections kept for the next may need {needed}. Raise the hard limit of the server (LimitNOFILE in its systemd unit, or ulimit -Hn) or lower outbox.batch_size."
        );
    } else if now > soft {
        pgrx::log!(
            "outbox_delivery worker {index}: open files limit raised from {soft} to {now}, leaving {room} descriptors for connections to providers"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_limit_rises_to_the_hard_limit_and_never_falls() {
        for (soft, hard, want) in [
            (1024, 20_000, 20_000),
            (1024, 1024, 1024),
            (4096, 1024, 4096), // cannot happen; never lowered
            (1024, u64::MAX, MOST_ASKED),
            (1024, MOST_ASKED + 1, MOST_ASKED),
            (2_000_000, u64::MAX, 2_000_000),
            (0, 0, 0),
        ] {
            assert_eq!(wanted_soft(soft, hard), want, "soft {soft}, hard {hard}");
        }
    }

    #[test]
    fn sockets_get_what_postgres_files_leave() {
        assert_eq!(room_for_sockets(20_000, 990), 20_000 - 990 - RESERVED);
        // The usual default: PostgreSQL sized its file cache to take nearly all of it.
        assert_eq!(room_for_sockets(1024, 990), 1024 - 990 - RESERVED);
        assert_eq!(room_for_sockets(1024, 1024), 0);
        assert_eq!(room_for_sockets(0, u64::MAX), 0);
    }
}
