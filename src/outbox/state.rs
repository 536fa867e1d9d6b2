//! The states of a message (SQL enum `outbox.state`) and who moves a message out of each.

/// Mirrors `outbox.state`. Pure; the worker and tests use these names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    /// Waiting for its first or next attempt at `next_attempt_at`. Moved by: the worker.
    Queued,
    /// Claimed by a worker under a lease. Moved by: the worker; lease expiry → recovery.
    Sending,
    /// Provider confirmed; ledger entry written in the same transaction. Terminal.
    Delivered,
    /// Outcome ambiguous and no safe automatic path. Moved by: reconcile, an operator.
    Uncertain,
    /// Transient errors until the retry budget ran out. Moved by: an operator.
    Exhausted,
    /// Permanent error. Moved by: an operator.
    Failed,
    /// Cancelled by an operator or the application. Terminal.
    Cancelled,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Queued => "queued",
            State::Sending => "sending",
            State::Delivered => "delivered",
            State::Uncertain => "uncertain",
            State::Exhausted => "exhausted",
            State::Failed => "failed",
            State::Cancelled => "cancelled",
        }
    }
}
