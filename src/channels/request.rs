//! The HTTP request of one message on its channel: method, endpoint, the merged headers
//! (the message's, then the channel's, then the effect key's) and the payload. Pure Rust:
//! the worker hands the result to the transport (`http`).

use super::http::Outgoing;
use super::options::ChannelOptions;
use crate::outbox::enqueue_check::reserved_header;
use std::time::Duration;

/// What the request carries of one message.
pub struct Message<'a> {
    pub channel_id: i32,
    /// The message's own headers (a JSON object's text), if any.
    pub headers: Option<&'a str>,
    pub payload: &'a str,
    /// The effect key as the provider sees it.
    pub effect_key: &'a str,
    /// When its request may no longer start (`fence`).
    pub fence: super::fence::Fence,
}

/// The request for `message` on a channel with `endpoint` and `options`, or why it cannot
/// be sent (nothing is sent then).
///
/// Channel headers win over message headers of the same name; the reference and
/// idempotency headers, which carry the effect key, win last. A message header that frames
/// or routes the request is refused (`enqueue` refuses it too; a row written otherwise is
/// not sent with it).
pub fn outgoing(
    message: &Message<'_>,
    endpoint: &str,
    options: &ChannelOptions,
) -> Result<Outgoing, String> {
    let mut headers = message_headers(message.headers)?;
    headers.retain(|(n, _)| {
        !options
            .headers
            .iter()
            .any(|(c, _)| c.eq_ignore_ascii_case(n))
    });
    headers.extend(options.headers.iter().cloned());
    for key_header in [&options.reference_header, &options.idempotency_header]
        .into_iter()
        .flatten()
    {
        headers.retain(|(n, _)| !n.eq_ignore_ascii_case(key_header));
        headers.push((key_header.clone(), message.effect_key.to_string()));
    }
    Ok(Outgoing {
        channel_id: message.channel_id,
        method: options.method.clone(),
        url: endpoint.to_string(),
        parsed_url: None,
        headers,
        body: message.payload.to_string(),
        timeout: Duration::from_millis(options.timeout_ms),
        external_id: options.external_id.clone(),
        max_response_bytes: options.max_response_bytes as usize,
        excerpt_bytes: options.response_excerpt_bytes as usize,
        fence: message.fence,
    })
}

/// The message's own headers as name/value pairs, in their order.
fn message_headers(raw: Option<&str>) -> Result<Vec<(String, String)>, String> {
    let Some(raw) = raw else {
        return Ok(Vec::new());
    };
    let parsed: serde_json::Value =
        serde_json::from_str(raw).map_err(|e| format!("message headers are not JSON: {e}"))?;
    let fields = match &parsed {
        serde_json::Value::Null => return Ok(Vec::new()),
        serde_json::Value::Object(fields) => fields,
        other => {
            return Err(format!(
                "message headers must be a JSON object of strings, not {other}"
            ))
        }
    };
    let mut headers = Vec::with_capacity(fields.len());
    for (name, value) in fields {
        let value = value
            .as_str()
            .ok_or_else(|| format!("message header \"{name}\" is not a string"))?;
        if let Some(why) = reserved_header(name, &[]) {
            return Err(format!(
                "message header \"{name}\" may not be set: it {why}"
            ));
        }
        headers.push((name.clone(), value.to_string()));
    }
    Ok(headers)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn options(v: serde_json::Value) -> ChannelOptions {
        ChannelOptions::from_json(&v).unwrap()
    }

    fn message(headers: Option<&str>) -> Message<'_> {
        Message {
            channel_id: 7,
            headers,
            payload: r#"{"text": "hi"}"#,
            effect_key: "k-1",
            fence: crate::channels::fence::Fence::open(),
        }
    }

    fn header<'a>(out: &'a Outgoing, name: &str) -> Vec<&'a str> {
        out.headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
            .collect()
    }

    #[test]
    fn channel_headers_win_over_message_headers_and_key_headers_win_last() {
        let o = options(json!({
            "headers": {"Authorization": "Bearer c", "X-Shared": "channel"},
            "idempotency_header": "Idempotency-Key",
            "reference_header": "X-Ref",
            "timeout_ms": 5000,
            "external_id": "/id"
        }));
        let raw = r#"{"x-shared": "message", "X-Own": "mine", "idempotency-key": "forged", "X-REF": "forged"}"#;
        let out = outgoing(&message(Some(raw)), "http://h/send", &o).unwrap();
        assert_eq!(header(&out, "X-Shared"), vec!["channel"]);
        assert_eq!(header(&out, "X-Own"), vec!["mine"]);
        assert_eq!(header(&out, "Authorization"), vec!["Bearer c"]);
        assert_eq!(header(&out, "Idempotency-Key"), vec!["k-1"]);
        assert_eq!(header(&out, "X-Ref"), vec!["k-1"]);
        assert_eq!(out.url, "http://h/send");
        assert_eq!(out.method, "POST");
        assert_eq!(out.body, r#"{"text": "hi"}"#);
        assert_eq!(out.timeout, Duration::from_millis(5000));
        assert_eq!(out.channel_id, 7);
        assert_eq!(out.max_response_bytes, 65536);
    }

    #[test]
    fn message_headers_that_cannot_be_sent_are_refused() {
        let o = options(json!({}));
        for (raw, error) in [
            ("not json", "message headers are not JSON"),
            ("[1]", "must be a JSON object of strings"),
            (r#"{"X-A": 1}"#, "message header \"X-A\" is not a string"),
            (
                r#"{"Content-Length": "3"}"#,
                "\"Content-Length\" may not be set",
            ),
            (
                r#"{"X-Forwarded-For": "1.2.3.4"}"#,
                "\"X-Forwarded-For\" may not be set",
            ),
        ] {
            let e = outgoing(&message(Some(raw)), "http://h/", &o).unwrap_err();
            assert!(e.contains(error), "{raw}: {e}");
        }
        assert!(outgoing(&message(Some("null")), "http://h/", &o)
            .unwrap()
            .headers
            .is_empty());
        assert!(outgoing(&message(None), "http://h/", &o)
            .unwrap()
            .headers
            .is_empty());
    }
}
