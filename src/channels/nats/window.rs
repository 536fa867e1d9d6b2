//! A `nats` channel's duplicate window, read from its stream by `create_channel` and
//! `alter_channel`, and what it means for the retry budget: an interrupted publish is
//! republished with the same `Nats-Msg-Id` only inside the window, so a retry budget
//! longer than the window is refused when asked for, and capped to it by default.

use crate::allow_list::AllowList;
use crate::channels::nats;
use crate::channels::options::{ChannelOptions, Kind, OptionError};

/// Applies the stream's `window_ms` to `options`: stored as `duplicate_window_ms`; a
/// `retry.max_age_ms` longer than it is refused when `explicit_max_age` (the caller set it
/// in this call), and otherwise capped to it. Returns a note for the caller when capped.
pub fn apply_window(
    options: &mut ChannelOptions,
    window_ms: u64,
    explicit_max_age: bool,
) -> Result<Option<String>, OptionError> {
    let Kind::Nats(target) = &mut options.kind else {
        return Ok(None);
    };
    target.duplicate_window_ms = Some(window_ms);
    if options.retry.max_age_ms <= window_ms {
        return Ok(None);
    }
    if explicit_max_age {
        return Err(OptionError::new(
            "retry.max_age_ms",
            format!(
                "{} ms is longer than the stream's duplicate window ({window_ms} ms): a publish republished after the window could be stored twice; set it to at most {window_ms}, or widen the stream's duplicate_window",
                options.retry.max_age_ms
            ),
        ));
    }
    let was = options.retry.max_age_ms;
    options.retry.max_age_ms = window_ms;
    Ok(Some(format!(
        "retry.max_age_ms capped from {was} ms to the stream's duplicate window ({window_ms} ms): a message is republished with the same Nats-Msg-Id only inside it"
    )))
}

/// Reads the channel's stream from a backend (connects, asks, and closes), held to
/// `allowed`: its duplicate window and subjects, or an error naming what could not be read.
pub fn read_from_backend(
    endpoint: &str,
    options: &ChannelOptions,
    allowed: AllowList,
) -> Result<nats::StreamFacts, String> {
    let Kind::Nats(target) = &options.kind else {
        return Err("not a nats channel".into());
    };
    let (endpoint, options, target) = (endpoint.to_string(), options.clone(), target.clone());
    crate::runtime::wait_in_backend(async move {
        nats::probe_stream(&endpoint, &options, &target, &allowed).await
    })?
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn nats(extra: serde_json::Value) -> ChannelOptions {
        let mut v = json!({"kind": "nats", "subject": "o.{effect_key}", "stream": "S"});
        v.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        ChannelOptions::from_json(&v).unwrap()
    }

    #[test]
    fn the_window_is_stored_and_a_longer_budget_capped_or_refused() {
        let mut o = nats(json!({}));
        let note = apply_window(&mut o, 120_000, false).unwrap();
        assert!(note.unwrap().contains("capped"));
        assert_eq!(o.retry.max_age_ms, 120_000);
        assert_eq!(o.key_dedupe(), Some(Some(120_000)));

        let mut o = nats(json!({"retry": {"max_age_ms": 600000}}));
        let e = apply_window(&mut o, 120_000, true).unwrap_err();
        assert_eq!(e.option, "retry.max_age_ms");

        let mut o = nats(json!({"retry": {"max_age_ms": 60000}}));
        assert_eq!(apply_window(&mut o, 120_000, true).unwrap(), None);
        assert_eq!(o.retry.max_age_ms, 60_000);
    }

    #[test]
    fn other_kinds_are_left_alone() {
        let mut o = ChannelOptions::default();
        assert_eq!(apply_window(&mut o, 1, true).unwrap(), None);
        assert_eq!(o, ChannelOptions::default());
    }
}
