//! The listener: `GET /metrics` on `outbox.metrics_address`. It is bound to no database.
//!
//! Its connections are read and written by threads of their own (`connections`); its main
//! thread alone calls PostgreSQL. The main thread sleeps on its latch and on a socket the
//! connection threads ring when a request head is complete, then answers every request
//! waiting: a `GET /metrics` that the token allows is answered by one scrape shared by all
//! such requests waiting at that moment (`scrape`), the others at once. A SIGTERM
//! (`pg_terminate_backend`, a shutdown) ends it with exit code 1, so that the postmaster
//! starts it again after its restart time unless the server is stopping.

use super::connections::{Connections, Request};
use super::exposition::{self, Part, Route};
use super::request::{verdict, Access};
use super::scrape;
use crate::gucs;
use crate::served_database;
use pgrx::bgworkers::{BackgroundWorker, SignalWakeFlags};
use pgrx::pg_sys;
use pgrx::prelude::*;
use std::net::TcpListener;
use std::time::Duration;

/// Longest the main thread sleeps without looking at its signals.
const IDLE_WAIT: Duration = Duration::from_secs(1);

/// Every database's part: a scrape worker is started for each database that can be served
/// now, all at once, then each is waited for, `scrape::SCRAPE_BOUND` at most.
fn scrape_all(number: u32) -> Result<String, String> {
    scrape::remove_leftovers();
    let databases = gucs::databases();
    let started: Vec<_> = databases
        .iter()
        .enumerate()
        .map(|(index, database)| {
            if served_database::can_serve(database) {
                scrape::start(number, index, database)
            } else {
                Err("the database does not exist, or is being dropped".into())
            }
        })
        .collect();
    let parts: Vec<(String, Part)> = databases.into_iter().zip(scrape::finish(started)).collect();
    Ok(exposition::assemble(&parts))
}

/// Sleeps until a request may be waiting, a signal came or `IDLE_WAIT` passed; exits
/// (code 1) on SIGTERM or when the postmaster died.
fn wait(connections: &Connections) {
    let events = unsafe {
        let events = pg_sys::WaitLatchOrSocket(
            pg_sys::MyLatch,
            (pg_sys::WL_LATCH_SET
                | pg_sys::WL_SOCKET_READABLE
                | pg_sys::WL_TIMEOUT
                | pg_sys::WL_POSTMASTER_DEATH) as i32,
            connections.wake_fd(),
            IDLE_WAIT.as_millis() as std::ffi::c_long,
            pg_sys::PG_WAIT_EXTENSION,
        );
        pg_sys::ResetLatch(pg_sys::MyLatch);
        events
    };
    pg_sys::check_for_interrupts!();
    if BackgroundWorker::sigterm_received() || events & pg_sys::WL_POSTMASTER_DEATH as i32 != 0 {
        unsafe { pg_sys::proc_exit(1) };
    }
    if BackgroundWorker::sighup_received() {
        unsafe { pg_sys::ProcessConfigFile(pg_sys::GucContext::PGC_SIGHUP) };
    }
}

/// What `outbox.metrics_token_file` gives now; a change of its trouble is logged once.
struct TokenFile {
    path: String,
    trouble: Option<String>,
}

impl TokenFile {
    fn read(&mut self) -> Access {
        let access = Access::from_file(&self.path, |p| std::fs::read(p));
        let trouble = match &access {
            Access::Broken(why) => Some(why.clone()),
            _ => None,
        };
        if trouble != self.trouble {
            match &trouble {
                Some(why) => log!("outbox_delivery metrics: {why}; GET /metrics answers 503 until it gives a token"),
                None => log!("outbox_delivery metrics: outbox.metrics_token_file gives a token again"),
            }
            self.trouble = trouble;
        }
        access
    }
}

/// Answers the requests waiting now; `scrapes` counts the scrapes run.
fn answer(requests: Vec<Request>, token_file: &mut TokenFile, scrapes: &mut u32) {
    let mut access = None;
    let mut waiting = Vec::new();
    for request in requests {
        let route = exposition::route(&request.head, || {
            let access = access.get_or_insert_with(|| token_file.read());
            verdict(access, request.head.authorization.as_deref())
        });
        match route {
            Route::Answer(status, body) => request.answer(exposition::http_answer(status, &body)),
            Route::Scrape => waiting.push(request),
        }
    }
    if waiting.is_empty() {
        return;
    }
    *scrapes = scrapes.wrapping_add(1);
    let (status, body) = exposition::scraped(scrape_all(*scrapes));
    let bytes = exposition::http_answer(status, &body);
    for request in waiting {
        request.answer(bytes.clone());
    }
}

#[pg_guard]
#[no_mangle]
pub extern "C-unwind" fn outbox_delivery_metrics_main(_arg: pg_sys::Datum) {
    BackgroundWorker::attach_signal_handlers(SignalWakeFlags::SIGHUP | SignalWakeFlags::SIGTERM);
    BackgroundWorker::connect_worker_to_spi(None, None);
    scrape::remove_leftovers();
    let address = gucs::metrics_address();
    let mut token_file = TokenFile {
        path: gucs::metrics_token_file(),
        trouble: None,
    };
    let connections = match TcpListener::bind(address.as_str()).and_then(Connections::start) {
        Ok(c) => c,
        Err(e) => {
            log!("outbox_delivery metrics: cannot listen on {address}: {e}; retrying in 5 s");
            unsafe { pg_sys::proc_exit(1) };
        }
    };
    log!(
        "outbox_delivery metrics: GET http://{address}/metrics serves {}{}",
        gucs::databases()
            .iter()
            .map(|d| format!("{d:?}"))
            .collect::<Vec<_>>()
            .join(", "),
        if token_file.path.is_empty() {
            String::new()
        } else {
            format!(
                " to requests with the bearer token of {:?}",
                token_file.path
            )
        }
    );
    let mut scrapes = 0u32;
    loop {
        wait(&connections);
        let requests = connections.take();
        if !requests.is_empty() {
            answer(requests, &mut token_file, &mut scrapes);
        }
    }
}
