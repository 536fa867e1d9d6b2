//! Section 7: the worker is woken at COMMIT, not before and not on rollback.

use super::*;

// ---------------------------------------------------------------------------------------
// 7. the wake at COMMIT
// ---------------------------------------------------------------------------------------

/// Resets outbox.poll_interval_ms, whatever happens.
struct PollReset<'a>(&'a Cluster);

impl Drop for PollReset<'_> {
    fn drop(&mut self) {
        let mut c = self.0.connect();
        // Two statements: ALTER SYSTEM cannot run in the implicit transaction of a batch.
        if let Err(e) = c
            .batch_execute("ALTER SYSTEM RESET outbox.poll_interval_ms")
            .and_then(|_| c.batch_execute("SELECT pg_reload_conf()"))
        {
            eprintln!("could not reset outbox.poll_interval_ms: {e}");
        }
        // Let the workers reload before the next test.
        thread::sleep(Duration::from_millis(700));
    }
}

#[test]
fn worker_is_woken_at_commit_not_before_and_not_on_rollback() {
    let (cluster, mut c, sim) = cluster_and_sim();
    let ch = unique("fnd_wake");
    let mut watcher = cluster.connect();
    create_channel(&mut c, &ch, &sim.send_url(&ch), OPTIONS);
    cluster.wait_for_worker();
    let workers = cluster.worker_pids(&mut c).len();
    assert!(workers >= 1, "no delivery worker runs");

    let _reset = PollReset(&cluster);
    let mark = cluster.log_mark();
    c.batch_execute("ALTER SYSTEM SET outbox.poll_interval_ms = 60000")
        .expect("raise poll interval");
    c.batch_execute("SELECT pg_reload_conf()").expect("reload");
    assert!(
        wait_until(Duration::from_secs(20), || cluster
            .log_since(mark)
            .matches("poll_interval_ms=60000")
            .count()
            >= workers),
        "the workers did not reload poll_interval_ms = 60000; log:\n{}",
        cluster.log_since(mark)
    );
    // Nothing else may wake the workers during the windows below: no queued message of
    // an unpaused channel is due soon.
    let due_soon =
        "SELECT count(*) FROM outbox._messages m JOIN outbox._channels c ON c.id = m.channel_id \
                     WHERE m.state = 'queued' AND NOT c.paused \
                       AND m.next_attempt_at < now() + interval '30 seconds'";
    assert!(
        wait_until(Duration::from_secs(30), || count(
            &mut watcher,
            due_soon,
            &[]
        ) == 0),
        "queued messages of other channels keep coming due; the wake cannot be observed alone"
    );

    // Not before COMMIT: an open transaction with an enqueue wakes nobody.
    let quiet = wait_for_quiet_workers(&mut watcher, Duration::from_secs(1));
    let key_commit = unique("wake_commit");
    let mut tx = c.transaction().unwrap();
    let id = enqueue(&mut tx, &ch, &key_commit);
    thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        worker_loops(&mut watcher),
        quiet,
        "a worker ran a cycle while the enqueuing transaction was still open"
    );
    assert_eq!(sim.send_count(&ch), 0, "sent before COMMIT");

    // At COMMIT: delivered within 2 s, far below the 60 s poll.
    let committed_at = Instant::now();
    tx.commit().unwrap();
    assert!(
        sim.wait_for_stored(&ch, 1, Duration::from_secs(2)),
        "not delivered within 2 s of COMMIT with a 60 s poll: the commit did not wake the worker (state {:?})",
        state_of(&cluster, id)
    );
    let took = committed_at.elapsed();
    assert_eq!(stored_keys(&sim, &ch), vec![Some(key_commit.clone())]);
    assert_ne!(
        worker_loops(&mut watcher),
        quiet,
        "no worker cycle after COMMIT"
    );
    assert!(
        wait_for_state(&cluster, id, "delivered", Duration::from_secs(5)),
        "state {:?} after the provider stored it ({took:?} after COMMIT)",
        state_of(&cluster, id)
    );

    // Not on ROLLBACK: the rolled-back enqueue wakes nobody and is never sent.
    let quiet = wait_for_quiet_workers(&mut watcher, Duration::from_secs(1));
    let key_rollback = unique("wake_rollback");
    let mut tx = c.transaction().unwrap();
    let rolled_back_id = enqueue(&mut tx, &ch, &key_rollback);
    tx.rollback().unwrap();
    thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        worker_loops(&mut watcher),
        quiet,
        "a worker ran a cycle after a ROLLBACK"
    );
    assert_eq!(messages_with_key(&mut c, &key_rollback), 0);
    assert_eq!(status(&mut c, rolled_back_id), None);

    // A later commit wakes the worker; it sends that message and not the rolled-back one.
    let key_after = unique("wake_after");
    let committed_at = Instant::now();
    let id_after = enqueue(&mut c, &ch, &key_after);
    assert!(
        sim.wait_for_stored(&ch, 2, Duration::from_secs(2)),
        "second committed message not delivered within 2 s ({:?})",
        committed_at.elapsed()
    );
    assert!(wait_for_state(
        &cluster,
        id_after,
        "delivered",
        Duration::from_secs(5)
    ));
    assert!(!sim.wait_for_sends(&ch, 3, Duration::from_secs(1)));
    assert_eq!(
        sent_keys(&sim, &ch),
        vec![Some(key_commit), Some(key_after)],
        "the provider received exactly the committed messages"
    );
    assert_eq!(
        count(
            &mut c,
            "SELECT count(*) FROM outbox.attempts WHERE message_id = $1",
            &[&rolled_back_id]
        ),
        0
    );
}
