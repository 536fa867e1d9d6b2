//! What a piece of work cost the machine, read from outside the processes that did it: CPU
//! time of processes (`/proc/<pid>/stat`, utime + stime), WAL written
//! (`pg_current_wal_lsn()`) and the growth of the extension's tables
//! (`pg_total_relation_size` of every table of the `outbox` schema, indexes and TOAST
//! included). A [`Snapshot`] before and one after give a [`Cost`].
//!
//! Processes that start and end between the two snapshots (an autovacuum worker) are not
//! counted: the figures are lower bounds for the server as a whole.

use postgres::Client;
use std::path::Path;
use std::time::Instant;

/// Clock ticks per second of `/proc/<pid>/stat` times (USER_HZ: 100 on Linux).
const TICKS_PER_S: f64 = 100.0;

/// utime + stime of a process, in seconds; None when it is gone.
pub fn cpu_seconds(pid: i32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces: the fields after it follow its ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // fields[0] is field 3 (state); utime and stime are fields 14 and 15.
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / TICKS_PER_S)
}

/// The parent of a process.
fn parent_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// The postmaster of a data directory and every process it started (backends, workers,
/// walwriter, checkpointer, autovacuum).
pub fn server_pids(pgdata: &Path) -> Vec<i32> {
    let Some(postmaster) = std::fs::read_to_string(pgdata.join("postmaster.pid"))
        .ok()
        .and_then(|t| t.lines().next().and_then(|l| l.trim().parse::<i32>().ok()))
    else {
        return Vec::new();
    };
    let mut pids = vec![postmaster];
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for entry in dir.flatten() {
            if let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse().ok()) {
                if parent_of(pid) == Some(postmaster) {
                    pids.push(pid);
                }
            }
        }
    }
    pids
}

/// The delivery workers of the database `c` is connected to.
pub fn worker_pids(c: &mut Client) -> Vec<i32> {
    c.query(
        "SELECT pid FROM outbox.worker_status() WHERE pid IS NOT NULL",
        &[],
    )
    .map(|rows| rows.iter().map(|r| r.get::<_, i32>(0)).collect())
    .unwrap_or_default()
}

fn cpu_of(pids: &[i32]) -> f64 {
    pids.iter().filter_map(|p| cpu_seconds(*p)).sum()
}

/// The bytes of every table of the `outbox` schema, with indexes and TOAST.
const OUTBOX_BYTES: &str = "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0)::int8
       FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
      WHERE n.nspname = 'outbox' AND c.relkind = 'r'";

/// The WAL position now, in bytes from the start.
const WAL_BYTES: &str = "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::int8";

/// The counters at one moment.
pub struct Snapshot {
    at: Instant,
    workers: f64,
    server: f64,
    others: f64,
    wal: i64,
    tables: i64,
}

/// What happened between two snapshots.
#[derive(Debug, Clone, Copy, Default)]
pub struct Cost {
    pub seconds: f64,
    /// CPU seconds of the processes of interest (the delivery workers; the backend of an
    /// enqueueing session).
    pub cpu: f64,
    /// CPU seconds of every process of the server (the workers included).
    pub server_cpu: f64,
    /// CPU seconds of the other processes watched (a sink, a bus).
    pub others_cpu: f64,
    pub wal_bytes: i64,
    pub table_bytes: i64,
}

impl Snapshot {
    /// Reads the counters: `workers` (the processes of interest) and `server` are pids of
    /// the cluster, `others` of processes outside it.
    pub fn take(c: &mut Client, workers: &[i32], server: &[i32], others: &[i32]) -> Snapshot {
        let wal = c.query_one(WAL_BYTES, &[]).map(|r| r.get(0)).unwrap_or(0);
        let tables = c
            .query_one(OUTBOX_BYTES, &[])
            .map(|r| r.get(0))
            .unwrap_or(0);
        Snapshot {
            at: Instant::now(),
            workers: cpu_of(workers),
            server: cpu_of(server),
            others: cpu_of(others),
            wal,
            tables,
        }
    }

    /// The cost since `self`, read now.
    pub fn cost(&self, c: &mut Client, workers: &[i32], server: &[i32], others: &[i32]) -> Cost {
        let now = Snapshot::take(c, workers, server, others);
        Cost {
            seconds: now.at.duration_since(self.at).as_secs_f64(),
            cpu: now.workers - self.workers,
            server_cpu: now.server - self.server,
            others_cpu: now.others - self.others,
            wal_bytes: now.wal - self.wal,
            table_bytes: now.tables - self.tables,
        }
    }
}

impl Cost {
    /// Per message of `n`: (CPU µs of the processes of interest, server CPU µs, others' CPU µs, WAL bytes, table bytes).
    pub fn per_message(&self, n: usize) -> [f64; 5] {
        let n = n.max(1) as f64;
        [
            self.cpu * 1e6 / n,
            self.server_cpu * 1e6 / n,
            self.others_cpu * 1e6 / n,
            self.wal_bytes as f64 / n,
            self.table_bytes as f64 / n,
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_cpu_is_read_and_grows() {
        let me = std::process::id() as i32;
        let before = cpu_seconds(me).expect("own stat");
        let mut x = 0u64;
        let start = Instant::now();
        while start.elapsed().as_millis() < 300 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        }
        assert!(x != 42);
        let after = cpu_seconds(me).unwrap();
        assert!(after - before >= 0.1, "{before} -> {after}");
        assert_eq!(cpu_seconds(-1), None);
    }

    #[test]
    fn per_message_divides() {
        let c = Cost {
            seconds: 1.0,
            cpu: 0.5,
            server_cpu: 1.0,
            others_cpu: 0.25,
            wal_bytes: 1000,
            table_bytes: 2000,
        };
        assert_eq!(
            c.per_message(10),
            [50_000.0, 100_000.0, 25_000.0, 100.0, 200.0]
        );
    }
}
