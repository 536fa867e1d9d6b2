//! The real cluster the end-to-end tests drive: the one `scripts/cluster.sh` starts, with
//! outbox_delivery preloaded. Tests connect as an application would (a normal client
//! connection), kill real processes and restart the server.
//!
//! The cluster's location comes from the same environment variables as the script
//! (`OUTBOX_BASE`, `OUTBOX_PGPORT`, `OUTBOX_DB`), so several clusters can run side by side.

use postgres::{Client, NoTls};

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

#[derive(Clone)]
pub struct Cluster {
    pub base: PathBuf,
    pub port: u16,
    /// The database (or a comma-separated list of them, the first the one [`Cluster::connect`]
    /// opens).
    pub db: String,
    pub script: PathBuf,
    /// More environment for `scripts/cluster.sh` (`OUTBOX_WORKERS`, `OUTBOX_EXTRA_CONF`).
    pub env: Vec<(String, String)>,
}

impl Default for Cluster {
    fn default() -> Self {
        Self::from_env()
    }
}

/// The port in the environment variable `var`, or `default` when it is unset or no number.
pub fn env_port(var: &str, default: u16) -> u16 {
    std::env::var(var)
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(default)
}

/// Polls `f` every 20 ms until it returns true or `timeout` passes.
pub fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    loop {
        if f() {
            return true;
        }
        if start.elapsed() > timeout {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A name no other test uses (channels, effect keys).
pub fn unique(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!(
        "{prefix}_{:x}_{}",
        nanos & 0xffff_ffff,
        N.fetch_add(1, Ordering::Relaxed)
    )
}

impl Cluster {
    pub fn from_env() -> Cluster {
        let base = std::env::var("OUTBOX_BASE").unwrap_or_else(|_| "/tmp/outbox_delivery".into());
        let port = env_port("OUTBOX_PGPORT", 54815);
        let db = std::env::var("OUTBOX_DB").unwrap_or_else(|_| "outbox".into());
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/cluster.sh");
        Cluster {
            base: PathBuf::from(base),
            port,
            db,
            script,
            env: Vec::new(),
        }
    }

    /// The first database of [`Cluster::db`].
    pub fn first_db(&self) -> &str {
        self.db
            .split(',')
            .map(str::trim)
            .find(|d| !d.is_empty())
            .unwrap_or("postgres")
    }

    pub fn conninfo(&self) -> String {
        self.conninfo_for(self.first_db())
    }

    pub fn conninfo_for(&self, db: &str) -> String {
        format!(
            "host={} port={} user=postgres dbname={db} connect_timeout=5 application_name=outbox_e2e",
            self.base.join("sock").display(),
            self.port,
        )
    }

    /// Connects to `db`, waiting up to 60 s for the server.
    pub fn connect_to(&self, db: &str) -> Client {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match Client::connect(&self.conninfo_for(db), NoTls) {
                Ok(c) => return c,
                Err(e) if Instant::now() >= deadline => {
                    panic!("cannot connect to {db} of {}: {e}", self.base.display())
                }
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    /// Connects, waiting up to 60 s for the server (it may be restarting).
    pub fn connect(&self) -> Client {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match Client::connect(&self.conninfo(), NoTls) {
                Ok(c) => return c,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => panic!(
                    "cannot connect to the test cluster ({}): {e}",
                    self.conninfo()
                ),
            }
        }
    }

    /// Runs `scripts/cluster.sh ARGS` with this cluster's settings.
    pub fn script(&self, args: &[&str]) {
        let status = Command::new("bash")
            .arg(&self.script)
            .args(args)
            .env("OUTBOX_BASE", &self.base)
            .env("OUTBOX_PGPORT", self.port.to_string())
            .env("OUTBOX_DB", &self.db)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(std::process::Stdio::null())
            .status()
            .expect("run scripts/cluster.sh");
        assert!(
            status.success(),
            "scripts/cluster.sh {args:?} failed: {status}"
        );
    }

    /// `pg_ctl stop -m immediate` (a crash: no shutdown checkpoint), then start again.
    pub fn crash_restart(&self) {
        self.script(&["stop", "immediate"]);
        self.script(&["start"]);
    }

    /// PIDs of the running delivery workers, from `pg_stat_activity`.
    pub fn worker_pids(&self, client: &mut Client) -> Vec<i32> {
        client
            .query(
                "SELECT pid FROM pg_stat_activity WHERE backend_type = 'outbox_delivery worker' ORDER BY pid",
                &[],
            )
            .map(|rows| rows.iter().map(|r| r.get::<_, i32>(0)).collect())
            .unwrap_or_default()
    }

    /// Waits until a delivery worker runs and has finished its start; returns its PID.
    pub fn wait_for_worker(&self) -> i32 {
        let mut pid = 0;
        let ok = wait_until(Duration::from_secs(60), || {
            let mut c = match Client::connect(&self.conninfo(), NoTls) {
                Ok(c) => c,
                Err(_) => return false,
            };
            let row = c
                .query_opt(
                    "SELECT pid FROM outbox.worker_status() WHERE pid IS NOT NULL AND state NOT IN ('starting', 'stopped') LIMIT 1",
                    &[],
                )
                .ok()
                .flatten();
            match row {
                Some(r) => {
                    pid = r.get(0);
                    true
                }
                None => false,
            }
        });
        assert!(
            ok,
            "no delivery worker came up within 60 s; see {}",
            self.log_path().display()
        );
        pid
    }

    /// `kill -9` of a worker process. The postmaster treats it as a crash: every backend
    /// is terminated and the server recovers, then the worker starts again.
    pub fn kill_worker(&self, pid: i32) {
        let status = Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status()
            .expect("kill");
        assert!(status.success(), "kill -9 {pid} failed");
    }

    pub fn log_path(&self) -> PathBuf {
        self.base.join("postgres.log")
    }

    /// Size of the server log now, to read what is written after it.
    pub fn log_mark(&self) -> u64 {
        std::fs::metadata(self.log_path())
            .map(|m| m.len())
            .unwrap_or(0)
    }

    /// The server log written since `mark`.
    pub fn log_since(&self, mark: u64) -> String {
        let all = std::fs::read(self.log_path()).unwrap_or_default();
        String::from_utf8_lossy(&all[(mark as usize).min(all.len())..]).into_owned()
    }
}

/// A cluster a test starts for itself beside the suite's (a primary and its standby,
/// several databases): `scripts/cluster.sh` under `base` on `port`, serving `databases` (a
/// comma-separated list, each created with the extension), stopped (immediate) when dropped.
/// Its data directory is kept for inspection until the next start of the same name.
pub struct OwnCluster {
    pub cluster: Cluster,
}

impl std::ops::Deref for OwnCluster {
    type Target = Cluster;
    fn deref(&self) -> &Cluster {
        &self.cluster
    }
}

impl OwnCluster {
    fn new(base: PathBuf, port: u16, databases: &str, workers: u32, extra_conf: &str) -> Self {
        let mut cluster = Cluster::from_env();
        cluster.base = base;
        cluster.port = port;
        cluster.db = databases.to_string();
        cluster.env = vec![
            ("OUTBOX_WORKERS".into(), workers.to_string()),
            ("OUTBOX_EXTRA_CONF".into(), extra_conf.to_string()),
        ];
        OwnCluster { cluster }
    }

    /// A new cluster (its data directory removed first), started.
    pub fn fresh(
        base: PathBuf,
        port: u16,
        databases: &str,
        workers: u32,
        extra_conf: &str,
    ) -> Self {
        let own = Self::new(base, port, databases, workers, extra_conf);
        own.script(&["destroy"]);
        own.script(&["start"]);
        own
    }

    /// As [`OwnCluster::fresh`], with more of `scripts/cluster.sh`'s settings (`env`, e.g.
    /// `OUTBOX_FAKETIME_FILE`).
    pub fn fresh_with(
        base: PathBuf,
        port: u16,
        databases: &str,
        workers: u32,
        extra_conf: &str,
        env: &[(&str, &str)],
    ) -> Self {
        let mut own = Self::new(base, port, databases, workers, extra_conf);
        own.cluster
            .env
            .extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        own.script(&["destroy"]);
        own.script(&["start"]);
        own
    }

    /// A streaming hot standby of `primary` (`pg_basebackup -R`), started, under `base` on
    /// `port`; `name` is its application_name (for `synchronous_standby_names`). Its
    /// settings are the primary's (the extension preloaded, the same databases and workers).
    pub fn standby_of(primary: &Cluster, base: PathBuf, port: u16, name: &str) -> Self {
        let own = Self::new(base, port, &primary.db, 1, "");
        own.script(&["standby", "127.0.0.1", &primary.port.to_string(), name]);
        own
    }

    /// Promotes a standby; returns when it accepts writes.
    pub fn promote(&self) {
        self.script(&["promote"]);
    }

    /// `pg_ctl stop -m immediate`: the server dies as in a crash.
    pub fn kill(&self) {
        self.script(&["stop", "immediate"]);
    }
}

impl Drop for OwnCluster {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(&self.cluster.script)
            .args(["stop", "immediate"])
            .env("OUTBOX_BASE", &self.cluster.base)
            .env("OUTBOX_PGPORT", self.cluster.port.to_string())
            .stdout(std::process::Stdio::null())
            .status();
    }
}

/// The state of a message, read with a fresh connection (survives server restarts).
pub fn state_of(cluster: &Cluster, id: i64) -> Option<String> {
    let mut c = cluster.connect();
    c.query_opt("SELECT outbox.status($1)::text", &[&id])
        .ok()
        .flatten()
        .and_then(|r| r.get::<_, Option<String>>(0))
}

/// Waits until message `id` is in `state`.
pub fn wait_for_state(cluster: &Cluster, id: i64, state: &str, timeout: Duration) -> bool {
    wait_until(timeout, || state_of(cluster, id).as_deref() == Some(state))
}

/// Polls `f` with a connection that is re-opened whenever it breaks (the server may be
/// crash-restarting) until it returns `Some`, or `timeout` passes.
pub fn poll<T>(
    cluster: &Cluster,
    timeout: Duration,
    mut f: impl FnMut(&mut Client) -> Result<Option<T>, postgres::Error>,
) -> Option<T> {
    let deadline = Instant::now() + timeout;
    let mut client: Option<Client> = None;
    loop {
        if client.as_ref().is_none_or(|c| c.is_closed()) {
            client = Client::connect(&cluster.conninfo(), NoTls).ok();
        }
        if let Some(c) = client.as_mut() {
            match f(c) {
                Ok(Some(v)) => return Some(v),
                Ok(None) => {}
                Err(_) => client = None,
            }
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits until all `outbox.workers` delivery workers run and have finished their start; when
/// `old` is given, until none of them is one of those processes (after a crash restart).
/// Returns their PIDs.
pub fn wait_for_workers(cluster: &Cluster, old: &[i32]) -> Vec<i32> {
    poll(cluster, Duration::from_secs(60), |c| {
        let pids = cluster.worker_pids(c);
        let row = c.query_one(
            "SELECT current_setting('outbox.workers')::int8,
                    (SELECT count(*) FROM outbox.worker_status()
                      WHERE pid IS NOT NULL AND state NOT IN ('starting', 'stopped'))",
            &[],
        )?;
        let (configured, ready): (i64, i64) = (row.get(0), row.get(1));
        Ok((pids.len() as i64 == configured
            && ready == configured
            && pids.iter().all(|p| !old.contains(p)))
        .then_some(pids))
    })
    .unwrap_or_else(|| {
        panic!(
            "the delivery workers did not come up (again) within 60 s; see {}",
            cluster.log_path().display()
        )
    })
}
