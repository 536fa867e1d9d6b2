//! Section 9: bad rows never stop the worker.

use super::*;

// ---------------------------------------------------------------------------------------
// 9. Bad rows never stop the worker
// ---------------------------------------------------------------------------------------

#[test]
fn bad_rows_never_stop_the_worker() {
    let cluster = Cluster::from_env();
    let pids_before = wait_for_workers(&cluster, &[]);
    let sim = Simulator::start();
    let bad_hdr_ch = unique("w_badhdr");
    let dns_ch = unique("w_dns");
    let good_ch = unique("w_good");
    let mut c = cluster.connect();
    create_channel(&mut c, &bad_hdr_ch, &sim.send_url(&bad_hdr_ch), "{}");
    create_channel(
        &mut c,
        &dns_ch,
        "http://nonexistent.invalid/x",
        r#"{"retry": {"base_ms": 60000, "max_ms": 60000, "jitter": "none"}}"#,
    );
    create_channel(
        &mut c,
        &good_ch,
        &sim.send_url(&good_ch),
        r#"{"external_id": "/id"}"#,
    );

    // A header value HTTP cannot carry (a control character): enqueue refuses it, so the
    // bad row is written by hand, as an older version or a careless UPDATE could have.
    let refused = c
        .query_one(
            "SELECT outbox.enqueue($1::text, '{}'::jsonb, $2::text, headers => $3::text::jsonb)",
            &[&bad_hdr_ch, &unique("badhdr"), &r#"{"X-Bad": "a\u0001b"}"#],
        )
        .expect_err("a control character in a header value is refused");
    assert_eq!(
        refused.as_db_error().map(|d| d.code().code()),
        Some("22023"),
        "{refused:?}"
    );
    let bad = {
        let mut t = c.transaction().expect("begin");
        let id = enqueue_with(
            &mut t,
            &bad_hdr_ch,
            r#"{"x": 1}"#,
            &unique("badhdr"),
            None,
            None,
        );
        t.execute(
            r#"UPDATE outbox._messages SET headers = '{"X-Bad": "a\u0001b"}' WHERE id = $1"#,
            &[&id],
        )
        .expect("write the bad header");
        t.commit().expect("commit");
        id
    };
    let dns = enqueue_payload(&mut c, &dns_ch, r#"{"x": 2}"#, &unique("dns"));

    let m = wait_message(&cluster, bad, "failed");
    assert_eq!(m.last_error_class.as_deref(), Some("permanent"));
    let err = m.last_error.clone().unwrap_or_default();
    assert!(
        err.contains("X-Bad") && err.contains("not sent"),
        "a readable error naming the header: {err:?}"
    );
    assert_eq!(sim.send_count(&bad_hdr_ch), 0, "nothing was sent");

    let d = wait_msg(&cluster, dns, SETTLE, "a transient DNS failure", |m| {
        m.attempts >= 1 && m.last_error_class.is_some()
    });
    // Stop its retries (every 60 s) before checking, so the shared cluster stays quiet.
    c.execute(
        "SELECT outbox.pause_channel($1::text, 'end of test')",
        &[&dns_ch],
    )
    .unwrap();
    assert_eq!(d.last_error_class.as_deref(), Some("transient"), "{d:?}");
    assert_eq!(d.state, "queued", "a transient error is retried: {d:?}");
    let err = d.last_error.clone().unwrap_or_default();
    assert!(err.contains("DNS"), "phase DNS in last_error: {err:?}");
    let a = attempts(&mut c, dns);
    assert_eq!(a[0].error_class.as_deref(), Some("transient"));
    assert!(a[0].error.as_deref().unwrap_or("").contains("DNS"), "{a:?}");

    // A due time and a creation time of -infinity, written by hand: the worker reads times
    // as numbers, and these have none. It is delivered like any other.
    let timeless = {
        let mut tx = c.transaction().unwrap();
        let id = enqueue_payload(&mut tx, &good_ch, r#"{"x": 5}"#, &unique("timeless"));
        tx.execute(
            "UPDATE outbox._messages SET next_attempt_at = '-infinity', created_at = '-infinity'
              WHERE id = $1",
            &[&id],
        )
        .expect("write the due time");
        tx.commit().unwrap();
        id
    };
    wait_message(&cluster, timeless, "delivered");

    // Counters at the ends of their range, a lease without an end, headers that are not an
    // object, and a channel whose options were changed by hand, all written in one
    // transaction. Before the worker saturated its counters, the first of these failed every
    // claim with 'integer out of range' and both workers restarted every second.
    let (at_max, base_min, no_lease, hdr_array, bad_opts) = {
        let mut tx = c.transaction().unwrap();
        let at_max = enqueue_payload(&mut tx, &good_ch, r#"{"x": 6}"#, &unique("at_max"));
        let base_min = enqueue_payload(&mut tx, &good_ch, r#"{"x": 7}"#, &unique("base_min"));
        let no_lease = enqueue_payload(&mut tx, &good_ch, r#"{"x": 8}"#, &unique("no_lease"));
        let hdr_array = enqueue_payload(&mut tx, &good_ch, r#"{"x": 9}"#, &unique("hdr_array"));
        let bad_opts = enqueue_payload(&mut tx, &dns_ch, r#"{"x": 10}"#, &unique("bad_opts"));
        for (sql, id) in [
            ("UPDATE outbox._messages SET attempts = 2147483647 WHERE id = $1", at_max),
            ("UPDATE outbox._messages SET attempts = 5, budget_base = -2147483648 WHERE id = $1", base_min),
            ("UPDATE outbox._messages SET state = 'sending', lease_until = NULL, lease_owner = NULL WHERE id = $1", no_lease),
            ("UPDATE outbox._messages SET headers = '[1, 2]' WHERE id = $1", hdr_array),
        ] {
            tx.execute(sql, &[&id]).expect(sql);
        }
        tx.execute(
            r#"UPDATE outbox._channels SET options = jsonb_set(options, '{max_in_flight}', '"many"'),
                                           paused = false
                WHERE name = $1"#,
            &[&dns_ch],
        )
        .expect("write the bad option");
        tx.commit().unwrap();
        (at_max, base_min, no_lease, hdr_array, bad_opts)
    };
    let m = wait_message(&cluster, at_max, "delivered");
    assert_eq!(
        m.attempts,
        i32::MAX,
        "the counter stays at its limit: {m:?}"
    );
    wait_message(&cluster, base_min, "delivered");
    // In flight with no end to its lease: taken back as an interrupted attempt, not resent.
    let m = wait_message(&cluster, no_lease, "uncertain");
    assert_eq!(m.last_error_class.as_deref(), Some("ambiguous"), "{m:?}");
    let m = wait_message(&cluster, hdr_array, "failed");
    assert!(
        m.last_error
            .as_deref()
            .unwrap_or("")
            .contains("must be a JSON object"),
        "{m:?}"
    );
    let m = wait_message(&cluster, bad_opts, "failed");
    assert!(
        m.last_error
            .as_deref()
            .unwrap_or("")
            .contains("max_in_flight"),
        "the channel's bad option is named: {m:?}"
    );
    assert_eq!(
        sim.stored(&good_ch).len(),
        3,
        "the two messages at the counters' ends were sent, the others not"
    );
    // The views read the bad option as unknown instead of failing.
    let max_attempts: Option<i32> = one(
        &mut c,
        "SELECT max_attempts FROM outbox.messages WHERE id = $1",
        &[&bad_opts],
    );
    assert_eq!(max_attempts, Some(8));
    c.execute(
        "SELECT outbox.pause_channel($1::text, 'end of test')",
        &[&dns_ch],
    )
    .unwrap();
    c.execute("SELECT outbox.cancel($1, 'end of test')", &[&no_lease])
        .unwrap();

    // After those, normal work goes on, on another channel and on the bad header's channel.
    let good = enqueue_payload(&mut c, &good_ch, r#"{"x": 3}"#, &unique("good"));
    let also = enqueue_payload(&mut c, &bad_hdr_ch, r#"{"x": 4}"#, &unique("good2"));
    let g = wait_message(&cluster, good, "delivered");
    wait_message(&cluster, also, "delivered");
    assert_eq!(sim.stored(&good_ch).len(), 4);
    assert!(
        sim.stored(&good_ch)
            .iter()
            .any(|s| g.external_id.as_deref() == Some(s.external_id.as_str())),
        "{g:?}"
    );
    assert_eq!(sim.stored(&bad_hdr_ch).len(), 1);
    assert_eq!(
        cluster.worker_pids(&mut c),
        pids_before,
        "no worker crashed or restarted"
    );
}

/// A failed attempt of a message whose counter was set by hand to its limit is recorded
/// like any other: the attempt under way saturates (2147483647, as the claim counts it), and
/// the record's check that the message is still in that attempt counts it the same way.
/// Before, the check never held at the limit: the failure was never recorded, the message
/// went back to the queue due at once, and was sent again on every claim.
#[test]
fn a_failure_at_the_counters_limit_is_recorded_once_and_not_sent_again() {
    let cluster = Cluster::from_env();
    let pids_before = wait_for_workers(&cluster, &[]);
    let sim = Simulator::start();
    let ch = unique("w_at_limit");
    let mut c = cluster.connect();
    create_channel(
        &mut c,
        &ch,
        &sim.send_url(&ch),
        r#"{"retry": {"base_ms": 50, "max_ms": 50, "jitter": "none", "max_attempts": 3}}"#,
    );
    sim.set_default(&ch, Action::Status(503));
    let id = {
        let mut tx = c.transaction().unwrap();
        let id = enqueue_payload(&mut tx, &ch, r#"{"x": 1}"#, &unique("at_limit"));
        tx.execute(
            "UPDATE outbox._messages SET attempts = 2147483647 WHERE id = $1",
            &[&id],
        )
        .expect("set the counter");
        tx.commit().unwrap();
        id
    };
    let m = wait_message(&cluster, id, "exhausted");
    assert_eq!(m.attempts, i32::MAX, "{m:?}");
    assert_eq!(m.last_http_status, Some(503), "{m:?}");
    // A second look after a few retry intervals: still one send.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(sim.send_count(&ch), 1, "sent once, its failure recorded");
    let a = attempts(&mut c, id);
    assert_eq!(a.len(), 1, "{a:?}");
    assert_eq!(a[0].attempt, i32::MAX, "{a:?}");
    assert_eq!(
        cluster.worker_pids(&mut c),
        pids_before,
        "no worker crashed or restarted"
    );
}

/// The soft open-files limit of a process, and its hard limit (`/proc/<pid>/limits`).
fn open_files_limits(pid: i32) -> (String, String) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("read limits");
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("a line for open files");
    let fields: Vec<&str> = line.split_whitespace().collect();
    (fields[3].to_string(), fields[4].to_string())
}

/// Busy channels one after another: each leaves a batch's worth of idle connections in
/// each worker. Under the usual soft limit of 1,024 open files, which PostgreSQL sizes its
/// own file cache from, those sockets took the descriptors PostgreSQL counted on: its file
/// opens failed with "Too many open files; release and retry" and the drains slowed by a
/// third (seen in the benchmark). The workers raise their soft limit to the hard one at
/// start, and keep at most a batch of idle connections per channel.
#[test]
fn idle_connections_of_many_channels_leave_postgres_its_file_descriptors() {
    const CHANNELS: usize = 8;
    const PER_CHANNEL: i64 = 400;
    let cluster = Cluster::from_env();
    let pids = wait_for_workers(&cluster, &[]);
    let sim = Simulator::start();
    sim.set_record_bodies(false);
    let mut c = cluster.connect();
    for pid in cluster.worker_pids(&mut c) {
        let (soft, hard) = open_files_limits(pid);
        assert_eq!(
            soft, hard,
            "worker {pid}: the soft open-files limit is raised to the hard one"
        );
    }
    let mark = cluster.log_mark();
    let mut channels = Vec::new();
    for _ in 0..CHANNELS {
        // 20 ms per answer: the requests of a batch overlap, each on a connection of its own.
        let ch = slow_channel(&mut c, &sim, "w_fds", Duration::from_millis(20), 1000);
        enqueue_backlog(&mut c, &ch, PER_CHANNEL);
        assert!(
            no_message_left(&cluster, &ch, "state <> 'delivered'"),
            "{ch} was not delivered: {:?}",
            states_of(&mut c, &ch)
        );
        channels.push(ch);
    }
    let retried = count(
        &mut c,
        "SELECT count(*) FROM outbox.messages WHERE channel = ANY($1) AND attempts <> 1",
        &[&channels],
    );
    assert_eq!(retried, 0, "every message went out on its first attempt");
    let log = cluster.log_since(mark);
    let starved: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("Too many open files"))
        .take(3)
        .collect();
    assert!(
        starved.is_empty(),
        "the server ran out of file descriptors: {starved:?}"
    );
    assert_eq!(cluster.worker_pids(&mut c), pids, "no worker restarted");
}
