//! `create_channel` / `alter_channel`: every option validated before anything is written.

use super::lookup_url;
use super::nats::{subject as nats_subject, target as nats_options, window as nats_window};
use super::options::{unverifiable_notice, validate_endpoint, ChannelOptions, Kind, OptionError};
use super::secrets::{mask_url, shape};
use super::sql_effect;
use crate::allow_list::{self, AllowList};
use crate::error::{spi_failure, OrRaise, OutboxError};
use crate::gucs;
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::prelude::*;
use pgrx::spi::SpiClient;
use pgrx::{JsonB, PgLogLevel, PgSqlErrorCode};
use serde_json::Value;

const INSERT_CHANNEL: &str = "\
    INSERT INTO outbox._channels (name, endpoint, options) VALUES ($1, $2, $3) \
    ON CONFLICT (name) DO NOTHING RETURNING id";

const LOCK_CHANNEL: &str = "\
    SELECT endpoint, options FROM outbox._channels WHERE name = $1 FOR UPDATE";

const UPDATE_CHANNEL: &str = "\
    UPDATE outbox._channels SET endpoint = $2, options = $3, updated_at = now() WHERE name = $1";

const LOG_CHANNEL_CHANGE: &str = "\
    INSERT INTO outbox._operator_log (action, channel, detail) VALUES ($1, $2, $3)";

const WAKE_WORKERS: &str = "SELECT outbox._wake_at_commit()";

fn option_error(e: OptionError) -> OutboxError {
    OutboxError::InvalidOption {
        option: e.option,
        message: e.message,
        hint: e.hint,
    }
}

/// The destinations of an http channel, its endpoint and (when it can reconcile) the host of
/// its lookup URL, must be allowed by `outbox.allowed_hosts` (see `crate::allow_list`): 42501 naming the
/// option and the host otherwise. The worker checks every request again when it sends.
fn check_destinations(
    list: &AllowList,
    endpoint: &str,
    options: &ChannelOptions,
) -> Result<(), OutboxError> {
    let reconcile = options
        .reconcile
        .as_ref()
        .map(|r| ("reconcile.url", lookup_url::probe(&r.url)));
    for (option, url) in std::iter::once(("endpoint", endpoint.to_string())).chain(reconcile) {
        let parsed = reqwest::Url::parse(&url).map_err(|e| {
            option_error(OptionError::new(
                option,
                format!("\"{}\" is not a valid URL ({e})", mask_url(&url)),
            ))
        })?;
        allow_list::check_url(list, &parsed).map_err(|refusal| {
            OutboxError::DestinationRefused {
                option,
                refusal,
                allowed_hosts: list.source().to_string(),
            }
        })?;
    }
    Ok(())
}

/// Checks what an option object needs outside itself: an http channel's endpoint is a URL
/// whose host (like its reconcile URL's) `outbox.allowed_hosts` allows; a sql channel's
/// endpoint is `sql`, its function exists with the right signature, its `run_as` role
/// exists and is not a superuser, and the caller may administer channels.
fn check_target(
    client: &SpiClient<'_>,
    endpoint: &str,
    options: &ChannelOptions,
) -> Result<(), pgrx::spi::Error> {
    if let Kind::Nats(_) = &options.kind {
        return check_nats_endpoint(endpoint);
    }
    let Kind::Sql { function, run_as } = &options.kind else {
        validate_endpoint("endpoint", endpoint)
            .map_err(option_error)
            .or_raise();
        let list = AllowList::parse(&gucs::allowed_hosts())
            .map_err(OutboxError::InvalidAllowedHosts)
            .or_raise();
        check_destinations(&list, endpoint, options).or_raise();
        return Ok(());
    };
    if endpoint != "sql" {
        option_error(OptionError::new(
            "endpoint",
            format!(
                "must be 'sql' for a channel of kind sql, not \"{}\"",
                mask_url(endpoint)
            ),
        ))
        .raise();
    }
    let may = client
        .select(sql_effect::MAY_ADMINISTER, Some(1), &[])?
        .first()
        .get_one::<bool>()?;
    if may != Some(true) {
        OutboxError::InsufficientPrivilege {
            message:
                "only a superuser or a member of outbox_admin may point a channel at a function"
                    .into(),
            hint: "Ask an outbox_admin to create the channel.",
        }
        .raise();
    }
    let found = client.select(
        sql_effect::FIND_FUNCTION.sql,
        Some(1),
        &[function.as_str().into()],
    )?;
    if found.is_empty() {
        OutboxError::UndefinedFunction {
            name: function.clone(),
            message: "does not exist".into(),
        }
        .raise();
    }
    if found.first().get::<bool>(2)? != Some(true) {
        OutboxError::UndefinedFunction {
            name: function.clone(),
            message: "must return text (the external id)".into(),
        }
        .raise();
    }
    let role = client.select(sql_effect::FIND_ROLE, Some(1), &[run_as.as_str().into()])?;
    let (superuser, may_act_as) = if role.is_empty() {
        (None, None)
    } else {
        let row = role.first();
        (row.get::<bool>(1)?, row.get::<bool>(2)?)
    };
    match (superuser, may_act_as) {
        (Some(false), Some(true)) => Ok(()),
        (Some(false), _) => OutboxError::InsufficientPrivilege {
            message: format!(
                "run_as: you are not a member of role \"{run_as}\"; a channel runs its function only as a role its creator may act as"
            ),
            hint: "GRANT the role to yourself (or ask its owner), or choose a role you belong to.",
        }
        .raise(),
        (Some(true), _) => option_error(OptionError::new("run_as", format!("role \"{run_as}\" is a superuser; effects run with least privilege")))
        .raise(),
        (None, _) => option_error(OptionError::new("run_as", format!("role \"{run_as}\" does not exist")))
        .raise(),
    }
}

/// A `nats` channel's endpoint is `nats://host:port`, and `outbox.allowed_hosts` allows
/// its host (42501 naming it otherwise). The worker checks every connection again.
fn check_nats_endpoint(endpoint: &str) -> Result<(), pgrx::spi::Error> {
    let url = nats_options::validate_endpoint(endpoint)
        .map_err(option_error)
        .or_raise();
    let list = AllowList::parse(&gucs::allowed_hosts())
        .map_err(OutboxError::InvalidAllowedHosts)
        .or_raise();
    allow_list::check_url(&list, &url)
        .map_err(|refusal| OutboxError::DestinationRefused {
            option: "endpoint",
            refusal,
            allowed_hosts: list.source().to_string(),
        })
        .or_raise();
    Ok(())
}

/// Reads a `nats` channel's stream: its duplicate window, applied to `options`
/// (`nats_window::apply_window`), and its subjects, which must take the channel's subject
/// (`nats_subject::within_stream`) when `check_subject` (a new channel, or a change of its
/// subject or stream). A stream that cannot be read refuses the channel (22023 naming the
/// stream), since without its window no republish is known to be safe.
fn read_nats_stream(
    endpoint: &str,
    options: &mut ChannelOptions,
    explicit_max_age: bool,
    check_subject: bool,
) {
    if !matches!(options.kind, Kind::Nats(_)) {
        return;
    }
    let list = AllowList::parse(&gucs::allowed_hosts())
        .map_err(OutboxError::InvalidAllowedHosts)
        .or_raise();
    let stream = nats_window::read_from_backend(endpoint, options, list)
        .map_err(|e| {
            option_error(OptionError::new(
                "stream",
                format!(
                    "its duplicate window cannot be read from {}: {e}",
                    mask_url(endpoint)
                ),
            ))
        })
        .or_raise();
    if let (Kind::Nats(target), true) = (&options.kind, check_subject) {
        nats_subject::within_stream(&target.subject, &target.stream, &stream.subjects)
            .map_err(|e| {
                option_error(OptionError::new("subject", e).with_hint(
                    "Use a subject the stream takes, or add the subject to the stream's subjects.",
                ))
            })
            .or_raise();
    }
    let note = nats_window::apply_window(options, stream.window_ms, explicit_max_age)
        .map_err(option_error)
        .or_raise();
    if let Some(note) = note {
        ErrorReport::new(
            PgSqlErrorCode::ERRCODE_SUCCESSFUL_COMPLETION,
            note,
            "outbox_delivery",
        )
        .report(PgLogLevel::NOTICE);
    }
}

/// Does this call change a `nats` channel's subject or stream?
fn changes_subject(changes: &Value) -> bool {
    ["subject", "stream"]
        .iter()
        .any(|k| changes.get(k).is_some_and(|v| !v.is_null()))
}

/// Did the caller set `retry.max_age_ms` in this call?
fn sets_max_age(options: &Value) -> bool {
    options
        .pointer("/retry/max_age_ms")
        .is_some_and(|v| !v.is_null())
}

fn required<'a>(argument: &'static str, v: Option<&'a str>) -> &'a str {
    match v {
        Some(s) if !s.trim().is_empty() => s,
        _ => OutboxError::invalid_argument(
            argument,
            "must not be NULL or empty",
            "Pass a non-empty value.",
        )
        .raise(),
    }
}

/// What the operator log keeps of a change: the options without their secrets.
fn loggable(options: &Value) -> Value {
    super::secrets::mask_options(options)
}

/// Reads the options argument. It arrives as the text of a jsonb (see the SQL wrappers in
/// sql/api.sql), so that a document too deeply nested for the parser is refused with 22023
/// instead of failing inside the argument conversion.
fn options_argument(options: Option<&str>) -> Option<Value> {
    options.map(|text| {
        serde_json::from_str(text)
            .map_err(|e| option_error(OptionError::new("options", format!("cannot be read: {e}"))))
            .or_raise()
    })
}

/// A NOTICE for a channel that can neither dedupe nor be asked: what a crash costs there,
/// and which option removes the cost.
fn say_if_unverifiable(name: &str, options: &ChannelOptions) {
    if let Some((message, detail, hint)) = unverifiable_notice(name, options) {
        ErrorReport::new(
            PgSqlErrorCode::ERRCODE_SUCCESSFUL_COMPLETION,
            message,
            "outbox_delivery",
        )
        .set_detail(detail)
        .set_hint(hint)
        .report(PgLogLevel::NOTICE);
    }
}

/// `outbox.create_channel(name, endpoint, options jsonb)` (a wrapper in sql/api.sql).
#[pg_extern(name = "_create_channel", volatile, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn create_channel(name: Option<&str>, endpoint: Option<&str>, options: Option<&str>) {
    let name = required("name", name);
    let endpoint = required("endpoint", endpoint);
    let options = options_argument(options).unwrap_or_else(|| Value::Object(Default::default()));
    let mut parsed = ChannelOptions::from_json_checked(&options)
        .map_err(option_error)
        .or_raise();

    Spi::connect_mut(|client| -> Result<(), pgrx::spi::Error> {
        check_target(client, endpoint, &parsed)?;
        read_nats_stream(endpoint, &mut parsed, sets_max_age(&options), true);
        let normalized = parsed.to_json();
        let inserted = client.update(
            INSERT_CHANNEL,
            None,
            &[
                name.into(),
                endpoint.into(),
                JsonB(normalized.clone()).into(),
            ],
        )?;
        if inserted.is_empty() {
            OutboxError::DuplicateChannel {
                name: name.to_string(),
            }
            .raise();
        }
        let detail =
            serde_json::json!({"endpoint": mask_url(endpoint), "options": loggable(&normalized)});
        client.update(
            LOG_CHANNEL_CHANGE,
            None,
            &["create_channel".into(), name.into(), JsonB(detail).into()],
        )?;
        say_if_unverifiable(name, &parsed);
        Ok(())
    })
    .unwrap_or_else(|e| spi_failure(e));
}

/// `outbox.alter_channel(name, options jsonb)` (a wrapper in sql/api.sql).
#[pg_extern(name = "_alter_channel", volatile, security_definer)]
#[search_path(pg_catalog, pg_temp)]
fn alter_channel(name: Option<&str>, options: Option<&str>) {
    let name = required("name", name);
    let changes = match options_argument(options) {
        Some(v) if v.is_object() => v,
        Some(v) => option_error(OptionError::new(
            "options",
            format!("must be a JSON object, not {}", shape(&v)),
        ))
        .raise(),
        None => OutboxError::invalid_argument(
            "options",
            "must not be NULL",
            "Pass the options to change, e.g. '{\"max_in_flight\": 8}'.",
        )
        .raise(),
    };

    Spi::connect_mut(|client| -> Result<(), pgrx::spi::Error> {
        let current = client.update(LOCK_CHANNEL, Some(1), &[name.into()])?;
        if current.is_empty() {
            OutboxError::UnknownChannel {
                name: name.to_string(),
            }
            .raise();
        }
        let row = current.first();
        let mut endpoint: String = row.get(1)?.unwrap_or_default();
        let current_options: Value = row.get::<JsonB>(2)?.map(|j| j.0).unwrap_or(Value::Null);

        let mut changes = changes.clone();
        if let Some(new_endpoint) = changes.as_object_mut().and_then(|o| o.remove("endpoint")) {
            let e = new_endpoint
                .as_str()
                .ok_or_else(|| OptionError::new("endpoint", "must be a string".to_string()))
                .map_err(option_error)
                .or_raise();
            endpoint = e.to_string();
        }
        let merged = ChannelOptions::merge(&current_options, &changes)
            .map_err(option_error)
            .or_raise();
        let mut parsed = ChannelOptions::from_json_checked(&merged)
            .map_err(option_error)
            .or_raise();
        check_target(client, &endpoint, &parsed)?;
        read_nats_stream(
            &endpoint,
            &mut parsed,
            sets_max_age(&changes),
            changes_subject(&changes),
        );
        let normalized = parsed.to_json();

        client.update(
            UPDATE_CHANNEL,
            None,
            &[
                name.into(),
                endpoint.as_str().into(),
                JsonB(normalized.clone()).into(),
            ],
        )?;
        let detail = serde_json::json!({
            "changes": loggable(&changes),
            "endpoint": mask_url(&endpoint),
            "options": loggable(&normalized),
        });
        client.update(
            LOG_CHANNEL_CHANGE,
            None,
            &["alter_channel".into(), name.into(), JsonB(detail).into()],
        )?;
        say_if_unverifiable(name, &parsed);
        // Changed policies apply to queued messages at their next decision: wake the worker.
        client.update(WAKE_WORKERS, None, &[])?;
        Ok(())
    })
    .unwrap_or_else(|e| spi_failure(e));
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn refused(list: &str, endpoint: &str, options: Value) -> Option<OutboxError> {
        let list = AllowList::parse(list).unwrap();
        let options = ChannelOptions::from_json(&options).unwrap();
        check_destinations(&list, endpoint, &options).err()
    }

    #[test]
    fn destinations_are_checked_at_create_and_alter() {
        let none = json!({});
        let lookup = |url: &str| json!({"reconcile": {"url": url}});
        assert_eq!(
            refused("*", "https://api.example.com/v1", none.clone()),
            None
        );
        assert_eq!(refused("*", "http://127.0.0.1:8080/x", none.clone()), None);
        assert_eq!(
            refused(
                "api.example.com",
                "https://api.example.com/v1",
                lookup("https://api.example.com/m/{effect_key}")
            ),
            None
        );
        assert_eq!(
            refused(
                "*, 169.254.169.254",
                "http://169.254.169.254/latest",
                none.clone()
            ),
            None
        );

        let e = refused("*", "http://169.254.169.254/latest/meta-data", none.clone()).unwrap();
        assert_eq!(
            e.sqlstate(),
            pgrx::PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE
        );
        assert_eq!(
            e.message(),
            "channel option \"endpoint\": host 169.254.169.254 is not allowed by outbox.allowed_hosts"
        );
        let detail = e.detail().unwrap();
        assert!(detail.contains("link-local"), "{detail}");
        assert!(
            detail.ends_with("outbox.allowed_hosts is currently \"*\"."),
            "{detail}"
        );
        assert!(e.hint().contains("outbox.allowed_hosts"));

        let e = refused(
            "api.example.com",
            "https://evil.example.net/x",
            none.clone(),
        )
        .unwrap();
        assert_eq!(
            e.message(),
            "channel option \"endpoint\": host evil.example.net is not allowed by outbox.allowed_hosts"
        );
        assert!(e
            .detail()
            .unwrap()
            .contains("outbox.allowed_hosts is currently \"api.example.com\""));

        let e = refused(
            "api.example.com",
            "https://api.example.com/v1",
            lookup("https://lookup.example.net/m/{effect_key}"),
        )
        .unwrap();
        assert_eq!(
            e.sqlstate(),
            pgrx::PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE
        );
        assert_eq!(
            e.message(),
            "channel option \"reconcile.url\": host lookup.example.net is not allowed by outbox.allowed_hosts"
        );
        let e = refused(
            "*",
            "https://api.example.com/v1",
            lookup("http://[fd00:ec2::254]/m/{effect_key}"),
        )
        .unwrap();
        assert!(e.message().contains("reconcile.url") && e.message().contains("[fd00:ec2::254]"));
        // Every address form the url crate normalizes is checked as the address.
        let e = refused("*", "http://0xa9.0xfe.0xa9.0xfe/", none.clone()).unwrap();
        assert!(
            e.message().contains("host 169.254.169.254 "),
            "{}",
            e.message()
        );
        assert!(refused("", "https://api.example.com/v1", none).is_some());
    }

    #[test]
    fn an_invalid_setting_names_its_entry() {
        let e = OutboxError::InvalidAllowedHosts(
            AllowList::parse("*, api.example.com:443").unwrap_err(),
        );
        assert_eq!(
            e.sqlstate(),
            pgrx::PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE
        );
        assert!(
            e.message().starts_with(
                "invalid value for setting \"outbox.allowed_hosts\": entry \"api.example.com:443\""
            ),
            "{}",
            e.message()
        );
    }
}
