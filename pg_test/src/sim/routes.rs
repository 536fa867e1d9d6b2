//! Which endpoint a request hits, and what a send or a lookup does: dedupe, storing,
//! recording, and the JSON of the introspection endpoints.

use super::*;

enum Route<'a> {
    Send(Cow<'a, str>),
    Lookup(Cow<'a, str>, LookupBy, Cow<'a, str>),
    /// A request under `/ch/{channel}` that is neither; with the status to answer.
    ChannelOther(Cow<'a, str>, u16),
    Stats,
    Requests(Option<String>),
    NotFound,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum LookupBy {
    Key,
    Id,
}

fn route<'a>(method: &str, target: &'a str) -> Route<'a> {
    // Absolute form (`http://host/path`) as a proxy-style client might send.
    let target = match target.strip_prefix("http://") {
        Some(rest) => rest.find('/').map_or("/", |i| &rest[i..]),
        None => target,
    };
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (target, None),
    };
    let read_only = method == "GET" || method == "HEAD";
    if let Some(rest) = path.strip_prefix("/ch/") {
        let mut parts = rest.splitn(3, '/');
        let channel = parts.next().unwrap_or("");
        if channel.is_empty() {
            return Route::NotFound;
        }
        let channel = pct_decode(channel);
        return match (parts.next(), parts.next()) {
            (None, _) if read_only => Route::ChannelOther(channel, 405),
            (None, _) => Route::Send(channel),
            (Some(by @ ("by-key" | "by-id")), Some(v)) if read_only && !v.is_empty() => {
                let by = if by == "by-key" {
                    LookupBy::Key
                } else {
                    LookupBy::Id
                };
                Route::Lookup(channel, by, pct_decode(v))
            }
            _ => Route::ChannelOther(channel, 404),
        };
    }
    match path {
        "/_stats" if read_only => Route::Stats,
        "/_requests" if read_only => Route::Requests(query.and_then(|q| {
            q.split('&')
                .filter_map(|kv| kv.split_once('='))
                .find(|(k, _)| *k == "channel")
                .map(|(_, v)| pct_decode(&v.replace('+', " ")).into_owned())
        })),
        _ => Route::NotFound,
    }
}

pub(super) async fn handle(shared: &Shared, req: &Request<'_>, out: &mut Out) -> After {
    bump(&shared.counters.requests);
    match route(req.method, req.target) {
        Route::Send(channel) => handle_send(shared, req, &channel, out).await,
        Route::Lookup(channel, by, value) => handle_lookup(shared, req, &channel, by, &value, out),
        Route::ChannelOther(channel, status) => {
            bump(&shared.counters.other);
            let draft = shared
                .building()
                .then(|| req.draft(shared, &channel, "other"));
            let mut st = shared.lock();
            let seq = st.next_seq();
            let observer = st.observer.clone();
            st.channel_mut(&channel);
            let rec = draft.map(|mut r| {
                r.seq = seq;
                r.outcome = format!("status:{status}");
                r.status = Some(status);
                r
            });
            finish_record(shared, st, &channel, rec, observer);
            out.json_error(
                status,
                if status == 405 {
                    "sends are POSTed to /ch/{channel}"
                } else {
                    "not found"
                },
            );
            After::Respond
        }
        Route::Stats => {
            bump(&shared.counters.other);
            let c = shared.counters.snapshot();
            let v = serde_json::json!({
                "requests": c.requests,
                "sends": c.sends,
                "accepted": c.accepted,
                "deduped": c.deduped,
                "stored": c.stored,
                "status_errors": c.status_errors,
                "hangs": c.hangs,
                "dropped": c.dropped,
                "lookups": c.lookups,
                "lookups_found": c.lookups_found,
                "lookups_not_found": c.lookups_not_found,
                "bad_requests": c.bad_requests,
                "other": c.other,
                "connections": c.connections,
            });
            json_response(out, 200, &v);
            After::Respond
        }
        Route::Requests(channel) => {
            bump(&shared.counters.other);
            let Some(channel) = channel else {
                out.json_error(400, "missing ?channel=");
                return After::Respond;
            };
            let list: Vec<serde_json::Value> = {
                let st = shared.lock();
                st.channels
                    .get(&channel)
                    .map(|c| c.received.iter().map(received_json).collect())
                    .unwrap_or_default()
            };
            json_response(out, 200, &serde_json::Value::Array(list));
            After::Respond
        }
        Route::NotFound => {
            bump(&shared.counters.other);
            out.json_error(404, "not found");
            After::Respond
        }
    }
}

async fn handle_send(shared: &Shared, req: &Request<'_>, channel: &str, out: &mut Out) -> After {
    bump(&shared.counters.sends);
    let record_body = shared.record_bodies.load(Ordering::Relaxed);
    let mut draft = shared
        .building()
        .then(|| req.draft(shared, channel, "send"));

    // Everything decided under one short lock hold, except what AcceptAfter defers.
    let (seq, key, from_dedupe, delay) = {
        let mut st = shared.lock();
        let seq = st.next_seq();
        let observer = st.observer.clone();
        let ch = st.channel_mut(channel);
        ch.sends += 1;
        let (key, from_dedupe) = req.send_key(ch.dedupe_header.as_deref());
        let step = ch.next_step(key.as_deref());
        if let Some(r) = draft.as_mut() {
            r.seq = seq;
            r.key = key.clone();
        }
        match step {
            Step::Status(status, extra) => {
                bump(&shared.counters.status_errors);
                let rec = draft.map(|mut r| {
                    r.outcome = format!("status:{status}");
                    r.status = Some(status);
                    r
                });
                finish_record(shared, st, channel, rec, observer);
                out.json_error(status, &format!("simulated status {status}"));
                for (n, v) in &extra {
                    out.header(n, v);
                }
                return After::Respond;
            }
            Step::Hang(store) | Step::Drop(store) => {
                let hang = matches!(step, Step::Hang(_));
                let id = store.then(|| {
                    let (id, deduped) =
                        ch.store(key.as_deref(), from_dedupe, req.body, record_body);
                    if !deduped {
                        bump(&shared.counters.stored);
                    }
                    id
                });
                bump(if hang {
                    &shared.counters.hangs
                } else {
                    &shared.counters.dropped
                });
                let rec = draft.map(|mut r| {
                    r.outcome = if hang { "hang" } else { "dropped" }.to_string();
                    r.external_id = id;
                    r
                });
                finish_record(shared, st, channel, rec, observer);
                return if hang { After::Hang } else { After::Drop };
            }
            Step::Accept(None, size) => {
                let (id, deduped) = ch.store(key.as_deref(), from_dedupe, req.body, record_body);
                let rec = draft.map(|mut r| {
                    r.outcome = if deduped { "deduped" } else { "accepted" }.to_string();
                    r.status = Some(200);
                    r.external_id = Some(id.clone());
                    r
                });
                count_accept(shared, deduped);
                finish_record(shared, st, channel, rec, observer);
                accept_response(out, &id, size);
                return After::Respond;
            }
            Step::Accept(Some(delay), _) => {
                // Recorded now as "delayed" (so waiters see the send), completed later.
                if let Some(r) = draft.as_ref() {
                    let mut r = r.clone();
                    r.outcome = "delayed".to_string();
                    if shared.record_requests.load(Ordering::Relaxed) {
                        ch.received.push(r);
                    }
                }
                notify(shared, &st);
                (seq, key, from_dedupe, delay)
            }
        }
    };

    tokio::time::sleep(delay).await;

    let mut st = shared.lock();
    let observer = st.observer.clone();
    let ch = st.channel_mut(channel);
    let (id, deduped) = ch.store(key.as_deref(), from_dedupe, req.body, record_body);
    count_accept(shared, deduped);
    let outcome = if deduped { "deduped" } else { "accepted" };
    // Complete the "delayed" entry in place (it is gone if the channel was reset).
    if let Some(r) = ch.received.iter_mut().rev().find(|r| r.seq == seq) {
        r.outcome = outcome.to_string();
        r.status = Some(200);
        r.external_id = Some(id.clone());
    }
    notify(shared, &st);
    drop(st);
    if let (Some(obs), Some(mut r)) = (observer, draft) {
        r.outcome = outcome.to_string();
        r.status = Some(200);
        r.external_id = Some(id.clone());
        obs(&r);
    }
    accept_response(out, &id, 0);
    After::Respond
}

fn count_accept(shared: &Shared, deduped: bool) {
    if deduped {
        bump(&shared.counters.deduped);
    } else {
        bump(&shared.counters.accepted);
        bump(&shared.counters.stored);
    }
}

/// The answer of an accept; `size > 0`: padded to `size` bytes (see
/// [`Action::AcceptLarge`]).
fn accept_response(out: &mut Out, id: &str, size: usize) {
    out.start(200);
    out.header("Content-Type", "application/json");
    out.header("X-Message-Id", id);
    out.body.extend_from_slice(b"{\"id\":");
    json_str(&mut out.body, id);
    if size == 0 {
        out.body.extend_from_slice(b",\"status\":\"accepted\"}");
        return;
    }
    out.body
        .extend_from_slice(b",\"status\":\"accepted\",\"pad\":\"");
    out.tail = b"\"}";
    out.pad = size.saturating_sub(out.body.len() + out.tail.len());
}

fn handle_lookup(
    shared: &Shared,
    req: &Request<'_>,
    channel: &str,
    by: LookupBy,
    value: &str,
    out: &mut Out,
) -> After {
    bump(&shared.counters.lookups);
    let draft = shared
        .building()
        .then(|| req.draft(shared, channel, "lookup"));
    let mut st = shared.lock();
    let seq = st.next_seq();
    let observer = st.observer.clone();
    let ch = st.channel_mut(channel);
    let action = ch.lookup_plan.pop_front().unwrap_or(LookupAction::Answer);
    let (outcome, status, external_id, after): (
        Cow<'static, str>,
        Option<u16>,
        Option<String>,
        After,
    ) = match action {
        LookupAction::Answer => {
            let idx = match by {
                LookupBy::Key => ch.by_key.get(value),
                LookupBy::Id => ch.by_id.get(value),
            };
            match idx.map(|&i| &ch.stored[i]) {
                Some(m) => {
                    bump(&shared.counters.lookups_found);
                    out.start(200);
                    out.header("Content-Type", "application/json");
                    out.body.extend_from_slice(b"{\"found\":true,\"id\":");
                    json_str(&mut out.body, &m.external_id);
                    out.body.extend_from_slice(b",\"key\":");
                    match &m.key {
                        Some(k) => json_str(&mut out.body, k),
                        None => out.body.extend_from_slice(b"null"),
                    }
                    out.body.push(b'}');
                    (
                        "lookup:found".into(),
                        Some(200),
                        Some(m.external_id.clone()),
                        After::Respond,
                    )
                }
                None => {
                    bump(&shared.counters.lookups_not_found);
                    out.start(404);
                    out.header("Content-Type", "application/json");
                    out.body.extend_from_slice(b"{\"found\":false}");
                    ("lookup:not_found".into(), Some(404), None, After::Respond)
                }
            }
        }
        LookupAction::Status(s) => {
            out.json_error(s, &format!("simulated status {s}"));
            (
                format!("lookup:status:{s}").into(),
                Some(s),
                None,
                After::Respond,
            )
        }
        LookupAction::Drop => {
            bump(&shared.counters.dropped);
            ("lookup:dropped".into(), None, None, After::Drop)
        }
    };
    let rec = draft.map(|mut r| {
        r.seq = seq;
        r.outcome = outcome.into_owned();
        r.status = status;
        r.external_id = external_id;
        r.key = (by == LookupBy::Key).then(|| value.to_owned());
        r
    });
    finish_record(shared, st, channel, rec, observer);
    after
}

/// Keeps the record (when recording), wakes waiters, releases the lock, then calls the
/// observer.
fn finish_record(
    shared: &Shared,
    mut st: MutexGuard<'_, State>,
    channel: &str,
    rec: Option<Received>,
    observer: Option<Observer>,
) {
    let recording = shared.record_requests.load(Ordering::Relaxed);
    let mut for_observer = None;
    if let Some(r) = rec {
        let r = if observer.is_some() {
            for_observer = Some(r.clone());
            r
        } else {
            r
        };
        if recording {
            if let Some(ch) = st.channels.get_mut(channel) {
                ch.received.push(r);
            }
        }
    }
    notify(shared, &st);
    drop(st);
    if let (Some(obs), Some(r)) = (observer, for_observer) {
        obs(&r);
    }
}

fn notify(shared: &Shared, st: &State) {
    if st.waiters > 0 {
        shared.cond.notify_all();
    }
}

fn json_response(out: &mut Out, status: u16, v: &serde_json::Value) {
    out.start(status);
    out.header("Content-Type", "application/json");
    // Serializing a Value into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut out.body, v);
}

fn received_json(r: &Received) -> serde_json::Value {
    let at_ms = r
        .received_at
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    serde_json::json!({
        "seq": r.seq,
        "channel": r.channel,
        "kind": r.kind,
        "method": r.method,
        "path": r.path,
        "headers": r.headers.iter().map(|(n, v)| serde_json::json!([n, v])).collect::<Vec<_>>(),
        "body": String::from_utf8_lossy(&r.body),
        "received_at_ms": at_ms,
        "outcome": r.outcome,
        "status": r.status,
        "external_id": r.external_id,
        "key": r.key,
    })
}

/// Appends `s` as a JSON string literal.
pub(super) fn json_str(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    for c in s.chars() {
        match c {
            '"' => out.extend_from_slice(b"\\\""),
            '\\' => out.extend_from_slice(b"\\\\"),
            '\n' => out.extend_from_slice(b"\\n"),
            '\r' => out.extend_from_slice(b"\\r"),
            '\t' => out.extend_from_slice(b"\\t"),
            c if (c as u32) < 0x20 => {
                let _ = write!(VecWriter(out), "\\u{:04x}", c as u32);
            }
            c => {
                let mut b = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut b).as_bytes());
            }
        }
    }
    out.push(b'"');
}

fn pct_decode(s: &str) -> Cow<'_, str> {
    if !s.contains('%') {
        return Cow::Borrowed(s);
    }
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 3 <= b.len() {
            let hi = (b[i + 1] as char).to_digit(16);
            let lo = (b[i + 2] as char).to_digit(16);
            if let (Some(hi), Some(lo)) = (hi, lo) {
                out.push((hi * 16 + lo) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    Cow::Owned(String::from_utf8_lossy(&out).into_owned())
}

/// Percent-encodes everything but RFC 3986 unreserved characters (for one path segment).
pub(super) fn pct_encode(s: &str) -> Cow<'_, str> {
    let unreserved = |b: u8| b.is_ascii_alphanumeric() || b"-._~".contains(&b);
    if s.bytes().all(unreserved) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() * 3);
    for b in s.bytes() {
        if unreserved(b) {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    Cow::Owned(out)
}
