//! The channel option `classify_answers`: rules that classify a refusing answer by what its
//! body says, where the status alone says too little. A provider that answers 400 both to
//! "unknown recipient" (permanent) and to "quota exceeded, try later" (transient), or 409 to
//! "already processed" (delivered), is classified by the text of its answer.
//!
//! ```json
//! "classify_answers": [
//!   {"status": "4xx", "contains": "quota exceeded", "class": "transient"},
//!   {"status": "409", "contains": "already processed", "class": "delivered"}
//! ]
//! ```
//!
//! Each rule names a text the answer's excerpt must contain (`contains`, matched as is,
//! case and all; a text the excerpt cannot hold, with a control character, a space at an
//! end, or longer than the excerpt or the body read, is refused), optionally a status code or range (`status`: "409", "4xx"; any status
//! that is not 2xx when absent), and the class it gives. The first rule that matches
//! decides, before the `classify` status overrides and the default table. Rules read the
//! excerpt the attempt keeps (`answer_excerpt`): the first `response_excerpt_bytes` of the
//! body, masked and on one line; a 2xx answer keeps none and is never matched. A rule that
//! makes an answer `delivered` while its body could not be read to the end gives
//! `ambiguous`, as `classify` does. Pure.

use crate::classify::{Class, Key};
use serde_json::{json, Value};

use super::option_error::OptionError;

/// Most rules a channel may have.
pub const MOST_RULES: usize = 32;
/// Longest `contains`, in bytes.
pub const LONGEST_TEXT: usize = 256;

/// Which statuses a rule looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Statuses {
    Any,
    Exact(u16),
    /// The hundreds digit: 4 for `4xx`.
    Range(u16),
}

impl Statuses {
    /// A status key as `classify` reads it (`crate::classify::parse_key`), outside 2xx.
    fn parse(s: &str) -> Option<Statuses> {
        match crate::classify::parse_key(s)? {
            Key::Exact(code) if !(200..300).contains(&code) => Some(Statuses::Exact(code)),
            Key::Range(index) if index != 1 => Some(Statuses::Range(index as u16 + 1)),
            _ => None,
        }
    }

    fn matches(self, status: u16) -> bool {
        match self {
            Statuses::Any => true,
            Statuses::Exact(code) => status == code,
            Statuses::Range(hundreds) => status / 100 == hundreds,
        }
    }

    fn to_json(self) -> Value {
        match self {
            Statuses::Any => Value::Null,
            Statuses::Exact(code) => json!(code.to_string()),
            Statuses::Range(hundreds) => json!(format!("{hundreds}xx")),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Rule {
    statuses: Statuses,
    contains: String,
    class: Class,
}

/// A channel's rules, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AnswerRules(Vec<Rule>);

impl AnswerRules {
    /// Parses `classify_answers`: an array of objects with `contains` (a non-empty string of
    /// at most [`LONGEST_TEXT`] bytes), `class` and optionally `status` (a code or range
    /// outside 2xx). Errors name the rule (`classify_answers[1].status`).
    pub fn from_json(v: &Value) -> Result<AnswerRules, OptionError> {
        let key = "classify_answers";
        let rules = v.as_array().ok_or_else(|| {
            OptionError::new(
                key,
                "must be an array of {\"contains\", \"class\", \"status\"} objects",
            )
        })?;
        if rules.len() > MOST_RULES {
            return Err(OptionError::new(
                key,
                format!("has {} rules; at most {MOST_RULES}", rules.len()),
            ));
        }
        let mut out = Vec::with_capacity(rules.len());
        for (i, rule) in rules.iter().enumerate() {
            let at = |field: &str| format!("{key}[{i}]{field}");
            let obj = rule.as_object().ok_or_else(|| {
                OptionError::new(at(""), "must be an object with contains, class and status")
            })?;
            if let Some(unknown) = obj
                .keys()
                .find(|k| !["contains", "class", "status"].contains(&k.as_str()))
            {
                return Err(OptionError::new(
                    at(""),
                    format!(
                        "\"{unknown}\" is not a field of a rule; fields: contains, class, status"
                    ),
                ));
            }
            let contains = match obj.get("contains") {
                // The excerpt writes control characters as spaces and trims its ends: a text
                // holding one, or starting or ending with a space, could never be found.
                Some(Value::String(s))
                    if !s.is_empty()
                        && s.len() <= LONGEST_TEXT
                        && !s.chars().any(char::is_control)
                        && s.trim() == s =>
                {
                    s.clone()
                }
                _ => {
                    return Err(OptionError::new(
                        at(".contains"),
                        format!("must be a text of 1 to {LONGEST_TEXT} bytes the answer contains, without control characters or spaces at its ends"),
                    ))
                }
            };
            let class = obj
                .get("class")
                .and_then(Value::as_str)
                .and_then(Class::parse)
                .ok_or_else(|| {
                    OptionError::new(
                        at(".class"),
                        "must be \"delivered\", \"transient\", \"permanent\" or \"ambiguous\"",
                    )
                })?;
            let statuses = match obj.get("status") {
                None | Some(Value::Null) => Statuses::Any,
                Some(Value::String(s)) => Statuses::parse(s).ok_or_else(|| {
                    OptionError::new(
                        at(".status"),
                        format!("\"{s}\" is not a status code or range outside 2xx (\"409\", \"4xx\"): a 2xx answer keeps no excerpt"),
                    )
                })?,
                Some(_) => {
                    return Err(OptionError::new(
                        at(".status"),
                        "must be a status code or range as a string (\"409\", \"4xx\")",
                    ))
                }
            };
            out.push(Rule {
                statuses,
                contains,
                class,
            });
        }
        Ok(AnswerRules(out))
    }

    pub fn to_json(&self) -> Value {
        Value::Array(
            self.0
                .iter()
                .map(|r| {
                    let mut m = serde_json::Map::new();
                    if r.statuses != Statuses::Any {
                        m.insert("status".into(), r.statuses.to_json());
                    }
                    m.insert("contains".into(), json!(r.contains));
                    m.insert("class".into(), json!(r.class.as_str()));
                    Value::Object(m)
                })
                .collect(),
        )
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The longest `contains` of the rules, in bytes (0 without rules).
    pub fn longest_text(&self) -> usize {
        self.0.iter().map(|r| r.contains.len()).max().unwrap_or(0)
    }

    /// The class the first matching rule gives an answer with `status` whose excerpt is
    /// `excerpt`, and the rule's index; None when no rule matches (or there is no excerpt).
    pub fn class_for(&self, status: u16, excerpt: Option<&str>) -> Option<(Class, usize)> {
        let text = excerpt?;
        if (200..300).contains(&status) {
            return None;
        }
        self.0
            .iter()
            .position(|r| r.statuses.matches(status) && text.contains(r.contains.as_str()))
            .map(|i| (self.0[i].class, i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rules(v: Value) -> AnswerRules {
        AnswerRules::from_json(&v).unwrap()
    }

    fn refused(v: Value) -> String {
        AnswerRules::from_json(&v).unwrap_err().option
    }

    #[test]
    fn the_first_matching_rule_decides() {
        let r = rules(json!([
            {"status": "4xx", "contains": "quota exceeded", "class": "transient"},
            {"status": "409", "contains": "already processed", "class": "delivered"},
            {"contains": "unknown recipient", "class": "permanent"},
            {"contains": "quota", "class": "ambiguous"},
        ]));
        let said = |s: &str| Some(s.to_string());
        let at = |status, text: Option<String>| r.class_for(status, text.as_deref());
        assert_eq!(
            at(429, said("{\"error\": \"quota exceeded\"}")),
            Some((Class::Transient, 0))
        );
        assert_eq!(
            at(409, said("already processed: 42")),
            Some((Class::Delivered, 1))
        );
        assert_eq!(
            at(404, said("unknown recipient +999")),
            Some((Class::Permanent, 2))
        );
        assert_eq!(
            at(503, said("unknown recipient")),
            Some((Class::Permanent, 2))
        );
        // The range rule does not take a 5xx; the later rule without a status does.
        assert_eq!(at(503, said("quota exceeded")), Some((Class::Ambiguous, 3)));
        // Case counts; no excerpt, no match; a 2xx is never matched.
        assert_eq!(at(400, said("QUOTA EXCEEDED")), None);
        assert_eq!(at(400, None), None);
        assert_eq!(at(200, said("quota exceeded")), None);
        assert_eq!(at(409, said("processed")), None);
    }

    #[test]
    fn rules_round_trip_and_bad_ones_are_named() {
        let v = json!([
            {"status": "4xx", "contains": "a", "class": "transient"},
            {"contains": "b", "class": "delivered"},
            {"status": "504", "contains": "c", "class": "ambiguous"},
        ]);
        let r = rules(v.clone());
        assert_eq!(r.to_json(), v);
        assert_eq!(rules(r.to_json()), r);
        assert_eq!(r.longest_text(), 1);
        assert!(rules(json!([])).is_empty());
        let long = "x".repeat(LONGEST_TEXT + 1);
        for (bad, option) in [
            (json!({}), "classify_answers"),
            (json!("quota"), "classify_answers"),
            (json!([1]), "classify_answers[0]"),
            (
                json!([{"contains": "a", "class": "transient", "when": 1}]),
                "classify_answers[0]",
            ),
            (
                json!([{"class": "transient"}]),
                "classify_answers[0].contains",
            ),
            (
                json!([{"contains": "", "class": "transient"}]),
                "classify_answers[0].contains",
            ),
            (
                json!([{"contains": 3, "class": "transient"}]),
                "classify_answers[0].contains",
            ),
            (
                json!([{"contains": long, "class": "transient"}]),
                "classify_answers[0].contains",
            ),
            (
                json!([{"contains": "a\nb", "class": "transient"}]),
                "classify_answers[0].contains",
            ),
            (
                json!([{"contains": "quota ", "class": "transient"}]),
                "classify_answers[0].contains",
            ),
            (json!([{"contains": "a"}]), "classify_answers[0].class"),
            (
                json!([{"contains": "a", "class": "retry"}]),
                "classify_answers[0].class",
            ),
            (
                json!([{"contains": "a", "class": "permanent"}, {"contains": "a", "class": "permanent", "status": "2xx"}]),
                "classify_answers[1].status",
            ),
            (
                json!([{"contains": "a", "class": "permanent", "status": "200"}]),
                "classify_answers[0].status",
            ),
            (
                json!([{"contains": "a", "class": "permanent", "status": "6xx"}]),
                "classify_answers[0].status",
            ),
            (
                json!([{"contains": "a", "class": "permanent", "status": "4XX"}]),
                "classify_answers[0].status",
            ),
            (
                json!([{"contains": "a", "class": "permanent", "status": 404}]),
                "classify_answers[0].status",
            ),
        ] {
            assert_eq!(refused(bad.clone()), option, "{bad}");
        }
        let many: Vec<Value> = (0..=MOST_RULES)
            .map(|i| json!({"contains": format!("t{i}"), "class": "permanent"}))
            .collect();
        assert_eq!(refused(Value::Array(many)), "classify_answers");
    }

    #[test]
    fn every_status_is_matched_by_its_code_and_its_range_alone() {
        for status in 100..=599u16 {
            if (200..300).contains(&status) {
                continue;
            }
            let exact = rules(
                json!([{"status": status.to_string(), "contains": "t", "class": "permanent"}]),
            );
            let range = rules(
                json!([{"status": format!("{}xx", status / 100), "contains": "t", "class": "permanent"}]),
            );
            for other in [100u16, 302, 404, 409, 500, 599] {
                assert_eq!(exact.class_for(other, Some("t")).is_some(), other == status);
                assert_eq!(
                    range.class_for(other, Some("t")).is_some(),
                    other / 100 == status / 100
                );
            }
        }
    }
}
