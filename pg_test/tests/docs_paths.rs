//! No document a reader opens holds an absolute path of a machine: the working directory of
//! the machine a figure was measured on, a home directory, or the output directory of a
//! build script. Such a path tells a reader nothing they can use, and says where and by whom
//! a run was made. The documents are the README, BENCHMARKS.md, the benchmark log
//! (`bench/log/*.md`) and `docs/*.md`.
//!
//! Paths a reader is meant to type stay allowed: the throwaway directories the scripts use
//! by default (`/tmp/…`), PostgreSQL's own (`/usr/lib/postgresql/15/bin`), and placeholders
//! (`P`, `$OUTBOX_BASE`).
//!
//! Needs no cluster: `cargo test -p outbox_e2e --release --test docs_paths`.

use std::path::{Path, PathBuf};

/// The top directories where an absolute path of a machine starts (`/<name>/`): a build
/// machine's working tree, the home directories. Named without their slashes, so that this
/// file holds no such path itself.
const MACHINE_ROOTS: &[&str] = &["work", "root", "home"];

/// The directory of cargo's build scripts' output, under a target directory of a machine.
const BUILD_OUTPUT: &str = "target/release/build";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The documents checked, in a stable order.
fn documents() -> Vec<PathBuf> {
    let root = repo();
    let mut files = vec![root.join("README.md"), root.join("BENCHMARKS.md")];
    for dir in ["bench/log", "docs"] {
        let entries = std::fs::read_dir(root.join(dir)).unwrap_or_else(|e| panic!("{dir}: {e}"));
        let mut found: Vec<PathBuf> = entries
            .map(|entry| entry.expect("a directory entry").path())
            .filter(|path| path.extension().is_some_and(|ext| ext == "md"))
            .collect();
        found.sort();
        files.extend(found);
    }
    files
}

/// Does a path that starts at byte `at` of `line` start there, rather than continue a
/// relative path (`scripts/…`), a variable (`$HOME/…`) or a home-relative one (`~/…`)?
fn starts_a_path(line: &str, at: usize) -> bool {
    line[..at]
        .chars()
        .next_back()
        .is_none_or(|c| !(c.is_alphanumeric() || matches!(c, '.' | '_' | '-' | '/' | '~' | '$')))
}

/// The path that starts at byte `at` of `line`, up to the first character that ends it in
/// Markdown text.
fn path_at(line: &str, at: usize) -> &str {
    let rest = &line[at..];
    let end = rest
        .find(|c: char| c.is_whitespace() || matches!(c, '`' | ')' | '"' | '\'' | ',' | ';' | '|'))
        .unwrap_or(rest.len());
    &rest[..end]
}

/// The absolute paths of a machine in `text`: (line number, path).
fn machine_paths(text: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    let roots: Vec<String> = MACHINE_ROOTS.iter().map(|r| format!("/{r}/")).collect();
    for (number, line) in text.lines().enumerate() {
        for root in &roots {
            let mut from = 0;
            while let Some(offset) = line[from..].find(root) {
                let at = from + offset;
                if starts_a_path(line, at) {
                    found.push((number + 1, path_at(line, at).to_string()));
                }
                from = at + root.len();
            }
        }
        let mut from = 0;
        while let Some(offset) = line[from..].find(BUILD_OUTPUT) {
            let at = from + offset;
            found.push((number + 1, path_at(line, at).to_string()));
            from = at + BUILD_OUTPUT.len();
        }
    }
    found
}

fn shown(path: &Path) -> String {
    path.strip_prefix(repo())
        .unwrap_or(path)
        .display()
        .to_string()
}

#[test]
fn no_document_holds_an_absolute_path_of_a_machine() {
    let files = documents();
    for expected in [
        "README.md",
        "BENCHMARKS.md",
        "bench/log/README.md",
        "docs/reference.md",
    ] {
        assert!(
            files.iter().any(|f| f.ends_with(expected)),
            "{expected} is not among the documents checked"
        );
    }
    let mut findings = Vec::new();
    for file in &files {
        let text =
            std::fs::read_to_string(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        for (line, path) in machine_paths(&text) {
            findings.push(format!("{}:{line}: {path}", shown(file)));
        }
    }
    assert!(
        findings.is_empty(),
        "absolute paths of a machine in the documents; write them relative to the repository, \
         or as a placeholder (P, $OUTBOX_BASE):\n{}",
        findings.join("\n")
    );
}

/// `text` with `@w`, `@r` and `@h` written as the machine roots `/work`, `/root` and
/// `/home`: the examples below name no machine path in this file.
fn rooted(text: &str) -> String {
    text.replace("@w", "/work")
        .replace("@r", "/root")
        .replace("@h", "/home")
}

#[test]
fn machine_paths_are_found_and_relative_ones_are_not() {
    let found = |text: &str| -> Vec<String> {
        machine_paths(&rooted(text))
            .into_iter()
            .map(|(_, path)| path)
            .collect()
    };
    assert_eq!(
        found("data in `@w/main/target/x` today"),
        [rooted("@w/main/target/x")]
    );
    assert_eq!(
        found("(@r/.cargo/registry/src)"),
        [rooted("@r/.cargo/registry/src")]
    );
    assert_eq!(found("@h/ci/outbox, and more"), [rooted("@h/ci/outbox")]);
    assert_eq!(
        found("see target/release/build/outbox-1a2b/out"),
        ["target/release/build/outbox-1a2b/out"]
    );
    assert_eq!(found("a\n@w/a and @w/b"), [rooted("@w/a"), rooted("@w/b")]);
    assert!(found("scripts@w/x, ~@w/y, $HOME@w/z").is_empty());
    assert!(found("OUTBOX_BASE=/tmp/outbox_pref P/lib/postgresql/15/bin/pg_config").is_empty());
    assert!(found("/usr/lib/postgresql/15/bin and target/release/bench").is_empty());
    assert_eq!(machine_paths(&rooted("x\ny @h/u"))[0].0, 2);
}
