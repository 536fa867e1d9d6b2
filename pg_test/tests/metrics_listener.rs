//! The `/metrics` listener under hostile or unlucky clients (security review, findings 6
//! and 14, and the scrape's bound of finding 2):
//!
//! - a client that drips its request head a byte at a time, and a crowd of silent
//!   connections, do not keep the listener from answering another scrape;
//! - with `outbox.metrics_token_file` set, `GET /metrics` needs `Authorization: Bearer` with
//!   the file's token (401 without, 503 while the file gives none);
//! - the first scrape after a server start works, and the listener comes back after
//!   `pg_terminate_backend`;
//! - a scrape whose statement is slow ends at the scrape's statement timeout with an error
//!   part for that database.
//!
//! Each test starts a cluster of its own under `OUTBOX_LISTENER_BASE`
//! (`/tmp/outbox_metrics_listener`) on `OUTBOX_LISTENER_PGPORT` (54887), one at a time.
//!
//! Run: `cargo test -p outbox_e2e --release --test metrics_listener -- --test-threads=1`.

use outbox_e2e::cluster::{unique, wait_until, OwnCluster};
use outbox_e2e::helpers::{count, serial};
use postgres::Client;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The listener's connection bound (`src/metrics/connections.rs`).
const MAX_CONNECTIONS: usize = 16;
/// The listener's type in `pg_stat_activity`.
const LISTENER: &str = "outbox_delivery metrics";

/// A free loopback port.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A fresh cluster serving `outbox` with the listener on `metrics_port` and `extra_conf`.
fn cluster(name: &str, metrics_port: u16, extra_conf: &str) -> OwnCluster {
    let base = std::env::var("OUTBOX_LISTENER_BASE")
        .unwrap_or_else(|_| "/tmp/outbox_metrics_listener".into());
    let port = outbox_e2e::cluster::env_port("OUTBOX_LISTENER_PGPORT", 54887);
    OwnCluster::fresh(
        PathBuf::from(base).join(name),
        port,
        "outbox",
        1,
        &format!("outbox.metrics_address = '127.0.0.1:{metrics_port}'\n{extra_conf}"),
    )
}

/// An answer: status, head and body.
struct Answer {
    status: u16,
    head: String,
    body: String,
}

/// `GET /metrics` with `extra` header lines, reading the answer for `within` at most.
fn get_with(port: u16, extra: &str, within: Duration) -> std::io::Result<Answer> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(within))?;
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}Connection: close\r\n\r\n"
    )?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    Ok(Answer {
        status: head
            .split(' ')
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0),
        head: head.to_string(),
        body: body.to_string(),
    })
}

fn get(port: u16) -> std::io::Result<Answer> {
    get_with(port, "", Duration::from_secs(10))
}

/// Waits until `GET /metrics` answers 200 with the database's figures.
fn wait_for_scrapes(port: u16) {
    assert!(
        wait_until(Duration::from_secs(30), || get(port).is_ok_and(|a| a
            .status
            == 200
            && a.body
                .contains("outbox_metrics_database_up{database=\"outbox\"} 1"))),
        "the listener answers"
    );
}

fn listener_pid(c: &mut Client) -> Option<i32> {
    c.query_opt(
        "SELECT pid FROM pg_stat_activity WHERE backend_type = $1",
        &[&LISTENER],
    )
    .unwrap()
    .map(|r| r.get(0))
}

#[test]
fn a_dripping_client_or_a_crowd_of_silent_ones_does_not_blind_the_listener() {
    let _serial = serial();
    let metrics_port = free_port();
    let _cluster = cluster("drip", metrics_port, "");
    wait_for_scrapes(metrics_port);

    // A client that sends its head a byte every 4 s, for 20 s.
    let mut drip = TcpStream::connect(("127.0.0.1", metrics_port)).unwrap();
    drip.write_all(b"GET /metrics HTTP/1.1\r\n").unwrap();
    let dripping = std::thread::spawn(move || {
        for _ in 0..5 {
            std::thread::sleep(Duration::from_secs(4));
            if drip.write_all(b"X").is_err() {
                return "closed by the listener";
            }
        }
        "still open"
    });
    for _ in 0..3 {
        std::thread::sleep(Duration::from_secs(1));
        let started = Instant::now();
        let answer = get(metrics_port).expect("a scrape beside the dripping client");
        let took = started.elapsed();
        assert_eq!(answer.status, 200, "{}", answer.head);
        assert!(
            took < Duration::from_millis(1500),
            "a scrape beside the dripping client took {took:?}"
        );
    }
    assert_eq!(
        dripping.join().unwrap(),
        "closed by the listener",
        "the dripping client is cut at its head deadline"
    );

    // More silent connections than the bound: the one beyond is refused at once, and
    // scrapes come back when the silent ones reach their head deadline.
    let silent: Vec<TcpStream> = (0..MAX_CONNECTIONS + 4)
        .map(|_| TcpStream::connect(("127.0.0.1", metrics_port)).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    // Refused without being read: the client reads the answer before it sends anything.
    let started = Instant::now();
    let mut refused = TcpStream::connect(("127.0.0.1", metrics_port)).unwrap();
    refused
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut text = String::new();
    let _ = refused.read_to_string(&mut text);
    assert!(text.starts_with("HTTP/1.1 503 "), "{text:?}");
    assert!(started.elapsed() < Duration::from_secs(1));
    assert!(
        wait_until(Duration::from_secs(8), || get(metrics_port)
            .is_ok_and(|a| a.status == 200)),
        "scrapes are answered again once the silent connections' deadline passed"
    );
    drop(silent);
}

#[test]
fn a_token_file_makes_get_metrics_ask_for_its_bearer_token() {
    let _serial = serial();
    let metrics_port = free_port();
    let dir = std::env::temp_dir().join(unique("outbox_metrics_token"));
    std::fs::create_dir_all(&dir).unwrap();
    let token_file = dir.join("token");
    std::fs::write(&token_file, "first-s3cret\n").unwrap();
    // The server runs as postgres: the directory is left readable, the file is not shown to
    // anyone but its owner and postgres.
    for path in [&dir, &token_file] {
        let status = std::process::Command::new("chown")
            .arg("postgres")
            .arg(path)
            .status()
            .unwrap();
        assert!(status.success());
    }
    let cluster = cluster(
        "token",
        metrics_port,
        &format!("outbox.metrics_token_file = '{}'", token_file.display()),
    );
    assert!(
        wait_until(Duration::from_secs(30), || get(metrics_port).is_ok()),
        "the listener answers"
    );

    let no_header = get(metrics_port).unwrap();
    assert_eq!(no_header.status, 401, "{}", no_header.head);
    assert!(
        no_header.head.contains("WWW-Authenticate: Bearer"),
        "{}",
        no_header.head
    );
    assert!(
        !no_header.body.contains("outbox_metrics_database_up"),
        "{}",
        no_header.body
    );
    let bearer = |token: &str| format!("Authorization: Bearer {token}\r\n");
    let within = Duration::from_secs(10);
    for wrong in [
        bearer("first-s3cre"),
        bearer("first-s3cret2"),
        bearer("First-s3cret"),
        "Authorization: Basic Zmlyc3QtczNjcmV0\r\n".to_string(),
    ] {
        let answer = get_with(metrics_port, &wrong, within).unwrap();
        assert_eq!(answer.status, 401, "{wrong:?}: {}", answer.head);
    }
    let right = get_with(metrics_port, &bearer("first-s3cret"), within).unwrap();
    assert_eq!(right.status, 200, "{}", right.head);
    assert!(
        right
            .body
            .contains("outbox_metrics_database_up{database=\"outbox\"} 1"),
        "{}",
        right.body
    );

    // A new token takes effect at once; the old one no longer opens.
    std::fs::write(&token_file, "second-s3cret").unwrap();
    assert_eq!(
        get_with(metrics_port, &bearer("first-s3cret"), within)
            .unwrap()
            .status,
        401
    );
    assert_eq!(
        get_with(metrics_port, &bearer("second-s3cret"), within)
            .unwrap()
            .status,
        200
    );

    // No file: closed (503) for everyone, and the log says why, once.
    let mark = cluster.log_mark();
    std::fs::remove_file(&token_file).unwrap();
    for _ in 0..3 {
        let answer = get_with(metrics_port, &bearer("second-s3cret"), within).unwrap();
        assert_eq!(answer.status, 503, "{}", answer.head);
        assert!(!answer.body.contains("outbox_queued"), "{}", answer.body);
    }
    assert_eq!(get(metrics_port).unwrap().status, 503);
    let log = cluster.log_since(mark);
    assert_eq!(
        log.matches("cannot read outbox.metrics_token_file").count(),
        1,
        "{log}"
    );
    std::fs::write(&token_file, "third-s3cret\n").unwrap();
    assert_eq!(
        get_with(metrics_port, &bearer("third-s3cret"), within)
            .unwrap()
            .status,
        200
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_first_scrape_after_a_start_works_and_a_terminated_listener_comes_back() {
    let _serial = serial();
    let metrics_port = free_port();
    let cluster = cluster("first", metrics_port, "");
    let mut c = cluster.connect();
    assert!(
        wait_until(Duration::from_secs(20), || listener_pid(&mut c).is_some()),
        "the listener runs"
    );
    let first_pid = listener_pid(&mut c).unwrap();
    let mark = cluster.log_mark();

    let first = get(metrics_port).expect("the first scrape after the start is answered");
    assert_eq!(first.status, 200, "{}", first.head);
    assert!(
        first
            .body
            .contains("outbox_metrics_database_up{database=\"outbox\"} 1"),
        "{}",
        first.body
    );
    assert_eq!(get(metrics_port).map(|a| a.status).ok(), Some(200));
    assert_eq!(
        listener_pid(&mut c),
        Some(first_pid),
        "the listener lives on after the first scrape:\n{}",
        cluster.log_since(mark)
    );
    let log = cluster.log_since(mark);
    assert!(!log.contains("FATAL"), "{log}");

    // Terminated, it is started again and answers.
    let terminated: bool = c
        .query_one("SELECT pg_terminate_backend($1)", &[&first_pid])
        .unwrap()
        .get(0);
    assert!(terminated);
    assert!(
        wait_until(Duration::from_secs(20), || {
            let _ = c.batch_execute("SELECT pg_stat_clear_snapshot()");
            listener_pid(&mut c).is_some_and(|pid| pid != first_pid)
        }),
        "a new listener after pg_terminate_backend:\n{}",
        cluster.log_since(mark)
    );
    wait_for_scrapes(metrics_port);
}

#[test]
fn a_slow_scrape_ends_at_its_statement_timeout_with_an_error_part() {
    let _serial = serial();
    let metrics_port = free_port();
    let cluster = cluster("slow", metrics_port, "");
    wait_for_scrapes(metrics_port);
    // A scrape statement that would take a minute.
    let mut c = cluster.connect();
    c.batch_execute(
        "CREATE OR REPLACE FUNCTION outbox.prometheus() RETURNS text
         LANGUAGE sql STABLE AS $$ SELECT pg_catalog.pg_sleep(60)::text $$",
    )
    .unwrap();

    let started = Instant::now();
    let answer = get_with(metrics_port, "", Duration::from_secs(45)).expect("an answer");
    let took = started.elapsed();
    assert_eq!(answer.status, 200, "{}", answer.head);
    assert!(
        took < Duration::from_secs(13),
        "the slow scrape took {took:?}"
    );
    assert!(
        answer
            .body
            .contains("outbox_metrics_database_up{database=\"outbox\"} 0"),
        "{}",
        answer.body
    );
    assert!(
        answer
            .body
            .contains("canceling statement due to statement timeout"),
        "{}",
        answer.body
    );
    // No scrape worker is left behind.
    assert!(wait_until(Duration::from_secs(5), || {
        count(
        &mut c,
        "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'outbox_delivery metrics scrape'",
        &[]
    ) == 0
    }));
}
