//! `tls`: HTTPS to the simulator behind a test CA; unknown CA and wrong host name are TLS
//! failures named as such; mutual TLS refuses a client without a certificate and delivers
//! with one; invalid PEM is refused at create_channel.

use outbox_e2e::cluster::{unique, wait_until};
use outbox_e2e::helpers::{
    attempts, cluster_and_sim, code_of, create_channel, describe, enqueue, wait_state, Attempt,
};
use outbox_e2e::sim::Simulator;
use outbox_e2e::test_ca::TestPki;
use outbox_e2e::tls_front::TlsFront;
use postgres::Client;
use serde_json::json;
use std::sync::OnceLock;
use std::time::Duration;

fn pki() -> &'static TestPki {
    static PKI: OnceLock<TestPki> = OnceLock::new();
    PKI.get_or_init(TestPki::generate)
}

/// A channel to `front` with `tls` options and one attempt, so that a failure ends it.
fn channel(c: &mut Client, front: &TlsFront, tls: Option<serde_json::Value>) -> String {
    let ch = unique("tls");
    let mut options =
        json!({"retry": {"max_attempts": 1}, "connect_timeout_ms": 2000, "timeout_ms": 4000});
    if let Some(tls) = tls {
        options["tls"] = tls;
    }
    create_channel(c, &ch, &front.send_url(&ch), &options.to_string());
    ch
}

/// The only attempt of a message that ended without being delivered.
fn failed_attempt(cluster: &outbox_e2e::cluster::Cluster, c: &mut Client, id: i64) -> Attempt {
    assert!(
        wait_until(Duration::from_secs(30), || {
            let a = attempts(c, id);
            a.first().is_some_and(|a| a.finished_ms.is_some())
        }),
        "message {id} was not attempted; see {}",
        cluster.log_path().display()
    );
    attempts(c, id).remove(0)
}

fn assert_tls_failure(a: &Attempt, what: &str) {
    let error = a.error.clone().unwrap_or_default();
    assert!(
        error.starts_with("TLS:"),
        "{what}: the error names the TLS phase: {error}"
    );
    assert!(
        error.contains("certificate"),
        "{what}: the error says it is the certificate: {error}"
    );
    assert_eq!(a.error_class.as_deref(), Some("transient"), "{what}: {a:?}");
}

fn ca_only() -> serde_json::Value {
    json!({"ca_pem": pki().ca.cert_pem})
}

#[test]
fn a_private_ca_delivers_and_connections_are_reused() {
    let (cluster, mut c, sim) = cluster_and_sim();
    let front = TlsFront::start(
        sim.port(),
        &pki().server.cert_pem,
        &pki().server.key_pem,
        None,
    );
    let ch = channel(&mut c, &front, Some(ca_only()));
    for i in 0..5 {
        let id = enqueue(&mut c, &ch, &unique(&format!("tls_ok{i}")));
        wait_state(&cluster, id, "delivered");
    }
    assert_eq!(sim.send_count(&ch), 5);
    let handshakes = TlsFront::count(&front.counters().handshakes);
    assert!(
        (1..=2).contains(&handshakes),
        "5 messages one after another reuse the connection (a worker each at most): {handshakes} handshakes"
    );
}

#[test]
fn an_unknown_ca_and_a_wrong_host_name_are_tls_failures() {
    let (cluster, mut c, sim) = cluster_and_sim();
    let p = pki();
    // Signed by a CA the channel does not trust.
    let untrusted = TlsFront::start(
        sim.port(),
        &p.untrusted_server.cert_pem,
        &p.untrusted_server.key_pem,
        None,
    );
    let ch = channel(&mut c, &untrusted, Some(ca_only()));
    let id = enqueue(&mut c, &ch, &unique("tls_ca"));
    let a = failed_attempt(&cluster, &mut c, id);
    assert_tls_failure(&a, "unknown CA");
    assert!(
        a.error.as_deref().unwrap_or("").contains("UnknownIssuer"),
        "{a:?}"
    );
    // The test CA is not in the system's store: without ca_pem the same.
    let front = TlsFront::start(sim.port(), &p.server.cert_pem, &p.server.key_pem, None);
    let ch2 = channel(&mut c, &front, None);
    let id = enqueue(&mut c, &ch2, &unique("tls_system"));
    assert_tls_failure(&failed_attempt(&cluster, &mut c, id), "system roots only");
    // A trusted CA, a certificate for another name.
    let wrong = TlsFront::start(
        sim.port(),
        &p.wrong_host.cert_pem,
        &p.wrong_host.key_pem,
        None,
    );
    let ch3 = channel(&mut c, &wrong, Some(ca_only()));
    let id = enqueue(&mut c, &ch3, &unique("tls_host"));
    let a = failed_attempt(&cluster, &mut c, id);
    assert_tls_failure(&a, "wrong host name");
    assert!(
        a.error
            .as_deref()
            .unwrap_or("")
            .contains("not valid for name"),
        "{a:?}"
    );
    for ch in [&ch, &ch2, &ch3] {
        assert_eq!(
            sim.send_count(ch),
            0,
            "nothing reached the provider on {ch}"
        );
    }
}

#[test]
fn mutual_tls_refuses_a_client_without_a_certificate_and_delivers_with_one() {
    let (cluster, mut c, sim) = cluster_and_sim();
    let p = pki();
    let front = TlsFront::start(
        sim.port(),
        &p.server.cert_pem,
        &p.server.key_pem,
        Some(&p.ca.cert_pem),
    );
    let without = channel(&mut c, &front, Some(ca_only()));
    let id = enqueue(&mut c, &without, &unique("mtls_no"));
    let a = failed_attempt(&cluster, &mut c, id);
    let error = a.error.clone().unwrap_or_default();
    assert!(error.starts_with("TLS:"), "refused in the TLS phase: {a:?}");
    assert!(error.contains("Certificate"), "{error}");
    assert_eq!(a.error_class.as_deref(), Some("transient"), "{a:?}");
    assert_eq!(sim.send_count(&without), 0);
    assert!(TlsFront::count(&front.counters().failed_handshakes) >= 1);
    let with = channel(
        &mut c,
        &front,
        Some(json!({
            "ca_pem": p.ca.cert_pem,
            "client_cert_pem": p.client.cert_pem,
            "client_key_pem": p.client.key_pem,
        })),
    );
    let id = enqueue(&mut c, &with, &unique("mtls_yes"));
    wait_state(&cluster, id, "delivered");
    assert_eq!(sim.send_count(&with), 1);
    // The key is masked where the options are shown.
    let shown: String = c
        .query_one(
            "SELECT options::text FROM outbox.channels WHERE name = $1",
            &[&with],
        )
        .unwrap()
        .get(0);
    let key_body = p.client.key_pem.lines().nth(1).unwrap();
    assert!(
        !shown.contains(key_body),
        "the client key is masked: {shown}"
    );
    assert!(shown.contains(r#""client_key_pem": "********""#), "{shown}");
}

#[test]
fn invalid_pem_is_refused_at_create_channel() {
    let (_cluster, mut c, sim) = cluster_and_sim();
    let p = pki();
    let truncated = &p.ca.cert_pem[..p.ca.cert_pem.len() / 2];
    for (tls, what) in [
        (json!({"ca_pem": "not PEM"}), "text"),
        (json!({"ca_pem": truncated}), "a truncated certificate"),
        (
            json!({"client_cert_pem": p.client.cert_pem}),
            "a certificate without its key",
        ),
        (
            json!({"client_cert_pem": p.client.cert_pem, "client_key_pem": p.ca.cert_pem}),
            "a certificate as the key",
        ),
    ] {
        let ch = unique("tls_bad");
        let options = json!({ "tls": tls }).to_string();
        let e = c
            .execute(
                "SELECT outbox.create_channel($1::text, $2::text, $3::text::jsonb)",
                &[&ch, &sim_url(&sim, &ch), &options],
            )
            .expect_err(what);
        assert_eq!(code_of(&e), "22023", "{what}: {}", describe(&e));
        assert!(describe(&e).contains("tls"), "{what}: {}", describe(&e));
    }
}

fn sim_url(sim: &Simulator, ch: &str) -> String {
    sim.send_url(ch).replace("http://", "https://")
}
