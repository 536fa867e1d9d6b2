//! The listener's connections, served on threads that do socket I/O alone: no PostgreSQL
//! function is called off the listener's main thread.
//!
//! An acceptor thread takes each connection and gives it a thread of its own, at most
//! `MAX_CONNECTIONS` at once: a connection beyond them is answered 503 at once and closed.
//! Each connection has one deadline for the whole request, counted from its accept and
//! never renewed by a byte that arrives: its head must be complete within `HEAD_DEADLINE`
//! (else 408), and its answer written within `REQUEST_DEADLINE` (else 503 if the scrape
//! is not done, or the connection is closed mid-answer). A client that sends a byte now
//! and then therefore holds one connection slot for `HEAD_DEADLINE` at most, and the
//! others are served meanwhile. A complete head is handed to the main thread, which scrapes
//! and hands the answer back; a byte on a socket pair wakes the main thread's wait.

use super::exposition::http_answer;
use super::request::{parse, Head, Parsed, MAX_HEAD_BYTES};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// Connections served at once; more are answered 503 and closed.
pub const MAX_CONNECTIONS: usize = 16;
/// A request's head must be complete this long after its connection was accepted.
pub const HEAD_DEADLINE: Duration = Duration::from_secs(5);
/// A request's answer must be written this long after its connection was accepted.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(30);

/// A complete request head, waiting for the main thread's answer.
pub struct Request {
    pub head: Head,
    answer: mpsc::Sender<Vec<u8>>,
}

impl Request {
    /// Hands the answer's bytes to the connection's thread (which may have given up).
    pub fn answer(self, bytes: Vec<u8>) {
        let _ = self.answer.send(bytes);
    }
}

/// The main thread's end: the requests whose heads are complete.
pub struct Connections {
    requests: mpsc::Receiver<Request>,
    wake: UnixStream,
}

impl Connections {
    /// Starts accepting on `listener`. The threads start with every signal blocked, so
    /// that SIGTERM and SIGHUP reach the main thread alone.
    pub fn start(listener: TcpListener) -> std::io::Result<Connections> {
        listener.set_nonblocking(false)?;
        let (wake, wake_writer) = UnixStream::pair()?;
        wake.set_nonblocking(true)?;
        wake_writer.set_nonblocking(true)?;
        let (sender, requests) = mpsc::channel();
        let previous = crate::runtime::block_all_signals();
        let started = std::thread::Builder::new()
            .name("outbox-metrics-accept".into())
            .spawn(move || accept(listener, sender, Arc::new(wake_writer)));
        crate::runtime::restore_signals(&previous);
        started?;
        Ok(Connections { requests, wake })
    }

    /// The descriptor that is readable when a request is waiting.
    pub fn wake_fd(&self) -> RawFd {
        self.wake.as_raw_fd()
    }

    /// The requests waiting now.
    pub fn take(&self) -> Vec<Request> {
        let mut drain = [0u8; 64];
        while matches!((&self.wake).read(&mut drain), Ok(n) if n > 0) {}
        self.requests.try_iter().collect()
    }
}

/// Counts a connection's thread while it lives.
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn accept(listener: TcpListener, sender: mpsc::Sender<Request>, wake: Arc<UnixStream>) {
    let active = Arc::new(AtomicUsize::new(0));
    loop {
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            // Out of descriptors, say: the connections being served will free some.
            Err(_) => {
                std::thread::sleep(Duration::from_millis(100));
                continue;
            }
        };
        let accepted = Instant::now();
        if active.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
            active.fetch_sub(1, Ordering::SeqCst);
            refuse(stream);
            continue;
        }
        let slot = Slot(active.clone());
        let (sender, wake) = (sender.clone(), wake.clone());
        // A thread that cannot be made drops its slot and its connection.
        let _ = std::thread::Builder::new()
            .name("outbox-metrics-conn".into())
            .spawn(move || {
                let _slot = slot;
                serve(stream, accepted, &sender, &wake);
            });
    }
}

/// A connection beyond the bound: 503 without reading it, if the socket takes it now.
fn refuse(mut stream: TcpStream) {
    let _ = stream.set_nonblocking(true);
    let _ = stream.write_all(&http_answer(
        503,
        &format!("outbox_delivery: more than {MAX_CONNECTIONS} connections at once\n"),
    ));
    let _ = stream.shutdown(std::net::Shutdown::Write);
    // What the client sent already, read so that closing does not reset the connection.
    let mut drain = [0u8; 4096];
    while matches!(stream.read(&mut drain), Ok(n) if n > 0) {}
}

/// How reading a head ended without one.
enum NoHead {
    /// Answer this status, then close.
    Answer(u16),
    /// The client closed or broke the connection.
    Closed,
}

fn serve(
    mut stream: TcpStream,
    accepted: Instant,
    sender: &mpsc::Sender<Request>,
    wake: &UnixStream,
) {
    let answer_by = accepted + REQUEST_DEADLINE;
    let bytes = match read_head(&mut stream, accepted + HEAD_DEADLINE) {
        Err(NoHead::Closed) => return,
        Err(NoHead::Answer(status)) => http_answer(status, &status_text(status)),
        Ok(head) => {
            let (answer, answered) = mpsc::channel();
            if sender.send(Request { head, answer }).is_err() {
                return;
            }
            let _ = (&*wake).write(&[1]);
            let left = answer_by.saturating_duration_since(Instant::now());
            answered.recv_timeout(left).unwrap_or_else(|_| {
                http_answer(
                    503,
                    &format!(
                        "outbox_delivery: the scrape did not finish within {} s\n",
                        REQUEST_DEADLINE.as_secs()
                    ),
                )
            })
        }
    };
    write_by(&mut stream, &bytes, answer_by);
    let _ = stream.shutdown(std::net::Shutdown::Write);
}

fn status_text(status: u16) -> String {
    match status {
        408 => format!(
            "outbox_delivery: the request head did not arrive within {} s\n",
            HEAD_DEADLINE.as_secs()
        ),
        431 => format!("outbox_delivery: a request head is at most {MAX_HEAD_BYTES} bytes\n"),
        _ => "outbox_delivery: not an HTTP/1.1 request\n".to_string(),
    }
}

fn read_head(stream: &mut TcpStream, by: Instant) -> Result<Head, NoHead> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        match parse(&buf) {
            Parsed::Complete(head) => return Ok(head),
            Parsed::Invalid => return Err(NoHead::Answer(400)),
            Parsed::Partial if buf.len() >= MAX_HEAD_BYTES => return Err(NoHead::Answer(431)),
            Parsed::Partial => {}
        }
        let left = by.saturating_duration_since(Instant::now());
        if left.is_zero() || stream.set_read_timeout(Some(left)).is_err() {
            return Err(NoHead::Answer(408));
        }
        match stream.read(&mut chunk) {
            Ok(0) => return Err(NoHead::Closed),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if is_timeout(&e) => return Err(NoHead::Answer(408)),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return Err(NoHead::Closed),
        }
    }
}

/// Writes `bytes` unless `by` passes first (a client that does not read is left).
fn write_by(stream: &mut TcpStream, mut bytes: &[u8], by: Instant) {
    while !bytes.is_empty() {
        let left = by.saturating_duration_since(Instant::now());
        if left.is_zero() || stream.set_write_timeout(Some(left)).is_err() {
            return;
        }
        match stream.write(bytes) {
            Ok(0) => return,
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A listener on a loopback port served by `Connections`, whose requests a thread
    /// answers with `answer` (or never, when it is `None`).
    fn serving(answer: Option<&'static str>) -> (u16, std::thread::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let connections = Connections::start(listener).unwrap();
        let main = std::thread::spawn(move || loop {
            for request in connections.take() {
                if let Some(body) = answer {
                    request.answer(http_answer(200, body));
                } else {
                    std::mem::forget(request);
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        });
        (port, main)
    }

    fn get(port: u16) -> String {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut text = String::new();
        let _ = s.read_to_string(&mut text);
        text
    }

    #[test]
    fn a_client_that_drips_its_head_does_not_hold_the_others() {
        let (port, _main) = serving(Some("x 1\n"));
        let mut drip = TcpStream::connect(("127.0.0.1", port)).unwrap();
        drip.write_all(b"GET /met").unwrap();
        let started = Instant::now();
        let text = get(port);
        assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
        assert!(text.ends_with("\r\n\r\nx 1\n"), "{text}");
        assert!(started.elapsed() < Duration::from_secs(1));
        // The dripping client gets 408 once its head deadline has passed, whatever it sends.
        drip.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
        let mut answer = Vec::new();
        let mut chunk = [0u8; 256];
        while started.elapsed() < Duration::from_secs(15) {
            match drip.read(&mut chunk) {
                Ok(0) => break,
                Ok(n) => answer.extend_from_slice(&chunk[..n]),
                Err(e) if is_timeout(&e) && answer.is_empty() => {
                    let _ = drip.write_all(b"r");
                }
                Err(_) => break,
            }
        }
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 408 "), "{answer:?}");
        let waited = started.elapsed();
        assert!(
            waited < HEAD_DEADLINE + Duration::from_secs(2),
            "{waited:?}"
        );
    }

    #[test]
    fn connections_beyond_the_bound_are_refused_at_once() {
        let (port, _main) = serving(Some("x 1\n"));
        let held: Vec<TcpStream> = (0..MAX_CONNECTIONS)
            .map(|_| TcpStream::connect(("127.0.0.1", port)).unwrap())
            .collect();
        std::thread::sleep(Duration::from_millis(200));
        // Refused without being read: the client reads the answer before it sends.
        let mut refused = TcpStream::connect(("127.0.0.1", port)).unwrap();
        refused
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut text = String::new();
        let _ = refused.read_to_string(&mut text);
        assert!(text.starts_with("HTTP/1.1 503 "), "{text}");
        assert!(text.contains("more than 16 connections"), "{text}");
        drop(held);
        std::thread::sleep(Duration::from_millis(200));
        assert!(get(port).starts_with("HTTP/1.1 200 "));
    }

    #[test]
    fn a_bad_or_overlong_head_is_answered_at_once() {
        let (port, _main) = serving(None);
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.write_all(b"\x16\x03\x01garbage\r\n\r\n").unwrap();
        let mut text = String::new();
        let _ = s.read_to_string(&mut text);
        assert!(text.starts_with("HTTP/1.1 400 "), "{text}");
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.write_all(&vec![b'a'; MAX_HEAD_BYTES]).unwrap();
        let mut text = String::new();
        let _ = s.read_to_string(&mut text);
        assert!(text.starts_with("HTTP/1.1 431 "), "{text}");
    }
}
