//! Which tenants a channel serves (option `tenants`), and what a message may not set.
//!
//! 1. An enqueue by a tenant a channel does not list is refused with 42501 and writes
//!    nothing; a listed tenant enqueues as before; `["*"]` (the default) serves everyone.
//! 2. A writer never learns the options of a channel that does not serve it:
//!    `outbox.channels` does not show it; an admin sees every channel. Nor does an
//!    operator read the operator log's rows about it.
//! 3. Message headers may not set framing or routing headers, the signing headers or the
//!    channel's key headers (22023, naming the header, nothing written); a row that holds
//!    one anyway (written by hand) is not sent with it.
//!
//! Run: `cargo test -p outbox_e2e --release --test channel_tenancy`.

use outbox_e2e::cluster::{unique, wait_for_state, Cluster};
use outbox_e2e::helpers::{code_of, create_channel, ident, one, session_as};
use outbox_e2e::sim::Simulator;
use postgres::Client;
use std::time::Duration;

const T: Duration = Duration::from_secs(30);

/// A role bound to one tenant, a writer unless made in another group; dropped with its
/// binding when the test ends.
struct Writer<'a> {
    cluster: &'a Cluster,
    role: String,
    tenant: String,
}

impl<'a> Writer<'a> {
    fn new(cluster: &'a Cluster, tenant: &str) -> Writer<'a> {
        Writer::in_role(cluster, tenant, "outbox_writer")
    }

    /// A role of `group` (outbox_writer, outbox_operator) bound to `tenant`.
    fn in_role(cluster: &'a Cluster, tenant: &str, group: &str) -> Writer<'a> {
        let role = unique("ct_role");
        let mut c = cluster.connect();
        c.batch_execute(&format!(
            "CREATE ROLE {} NOLOGIN IN ROLE {group}",
            ident(&role)
        ))
        .expect("create role");
        c.execute("SELECT outbox.bind_tenant($1, $2)", &[&role, &tenant])
            .expect("bind");
        Writer {
            cluster,
            role,
            tenant: tenant.to_string(),
        }
    }

    fn session(&self) -> Client {
        session_as(self.cluster, &self.role)
    }

    fn enqueue(&self, channel: &str, headers: Option<&str>) -> Result<i64, postgres::Error> {
        let mut c = self.session();
        c.query_one(
            "SELECT outbox.enqueue($1, '{}'::jsonb, $2, headers => $3::text::jsonb)",
            &[&channel, &unique("ct_key"), &headers],
        )
        .map(|r| r.get(0))
    }
}

impl Drop for Writer<'_> {
    fn drop(&mut self) {
        let mut c = self.cluster.connect();
        let _ = c.execute(
            "SELECT outbox.unbind_tenant($1, $2)",
            &[&self.role, &self.tenant],
        );
        let _ = c.batch_execute(&format!("DROP ROLE IF EXISTS {}", ident(&self.role)));
    }
}

fn messages_of(c: &mut Client, tenant: &str, channel: &str) -> i64 {
    c.query_one(
        "SELECT count(*) FROM outbox._messages m JOIN outbox._channels c ON c.id = m.channel_id
          WHERE m.tenant = $1 AND c.name = $2",
        &[&tenant, &channel],
    )
    .expect("count")
    .get(0)
}

fn paused_channel(c: &mut Client, options: &str) -> String {
    let ch = unique("ct_ch");
    create_channel(c, &ch, "http://127.0.0.1:9/ct", options);
    c.execute(
        "SELECT outbox.pause_channel($1, 'channel tenants test')",
        &[&ch],
    )
    .expect("pause");
    ch
}

/// A paused channel that serves tenant `a` alone, with a secret header (`SECRET-A`), and a
/// paused channel that serves everyone.
fn channels_of_a_and_everyone(su: &mut Client, a: &str) -> (String, String) {
    let only_a = paused_channel(
        su,
        &format!(r#"{{"tenants": ["{a}"], "headers": {{"Authorization": "Bearer SECRET-A"}}}}"#),
    );
    (only_a, paused_channel(su, "{}"))
}

#[test]
fn a_tenant_a_channel_does_not_list_may_not_enqueue_on_it() {
    let cluster = Cluster::from_env();
    let mut su = cluster.connect();
    let (a, b) = (unique("cta"), unique("ctb"));
    let only_a = paused_channel(&mut su, &format!(r#"{{"tenants": ["{a}"]}}"#));
    let everyone = paused_channel(&mut su, "{}");
    let (writer_a, writer_b) = (Writer::new(&cluster, &a), Writer::new(&cluster, &b));

    writer_a
        .enqueue(&only_a, None)
        .expect("a listed tenant enqueues");
    let e = writer_b
        .enqueue(&only_a, None)
        .expect_err("an unlisted tenant is refused");
    assert_eq!(code_of(&e), "42501", "{e:?}");
    let text = e
        .as_db_error()
        .map(|d| d.message().to_string())
        .unwrap_or_default();
    assert!(
        !text.contains(&a),
        "the refusal names the tenants the channel serves: {text}"
    );
    assert_eq!(messages_of(&mut su, &b, &only_a), 0, "nothing was written");
    // A superuser acting for b is refused the same way.
    let mut tx = su.transaction().expect("tx");
    tx.execute("SELECT set_config('outbox.tenant', $1, true)", &[&b])
        .expect("tenant");
    let e = tx
        .query_one("SELECT outbox.enqueue($1, '{}'::jsonb, 'k')", &[&only_a])
        .expect_err("a superuser acting for b is refused");
    assert_eq!(code_of(&e), "42501");
    drop(tx);
    writer_b
        .enqueue(&everyone, None)
        .expect("[\"*\"] serves every tenant");
    // Listing b later lets it in (the session caches are told of the change).
    su.execute(
        "SELECT outbox.alter_channel($1, $2::text::jsonb)",
        &[&only_a, &format!(r#"{{"tenants": ["{a}", "{b}"]}}"#)],
    )
    .expect("alter");
    writer_b.enqueue(&only_a, None).expect("b is listed now");
}

#[test]
fn a_writer_sees_only_the_channels_that_serve_its_tenant() {
    let cluster = Cluster::from_env();
    let mut su = cluster.connect();
    let (a, b) = (unique("cta"), unique("ctb"));
    let (only_a, everyone) = channels_of_a_and_everyone(&mut su, &a);
    let (writer_a, writer_b) = (Writer::new(&cluster, &a), Writer::new(&cluster, &b));
    let visible = |c: &mut Client, ch: &str| -> bool {
        c.query_one(
            "SELECT count(*) FROM outbox.channels WHERE name = $1",
            &[&ch],
        )
        .expect("channels")
        .get::<_, i64>(0)
            == 1
    };
    let mut sa = writer_a.session();
    let mut sb = writer_b.session();
    assert!(visible(&mut sa, &only_a) && visible(&mut sa, &everyone));
    assert!(
        !visible(&mut sb, &only_a),
        "tenant b's writer sees a channel that serves only a"
    );
    assert!(visible(&mut sb, &everyone));
    let options: String = one(
        &mut sa,
        "SELECT options::text FROM outbox.channels WHERE name = $1",
        &[&only_a],
    );
    assert!(!options.contains("SECRET-A"), "{options}");

    let admin = unique("ct_admin");
    su.batch_execute(&format!(
        "CREATE ROLE {} NOLOGIN IN ROLE outbox_admin",
        ident(&admin)
    ))
    .expect("admin");
    let mut sadmin = cluster.connect();
    sadmin
        .batch_execute(&format!("SET ROLE {}", ident(&admin)))
        .expect("set role");
    assert!(visible(&mut sadmin, &only_a), "an admin sees every channel");
    drop(sadmin);
    su.batch_execute(&format!("DROP ROLE {}", ident(&admin)))
        .expect("drop");
}

/// The operator log's rows about a channel (its creation, its pause, a change of its
/// options) are shown to the operators of the tenants it serves, as `outbox.channels` is,
/// and follow its option `tenants` when it changes.
#[test]
fn an_operator_reads_the_log_of_the_channels_that_serve_its_tenant() {
    let cluster = Cluster::from_env();
    let mut su = cluster.connect();
    let (a, b) = (unique("cta"), unique("ctb"));
    let (only_a, everyone) = channels_of_a_and_everyone(&mut su, &a);
    let operator_a = Writer::in_role(&cluster, &a, "outbox_operator");
    let operator_b = Writer::in_role(&cluster, &b, "outbox_operator");
    let rows = |c: &mut Client, ch: &str| -> i64 {
        one(
            c,
            "SELECT count(*) FROM outbox.operator_log WHERE channel = $1",
            &[&ch],
        )
    };
    let all_of_only_a = rows(&mut su, &only_a);
    assert!(
        all_of_only_a >= 2,
        "its creation and its pause are logged: {all_of_only_a}"
    );
    let (mut sa, mut sb) = (operator_a.session(), operator_b.session());
    assert_eq!(rows(&mut sa, &only_a), all_of_only_a);
    assert_eq!(
        rows(&mut sb, &only_a),
        0,
        "tenant b's operator reads the log of a channel that serves only a"
    );
    assert_eq!(rows(&mut sb, &everyone), rows(&mut su, &everyone));
    assert!(rows(&mut sb, &everyone) >= 2);
    // The table behind the view, filtered the same way.
    let of_both = "SELECT count(*) FROM outbox._operator_log WHERE channel IN ($1, $2)";
    assert_eq!(
        one::<i64>(&mut sb, of_both, &[&only_a, &everyone]),
        rows(&mut su, &everyone)
    );
    // A role that may read the table but is neither an operator nor an admin (an auditor,
    // a member of pg_read_all_data) reads no row about a channel, and no error.
    let auditor = unique("ct_auditor");
    su.batch_execute(&format!(
        "CREATE ROLE {r} NOLOGIN; GRANT USAGE ON SCHEMA outbox TO {r};
         GRANT SELECT ON outbox._operator_log TO {r}",
        r = ident(&auditor)
    ))
    .expect("auditor");
    let mut saudit = session_as(&cluster, &auditor);
    assert_eq!(one::<i64>(&mut saudit, of_both, &[&only_a, &everyone]), 0);
    drop(saudit);
    su.batch_execute(&format!(
        "REVOKE ALL ON outbox._operator_log FROM {r}; REVOKE USAGE ON SCHEMA outbox FROM {r}; DROP ROLE {r}",
        r = ident(&auditor)
    ))
    .expect("drop auditor");
    // Listing b shows it the channel's whole log, its earlier rows too.
    su.execute(
        "SELECT outbox.alter_channel($1, $2::text::jsonb)",
        &[&only_a, &format!(r#"{{"tenants": ["{a}", "{b}"]}}"#)],
    )
    .expect("alter");
    let now_all = rows(&mut su, &only_a);
    assert_eq!(rows(&mut sb, &only_a), now_all);
    let detail: String = one(
        &mut sb,
        "SELECT string_agg(coalesce(detail::text, ''), ' ') FROM outbox.operator_log WHERE channel = $1",
        &[&only_a],
    );
    assert!(!detail.contains("SECRET-A"), "{detail}");
}

/// A condition of the reader's own, cheaper than a view's filter, is not evaluated on the
/// rows the filter hides: `outbox.channels` and `outbox._under_way` run with their owner's
/// rights, and without `security_barrier` the planner ran the reader's condition first, on
/// every row. A division by zero on a hidden row's name or id is how a condition would
/// show it (a function of the reader's could as well print it); it must never run. (The
/// divisor is computed from the row: a constant one would be folded, and fail, at planning.)
#[test]
fn a_readers_own_condition_never_sees_a_row_the_views_hide() {
    let cluster = Cluster::from_env();
    let mut su = cluster.connect();
    let (a, b) = (unique("cta"), unique("ctb"));
    let only_a = paused_channel(&mut su, &format!(r#"{{"tenants": ["{a}"]}}"#));
    let (writer_a, writer_b) = (Writer::new(&cluster, &a), Writer::new(&cluster, &b));
    let id = writer_a.enqueue(&only_a, None).expect("enqueue as a");
    // In flight, as a claim makes it (the channel is paused: no worker sends or recovers it
    // before the lease ends, an hour from now).
    let claim: i64 = one(
        &mut su,
        "INSERT INTO outbox._claims (channel_id, lease_owner, worker_pid, lease_until, started_at, message_ids)
         SELECT channel_id, -1, 0, now() + interval '1 hour', now(), ARRAY[id]
           FROM outbox._messages WHERE id = $1
         RETURNING id",
        &[&id],
    );
    let mut sb = writer_b.session();
    let probes = [
        format!(
            "SELECT count(*) FROM outbox.channels WHERE (CASE WHEN name = '{only_a}' THEN 1 / (length(name) - length(name)) ELSE 1 END) = 1"
        ),
        format!(
            "SELECT count(*) FROM outbox._under_way WHERE (CASE WHEN message_id = {id} THEN 1 / (message_id - message_id) ELSE 1 END) = 1"
        ),
        format!(
            "SELECT count(*) FROM outbox._under_way WHERE (CASE WHEN channel_id IS NOT NULL AND message_id = {id} THEN 1 / (message_id - message_id) ELSE 1 END) = 1"
        ),
    ];
    let mut outcomes = Vec::new();
    for probe in &probes {
        outcomes.push(match sb.query_one(probe.as_str(), &[]) {
            Ok(row) => format!("{} rows", row.get::<_, i64>(0)),
            Err(e) => format!("error {}", code_of(&e)),
        });
    }
    // Tenant a's own writer sees both, the same way.
    let mut sa = writer_a.session();
    let own = sa
        .query_one(probes[1].as_str(), &[])
        .map_err(|e| code_of(&e));
    su.execute("DELETE FROM outbox._claims WHERE id = $1", &[&claim])
        .expect("end the claim");
    su.execute("SELECT outbox.cancel($1, 'end of test')", &[&id])
        .expect("cancel");
    for (probe, outcome) in probes.iter().zip(&outcomes) {
        assert!(outcome.ends_with("rows"), "{probe}: {outcome}");
    }
    assert_eq!(
        own.err().as_deref(),
        Some("22012"),
        "a's writer reads its own claim"
    );
}

#[test]
fn messages_may_not_set_framing_routing_signing_or_key_headers() {
    let cluster = Cluster::from_env();
    let mut su = cluster.connect();
    let t = unique("cth");
    let ch = paused_channel(
        &mut su,
        r#"{"idempotency_header": "Idempotency-Key", "reference_header": "X-Ref"}"#,
    );
    let plain = paused_channel(&mut su, "{}");
    let writer = Writer::new(&cluster, &t);
    for name in [
        "Host",
        "Content-Length",
        "transfer-encoding",
        "Connection",
        "Upgrade",
        "TE",
        "Trailer",
        "Proxy-Authorization",
        "Forwarded",
        "X-Forwarded-For",
        "X-Forwarded-Host",
        "webhook-signature",
        "Idempotency-Key",
        "x-ref",
    ] {
        let headers = format!(r#"{{"X-Fine": "1", "{name}": "3"}}"#);
        let e = writer
            .enqueue(&ch, Some(&headers))
            .expect_err(&format!("{name} is refused"));
        assert_eq!(code_of(&e), "22023", "{name}: {e:?}");
        let message = e
            .as_db_error()
            .map(|d| d.message().to_string())
            .unwrap_or_default();
        assert!(
            message.contains(&format!("\"{name}\"")),
            "{name}: {message}"
        );
    }
    assert_eq!(messages_of(&mut su, &t, &ch), 0, "nothing was written");
    // The key headers belong to the channel that sets them.
    writer
        .enqueue(
            &plain,
            Some(r#"{"Idempotency-Key": "mine", "X-Request-Id": "r"}"#),
        )
        .expect("a channel without key headers leaves the name free");
}

#[test]
fn a_stored_framing_header_is_not_sent() {
    let cluster = Cluster::from_env();
    let mut su = cluster.connect();
    let sim = Simulator::start();
    let ch = unique("ct_stored");
    create_channel(
        &mut su,
        &ch,
        &sim.send_url(&ch),
        r#"{"retry": {"max_attempts": 1}}"#,
    );
    // A row written by hand, around enqueue's checks.
    let id: i64 = one(&mut su, "INSERT INTO outbox._messages (tenant, channel_id, effect_key, payload, headers, next_attempt_at)
             SELECT 'default', c.id, $2, '{\"text\": \"cut me short\"}', '{\"Content-Length\": \"3\"}', now()
               FROM outbox._channels c WHERE c.name = $1
             RETURNING id", &[&ch, &unique("ct_key")]);
    su.execute("SELECT pg_notify('outbox_delivery', '')", &[])
        .ok();
    assert!(
        wait_for_state(&cluster, id, "failed", T),
        "state: {:?}",
        outbox_e2e::cluster::state_of(&cluster, id)
    );
    assert_eq!(sim.send_count(&ch), 0, "the provider received the request");
    sim.shutdown();
}
