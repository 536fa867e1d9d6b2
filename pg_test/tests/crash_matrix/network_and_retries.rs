//! Beyond the restart points: a network cut mid-send, a server crash during backoff, a spent
//! retry budget.

use super::*;

// ---------------------------------------------------------------------------------------
// Network cut in the middle of a send
// ---------------------------------------------------------------------------------------

pub(super) fn network_cut(scenario: &str) -> Vec<Row> {
    let cluster = Cluster::from_env();
    wait_for_workers(&cluster, &[]);
    let sim = Simulator::start();
    // When the provider confirmed (a 200 written, or a lookup that found it), per channel:
    // taken before the answer is written, so before the worker can have read it.
    let confirmed: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let conf = confirmed.clone();
    sim.set_observer(move |r| {
        if (r.kind == "send" && r.status == Some(200)) || r.outcome == "lookup:found" {
            conf.lock()
                .unwrap()
                .entry(r.channel.clone())
                .or_insert_with(Instant::now);
        }
    });
    let mut c = cluster.connect();
    let retry = r#"{"base_ms": 1000, "max_ms": 2000, "jitter": "none"}"#;
    let chans = make_channels(&mut c, &sim, "cut", retry, &json!({}), &|ch| {
        sim.send_url(ch)
    });
    for (_, ch) in &chans {
        sim.set_plan(ch, vec![Action::DropAfterRead { store: true }]);
    }
    let lanes = enqueue_all(&mut c, &chans, None);
    drop(c);

    // Poll outbox.status() of every message; keep every value seen with the instant the
    // query returned.
    let stop = Arc::new(AtomicBool::new(false));
    let ids: Vec<i64> = lanes.iter().map(|l| l.id).collect();
    let poller = {
        let stop = stop.clone();
        let conninfo = cluster.conninfo();
        let ids = ids.clone();
        std::thread::spawn(move || {
            let mut seen: HashMap<i64, Vec<(String, Instant)>> = HashMap::new();
            let mut client: Option<Client> = None;
            while !stop.load(Ordering::Relaxed) {
                if client.as_ref().is_none_or(|c| c.is_closed()) {
                    client = Client::connect(&conninfo, NoTls).ok();
                }
                if let Some(c) = client.as_mut() {
                    match c.query(
                        "SELECT id, coalesce(outbox.status(id)::text, 'NULL') FROM unnest($1::int8[]) id",
                        &[&ids],
                    ) {
                        Ok(rows) => {
                            let at = Instant::now();
                            for r in rows {
                                let v = seen.entry(r.get(0)).or_default();
                                let s: String = r.get(1);
                                if v.last().map(|l| &l.0) != Some(&s) {
                                    v.push((s, at));
                                }
                            }
                        }
                        Err(_) => client = None,
                    }
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            seen
        })
    };
    let expect = |kind: Kind| match kind {
        Kind::Dedupe => delivered(2, 2, 0, 0, "worker").outcomes(&["dropped", "deduped"]),
        Kind::Reconcile => delivered(1, 1, 0, 1, "reconcile").outcomes(&["dropped"]),
        Kind::Neither => uncertain(1, 1, 1, 0).outcomes(&["dropped"]),
    };
    let mut rows = settle_and_judge(&cluster, &sim, scenario, &lanes, &expect, &no_extra);
    stop.store(true, Ordering::Relaxed);
    let seen = poller.join().expect("status poller");
    let confirmed = confirmed.lock().unwrap().clone();
    for (row, lane) in rows.iter_mut().zip(&lanes) {
        let values = seen.get(&lane.id).cloned().unwrap_or_default();
        let path: Vec<&str> = values.iter().map(|v| v.0.as_str()).collect();
        let mut bad = Vec::new();
        if let Some((_, at)) = values.iter().find(|v| v.0 == "delivered") {
            match confirmed.get(&lane.ch) {
                Some(c) if c < at => {}
                other => bad.push(format!(
                    "status() said delivered before the provider confirmed ({other:?})"
                )),
            }
        }
        if lane.kind == Kind::Neither && path.contains(&"delivered") {
            bad.push("status() said delivered on the neither-channel".into());
        }
        // The first value the poller sees is an intermediate state: queued or sending, or
        // already uncertain when the worker settled the cut before the poller's first query.
        if !matches!(
            path.first(),
            Some(&"queued") | Some(&"sending") | Some(&"uncertain")
        ) {
            bad.push(format!("first status seen {:?}", path.first()));
        }
        row.local = format!("{}; status() seen: {}", row.local, path.join(" → "));
        if !bad.is_empty() {
            row.pass = false;
            row.verdict = format!(
                "FAIL: {}{}",
                bad.join("; "),
                row.verdict
                    .strip_prefix("FAIL:")
                    .map(|r| format!(";{r}"))
                    .unwrap_or_default()
            );
        }
    }
    rows
}

// ---------------------------------------------------------------------------------------
// Postgres crash-restart during backoff
// ---------------------------------------------------------------------------------------

pub(super) fn restart_during_backoff(scenario: &str) -> Vec<Row> {
    let retry = r#"{"base_ms": 5000, "max_ms": 5000, "jitter": "none"}"#;
    let (cluster, before, sim, mut c, chans) = start_with_channels("bo", retry);
    for (_, ch) in &chans {
        sim.set_plan(ch, vec![Action::Status(503)]);
    }
    let lanes = enqueue_all(&mut c, &chans, None);
    let ids: Vec<i64> = lanes.iter().map(|l| l.id).collect();
    let schedule = |c: &mut Client| -> Result<Vec<(String, i32, f64, String)>, postgres::Error> {
        Ok(c.query(
            "SELECT state::text, attempts, (extract(epoch FROM next_attempt_at) * 1000)::float8, effect_key
               FROM outbox._messages WHERE id = ANY($1) ORDER BY id",
            &[&ids],
        )?
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect())
    };
    let in_backoff = poll(&cluster, CRASH_SETTLE, |c| {
        let s = schedule(c)?;
        Ok((s.len() == 3 && s.iter().all(|m| m.0 == "queued" && m.1 == 1)).then_some(s))
    })
    .expect("the messages did not reach backoff after their first 503");
    drop(c);
    cluster.crash_restart();
    let mut c = cluster.connect();
    let restarted_ms: f64 = one(
        &mut c,
        "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::float8",
        &[],
    );
    let after = schedule(&mut c).unwrap();
    drop(c);
    let mut pre = Vec::new();
    for (b, a) in in_backoff.iter().zip(&after) {
        if a.2 != b.2 || a.3 != b.3 {
            pre.push(format!(
                "schedule or key changed across the restart: {b:?} → {a:?}"
            ));
        }
        if restarted_ms + 200.0 < b.2 && (a.0 != "queued" || a.1 != 1) {
            pre.push(format!("retried before its time: {a:?}"));
        }
    }
    wait_for_workers(&cluster, &before);
    let due: HashMap<i64, f64> = ids
        .iter()
        .copied()
        .zip(in_backoff.iter().map(|m| m.2))
        .collect();
    let mut rows = settle_and_judge(
        &cluster,
        &sim,
        scenario,
        &lanes,
        &|_| delivered(2, 2, 0, 0, "worker").outcomes(&["status:503", "accepted"]),
        &|lane, _| {
            let mut bad = pre.clone();
            let sends = sim.sends(&lane.ch);
            if let Some(second) = sends.get(1) {
                let at = second
                    .received_at
                    .duration_since(UNIX_EPOCH)
                    .unwrap()
                    .as_secs_f64()
                    * 1000.0;
                if at + 1.0 < due[&lane.id] {
                    bad.push(format!(
                        "retried {:.0} ms before next_attempt_at",
                        due[&lane.id] - at
                    ));
                }
            }
            bad
        },
    );
    for r in &mut rows {
        r.local = format!(
            "{}; next_attempt_at and key unchanged by the restart",
            r.local
        );
    }
    rows
}

// ---------------------------------------------------------------------------------------
// Retry budget exhausted
// ---------------------------------------------------------------------------------------

pub(super) fn budget_exhausted(scenario: &str) -> Vec<Row> {
    let (cluster, mut c, sim) = cluster_and_sim();
    wait_for_workers(&cluster, &[]);
    let retry = r#"{"max_attempts": 3, "base_ms": 100, "jitter": "none"}"#;
    let chans = make_channels(&mut c, &sim, "ex", retry, &json!({}), &|ch| {
        sim.send_url(ch)
    });
    for (_, ch) in &chans {
        sim.set_default(ch, Action::Status(503));
    }
    let lanes = enqueue_all(&mut c, &chans, None);
    drop(c);
    let expect = |_| Expect {
        state: "exhausted",
        stored: 0,
        sends: 3,
        send_rows: 3,
        recovery_rows: 0,
        lookups: 0,
        ledger_by: None,
        outcomes: Some(vec!["status:503"; 3]),
    };
    let mut rows = settle_and_judge(&cluster, &sim, scenario, &lanes, &expect, &|_, o| {
        let mut bad = Vec::new();
        let reason = o.work_queue_reason.clone().unwrap_or_default();
        if !reason.contains("retry budget spent") {
            bad.push(format!("work_queue reason {reason:?}"));
        }
        let e = o.last_error.clone().unwrap_or_default();
        if !(e.contains("HTTP 503") && e.contains("3 of 3 attempts")) {
            bad.push(format!("last_error {e:?}"));
        }
        bad
    });
    for (r, lane) in rows.iter_mut().zip(&lanes) {
        let o = observe(&cluster, &sim, lane);
        r.local = format!(
            "{}: \"{}\"",
            r.local,
            o.work_queue_reason.unwrap_or_default()
        );
    }
    rows
}
