//! Circuit breaking, the `circuit` option: after `open_after` consecutive transient or
//! ambiguous outcomes a channel opens and sends nothing for `open_ms`; then it lets one
//! probe through (half open). An answer that is not a failure closes it; a failure opens it
//! again. The state is a row per channel, shared by every worker of the database
//! (`outbox._channel_flow`); this module is the pure part: the option and the transitions.

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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Circuit {
    pub state: State,
    /// When it entered `state`, unix ms.
    pub since_ms: i64,
    /// Consecutive failures seen while closed.
    pub streak: u32,
    /// Until when the probe let through while half open may still be out, unix ms.
    pub probe_until_ms: Option<i64>,
}

/// What the claim may take from a channel now, and the circuit after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gate {
    /// `None`: no bound from the circuit; `Some(n)`: at most n messages.
    pub cap: Option<u32>,
    pub circuit: Circuit,
}

/// Before a claim: an open circuit whose time is up turns half open and lets one probe
/// through (`probe_ms`: how long the probe may take, its channel's timeout and some); a
/// half-open circuit whose probe is out lets nothing through.
pub fn gate(c: Circuit, options: &CircuitOptions, now_ms: i64, probe_ms: i64) -> Gate {
    match c.state {
        State::Closed => Gate {
            cap: None,
            circuit: c,
        },
        State::Open if now_ms < c.since_ms.saturating_add(options.open_ms as i64) => Gate {
            cap: Some(0),
            circuit: c,
        },
        State::Open => Gate {
            cap: Some(1),
            circuit: Circuit {
                state: State::HalfOpen,
                since_ms: now_ms,
                streak: c.streak,
                probe_until_ms: Some(now_ms + probe_ms),
            },
        },
        State::HalfOpen if c.probe_until_ms.is_some_and(|until| now_ms < until) => Gate {
            cap: Some(0),
            circuit: c,
        },
        // The probe never came back (its worker died): another one.
        State::HalfOpen => Gate {
            cap: Some(1),
            circuit: Circuit {
                probe_until_ms: Some(now_ms + probe_ms),
                ..c
            },
        },
    }
}

/// After a batch: the outcomes of the channel's attempts, in order, `true` for a failure
/// (transient or ambiguous). While half open, the probe's outcome decides; outcomes of
/// attempts that were already out when the circuit opened change nothing while it is open.
pub fn after(c: Circuit, options: &CircuitOptions, failures: &[bool], now_ms: i64) -> Circuit {
    let mut c = c;
    for &failed in failures {
        c = match (c.state, failed) {
            (State::Closed, false) => Circuit { streak: 0, ..c },
            (State::Closed, true) if c.streak + 1 >= options.open_after => Circuit {
                state: State::Open,
                since_ms: now_ms,
                streak: 0,
                probe_until_ms: None,
            },
            (State::Closed, true) => Circuit {
                streak: c.streak + 1,
                ..c
            },
            (State::HalfOpen, false) => Circuit {
                state: State::Closed,
                since_ms: now_ms,
                streak: 0,
                probe_until_ms: None,
            },
            (State::HalfOpen, true) => Circuit {
                state: State::Open,
                since_ms: now_ms,
                streak: 0,
                probe_until_ms: None,
            },
            (State::Open, _) => c,
        };
    }
    c
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
        }
    }

    #[test]
    fn opens_after_n_consecutive_failures_only() {
        let c = after(closed(), &O, &[true, true, false, true, true], 10);
        assert_eq!((c.state, c.streak), (State::Closed, 2));
        let c = after(c, &O, &[true], 20);
        assert_eq!((c.state, c.since_ms), (State::Open, 20));
        // Late outcomes of attempts already out change nothing.
        assert_eq!(after(c, &O, &[false, true], 30), c);
    }

    #[test]
    fn open_sends_nothing_then_one_probe_that_decides() {
        let open = Circuit {
            state: State::Open,
            since_ms: 1000,
            streak: 0,
            probe_until_ms: None,
        };
        assert_eq!(gate(open, &O, 1999, 500).cap, Some(0));
        let g = gate(open, &O, 2000, 500);
        assert_eq!(g.cap, Some(1));
        assert_eq!(g.circuit.state, State::HalfOpen);
        assert_eq!(g.circuit.probe_until_ms, Some(2500));
        // The probe is out: nothing more.
        assert_eq!(gate(g.circuit, &O, 2100, 500).cap, Some(0));
        // Lost probe: another after its time.
        assert_eq!(gate(g.circuit, &O, 2500, 500).cap, Some(1));
        let closed_again = after(g.circuit, &O, &[false], 2200);
        assert_eq!(closed_again.state, State::Closed);
        assert_eq!(gate(closed_again, &O, 2200, 500).cap, None);
        let reopened = after(g.circuit, &O, &[true], 2200);
        assert_eq!((reopened.state, reopened.since_ms), (State::Open, 2200));
        assert_eq!(gate(reopened, &O, 3199, 500).cap, Some(0));
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
