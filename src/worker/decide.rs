//! What happens to a message after an attempt: pure Rust, no Postgres.
//!
//! `classify` says what the answer means; `retry_policy` says when (and whether) to try
//! again; this module combines them with the channel's capabilities into the next state.
//! An ambiguous outcome is never blindly resent: it is retried with the same key only where
//! the provider dedupes by key (inside its key window); otherwise it waits in `uncertain`
//! for reconcile or an operator.

use crate::channels::http::Transmission;
use crate::channels::nats::Publication;
use crate::channels::options::{ChannelOptions, Kind};
use crate::channels::remote::Sent;
use crate::classify::{classify, Class, Resend, SendFacts};
use crate::classify::{classify_sqlstate, EffectOutcome};
use crate::outbox::state::State;
use crate::retry_policy::{decide, parse_retry_after, Decision, FailureFacts};

/// The facts of the message an attempt belonged to.
#[derive(Debug, Clone, Copy)]
pub struct AttemptContext {
    /// Send attempts made so far, this one included.
    pub attempt: u32,
    pub now_ms: i64,
    pub enqueued_at_ms: i64,
    pub first_attempt_at_ms: i64,
}

impl AttemptContext {
    /// `budget_attempt` counts the attempts against the current budget, this one included.
    pub fn new(
        budget_attempt: i64,
        now_ms: i64,
        budget_started_at_ms: i64,
        first_attempt_at_ms: i64,
    ) -> Self {
        AttemptContext {
            attempt: budget_attempt.clamp(1, u32::MAX.into()) as u32,
            now_ms,
            enqueued_at_ms: budget_started_at_ms,
            first_attempt_at_ms,
        }
    }
}

/// The next state of a message, with everything the attempt row records.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    pub state: State,
    /// For `Queued`: when the next attempt is due.
    pub next_at_ms: Option<i64>,
    pub class: Option<Class>,
    pub http_status: Option<u16>,
    pub retry_after_ms: Option<u64>,
    pub external_id: Option<String>,
    /// Readable account of the attempt: phase, timing, status, and the decision taken.
    pub error: Option<String>,
    /// Short outcome for the attempt row: delivered, transient, permanent, ambiguous, ...
    pub outcome: String,
    /// For `Uncertain` on a channel that can be asked: how long the provider may take to
    /// finish the request (`reconcile.settle_ms`). Until then no lookup runs, and a lookup
    /// that does not find the message is not believed; the record keeps that window on the
    /// boot clock too (`_messages.settle_boot_ms`).
    pub settle_ms: Option<u64>,
}

/// How a resend of a message on this channel would be guarded: by its key where the
/// provider dedupes by it (`idempotency_header`), else not at all (a 502 or 504 is then
/// ambiguous, `crate::classify`).
fn resend_guard(options: &ChannelOptions) -> Resend {
    match options.idempotency_header {
        Some(_) => Resend::DedupedByKey,
        None => Resend::Unguarded,
    }
}

/// Decides after one send on a remote channel, whatever its kind.
pub fn after_send(
    sent: &Sent,
    options: &ChannelOptions,
    ctx: AttemptContext,
    rng: &mut dyn FnMut() -> f64,
) -> Verdict {
    match sent {
        Sent::Http(t) => after_transmission(t, options, ctx, rng),
        Sent::Nats(p) => after_publish(p, options, ctx, rng),
    }
}

/// Decides after one publish to NATS JetStream: an acknowledgement from the channel's
/// stream is delivered (`stream:sequence`); one from another stream is a permanent failure
/// naming both; nothing written or no stream on the subject is transient (nothing was
/// stored); a publish with no acknowledgement is ambiguous.
pub fn after_publish(
    p: &Publication,
    options: &ChannelOptions,
    ctx: AttemptContext,
    rng: &mut dyn FnMut() -> f64,
) -> Verdict {
    let expected = match &options.kind {
        Kind::Nats(t) => t.stream.as_str(),
        _ => "",
    };
    let (class, external_id, what) = match p {
        Publication::Acked {
            stream,
            sequence,
            duplicate,
            elapsed_ms,
        } if stream == expected => {
            let mut v = settle(
                Class::Delivered,
                None,
                None,
                Some(format!("{stream}:{sequence}")),
                String::new(),
                options,
                ctx,
                rng,
            );
            if *duplicate {
                v.outcome = "delivered (duplicate: the stream already held this Nats-Msg-Id)".into();
            }
            let _ = elapsed_ms;
            return v;
        }
        Publication::Acked {
            stream, sequence, elapsed_ms, ..
        } => (
            Class::Permanent,
            None,
            format!("wrong stream: acknowledged by stream \"{stream}\" (sequence {sequence}), not \"{expected}\", after {elapsed_ms} ms"),
        ),
        Publication::Fenced { error } => return not_started(error),
        Publication::NotWritten { error, permanent } => (
            if *permanent { Class::Permanent } else { Class::Transient },
            None,
            format!("not published: {error}"),
        ),
        Publication::Rejected {
            error,
            permanent,
            elapsed_ms,
        } => (
            if *permanent {
                Class::Permanent
            } else {
                Class::Transient
            },
            None,
            format!("{error} after {elapsed_ms} ms"),
        ),
        Publication::NoAck {
            error,
            timed_out,
            elapsed_ms,
        } => (
            Class::Ambiguous,
            None,
            if *timed_out {
                format!("published, {error} within {elapsed_ms} ms")
            } else {
                format!("published, {error} after {elapsed_ms} ms")
            },
        ),
    };
    settle(class, None, None, external_id, what, options, ctx, rng)
}

/// Before a republish on a `nats` channel whose subject does not name the effect key: once
/// the stream's duplicate window has closed since the first publish, a republish could be
/// stored twice, so the message is not published again; it takes the ambiguous path
/// (`uncertain`, for an operator). `attempt` is the message's attempt number, this one
/// included. None: publish. (A subject that names the key is guarded by the server: a
/// publish is stored only while the subject holds no message.)
pub fn before_republish(
    options: &ChannelOptions,
    attempt: i32,
    ctx: AttemptContext,
    rng: &mut dyn FnMut() -> f64,
) -> Option<Verdict> {
    let Kind::Nats(target) = &options.kind else {
        return None;
    };
    let window = target.duplicate_window_ms.unwrap_or(0) as i64;
    if attempt <= 1 || target.can_look_up() || ctx.now_ms - ctx.first_attempt_at_ms <= window {
        return None;
    }
    let what = format!(
        "not republished: the stream's duplicate window ({window} ms) has closed since the first publish"
    );
    Some(settle(
        Class::Ambiguous,
        None,
        None,
        None,
        what,
        options,
        ctx,
        rng,
    ))
}

/// The verdict for an attempt that never started because its fence had passed: queued
/// again, due now, as if it had not been claimed.
fn not_started(error: &str) -> Verdict {
    Verdict {
        state: State::Queued,
        next_at_ms: None,
        class: None,
        http_status: None,
        retry_after_ms: None,
        external_id: None,
        error: Some(error.to_string()),
        outcome: "not sent".into(),
        settle_ms: None,
    }
}

/// Decides after one transmission.
pub fn after_transmission(
    t: &Transmission,
    options: &ChannelOptions,
    ctx: AttemptContext,
    rng: &mut dyn FnMut() -> f64,
) -> Verdict {
    match t {
        // Nothing was sent (`send::decide_all` puts such a message back as it was before
        // it comes here): were it decided, it would be tried again at once.
        Transmission::Fenced { error } => not_started(error),
        Transmission::NotSent { error } => Verdict {
            state: State::Failed,
            next_at_ms: None,
            class: Some(Class::Permanent),
            http_status: None,
            retry_after_ms: None,
            external_id: None,
            error: Some(format!("not sent: {error}")),
            outcome: "permanent".into(),
            settle_ms: None,
        },
        // Nothing was written, and resending to the same destination would be refused again
        // until an administrator changes outbox.allowed_hosts: permanent, whatever `classify`.
        Transmission::Refused {
            phase,
            error,
            elapsed_ms,
        } => settle(
            Class::Permanent,
            None,
            None,
            None,
            format!("{}: {error} after {elapsed_ms} ms", phase.as_str()),
            options,
            ctx,
            rng,
        ),
        Transmission::Failed {
            phase,
            timed_out,
            error,
            elapsed_ms,
        } => {
            let facts = SendFacts::Failure {
                phase: *phase,
                timed_out: *timed_out,
            };
            let class = classify(&facts, &options.classify, resend_guard(options));
            let what = if *timed_out {
                format!(
                    "{}: timed out after {elapsed_ms} ms ({error})",
                    phase.as_str()
                )
            } else {
                format!("{}: {error} after {elapsed_ms} ms", phase.as_str())
            };
            settle(class, None, None, None, what, options, ctx, rng)
        }
        Transmission::Answered {
            status,
            retry_after,
            external_id,
            body_complete,
            body_error,
            excerpt,
            elapsed_ms,
        } => {
            let facts = SendFacts::Response {
                status: *status,
                body_complete: *body_complete,
            };
            let ruled = options
                .classify_answers
                .class_for(*status, excerpt.as_deref());
            let class = match ruled {
                // A body not read to the end confirms nothing (`classify`).
                Some((Class::Delivered, _)) if !*body_complete => Class::Ambiguous,
                Some((class, _)) => class,
                None => classify(&facts, &options.classify, resend_guard(options)),
            };
            let mut what = format!("HTTP {status} after {elapsed_ms} ms");
            if let Some(e) = body_error {
                what.push_str(&format!("; read: {e}"));
            }
            // What the provider said: kept with the attempt (`answer_excerpt`).
            if let Some(said) = excerpt {
                what.push_str(&format!("; answer: {said}"));
            }
            if let Some((_, rule)) = ruled {
                what.push_str(&format!("; {class} by classify_answers[{rule}]"));
            }
            let mut retry_after_ms = None;
            if let Some(raw) = retry_after {
                match parse_retry_after(raw, ctx.now_ms) {
                    Ok(ms) => retry_after_ms = Some(ms),
                    Err(e) => what.push_str(&format!("; Retry-After ignored: {e}")),
                }
            }
            settle(
                class,
                Some(*status),
                retry_after_ms,
                external_id.clone(),
                what,
                options,
                ctx,
                rng,
            )
        }
    }
}

/// Decides after calling a sql channel's function. An effect that was cancelled (57014: it
/// ran past `timeout_ms`, the worker was asked to stop, `pg_cancel_backend`) is retried
/// under the channel's backoff with its jitter at most `equal`: never sooner than half the
/// backoff's ceiling, so that an effect that outlasts its bound does not take a worker again
/// at once.
pub fn after_effect(
    outcome: &EffectOutcome,
    options: &ChannelOptions,
    ctx: AttemptContext,
    rng: &mut dyn FnMut() -> f64,
) -> Verdict {
    if let EffectOutcome::Raised { sqlstate, .. } = outcome {
        if sqlstate == "57014" && options.retry.jitter == crate::retry_policy::Jitter::Full {
            let mut bounded = options.clone();
            bounded.retry.jitter = crate::retry_policy::Jitter::Equal;
            return after_effect(outcome, &bounded, ctx, rng);
        }
    }
    match outcome {
        EffectOutcome::Returned(external_id) => Verdict {
            state: State::Delivered,
            next_at_ms: None,
            class: None,
            http_status: None,
            retry_after_ms: None,
            external_id: external_id.clone(),
            error: None,
            outcome: "delivered".into(),
            settle_ms: None,
        },
        EffectOutcome::Raised { sqlstate, message } => {
            let class = classify_sqlstate(sqlstate);
            settle(
                class,
                None,
                None,
                None,
                format!("sql: SQLSTATE {sqlstate}: {message}"),
                options,
                ctx,
                rng,
            )
        }
        EffectOutcome::Unavailable(e) => settle(
            Class::Permanent,
            None,
            None,
            None,
            format!("sql: {e}"),
            options,
            ctx,
            rng,
        ),
    }
}

/// Decides for a `sending` message whose lease expired: the worker stopped while the
/// attempt was in flight, so the provider may or may not have it.
pub fn after_lost_lease(
    options: &ChannelOptions,
    ctx: AttemptContext,
    rng: &mut dyn FnMut() -> f64,
) -> Verdict {
    let (class, what) = match options.kind {
        // A sql effect commits with its ledger entry: a lost attempt did not happen.
        Kind::Sql { .. } => (
            Class::Transient,
            "recovery: the worker stopped before the effect's transaction committed; nothing happened".to_string(),
        ),
        Kind::Http | Kind::Nats(_) => (
            Class::Ambiguous,
            "recovery: the attempt was in flight when its worker stopped (lease expired)".to_string(),
        ),
    };
    let mut v = settle(class, None, None, None, what, options, ctx, rng);
    v.outcome = format!("recovered: {}", v.state.as_str());
    v
}

/// Appends `text` to the verdict's account of the attempt.
fn note(v: &mut Verdict, text: String) {
    if let Some(e) = v.error.as_mut() {
        e.push_str("; ");
        e.push_str(&text);
    }
}

/// What an operator does with an ambiguous outcome on a deduping channel once its retries
/// ran out. Only a channel that can look a message up offers a reconcile: on the others
/// `outbox.reconcile` answers not_supported.
fn after_ambiguity_past_budget(options: &ChannelOptions) -> &'static str {
    if options.can_look_up() {
        "reconcile, or resolve by hand"
    } else {
        "ask the provider, then resolve by hand, or retry with the same key while the provider keeps it"
    }
}

#[allow(clippy::too_many_arguments)]
fn settle(
    class: Class,
    http_status: Option<u16>,
    retry_after_ms: Option<u64>,
    external_id: Option<String>,
    what: String,
    options: &ChannelOptions,
    ctx: AttemptContext,
    rng: &mut dyn FnMut() -> f64,
) -> Verdict {
    let mut v = Verdict {
        state: State::Failed,
        next_at_ms: None,
        class: Some(class),
        http_status,
        retry_after_ms,
        external_id,
        error: Some(what),
        outcome: class.as_str().to_string(),
        settle_ms: None,
    };
    let retry = |key_window_ms: Option<u64>, rng: &mut dyn FnMut() -> f64| {
        decide(
            &options.retry,
            &FailureFacts {
                failures: ctx.attempt.max(1),
                now_ms: ctx.now_ms,
                enqueued_at_ms: ctx.enqueued_at_ms,
                first_attempt_at_ms: ctx.first_attempt_at_ms,
                retry_after_ms,
                key_window_ms,
            },
            rng,
        )
    };
    match class {
        Class::Delivered => {
            v.state = State::Delivered;
            v.class = None;
            v.error = None;
        }
        Class::Permanent => {
            v.state = State::Failed;
            note(&mut v, "permanent: not retried".into());
        }
        Class::Transient => match retry(None, rng) {
            Decision::RetryAt {
                at_ms,
                delay_ms,
                retry_after_honoured,
            } => {
                v.state = State::Queued;
                v.next_at_ms = Some(at_ms);
                let why = if retry_after_honoured {
                    " (Retry-After honoured)"
                } else {
                    ""
                };
                note(&mut v, format!("retry in {delay_ms} ms{why}"));
            }
            Decision::Exhausted(e) => {
                v.state = State::Exhausted;
                note(&mut v, e.to_string());
            }
            Decision::KeyWindowClosed { window_ms } => {
                v.state = State::Exhausted;
                note(&mut v, format!("key window of {window_ms} ms closed"));
            }
        },
        Class::Ambiguous => match options.key_dedupe() {
            Some(window) => match retry(window, rng) {
                Decision::RetryAt {
                    at_ms, delay_ms, ..
                } => {
                    v.state = State::Queued;
                    v.next_at_ms = Some(at_ms);
                    note(
                        &mut v,
                        format!("the provider dedupes by key: same-key retry in {delay_ms} ms"),
                    );
                }
                Decision::Exhausted(e) => {
                    v.state = State::Uncertain;
                    let next = after_ambiguity_past_budget(options);
                    note(&mut v, format!("{e}; the provider may have it: {next}"));
                }
                Decision::KeyWindowClosed { window_ms } => {
                    v.state = State::Uncertain;
                    note(&mut v, format!("the provider's key window ({window_ms} ms) has closed: a resend could duplicate"));
                }
            },
            None if options.can_look_up() => {
                v.state = State::Uncertain;
                // The first lookup waits until the provider has had time to finish
                // processing the request whose answer never came.
                let wait = options.retry.base_ms.max(options.reconcile_settle_ms());
                v.next_at_ms = Some(ctx.now_ms.saturating_add(wait.min(i64::MAX as u64) as i64));
                v.settle_ms = Some(options.reconcile_settle_ms());
                note(&mut v, "no resend before a read-only reconcile".into());
            }
            None => {
                v.state = State::Uncertain;
                note(
                    &mut v,
                    "the channel neither dedupes by key nor can reconcile: an operator decides"
                        .into(),
                );
            }
        },
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::classify::Phase;
    use serde_json::json;

    /// The budget count comes from the row (attempts - budget_base, in bigint): any value a
    /// row changed by hand can hold is a valid attempt number.
    #[test]
    fn budget_attempt_from_any_row_is_an_attempt_number() {
        for (budget_attempt, want) in [
            (i64::MIN, 1),
            (-2_147_483_648 - 2_147_483_647, 1),
            (-1, 1),
            (0, 1),
            (1, 1),
            (8, 8),
            (i64::from(i32::MAX), i32::MAX as u32),
            // attempts 2147483647, budget_base -2147483648
            (i64::from(i32::MAX) - i64::from(i32::MIN), u32::MAX),
            (i64::MAX, u32::MAX),
        ] {
            assert_eq!(
                AttemptContext::new(budget_attempt, 0, 0, 0).attempt,
                want,
                "{budget_attempt}"
            );
        }
    }

    fn ctx(attempt: u32) -> AttemptContext {
        AttemptContext {
            attempt,
            now_ms: 1_000_000,
            enqueued_at_ms: 999_000,
            first_attempt_at_ms: 999_500,
        }
    }

    fn answered(status: u16, retry_after: Option<&str>) -> Transmission {
        Transmission::Answered {
            status,
            retry_after: retry_after.map(str::to_string),
            external_id: Some("ext-1".into()),
            body_complete: true,
            body_error: None,
            excerpt: None,
            elapsed_ms: 3,
        }
    }

    fn dropped() -> Transmission {
        Transmission::Failed {
            phase: Phase::Wait,
            timed_out: false,
            error: "connection reset".into(),
            elapsed_ms: 4,
        }
    }

    fn opts(v: serde_json::Value) -> ChannelOptions {
        ChannelOptions::from_json(&v).unwrap()
    }

    fn half() -> impl FnMut() -> f64 {
        || 0.5
    }

    #[test]
    fn classify_answers_decides_by_what_the_answer_said_before_the_status() {
        let o = opts(json!({"classify_answers": [
            {"status": "4xx", "contains": "quota exceeded", "class": "transient"},
            {"status": "409", "contains": "already processed", "class": "delivered"},
        ]}));
        let said = |status, text: &str, complete| Transmission::Answered {
            status,
            retry_after: None,
            external_id: None,
            body_complete: complete,
            body_error: None,
            excerpt: Some(text.into()),
            elapsed_ms: 3,
        };
        let v = after_transmission(
            &said(400, "{\"error\": \"quota exceeded\"}", true),
            &o,
            ctx(1),
            &mut half(),
        );
        assert_eq!((v.state, v.class), (State::Queued, Some(Class::Transient)));
        let error = v.error.unwrap();
        assert!(
            error.contains("answer: {\"error\": \"quota exceeded\"}"),
            "{error}"
        );
        assert!(
            error.contains("transient by classify_answers[0]"),
            "{error}"
        );
        // Another 400: the status decides, as without rules.
        let v = after_transmission(
            &said(400, "unknown recipient", true),
            &o,
            ctx(1),
            &mut half(),
        );
        assert_eq!((v.state, v.class), (State::Failed, Some(Class::Permanent)));
        assert!(!v.error.unwrap().contains("classify_answers"));
        let v = after_transmission(
            &said(409, "already processed", true),
            &o,
            ctx(1),
            &mut half(),
        );
        assert_eq!(v.state, State::Delivered);
        // Delivered by a rule, but the body was cut short: nothing is confirmed.
        let v = after_transmission(
            &said(409, "already processed", false),
            &o,
            ctx(1),
            &mut half(),
        );
        assert_eq!(v.class, Some(Class::Ambiguous));
        // Rules must be readable in the excerpt the channel keeps.
        let e = ChannelOptions::from_json(&json!({
            "response_excerpt_bytes": 4,
            "classify_answers": [{"contains": "quota exceeded", "class": "transient"}],
        }))
        .unwrap_err();
        assert_eq!(e.option, "classify_answers");
    }

    #[test]
    fn delivered_keeps_external_id() {
        let v = after_transmission(&answered(200, None), &opts(json!({})), ctx(1), &mut half());
        assert_eq!(v.state, State::Delivered);
        assert_eq!(v.external_id.as_deref(), Some("ext-1"));
        assert_eq!(v.error, None);
    }

    #[test]
    fn transient_is_requeued_with_backoff() {
        let v = after_transmission(
            &answered(503, None),
            &opts(json!({"retry": {"jitter": "none"}})),
            ctx(1),
            &mut half(),
        );
        assert_eq!(v.state, State::Queued);
        assert_eq!(v.next_at_ms, Some(1_000_000 + 1000));
        assert_eq!(v.class, Some(Class::Transient));
    }

    #[test]
    fn retry_after_is_honoured() {
        let v = after_transmission(
            &answered(429, Some("2")),
            &opts(json!({"retry": {"jitter": "none"}})),
            ctx(1),
            &mut half(),
        );
        assert_eq!(v.state, State::Queued);
        assert_eq!(v.retry_after_ms, Some(2000));
        assert!(v.next_at_ms.unwrap() >= 1_002_000);
    }

    #[test]
    fn garbage_retry_after_is_recorded_and_ignored() {
        let v = after_transmission(
            &answered(429, Some("soon")),
            &opts(json!({})),
            ctx(1),
            &mut half(),
        );
        assert_eq!(v.state, State::Queued);
        assert_eq!(v.retry_after_ms, None);
        assert!(v.error.unwrap().contains("Retry-After ignored"));
    }

    #[test]
    fn permanent_fails_at_once() {
        let v = after_transmission(&answered(401, None), &opts(json!({})), ctx(1), &mut half());
        assert_eq!(v.state, State::Failed);
        assert_eq!(v.class, Some(Class::Permanent));
    }

    #[test]
    fn budget_ends_in_exhausted() {
        let v = after_transmission(
            &answered(503, None),
            &opts(json!({"retry": {"max_attempts": 3}})),
            ctx(3),
            &mut half(),
        );
        assert_eq!(v.state, State::Exhausted);
        assert!(v.error.unwrap().contains("HTTP 503"));
    }

    #[test]
    fn ambiguous_on_a_deduping_channel_is_retried_with_the_key() {
        let o = opts(json!({"idempotency_header": "Idempotency-Key"}));
        let v = after_transmission(&dropped(), &o, ctx(1), &mut half());
        assert_eq!(v.state, State::Queued);
        assert_eq!(v.class, Some(Class::Ambiguous));
    }

    #[test]
    fn an_ambiguous_outcome_past_its_budget_offers_a_reconcile_only_where_there_is_one() {
        let keyed = json!({"idempotency_header": "Idempotency-Key", "retry": {"max_attempts": 2}});
        let mut asked = keyed.clone();
        asked["reconcile"] = json!({"url": "http://127.0.0.1:1/m/{effect_key}"});
        for (options, offers) in [(keyed, false), (asked, true)] {
            let v = after_transmission(&dropped(), &opts(options), ctx(2), &mut half());
            assert_eq!(v.state, State::Uncertain);
            let text = v.error.unwrap();
            assert_eq!(text.contains("reconcile"), offers, "{text}");
            assert!(text.contains("resolve by hand"), "{text}");
        }
    }

    #[test]
    fn ambiguous_past_the_key_window_waits() {
        let o = opts(
            json!({"idempotency_header": "Idempotency-Key", "idempotency_window_ms": 100, "retry": {"jitter": "none"}}),
        );
        let v = after_transmission(&dropped(), &o, ctx(1), &mut half());
        assert_eq!(v.state, State::Uncertain);
    }

    #[test]
    fn ambiguous_without_dedupe_is_never_resent() {
        for o in [
            opts(json!({})),
            opts(json!({"reconcile": {"url": "http://127.0.0.1:1/m/{effect_key}"}})),
        ] {
            let v = after_transmission(&dropped(), &o, ctx(1), &mut half());
            assert_eq!(v.state, State::Uncertain);
            // Only a channel that can reconcile schedules anything: its read-only lookup.
            assert_eq!(v.next_at_ms.is_some(), o.reconcile.is_some());
        }
    }

    fn nats(subject: &str, window_ms: u64) -> ChannelOptions {
        opts(
            json!({"kind": "nats", "subject": subject, "stream": "ORDERS",
            "duplicate_window_ms": window_ms, "retry": {"jitter": "none"}}),
        )
    }

    fn no_ack() -> Publication {
        Publication::NoAck {
            error: "no acknowledgement: timed out".into(),
            timed_out: true,
            elapsed_ms: 5000,
        }
    }

    #[test]
    fn a_publish_acked_by_the_channels_stream_is_delivered_with_its_sequence() {
        let o = nats("o.{effect_key}", 120_000);
        for duplicate in [false, true] {
            let acked = Publication::Acked {
                stream: "ORDERS".into(),
                sequence: 42,
                duplicate,
                elapsed_ms: 1,
            };
            let v = after_publish(&acked, &o, ctx(1), &mut half());
            assert_eq!(v.state, State::Delivered);
            assert_eq!(v.external_id.as_deref(), Some("ORDERS:42"));
            assert_eq!(v.outcome.contains("duplicate"), duplicate);
        }
        let elsewhere = Publication::Acked {
            stream: "OTHER".into(),
            sequence: 1,
            duplicate: false,
            elapsed_ms: 1,
        };
        let v = after_publish(&elsewhere, &o, ctx(1), &mut half());
        assert_eq!(v.state, State::Failed);
        let e = v.error.unwrap();
        assert!(
            e.contains("wrong stream") && e.contains("OTHER") && e.contains("ORDERS"),
            "{e}"
        );
    }

    #[test]
    fn a_publish_nothing_stored_is_retried_and_a_bad_message_fails() {
        let o = nats("o.{effect_key}", 120_000);
        let cases = [
            (
                Publication::NotWritten {
                    error: "connect: refused".into(),
                    permanent: false,
                },
                State::Queued,
            ),
            (
                Publication::Rejected {
                    error: "no stream stored it: no responders".into(),
                    permanent: false,
                    elapsed_ms: 1,
                },
                State::Queued,
            ),
            (
                Publication::Rejected {
                    error: "wrong stream".into(),
                    permanent: true,
                    elapsed_ms: 1,
                },
                State::Failed,
            ),
            (
                Publication::NotWritten {
                    error: "subject".into(),
                    permanent: true,
                },
                State::Failed,
            ),
        ];
        for (p, want) in cases {
            let v = after_publish(&p, &o, ctx(1), &mut half());
            assert_eq!(v.state, want, "{p:?}");
        }
    }

    #[test]
    fn an_unacknowledged_publish_is_republished_only_inside_the_duplicate_window() {
        // Inside the window: the same Nats-Msg-Id again; the stream stores it once.
        let v = after_publish(
            &no_ack(),
            &nats("o.{effect_key}", 120_000),
            ctx(1),
            &mut half(),
        );
        assert_eq!(v.state, State::Queued);
        assert!(v.error.unwrap().contains("same-key retry"));
        // Past it: looked up where the subject names the key, an operator's otherwise.
        for (subject, lookup) in [("o.{effect_key}", true), ("o.created", false)] {
            let v = after_publish(&no_ack(), &nats(subject, 100), ctx(1), &mut half());
            assert_eq!(v.state, State::Uncertain, "{subject}");
            assert_eq!(nats(subject, 100).can_look_up(), lookup);
        }
        // A lost lease takes the same path.
        let v = after_lost_lease(&nats("o.created", 120_000), ctx(1), &mut half());
        assert_eq!(v.state, State::Queued);
    }

    #[test]
    fn a_fixed_subject_is_not_republished_past_the_duplicate_window() {
        let fixed = nats("o.created", 100);
        // ctx(2): first publish 500 ms ago, the window 100 ms.
        let v = before_republish(&fixed, 2, ctx(2), &mut half()).unwrap();
        assert_eq!(v.state, State::Uncertain);
        assert!(before_republish(&fixed, 1, ctx(1), &mut half()).is_none());
        assert!(before_republish(&nats("o.created", 120_000), 2, ctx(2), &mut half()).is_none());
        assert!(before_republish(&nats("o.{effect_key}", 100), 2, ctx(2), &mut half()).is_none());
        assert!(before_republish(&opts(json!({})), 2, ctx(2), &mut half()).is_none());
    }

    #[test]
    fn lost_lease_follows_the_ambiguous_path() {
        let dedupe = opts(json!({"idempotency_header": "Idempotency-Key"}));
        assert_eq!(
            after_lost_lease(&dedupe, ctx(1), &mut half()).state,
            State::Queued
        );
        assert_eq!(
            after_lost_lease(&opts(json!({})), ctx(1), &mut half()).state,
            State::Uncertain
        );
        let spent = opts(json!({"idempotency_header": "K", "retry": {"max_attempts": 1}}));
        assert_eq!(
            after_lost_lease(&spent, ctx(1), &mut half()).state,
            State::Uncertain
        );
    }

    #[test]
    fn sql_effects() {
        let o = opts(
            json!({"kind": "sql", "function": "app.f", "run_as": "r", "retry": {"jitter": "none"}}),
        );
        let ok = after_effect(
            &EffectOutcome::Returned(Some("task-1".into())),
            &o,
            ctx(1),
            &mut half(),
        );
        assert_eq!(
            (ok.state, ok.external_id.as_deref()),
            (State::Delivered, Some("task-1"))
        );
        let deadlock = EffectOutcome::Raised {
            sqlstate: "40P01".into(),
            message: "deadlock detected".into(),
        };
        let v = after_effect(&deadlock, &o, ctx(1), &mut half());
        assert_eq!((v.state, v.class), (State::Queued, Some(Class::Transient)));
        let check = EffectOutcome::Raised {
            sqlstate: "23514".into(),
            message: "violates check".into(),
        };
        let v = after_effect(&check, &o, ctx(1), &mut half());
        assert_eq!(v.state, State::Failed);
        assert!(v.error.unwrap().contains("23514"));
        let gone = EffectOutcome::Unavailable("function app.f(jsonb, text) does not exist".into());
        assert_eq!(
            after_effect(&gone, &o, ctx(1), &mut half()).state,
            State::Failed
        );
        // A lost lease on a sql channel is not ambiguous: the effect did not commit.
        assert_eq!(
            after_lost_lease(&o, ctx(1), &mut half()).state,
            State::Queued
        );
    }

    #[test]
    fn a_cancelled_effect_waits_at_least_half_the_backoff() {
        let o = opts(json!({"kind": "sql", "function": "app.f", "run_as": "r",
                            "retry": {"base_ms": 2000}}));
        let cancelled = EffectOutcome::Raised {
            sqlstate: "57014".into(),
            message: "canceling statement due to statement timeout".into(),
        };
        let now = ctx(1).now_ms;
        // The smallest draw of full jitter would retry at once.
        let v = after_effect(&cancelled, &o, ctx(1), &mut || 0.0);
        assert_eq!((v.state, v.class), (State::Queued, Some(Class::Transient)));
        assert_eq!(v.next_at_ms, Some(now + 1000), "{:?}", v.error);
        let v = after_effect(&cancelled, &o, ctx(2), &mut || 0.0);
        assert_eq!(v.next_at_ms, Some(now + 2000), "the backoff grows");
        // Other transient errors keep the channel's jitter; a jitter of none is kept.
        let conflict = EffectOutcome::Raised {
            sqlstate: "40001".into(),
            message: "could not serialize access".into(),
        };
        assert_eq!(
            after_effect(&conflict, &o, ctx(1), &mut || 0.0).next_at_ms,
            Some(now)
        );
        let fixed = opts(json!({"kind": "sql", "function": "app.f", "run_as": "r",
                                "retry": {"base_ms": 2000, "jitter": "none"}}));
        assert_eq!(
            after_effect(&cancelled, &fixed, ctx(1), &mut || 0.0).next_at_ms,
            Some(now + 2000)
        );
    }

    #[test]
    fn a_destination_refused_by_allowed_hosts_fails_permanently() {
        let refused = |phase| {
            Transmission::Refused {
            phase,
            error: "destination refused by outbox.allowed_hosts: host 169.254.169.254 is IPv4 link-local".into(),
            elapsed_ms: 0,
        }
        };
        // Whatever the channel would otherwise do with a failure: retry, same-key retry,
        // reconcile, or overrides of the classification table.
        let channels = [
            opts(json!({})),
            opts(json!({"retry": {"max_attempts": 100}})),
            opts(json!({"idempotency_header": "Idempotency-Key"})),
            opts(json!({"reconcile": {"url": "http://127.0.0.1:1/m/{effect_key}"}})),
            opts(json!({"classify": {"5xx": "transient", "4xx": "transient"}})),
        ];
        for o in &channels {
            for phase in [Phase::Dns, Phase::Connect] {
                let v = after_transmission(&refused(phase), o, ctx(1), &mut half());
                assert_eq!(v.state, State::Failed);
                assert_eq!(v.class, Some(Class::Permanent));
                assert_eq!(v.outcome, "permanent");
                assert_eq!(v.next_at_ms, None);
                assert_eq!(v.http_status, None);
                let error = v.error.unwrap();
                assert!(
                    error.starts_with(&format!(
                        "{}: destination refused by outbox.allowed_hosts: host 169.254.169.254",
                        phase.as_str()
                    )),
                    "{error}"
                );
                assert!(error.ends_with("permanent: not retried"), "{error}");
            }
        }
        // An ordinary DNS failure stays transient.
        let dns = Transmission::Failed {
            phase: Phase::Dns,
            timed_out: false,
            error: "dns error: failed to lookup address information".into(),
            elapsed_ms: 2,
        };
        let v = after_transmission(&dns, &opts(json!({})), ctx(1), &mut half());
        assert_eq!((v.state, v.class), (State::Queued, Some(Class::Transient)));
    }

    #[test]
    fn connect_refused_is_transient_and_not_sent_is_permanent() {
        let refused = Transmission::Failed {
            phase: Phase::Connect,
            timed_out: false,
            error: "connection refused".into(),
            elapsed_ms: 1,
        };
        let v = after_transmission(&refused, &opts(json!({})), ctx(1), &mut half());
        assert_eq!(v.state, State::Queued);
        assert!(v.error.unwrap().starts_with("connect:"));
        let bad = Transmission::NotSent {
            error: "bad header".into(),
        };
        assert_eq!(
            after_transmission(&bad, &opts(json!({})), ctx(1), &mut half()).state,
            State::Failed
        );
    }
}
