//! The crash matrix: every scenario on the three channel kinds, one table row each.

use super::network_and_retries::{budget_exhausted, network_cut, restart_during_backoff};
use super::page::{record_doc_region, run_header, Claim};
use super::restart_points::{
    after_claim, after_claim_kill9, after_provider_has_it, after_send_kill9,
    before_commit_immediate_stop, client_dies, fault_point, ClientKill,
};
use super::*;

// ---------------------------------------------------------------------------------------
// The matrix
// ---------------------------------------------------------------------------------------

#[test]
fn crash_matrix() {
    let cluster = Cluster::from_env();
    wait_for_workers(&cluster, &[]);
    let started = Instant::now();
    let mut rows = Vec::new();
    println!(
        "| scenario | channel kind | provider: stored / sends | local state | attempts | same key | verdict |"
    );
    run(
        &mut rows,
        "(1) client dies before COMMIT — fault: crash_after_claim armed + pg_terminate_backend",
        |s| client_dies(s, ClientKill::FaultArmedTerminate),
    );
    run(
        &mut rows,
        "(1) client dies before COMMIT — real: kill -9 of the client backend",
        |s| client_dies(s, ClientKill::Kill9Backend),
    );
    run(
        &mut rows,
        "(1) client dies before COMMIT — real: pg_ctl stop -m immediate",
        |s| client_dies(s, ClientKill::ImmediateStop),
    );
    run(
        &mut rows,
        "(2) after claim, before send — fault: crash_after_claim",
        |s| fault_point(s, "crash_after_claim", &after_claim),
    );
    run(
        &mut rows,
        "(2) after claim, before send — real: kill -9 while the worker hangs in connect()",
        after_claim_kill9,
    );
    run(
        &mut rows,
        "(3) provider accepted, answer not read — fault: crash_after_send",
        |s| fault_point(s, "crash_after_send", &after_provider_has_it("accepted")),
    );
    run(
        &mut rows,
        "(3) provider accepted, answer not read — real: kill -9 while the provider holds the request",
        after_send_kill9,
    );
    run(
        &mut rows,
        "(4) answer read, record not committed — fault: crash_after_response",
        |s| {
            fault_point(
                s,
                "crash_after_response",
                &after_provider_has_it("accepted"),
            )
        },
    );
    run(
        &mut rows,
        "(4) answer read, record not committed — fault: crash_before_commit",
        |s| fault_point(s, "crash_before_commit", &after_provider_has_it("accepted")),
    );
    run(
        &mut rows,
        "(4) answer read, record not committed — real: pg_ctl stop -m immediate while the record waits on a row lock",
        before_commit_immediate_stop,
    );
    run(
        &mut rows,
        "network cut mid-send (read, stored, connection reset)",
        network_cut,
    );
    run(
        &mut rows,
        "Postgres crash-restart during backoff",
        restart_during_backoff,
    );
    run(
        &mut rows,
        "retry budget exhausted (503 on every attempt, max_attempts 3)",
        budget_exhausted,
    );

    let passed = rows.iter().filter(|r| r.pass).count();
    let summary = format!(
        "crash matrix: {passed} of {} rows pass ({:.0} s)",
        rows.len(),
        started.elapsed().as_secs_f64()
    );
    println!("\n{}\n{summary}", table(&rows));
    let doc = record_doc_region(
        "crash-matrix",
        &format!(
            "Produced by `{RUN_COMMAND}` (test `crash_matrix`), {}. {summary}.\n\n{}",
            run_header(&cluster),
            table(&rows)
        ),
        Claim::Exact,
    );
    let failed: Vec<String> = rows
        .iter()
        .filter(|r| !r.pass)
        .map(|r| format!("{} [{}]: {}", r.scenario, r.kind, r.verdict))
        .collect();
    assert!(failed.is_empty(), "failed rows:\n{}", failed.join("\n"));
    if let Err(diff) = doc {
        panic!("{diff}");
    }
}
