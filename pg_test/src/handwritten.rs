//! The outbox an application would write by hand without the extension, the baseline of the
//! delivery benchmark (`bench --anchors`, `bench/bench_anchors.sh`): a plain table, and
//! one process (`src/bin/handwritten_outbox.rs`) that loops: claim a batch with `FOR UPDATE
//! SKIP LOCKED` in a transaction, POST each row's payload, mark the rows sent, commit.
//!
//! No ledger, no attempts table, no effect key: a row that fails is counted and claimed
//! again, up to [`MAX_ATTEMPTS`], then left `failed`.

/// The table and the partial index its claims read.
pub const SCHEMA: &str = "
CREATE SCHEMA IF NOT EXISTS handwritten;
CREATE TABLE IF NOT EXISTS handwritten.outbox (
    id bigserial PRIMARY KEY,
    payload jsonb NOT NULL,
    state text NOT NULL DEFAULT 'pending' CHECK (state IN ('pending', 'sent', 'failed')),
    attempts int NOT NULL DEFAULT 0,
    created_at timestamptz NOT NULL DEFAULT now(),
    sent_at timestamptz,
    last_error text);
CREATE INDEX IF NOT EXISTS outbox_pending ON handwritten.outbox (id) WHERE state = 'pending';
";

/// Rows $1..=$2 of a backlog, the payload the extension's benchmark enqueues.
pub const LOAD: &str = "INSERT INTO handwritten.outbox (payload)
     SELECT jsonb_build_object('n', g, 'text', 'benchmark message') FROM generate_series($1::int8, $2::int8) g";

/// Up to $1 pending rows, oldest first, locked; rows another loop holds are skipped.
pub const CLAIM: &str = "SELECT id, payload::text FROM handwritten.outbox
     WHERE state = 'pending' ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED";

/// The rows $1 were accepted by the provider.
pub const MARK_SENT: &str = "UPDATE handwritten.outbox
     SET state = 'sent', sent_at = now(), attempts = attempts + 1 WHERE id = ANY($1)";

/// The row $1 failed with $2; `failed` after [`MAX_ATTEMPTS`] ($3), else pending again.
pub const MARK_FAILED: &str = "UPDATE handwritten.outbox
     SET attempts = attempts + 1, last_error = $2,
         state = CASE WHEN attempts + 1 >= $3 THEN 'failed' ELSE 'pending' END
     WHERE id = $1";

/// Attempts before a row is left `failed`.
pub const MAX_ATTEMPTS: i32 = 5;

/// The outcome of one POST: the row's id, and the error when the provider did not accept it.
pub type Outcome = (i64, Result<(), String>);

/// The ids accepted, and the failures with their errors.
pub fn partition(outcomes: Vec<Outcome>) -> (Vec<i64>, Vec<(i64, String)>) {
    let mut sent = Vec::new();
    let mut failed = Vec::new();
    for (id, result) in outcomes {
        match result {
            Ok(()) => sent.push(id),
            Err(e) => failed.push((id, e)),
        }
    }
    (sent, failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partition_keeps_the_order_and_the_errors() {
        let (sent, failed) = partition(vec![
            (3, Ok(())),
            (1, Err("503".into())),
            (2, Ok(())),
            (7, Err("timeout".into())),
        ]);
        assert_eq!(sent, vec![3, 2]);
        assert_eq!(
            failed,
            vec![(1, "503".to_string()), (7, "timeout".to_string())]
        );
        assert_eq!(partition(Vec::new()), (Vec::new(), Vec::new()));
    }
}
