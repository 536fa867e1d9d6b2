//! The text of `GET /metrics`, pure: each database's `outbox.prometheus()` labelled with its
//! `database`, every family described once, and for each database served a sample saying
//! whether its part is in this scrape; and the answers of the listener.

use super::request::{Head, Verdict};

/// `exposition` with `database="<db>"` added to every sample's labels; comments as they are.
pub fn with_database_label(exposition: &str, database: &str) -> String {
    let label = format!(
        "database=\"{}\"",
        database
            .replace('\\', "\\\\")
            .replace('"', "\\\"")
            .replace('\n', "\\n")
    );
    let mut out = String::with_capacity(exposition.len() + 64);
    for line in exposition.lines() {
        if line.is_empty() || line.starts_with('#') {
            out.push_str(line);
        } else if let Some(brace) = line.find('{') {
            let rest = &line[brace + 1..];
            out.push_str(&line[..=brace]);
            out.push_str(&label);
            if !rest.starts_with('}') {
                out.push(',');
            }
            out.push_str(rest);
        } else if let Some(space) = line.find(' ') {
            out.push_str(&line[..space]);
            out.push('{');
            out.push_str(&label);
            out.push('}');
            out.push_str(&line[space..]);
        } else {
            out.push_str(line);
        }
        out.push('\n');
    }
    out
}

/// Families already described by an earlier database's exposition lose their HELP and TYPE
/// lines: a family is described once in a scrape.
pub fn merge(parts: &[String]) -> String {
    let mut seen = std::collections::HashSet::new();
    let mut out = String::new();
    for part in parts {
        for line in part.lines() {
            let mut words = line.split(' ');
            if let (Some("#"), Some(kind @ ("HELP" | "TYPE")), Some(name)) =
                (words.next(), words.next(), words.next())
            {
                if !seen.insert((kind, name.to_string())) {
                    continue;
                }
            }
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// What a request head asks of the listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// Answered at once: status and body.
    Answer(u16, String),
    /// `GET /metrics`, allowed: answered by the next scrape.
    Scrape,
}

/// The route of a request: `GET /metrics` alone is served, to whom `verdict` allows.
/// `verdict` is only asked for a `GET /metrics`.
pub fn route(head: &Head, verdict: impl FnOnce() -> Verdict) -> Route {
    match (head.method.as_str(), head.path.as_str()) {
        ("GET", "/metrics") => match verdict() {
            Verdict::Allowed => Route::Scrape,
            Verdict::Unauthorized => Route::Answer(
                401,
                "outbox_delivery: GET /metrics needs Authorization: Bearer <token>\n".into(),
            ),
            Verdict::Unavailable => Route::Answer(
                503,
                "outbox_delivery: the metrics token cannot be read; the server log says why\n"
                    .into(),
            ),
        },
        (_, "/metrics") => Route::Answer(405, "only GET\n".into()),
        _ => Route::Answer(404, "outbox_delivery: GET /metrics\n".into()),
    }
}

/// The answer to an allowed `GET /metrics` from what the scrape gave.
pub fn scraped(exposition: Result<String, String>) -> (u16, String) {
    match exposition {
        Ok(text) => (200, text),
        Err(e) => (
            503,
            format!("outbox_delivery: the exposition failed: {e}\n"),
        ),
    }
}

pub fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        431 => "Request Header Fields Too Large",
        _ => "Service Unavailable",
    }
}

/// The bytes of an HTTP/1.1 answer; the connection closes after it.
pub fn http_answer(status: u16, body: &str) -> Vec<u8> {
    let content_type = if status == 200 {
        "text/plain; version=0.0.4; charset=utf-8"
    } else {
        "text/plain; charset=utf-8"
    };
    let challenge = if status == 401 {
        "WWW-Authenticate: Bearer realm=\"outbox_delivery metrics\"\r\n"
    } else {
        ""
    };
    format!(
        "HTTP/1.1 {status} {}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n{challenge}Connection: close\r\n\r\n{body}",
        reason(status),
        body.len()
    )
    .into_bytes()
}

/// What one database gave to a scrape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    /// Its `outbox.prometheus()`.
    Exposition(String),
    /// Nothing, and why (said in a comment of the scrape).
    Missing(String),
}

/// The family that says, per database, whether its part is in the scrape.
const UP_FAMILY: &str = "outbox_metrics_database_up";

/// The scrape: every database's part in the order of `outbox.database`, labelled, each
/// family described once, then `outbox_metrics_database_up` per database (1: its figures
/// are here; 0: they are not, and a comment says why).
pub fn assemble(parts: &[(String, Part)]) -> String {
    let mut labelled = Vec::with_capacity(parts.len() + 1);
    let mut up = format!(
        "# HELP {UP_FAMILY} Whether this scrape holds the database's figures (0: see the comment above it).\n# TYPE {UP_FAMILY} gauge\n"
    );
    for (database, part) in parts {
        let value = match part {
            Part::Exposition(text) => {
                labelled.push(with_database_label(text, database));
                1
            }
            Part::Missing(why) => {
                up.push_str(&format!(
                    "# outbox_delivery: database {database:?}: {}\n",
                    why.replace('\n', " ")
                ));
                0
            }
        };
        up.push_str(&with_database_label(
            &format!("{UP_FAMILY} {value}\n"),
            database,
        ));
    }
    labelled.push(up);
    merge(&labelled)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_sample_gets_the_database_label() {
        let text = "# HELP outbox_queued Queued.\n# TYPE outbox_queued gauge\noutbox_queued{channel=\"a\"} 3\noutbox_workers 2\nx{} 1\n";
        assert_eq!(
            with_database_label(text, "app\"db"),
            "# HELP outbox_queued Queued.\n# TYPE outbox_queued gauge\noutbox_queued{database=\"app\\\"db\",channel=\"a\"} 3\noutbox_workers{database=\"app\\\"db\"} 2\nx{database=\"app\\\"db\"} 1\n"
        );
    }

    #[test]
    fn families_are_described_once() {
        let a = "# HELP f F.\n# TYPE f gauge\nf{database=\"a\"} 1\n".to_string();
        let b = "# HELP f F.\n# TYPE f gauge\nf{database=\"b\"} 2\n".to_string();
        assert_eq!(
            merge(&[a, b]),
            "# HELP f F.\n# TYPE f gauge\nf{database=\"a\"} 1\nf{database=\"b\"} 2\n"
        );
    }

    #[test]
    fn a_scrape_holds_every_database_and_says_which_are_missing() {
        let a =
            "# HELP outbox_queued Q.\n# TYPE outbox_queued gauge\noutbox_queued{channel=\"c\"} 1\n";
        let text = assemble(&[
            ("a".into(), Part::Exposition(a.into())),
            (
                "b".into(),
                Part::Missing("extension outbox_delivery is not installed\nthere".into()),
            ),
            ("c".into(), Part::Exposition(a.replace(" 1", " 2"))),
        ]);
        assert_eq!(
            text,
            "# HELP outbox_queued Q.\n# TYPE outbox_queued gauge\noutbox_queued{database=\"a\",channel=\"c\"} 1\n\
             outbox_queued{database=\"c\",channel=\"c\"} 2\n\
             # HELP outbox_metrics_database_up Whether this scrape holds the database's figures (0: see the comment above it).\n\
             # TYPE outbox_metrics_database_up gauge\n\
             outbox_metrics_database_up{database=\"a\"} 1\n\
             # outbox_delivery: database \"b\": extension outbox_delivery is not installed there\n\
             outbox_metrics_database_up{database=\"b\"} 0\n\
             outbox_metrics_database_up{database=\"c\"} 1\n"
        );
        assert_eq!(
            assemble(&[]),
            "# HELP outbox_metrics_database_up Whether this scrape holds the database's figures (0: see the comment above it).\n# TYPE outbox_metrics_database_up gauge\n"
        );
    }

    fn head(method: &str, path: &str) -> Head {
        Head {
            method: method.into(),
            path: path.into(),
            authorization: None,
        }
    }

    #[test]
    fn only_get_metrics_is_served_and_only_to_whom_the_verdict_allows() {
        let allowed = || Verdict::Allowed;
        assert_eq!(route(&head("GET", "/metrics"), allowed), Route::Scrape);
        assert!(matches!(
            route(&head("GET", "/metrics"), || Verdict::Unauthorized),
            Route::Answer(401, _)
        ));
        assert!(matches!(
            route(&head("GET", "/metrics"), || Verdict::Unavailable),
            Route::Answer(503, _)
        ));
        assert!(matches!(
            route(&head("POST", "/metrics"), allowed),
            Route::Answer(405, _)
        ));
        assert!(matches!(
            route(&head("GET", "/"), allowed),
            Route::Answer(404, _)
        ));
        assert!(matches!(
            route(&head("", ""), allowed),
            Route::Answer(404, _)
        ));
        // The verdict (a read of the token file) is only taken for GET /metrics.
        assert!(matches!(
            route(&head("GET", "/x"), || panic!("asked")),
            Route::Answer(404, _)
        ));
        assert_eq!(scraped(Ok("body".into())), (200, "body".into()));
        assert_eq!(scraped(Err("down".into())).0, 503);
    }

    #[test]
    fn an_answer_says_its_length_and_closes() {
        let text = String::from_utf8(http_answer(200, "x 1\n")).unwrap();
        assert_eq!(
            text,
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: 4\r\nConnection: close\r\n\r\nx 1\n"
        );
        let text = String::from_utf8(http_answer(401, "no")).unwrap();
        assert!(text.starts_with("HTTP/1.1 401 Unauthorized\r\n"), "{text}");
        assert!(text.contains("\r\nWWW-Authenticate: Bearer realm=\"outbox_delivery metrics\"\r\n"));
    }
}
