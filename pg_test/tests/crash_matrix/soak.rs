//! The soak: many messages, random provider faults, killed workers and restarted servers;
//! then 0 lost, 0 duplicates.

use super::page::{record_doc_region, run_header, Claim};
use super::*;

// ---------------------------------------------------------------------------------------
// The soak
// ---------------------------------------------------------------------------------------

/// Enqueues `plan` in batches from its own thread, surviving server crashes: a batch whose
/// COMMIT failed is re-run with the same effect keys (enqueue of an existing key returns the
/// existing message), so every batch ends committed exactly once. Returns the committed keys
/// and how many batch runs had to be repeated.
fn spawn_enqueuer(
    conninfo: String,
    plan: Vec<(String, String)>,
    batch: usize,
    pause: Duration,
    done: Arc<AtomicBool>,
) -> std::thread::JoinHandle<(Vec<String>, usize)> {
    std::thread::spawn(move || {
        let mut committed = Vec::with_capacity(plan.len());
        let mut repeats = 0;
        let mut client: Option<Client> = None;
        for chunk in plan.chunks(batch) {
            let deadline = Instant::now() + Duration::from_secs(120);
            loop {
                if client.as_ref().is_none_or(|c| c.is_closed()) {
                    client = Client::connect(&conninfo, NoTls).ok();
                }
                let ok = match client.as_mut() {
                    Some(c) => (|| -> Result<(), postgres::Error> {
                        let mut tx = c.transaction()?;
                        for (ch, key) in chunk {
                            try_enqueue(&mut tx, ch, key)?;
                        }
                        tx.commit()
                    })()
                    .is_ok(),
                    None => false,
                };
                if ok {
                    break;
                }
                if client.is_some() {
                    repeats += 1;
                }
                client = None;
                assert!(
                    Instant::now() < deadline,
                    "a batch could not be committed within 120 s"
                );
                std::thread::sleep(Duration::from_millis(200));
            }
            committed.extend(chunk.iter().map(|(_, k)| k.clone()));
            std::thread::sleep(pause);
        }
        done.store(true, Ordering::Relaxed);
        (committed, repeats)
    })
}

#[derive(Debug, Default, Clone)]
struct SoakLane {
    committed: usize,
    delivered: usize,
    uncertain: usize,
    exhausted: usize,
    failed: usize,
    other: usize,
    missing: usize,
    no_reason: usize,
    sends: usize,
    stored: usize,
    duplicates: usize,
    delivered_not_held: usize,
    /// Uncertain messages the provider does hold (the rest it never received).
    uncertain_held: usize,
    key_mismatch_rows: i64,
    key_mismatch_provider: usize,
    send_rows: i64,
    recovery_rows: i64,
    lookup_rows: i64,
    ledger: i64,
}

#[test]
fn soak() {
    let full = std::env::var("OUTBOX_SOAK_FULL").as_deref() == Ok("1");
    let n: usize = if full { 10_000 } else { 1_000 };
    let (batch, pause) = if full {
        (125, Duration::from_millis(300))
    } else {
        (25, Duration::from_millis(400))
    };
    let cluster = Cluster::from_env();
    let mut workers = wait_for_workers(&cluster, &[]);
    let started = Instant::now();
    let sim = Simulator::start();
    let mut c = cluster.connect();
    let retry = r#"{"base_ms": 150, "max_ms": 2000, "max_attempts": 10}"#;
    let chans = make_channels(&mut c, &sim, "soak", retry, &json!({}), &|ch| {
        sim.send_url(ch)
    });
    let seed = 0x5eed_0000
        + (SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs()
            % 1000);
    for (i, (_, ch)) in chans.iter().enumerate() {
        sim.set_default(
            ch,
            Action::Random(RandomFaults {
                drop_after_read_store: 0.05,
                status_503: 0.05,
                status_429: 0.02,
                retry_after_s: 1,
                seed: seed + i as u64,
            }),
        );
    }
    drop(c);
    let tag = unique("soak");
    let plan: Vec<(String, String)> = (0..n)
        .map(|i| (chans[i % 3].1.clone(), format!("{tag}-{i}")))
        .collect();
    let kind_of_key: HashMap<String, Kind> = (0..n)
        .map(|i| (plan[i].1.clone(), chans[i % 3].0))
        .collect();

    // Chaos while the enqueuer runs and until the backlog is nearly drained: kill -9 of a
    // worker every few seconds (at least six; a worker with messages in flight when there is
    // one), and two immediate restarts (after the 2nd and the 5th kill).
    let names: Vec<String> = chans.iter().map(|(_, ch)| ch.clone()).collect();
    let backlog = |c: &mut Client| -> Result<i64, postgres::Error> {
        Ok(c.query_one(
            "SELECT count(*) FROM outbox.messages WHERE channel = ANY($1) AND state IN ('queued', 'sending')",
            &[&names],
        )?
        .get(0))
    };
    let done = Arc::new(AtomicBool::new(false));
    let enqueuer = spawn_enqueuer(cluster.conninfo(), plan.clone(), batch, pause, done.clone());
    let (mut kills, mut restarts, mut busy_kills) = (0usize, 0usize, 0usize);
    let chaos_cap = Duration::from_secs(if full { 300 } else { 120 });
    loop {
        std::thread::sleep(Duration::from_millis(2000));
        let finished = done.load(Ordering::Relaxed) || enqueuer.is_finished();
        let left = if finished {
            poll(&cluster, Duration::from_secs(30), |c| backlog(c).map(Some)).unwrap_or(0)
        } else {
            i64::MAX
        };
        let enough = kills >= 6 && restarts >= 2;
        if finished && enough && (left as usize <= n / 20 || started.elapsed() > chaos_cap) {
            break;
        }
        if (kills == 2 && restarts == 0) || (kills == 5 && restarts == 1) {
            cluster.crash_restart();
            restarts += 1;
        } else {
            let busy = poll(&cluster, Duration::from_millis(1500), |c| {
                Ok(c.query_opt(
                    "SELECT pid FROM outbox.worker_status() WHERE in_flight > 0 ORDER BY random() LIMIT 1",
                    &[],
                )?
                .and_then(|r| r.get::<_, Option<i32>>(0)))
            });
            let victim = busy.unwrap_or(workers[kills % workers.len()]);
            if kill_9(victim) {
                kills += 1;
                busy_kills += usize::from(busy.is_some());
            }
        }
        workers = wait_for_workers(&cluster, &workers);
    }
    let (committed, repeats) = enqueuer.join().expect("enqueuer");
    let chaos_s = started.elapsed().as_secs_f64();

    // Quiescence: nothing queued or in flight, no reconcile-channel message waiting for its
    // lookup; then one reconcile() pass, and quiescence again.
    let rc_name = chans[1].1.clone();
    let pending = |c: &mut Client| -> Result<i64, postgres::Error> {
        Ok(c.query_one(
            "SELECT count(*) FROM outbox.messages
              WHERE channel = ANY($1) AND (state IN ('queued', 'sending') OR (state = 'uncertain' AND channel = $2))",
            &[&names, &rc_name],
        )?
        .get(0))
    };
    let quiet_for = |secs: u64| {
        let mut zero_since: Option<Instant> = None;
        poll(
            &cluster,
            Duration::from_secs(if full { 600 } else { 180 }),
            |c| {
                if pending(c)? == 0 {
                    let z = *zero_since.get_or_insert_with(Instant::now);
                    Ok((z.elapsed() >= Duration::from_secs(secs)).then_some(()))
                } else {
                    zero_since = None;
                    Ok(None)
                }
            },
        )
        .is_some()
    };
    let quiet1 = quiet_for(3);
    let mut c = cluster.connect();
    let rec = c
        .query_one(
            "SELECT checked, delivered, not_found, unavailable FROM outbox.reconcile()",
            &[],
        )
        .expect("outbox.reconcile()");
    let reconcile_counts: (i32, i32, i32, i32) = (rec.get(0), rec.get(1), rec.get(2), rec.get(3));
    let quiet2 = quiet_for(2);
    let total_s = started.elapsed().as_secs_f64();

    // The local view.
    let committed_set: HashSet<String> = committed.iter().cloned().collect();
    let mut table_keys: HashMap<String, (String, Option<String>)> = HashMap::new();
    for r in c
        .query(
            "SELECT m.effect_key, m.state::text, w.reason FROM outbox.messages m
               LEFT JOIN outbox.work_queue w ON w.id = m.id WHERE m.channel = ANY($1)",
            &[&names],
        )
        .unwrap()
    {
        table_keys.insert(r.get(0), (r.get(1), r.get(2)));
    }
    let mut lanes: BTreeMap<Kind, SoakLane> =
        KINDS.iter().map(|k| (*k, SoakLane::default())).collect();
    let mut extra_rows = 0usize;
    for key in table_keys.keys() {
        if !committed_set.contains(key) {
            extra_rows += 1;
        }
    }
    for key in &committed_set {
        let l = lanes.get_mut(&kind_of_key[key]).unwrap();
        l.committed += 1;
        match table_keys.get(key) {
            None => l.missing += 1,
            Some((state, reason)) => {
                match state.as_str() {
                    "delivered" => l.delivered += 1,
                    "uncertain" => l.uncertain += 1,
                    "exhausted" => l.exhausted += 1,
                    "failed" => l.failed += 1,
                    _ => l.other += 1,
                }
                if state != "delivered" && reason.as_deref().is_none_or(str::is_empty) {
                    l.no_reason += 1;
                }
            }
        }
    }
    for r in c
        .query(
            "SELECT m.channel, a.kind, count(*),
                    count(*) FILTER (WHERE a.effect_key_sent IS DISTINCT FROM m.effect_key)
               FROM outbox.attempts a JOIN outbox.messages m ON m.id = a.message_id
              WHERE m.channel = ANY($1) GROUP BY 1, 2",
            &[&names],
        )
        .unwrap()
    {
        let ch: String = r.get(0);
        let kind = chans.iter().find(|(_, c)| *c == ch).unwrap().0;
        let l = lanes.get_mut(&kind).unwrap();
        let (k, n, bad): (String, i64, i64) = (r.get(1), r.get(2), r.get(3));
        match k.as_str() {
            "send" => l.send_rows += n,
            "recovery" => l.recovery_rows += n,
            _ => l.lookup_rows += n,
        }
        l.key_mismatch_rows += bad;
    }
    for r in c
        .query(
            "SELECT m.channel, count(*) FROM outbox.ledger l JOIN outbox.messages m ON m.id = l.message_id
              WHERE m.channel = ANY($1) GROUP BY 1",
            &[&names],
        )
        .unwrap()
    {
        let ch: String = r.get(0);
        let kind = chans.iter().find(|(_, c)| *c == ch).unwrap().0;
        lanes.get_mut(&kind).unwrap().ledger = r.get(1);
    }

    // The provider's view.
    for (kind, ch) in &chans {
        let l = lanes.get_mut(kind).unwrap();
        let sends = sim.sends(ch);
        l.sends = sends.len();
        l.key_mismatch_provider = sends
            .iter()
            .filter(|r| {
                let k = provider_key(*kind, r);
                k.is_none()
                    || k != body_key(&r.body)
                    || !committed_set.contains(k.as_deref().unwrap_or(""))
            })
            .count();
        let stored = sim.stored(ch);
        l.stored = stored.len();
        let mut per_key: HashMap<String, usize> = HashMap::new();
        for s in &stored {
            let k = match kind {
                Kind::Neither => body_key(&s.body),
                _ => s.key.clone(),
            }
            .unwrap_or_default();
            *per_key.entry(k).or_default() += 1;
        }
        l.duplicates = per_key.values().filter(|n| **n > 1).count();
        l.uncertain_held = table_keys
            .iter()
            .filter(|(k, (s, _))| s == "uncertain" && kind_of_key.get(*k) == Some(kind))
            .filter(|(k, _)| per_key.get(*k).copied().unwrap_or(0) == 1)
            .count();
        l.delivered_not_held = table_keys
            .iter()
            .filter(|(k, (s, _))| s == "delivered" && kind_of_key.get(*k) == Some(kind))
            .filter(|(k, _)| per_key.get(*k).copied().unwrap_or(0) != 1)
            .count();
    }

    // Report.
    let scenario = format!(
        "soak: {n} messages, random faults (5% drop after store, 5% 503, 2% 429), {kills} × kill -9, {restarts} × pg_ctl stop -m immediate"
    );
    let mut rows = Vec::new();
    let mut failures = Vec::new();
    for (kind, l) in &lanes {
        let (row, bad) = soak_row(&scenario, *kind, l);
        if !bad.is_empty() {
            failures.push(format!("{}: {}", kind.label(), bad.join("; ")));
        }
        rows.push(row);
    }
    if extra_rows > 0 {
        failures.push(format!("{extra_rows} messages nobody committed"));
    }
    if !(quiet1 && quiet2) {
        failures.push("the run did not become quiet".into());
    }
    if kills < 6 || restarts != 2 {
        failures.push(format!(
            "chaos too small: {kills} kills, {restarts} restarts"
        ));
    }
    let figures = format!(
        "soak: {n} messages in {} batches ({repeats} batch runs repeated after a crash), {kills} × kill -9 of a worker ({busy_kills} of them with messages in flight), {restarts} × pg_ctl stop -m immediate; \
         chaos {chaos_s:.0} s, total {total_s:.0} s; reconcile() once: checked {}, delivered {}, not_found {}, unavailable {}; \
         simulator counters {:?}",
        n.div_ceil(batch),
        reconcile_counts.0,
        reconcile_counts.1,
        reconcile_counts.2,
        reconcile_counts.3,
        sim.counters()
    );
    println!("\n{}\n{figures}", table(&rows));
    for (kind, l) in &lanes {
        println!("soak {}: {l:?}", kind.label());
    }
    let doc = record_doc_region(
        "soak",
        &format!(
            "Produced by `{}{RUN_COMMAND}` (test `soak`; `OUTBOX_SOAK_FULL=1` for 10,000 messages), {}.\n\n{}\n{figures}\n\n",
            if full { "OUTBOX_SOAK_FULL=1 " } else { "" },
            run_header(&cluster),
            table(&rows)
        ),
        Claim::FiguresMasked,
    );
    assert!(failures.is_empty(), "soak failed:\n{}", failures.join("\n"));
    if let Err(diff) = doc {
        panic!("{diff}");
    }
}

/// The table row of one channel kind of the soak, and what is wrong with it (nothing when it
/// passes: 0 lost, 0 duplicates, the same key everywhere, one ledger entry per delivery).
fn soak_row(scenario: &str, kind: Kind, l: &SoakLane) -> (Row, Vec<String>) {
    let mut bad = Vec::new();
    if l.missing > 0 || l.other > 0 || l.no_reason > 0 {
        bad.push(format!(
            "lost: {} missing, {} not settled, {} without a work_queue reason",
            l.missing, l.other, l.no_reason
        ));
    }
    if l.duplicates > 0 {
        bad.push(format!(
            "{} effect keys stored more than once",
            l.duplicates
        ));
    }
    if l.delivered_not_held > 0 {
        bad.push(format!(
            "{} delivered messages the provider does not hold exactly once",
            l.delivered_not_held
        ));
    }
    if l.key_mismatch_rows > 0 || l.key_mismatch_provider > 0 {
        bad.push(format!(
            "key mismatches: {} attempt rows, {} provider requests",
            l.key_mismatch_rows, l.key_mismatch_provider
        ));
    }
    if l.ledger != l.delivered as i64 {
        bad.push(format!(
            "{} ledger entries for {} delivered",
            l.ledger, l.delivered
        ));
    }
    let pass = bad.is_empty();
    let verdict = if pass {
        match kind {
            Kind::Neither => format!(
                "PASS: 0 lost, 0 duplicates; {} ambiguous jobs wait in uncertain (limit: never resent, an operator decides)",
                l.uncertain
            ),
            _ => "PASS: 0 lost, 0 duplicates".to_string(),
        }
    } else {
        format!("FAIL: {}", bad.join("; "))
    };
    let row = Row {
        scenario: scenario.to_string(),
        kind: kind.label().to_string(),
        provider: format!(
            "{} stored / {} sends; {} keys stored twice",
            l.stored, l.sends, l.duplicates
        ),
        local: format!(
            "{} committed: {} delivered, {} uncertain ({} of them held by the provider), {} exhausted, {} failed, {} missing",
            l.committed, l.delivered, l.uncertain, l.uncertain_held, l.exhausted, l.failed, l.missing
        ),
        attempts: format!(
            "{} send, {} recovery, {} lookup rows",
            l.send_rows, l.recovery_rows, l.lookup_rows
        ),
        same_key: if l.key_mismatch_rows == 0 && l.key_mismatch_provider == 0 {
            "yes"
        } else {
            "no"
        }
        .into(),
        verdict,
        pass,
    };
    (row, bad)
}
