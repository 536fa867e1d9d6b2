//! The `nats` channel kind end to end: the real cluster's workers publish to a real
//! nats-server with JetStream (Debian's `nats-server`, started by each test on a loopback
//! port of its own, file storage), and the tests read what the stream holds.
//!
//! Run: `cargo test -p outbox_e2e --release --test nats_channel -- --test-threads=1`.
//!
//! For every test: the stream holds each effect key at most once, and no message is
//! `delivered` without an acknowledgement (or a lookup) naming a message the stream holds.

use outbox_e2e::cluster::{poll, unique, Cluster};
use outbox_e2e::helpers::{
    attempts, code_of, count, create_channel, describe, enqueue, error_message, one, SETTLE,
};
use outbox_e2e::nats::NatsServer;
use postgres::Client;
use std::collections::HashMap;
use std::time::Duration;

const FAST_RETRY: &str =
    r#"{"base_ms": 200, "max_ms": 1000, "jitter": "none", "max_attempts": 50}"#;

/// A stream of the test's own on `<prefix>.>`, and a channel publishing to `subject`
/// (`{p}` in it is the prefix) with `extra` options (JSON members, may be empty).
fn stream_and_channel(
    c: &mut Client,
    nats: &NatsServer,
    subject: &str,
    extra: &str,
) -> (String, String, String) {
    let channel = unique("nats");
    let prefix = channel.replace(['-', '.'], "_");
    let stream = prefix.to_uppercase();
    nats.create_stream(&stream, &[&format!("{prefix}.>")], Duration::from_secs(120));
    let subject = subject.replace("{p}", &prefix);
    let extra = if extra.is_empty() {
        String::new()
    } else {
        format!(", {extra}")
    };
    create_channel(
        c,
        &channel,
        &nats.url(),
        &format!(
            r#"{{"kind": "nats", "subject": "{subject}", "stream": "{stream}", "retry": {FAST_RETRY}{extra}}}"#
        ),
    );
    (channel, stream, prefix)
}

fn in_state(c: &mut Client, channel: &str, state: &str) -> i64 {
    count(
        c,
        "SELECT count(*) FROM outbox.messages m
          WHERE m.channel = $1 AND m.state::text = $2",
        &[&channel, &state],
    )
}

fn wait_all(cluster: &Cluster, channel: &str, state: &str, n: i64, within: Duration) {
    let done = poll(cluster, within, |c| {
        Ok((in_state(c, channel, state) == n).then_some(()))
    });
    let mut c = cluster.connect();
    let states: Vec<(String, i64)> = c
        .query(
            "SELECT m.state::text, count(*) FROM outbox.messages m
              WHERE m.channel = $1 GROUP BY 1 ORDER BY 1",
            &[&channel],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert!(
        done.is_some(),
        "{n} messages of {channel} {state} within {within:?}; states: {states:?}"
    );
}

/// Each message's effect key as sent (its `Nats-Msg-Id`), state and external id.
fn sent_keys(c: &mut Client, channel: &str) -> Vec<(String, String, Option<String>)> {
    c.query(
        "SELECT outbox._provider_key(m.tenant, m.effect_key), m.state::text, m.external_id
           FROM outbox.messages m
          WHERE m.channel = $1 ORDER BY m.id",
        &[&channel],
    )
    .unwrap()
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2)))
    .collect()
}

/// The two properties every test holds: each key at most once in the stream, and every
/// delivered message's external id names the stream's copy of it. Returns how many keys
/// the stream holds.
fn check_stream(nats: &NatsServer, stream: &str, c: &mut Client, channel: &str) -> usize {
    let stored = nats.messages(stream);
    let copies = nats.copies_by_id(stream);
    let twice: Vec<_> = copies.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "keys stored more than once: {twice:?}");
    let by_seq: HashMap<u64, Option<String>> = stored
        .iter()
        .map(|m| (m.sequence, m.msg_id.clone()))
        .collect();
    for (key, state, external_id) in sent_keys(c, channel) {
        if state != "delivered" {
            continue;
        }
        let ext = external_id.unwrap_or_else(|| panic!("{key} delivered without an external id"));
        let (name, seq) = ext.rsplit_once(':').expect("stream:sequence");
        assert_eq!(name, stream);
        let seq: u64 = seq.parse().unwrap();
        assert_eq!(
            by_seq.get(&seq),
            Some(&Some(key.clone())),
            "{key} is delivered as {ext}, which the stream does not hold with its key"
        );
    }
    copies.len()
}

#[test]
fn each_message_is_published_once_with_its_key_and_delivered_as_stream_and_sequence() {
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    let nats = NatsServer::start(None);
    for subject in ["{p}.orders.{effect_key}", "{p}.orders.created"] {
        let (channel, stream, _) = stream_and_channel(&mut c, &nats, subject, "");
        let window: i64 = one(
            &mut c,
            "SELECT (options ->> 'duplicate_window_ms')::int8 FROM outbox.channels WHERE name = $1",
            &[&channel],
        );
        assert_eq!(
            window, 120_000,
            "the stream's window is read at create_channel"
        );
        for i in 0..50 {
            enqueue(&mut c, &channel, &format!("{channel}-{i}"));
        }
        wait_all(&cluster, &channel, "delivered", 50, SETTLE);
        assert_eq!(
            check_stream(&nats, &stream, &mut c, &channel),
            50,
            "{subject}"
        );
        let subjects: Vec<String> = nats
            .messages(&stream)
            .into_iter()
            .map(|m| m.subject)
            .collect();
        if subject.contains("{effect_key}") {
            let keys: Vec<String> = sent_keys(&mut c, &channel)
                .into_iter()
                .map(|k| k.0)
                .collect();
            assert!(keys.iter().all(|k| subjects
                .iter()
                .any(|s| s.ends_with(&format!(".orders.{k}")))));
        } else {
            assert!(subjects.iter().all(|s| s.ends_with(".orders.created")));
        }
    }
}

#[test]
fn a_message_the_stream_already_holds_is_delivered_with_the_sequence_stored_first() {
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    let nats = NatsServer::start(None);
    for subject in ["{p}.o.{effect_key}", "{p}.o.fixed"] {
        let (channel, stream, prefix) = stream_and_channel(&mut c, &nats, subject, "");
        c.execute(
            "SELECT outbox.pause_channel($1, 'held for the test')",
            &[&channel],
        )
        .unwrap();
        let id = enqueue(&mut c, &channel, &format!("{channel}-already"));
        let key: String = one(
            &mut c,
            "SELECT outbox._provider_key(tenant, effect_key) FROM outbox.messages WHERE id = $1",
            &[&id],
        );
        // Another producer (or an attempt whose acknowledgement was lost) stored it first.
        let filled = subject
            .replace("{p}", &prefix)
            .replace("{effect_key}", &key);
        let first = nats.publish(&filled, &key, "{}");
        c.execute("SELECT outbox.resume_channel($1)", &[&channel])
            .unwrap();
        wait_all(&cluster, &channel, "delivered", 1, SETTLE);
        let ext: Option<String> = one(
            &mut c,
            "SELECT external_id FROM outbox.messages WHERE id = $1",
            &[&id],
        );
        assert_eq!(ext, Some(format!("{stream}:{first}")), "{subject}");
        assert_eq!(check_stream(&nats, &stream, &mut c, &channel), 1);
        let outcome = attempts(&mut c, id)
            .last()
            .and_then(|a| a.outcome.clone())
            .unwrap_or_default();
        assert!(outcome.contains("duplicate"), "{outcome}");
    }
}

/// `create_channel` refuses a subject outside its stream; a stream whose subjects change
/// afterwards leaves the channel's publishes with no stream: retried as transient, said.
#[test]
fn a_subject_the_stream_stopped_taking_is_retried_and_says_so() {
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    let nats = NatsServer::start(None);
    let (channel, stream, prefix) = stream_and_channel(&mut c, &nats, "{p}.{effect_key}", "");
    nats.create_stream(
        &stream,
        &[&format!("moved_{prefix}.>")],
        Duration::from_secs(120),
    );
    let id = enqueue(&mut c, &channel, &format!("{channel}-0"));
    let seen = poll(&cluster, SETTLE, |c| {
        Ok((attempts(c, id).len() >= 2).then_some(()))
    });
    assert!(seen.is_some(), "two attempts of a message no stream takes");
    let a = attempts(&mut c, id);
    assert_eq!(a[0].error_class.as_deref(), Some("transient"));
    assert!(
        a[0].error
            .as_deref()
            .unwrap_or("")
            .contains("no responders"),
        "{:?}",
        a[0].error
    );
    assert_ne!(
        one::<String>(
            &mut c,
            "SELECT state::text FROM outbox.messages WHERE id = $1",
            &[&id]
        ),
        "delivered"
    );
}

#[test]
fn a_subject_of_another_stream_fails_naming_the_stream() {
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    let nats = NatsServer::start(None);
    let (channel, stream, prefix) = stream_and_channel(&mut c, &nats, "{p}.{effect_key}", "");
    // The channel's subjects move to another stream after create_channel.
    let other = unique("other").replace(['-', '.'], "_");
    nats.create_stream(
        &stream,
        &[&format!("moved_{prefix}.>")],
        Duration::from_secs(120),
    );
    nats.create_stream(
        &other.to_uppercase(),
        &[&format!("{prefix}.>")],
        Duration::from_secs(60),
    );
    let id = enqueue(&mut c, &channel, &format!("{channel}-0"));
    wait_all(&cluster, &channel, "failed", 1, SETTLE);
    let a = attempts(&mut c, id);
    let error = a.last().and_then(|a| a.error.clone()).unwrap_or_default();
    assert!(
        error.contains("wrong stream") && error.contains(&stream),
        "{error}"
    );
    assert_eq!(a.last().unwrap().error_class.as_deref(), Some("permanent"));
    assert!(
        nats.messages(&other.to_uppercase()).is_empty(),
        "the other stream stored nothing"
    );
}

#[test]
fn create_channel_reads_the_window_and_refuses_what_it_cannot_keep() {
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    let nats = NatsServer::start(None);
    let stream = unique("w").replace(['-', '.'], "_").to_uppercase();
    nats.create_stream(
        &stream,
        &[&format!("{}.>", stream.to_lowercase())],
        Duration::from_secs(30),
    );
    let url = nats.url();
    let ok = |extra: &str| {
        format!(
            r#"{{"kind": "nats", "subject": "{}.x", "stream": "{stream}"{extra}}}"#,
            stream.to_lowercase()
        )
    };
    let refused = [
        (
            r#"{"kind": "nats", "subject": "a.x", "stream": "NO_SUCH_STREAM"}"#.to_string(),
            url.clone(),
            "stream",
        ),
        (
            ok(r#", "retry": {"max_age_ms": 60000}"#),
            url.clone(),
            "retry.max_age_ms",
        ),
        (
            ok(r#", "idempotency_header": "Idempotency-Key""#),
            url.clone(),
            "idempotency_header",
        ),
        (
            r#"{"kind": "nats", "subject": "a.*", "stream": "S"}"#.to_string(),
            url.clone(),
            "subject",
        ),
        // Outside the stream's subjects: the server would store none of its messages.
        (
            format!(
                r#"{{"kind": "nats", "subject": "elsewhere.{{effect_key}}", "stream": "{stream}"}}"#
            ),
            url.clone(),
            "lies outside the subjects of stream",
        ),
        (
            format!(
                r#"{{"kind": "nats", "subject": "{}", "stream": "{stream}"}}"#,
                stream.to_lowercase()
            ),
            url.clone(),
            "subject",
        ),
        (ok(""), url.replace("nats://", "nats://u:p@"), "endpoint"),
        (ok(""), url.replace("nats://", "http://"), "endpoint"),
        (
            r#"{"subject": "a.x"}"#.to_string(),
            "http://127.0.0.1:1/x".to_string(),
            "subject",
        ),
    ];
    for (options, endpoint, option) in refused {
        let e = c
            .execute(
                "SELECT outbox.create_channel($1, $2, $3::text::jsonb)",
                &[&unique("nats-bad"), &endpoint, &options],
            )
            .expect_err(&options);
        assert_eq!(code_of(&e), "22023", "{options}: {}", describe(&e));
        assert!(
            error_message(&e).contains(option),
            "{options}: {}",
            describe(&e)
        );
    }
    // The retry budget defaults to a day: capped to the window, and said.
    let name = unique("nats-cap");
    c.execute("SET client_min_messages = notice", &[]).unwrap();
    c.execute(
        "SELECT outbox.create_channel($1, $2, $3::text::jsonb)",
        &[&name, &url, &ok("")],
    )
    .unwrap();
    let (max_age, window): (i64, i64) = c
        .query_one(
            "SELECT (options #>> '{retry,max_age_ms}')::int8, (options ->> 'duplicate_window_ms')::int8
               FROM outbox.channels WHERE name = $1",
            &[&name],
        )
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    assert_eq!((max_age, window), (30_000, 30_000));
    let bound: String = one(
        &mut c,
        "SELECT in_flight_reason FROM outbox.channels WHERE name = $1",
        &[&name],
    );
    assert_eq!(
        bound, "max_in_flight",
        "a nats channel dedupes by Nats-Msg-Id"
    );
    // alter_channel holds a new subject to the stream as well, and changes nothing.
    let e = c
        .execute(
            "SELECT outbox.alter_channel($1, '{\"subject\": \"elsewhere.x\"}')",
            &[&name],
        )
        .expect_err("a subject outside the stream");
    assert_eq!(code_of(&e), "22023", "{}", describe(&e));
    assert!(describe(&e).contains("lies outside"), "{}", describe(&e));
    let subject: String = one(
        &mut c,
        "SELECT options ->> 'subject' FROM outbox.channels WHERE name = $1",
        &[&name],
    );
    assert_eq!(subject, format!("{}.x", stream.to_lowercase()));
}

#[test]
fn credentials_are_masked_and_used() {
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    let token = "s3cret-token-value";
    let nats = NatsServer::start(Some(token));
    let (channel, stream, _) = stream_and_channel(
        &mut c,
        &nats,
        "{p}.{effect_key}",
        &format!(r#""auth": {{"token": "{token}"}}"#),
    );
    enqueue(&mut c, &channel, &format!("{channel}-0"));
    wait_all(&cluster, &channel, "delivered", 1, SETTLE);
    assert_eq!(check_stream(&nats, &stream, &mut c, &channel), 1);
    for view in ["outbox.channels", "outbox.operator_log"] {
        let leaked = count(
            &mut c,
            &format!("SELECT count(*) FROM {view} v WHERE v::text LIKE '%' || $1 || '%'"),
            &[&token],
        );
        assert_eq!(leaked, 0, "{view} shows the token");
    }
    // A wrong token cannot read the stream: the channel is refused, naming the stream.
    let e = c
        .execute(
            "SELECT outbox.create_channel($1, $2, $3::text::jsonb)",
            &[&unique("nats-badtoken"), &nats.url(),
              &format!(r#"{{"kind": "nats", "subject": "x.y", "stream": "{stream}", "auth": {{"token": "not-the-token-7f3a"}}}}"#)],
        )
        .expect_err("a wrong token");
    assert_eq!(code_of(&e), "22023", "{}", describe(&e));
    assert!(
        error_message(&e).contains("stream") && !error_message(&e).contains("not-the-token-7f3a"),
        "{}",
        describe(&e)
    );
}

/// Waits until `n` messages of `channel` are delivered (at least), for a fault mid-load.
#[allow(dead_code)]
fn wait_delivered_at_least(cluster: &Cluster, channel: &str, n: i64) {
    let seen = poll(cluster, SETTLE, |c| {
        Ok((in_state(c, channel, "delivered") >= n).then_some(()))
    });
    assert!(seen.is_some(), "{n} delivered on {channel}");
}

#[test]
fn the_server_killed_and_restarted_mid_load_stores_each_key_once_and_loses_nothing() {
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    let mut nats = NatsServer::start(None);
    for subject in ["{p}.{effect_key}", "{p}.fixed"] {
        let (channel, stream, _) = stream_and_channel(
            &mut c,
            &nats,
            subject,
            r#""timeout_ms": 2000, "connect_timeout_ms": 500"#,
        );
        let enqueue_range = |c: &mut Client, range: std::ops::Range<i32>| {
            let mut tx = c.transaction().unwrap();
            for i in range {
                enqueue(&mut tx, &channel, &format!("{channel}-{i}"));
            }
            tx.commit().unwrap();
        };
        enqueue_range(&mut c, 0..200);
        wait_all(&cluster, &channel, "delivered", 200, SETTLE);
        // The workers hold a connection: they publish into it while the server is gone, and
        // no acknowledgement comes.
        nats.kill9();
        enqueue_range(&mut c, 200..400);
        let waiting = poll(&cluster, SETTLE, |c| {
            Ok((count(c, "SELECT count(*) FROM outbox.attempts a JOIN outbox.messages m ON m.id = a.message_id
                            WHERE m.channel = $1 AND a.error_class = 'ambiguous'", &[&channel]) > 0).then_some(()))
        });
        assert!(
            waiting.is_some(),
            "{subject}: publishes while the server is gone are unacknowledged"
        );
        nats.restart();
        // Nothing is lost: every message ends delivered, or (a fixed subject whose window
        // closed on an unacknowledged publish) uncertain for an operator; none is sent twice.
        let settled = poll(&cluster, Duration::from_secs(90), |c| {
            let done = in_state(c, &channel, "delivered") + in_state(c, &channel, "uncertain");
            Ok((done == 400).then_some(()))
        });
        let held = check_stream(&nats, &stream, &mut c, &channel);
        let delivered = in_state(&mut c, &channel, "delivered");
        assert!(
            settled.is_some(),
            "{subject}: {delivered} delivered of 400 within 90 s"
        );
        assert!(
            held as i64 >= delivered,
            "{subject}: {held} stored, {delivered} delivered"
        );
        if subject.contains("{effect_key}") {
            assert_eq!(
                delivered, 400,
                "a subject that names the key is looked up: all delivered"
            );
        }
        println!("{subject}: 400 messages, server killed and restarted: {delivered} delivered, {} uncertain, {held} keys stored, 0 twice",
                 400 - delivered);
    }
}

#[test]
fn the_stream_deleted_mid_load_holds_the_rest_until_it_is_back() {
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    let nats = NatsServer::start(None);
    let (channel, stream, prefix) = stream_and_channel(&mut c, &nats, "{p}.{effect_key}", "");
    let enqueue_range = |c: &mut Client, range: std::ops::Range<i32>| {
        let mut tx = c.transaction().unwrap();
        for i in range {
            enqueue(&mut tx, &channel, &format!("{channel}-{i}"));
        }
        tx.commit().unwrap();
    };
    enqueue_range(&mut c, 0..100);
    wait_all(&cluster, &channel, "delivered", 100, SETTLE);
    nats.delete_stream(&stream);
    let before: i64 = in_state(&mut c, &channel, "delivered");
    enqueue_range(&mut c, 100..300);
    // Publishes find no stream: transient, retried; nothing is delivered meanwhile.
    let refused = poll(&cluster, SETTLE, |c| {
        Ok((count(
            c,
            "SELECT count(*) FROM outbox.attempts a JOIN outbox.messages m ON m.id = a.message_id
                        WHERE m.channel = $1 AND a.error LIKE '%no responders%'",
            &[&channel],
        ) > 0)
            .then_some(()))
    });
    assert!(
        refused.is_some(),
        "publishes to the deleted stream are refused"
    );
    std::thread::sleep(Duration::from_millis(500));
    let during = in_state(&mut c, &channel, "delivered");
    nats.create_stream(&stream, &[&format!("{prefix}.>")], Duration::from_secs(120));
    wait_all(
        &cluster,
        &channel,
        "delivered",
        300,
        Duration::from_secs(90),
    );
    // The messages delivered before the deletion went with the stream; the rest are in the
    // new one, each once.
    let held = check_stream_after_delete(&nats, &stream, &mut c, &channel, during);
    println!("stream deleted after {before} deliveries ({during} delivered while it was gone): 300 delivered, {held} in the new stream, 0 twice");
}

/// [`check_stream`] for a stream that was deleted and made again: the messages delivered
/// before it was deleted (`gone` of them at most) are no longer in it.
fn check_stream_after_delete(
    nats: &NatsServer,
    stream: &str,
    c: &mut Client,
    channel: &str,
    gone: i64,
) -> usize {
    let copies = nats.copies_by_id(stream);
    assert!(
        copies.values().all(|n| *n == 1),
        "a key stored twice in the new stream"
    );
    let keys = sent_keys(c, channel);
    let missing = keys
        .iter()
        .filter(|(k, _, _)| !copies.contains_key(k))
        .count() as i64;
    assert!(missing <= gone, "{missing} delivered messages are not in the new stream, but only {gone} were delivered before it was deleted");
    copies.len()
}
