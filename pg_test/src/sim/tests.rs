//! Everything over real TCP, with a tiny blocking HTTP/1.1 client.

use super::*;
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream as StdStream;

struct Resp {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Resp {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("JSON body")
    }
}

struct Client {
    s: StdStream,
    buf: Vec<u8>,
}

impl Client {
    fn connect(port: u16) -> Client {
        let s = StdStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.set_nodelay(true).unwrap();
        Client { s, buf: Vec::new() }
    }

    fn write(&mut self, raw: &[u8]) {
        self.s.write_all(raw).unwrap();
    }

    fn fill(&mut self) -> io::Result<()> {
        let mut tmp = [0u8; 4096];
        let n = self.s.read(&mut tmp)?;
        if n == 0 {
            return Err(io::Error::new(ErrorKind::UnexpectedEof, "eof"));
        }
        self.buf.extend_from_slice(&tmp[..n]);
        Ok(())
    }

    /// Reads one response (skipping 1xx); errors on EOF/reset/timeout before it is whole.
    fn read_response(&mut self) -> io::Result<Resp> {
        loop {
            let end = loop {
                if let Some(i) = find_head_end(&self.buf, 0) {
                    break i;
                }
                self.fill()?;
            };
            let head = String::from_utf8_lossy(&self.buf[..end]).into_owned();
            let mut lines = head.split("\r\n");
            let status: u16 = lines.next().unwrap()[9..12].parse().unwrap();
            let headers: Vec<(String, String)> = lines
                .map(|l| {
                    let (n, v) = l.split_once(':').unwrap();
                    (n.trim().to_string(), v.trim().to_string())
                })
                .collect();
            self.buf.drain(..end + 4);
            if status < 200 {
                continue;
            }
            let len: usize = headers
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case("content-length"))
                .expect("every response has Content-Length")
                .1
                .parse()
                .unwrap();
            while self.buf.len() < len {
                self.fill()?;
            }
            let body = self.buf.drain(..len).collect();
            return Ok(Resp {
                status,
                headers,
                body,
            });
        }
    }

    fn roundtrip(&mut self, raw: &[u8]) -> Resp {
        self.write(raw);
        self.read_response().unwrap()
    }

    /// True when the server closed the connection (EOF or reset) with nothing more sent.
    fn closed(&mut self) -> bool {
        let mut tmp = [0u8; 64];
        match self.s.read(&mut tmp) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => matches!(
                e.kind(),
                ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted
            ),
        }
    }
}

fn post(channel: &str, body: &str, headers: &[(&str, &str)]) -> Vec<u8> {
    let mut r = format!(
        "POST /ch/{channel} HTTP/1.1\r\nHost: sim\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (n, v) in headers {
        r.push_str(&format!("{n}: {v}\r\n"));
    }
    r.push_str("\r\n");
    r.push_str(body);
    r.into_bytes()
}

fn get(path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: sim\r\n\r\n").into_bytes()
}

fn send_once(sim: &Simulator, channel: &str, body: &str, headers: &[(&str, &str)]) -> Resp {
    Client::connect(sim.port()).roundtrip(&post(channel, body, headers))
}

#[test]
fn accept_stores_and_answers_with_id() {
    let sim = Simulator::start();
    assert_eq!(sim.base_url(), format!("http://127.0.0.1:{}", sim.port()));
    assert_eq!(sim.send_url("a"), format!("{}/ch/a", sim.base_url()));
    let r = send_once(&sim, "a", r#"{"to":"x"}"#, &[("Idempotency-Key", "k-1")]);
    assert_eq!(r.status, 200);
    let v = r.json();
    assert_eq!(v["status"], "accepted");
    let id = v["id"].as_str().unwrap().to_string();
    assert_eq!(id, "msg-a-1");
    assert_eq!(r.header("X-Message-Id"), Some(id.as_str()));

    let stored = sim.stored("a");
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].external_id, id);
    assert_eq!(stored[0].key.as_deref(), Some("k-1"));
    assert_eq!(stored[0].body, br#"{"to":"x"}"#);

    let sends = sim.sends("a");
    assert_eq!(sends.len(), 1);
    let s = &sends[0];
    assert_eq!(
        (s.kind, s.method.as_str(), s.path.as_str()),
        ("send", "POST", "/ch/a")
    );
    assert_eq!(s.outcome, "accepted");
    assert_eq!(s.status, Some(200));
    assert_eq!(s.external_id.as_deref(), Some(id.as_str()));
    assert!(s
        .headers
        .contains(&("idempotency-key".to_string(), "k-1".to_string())));
    assert_eq!(sim.header_values("a", "IDEMPOTENCY-KEY"), vec!["k-1"]);
    assert_eq!(s.body, br#"{"to":"x"}"#);
    let c = sim.counters();
    assert_eq!((c.sends, c.accepted, c.stored), (1, 1, 1));
    assert!(sim.stored("other").is_empty());
}

#[test]
fn key_falls_back_to_x_effect_key() {
    let sim = Simulator::start();
    send_once(&sim, "k", "{}", &[("X-Effect-Key", "e-1")]);
    send_once(&sim, "k", "{}", &[]);
    let keys: Vec<_> = sim.stored("k").into_iter().map(|s| s.key).collect();
    assert_eq!(keys, vec![Some("e-1".to_string()), None]);
}

#[test]
fn keep_alive_serves_many_requests_on_one_connection() {
    let sim = Simulator::start();
    let mut c = Client::connect(sim.port());
    let mut ids = Vec::new();
    for i in 0..3 {
        let r = c.roundtrip(&post("ka", &format!("{{\"n\":{i}}}"), &[]));
        assert_eq!(r.status, 200);
        assert_eq!(r.header("Connection"), None);
        ids.push(r.json()["id"].as_str().unwrap().to_string());
    }
    assert_eq!(ids, vec!["msg-ka-1", "msg-ka-2", "msg-ka-3"]);
    // Pipelined: two requests in one write.
    let mut two = post("ka", "{}", &[]);
    two.extend(post("ka", "{}", &[]));
    c.write(&two);
    assert_eq!(c.read_response().unwrap().status, 200);
    assert_eq!(c.read_response().unwrap().status, 200);
    // Connection: close is honoured.
    let r = c.roundtrip(&post("ka", "{}", &[("Connection", "close")]));
    assert_eq!(r.status, 200);
    assert_eq!(r.header("Connection"), Some("close"));
    assert!(c.closed());
    assert_eq!(sim.counters().connections, 1);
    assert_eq!(sim.stored("ka").len(), 6);
}

#[test]
fn open_connections_count_those_not_yet_closed() {
    let sim = Simulator::start();
    assert_eq!(sim.open_connections(), 0);
    let mut a = Client::connect(sim.port());
    let mut b = Client::connect(sim.port());
    assert_eq!(a.roundtrip(&post("open", "{}", &[])).status, 200);
    assert_eq!(b.roundtrip(&post("open", "{}", &[])).status, 200);
    assert_eq!(sim.open_connections(), 2);
    // Closed by the simulator (Connection: close), then by the client.
    let r = a.roundtrip(&post("open", "{}", &[("Connection", "close")]));
    assert_eq!(r.status, 200);
    assert!(a.closed());
    drop(b);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while sim.open_connections() > 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(sim.open_connections(), 0);
    assert_eq!(sim.counters().connections, 2);
}

#[test]
fn http10_closes_unless_keep_alive() {
    let sim = Simulator::start();
    let mut c = Client::connect(sim.port());
    let r = c.roundtrip(b"POST /ch/h HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}");
    assert_eq!(r.status, 200);
    assert!(c.closed());
    let mut c = Client::connect(sim.port());
    let req = b"POST /ch/h HTTP/1.0\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\n{}";
    let r = c.roundtrip(req);
    assert_eq!(r.header("Connection"), Some("keep-alive"));
    assert_eq!(c.roundtrip(req).status, 200);
}

#[test]
fn chunked_body_is_decoded() {
    let sim = Simulator::start();
    let mut c = Client::connect(sim.port());
    c.write(b"POST /ch/chunk HTTP/1.1\r\nHost: sim\r\nTransfer-Encoding: chunked\r\n\r\n");
    // Sent in awkward pieces, with a chunk extension and a trailer.
    for piece in [
        &b"5\r\nhel"[..],
        b"lo\r\n",
        b"7;ext=1\r\n, world\r",
        b"\n0\r\nX-Trailer: t\r\n",
        b"\r\n",
    ] {
        c.write(piece);
        std::thread::sleep(Duration::from_millis(10));
    }
    let r = c.read_response().unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(sim.stored("chunk")[0].body, b"hello, world");
    // The connection is still usable afterwards.
    let r = c.roundtrip(
        b"POST /ch/chunk HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    );
    assert_eq!(r.status, 200);
    assert_eq!(sim.stored("chunk")[1].body, b"abc");
}

#[test]
fn expect_100_continue() {
    let sim = Simulator::start();
    let mut c = Client::connect(sim.port());
    c.write(b"POST /ch/e HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n");
    while find_head_end(&c.buf, 0).is_none() {
        c.fill().unwrap();
    }
    assert!(c.buf.starts_with(b"HTTP/1.1 100 Continue\r\n\r\n"));
    c.write(b"body");
    assert_eq!(c.read_response().unwrap().status, 200);
    assert_eq!(sim.stored("e")[0].body, b"body");
}

#[test]
fn plan_of_503s_then_default_accept() {
    let sim = Simulator::start();
    sim.set_plan("p", vec![Action::Status(503), Action::Status(503)]);
    let mut c = Client::connect(sim.port());
    let statuses: Vec<u16> = (0..4)
        .map(|_| c.roundtrip(&post("p", "{}", &[])).status)
        .collect();
    assert_eq!(statuses, vec![503, 503, 200, 200]);
    let outcomes: Vec<String> = sim.sends("p").into_iter().map(|r| r.outcome).collect();
    assert_eq!(
        outcomes,
        vec!["status:503", "status:503", "accepted", "accepted"]
    );
    assert_eq!(sim.stored("p").len(), 2);
    assert_eq!(sim.counters().status_errors, 2);

    sim.set_default("p", Action::Status(500));
    let r = c.roundtrip(&post("p", "{}", &[]));
    assert_eq!(r.status, 500);
    assert!(r.json()["error"].is_string());
}

#[test]
fn status_429_carries_retry_after() {
    let sim = Simulator::start();
    sim.set_plan(
        "r",
        vec![Action::StatusWithHeaders(
            429,
            vec![("Retry-After".to_string(), "2".to_string())],
        )],
    );
    let r = send_once(&sim, "r", "{}", &[]);
    assert_eq!(r.status, 429);
    assert_eq!(r.header("retry-after"), Some("2"));
    assert!(sim.stored("r").is_empty());
    assert_eq!(sim.sends("r")[0].outcome, "status:429");
}

#[test]
fn drop_after_read_stores_then_dedupe_returns_same_id() {
    let sim = Simulator::start();
    sim.set_dedupe("d", "Idempotency-Key");
    sim.set_plan("d", vec![Action::DropAfterRead { store: true }]);
    let mut c = Client::connect(sim.port());
    c.write(&post("d", r#"{"n":1}"#, &[("idempotency-key", "K")]));
    let err = c.read_response().err().expect("no response after a drop");
    assert!(
        matches!(
            err.kind(),
            ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset
        ),
        "{err:?}"
    );
    assert!(c.buf.is_empty(), "nothing at all was written");
    let stored = sim.stored("d");
    assert_eq!(stored.len(), 1);
    let first_id = stored[0].external_id.clone();

    // The client retries with the same key: same id, nothing new stored.
    let r = send_once(&sim, "d", r#"{"n":1}"#, &[("Idempotency-Key", "K")]);
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["id"], first_id.as_str());
    assert_eq!(r.header("x-message-id"), Some(first_id.as_str()));
    assert_eq!(sim.stored("d").len(), 1);
    let outcomes: Vec<_> = sim
        .sends("d")
        .into_iter()
        .map(|r| (r.outcome, r.external_id))
        .collect();
    assert_eq!(
        outcomes,
        vec![
            ("dropped".to_string(), Some(first_id.clone())),
            ("deduped".to_string(), Some(first_id.clone())),
        ]
    );
    // A different key is stored anew.
    let r = send_once(&sim, "d", "{}", &[("Idempotency-Key", "K2")]);
    assert_ne!(r.json()["id"], first_id.as_str());
    let c = sim.counters();
    assert_eq!((c.dropped, c.deduped, c.accepted, c.stored), (1, 1, 1, 2));
}

#[test]
fn drop_without_store_and_plan_before_dedupe() {
    let sim = Simulator::start();
    sim.set_dedupe("x", "X-Dedupe");
    let first = send_once(&sim, "x", "{}", &[("x-dedupe", "a")]);
    // Status actions come before any dedupe check; then the duplicate is deduped.
    sim.set_plan(
        "x",
        vec![Action::Status(503), Action::DropAfterRead { store: false }],
    );
    assert_eq!(send_once(&sim, "x", "{}", &[("X-Dedupe", "a")]).status, 503);
    let mut c = Client::connect(sim.port());
    c.write(&post("x", "{}", &[("X-Dedupe", "a")]));
    assert!(c.read_response().is_err());
    let again = send_once(&sim, "x", "{}", &[("X-Dedupe", "a")]);
    assert_eq!(again.json()["id"], first.json()["id"]);
    assert_eq!(sim.stored("x").len(), 1);
    // Idempotency-Key is not the configured dedupe header: stored anew.
    send_once(&sim, "x", "{}", &[("Idempotency-Key", "a")]);
    assert_eq!(sim.stored("x").len(), 2);
    let outcomes: Vec<_> = sim.sends("x").into_iter().map(|r| r.outcome).collect();
    assert_eq!(
        outcomes,
        vec!["accepted", "status:503", "dropped", "deduped", "accepted"]
    );
}

#[test]
fn hang_never_answers_and_shutdown_closes() {
    let sim = Simulator::start();
    sim.set_plan("h", vec![Action::Hang { store: true }]);
    let mut c = Client::connect(sim.port());
    c.s.set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    c.write(&post("h", "{}", &[("Idempotency-Key", "hk")]));
    let t = Instant::now();
    let err = c.read_response().err().expect("no answer");
    assert!(
        matches!(err.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
        "{err:?}"
    );
    assert!(t.elapsed() >= Duration::from_millis(250));
    assert_eq!(sim.stored("h").len(), 1);
    assert_eq!(sim.sends("h")[0].outcome, "hang");
    assert_eq!(sim.counters().hangs, 1);
    // Other connections are unaffected.
    assert_eq!(send_once(&sim, "h", "{}", &[]).status, 200);

    // Shutting down closes the hung connection.
    c.s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let t = Instant::now();
    sim.shutdown();
    assert!(t.elapsed() < Duration::from_secs(3));
    assert!(c.closed());
    assert!(StdStream::connect(("127.0.0.1", sim.port())).is_err());
}

#[test]
fn accept_after_waits() {
    let sim = Simulator::start();
    sim.set_plan(
        "slow",
        vec![Action::AcceptAfter(Duration::from_millis(800))],
    );
    let mut c = Client::connect(sim.port());
    let t = Instant::now();
    c.write(&post("slow", "{}", &[]));
    assert!(sim.wait_for_sends("slow", 1, Duration::from_secs(2)));
    assert_eq!(sim.sends("slow")[0].outcome, "delayed");
    assert!(sim.stored("slow").is_empty());
    let r = c.read_response().unwrap();
    assert!(t.elapsed() >= Duration::from_millis(780));
    assert_eq!(r.status, 200);
    assert_eq!(sim.sends("slow")[0].outcome, "accepted");
    assert_eq!(sim.stored("slow").len(), 1);
}

#[test]
fn accept_large_pads_the_answer_to_its_size() {
    let sim = Simulator::start();
    sim.set_dedupe("big", "Idempotency-Key");
    sim.set_default("big", Action::AcceptLarge(10_000_000));
    let mut c = Client::connect(sim.port());
    let r = c.roundtrip(&post("big", "{}", &[("Idempotency-Key", "k1")]));
    assert_eq!(r.status, 200);
    assert_eq!(r.body.len(), 10_000_000);
    assert!(r
        .body
        .starts_with(br#"{"id":"msg-big-1","status":"accepted","pad":"xx"#));
    assert!(r.body.ends_with(br#"xx"}"#));
    let v = r.json();
    assert_eq!(
        (v["id"].as_str(), v["status"].as_str()),
        (Some("msg-big-1"), Some("accepted"))
    );
    assert_eq!(r.header("X-Message-Id"), Some("msg-big-1"));
    // The connection stays usable, and a duplicate is deduped with the same padding.
    let r = c.roundtrip(&post("big", "{}", &[("Idempotency-Key", "k1")]));
    assert_eq!((r.status, r.body.len()), (200, 10_000_000));
    assert_eq!(r.json()["id"], "msg-big-1");
    let outcomes: Vec<_> = sim.sends("big").into_iter().map(|r| r.outcome).collect();
    assert_eq!(outcomes, vec!["accepted", "deduped"]);
    assert_eq!(sim.stored("big").len(), 1);
    // Too small a size: the shortest body, with an empty pad.
    sim.set_plan("big", vec![Action::AcceptLarge(1)]);
    let r = c.roundtrip(&post("big", "{}", &[]));
    assert_eq!(
        r.body,
        br#"{"id":"msg-big-2","status":"accepted","pad":""}"#
    );
}

#[test]
fn accept_large_survives_clients_that_stop_reading() {
    let sim = Arc::new(Simulator::start());
    sim.set_default("cut", Action::AcceptLarge(10_000_000));
    let threads: Vec<_> = (0..16)
        .map(|_| {
            let port = sim.port();
            std::thread::spawn(move || {
                // Read the head and some 64 KiB of the body, then hang up.
                let mut c = Client::connect(port);
                c.write(&post("cut", "{}", &[]));
                while c.buf.len() < 64 * 1024 {
                    c.fill().unwrap();
                }
                assert!(c.buf.starts_with(b"HTTP/1.1 200 OK\r\n"));
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(sim.stored("cut").len(), 16);
    assert!(sim.sends("cut").iter().all(|r| r.outcome == "accepted"));
    // Still serving, large answers included.
    let r = send_once(&sim, "cut", "{}", &[]);
    assert_eq!((r.status, r.body.len()), (200, 10_000_000));
    sim.set_default("cut", Action::Accept);
    assert_eq!(send_once(&sim, "cut", "{}", &[]).json()["id"], "msg-cut-18");
}

#[test]
fn lookups_by_key_and_id() {
    let sim = Simulator::start();
    let id = send_once(&sim, "l", "{}", &[("Idempotency-Key", "a b/c")]).json()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let by_key = sim.lookup_url_by_key("l");
    assert_eq!(
        by_key,
        format!("http://127.0.0.1:{}/ch/l/by-key/{{effect_key}}", sim.port())
    );
    let by_id = sim.lookup_url_by_id("l");
    assert!(by_id.ends_with("/ch/l/by-id/{external_id}"));
    let path = |url: &str, v: &str| {
        url.replace(&sim.base_url(), "")
            .replace("{effect_key}", v)
            .replace("{external_id}", v)
    };

    let mut c = Client::connect(sim.port());
    let r = c.roundtrip(&get(&path(&by_key, "a%20b%2Fc")));
    assert_eq!(r.status, 200);
    let v = r.json();
    assert_eq!(
        (v["found"].as_bool(), v["id"].as_str(), v["key"].as_str()),
        (Some(true), Some(id.as_str()), Some("a b/c"))
    );
    let r = c.roundtrip(&get(&path(&by_id, &id)));
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["id"], id.as_str());
    let r = c.roundtrip(&get(&path(&by_key, "nope")));
    assert_eq!(r.status, 404);
    assert_eq!(r.json(), serde_json::json!({"found": false}));
    let r = c.roundtrip(&get(&path(&by_id, "msg-l-999")));
    assert_eq!(r.status, 404);

    // Lookups are recorded, never stored.
    assert_eq!(sim.stored("l").len(), 1);
    assert_eq!(sim.sends("l").len(), 1);
    let outcomes: Vec<_> = sim
        .requests("l")
        .into_iter()
        .filter(|r| r.kind == "lookup")
        .map(|r| r.outcome)
        .collect();
    assert_eq!(
        outcomes,
        vec![
            "lookup:found",
            "lookup:found",
            "lookup:not_found",
            "lookup:not_found"
        ]
    );

    // Lookup plan.
    sim.set_lookup_plan("l", vec![LookupAction::Status(500), LookupAction::Drop]);
    assert_eq!(c.roundtrip(&get(&path(&by_id, &id))).status, 500);
    c.write(&get(&path(&by_id, &id)));
    assert!(c.read_response().is_err());
    let mut c = Client::connect(sim.port());
    assert_eq!(c.roundtrip(&get(&path(&by_id, &id))).status, 200);
    let c = sim.counters();
    assert_eq!((c.lookups, c.lookups_found, c.lookups_not_found), (7, 3, 2));
}

#[test]
fn malformed_requests_get_400_and_close() {
    let sim = Simulator::start();
    let bad: &[&[u8]] = &[
        b"garbage\r\n\r\n",
        b"POST /ch/a HTTP/9.9\r\n\r\n",
        b"POST /ch/a HTTP/1.1\r\nNoColonHere\r\n\r\n",
        b"POST /ch/a HTTP/1.1\r\nBad Name: x\r\n\r\n",
        b"POST /ch/a HTTP/1.1\r\nContent-Length: abc\r\n\r\n",
        b"POST /ch/a HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nxx",
        b"POST /ch/a HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"POST /ch/a HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
        b"POST /ch/a HTTP/1.1\r\nX: a\r\n folded\r\n\r\n",
        b"POST /ch/a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"POST /ch/a HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabX\r\n",
        b"\x00\xff\xfe binary\r\n\r\n",
    ];
    for raw in bad {
        let mut c = Client::connect(sim.port());
        let r = c.roundtrip(raw);
        assert_eq!(r.status, 400, "{:?}", String::from_utf8_lossy(raw));
        assert_eq!(r.header("connection"), Some("close"));
        assert!(c.closed(), "{:?}", String::from_utf8_lossy(raw));
    }
    assert_eq!(sim.counters().bad_requests, bad.len() as u64);
    assert!(sim.stored("a").is_empty());
    // Too large a head.
    let mut c = Client::connect(sim.port());
    let mut big = b"POST /ch/a HTTP/1.1\r\nX: ".to_vec();
    big.extend(std::iter::repeat_n(b'a', MAX_HEAD + 10));
    c.write(&big);
    assert_eq!(c.read_response().unwrap().status, 431);
    // Still serving.
    assert_eq!(send_once(&sim, "a", "{}", &[]).status, 200);
}

#[test]
fn random_faults_are_deterministic() {
    let faults = RandomFaults {
        drop_after_read_store: 0.2,
        status_503: 0.2,
        status_429: 0.2,
        retry_after_s: 3,
        seed: 42,
    };
    let run = |f: RandomFaults| -> Vec<String> {
        let sim = Simulator::start();
        sim.set_default("rnd", Action::Random(f));
        for i in 0..60 {
            let mut c = Client::connect(sim.port());
            c.write(&post("rnd", "{}", &[("Idempotency-Key", &format!("k{i}"))]));
            match c.read_response() {
                Ok(r) if r.status == 429 => assert_eq!(r.header("Retry-After"), Some("3")),
                Ok(_) => {}
                Err(_) => {}
            }
        }
        let sends = sim.sends("rnd");
        let stored = sim.stored("rnd");
        let expect_stored = sends
            .iter()
            .filter(|r| r.outcome == "accepted" || r.outcome == "dropped")
            .count();
        assert_eq!(stored.len(), expect_stored);
        sends.into_iter().map(|r| r.outcome).collect()
    };
    let a = run(faults);
    let b = run(faults);
    assert_eq!(a, b);
    for o in ["accepted", "dropped", "status:503", "status:429"] {
        assert!(a.iter().any(|x| x == o), "{o} never drawn in {a:?}");
    }
    let c = run(RandomFaults { seed: 43, ..faults });
    assert_ne!(a, c);
}

#[test]
fn random_faults_parse() {
    let f = RandomFaults::parse("drop=0.05,503=0.05,429=0.02,retry_after=1,seed=7").unwrap();
    assert_eq!(
        f,
        RandomFaults {
            drop_after_read_store: 0.05,
            status_503: 0.05,
            status_429: 0.02,
            retry_after_s: 1,
            seed: 7
        }
    );
    assert!(RandomFaults::parse("drop=0.7,503=0.7").is_err());
    assert!(RandomFaults::parse("nope=1").is_err());
    assert!(RandomFaults::parse("drop").is_err());
}

#[test]
fn stats_requests_and_other_paths() {
    let sim = Simulator::start();
    send_once(&sim, "s", "hello", &[("Idempotency-Key", "k")]);
    let mut c = Client::connect(sim.port());
    let stats = c.roundtrip(&get("/_stats")).json();
    assert_eq!(stats["sends"], 1);
    assert_eq!(stats["accepted"], 1);
    let reqs = c.roundtrip(&get("/_requests?channel=s")).json();
    assert_eq!(reqs[0]["body"], "hello");
    assert_eq!(reqs[0]["outcome"], "accepted");
    assert_eq!(reqs[0]["external_id"], "msg-s-1");
    assert_eq!(reqs[0]["key"], "k");
    assert_eq!(c.roundtrip(&get("/nowhere")).status, 404);
    assert_eq!(c.roundtrip(&get("/ch/s")).status, 405);
    assert_eq!(c.roundtrip(&get("/ch/s/by-what/x")).status, 404);
    let kinds: Vec<_> = sim.requests("s").into_iter().map(|r| r.kind).collect();
    assert_eq!(kinds, vec!["send", "other", "other"]);

    // HEAD gets the head only.
    c.write(b"HEAD /ch/s HTTP/1.1\r\n\r\n");
    while find_head_end(&c.buf, 0).is_none() {
        c.fill().unwrap();
    }
    assert!(c.buf.starts_with(b"HTTP/1.1 405 "));
    assert!(
        c.buf.ends_with(b"\r\n\r\n"),
        "no body after a HEAD response"
    );
    c.buf.clear();
    assert_eq!(c.roundtrip(&get("/_stats")).status, 200);
    // Any method but GET is a send.
    let r = c.roundtrip(b"PUT /ch/s HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
    assert_eq!(r.status, 200);
    assert_eq!(sim.sends("s").len(), 2);
}

#[test]
fn reset_forgets_traffic_and_plans() {
    let sim = Simulator::start();
    sim.set_plan("z", vec![Action::Status(503)]);
    send_once(&sim, "z", "{}", &[]);
    send_once(&sim, "z", "{}", &[]);
    sim.set_plan("z", vec![Action::Status(503)]);
    sim.reset("z");
    assert!(sim.requests("z").is_empty() && sim.stored("z").is_empty());
    assert_eq!(sim.send_count("z"), 0);
    let r = send_once(&sim, "z", "{}", &[]);
    assert_eq!(r.status, 200);
    // Ids stay unique across a reset.
    assert_eq!(r.json()["id"], "msg-z-2");
}

#[test]
fn recording_switches_keep_counters() {
    let sim = Simulator::start();
    sim.set_record_bodies(false);
    send_once(&sim, "b", "secret", &[]);
    assert!(sim.sends("b")[0].body.is_empty());
    assert!(sim.stored("b")[0].body.is_empty());
    sim.set_record_requests(false);
    send_once(&sim, "b", "x", &[]);
    assert_eq!(sim.sends("b").len(), 1);
    assert_eq!(sim.send_count("b"), 2);
    assert!(sim.wait_for_sends("b", 2, Duration::from_millis(10)));
    assert_eq!(sim.stored("b").len(), 2);
    assert_eq!(sim.counters().accepted, 2);
}

#[test]
fn wait_for_stored_wakes_up() {
    let sim = Arc::new(Simulator::start());
    assert!(!sim.wait_for_stored("w", 1, Duration::from_millis(50)));
    let s2 = sim.clone();
    let t = std::thread::spawn(move || s2.wait_for_stored("w", 3, Duration::from_secs(5)));
    std::thread::sleep(Duration::from_millis(50));
    for _ in 0..3 {
        send_once(&sim, "w", "{}", &[]);
    }
    assert!(t.join().unwrap());
}

#[test]
fn observer_sees_final_outcomes() {
    let sim = Simulator::start();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s2 = seen.clone();
    sim.set_observer(move |r| s2.lock().unwrap().push((r.outcome.clone(), r.status)));
    sim.set_plan("o", vec![Action::Status(503)]);
    send_once(&sim, "o", "{}", &[]);
    send_once(&sim, "o", "{}", &[]);
    assert_eq!(
        *seen.lock().unwrap(),
        vec![
            ("status:503".to_string(), Some(503)),
            ("accepted".to_string(), Some(200))
        ]
    );
}

#[test]
fn concurrent_keep_alive_clients() {
    let sim = Arc::new(Simulator::start());
    sim.set_record_bodies(false);
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let port = sim.port();
            std::thread::spawn(move || {
                let mut c = Client::connect(port);
                for i in 0..250 {
                    let key = format!("t{t}-{i}");
                    let r = c.roundtrip(&post("load", "{}", &[("Idempotency-Key", &key)]));
                    assert_eq!(r.status, 200);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let stored = sim.stored("load");
    assert_eq!(stored.len(), 2000);
    let ids: std::collections::HashSet<_> = stored.iter().map(|s| &s.external_id).collect();
    assert_eq!(ids.len(), 2000);
    assert_eq!(sim.counters().connections, 8);
}

/// Throughput of `Accept` over many keep-alive connections. Not part of the normal run:
/// `cargo test -p outbox_e2e --release --lib -- --ignored bench --nocapture`.
#[test]
#[ignore]
fn bench_accept_throughput() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const CONNS: usize = 300;
    const PER_CONN: usize = 300;
    let sim = Simulator::start();
    sim.set_record_bodies(false);
    sim.set_record_requests(false);
    let port = sim.port();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let t = Instant::now();
    rt.block_on(async move {
        let mut tasks = Vec::new();
        for c in 0..CONNS {
            tasks.push(tokio::spawn(async move {
                let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
                    .await
                    .unwrap();
                s.set_nodelay(true).unwrap();
                let mut buf = vec![0u8; 4096];
                for i in 0..PER_CONN {
                    let key = format!("c{c}-{i}");
                    s.write_all(&post(
                        "bench",
                        r#"{"payload":"x"}"#,
                        &[("Idempotency-Key", &key)],
                    ))
                    .await
                    .unwrap();
                    // Responses are small and arrive whole: read until the body end.
                    let mut got = 0;
                    loop {
                        let n = s.read(&mut buf[got..]).await.unwrap();
                        assert!(n > 0);
                        got += n;
                        if let Some(h) = find_head_end(&buf[..got], 0) {
                            let head = std::str::from_utf8(&buf[..h]).unwrap();
                            let len: usize = head
                                .split("\r\n")
                                .find_map(|l| l.strip_prefix("Content-Length: "))
                                .unwrap()
                                .parse()
                                .unwrap();
                            if got >= h + 4 + len {
                                assert!(head.starts_with("HTTP/1.1 200"));
                                break;
                            }
                        }
                    }
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
    });
    let el = t.elapsed();
    let n = CONNS * PER_CONN;
    assert_eq!(sim.counters().accepted, n as u64);
    println!(
        "{n} requests over {CONNS} connections in {el:?}: {:.0} req/s",
        n as f64 / el.as_secs_f64()
    );
}
