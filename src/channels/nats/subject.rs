//! The subject a `nats` channel publishes each message to: a fixed subject, or a template
//! with `{effect_key}` and `{payload:/json/pointer}` placeholders. Pure Rust.
//!
//! A subject is a dot-separated list of tokens; a token is not empty and holds no space,
//! control character, `*` or `>` (the wildcards subscribers use). A filled placeholder must
//! keep the subject valid, or the message is not sent: a value with a dot would add tokens,
//! and a lookup by subject must find exactly the subject the publish used.

use crate::channels::json_pointer::body_pointer;

/// The placeholder of the effect key as sent (`Nats-Msg-Id`).
pub const EFFECT_KEY: &str = "{effect_key}";
/// Longest subject, in bytes (the server's default `max_control_line` leaves room).
pub const MAX_SUBJECT_BYTES: usize = 1024;

/// One part of a template.
#[derive(Debug, Clone, PartialEq)]
enum Part<'a> {
    Text(&'a str),
    EffectKey,
    Payload(&'a str),
}

/// Splits a template into text and placeholders, or says why it is not one.
fn parts(template: &str) -> Result<Vec<Part<'_>>, String> {
    let mut out = Vec::new();
    let mut rest = template;
    while let Some(open) = rest.find('{') {
        if open > 0 {
            out.push(Part::Text(&rest[..open]));
        }
        let Some(close) = rest[open..].find('}') else {
            return Err(format!("\"{template}\" has a '{{' without its '}}'"));
        };
        let inner = &rest[open + 1..open + close];
        out.push(match inner {
            "effect_key" => Part::EffectKey,
            p if p.starts_with("payload:/") => Part::Payload(&p["payload:".len()..]),
            other => {
                return Err(format!(
                    "\"{{{other}}}\" is not a placeholder; use {{effect_key}} or {{payload:/json/pointer}}"
                ))
            }
        });
        rest = &rest[open + close + 1..];
    }
    if rest.contains('}') {
        return Err(format!("\"{template}\" has a '}}' without its '{{'"));
    }
    if !rest.is_empty() {
        out.push(Part::Text(rest));
    }
    Ok(out)
}

/// Is `token` a subject token a publish may use?
fn valid_token(token: &str) -> bool {
    !token.is_empty()
        && token
            .chars()
            .all(|c| !c.is_whitespace() && !c.is_control() && c != '*' && c != '>')
}

/// Is `subject` one a message may be published to (no wildcard, no empty token)?
pub fn valid_subject(subject: &str) -> bool {
    !subject.is_empty() && subject.len() <= MAX_SUBJECT_BYTES && subject.split('.').all(valid_token)
}

/// Checks a template as `create_channel` does: its placeholders are known, and its text
/// with every placeholder filled by a plain token is a valid subject.
pub fn check_template(template: &str) -> Result<(), String> {
    let probe: String = parts(template)?
        .iter()
        .map(|p| match p {
            Part::Text(t) => *t,
            Part::EffectKey | Part::Payload(_) => "x",
        })
        .collect();
    if !valid_subject(&probe) {
        return Err(format!(
            "\"{template}\" is not a subject to publish to: tokens are separated by single dots and hold no space, '*' or '>'"
        ));
    }
    Ok(())
}

/// Does the subject name the effect key, so that the last message on it is this message
/// (a lookup by subject can find it)?
pub fn names_effect_key(template: &str) -> bool {
    parts(template).is_ok_and(|p| p.contains(&Part::EffectKey))
}

/// One token of a template, as far as a stream's subjects can tell: fixed text, or a token
/// holding a placeholder, which a message may fill with one token or more (a value with a
/// dot adds tokens).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Shape<'a> {
    Fixed(&'a str),
    Filled,
}

/// Can some message's subject from `template` match the subject filter `filter` (tokens,
/// `*` for one token, a last `>` for one or more)? A template that cannot is outside it.
fn may_match(filter: &[&str], template: &[Shape<'_>]) -> bool {
    match (filter.split_first(), template.split_first()) {
        (None, None) => true,
        (Some((&">", _)), Some(_)) => true,
        (None, Some(_)) | (Some(_), None) => false,
        (Some((f, fs)), Some((Shape::Fixed(t), ts))) => (*f == "*" || f == t) && may_match(fs, ts),
        // A filled token takes one filter token, or more: its value may hold dots.
        (Some((_, _)), Some((Shape::Filled, ts))) => {
            (1..=filter.len())
                .take_while(|&n| filter[n - 1] != ">")
                .any(|n| may_match(&filter[n..], ts))
                || filter.contains(&">")
        }
    }
}

/// The tokens of `template`: a token with a placeholder anywhere in it is filled.
fn shapes(template: &str) -> Result<Vec<Shape<'_>>, String> {
    let mut out = vec![Shape::Fixed("")];
    for part in parts(template)? {
        match part {
            Part::Text(text) => {
                let mut tokens = text.split('.');
                let first = tokens.next().unwrap_or_default();
                // Text continues the token before it: the empty first token, or a filled
                // one (a placeholder precedes every text part but the first), which stays
                // filled.
                if let Some(Shape::Fixed(start)) = out.last_mut() {
                    *start = first;
                }
                out.extend(tokens.map(Shape::Fixed));
            }
            Part::EffectKey | Part::Payload(_) => {
                *out.last_mut().expect("never empty") = Shape::Filled
            }
        }
    }
    Ok(out)
}

/// Does the stream take the subjects of `template`? `subjects` are the stream's subject
/// filters; a stream with none takes the subject named like the stream. `Err` says, for
/// `create_channel`, why no message of the channel could be stored: the server would
/// answer every publish with "no responders", retried as transient for ever.
pub fn within_stream(template: &str, stream: &str, subjects: &[String]) -> Result<(), String> {
    let shapes = shapes(template)?;
    let own = [stream.to_string()];
    let filters = if subjects.is_empty() {
        &own[..]
    } else {
        subjects
    };
    if filters
        .iter()
        .any(|f| may_match(&f.split('.').collect::<Vec<_>>(), &shapes))
    {
        return Ok(());
    }
    Err(format!(
        "\"{template}\" lies outside the subjects of stream \"{stream}\" ({}): the server would store none of its messages",
        filters.join(", ")
    ))
}

/// The subject of one message, or why it has none (the message is not sent).
pub fn fill(template: &str, effect_key: &str, payload: &str) -> Result<String, String> {
    let mut subject = String::with_capacity(template.len() + effect_key.len());
    for part in parts(template)? {
        match part {
            Part::Text(t) => subject.push_str(t),
            Part::EffectKey => subject.push_str(effect_key),
            Part::Payload(pointer) => match body_pointer(payload.as_bytes(), pointer) {
                Some(value) => subject.push_str(&value),
                None => {
                    return Err(format!(
                        "the payload has no value at {pointer} for the subject \"{template}\""
                    ))
                }
            },
        }
    }
    if !valid_subject(&subject) {
        return Err(format!(
            "\"{subject}\" is not a subject to publish to (filled from \"{template}\"): tokens hold no space, '*' or '>', and none is empty"
        ));
    }
    Ok(subject)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fixed_subject_is_its_own_subject() {
        assert_eq!(fill("orders.created", "k", "{}").unwrap(), "orders.created");
        assert!(!names_effect_key("orders.created"));
    }

    #[test]
    fn placeholders_are_filled() {
        let payload = r#"{"region": "eu", "n": 7}"#;
        assert_eq!(
            fill("orders.{payload:/region}.{effect_key}", "abc-1", payload).unwrap(),
            "orders.eu.abc-1"
        );
        assert_eq!(fill("n.{payload:/n}", "k", payload).unwrap(), "n.7");
        assert!(names_effect_key("orders.{effect_key}"));
    }

    #[test]
    fn a_filled_value_that_breaks_the_subject_is_refused() {
        for key in ["a b", "*", ">", "", "a\u{1}"] {
            assert!(fill("o.{effect_key}", key, "{}").is_err(), "{key:?}");
        }
        assert!(fill("o.{payload:/missing}", "k", "{}").is_err());
        assert!(fill("o.{payload:/x}", "k", r#"{"x": "a b"}"#).is_err());
        // A dot adds a token; the subject is still valid and the same on every attempt.
        assert_eq!(fill("o.{effect_key}", "a.b", "{}").unwrap(), "o.a.b");
    }

    #[test]
    fn templates_are_checked() {
        for good in [
            "a",
            "a.b.c",
            "a.{effect_key}",
            "{payload:/t}.x",
            "ünïcode.ok",
        ] {
            assert!(check_template(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "a..b",
            ".a",
            "a.",
            "a.*",
            "a.>",
            "a b",
            "a.{other}",
            "a.{effect_key",
            "a}",
            "{payload:x}",
        ] {
            assert!(check_template(bad).is_err(), "{bad}");
        }
        assert!(check_template(&"a".repeat(MAX_SUBJECT_BYTES + 1)).is_err());
    }

    #[test]
    fn a_subject_outside_its_stream_is_found() {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        let inside = [
            ("orders.created", s(&["orders.>"])),
            ("orders.created", s(&["orders.*"])),
            ("orders.created", s(&["orders.created"])),
            ("orders.{effect_key}", s(&["orders.*"])),
            ("orders.{effect_key}", s(&["orders.>"])),
            // A key with a dot fills two tokens.
            ("orders.{effect_key}", s(&["orders.*.*"])),
            ("orders.{effect_key}", s(&["orders.a.b.c"])),
            ("{payload:/r}.x", s(&["eu.x"])),
            ("{payload:/r}.x", s(&["*.*.x"])),
            ("a.{effect_key}.z", s(&["a.>"])),
            ("a.b", s(&["x.>", "a.b"])),
            ("ORDERS", s(&[])),
            ("o-{effect_key}", s(&["*"])),
            ("o.{payload:/a.b}", s(&["o.*"])),
            ("o.x{payload:/a}y.z", s(&["o.q.z"])),
        ];
        for (template, subjects) in inside {
            assert!(
                within_stream(template, "ORDERS", &subjects).is_ok(),
                "{template} {subjects:?}"
            );
        }
        let outside = [
            ("elsewhere.x", s(&["orders.>"])),
            ("orders", s(&["orders.>"])),
            ("orders.a.b", s(&["orders.*"])),
            ("orders.created", s(&["orders.updated"])),
            ("a.{effect_key}.z", s(&["a.*.y"])),
            ("a.{effect_key}", s(&["a"])),
            ("orders", s(&[])),
            ("x.{effect_key}", s(&["y.*", "y.>"])),
            ("o.{payload:/a.b}.c", s(&["o.*"])),
        ];
        for (template, subjects) in outside {
            let e = within_stream(template, "ORDERS", &subjects).unwrap_err();
            assert!(e.contains("lies outside") && e.contains(template), "{e}");
        }
    }
}
