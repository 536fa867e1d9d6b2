//! Releases in the tests: the package of this version (`scripts/package.sh`), a released
//! version built from its recorded commit (`scripts/build_release.sh`), private copies of
//! PostgreSQL to install them into (`scripts/pg_prefix.sh`), and clusters on those copies.
//!
//! The clusters of the release tests live under `OUTBOX_RELEASE_BASE` (default
//! `/tmp/outbox_releases`) on ports from `OUTBOX_RELEASE_PGPORT` (default 54841) upwards, so
//! that they run beside the suite's main cluster. Only the Debian package test touches the
//! system PostgreSQL, under [`system_pg_lock`].

use crate::cluster::Cluster;
use crate::schema_dump::{self, Schema};
use postgres::{Client, NoTls};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The lock every writer of the system PostgreSQL 15 directories holds for as long as it
/// needs them (installing there, and the tests that use what it installed).
pub const SYSTEM_PG_LOCK: &str = "/tmp/outbox-system-pg.lock";

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .expect("repository root")
}

/// Runs `scripts/NAME ARGS`; its last line of output (a path). Its messages go to stderr.
pub fn run_script(name: &str, args: &[&str]) -> String {
    let script = repo_root().join("scripts").join(name);
    let out = Command::new("bash")
        .arg(&script)
        .args(args)
        .stderr(std::process::Stdio::inherit())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "scripts/{name} {args:?} failed ({}):\n{stdout}",
        out.status
    );
    stdout.lines().last().unwrap_or_default().trim().to_string()
}

/// The version this tree builds (`Cargo.toml` of the extension).
pub fn library_version() -> String {
    let manifest = std::fs::read_to_string(repo_root().join("Cargo.toml")).expect("Cargo.toml");
    manifest
        .lines()
        .find_map(|l| l.strip_prefix("version = \""))
        .and_then(|v| v.strip_suffix('"'))
        .expect("version in Cargo.toml")
        .to_string()
}

/// The released versions: those whose install script is frozen in `sql/`, oldest first.
pub fn released_versions() -> Vec<String> {
    let mut versions: Vec<String> = std::fs::read_dir(repo_root().join("sql"))
        .expect("sql/")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|n| {
            let v = n.strip_prefix("outbox_delivery--")?.strip_suffix(".sql")?;
            (!v.contains("--")).then(|| v.to_string())
        })
        .collect();
    versions.sort_by_key(|v| {
        v.split('.')
            .map(|p| p.parse::<u64>().unwrap_or(0))
            .collect::<Vec<_>>()
    });
    versions
}

/// The Debian package of this version and its staged tree, built once per test process.
pub struct Package {
    pub deb: PathBuf,
    pub tree: PathBuf,
}

pub fn current_package() -> &'static Package {
    static PACKAGE: OnceLock<Package> = OnceLock::new();
    PACKAGE.get_or_init(|| {
        let deb = PathBuf::from(run_script("package.sh", &[]));
        let tree = deb.parent().expect("package directory").join("tree");
        Package { deb, tree }
    })
}

/// The package tree of released `version`, built from its commit (cached).
pub fn release_tree(version: &str) -> PathBuf {
    PathBuf::from(run_script("build_release.sh", &[version]))
}

fn release_base() -> PathBuf {
    PathBuf::from(
        std::env::var("OUTBOX_RELEASE_BASE").unwrap_or_else(|_| "/tmp/outbox_releases".into()),
    )
}

fn release_port() -> u16 {
    crate::cluster::env_port("OUTBOX_RELEASE_PGPORT", 54841)
}

/// A private copy of PostgreSQL 15 (see `scripts/pg_prefix.sh`).
pub struct Prefix {
    pub dir: PathBuf,
}

impl Prefix {
    /// A fresh copy under the release base, named `name`.
    pub fn create(name: &str) -> Prefix {
        let dir = release_base().join(name).join("pg");
        run_script("pg_prefix.sh", &["create", &dir.to_string_lossy()]);
        Prefix { dir }
    }

    /// Installs a package tree into the copy.
    pub fn install(&self, tree: &Path) {
        run_script(
            "pg_prefix.sh",
            &[
                "install",
                &self.dir.to_string_lossy(),
                &tree.to_string_lossy(),
            ],
        );
    }

    pub fn bindir(&self) -> PathBuf {
        self.dir.join("lib/postgresql/15/bin")
    }
}

/// A cluster of a release test: `scripts/cluster.sh` with the server binaries `pgbin`, one
/// worker serving database `app`, and short leases (a `sending` message left by a crash is
/// recovered 15 s after its claim). Stopped (immediate) when dropped; its data directory is
/// kept for inspection and removed by the next [`ReleaseCluster::fresh`] of the same name.
pub struct ReleaseCluster {
    pub cluster: Cluster,
    pub pgbin: PathBuf,
}

/// The settings of every release cluster beyond `scripts/cluster.sh`'s.
const RELEASE_CONF: &str = "outbox.lease_ms = 15000\nlog_min_messages = log";

impl ReleaseCluster {
    /// A new cluster (its data directory removed first) named `name` on port base + `offset`.
    pub fn fresh(name: &str, offset: u16, pgbin: &Path) -> ReleaseCluster {
        let mut cluster = Cluster::from_env();
        cluster.base = release_base().join(name);
        cluster.port = release_port() + offset;
        cluster.db = "app".into();
        let rc = ReleaseCluster {
            cluster,
            pgbin: pgbin.to_path_buf(),
        };
        rc.script(&["destroy"]);
        rc
    }

    /// Runs `scripts/cluster.sh ARGS` for this cluster.
    pub fn script(&self, args: &[&str]) {
        let status = Command::new("bash")
            .arg(&self.cluster.script)
            .args(args)
            .env("OUTBOX_BASE", &self.cluster.base)
            .env("OUTBOX_PGPORT", self.cluster.port.to_string())
            .env("OUTBOX_DB", &self.cluster.db)
            .env("OUTBOX_PGBIN", &self.pgbin)
            .env("OUTBOX_WORKERS", "1")
            .env("OUTBOX_EXTRA_CONF", RELEASE_CONF)
            .stdout(std::process::Stdio::null())
            .status()
            .expect("run scripts/cluster.sh");
        assert!(
            status.success(),
            "scripts/cluster.sh {args:?} failed for {}: {status}; see {}",
            self.cluster.base.display(),
            self.cluster.log_path().display()
        );
    }

    pub fn start(&self) {
        self.script(&["start"]);
    }

    pub fn stop(&self, mode: &str) {
        self.script(&["stop", mode]);
    }

    pub fn conninfo_for(&self, db: &str) -> String {
        format!(
            "host={} port={} user=postgres dbname={db} connect_timeout=5 application_name=outbox_e2e",
            self.cluster.base.join("sock").display(),
            self.cluster.port
        )
    }

    /// Connects to `db`, waiting up to 60 s for the server.
    pub fn connect_to(&self, db: &str) -> Client {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match Client::connect(&self.conninfo_for(db), NoTls) {
                Ok(c) => return c,
                Err(e) if Instant::now() >= deadline => {
                    panic!(
                        "cannot connect to {db} of {}: {e}",
                        self.cluster.base.display()
                    )
                }
                Err(_) => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    }

    /// The extension's schema in `db` (see [`schema_dump`]).
    pub fn schema(&self, db: &str) -> Schema {
        let dump = schema_dump::binary_upgrade_dump(
            &self.pgbin,
            &self.cluster.base.join("sock"),
            self.cluster.port,
            db,
        );
        let mut c = self.connect_to(db);
        let config: Vec<String> = c
            .query(schema_dump::CONFIG_DUMP, &[])
            .expect("config dump rows")
            .iter()
            .map(|r| r.get(0))
            .collect();
        schema_dump::normalize(&dump, &config)
    }

    /// Runs a server program of this cluster's PostgreSQL (pg_dump, pg_restore) as
    /// `postgres` against it; panics with its output when it fails; returns the output.
    pub fn run_pg(&self, program: &str, args: &[&str]) -> String {
        let out = Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(self.pgbin.join(program))
            .arg("-h")
            .arg(self.cluster.base.join("sock"))
            .args(["-p", &self.cluster.port.to_string()])
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{program} {args:?} failed:\n{text}");
        text
    }
}

impl Drop for ReleaseCluster {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(&self.cluster.script)
            .args(["stop", "immediate"])
            .env("OUTBOX_BASE", &self.cluster.base)
            .env("OUTBOX_PGPORT", self.cluster.port.to_string())
            .env("OUTBOX_PGBIN", &self.pgbin)
            .stdout(std::process::Stdio::null())
            .status();
    }
}

/// Asserts that two schemas are equal, listing the entries only one of them has.
pub fn assert_same_schema(expected: &Schema, expected_name: &str, got: &Schema, got_name: &str) {
    let (only_expected, only_got) = schema_dump::difference(expected, got);
    assert!(
        only_expected.is_empty() && only_got.is_empty(),
        "the schema of {got_name} differs from {expected_name}.\n\
         Only in {expected_name} ({}):\n{}\n\nOnly in {got_name} ({}):\n{}\n\n\
         An upgrade script must turn the last release into what this version installs \
         (RELEASES.md, \"Changing the SQL surface\").",
        only_expected.len(),
        only_expected.join("\n----\n"),
        only_got.len(),
        only_got.join("\n----\n")
    );
}

/// The entities of an install script as pgrx generates it (`/* <begin connected objects> */`
/// blocks), sorted: pgrx orders the entities that do not depend on each other differently
/// from one run to the next, so two generations of the same schema compare equal only so.
pub fn script_entities(sql: &str) -> Vec<String> {
    let mut entities: Vec<String> = sql
        .split("/* <begin connected objects> */")
        .map(|b| b.trim().to_string())
        .filter(|b| !b.is_empty())
        .collect();
    entities.sort();
    entities
}

/// Holds the lock of the system PostgreSQL directories until dropped; `None` when the
/// process that started the tests holds it already (`OUTBOX_SYSTEM_PG_LOCK_HELD=1`, set by
/// `scripts/test.sh`).
pub fn system_pg_lock() -> Option<File> {
    if std::env::var("OUTBOX_SYSTEM_PG_LOCK_HELD").as_deref() == Ok("1") {
        return None;
    }
    let file = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(SYSTEM_PG_LOCK)
        .expect("open the system PostgreSQL lock");
    file.lock().expect("lock the system PostgreSQL directories");
    Some(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn script_entities_ignore_the_order_of_blocks_but_not_their_text() {
        let a = "/* <begin connected objects> */\nCREATE TABLE a();\n/* </end connected objects> */\n\
                 /* <begin connected objects> */\nCREATE TABLE b();\n/* </end connected objects> */\n";
        let b = "/* <begin connected objects> */\nCREATE TABLE b();\n/* </end connected objects> */\n\
                 /* <begin connected objects> */\nCREATE TABLE a();\n/* </end connected objects> */\n";
        assert_eq!(script_entities(a), script_entities(b));
        assert_ne!(
            script_entities(a),
            script_entities(&b.replace("b()", "c()"))
        );
    }
}
