//! `signing`: every attempt carries a Standard Webhooks signature that a receiver with either
//! secret verifies over the exact bytes received.

use outbox_e2e::cluster::{unique, Cluster};
use outbox_e2e::helpers::{
    cluster_and_sim, code_of, describe, effect_key_of, enqueue_payload, one, session_as,
    sim_channel, wait_state, CONTRACT_VIEWS,
};
use outbox_e2e::sim::Action;
use outbox_e2e::webhook_verify::{now_s, verify, Rejection, Signed};
use std::time::Duration;

const OLD: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
/// 32 bytes: "a secret of the next rotation!!!" in base64.
const NEW: &str = "whsec_YSBzZWNyZXQgb2YgdGhlIG5leHQgcm90YXRpb24hISE=";

fn signing(secrets: &[&str]) -> String {
    serde_json::json!({"signing": {"scheme": "standard-webhooks", "secrets": secrets},
                       "retry": {"base_ms": 100, "jitter": "none"}})
    .to_string()
}

#[test]
fn every_attempt_verifies_with_either_secret_and_keeps_its_id() {
    let (cluster, mut c, sim) = cluster_and_sim();
    let ch = sim_channel(&mut c, &sim, "signed", &signing(&[OLD, NEW]));
    // A first attempt answered 503, the second accepted: two signed requests of one message.
    sim.set_plan(&ch, vec![Action::Status(503)]);
    let payload = r#"{"text": "ünïcödé \u2713", "n": [1, 2.50, {"deep": null}]}"#;
    let first = enqueue_payload(&mut c, &ch, payload, &unique("sig"));
    let second = enqueue_payload(&mut c, &ch, r#"{"n": 2}"#, &unique("sig"));
    wait_state(&cluster, first, "delivered");
    wait_state(&cluster, second, "delivered");
    let sends = sim.sends(&ch);
    assert_eq!(
        sends.len(),
        3,
        "two attempts of the first, one of the second"
    );
    let key_first = effect_key_of(&mut c, first);
    let mut ids = Vec::new();
    for r in &sends {
        let request = Signed {
            headers: &r.headers,
            body: &r.body,
        };
        for secret in [OLD, NEW] {
            let id = verify(secret, &request, now_s(), 300)
                .unwrap_or_else(|e| panic!("{e:?}: request {:?}", r.headers));
            ids.push(id);
        }
        // A receiver with a secret the channel does not have refuses it.
        let other = "whsec_b3RoZXIgc2VjcmV0IG9mIHNvbWVvbmUgZWxzZQ==";
        assert_eq!(
            verify(other, &request, now_s(), 300),
            Err(Rejection::NoSignatureMatches)
        );
    }
    // Each request verified twice (both secrets): its id is pushed twice. One message was
    // answered 503 once (whichever came first), so its id is there twice as often.
    let key_second = effect_key_of(&mut c, second);
    let mut counts = [&key_first, &key_second].map(|k| ids.iter().filter(|id| *id == k).count());
    counts.sort();
    assert_eq!(
        counts,
        [2, 4],
        "webhook-id is the effect key as sent, the same on the retry: {ids:?}"
    );
    // The signed body is the payload (as jsonb prints it), non-ASCII bytes included.
    let of_first = sends
        .iter()
        .find(|r| {
            r.headers
                .iter()
                .any(|(n, v)| n == "webhook-id" && *v == key_first)
        })
        .expect("a request of the first message");
    let body: serde_json::Value = serde_json::from_slice(&of_first.body).unwrap();
    assert_eq!(
        body,
        serde_json::from_str::<serde_json::Value>(payload).unwrap()
    );
}

#[test]
fn malformed_secrets_are_refused_with_22023_and_secrets_are_masked() {
    let (cluster, mut c, sim) = cluster_and_sim();
    let ch = sim_channel(&mut c, &sim, "signed_mask", &signing(&[OLD]));
    for bad in [
        r#"{"signing": {"secrets": ["MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"]}}"#,
        r#"{"signing": {"secrets": ["whsec_c2hvcnQ="]}}"#,
        r#"{"signing": {"secrets": ["whsec_!!!"]}}"#,
        r#"{"signing": {"secrets": []}}"#,
        r#"{"signing": {"scheme": "other", "secrets": ["whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"]}}"#,
    ] {
        let e = c
            .execute(
                "SELECT outbox.alter_channel($1::text, $2::text::jsonb)",
                &[&ch, &bad],
            )
            .expect_err(bad);
        assert_eq!(code_of(&e), "22023", "{bad}: {}", describe(&e));
        let text = describe(&e);
        assert!(text.contains("signing"), "{text}");
        assert!(
            !text.contains("MfKQ9r8"),
            "the secret is not quoted: {text}"
        );
        assert!(
            e.as_db_error().and_then(|d| d.hint()).is_some(),
            "a hint: {text}"
        );
    }
    let e = c
        .execute(
            "SELECT outbox.create_channel($1::text, $2::text, $3::text::jsonb)",
            &[
                &format!("{ch}_x"),
                &sim.send_url("x"),
                &r#"{"signing": {"secrets": ["whsec_c2hvcnQ="]}}"#,
            ],
        )
        .expect_err("a short secret");
    assert_eq!(code_of(&e), "22023");
    // A rotation: the new secret added, then the old one dropped.
    c.execute(
        "SELECT outbox.alter_channel($1::text, $2::text::jsonb)",
        &[&ch, &signing(&[OLD, NEW])],
    )
    .unwrap();
    c.execute(
        "SELECT outbox.alter_channel($1::text, $2::text::jsonb)",
        &[&ch, &signing(&[NEW])],
    )
    .unwrap();
    let id = enqueue_payload(&mut c, &ch, "{}", &unique("rotated"));
    wait_state(&cluster, id, "delivered");
    let r = sim.sends(&ch).pop().unwrap();
    let request = Signed {
        headers: &r.headers,
        body: &r.body,
    };
    assert!(verify(NEW, &request, now_s(), 300).is_ok());
    assert_eq!(
        verify(OLD, &request, now_s(), 300),
        Err(Rejection::NoSignatureMatches)
    );
    assert_nothing_shows(&cluster, &ch);
}

/// No view shows a secret to an operator, an admin or a writer, nor does the server log.
fn assert_nothing_shows(cluster: &Cluster, ch: &str) {
    let secrets = [&OLD[6..], &NEW[6..]];
    for role in ["outbox_operator", "outbox_admin", "outbox_writer"] {
        let mut c = session_as(cluster, role);
        for view in CONTRACT_VIEWS {
            let readable: bool = one(
                &mut c,
                "SELECT has_table_privilege(current_user, $1, 'SELECT')",
                &[&format!("outbox.{view}")],
            );
            if !readable {
                continue;
            }
            let text: String = one(
                &mut c,
                &format!("SELECT coalesce(string_agg(row_to_json(v)::text, ' '), '') FROM outbox.{view} v"),
                &[],
            );
            for s in secrets {
                assert!(!text.contains(s), "{role} sees a secret in outbox.{view}");
            }
        }
    }
    let mut c = cluster.connect();
    let shown: String = one(
        &mut c,
        "SELECT options::text FROM outbox.channels WHERE name = $1",
        &[&ch],
    );
    assert!(shown.contains(r#""secrets": ["********"]"#), "{shown}");
    std::thread::sleep(Duration::from_millis(200));
    let log = std::fs::read_to_string(cluster.log_path()).unwrap_or_default();
    for s in secrets {
        assert!(!log.contains(s), "the server log shows a secret");
    }
}
