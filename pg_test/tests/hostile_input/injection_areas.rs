//! Section 1, one hostile string through every entry point, area by area.

use super::injection::{
    header_name_expectation, header_value_expectation, json_pointer, key_expectation,
    reason_expectation, sql_literal, tenant_expectation, Checker, Expect, Hostile,
};
use super::*;
/// One hostile string of a round: `i` numbers it (for unique names), `label` names it in
/// failure messages.
pub(super) struct Round<'a> {
    pub(super) tag: String,
    pub(super) i: usize,
    pub(super) label: &'a str,
    pub(super) s: &'a str,
}

impl Round<'_> {
    /// A name unique to this string and `suffix`.
    fn k(&self, suffix: &str) -> String {
        format!("{}_{}_{suffix}", self.tag, self.i)
    }

    /// `what`, labelled with the string it is about.
    fn w(&self, what: &str) -> String {
        format!("[{}] {what}", self.label)
    }
}

/// `effect_key()` with it as either part; `enqueue()` with it as the channel, in the
/// payload, as the whole payload, in the effect and ordering keys, as a header value and name.
pub(super) fn effect_keys_and_enqueue(h: &mut Hostile<'_>, ck: &mut Checker, r: &Round<'_>) {
    let s = r.s;
    let k = |suffix: &str| r.k(suffix);
    let w = |what: &str| r.w(what);

    // effect_key(): any non-empty part.
    for (what, source, operation) in [("source", s, "op"), ("operation", "src", s)] {
        let r = h
            .writer
            .query_one(
                "SELECT outbox.effect_key($1::text, $2::text)",
                &[&source, &operation],
            )
            .map(|r| r.get::<_, String>(0));
        if let Some(key) = ck.call(&w(&format!("effect_key with it as {what}")), Expect::Ok, r) {
            ck.check(
                key.len() == 64 && key.bytes().all(|b| b.is_ascii_hexdigit()),
                || {
                    w(&format!(
                        "effect_key with it as {what} returned {key:?}, not 64 hex digits"
                    ))
                },
            );
        }
    }

    // enqueue(): channel, payload, effect key, ordering key, header value and name.
    let r = h
        .writer
        .query_one(
            "SELECT outbox.enqueue($1::text, '{}'::jsonb, $2::text)",
            &[&s, &k("chan")],
        )
        .map(|r| r.get::<_, i64>(0));
    ck.call(&w("enqueue with it as channel"), Expect::Code("42704"), r);

    let payload = json!({"s": s, s: [s, {"n": s}]});
    let text = payload.to_string();
    let base = h.base.clone();
    // jsonb's text adds a space after ':' and ','; near the limit either outcome is right.
    let payload_expect = if text.len() + 64 < h.max_payload {
        Expect::Ok
    } else if text.len() > h.max_payload {
        Expect::Code("54000")
    } else {
        Expect::Clean
    };
    if let Some(id) = h.enqueue(
        ck,
        &w("enqueue with it in the payload"),
        payload_expect,
        (&base, &text, &k("payload"), None, None),
    ) {
        let same: bool =
            h.su.query_one(
                "SELECT payload = $2::text::jsonb FROM outbox.messages WHERE id = $1",
                &[&id, &text],
            )
            .map(|r| r.get(0))
            .unwrap_or(false);
        ck.check(same, || {
            w(&format!(
                "message {id}: the payload was not stored verbatim"
            ))
        });
        h.sent.push((id, payload));
    }
    let string_payload = Value::String(s.to_string()).to_string();
    if let Some(id) = h.enqueue(
        ck,
        &w("enqueue with it as the whole payload (a JSON string)"),
        Expect::Clean,
        (&base, &string_payload, &k("strpayload"), None, None),
    ) {
        let stored = h.message_text(id, "payload #>> '{}'");
        ck.verbatim(&w("payload string"), stored, s);
        h.sent.push((id, Value::String(s.to_string())));
    }
    let key = format!("{}_{s}", k("key"));
    if let Some(id) = h.enqueue(
        ck,
        &w("enqueue with it in the effect key"),
        key_expectation(&key),
        (&base, "{}", &key, None, None),
    ) {
        let stored = h.message_text(id, "effect_key");
        ck.verbatim(&w("effect key"), stored, &key);
        h.sent.push((id, json!({})));
    }
    let ordering = format!("{}_{s}", k("ord"));
    if let Some(id) = h.enqueue(
        ck,
        &w("enqueue with it in the ordering key"),
        key_expectation(&ordering),
        (&base, "{}", &k("ordkey"), Some(&ordering), None),
    ) {
        let stored = h.message_text(id, "ordering_key");
        ck.verbatim(&w("ordering key"), stored, &ordering);
        h.sent.push((id, json!({})));
    }
    let headers = json!({"X-Probe": s}).to_string();
    if let Some(id) = h.enqueue(
        ck,
        &w("enqueue with it as a header value"),
        header_value_expectation(s),
        (&base, "{}", &k("hval"), None, Some(&headers)),
    ) {
        let stored = h.message_text(id, "headers ->> 'X-Probe'");
        ck.verbatim(&w("header value"), stored, s);
        h.sent.push((id, json!({})));
    }
    let headers = json!({ s: "v" }).to_string();
    if let Some(id) = h.enqueue(
        ck,
        &w("enqueue with it as a header name"),
        header_name_expectation(s),
        (&base, "{}", &k("hname"), None, Some(&headers)),
    ) {
        let present = h.message_text(id, &format!("headers ? {}", sql_literal(s)));
        ck.check(present.as_deref() == Some("true"), || {
            w(&format!(
                "message {id}: header name accepted but not stored verbatim"
            ))
        });
        h.sent.push((id, json!({})));
    }
    h.enqueue(
        ck,
        &w("enqueue with it as the headers JSON text"),
        Expect::Clean,
        (&base, "{}", &k("hraw"), None, Some(s)),
    );
}

/// Operator actions on a queued message of the operator's tenant, with it as owner or reason.
pub(super) fn operator_actions(h: &mut Hostile<'_>, ck: &mut Checker, r: &Round<'_>) {
    let s = r.s;
    let k = |suffix: &str| r.k(suffix);
    let w = |what: &str| r.w(what);

    // Operator actions on a queued message of the operator's tenant.
    let m = h.held_message(&k("held"));
    let r = h
        .operator
        .execute("SELECT outbox.assign($1::int8, $2::text)", &[&m, &s]);
    if ck
        .call(&w("assign with it as owner"), reason_expectation(s), r)
        .is_some()
    {
        let stored = h.message_text(m, "owner");
        ck.verbatim(&w("owner"), stored, s);
    }
    let r = h.operator.execute(
        "SELECT outbox.resolve($1::int8, $2::text, 'hostile input test')",
        &[&m, &s],
    );
    ck.call(&w("resolve with it as outcome"), Expect::Code("22023"), r);
    let r = h.operator.execute(
        "SELECT outbox.resolve($1::int8, 'failed', $2::text)",
        &[&m, &s],
    );
    if ck
        .call(&w("resolve with it as reason"), reason_expectation(s), r)
        .is_some()
    {
        let n = h.log_reasons(m, s);
        ck.check(n >= 1, || {
            w(&format!(
                "resolve of {m}: the reason is not in outbox.operator_log verbatim"
            ))
        });
    }
    let r = h.operator.execute(
        "SELECT outbox.resolve($1::int8, 'failed', 'hostile input test', $2::text)",
        &[&m, &s],
    );
    if ck
        .call(&w("resolve with it as external_id"), Expect::Clean, r)
        .is_some()
    {
        let stored = h.message_text(m, "external_id");
        ck.verbatim(&w("external_id"), stored, s);
    }
    // failed → queued (on the paused channel it stays queued).
    let r = h
        .operator
        .execute("SELECT outbox.retry($1::int8, $2::text)", &[&m, &s]);
    if ck
        .call(&w("retry with it as reason"), reason_expectation(s), r)
        .is_some()
    {
        let n = h.log_reasons(m, s);
        ck.check(n >= 1, || {
            w(&format!(
                "retry of {m}: the reason is not in outbox.operator_log verbatim"
            ))
        });
    }
    let r = h
        .operator
        .execute("SELECT outbox.cancel($1::int8, $2::text)", &[&m, &s]);
    if ck
        .call(&w("cancel with it as reason"), reason_expectation(s), r)
        .is_some()
    {
        let state = h.message_text(m, "state");
        ck.check(state.as_deref() == Some("cancelled"), || {
            w(&format!(
                "cancel of {m} succeeded but the message is {state:?}"
            ))
        });
        let n = h.log_reasons(m, s);
        ck.check(n >= 1, || {
            w(&format!(
                "cancel of {m}: the reason is not in outbox.operator_log verbatim"
            ))
        });
    }
}

/// Channels, as an outbox_admin: it in the name or the endpoint of a new channel.
pub(super) fn channel_names_and_endpoints(h: &mut Hostile<'_>, ck: &mut Checker, r: &Round<'_>) {
    let s = r.s;
    let k = |suffix: &str| r.k(suffix);
    let w = |what: &str| r.w(what);

    // Channels, as an outbox_admin: name, endpoint, options, pause reason.
    let name = format!("{}_{s}", k("ch"));
    let url = h.sim.send_url(&h.base_sim);
    let r = h.admin.execute(
        "SELECT outbox.create_channel($1::text, $2::text, '{}'::jsonb)",
        &[&name, &url],
    );
    if ck
        .call(&w("create_channel with it in the name"), Expect::Clean, r)
        .is_some()
    {
        let n = count(
            &mut h.su,
            "SELECT count(*) FROM outbox._channels WHERE name = $1",
            &[&name],
        );
        ck.check(n == 1, || {
            w("channel name accepted but not stored verbatim")
        });
        let r = h.admin.execute(
            "SELECT outbox.pause_channel($1::text, 'hostile name')",
            &[&name],
        );
        ck.call(&w("pause_channel of the channel so named"), Expect::Ok, r);
        let r = h.admin.execute(
            "SELECT outbox.alter_channel($1::text, '{\"max_in_flight\": 3}'::jsonb)",
            &[&name],
        );
        ck.call(&w("alter_channel of the channel so named"), Expect::Ok, r);
        let r = h
            .admin
            .execute("SELECT outbox.resume_channel($1::text)", &[&name]);
        ck.call(&w("resume_channel of the channel so named"), Expect::Ok, r);
        if let Some(id) = h.enqueue(
            ck,
            &w("enqueue on the channel so named"),
            Expect::Ok,
            (&name, "{\"hostile_channel\": true}", &k("onch"), None, None),
        ) {
            h.sent.push((id, json!({"hostile_channel": true})));
        }
    }
    let r = h.admin.execute(
        "SELECT outbox.create_channel($1::text, $2::text, '{}'::jsonb)",
        &[&k("ep"), &s],
    );
    if ck
        .call(&w("create_channel with it as endpoint"), Expect::Clean, r)
        .is_some()
    {
        let stored: Option<String> =
            h.su.query_opt(
                "SELECT endpoint FROM outbox._channels WHERE name = $1",
                &[&k("ep")],
            )
            .expect("endpoint")
            .map(|r| r.get(0));
        ck.verbatim(&w("endpoint"), stored, s);
    }
    let in_url = format!("{url}/{s}");
    let r = h.admin.execute(
        "SELECT outbox.create_channel($1::text, $2::text, '{}'::jsonb)",
        &[&k("ep2"), &in_url],
    );
    if ck
        .call(
            &w("create_channel with it in the endpoint's path"),
            Expect::Clean,
            r,
        )
        .is_some()
    {
        let stored: Option<String> =
            h.su.query_opt(
                "SELECT endpoint FROM outbox._channels WHERE name = $1",
                &[&k("ep2")],
            )
            .expect("endpoint")
            .map(|r| r.get(0));
        ck.verbatim(&w("endpoint with it in the path"), stored, &in_url);
    }
}

/// Channels, as an outbox_admin: it in each option of a new channel and of an altered one.
pub(super) fn channel_options(h: &mut Hostile<'_>, ck: &mut Checker, r: &Round<'_>) {
    let s = r.s;
    let k = |suffix: &str| r.k(suffix);
    let w = |what: &str| r.w(what);
    let url = h.sim.send_url(&h.base_sim);

    // Options: (label, options, expectation, where the value is kept if accepted).
    let lookup = format!(
        "{}/by-key/{{effect_key}}?q={s}",
        h.sim.send_url(&h.base_sim)
    );
    let not_found: &[&str] = &["22023", "42883", "42704"];
    let options: Vec<(&str, Value, Expect, Option<Vec<&str>>)> = vec![
        (
            "header value",
            json!({"headers": {"X-H": s}}),
            if has_ascii_control(s) {
                Expect::Code("22023")
            } else {
                Expect::Clean
            },
            Some(vec!["headers", "X-H"]),
        ),
        (
            "header name",
            json!({"headers": {s: "v"}}),
            if is_token(s) {
                Expect::Clean
            } else {
                Expect::Code("22023")
            },
            Some(vec!["headers", s]),
        ),
        ("method", json!({"method": s}), Expect::Code("22023"), None),
        ("kind", json!({"kind": s}), Expect::Code("22023"), None),
        (
            "idempotency_header",
            json!({"idempotency_header": s}),
            if is_token(s) {
                Expect::Clean
            } else {
                Expect::Code("22023")
            },
            Some(vec!["idempotency_header"]),
        ),
        (
            "external_id",
            json!({"external_id": s}),
            if s.starts_with('/') || s.starts_with("header:") {
                Expect::Clean
            } else {
                Expect::Code("22023")
            },
            Some(vec!["external_id"]),
        ),
        (
            "external_id pointer",
            json!({"external_id": format!("/{s}")}),
            Expect::Clean,
            None,
        ),
        (
            "reconcile.url",
            json!({"reconcile": {"url": s}}),
            Expect::Code("22023"),
            None,
        ),
        (
            "reconcile.url query",
            json!({"reconcile": {"url": lookup}}),
            Expect::Clean,
            Some(vec!["reconcile", "url"]),
        ),
        (
            "reconcile.found",
            json!({"reconcile": {"url": h.sim.lookup_url_by_key(&h.base_sim), "found": format!("/{s}")}}),
            Expect::Clean,
            None,
        ),
        (
            "classify status",
            json!({"classify": {s: "transient"}}),
            Expect::Code("22023"),
            None,
        ),
        (
            "classify class",
            json!({"classify": {"409": s}}),
            Expect::Code("22023"),
            None,
        ),
        (
            "retry.jitter",
            json!({"retry": {"jitter": s}}),
            Expect::Code("22023"),
            None,
        ),
        ("unknown key", json!({ s: 1 }), Expect::Code("22023"), None),
        (
            "sql function and run_as",
            json!({"kind": "sql", "function": s, "run_as": s, "tenants": ["*"]}),
            Expect::OneOf(not_found),
            None,
        ),
    ];
    for (j, (what, opts, expect, path)) in options.iter().enumerate() {
        let text = opts.to_string();
        let ch = k(&format!("o{j}"));
        let r = h.admin.execute(
            "SELECT outbox.create_channel($1::text, $2::text, $3::text::jsonb)",
            &[&ch, &url, &text],
        );
        let created = ck.call(
            &w(&format!("create_channel with it in option {what}")),
            *expect,
            r,
        );
        if created.is_some() {
            if let Some(path) = path {
                let stored = h.option_text(&ch, path);
                if let Some(Value::String(expected)) = opts.pointer(&json_pointer(path)) {
                    ck.verbatim(&w(&format!("option {what}")), stored, expected);
                }
            }
        }
        if *what == "unknown key" && s.len() <= 100 && !has_ascii_control(s) {
            if let Err(e) = h.admin.execute(
                "SELECT outbox.create_channel($1::text, $2::text, $3::text::jsonb)",
                &[&k("unk"), &url, &text],
            ) {
                if let Some(d) = e.as_db_error() {
                    let said = format!(
                        "{} {} {}",
                        d.message(),
                        d.detail().unwrap_or(""),
                        d.hint().unwrap_or("")
                    );
                    ck.check(said.contains(s), || {
                        w(&format!(
                            "an unknown option key must be named in the error; it said: {}",
                            short(&said)
                        ))
                    });
                }
            }
        }
        let alt = h.alt.clone();
        let r = h.admin.execute(
            "SELECT outbox.alter_channel($1::text, $2::text::jsonb)",
            &[&alt, &text],
        );
        if ck
            .call(
                &w(&format!("alter_channel with it in option {what}")),
                *expect,
                r,
            )
            .is_some()
        {
            if let Some(path) = path {
                let stored = h.option_text(&alt, path);
                if let Some(Value::String(expected)) = opts.pointer(&json_pointer(path)) {
                    ck.verbatim(&w(&format!("altered option {what}")), stored, expected);
                }
            }
        }
    }
}

/// Channels, as an outbox_admin: it as the name of a channel to alter, pause or resume, as
/// the new endpoint, and as a pause reason.
pub(super) fn channel_actions_by_name(h: &mut Hostile<'_>, ck: &mut Checker, r: &Round<'_>) {
    let s = r.s;
    let w = |what: &str| r.w(what);

    let r = h.admin.execute(
        "SELECT outbox.alter_channel($1::text, '{\"max_in_flight\": 2}'::jsonb)",
        &[&s],
    );
    ck.call(
        &w("alter_channel with it as name"),
        Expect::Code("42704"),
        r,
    );
    let endpoint_change = json!({"endpoint": s}).to_string();
    let alt = h.alt.clone();
    let r = h.admin.execute(
        "SELECT outbox.alter_channel($1::text, $2::text::jsonb)",
        &[&alt, &endpoint_change],
    );
    ck.call(
        &w("alter_channel with it as the new endpoint"),
        Expect::Code("22023"),
        r,
    );
    let pz = h.pz.clone();
    let r = h.admin.execute(
        "SELECT outbox.pause_channel($1::text, $2::text)",
        &[&pz, &s],
    );
    let pause_expect = if s.chars().count() > 1000 || has_ascii_control(s) || has_c1_control(s) {
        Expect::Clean
    } else {
        Expect::Ok
    };
    if ck
        .call(&w("pause_channel with it as reason"), pause_expect, r)
        .is_some()
    {
        let stored: Option<String> =
            h.su.query_opt(
                "SELECT paused_reason FROM outbox.channels WHERE name = $1",
                &[&pz],
            )
            .expect("paused_reason")
            .and_then(|r| r.get(0));
        ck.verbatim(&w("pause reason"), stored, s);
        let r = h
            .admin
            .execute("SELECT outbox.resume_channel($1::text)", &[&pz]);
        ck.call(&w("resume_channel after the hostile pause"), Expect::Ok, r);
    }
    let r = h.admin.execute(
        "SELECT outbox.pause_channel($1::text, 'hostile input test')",
        &[&s],
    );
    ck.call(
        &w("pause_channel with it as name"),
        Expect::Code("42704"),
        r,
    );
    let r = h
        .admin
        .execute("SELECT outbox.resume_channel($1::text)", &[&s]);
    ck.call(
        &w("resume_channel with it as name"),
        Expect::Code("42704"),
        r,
    );
}

/// Tenants, as an outbox_admin: it as the tenant of a binding and as a role name; and as
/// the superuser's `outbox.tenant`.
pub(super) fn tenants(h: &mut Hostile<'_>, ck: &mut Checker, r: &Round<'_>) {
    let s = r.s;
    let k = |suffix: &str| r.k(suffix);
    let w = |what: &str| r.w(what);
    let base = h.base.clone();

    // Tenants, as an outbox_admin: the tenant of a binding, a role name.
    let bindee = h.bindee.clone();
    let r = h.admin.execute(
        "SELECT outbox.bind_tenant($1::text::name, $2::text)",
        &[&bindee, &s],
    );
    if ck
        .call(
            &w("bind_tenant with it as tenant"),
            tenant_expectation(s),
            r,
        )
        .is_some()
    {
        // The role, bound to this tenant alone, enqueues for it.
        let mut b = session(h.cluster, Some(&bindee));
        let r = b
            .query_one(
                "SELECT outbox.enqueue($1::text, '{}'::jsonb, $2::text)",
                &[&base, &k("tenant")],
            )
            .map(|r| r.get::<_, i64>(0));
        if let Some(id) = ck.call(&w("enqueue by a role bound to it as tenant"), Expect::Ok, r) {
            let stored = h.message_text(id, "tenant");
            ck.verbatim(&w("tenant of a binding"), stored, s);
            h.sent.push((id, json!({})));
        }
        let r = h.admin.execute(
            "SELECT outbox.unbind_tenant($1::text::name, $2::text)",
            &[&bindee, &s],
        );
        ck.call(&w("unbind_tenant with it as tenant"), Expect::Ok, r);
    }
    let r = h.admin.execute(
        "SELECT outbox.bind_tenant($1::text::name, 'hostile_input_tenant')",
        &[&s],
    );
    ck.call(
        &w("bind_tenant with it as role"),
        Expect::OneOf(&["42704", "22023"]),
        r,
    );
    let r = h.admin.execute(
        "SELECT outbox.unbind_tenant($1::text::name, 'hostile_input_tenant')",
        &[&s],
    );
    ck.call(&w("unbind_tenant with it as role"), Expect::Clean, r);

    // outbox.tenant of the superuser: a valid name is a tenant like any other.
    let set = h.su.execute(
        "SELECT pg_catalog.set_config('outbox.tenant', $1::text, false)",
        &[&s],
    );
    let expect = tenant_expectation(s);
    if ck
        .call(
            &w("SET outbox.tenant to it (superuser)"),
            Expect::Clean,
            set,
        )
        .is_some()
    {
        let r =
            h.su.query_one(
                "SELECT outbox.enqueue($1::text, '{}'::jsonb, $2::text)",
                &[&base, &k("sutenant")],
            )
            .map(|r| r.get::<_, i64>(0));
        if let Some(id) = ck.call(&w("superuser enqueue with it as outbox.tenant"), expect, r) {
            let stored = h.message_text(id, "tenant");
            ck.verbatim(&w("tenant named by outbox.tenant"), stored, s);
            h.sent.push((id, json!({})));
        }
    }
    let _ = h.su.batch_execute("RESET outbox.tenant");
}
