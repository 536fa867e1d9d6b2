//! `/metrics` over HTTP: when `outbox.metrics_address` is set (postmaster), a background
//! worker of its own, never a delivery worker, listens there and answers `GET /metrics`
//! with `outbox.prometheus()` of every database served, each sample labelled with its
//! `database`. A scrape runs in this worker's own connection to the database (a background
//! worker, not one of `max_connections`), as `pg_monitor`, one at a time; it takes no time
//! of a delivery worker.

use crate::gucs;
use pgrx::bgworkers::{
    BackgroundWorker, BackgroundWorkerBuilder, BgWorkerStartTime, SignalWakeFlags,
};
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

/// How long a scraper may take to send its request.
const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest request head read.
const MAX_REQUEST_BYTES: usize = 8192;

/// The exposition statement (schema-qualified; runs as `pg_monitor`).
const EXPOSITION: &str = "SELECT outbox.prometheus()";

/// Registers the metrics worker when `outbox.metrics_address` is set.
pub fn register() {
    if !unsafe { pg_sys::process_shared_preload_libraries_in_progress } {
        return;
    }
    if gucs::metrics_address().is_empty() {
        return;
    }
    BackgroundWorkerBuilder::new("outbox_delivery metrics")
        .set_type("outbox_delivery metrics")
        .set_library("outbox_delivery")
        .set_function("outbox_delivery_metrics_main")
        .enable_spi_access()
        .set_start_time(BgWorkerStartTime::RecoveryFinished)
        .set_restart_time(Some(Duration::from_secs(5)))
        .load();
}

/// `exposition` with `database="<db>"` added to every sample's labels; comments as they are.
pub fn with_database_label(exposition: &str, database: &str) -> String {
    let label = format!(
        "database=\"{}\"",
        database
            .replace('\\', "\\\\")
            .replace('"', "\\\"")
            .replace('\n', "\\n")
    );
    let mut out = String::with_capacity(exposition.len() + 64);
    for line in exposition.lines() {
        if line.is_empty() || line.starts_with('#') {
            out.push_str(line);
        } else if let Some(brace) = line.find('{') {
            let rest = &line[brace + 1..];
            out.push_str(&line[..=brace]);
            out.push_str(&label);
            if !rest.starts_with('}') {
                out.push(',');
            }
            out.push_str(rest);
        } else if let Some(space) = line.find(' ') {
            out.push_str(&line[..space]);
            out.push('{');
            out.push_str(&label);
            out.push('}');
            out.push_str(&line[space..]);
        } else {
            out.push_str(line);
        }
        out.push('\n');
    }
    out
}

/// Families already described by an earlier database's exposition lose their HELP and TYPE
/// lines: a family is described once in a scrape.
fn merge(parts: &[String]) -> String {
    let mut seen = std::collections::HashSet::new();
    let mut out = String::new();
    for part in parts {
        for line in part.lines() {
            let mut words = line.split(' ');
            if let (Some("#"), Some(kind @ ("HELP" | "TYPE")), Some(name)) =
                (words.next(), words.next(), words.next())
            {
                if !seen.insert((kind, name.to_string())) {
                    continue;
                }
            }
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// The answer to a request head: status line, content type, body.
pub fn respond(head: &str, exposition: impl FnOnce() -> Result<String, String>) -> (u16, String) {
    let mut first = head.lines().next().unwrap_or("").split(' ');
    let (method, target) = (first.next().unwrap_or(""), first.next().unwrap_or(""));
    let path = target.split('?').next().unwrap_or("");
    match (method, path) {
        ("GET", "/metrics") => match exposition() {
            Ok(text) => (200, text),
            Err(e) => (
                503,
                format!("outbox_delivery: the exposition failed: {e}\n"),
            ),
        },
        (_, "/metrics") => (405, "only GET\n".into()),
        _ => (404, "outbox_delivery: GET /metrics\n".into()),
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        404 => "Not Found",
        405 => "Method Not Allowed",
        _ => "Service Unavailable",
    }
}

fn read_head(stream: &mut TcpStream) -> std::io::Result<String> {
    stream.set_read_timeout(Some(READ_TIMEOUT))?;
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < MAX_REQUEST_BYTES {
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

/// One scrape: the exposition of the database this worker is connected to, labelled.
fn scrape(database: &str) -> Result<String, String> {
    let text = crate::identity::transaction(pg_sys::Oid::from(pg_sys::ROLE_PG_MONITOR), || {
        Spi::get_one::<String>(EXPOSITION)
    })
    .map_err(|e| e.to_string())?
    .unwrap_or_default();
    Ok(merge(&[with_database_label(&text, database)]))
}

fn serve(stream: &mut TcpStream, database: &str) -> std::io::Result<()> {
    let head = read_head(stream)?;
    let (status, body) = respond(&head, || scrape(database));
    let content_type = if status == 200 {
        "text/plain; version=0.0.4; charset=utf-8"
    } else {
        "text/plain; charset=utf-8"
    };
    let answer = format!(
        "HTTP/1.1 {status} {}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        reason(status),
        body.len()
    );
    stream.write_all(answer.as_bytes())
}

#[pg_guard]
#[no_mangle]
pub extern "C-unwind" fn outbox_delivery_metrics_main(_arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    // A background worker connects to one database: the first of `outbox.database`. With
    // several listed, the others' figures are not in this exposition (said in the log).
    let databases = gucs::databases();
    let database = databases
        .first()
        .cloned()
        .unwrap_or_else(|| "postgres".into());
    if databases.len() > 1 {
        log!(
            "outbox_delivery metrics: outbox.database lists {} databases; /metrics serves the first, \"{database}\" (read the others with SELECT outbox.prometheus() in each)",
            databases.len()
        );
    }
    BackgroundWorker::connect_worker_to_spi(Some(&database), None);
    let address = gucs::metrics_address();
    let listener = match TcpListener::bind(address.as_str()) {
        Ok(l) => l,
        Err(e) => {
            log!("outbox_delivery metrics: cannot listen on {address}: {e}; retrying in 5 s");
            return;
        }
    };
    if let Err(e) = listener.set_nonblocking(true) {
        log!("outbox_delivery metrics: {e}");
        return;
    }
    log!("outbox_delivery metrics: GET http://{address}/metrics serves database \"{database}\"");
    loop {
        match listener.accept() {
            Ok((mut stream, _)) => {
                let _ = stream.set_nonblocking(false);
                if let Err(e) = serve(&mut stream, &database) {
                    debug1!("outbox_delivery metrics: a scrape failed: {e}");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if !BackgroundWorker::wait_latch(Some(Duration::from_millis(50))) {
                    break;
                }
            }
            Err(e) => {
                log!("outbox_delivery metrics: accept failed: {e}");
                if !BackgroundWorker::wait_latch(Some(Duration::from_millis(500))) {
                    break;
                }
            }
        }
        if BackgroundWorker::sighup_received() {
            unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_sample_gets_the_database_label() {
        let text = "# HELP outbox_queued Queued.\n# TYPE outbox_queued gauge\noutbox_queued{channel=\"a\"} 3\noutbox_workers 2\nx{} 1\n";
        assert_eq!(
            with_database_label(text, "app\"db"),
            "# HELP outbox_queued Queued.\n# TYPE outbox_queued gauge\noutbox_queued{database=\"app\\\"db\",channel=\"a\"} 3\noutbox_workers{database=\"app\\\"db\"} 2\nx{database=\"app\\\"db\"} 1\n"
        );
    }

    #[test]
    fn families_are_described_once() {
        let a = "# HELP f F.\n# TYPE f gauge\nf{database=\"a\"} 1\n".to_string();
        let b = "# HELP f F.\n# TYPE f gauge\nf{database=\"b\"} 2\n".to_string();
        assert_eq!(
            merge(&[a, b]),
            "# HELP f F.\n# TYPE f gauge\nf{database=\"a\"} 1\nf{database=\"b\"} 2\n"
        );
    }

    #[test]
    fn only_get_metrics_is_served() {
        let ok = || Ok("body".to_string());
        assert_eq!(
            respond("GET /metrics HTTP/1.1\r\n", ok),
            (200, "body".into())
        );
        assert_eq!(respond("GET /metrics?x=1 HTTP/1.1\r\n", ok).0, 200);
        assert_eq!(respond("POST /metrics HTTP/1.1\r\n", ok).0, 405);
        assert_eq!(respond("GET / HTTP/1.1\r\n", ok).0, 404);
        assert_eq!(respond("", ok).0, 404);
        assert_eq!(
            respond("GET /metrics HTTP/1.1\r\n", || Err("down".into())).0,
            503
        );
    }
}
