//! The listener: `GET /metrics` on `outbox.metrics_address`, one request at a time. It is
//! bound to no database; it reads `pg_database` to know which databases can be asked.

use super::exposition::{self, Part};
use super::scrape;
use crate::gucs;
use crate::worker::served_database;
use pgrx::bgworkers::{BackgroundWorker, SignalWakeFlags};
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

/// How long a scraper may take to send its request.
const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest request head read.
const MAX_REQUEST_BYTES: usize = 8192;

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

/// Every database's part: a scrape worker is started for each database that can be served
/// now, all at once, then each is waited for.
fn scrape_all() -> Result<String, String> {
    let databases = gucs::databases();
    let started: Vec<_> = databases
        .iter()
        .enumerate()
        .map(|(index, database)| {
            if served_database::can_serve(database) {
                scrape::start(index, database)
            } else {
                Err("the database does not exist, or is being dropped".into())
            }
        })
        .collect();
    let parts = databases
        .into_iter()
        .zip(started)
        .map(|(database, run)| {
            let part = match run {
                Ok(run) => run.finish(),
                Err(why) => Part::Missing(why),
            };
            (database, part)
        })
        .collect::<Vec<_>>();
    Ok(exposition::assemble(&parts))
}

fn serve(stream: &mut TcpStream) -> std::io::Result<()> {
    let head = read_head(stream)?;
    let (status, body) = exposition::respond(&head, scrape_all);
    let content_type = if status == 200 {
        "text/plain; version=0.0.4; charset=utf-8"
    } else {
        "text/plain; charset=utf-8"
    };
    let answer = format!(
        "HTTP/1.1 {status} {}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        exposition::reason(status),
        body.len()
    );
    stream.write_all(answer.as_bytes())
}

#[pg_guard]
#[no_mangle]
pub extern "C-unwind" fn outbox_delivery_metrics_main(_arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    BackgroundWorker::connect_worker_to_spi(None, None);
    scrape::remove_leftovers();
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
    log!(
        "outbox_delivery metrics: GET http://{address}/metrics serves {}",
        gucs::databases()
            .iter()
            .map(|d| format!("{d:?}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    loop {
        match listener.accept() {
            Ok((mut stream, _)) => {
                let _ = stream.set_nonblocking(false);
                if let Err(e) = serve(&mut stream) {
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
