//! Section 2: fuzzing every public function never breaks the server.

use super::fuzz_calls::{Arg, Call, Effect, Pools, Rng};
use super::injection::hostile_strings;
use super::*;

/// The fuzz's record: SQLSTATEs per role and function, and the calls that failed it.
#[derive(Default)]
struct FuzzLog {
    histogram: BTreeMap<String, BTreeMap<String, u64>>,
    failures: Vec<String>,
    successes: u64,
}

impl FuzzLog {
    fn record(&mut self, who: &str, function: &str, outcome: &str) {
        *self
            .histogram
            .entry(format!("{who} {function}"))
            .or_default()
            .entry(outcome.to_string())
            .or_default() += 1;
    }

    fn print(&self) {
        println!("SQLSTATEs seen (role function: outcome × count):");
        for (k, v) in &self.histogram {
            let outcomes: Vec<String> = v.iter().map(|(o, n)| format!("{o}×{n}")).collect();
            println!("  {k}: {}", outcomes.join(" "));
        }
    }
}

/// Runs one call on `c` and records it; panics when the connection broke.
#[allow(clippy::too_many_arguments)]
fn fuzz_one(
    c: &mut impl GenericClient,
    who: &str,
    call: &Call,
    pools: &mut Pools,
    log: &mut FuzzLog,
    seed: u64,
    iteration: u64,
    bindings: &mut Vec<(String, String)>,
) -> bool {
    let params: Vec<&(dyn ToSql + Sync)> = call.args.iter().map(Arg::as_sql).collect();
    let started = Instant::now();
    match c.query(call.sql, &params) {
        Ok(rows) => {
            log.successes += 1;
            log.record(who, call.function, "ok");
            match call.effect {
                Effect::Channel => {
                    if let Arg::Text(Some(name)) = &call.args[0] {
                        pools.channels.push(name.clone());
                    }
                }
                Effect::Message => {
                    if let Some(id) = rows.first().and_then(|r| r.try_get::<_, i64>(0).ok()) {
                        pools.ids.push(id);
                    }
                }
                Effect::Binding => {
                    if let (Arg::Text(Some(role)), Arg::Text(Some(tenant))) =
                        (&call.args[0], &call.args[1])
                    {
                        bindings.push((role.clone(), tenant.clone()));
                    }
                }
                Effect::None => {}
            }
            true
        }
        Err(e) => {
            let code = code_of(&e);
            log.record(who, call.function, &code);
            if e.as_db_error().is_none() {
                log.print();
                panic!(
                    "fuzz (seed {seed}, iteration {iteration}): the connection of {who} broke on {}: {e}",
                    call.describe()
                );
            }
            if code.starts_with("XX")
                || code.starts_with("58")
                || code.starts_with("53")
                || code.starts_with("57P")
                || code == "57014"
            {
                log.failures.push(format!(
                    "seed {seed}, iteration {iteration}, as {who}, after {:?}: {} → {}",
                    started.elapsed(),
                    call.describe(),
                    describe(&e)
                ));
            }
            false
        }
    }
}

#[test]
fn fuzzing_every_public_function_never_breaks_the_server() {
    let _serial = serial();
    let cluster = Cluster::from_env();
    let seed: u64 = std::env::var("OUTBOX_FUZZ_SEED")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
    let iterations: u64 = std::env::var("OUTBOX_FUZZ_ITERATIONS")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(FUZZ_ITERATIONS);
    println!("fuzz seed: {seed} (replay with OUTBOX_FUZZ_SEED={seed}), {iterations} calls");
    let pids = wait_for_workers(&cluster, &[]);
    let mark = cluster.log_mark();
    let tag = unique("e2efz");
    let mut cleanup = Cleanup::new(&cluster, &tag);
    let mut su = session(&cluster, None);
    let sim = Simulator::start();

    let writer = cleanup.create_role(&mut su, "writer", Some("outbox_writer"));
    let victim = cleanup.create_role(&mut su, "victim", Some("outbox_writer"));
    let tenant = format!("{tag}_tenant");
    cleanup.bind(&mut su, &writer, &tenant);

    let closed = closed_port();
    let sim_ch = format!("{tag}_sim");
    let closed_ch = format!("{tag}_closed");
    create_channel(&mut su, &sim_ch, &sim.send_url(&sim_ch), "{}");
    create_channel(
        &mut su,
        &closed_ch,
        &format!("http://127.0.0.1:{closed}/nothing"),
        r#"{"retry": {"max_attempts": 2, "base_ms": 100}}"#,
    );
    su.execute(
        "SELECT outbox.pause_channel($1, 'fuzz: closed port')",
        &[&closed_ch],
    )
    .expect("pause the closed-port channel");
    let foreign_roles: HashSet<String> = su
        .query("SELECT rolname::text FROM pg_roles", &[])
        .expect("roles")
        .iter()
        .map(|r| r.get::<_, String>(0))
        .filter(|r| r != &writer && r != &victim)
        .collect();
    let unknown_base: i64 = one(
        &mut su,
        "SELECT coalesce(max(id), 0) + 1000000000 FROM outbox._messages",
        &[],
    );
    let mut ids = Vec::new();
    for n in 0..3 {
        let id: i64 = one(
            &mut su,
            "SELECT outbox.enqueue($1::text, '{}'::jsonb, $2::text)",
            &[&sim_ch, &format!("{tag}_seed{n}")],
        );
        ids.push(id);
    }
    let mut pools = Pools {
        tag: tag.clone(),
        serial: 0,
        channels: vec![sim_ch.clone(), closed_ch.clone()],
        ids,
        roles: vec![writer.clone(), victim.clone()],
        tenants: vec![tenant.clone(), "default".into(), format!("{tag}_other")],
        endpoints: vec![
            sim.send_url(&sim_ch),
            sim.send_url(&format!("{tag}_x")),
            format!("http://127.0.0.1:{closed}/"),
            format!("https://127.0.0.1:{closed}/tls"),
            "ftp://127.0.0.1/".into(),
            "http://".into(),
            "127.0.0.1".into(),
            "sql".into(),
        ],
        lookups: vec![
            sim.lookup_url_by_key(&sim_ch),
            sim.lookup_url_by_id(&sim_ch),
            format!("http://127.0.0.1:{closed}/{{effect_key}}"),
            format!("http://127.0.0.1:{closed}/{{external_id}}/{{nope}}"),
            format!("http://127.0.0.1:{closed}/{{"),
            "{effect_key}".into(),
            "ftp://127.0.0.1/{effect_key}".into(),
        ],
        hostile: hostile_strings()
            .into_iter()
            .map(|(_, s)| s)
            .filter(|s| s.len() < 10_000)
            .collect(),
        foreign_roles,
        unknown_base,
    };

    let mut rng = Rng::new(seed);
    let mut log = FuzzLog::default();
    let mut bindings: Vec<(String, String)> = Vec::new();
    let mut writer_c = session(&cluster, Some(&writer));
    let started = Instant::now();
    let mut i = 0u64;
    while i < iterations {
        let as_writer = rng.chance(40);
        let (c, who) = if as_writer {
            (&mut writer_c, "writer")
        } else {
            (&mut su, "superuser")
        };
        if rng.chance(10) {
            // A few calls in one transaction, each in its own savepoint.
            let n = 1 + rng.below(6);
            let mut tx = c.transaction().unwrap_or_else(|e| {
                panic!("fuzz (seed {seed}, iteration {i}): BEGIN as {who}: {e}")
            });
            for _ in 0..n {
                let call = pools.call(&mut rng);
                let mut sp = tx.transaction().unwrap_or_else(|e| {
                    panic!("fuzz (seed {seed}, iteration {i}): SAVEPOINT as {who}: {e}")
                });
                let succeeded = fuzz_one(
                    &mut sp,
                    who,
                    &call,
                    &mut pools,
                    &mut log,
                    seed,
                    i,
                    &mut bindings,
                );
                // A savepoint whose statement failed can only be rolled back to.
                let end = if succeeded && rng.chance(80) {
                    sp.commit()
                } else {
                    sp.rollback()
                };
                if let Err(e) = end {
                    log.record(who, "RELEASE/ROLLBACK TO", &code_of(&e));
                    if e.as_db_error().is_none() {
                        panic!("fuzz (seed {seed}, iteration {i}): the connection of {who} broke ending a savepoint: {e}");
                    }
                }
                i += 1;
            }
            let end = if rng.chance(70) {
                tx.commit()
            } else {
                tx.rollback()
            };
            if let Err(e) = end {
                let code = code_of(&e);
                log.record(who, "COMMIT/ROLLBACK", &code);
                if e.as_db_error().is_none() {
                    panic!("fuzz (seed {seed}, iteration {i}): the connection of {who} broke at COMMIT: {e}");
                }
                if unclean(&code) {
                    log.failures.push(format!(
                        "seed {seed}, iteration {i}, as {who}: COMMIT → {}",
                        describe(&e)
                    ));
                }
            }
        } else {
            let call = pools.call(&mut rng);
            fuzz_one(c, who, &call, &mut pools, &mut log, seed, i, &mut bindings);
            i += 1;
        }
    }
    println!(
        "fuzz: {iterations} calls in {:?}, {} succeeded, {} channels and {} messages created",
        started.elapsed(),
        log.successes,
        pools.channels.len(),
        pools.ids.len()
    );
    log.print();
    cleanup.bindings.extend(bindings);

    let mut problems = log.failures.clone();
    // Nothing of the fuzz keeps the workers busy while the rest is checked.
    let mut fresh = cluster.connect();
    if let Err(e) = pause_tagged(&mut fresh, &tag) {
        problems.push(format!("pausing the fuzz channels: {}", describe(&e)));
    }
    if log.successes == 0 {
        problems.push("not one fuzz call succeeded; the fuzz tested nothing".into());
    }
    for (who, c) in [("superuser", &mut su), ("writer", &mut writer_c)] {
        if let Err(e) = c.query_one("SELECT 1", &[]) {
            problems.push(format!(
                "the {who}'s connection no longer answers SELECT 1: {e}"
            ));
        }
    }
    // The workers kept running: same processes, and they still deliver.
    let after = wait_for_workers(&cluster, &[]);
    if after != pids {
        problems.push(format!(
            "the delivery workers restarted during the fuzz (PIDs {pids:?} before, {after:?} after; seed {seed}); see {}",
            cluster.log_path().display()
        ));
    }
    let final_ch = format!("{tag}_final");
    create_channel(&mut fresh, &final_ch, &sim.send_url(&final_ch), "{}");
    let id: i64 = fresh
        .query_one(
            "SELECT outbox.enqueue($1::text, '{\"after\": \"fuzz\"}'::jsonb, $2::text)",
            &[&final_ch, &format!("{tag}_final_key")],
        )
        .unwrap_or_else(|e| panic!("a normal enqueue after the fuzz: {}", describe(&e)))
        .get(0);
    if !sim.wait_for_stored(&final_ch, 1, HOSTILE_SETTLE) {
        problems.push(format!(
            "a normal message ({id}) enqueued after the fuzz was not delivered within {HOSTILE_SETTLE:?}"
        ));
    }
    let crashes = crash_lines(&cluster.log_since(mark));
    if !crashes.is_empty() {
        problems.push(format!(
            "the server log since the fuzz began shows a crash (seed {seed}):\n{}",
            crashes.join("\n")
        ));
    }
    drop(writer_c);
    drop(su);
    drop(cleanup);
    assert!(
        problems.is_empty(),
        "fuzz (seed {seed}, replay with OUTBOX_FUZZ_SEED={seed}): {} problem(s):\n  - {}",
        problems.len(),
        problems.join("\n  - ")
    );
}
