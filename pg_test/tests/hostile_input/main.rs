//! End-to-end tests of hostile input against the real cluster (`scripts/cluster.sh`, located
//! by `OUTBOX_BASE` / `OUTBOX_PGPORT`), the real delivery workers and the provider
//! simulator (docs/security.md, "Limits"; the contract: "Bad input raises an ERROR with a
//! precise SQLSTATE ... never panics, never crashes the backend, never half-writes"):
//!
//! 1. injection strings (quotes, dollar quotes, comments, format specifiers, URL template
//!    placeholders, control characters, RTL overrides, 100,000-character Unicode, path
//!    traversal, CRLF) in every text argument of every public function, called by the roles
//!    an application would use (writer, operator, admin): each call succeeds and stores the
//!    value verbatim, or fails with a clean SQLSTATE (where docs/security.md fixes the
//!    outcome, exactly that one); one test per area (effect keys and enqueue, operator
//!    actions, channels, tenants, NUL), each followed by the checks that hold after any
//!    hostile input: the schema is intact, the hostile messages settle, the Prometheus
//!    exposition still parses and a normal message is delivered;
//! 2. a deterministic fuzz of every public function with random arguments (NULLs, empty,
//!    huge, extreme ids, random and malformed JSON, random channel options, infinite
//!    timestamps), as the superuser and as a role with `outbox_writer` alone: no internal
//!    error, no lost connection, no crash in the server log, the workers keep running and
//!    still deliver. `OUTBOX_FUZZ_SEED` replays a run, `OUTBOX_FUZZ_ITERATIONS` sizes it.
//!
//! Run: `cargo test -p outbox_e2e --release --test hostile_input -- --nocapture` (the fuzz
//! prints its seed and a histogram of SQLSTATEs).
//!
//! Every channel these tests create is named with a per-run tag and points at a simulator
//! or at a closed port on 127.0.0.1; when a test ends (also when it fails) its channels are
//! paused and removed with their messages, so that hostile channel names do not reach the
//! next test's metrics, and its roles and bindings are dropped.

use openmetrics_parser::prometheus::parse_prometheus;
use outbox_e2e::cluster::{poll, unique, wait_for_workers, Cluster};
use outbox_e2e::helpers::{
    closed_port, code_of, count, create_channel, describe, ident, one, serial, set_role, short,
    CONTRACT_VIEWS,
};
use outbox_e2e::sim::Simulator;
use postgres::types::ToSql;
use postgres::{Client, GenericClient, NoTls};
use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

// The tests, by area (numbered as in the sections).
mod fuzz;
mod fuzz_calls;
mod injection;
mod injection_areas;

/// How long a message may take to reach a state it is expected to reach (longer than the
/// shared SETTLE: the queue may hold the whole fuzz run).
const HOSTILE_SETTLE: Duration = Duration::from_secs(60);
/// Default number of fuzz calls (superuser and writer together).
const FUZZ_ITERATIONS: u64 = 3000;
/// Words whose presence in the server log means a backend crashed or was killed.
const CRASH_WORDS: [&str; 5] = [
    "PANIC",
    "server process",
    "terminated by signal",
    "was terminated",
    "TRAP",
];

// ---------------------------------------------------------------------------------------
// Helpers (local to this file)
// ---------------------------------------------------------------------------------------

/// SQLSTATEs no bad input may produce: internal errors, system errors, a RAISE without an
/// error code, a statement that ran into the timeout, a lost backend, resource exhaustion.
fn unclean(code: &str) -> bool {
    code.starts_with("XX")
        || code.starts_with("58")
        || code.starts_with("53")
        || code.starts_with("57P")
        || code == "57014"
        || code == "P0001"
        || code.starts_with("<no SQLSTATE")
}

/// An HTTP token (RFC 9110 `tchar`s): what a header name may be.
fn is_token(s: &str) -> bool {
    !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

fn has_ascii_control(s: &str) -> bool {
    s.chars().any(|c| c.is_ascii_control())
}

/// A C1 control (U+0080 to U+009F): a control character outside ASCII.
fn has_c1_control(s: &str) -> bool {
    s.chars().any(|c| c.is_control() && !c.is_ascii())
}

/// Lines of the server log that say a backend crashed or was killed.
fn crash_lines(log: &str) -> Vec<String> {
    log.lines()
        .filter(|l| CRASH_WORDS.iter().any(|w| l.contains(w)))
        .map(str::to_string)
        .collect()
}

/// Everything a test creates, removed when it ends (also when it fails): bindings, then
/// the channels named with `tag` (paused, then removed with their messages, attempts and
/// ledger entries), then roles.
struct Cleanup<'a> {
    cluster: &'a Cluster,
    tag: String,
    roles: Vec<String>,
    bindings: Vec<(String, String)>,
}

impl<'a> Cleanup<'a> {
    fn new(cluster: &'a Cluster, tag: &str) -> Self {
        Cleanup {
            cluster,
            tag: tag.to_string(),
            roles: Vec::new(),
            bindings: Vec::new(),
        }
    }

    fn create_role(&mut self, c: &mut Client, label: &str, grant: Option<&str>) -> String {
        let name = format!("{}_{label}", self.tag);
        c.batch_execute(&format!("CREATE ROLE {} NOLOGIN", ident(&name)))
            .unwrap_or_else(|e| panic!("CREATE ROLE {name}: {}", describe(&e)));
        self.roles.push(name.clone());
        if let Some(g) = grant {
            c.batch_execute(&format!("GRANT {} TO {}", ident(g), ident(&name)))
                .unwrap_or_else(|e| panic!("GRANT {g} TO {name}: {}", describe(&e)));
        }
        name
    }

    fn bind(&mut self, c: &mut Client, role: &str, tenant: &str) {
        self.bindings.push((role.to_string(), tenant.to_string()));
        c.execute(
            "SELECT outbox.bind_tenant($1::text::name, $2::text)",
            &[&role, &tenant],
        )
        .unwrap_or_else(|e| panic!("bind_tenant({role}, {tenant}): {}", describe(&e)));
    }
}

/// Pauses every channel whose name starts with `tag` (directly: no operator log rows).
fn pause_tagged(c: &mut Client, tag: &str) -> Result<u64, postgres::Error> {
    c.execute(
        "UPDATE outbox._channels SET paused = true WHERE starts_with(name, $1)",
        &[&tag],
    )
}

impl Drop for Cleanup<'_> {
    fn drop(&mut self) {
        let Ok(mut c) = Client::connect(&self.cluster.conninfo(), NoTls) else {
            eprintln!("cleanup: cannot connect; channels {}* are left", self.tag);
            return;
        };
        for (role, tenant) in &self.bindings {
            let _ = c.execute(
                "SELECT outbox.unbind_tenant($1::text::name, $2::text)",
                &[role, tenant],
            );
        }
        if let Err(e) = pause_tagged(&mut c, &self.tag) {
            eprintln!(
                "cleanup: could not pause channels {}*: {}",
                self.tag,
                describe(&e)
            );
        }
        // Nothing may be in flight when its rows go.
        let tag = self.tag.clone();
        let idle = poll(self.cluster, Duration::from_secs(30), |c| {
            let n: i64 = c
                .query_one(
                    "SELECT count(*) FROM outbox._messages m JOIN outbox._channels ch ON ch.id = m.channel_id
                      WHERE starts_with(ch.name, $1)
                        AND m.id IN (SELECT unnest(w.message_ids) FROM outbox._claims w)",
                    &[&tag],
                )?
                .get(0);
            Ok((n == 0).then_some(()))
        });
        if idle.is_none() {
            eprintln!(
                "cleanup: messages of channels {}* stayed in sending for 30 s",
                self.tag
            );
        }
        // Children first: attempts and ledger entries, then messages, then the channels.
        const PURGE: [&str; 6] = [
            "DELETE FROM outbox._attempts WHERE message_id IN (
                 SELECT m.id FROM outbox._messages m JOIN outbox._channels ch ON ch.id = m.channel_id
                  WHERE starts_with(ch.name, $1))",
            "DELETE FROM outbox._ledger WHERE message_id IN (
                 SELECT m.id FROM outbox._messages m JOIN outbox._channels ch ON ch.id = m.channel_id
                  WHERE starts_with(ch.name, $1))",
            "DELETE FROM outbox._messages WHERE channel_id IN (
                 SELECT id FROM outbox._channels WHERE starts_with(name, $1))",
            "DELETE FROM outbox._channel_stats WHERE channel_id IN (
                 SELECT id FROM outbox._channels WHERE starts_with(name, $1))",
            "DELETE FROM outbox._channel_minutes WHERE channel_id IN (
                 SELECT id FROM outbox._channels WHERE starts_with(name, $1))",
            "DELETE FROM outbox._channels WHERE starts_with(name, $1)",
        ];
        let result = c.transaction().and_then(|mut tx| {
            for stmt in PURGE {
                tx.execute(stmt, &[&self.tag])?;
            }
            tx.commit()
        });
        if let Err(e) = result {
            eprintln!(
                "cleanup: could not remove channels {}* and their messages: {}",
                self.tag,
                describe(&e)
            );
        }
        for role in self.roles.iter().rev() {
            if let Err(e) = c.batch_execute(&format!("DROP ROLE IF EXISTS {}", ident(role))) {
                eprintln!("cleanup: could not drop role {role}: {}", describe(&e));
            }
        }
    }
}

/// A connection acting as `role` (`SET ROLE` on a superuser connection), or as the
/// superuser itself when `role` is None.
fn session(cluster: &Cluster, role: Option<&str>) -> Client {
    let mut c = cluster.connect();
    c.batch_execute("SET statement_timeout = '60s'")
        .expect("statement_timeout");
    if let Some(r) = role {
        set_role(&mut c, r);
    }
    c
}
