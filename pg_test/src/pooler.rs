//! PgBouncer (Debian's `pgbouncer`, installed by `scripts/setup.sh`) in front of the test
//! cluster, in `pool_mode = transaction`, on a loopback port of its own
//! (`OUTBOX_PGBOUNCER_PORT`, default 54850). Applications connect to it as they would in
//! production; it connects to the cluster through its socket. It is stopped when dropped.
//!
//! Each pooled database is the cluster's database under another name with a pool of its
//! own size, so that a test chooses how few server connections its clients share.

use crate::cluster::{wait_until, Cluster};
use postgres::{Client, NoTls};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running PgBouncer.
pub struct PgBouncer {
    pub port: u16,
    pub dir: PathBuf,
    child: Child,
}

/// A database as PgBouncer offers it: `alias` names the cluster's database, pooled on at
/// most `pool_size` server connections per user.
pub struct Pool<'a> {
    pub alias: &'a str,
    pub pool_size: u32,
}

impl PgBouncer {
    /// Starts PgBouncer for `cluster`, letting `users` log in (trust, as the cluster does)
    /// to the `pools`. Panics when it does not accept connections within 10 s.
    pub fn start(cluster: &Cluster, users: &[&str], pools: &[Pool<'_>]) -> PgBouncer {
        let port = crate::cluster::env_port("OUTBOX_PGBOUNCER_PORT", 54850);
        let dir = cluster.base.join("pgbouncer");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the PgBouncer directory");
        let config = dir.join("pgbouncer.ini");
        std::fs::write(&config, Self::config(cluster, port, &dir, pools))
            .expect("write pgbouncer.ini");
        let userlist: String = users.iter().map(|u| format!("\"{u}\" \"\"\n")).collect();
        std::fs::write(dir.join("userlist.txt"), userlist).expect("write userlist.txt");
        if running_as_root() {
            // PgBouncer refuses to run as root; it switches to the cluster's user itself.
            let _ = Command::new("chown")
                .args(["-R", "postgres"])
                .arg(&dir)
                .status();
        }
        // The port lies in the kernel's range of ephemeral ports: an outgoing connection that
        // used it as its local port holds it for a minute after it closes (TIME_WAIT), and
        // PgBouncer then exits at once. It is started again until the port is free, as
        // scripts/cluster.sh does for the server.
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let mut command = Command::new("pgbouncer");
            if running_as_root() {
                command.args(["-u", "postgres"]);
            }
            let child = command
                .arg(&config)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start pgbouncer (scripts/setup.sh installs it)");
            let mut bouncer = PgBouncer {
                port,
                dir: dir.clone(),
                child,
            };
            let up = wait_until(Duration::from_secs(10), || {
                std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
                    || bouncer
                        .child
                        .try_wait()
                        .is_ok_and(|exited| exited.is_some())
            }) && std::net::TcpStream::connect(("127.0.0.1", port)).is_ok();
            if up {
                return bouncer;
            }
            let log = std::fs::read_to_string(bouncer.log_path()).unwrap_or_default();
            if log.contains("Address already in use") && Instant::now() < deadline {
                eprintln!("PgBouncer: port {port} is still held by a closed connection; starting again in 2 s");
                drop(bouncer);
                let _ = std::fs::remove_file(dir.join("pgbouncer.log"));
                std::thread::sleep(Duration::from_secs(2));
                continue;
            }
            panic!(
                "PgBouncer did not listen on 127.0.0.1:{port}; see {}",
                bouncer.log_path().display()
            );
        }
    }

    fn config(cluster: &Cluster, port: u16, dir: &std::path::Path, pools: &[Pool<'_>]) -> String {
        let mut ini = String::from("[databases]\n");
        for p in pools {
            let _ = writeln!(
                ini,
                "{} = host={} port={} dbname={} pool_size={}",
                p.alias,
                cluster.base.join("sock").display(),
                cluster.port,
                cluster.db,
                p.pool_size
            );
        }
        let _ = write!(
            ini,
            "[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {dir}/userlist.txt
pool_mode = transaction
max_client_conn = 200
logfile = {dir}/pgbouncer.log
pidfile = {dir}/pgbouncer.pid
ignore_startup_parameters = extra_float_digits
",
            dir = dir.display()
        );
        ini
    }

    /// The connection string of `user` on the pooled database `alias`.
    pub fn dsn(&self, alias: &str, user: &str) -> String {
        format!(
            "host=127.0.0.1 port={} dbname={alias} user={user} connect_timeout=5",
            self.port
        )
    }

    /// A connection of `user` to `alias` through PgBouncer.
    pub fn connect(&self, alias: &str, user: &str) -> Client {
        Client::connect(&self.dsn(alias, user), NoTls)
            .unwrap_or_else(|e| panic!("connect through PgBouncer as {user} to {alias}: {e}"))
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.join("pgbouncer.log")
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        // SIGTERM: immediate shutdown (client connections are closed).
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
    }
}

fn running_as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}
