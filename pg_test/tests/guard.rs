//! End-to-end tests of the outbound-request guard, `outbox.allowed_hosts`: refused at
//! create/alter time, refused again by the worker at send time after the setting was
//! narrowed (nothing reaches the provider, the message fails permanently), and literal
//! metadata addresses refused even under `*`.
//!
//! The tests change the setting server-wide with ALTER SYSTEM and put it back when they
//! end, even when they fail. Run with `--test-threads=1`.

use outbox_e2e::cluster::{unique, wait_for_state, wait_for_workers, wait_until, Cluster};
use outbox_e2e::helpers::{cluster_and_sim, count, enqueue, sim_channel};
use postgres::Client;
use std::time::Duration;

const T: Duration = Duration::from_secs(30);

/// Sets `outbox.allowed_hosts` server-wide and waits until every worker has taken it; the
/// setting returns to its default when dropped.
struct AllowedHosts<'a> {
    cluster: &'a Cluster,
}

impl<'a> AllowedHosts<'a> {
    fn set(cluster: &'a Cluster, value: &str) -> AllowedHosts<'a> {
        let workers = wait_for_workers(cluster, &[]).len();
        let mark = cluster.log_mark();
        let mut c = cluster.connect();
        c.execute(
            &format!("ALTER SYSTEM SET outbox.allowed_hosts = '{value}'"),
            &[],
        )
        .expect("ALTER SYSTEM");
        c.execute("SELECT pg_reload_conf()", &[]).expect("reload");
        let line = format!("outbox.allowed_hosts = '{value}'");
        // A worker takes the setting at the start of its next cycle (at the latest after
        // one poll interval).
        let taken = wait_until(T, || {
            cluster.log_since(mark).matches(&line).count() >= workers
        });
        assert!(
            taken,
            "the workers did not log {line:?}:\n{}",
            cluster.log_since(mark)
        );
        AllowedHosts { cluster }
    }
}

impl Drop for AllowedHosts<'_> {
    fn drop(&mut self) {
        let mut c = self.cluster.connect();
        let _ = c.execute("ALTER SYSTEM RESET outbox.allowed_hosts", &[]);
        let _ = c.execute("SELECT pg_reload_conf()", &[]);
        std::thread::sleep(Duration::from_millis(1500));
    }
}

fn sqlstate_of(
    c: &mut Client,
    sql: &str,
    params: &[&(dyn postgres::types::ToSql + Sync)],
) -> String {
    match c.execute(sql, params) {
        Ok(_) => "00000".into(),
        Err(e) => e
            .as_db_error()
            .map(|d| format!("{} {}", d.code().code(), d.detail().unwrap_or_default()))
            .unwrap_or_else(|| format!("not a database error: {e}")),
    }
}

#[test]
fn a_destination_outside_the_list_is_refused_when_created() {
    let cluster = Cluster::from_env();
    let _allowed = AllowedHosts::set(&cluster, "api.example.com");
    let mut c = cluster.connect();
    let create = "SELECT outbox.create_channel($1::text, $2::text, $3::text::jsonb)";
    let name = unique("g_create");
    let refused = sqlstate_of(&mut c, create, &[&name, &"http://127.0.0.1:9/x", &"{}"]);
    assert!(
        refused.starts_with("42501"),
        "endpoint outside the list: {refused}"
    );
    assert!(
        refused.contains("api.example.com"),
        "the detail names the list: {refused}"
    );
    let refused = sqlstate_of(
        &mut c,
        create,
        &[
            &name,
            &"https://api.example.com/send",
            &r#"{"reconcile": {"url": "http://127.0.0.1:9/m/{effect_key}"}}"#,
        ],
    );
    assert!(
        refused.starts_with("42501"),
        "reconcile.url outside the list: {refused}"
    );
    let placeholder = sqlstate_of(
        &mut c,
        create,
        &[
            &name,
            &"https://api.example.com/send",
            &r#"{"reconcile": {"url": "http://{payload:/h}/m/{effect_key}"}}"#,
        ],
    );
    assert!(
        placeholder.starts_with("22023"),
        "a placeholder in the host: {placeholder}"
    );
    let n = count(
        &mut c,
        "SELECT count(*) FROM outbox._channels WHERE name = $1",
        &[&name],
    );
    assert_eq!(n, 0, "nothing was written");
    assert_eq!(
        sqlstate_of(
            &mut c,
            create,
            &[&name, &"https://api.example.com/send", &"{}"]
        ),
        "00000"
    );
    let bad = sqlstate_of(
        &mut c,
        "ALTER SYSTEM SET outbox.allowed_hosts = 'bad host:1'",
        &[],
    );
    assert!(
        bad.starts_with("22023"),
        "an invalid list is refused: {bad}"
    );
    c.execute("CREATE ROLE g_nobody NOLOGIN", &[]).ok();
    c.batch_execute("SET ROLE g_nobody").unwrap();
    let not_admin = sqlstate_of(&mut c, "SET outbox.allowed_hosts = '*'", &[]);
    c.batch_execute("RESET ROLE").unwrap();
    assert!(
        not_admin.starts_with("42501"),
        "only a superuser widens the list: {not_admin}"
    );
}

#[test]
fn literal_metadata_addresses_are_refused_under_any_host() {
    let cluster = Cluster::from_env();
    let mut c = cluster.connect();
    for endpoint in [
        "http://169.254.169.254/latest/meta-data",
        "http://0xa9fea9fe/",
        "http://[::ffff:169.254.169.254]/",
        "http://[fe80::1]/",
    ] {
        let refused = sqlstate_of(
            &mut c,
            "SELECT outbox.create_channel($1::text, $2::text, '{}')",
            &[&unique("g_meta"), &endpoint],
        );
        assert!(refused.starts_with("42501"), "{endpoint}: {refused}");
    }
}

#[test]
fn a_narrowed_list_stops_the_send_and_a_widened_one_lets_the_retry_through() {
    let (cluster, mut c, sim) = cluster_and_sim();
    let ch = sim_channel(&mut c, &sim, "g_send", "{}");

    let narrowed = AllowedHosts::set(&cluster, "api.example.com");
    let id = enqueue(&mut c, &ch, &unique("guard"));
    assert!(
        wait_for_state(&cluster, id, "failed", T),
        "refused send ends failed"
    );
    let row = c
        .query_one(
            "SELECT last_error_class::text, last_error FROM outbox.messages WHERE id = $1",
            &[&id],
        )
        .unwrap();
    let class: Option<String> = row.get(0);
    let error: Option<String> = row.get(1);
    assert_eq!(class.as_deref(), Some("permanent"));
    let error = error.unwrap_or_default();
    assert!(
        error.contains("refused by outbox.allowed_hosts") && error.contains("127.0.0.1"),
        "a readable error: {error}"
    );
    assert_eq!(sim.send_count(&ch), 0, "nothing reached the provider");
    drop(narrowed);

    let _widened = AllowedHosts::set(&cluster, "127.0.0.1");
    c.execute("SELECT outbox.retry($1, 'allowed_hosts fixed')", &[&id])
        .expect("retry");
    assert!(
        wait_for_state(&cluster, id, "delivered", T),
        "delivered after the fix"
    );
    assert_eq!(sim.send_count(&ch), 1);
}
