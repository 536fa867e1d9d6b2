//! Circuit breaking, the `circuit` option: after `open_after` consecutive transient or
//! ambiguous outcomes a channel opens and sends nothing for `open_ms`; then it lets one
//! probe through (half open). An answer that is not a failure closes it; a failure opens it
//! again. The state is a row per channel, shared by every worker of the database
//! (`outbox._channel_flow`); this module is the pure part: the option and the transitions.
//!
//! Tenants of a shared channel: failures that all came from one tenant open the circuit
//! for that tenant's messages alone (its lane), so that one tenant whose messages the
//! provider refuses does not stop the others; failures of several tenants open it for the
//! whole channel. The endpoint is shared: a provider that is down fails every tenant, and
//! the circuit then opens for all after `open_after` failures of more than one tenant.

use super::option_error::OptionError;
use serde_json::{json, Value};

/// A channel's `circuit`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CircuitOptions {
    pub open_after: u32,
    pub open_ms: u64,
}

/// Longest `open_ms`: a day.
pub const MAX_OPEN_MS: u64 = 86_400_000;

impl CircuitOptions {
    pub fn from_json(v: &Value) -> Result<CircuitOptions, OptionError> {
        let obj = v.as_object().ok_or_else(|| {
            OptionError::new(
                "circuit",
                "must be an object {\"open_after\": n, \"open_ms\": t}",
            )
        })?;
        if let Some(k) = obj.keys().find(|k| *k != "open_after" && *k != "open_ms") {
            return Err(OptionError::new(
                format!("circuit.{k}"),
                "unknown option; known options are open_after, open_ms",
            ));
        }
        let int = |key: &str, max: u64| -> Result<u64, OptionError> {
            match obj.get(key).and_then(Value::as_u64) {
                Some(n) if (1..=max).contains(&n) => Ok(n),
                _ => Err(OptionError::new(
                    format!("circuit.{key}"),
                    format!("is required: an integer between 1 and {max}"),
                )),
            }
        };
        Ok(CircuitOptions {
            open_after: int("open_after", 10_000)? as u32,
            open_ms: int("open_ms", MAX_OPEN_MS)?,
        })
    }

    pub fn to_json(&self) -> Value {
        json!({"open_after": self.open_after, "open_ms": self.open_ms})
    }
}

/// Where a channel's circuit is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Closed,
    Open,
    HalfOpen,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Closed => "closed",
            State::Open => "open",
            State::HalfOpen => "half_open",
        }
    }

    pub fn parse(s: &str) -> State {
        match s {
            "open" => State::Open,
            "half_open" => State::HalfOpen,
            _ => State::Closed,
        }
    }
}

/// A circuit as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Circuit {
    pub state: State,
    /// When it entered `state`, unix ms.
    pub since_ms: i64,
    /// Consecutive failures seen while closed; while it is open or half open for one tenant,
    /// the consecutive failures of the other tenants.
    pub streak: u32,
    /// Until when the probe let through while half open may still be out, unix ms.
    pub probe_until_ms: Option<i64>,
    /// Closed: the tenant every failure of the streak came from (none when the streak is
    /// empty or came from several). Open or half open: the tenant whose lane alone it holds
    /// back, or none when it holds back the whole channel.
    pub tenant: Option<String>,
}

/// What the claim may take from a channel now, and the circuit after it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gate {
    /// `None`: no bound from the circuit; `Some(n)`: at most n messages.
    pub cap: Option<u32>,
    /// At most so many messages of this tenant (its lane), while the circuit holds back
    /// that tenant alone.
    pub lane_cap: Option<(String, u32)>,
    pub circuit: Circuit,
}

impl Gate {
    /// `cap` messages: of the whole channel, or of the one tenant the circuit holds back.
    fn capped(circuit: Circuit, cap: u32) -> Gate {
        match circuit.tenant.clone() {
            Some(tenant) => Gate {
                cap: None,
                lane_cap: Some((tenant, cap)),
                circuit,
            },
            None => Gate {
                cap: Some(cap),
                lane_cap: None,
                circuit,
            },
        }
    }
}

/// Before a claim: an open circuit whose time is up turns half open and lets one probe
/// through (`probe_ms`: how long the probe may take, its channel's timeout and some); a
/// half-open circuit whose probe is out lets nothing through. A circuit that one tenant's
/// failures opened holds back that tenant's lane only: the other tenants of the channel
/// go on sending.
pub fn gate(c: Circuit, options: &CircuitOptions, now_ms: i64, probe_ms: i64) -> Gate {
    match c.state {
        State::Closed => Gate {
            cap: None,
            lane_cap: None,
            circuit: c,
        },
        State::Open if now_ms < c.since_ms.saturating_add(options.open_ms as i64) => {
            Gate::capped(c, 0)
        }
        State::Open => Gate::capped(
            Circuit {
                state: State::HalfOpen,
                since_ms: now_ms,
                probe_until_ms: Some(now_ms + probe_ms),
                ..c
            },
            1,
        ),
        State::HalfOpen if c.probe_until_ms.is_some_and(|until| now_ms < until) => {
            Gate::capped(c, 0)
        }
        // The probe never came back (its worker died): another one.
        State::HalfOpen => Gate::capped(
            Circuit {
                probe_until_ms: Some(now_ms + probe_ms),
                ..c
            },
            1,
        ),
    }
}

/// One outcome as the circuit sees it: a failure (transient or ambiguous) or not, and the
/// tenant of the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outcome<'a> {
    pub failed: bool,
    pub tenant: &'a str,
}

/// After a batch: the outcomes of the channel's attempts, in order. While closed, a streak
/// of `open_after` failures opens it: for the one tenant they all came from, or for the
/// whole channel when they came from several; an answer that is not a failure ends the
/// streak, but an answer to another tenant does not end one tenant's streak (a provider
/// may fail one tenant's messages alone). While half open, the probe's outcome decides;
/// outcomes of attempts that were already out when the circuit opened change nothing while
/// it is open. While it holds back one tenant, `open_after` consecutive failures of the
/// others open it for the whole channel.
pub fn after(
    c: Circuit,
    options: &CircuitOptions,
    outcomes: &[Outcome<'_>],
    now_ms: i64,
) -> Circuit {
    let mut c = c;
    for o in outcomes {
        let held_alone = c.state != State::Closed && c.tenant.is_some();
        let own = c.tenant.as_deref() == Some(o.tenant);
        c = match (c.state, o.failed) {
            // The other tenants of a circuit that holds back one tenant alone.
            (State::Open | State::HalfOpen, true) if held_alone && !own => {
                if c.streak + 1 >= options.open_after {
                    opened(now_ms, None)
                } else {
                    Circuit {
                        streak: c.streak + 1,
                        ..c
                    }
                }
            }
            (State::Open | State::HalfOpen, false) if held_alone && !own => {
                Circuit { streak: 0, ..c }
            }
            (State::Closed, false) if c.streak > 0 && c.tenant.is_some() && !own => c,
            (State::Closed, false) => Circuit {
                streak: 0,
                tenant: None,
                ..c
            },
            (State::Closed, true) => {
                let tenant = if c.streak == 0 || own {
                    Some(o.tenant.to_string())
                } else {
                    None
                };
                if c.streak + 1 >= options.open_after {
                    opened(now_ms, tenant)
                } else {
                    Circuit {
                        streak: c.streak + 1,
                        tenant,
                        ..c
                    }
                }
            }
            (State::HalfOpen, false) => Circuit {
                state: State::Closed,
                since_ms: now_ms,
                streak: 0,
                probe_until_ms: None,
                tenant: None,
            },
            (State::HalfOpen, true) => opened(now_ms, c.tenant.clone()),
            (State::Open, _) => c,
        };
    }
    c
}

fn opened(now_ms: i64, tenant: Option<String>) -> Circuit {
    Circuit {
        state: State::Open,
        since_ms: now_ms,
        streak: 0,
        probe_until_ms: None,
        tenant,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const O: CircuitOptions = CircuitOptions {
        open_after: 3,
        open_ms: 1000,
    };

    fn closed() -> Circuit {
        Circuit {
            state: State::Closed,
            since_ms: 0,
            streak: 0,
            probe_until_ms: None,
            tenant: None,
        }
    }

    fn of(t: &str, failures: &[bool]) -> Vec<Outcome<'static>> {
        let t: &'static str = Box::leak(t.to_string().into_boxed_str());
        failures
            .iter()
            .map(|&failed| Outcome { failed, tenant: t })
            .collect()
    }

    #[test]
    fn opens_after_n_consecutive_failures_only() {
        let c = after(closed(), &O, &of("a", &[true, true, false, true, true]), 10);
        assert_eq!((c.state, c.streak), (State::Closed, 2));
        let c = after(c, &O, &of("a", &[true]), 20);
        assert_eq!((c.state, c.since_ms), (State::Open, 20));
        // Late outcomes of attempts already out change nothing.
        assert_eq!(after(c.clone(), &O, &of("a", &[false, true]), 30), c);
    }

    #[test]
    fn open_sends_nothing_then_one_probe_that_decides() {
        let open = Circuit {
            state: State::Open,
            since_ms: 1000,
            ..closed()
        };
        assert_eq!(gate(open.clone(), &O, 1999, 500).cap, Some(0));
        let g = gate(open, &O, 2000, 500);
        assert_eq!((g.cap, g.lane_cap.clone()), (Some(1), None));
        assert_eq!(g.circuit.state, State::HalfOpen);
        assert_eq!(g.circuit.probe_until_ms, Some(2500));
        // The probe is out: nothing more.
        assert_eq!(gate(g.circuit.clone(), &O, 2100, 500).cap, Some(0));
        // Lost probe: another after its time.
        assert_eq!(gate(g.circuit.clone(), &O, 2500, 500).cap, Some(1));
        let closed_again = after(g.circuit.clone(), &O, &of("b", &[false]), 2200);
        assert_eq!(closed_again.state, State::Closed);
        assert_eq!(gate(closed_again, &O, 2200, 500).cap, None);
        let reopened = after(g.circuit, &O, &of("b", &[true]), 2200);
        assert_eq!((reopened.state, reopened.since_ms), (State::Open, 2200));
        assert_eq!(gate(reopened, &O, 3199, 500).cap, Some(0));
    }

    #[test]
    fn one_tenants_failures_hold_back_its_lane_alone() {
        // b's answers between a's failures do not end a's streak.
        let mut outcomes = of("a", &[true]);
        outcomes.extend(of("b", &[false, false]));
        outcomes.extend(of("a", &[true, true]));
        let c = after(closed(), &O, &outcomes, 10);
        assert_eq!((c.state, c.tenant.as_deref()), (State::Open, Some("a")));
        let g = gate(c.clone(), &O, 500, 100);
        assert_eq!(
            (g.cap, g.lane_cap),
            (None, Some(("a".to_string(), 0))),
            "b sends on"
        );
        // Its probe is one message of a; the rest of the channel goes on meanwhile.
        let g = gate(c, &O, 1010, 100);
        assert_eq!(
            (g.cap, g.lane_cap.clone()),
            (None, Some(("a".to_string(), 1)))
        );
        assert_eq!(g.circuit.state, State::HalfOpen);
        // b's answers do not decide a's probe; a's does.
        let still = after(g.circuit.clone(), &O, &of("b", &[false]), 1020);
        assert_eq!(still.state, State::HalfOpen);
        let closed_again = after(still.clone(), &O, &of("a", &[false]), 1030);
        assert_eq!(
            (closed_again.state, closed_again.tenant),
            (State::Closed, None)
        );
        let reopened = after(still, &O, &of("a", &[true]), 1030);
        assert_eq!(
            (reopened.state, reopened.tenant.as_deref()),
            (State::Open, Some("a"))
        );
    }

    #[test]
    fn an_answer_of_the_failing_tenant_ends_its_streak() {
        let mut outcomes = of("a", &[true, true]);
        outcomes.extend(of("a", &[false]));
        outcomes.extend(of("a", &[true, true]));
        let c = after(closed(), &O, &outcomes, 10);
        assert_eq!((c.state, c.streak), (State::Closed, 2));
    }

    #[test]
    fn failures_of_several_tenants_open_the_whole_channel() {
        let mut outcomes = of("a", &[true]);
        outcomes.extend(of("b", &[true]));
        let c = after(closed(), &O, &outcomes, 10);
        assert_eq!(
            (c.state, c.streak, c.tenant.clone()),
            (State::Closed, 2, None)
        );
        // A mixed streak ends at any answer.
        assert_eq!(after(c.clone(), &O, &of("b", &[false]), 11).streak, 0);
        let open = after(c, &O, &of("a", &[true]), 12);
        assert_eq!((open.state, open.tenant.clone()), (State::Open, None));
        assert_eq!(gate(open, &O, 13, 100).cap, Some(0));
    }

    #[test]
    fn the_others_failing_while_one_tenant_is_held_open_the_whole_channel() {
        let held = after(closed(), &O, &of("a", &[true, true, true]), 10);
        assert_eq!(held.tenant.as_deref(), Some("a"));
        let c = after(held.clone(), &O, &of("b", &[true, true]), 20);
        assert_eq!(
            (c.state, c.tenant.as_deref(), c.streak),
            (State::Open, Some("a"), 2)
        );
        assert_eq!(
            after(c.clone(), &O, &of("b", &[false]), 21).streak,
            0,
            "an answer ends it"
        );
        let whole = after(c, &O, &of("c", &[true]), 30);
        assert_eq!(
            (whole.state, whole.tenant, whole.since_ms),
            (State::Open, None, 30)
        );
        // a's late outcomes change nothing while it is held.
        assert_eq!(after(held.clone(), &O, &of("a", &[false, true]), 40), held);
    }

    #[test]
    fn options_are_validated() {
        let ok = CircuitOptions::from_json(&json!({"open_after": 5, "open_ms": 30000})).unwrap();
        assert_eq!(
            ok,
            CircuitOptions {
                open_after: 5,
                open_ms: 30000
            }
        );
        assert_eq!(CircuitOptions::from_json(&ok.to_json()).unwrap(), ok);
        for (bad, option) in [
            (json!({"open_after": 0, "open_ms": 1}), "circuit.open_after"),
            (json!({"open_ms": 1}), "circuit.open_after"),
            (json!({"open_after": 1}), "circuit.open_ms"),
            (
                json!({"open_after": 1, "open_ms": 86_400_001}),
                "circuit.open_ms",
            ),
            (json!({"open_after": 1, "open_ms": "5"}), "circuit.open_ms"),
            (json!({"open_after": 1, "open_ms": 5, "x": 1}), "circuit.x"),
            (json!(true), "circuit"),
        ] {
            assert_eq!(
                CircuitOptions::from_json(&bad).unwrap_err().option,
                option,
                "{bad}"
            );
        }
    }
}
