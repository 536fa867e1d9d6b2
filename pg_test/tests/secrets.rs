//! Channel secrets stay secret: API keys in an endpoint's query string or userinfo, in a
//! reconcile URL and in static headers. Every outcome is driven (delivered, failed,
//! exhausted, a refused connection, a timeout, an ambiguous drop with failing lookups, an
//! on-demand reconcile, channel changes, a refused endpoint); then every view, as a writer,
//! an operator and an admin, the metrics, and the server log are searched for the secrets.
//!
//! Run: `cargo test -p outbox_e2e --release --test secrets`.

use outbox_e2e::cluster::{unique, wait_for_state, Cluster};
use outbox_e2e::helpers::{
    closed_port, count, create_channel, enqueue, ident, one, session_as, CONTRACT_VIEWS,
};
use outbox_e2e::sim::{Action, Simulator};
use postgres::Client;
use std::time::Duration;

const T: Duration = Duration::from_secs(40);
/// The secrets: each must appear nowhere but in `outbox._channels` (the owner's table).
const SECRETS: [&str; 4] = [
    "S3CRET-QUERY",
    "S3CRET-USER",
    "S3CRET-HEADER",
    "S3CRET-LOOKUP",
];

/// `http://user:S3CRET-USER@127.0.0.1:PORT/PATH?api_key=S3CRET-QUERY`
fn secret_url(port: u16, path: &str) -> String {
    format!("http://user:S3CRET-USER@127.0.0.1:{port}{path}?api_key=S3CRET-QUERY&v=1")
}

fn channel(c: &mut Client, ch: &str, endpoint: &str, options: &str) {
    let options = format!(
        r#"{{"headers": {{"Authorization": "Bearer S3CRET-HEADER"}}, "timeout_ms": 400, "connect_timeout_ms": 400, {options}}}"#
    );
    create_channel(c, ch, endpoint, &options);
}

/// Everything `role` reads in the views it may read, as text.
fn everything_visible_to(cluster: &Cluster, role: &str) -> String {
    let mut c = session_as(cluster, role);
    let mut text = String::new();
    for view in CONTRACT_VIEWS {
        let readable: bool = one(
            &mut c,
            "SELECT has_table_privilege(current_user, $1, 'SELECT')",
            &[&format!("outbox.{view}")],
        );
        if readable {
            let rows: String = c
                .query_one(
                    &format!(
                        "SELECT coalesce(string_agg(row_to_json(v)::text, E'\\n'), '') FROM outbox.{view} v"
                    ),
                    &[],
                )
                .unwrap_or_else(|e| panic!("{role} reading outbox.{view}: {e}"))
                .get(0);
            text.push_str(&rows);
        }
    }
    if let Ok(row) = c.query_one("SELECT outbox.prometheus()", &[]) {
        text.push_str(&row.get::<_, String>(0));
    }
    text
}

fn assert_no_secret(what: &str, text: &str) {
    for secret in SECRETS {
        if let Some(at) = text.find(secret) {
            let from = text[..at]
                .char_indices()
                .rev()
                .nth(200)
                .map_or(0, |(i, _)| i);
            panic!(
                "{what} shows {secret}: …{}…",
                &text[from..(at + 40).min(text.len())]
            );
        }
    }
}

#[test]
fn url_header_and_lookup_secrets_appear_in_no_view_and_no_log_line() {
    let cluster = Cluster::from_env();
    let mark = cluster.log_mark();
    let mut su = cluster.connect();
    let sim = Simulator::start();
    let port = sim.port();
    let closed = closed_port();

    // Each channel's endpoint is the simulator's send URL for its name, with the secrets.
    let mk = |su: &mut Client, options: &str| -> String {
        let ch = unique("sec");
        channel(su, &ch, &secret_url(port, &format!("/ch/{ch}")), options);
        ch
    };
    let ok = mk(&mut su, r#""retry": {"max_attempts": 1}"#);
    let failed = mk(&mut su, r#""retry": {"max_attempts": 1}"#);
    sim.set_default(&failed, Action::Status(400));
    let exhausted = mk(&mut su, r#""retry": {"max_attempts": 1}"#);
    sim.set_default(&exhausted, Action::Status(503));
    let hang = mk(&mut su, r#""retry": {"max_attempts": 1}"#);
    sim.set_default(&hang, Action::Hang { store: false });
    let lookup = format!("http://127.0.0.1:{closed}/m/{{effect_key}}?token=S3CRET-LOOKUP");
    let ambiguous = mk(
        &mut su,
        &format!(
            r#""retry": {{"max_attempts": 2, "base_ms": 100}}, "reconcile": {{"url": "{lookup}"}}"#
        ),
    );
    sim.set_default(&ambiguous, Action::DropAfterRead { store: false });
    let refused = unique("sec");
    channel(
        &mut su,
        &refused,
        &secret_url(closed, "/x"),
        r#""retry": {"max_attempts": 1}"#,
    );

    let ids = [
        (enqueue(&mut su, &ok, &unique("sec_key")), "delivered"),
        (enqueue(&mut su, &failed, &unique("sec_key")), "failed"),
        (
            enqueue(&mut su, &exhausted, &unique("sec_key")),
            "exhausted",
        ),
        (enqueue(&mut su, &hang, &unique("sec_key")), "uncertain"),
        (
            enqueue(&mut su, &ambiguous, &unique("sec_key")),
            "uncertain",
        ),
        (enqueue(&mut su, &refused, &unique("sec_key")), "exhausted"),
    ];
    for (id, state) in ids {
        assert!(
            wait_for_state(&cluster, id, state, T),
            "message {id} did not reach {state}: {:?}",
            outbox_e2e::cluster::state_of(&cluster, id)
        );
    }
    // The ambiguous message's lookups fail against the closed port, in the worker and on
    // demand; each failure is recorded with its error text.
    let amb_id = ids[4].0;
    let answer: String = su
        .query_one("SELECT outbox.reconcile($1)", &[&amb_id])
        .expect("reconcile")
        .get(0);
    assert_eq!(answer, "unavailable");
    let lookup_errors = count(&mut su, "SELECT count(*) FROM outbox.attempts WHERE message_id = $1 AND kind = 'reconcile' AND error LIKE '%token=********%'", &[&amb_id]);
    assert!(lookup_errors >= 1, "no lookup error quoted the masked URL");
    let refused_error: String = su
        .query_one(
            "SELECT coalesce(last_error, '') FROM outbox.messages WHERE id = $1",
            &[&ids[5].0],
        )
        .expect("error")
        .get(0);
    assert!(
        refused_error.contains("api_key=********"),
        "the refused connection's error quotes its (masked) URL: {refused_error}"
    );

    // Channel changes and a refused endpoint, with the secret passed as a parameter.
    su.execute(
        "SELECT outbox.alter_channel($1, $2::text::jsonb)",
        &[
            &ok,
            &format!(
                r#"{{"endpoint": "{}", "max_in_flight": 3}}"#,
                secret_url(port, &format!("/ch/{ok}"))
            ),
        ],
    )
    .expect("alter");
    let bad = su
        .execute(
            "SELECT outbox.create_channel($1, $2, '{}')",
            &[
                &unique("sec_bad"),
                &"http://user:S3CRET-USER@127.0.0.1:99999/x?api_key=S3CRET-QUERY",
            ],
        )
        .expect_err("a port out of range is refused");
    assert_no_secret("the refusal of an invalid endpoint", &bad.to_string());

    let roles: Vec<(String, &str)> = ["outbox_writer", "outbox_operator", "outbox_admin"]
        .iter()
        .map(|r| (unique("sec_role"), *r))
        .collect();
    for (role, member_of) in &roles {
        su.batch_execute(&format!(
            "CREATE ROLE {} NOLOGIN IN ROLE {member_of}",
            ident(role)
        ))
        .expect("role");
        su.execute("SELECT outbox.bind_tenant($1, 'default')", &[role])
            .expect("bind");
    }
    for (role, member_of) in &roles {
        let seen = everything_visible_to(&cluster, role);
        assert!(
            seen.contains(&ok),
            "{member_of} saw nothing of the test's channels"
        );
        assert_no_secret(&format!("what {member_of} reads"), &seen);
    }
    let superuser_view = everything_visible_to(&cluster, "postgres");
    assert_no_secret("the views, read by a superuser", &superuser_view);
    assert_no_secret("the server log", &cluster.log_since(mark));

    for (role, _) in &roles {
        let _ = su.execute("SELECT outbox.unbind_tenant($1, 'default')", &[role]);
        let _ = su.batch_execute(&format!("DROP ROLE {}", ident(role)));
    }
    for (id, _) in ids {
        let _ = su.execute("SELECT outbox.cancel($1, 'secrets test cleanup')", &[&id]);
    }
    sim.shutdown();
}
