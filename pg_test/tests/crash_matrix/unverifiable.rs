//! What one crash leaves for an operator on a channel that can neither dedupe nor be asked:
//! at most the channel's bound on attempts open at once (`max_unverifiable_in_flight`,
//! default 8), all workers together. Each crash is a `kill -9` of a delivery worker, which
//! the postmaster turns into a restart of every backend: every attempt open at that moment
//! becomes ambiguous and waits in `uncertain`; none is sent again.

use super::page::{record_doc_region, run_header, Claim};
use super::*;
use outbox_e2e::helpers::count;

/// Messages delivered while the workers are killed.
const MESSAGES: usize = 1_000;
/// Crashes while they are delivered.
const CRASHES: usize = 6;
/// How long the provider takes to accept a message: long enough that a crash always finds
/// attempts open, short enough that 1,000 messages go through in seconds.
const PROVIDER_MS: u64 = 25;

/// Messages of `channel` in `state`.
fn in_state(c: &mut Client, channel: &str, state: &str) -> i64 {
    count(
        c,
        "SELECT count(*) FROM outbox.messages m
          WHERE m.channel = $1 AND m.state::text = $2",
        &[&channel, &state],
    )
}

/// Messages of `channel` still `sending` in an attempt of one of the workers `pids` (not
/// yet taken back by recovery).
fn open_by(c: &mut Client, channel: &str, pids: &[i32]) -> i64 {
    count(
        c,
        "SELECT count(*) FROM outbox.messages m
          WHERE m.channel = $1 AND m.state = 'sending'
            AND EXISTS (SELECT 1 FROM outbox.attempts a
                         WHERE a.message_id = m.id AND a.attempt = m.attempts AND a.kind = 'send'
                           AND a.worker_pid = ANY ($2))",
        &[&channel, &pids],
    )
}

/// The messages a crash left, found as the runbook finds them ("after a crash on a channel
/// that cannot be asked"): uncertain, and their latest attempt was a send of one of the
/// workers that died, started since `window` (a while before the crash).
fn found_as_the_runbook_says(
    c: &mut Client,
    channel: &str,
    pids: &[i32],
    window: SystemTime,
) -> i64 {
    count(
        c,
        "SELECT count(*) FROM outbox.work_queue w
           JOIN outbox.attempts s ON s.message_id = w.id AND s.kind = 'send' AND s.attempt = w.attempts
          WHERE w.state = 'uncertain' AND w.channel = $1
            AND s.worker_pid = ANY ($2) AND s.started_at >= $3",
        &[&channel, &pids, &window],
    )
}

/// One crash: waits until attempts are open on `channel`, kills a worker, waits for the
/// workers to come back and for every attempt of before the crash to be settled. Returns
/// the attempts open just before the kill and how many messages the crash left `uncertain`
/// (`None` when the channel had nothing left to send); the runbook's query finds exactly
/// those.
fn crash_once(cluster: &Cluster, channel: &str, workers: &mut Vec<i32>) -> Option<(i64, i64)> {
    let mut c = cluster.connect();
    let open = poll(cluster, Duration::from_secs(20), |c| {
        let sending = in_state(c, channel, "sending");
        let left = sending + in_state(c, channel, "queued");
        Ok((sending > 0 || left == 0).then_some((sending, left)))
    })?;
    if open.1 == 0 {
        return None;
    }
    let before = in_state(&mut c, channel, "uncertain");
    // The window the runbook's operator reads the log for: from a while before the crash.
    let window = SystemTime::now() - Duration::from_secs(60);
    let died = workers.clone();
    cluster.kill_worker(workers[0]);
    *workers = wait_for_workers(cluster, workers);
    let mut c = cluster.connect();
    // Every attempt the dead workers had open is taken back by recovery.
    let settled = poll(cluster, CRASH_SETTLE, |c| {
        Ok((open_by(c, channel, &died) == 0).then_some(()))
    });
    assert!(
        settled.is_some(),
        "the attempts open at the crash were not recovered within {CRASH_SETTLE:?}"
    );
    let left = in_state(&mut c, channel, "uncertain") - before;
    assert_eq!(
        found_as_the_runbook_says(&mut c, channel, &died, window),
        left,
        "the runbook's query finds the messages the crash left (workers {died:?})"
    );
    Some((open.0, left))
}

#[test]
fn a_crash_on_a_channel_that_cannot_be_asked_leaves_at_most_its_bound_uncertain() {
    let cluster = Cluster::from_env();
    let mut workers = wait_for_workers(&cluster, &[]);
    let sim = Simulator::start();
    let mut c = cluster.connect();
    let channel = unique("unverifiable");
    sim.set_default(
        &channel,
        Action::AcceptAfter(Duration::from_millis(PROVIDER_MS)),
    );
    sim.set_record_bodies(true);
    create_channel(
        &mut c,
        &channel,
        &sim.send_url(&channel),
        &format!(r#"{{"retry": {FAST_RETRY}}}"#),
    );
    let (bound, reason): (i32, String) = c
        .query_one(
            "SELECT in_flight_bound, in_flight_reason FROM outbox.channels WHERE name = $1",
            &[&channel],
        )
        .map(|r| (r.get(0), r.get(1)))
        .unwrap();
    assert_eq!(
        (bound, reason.as_str()),
        (8, "max_unverifiable_in_flight: no dedupe, no lookup")
    );

    let mut tx = c.transaction().unwrap();
    let keys: Vec<String> = (0..MESSAGES).map(|i| format!("{channel}-{i}")).collect();
    for key in &keys {
        try_enqueue(&mut tx, &channel, key).unwrap();
    }
    tx.commit().unwrap();

    let mut crashes = Vec::new();
    for _ in 0..CRASHES {
        match crash_once(&cluster, &channel, &mut workers) {
            Some(crash) => crashes.push(crash),
            None => break,
        }
    }
    let mut c = cluster.connect();
    let drained = poll(&cluster, Duration::from_secs(120), |c| {
        let left = in_state(c, &channel, "queued") + in_state(c, &channel, "sending");
        Ok((left == 0).then_some(()))
    });
    assert!(
        drained.is_some(),
        "the channel was not drained within 120 s"
    );

    let delivered = in_state(&mut c, &channel, "delivered");
    let uncertain = in_state(&mut c, &channel, "uncertain");
    let mut per_key: HashMap<String, usize> = HashMap::new();
    for s in sim.stored(&channel) {
        *per_key
            .entry(body_key(&s.body).unwrap_or_default())
            .or_default() += 1;
    }
    let twice = per_key.values().filter(|n| **n > 1).count();
    let over_bound: Vec<&(i64, i64)> = crashes
        .iter()
        .filter(|(open, left)| *open > bound as i64 || *left > bound as i64)
        .collect();
    let worst = crashes.iter().map(|(_, left)| *left).max().unwrap_or(0);
    let pass = crashes.len() >= 3
        && over_bound.is_empty()
        && twice == 0
        && delivered + uncertain == MESSAGES as i64
        && uncertain == crashes.iter().map(|(_, left)| left).sum::<i64>();
    let row = Row {
        scenario: format!(
            "kill -9 of a worker while {MESSAGES} messages are delivered on a channel that can neither dedupe nor be asked ({} crashes)",
            crashes.len()
        ),
        kind: "neither, max_unverifiable_in_flight 8".into(),
        provider: format!("{} stored; {twice} keys stored twice", per_key.len()),
        local: format!(
            "{delivered} delivered, {uncertain} uncertain; per crash: open {:?}, left uncertain {:?}",
            crashes.iter().map(|(open, _)| *open).collect::<Vec<_>>(),
            crashes.iter().map(|(_, left)| *left).collect::<Vec<_>>()
        ),
        attempts: "one send row per attempt; each crash's open attempts end in recovery rows".into(),
        same_key: "yes".into(),
        verdict: match pass {
            true => "PASS: each crash left at most the bound (8) uncertain; 0 sent twice".into(),
            false => format!("FAIL: worst crash left {worst}; over the bound: {over_bound:?}; {twice} sent twice"),
        },
        pass,
    };
    print_row(&row);
    let doc = record_doc_region(
        "unverifiable",
        &format!(
            "Produced by `{RUN_COMMAND}` (test `a_crash_on_a_channel_that_cannot_be_asked_leaves_at_most_its_bound_uncertain`), {}.\n\n{}\n",
            run_header(&cluster),
            table(std::slice::from_ref(&row))
        ),
        Claim::FiguresMasked,
    );
    assert!(row.pass, "{}", row.verdict);
    if let Err(diff) = doc {
        panic!("{diff}");
    }
}
