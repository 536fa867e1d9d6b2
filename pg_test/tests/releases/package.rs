//! The Debian package, installed into the system PostgreSQL 15 with apt-get: it creates the
//! extension in a fresh cluster, delivers, and is removed without leaving a file behind.
//! What a development install (`cargo pgrx install`) put into the system directories is
//! moved aside for the test and put back afterwards, also when the test fails.

use super::*;
use outbox_e2e::releases::system_pg_lock;
use std::path::{Path, PathBuf};
use std::process::Command;

const PACKAGE: &str = "postgresql-15-outbox-delivery";
const SYSTEM_DIRS: [&str; 2] = [
    "/usr/lib/postgresql/15/lib",
    "/usr/share/postgresql/15/extension",
];

/// The extension's files in the system directories.
fn installed_files() -> Vec<PathBuf> {
    SYSTEM_DIRS
        .iter()
        .flat_map(|d| std::fs::read_dir(d).into_iter().flatten().flatten())
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("outbox_delivery"))
        })
        .collect()
}

fn run(cmd: &mut Command) -> (bool, String) {
    let out = cmd
        .env("DEBIAN_FRONTEND", "noninteractive")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn package_installed() -> bool {
    let (ok, text) = run(Command::new("dpkg-query").args(["-W", "-f=${Status}", PACKAGE]));
    ok && text.contains("install ok installed")
}

/// The development install, moved aside while the package is tested; put back when dropped
/// (after removing whatever the package left).
struct DevInstallAside {
    aside: PathBuf,
    moved: Vec<(PathBuf, PathBuf)>,
}

impl DevInstallAside {
    fn take(aside: &Path) -> DevInstallAside {
        let _ = std::fs::remove_dir_all(aside);
        std::fs::create_dir_all(aside).expect("aside directory");
        let moved = installed_files()
            .into_iter()
            .enumerate()
            .map(|(i, from)| {
                let name = from
                    .file_name()
                    .expect("file name")
                    .to_string_lossy()
                    .to_string();
                let to = aside.join(format!("{i}-{name}"));
                std::fs::rename(&from, &to)
                    .unwrap_or_else(|e| panic!("move {} aside: {e}", from.display()));
                (from, to)
            })
            .collect();
        DevInstallAside {
            aside: aside.to_path_buf(),
            moved,
        }
    }
}

impl Drop for DevInstallAside {
    fn drop(&mut self) {
        if package_installed() {
            let (_, text) = run(Command::new("apt-get").args(["remove", "-y", "--purge", PACKAGE]));
            eprintln!("removed the package after a failure:\n{text}");
        }
        for (from, to) in &self.moved {
            let _ = std::fs::remove_file(from);
            if let Err(e) = std::fs::rename(to, from) {
                eprintln!(
                    "could not put {} back from {}: {e}",
                    from.display(),
                    to.display()
                );
            }
        }
        let _ = std::fs::remove_dir(&self.aside);
    }
}

/// What Debian's own extension packages have: lintian finds no error in the package or in
/// its debug symbols' package; the library is stripped and its symbols are in the `-dbgsym`
/// package under its build id; the copyright, the changelog and the operator's documents
/// are in its documentation directory.
fn check_hygiene(deb: &Path) {
    let dbgsym = deb.with_file_name(deb.file_name().unwrap().to_string_lossy().replacen(
        PACKAGE,
        &format!("{PACKAGE}-dbgsym"),
        1,
    ));
    assert!(dbgsym.exists(), "{} is missing", dbgsym.display());
    let (ok, text) = run(Command::new("lintian")
        .args(["--tag-display-limit", "0", "--fail-on", "error"])
        .arg(deb)
        .arg(&dbgsym));
    assert!(ok, "lintian found errors:\n{text}");
    eprintln!("lintian:\n{text}");

    let (ok, listing) = run(Command::new("dpkg-deb").arg("--contents").arg(deb));
    assert!(ok, "{listing}");
    for file in [
        "copyright",
        "changelog.gz",
        "runbook.md.gz",
        "prometheus-rules.yml",
        "grafana-dashboard.json",
        "README.md.gz",
        "RELEASES.md.gz",
    ] {
        let path = format!("./usr/share/doc/{PACKAGE}/{file}");
        assert!(listing.contains(&path), "{path} missing:\n{listing}");
    }
    let tree = current_package()
        .tree
        .join("usr/lib/postgresql/15/lib/outbox_delivery.so");
    let (ok, sections) = run(Command::new("readelf").arg("-S").arg(&tree));
    assert!(ok, "{sections}");
    assert!(!sections.contains(".symtab"), "the library is stripped");
    let (ok, notes) = run(Command::new("readelf").arg("-n").arg(&tree));
    assert!(ok, "{notes}");
    let build_id = notes
        .lines()
        .find_map(|l| l.trim().strip_prefix("Build ID: "))
        .expect("a build id")
        .to_string();
    let (ok, listing) = run(Command::new("dpkg-deb").arg("--contents").arg(&dbgsym));
    assert!(ok, "{listing}");
    let debug = format!(
        "./usr/lib/debug/.build-id/{}/{}.debug",
        &build_id[..2],
        &build_id[2..]
    );
    assert!(listing.contains(&debug), "{debug} missing:\n{listing}");
}

#[test]
fn debian_package_installs_delivers_and_removes_cleanly() {
    let package = current_package();
    let deb = package.deb.to_string_lossy().to_string();
    let deb_name = package
        .deb
        .file_name()
        .unwrap()
        .to_string_lossy()
        .to_string();
    assert_eq!(
        deb_name,
        format!("{PACKAGE}_{}_amd64.deb", library_version())
    );
    let (ok, info) = run(Command::new("dpkg-deb").args(["--info", &deb]));
    assert!(ok, "dpkg-deb --info: {info}");
    assert!(info.contains("Depends: postgresql-15, libc6"), "{info}");
    assert!(
        !info.contains("@localhost"),
        "a maintainer with a real address: {info}"
    );
    check_hygiene(&package.deb);

    let _lock = system_pg_lock();
    let base =
        std::env::var("OUTBOX_RELEASE_BASE").unwrap_or_else(|_| "/tmp/outbox_releases".into());
    let aside = DevInstallAside::take(&Path::new(&base).join("deb-dev-install-aside"));
    assert!(
        installed_files().is_empty(),
        "the system directories hold no outbox_delivery file"
    );
    assert!(
        !package_installed(),
        "{PACKAGE} is not installed before the test"
    );

    let (ok, text) =
        run(Command::new("apt-get").args(["install", "-y", "--no-install-recommends", &deb]));
    assert!(ok, "apt-get install {deb}:\n{text}");
    let (_, listed) = run(Command::new("dpkg").args(["-L", PACKAGE]));
    let mut expected = vec![
        "/usr/lib/postgresql/15/lib/outbox_delivery.so".to_string(),
        "/usr/share/postgresql/15/extension/outbox_delivery.control".to_string(),
        format!(
            "/usr/share/postgresql/15/extension/outbox_delivery--{}.sql",
            library_version()
        ),
    ];
    let sql_dir = outbox_e2e::releases::repo_root().join("sql");
    for e in std::fs::read_dir(&sql_dir).expect("sql/").flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        if name.starts_with("outbox_delivery--") {
            expected.push(format!("/usr/share/postgresql/15/extension/{name}"));
        }
    }
    for file in &expected {
        assert!(
            listed.lines().any(|l| l == file),
            "{file} is not in the package:\n{listed}"
        );
    }

    // A fresh cluster on the system PostgreSQL with the packaged library delivers.
    {
        let rc = ReleaseCluster::fresh("deb", 4, Path::new("/usr/lib/postgresql/15/bin"));
        rc.start();
        let mut c = rc.cluster.connect();
        assert_eq!(extversion(&mut c), library_version());
        rc.cluster.wait_for_worker();
        let sim = Simulator::start();
        create_channel(
            &mut c,
            "pkg",
            &sim.send_url("pkg"),
            r#"{"external_id": "/id"}"#,
        );
        let id = enqueue(&mut c, "pkg", "packaged-delivery");
        wait_for_message_state(&rc.cluster, id, "delivered", SETTLE);
        assert_eq!(sim.stored("pkg").len(), 1, "delivered once");
        rc.stop("fast");
    }

    let (ok, text) = run(Command::new("apt-get").args(["remove", "-y", "--purge", PACKAGE]));
    assert!(ok, "apt-get remove:\n{text}");
    assert!(!package_installed(), "{PACKAGE} is removed");
    assert!(
        installed_files().is_empty(),
        "the package left files: {:?}",
        installed_files()
    );
    drop(aside);
}
