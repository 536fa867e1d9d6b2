//! One error type for the SQL API, mapped to SQLSTATE + message + detail + hint in one place.

use crate::allow_list::{InvalidEntry, Refusal};
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::{PgLogLevel, PgSqlErrorCode};

/// An error followed by each of its causes that its text does not already hold, joined
/// with ": " (a transport error says little without the TLS or I/O cause below it).
pub fn with_causes(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let part = s.to_string();
        if !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        source = s.source();
    }
    text
}

#[derive(Debug, Clone, PartialEq)]
pub enum OutboxError {
    /// A function argument is NULL, empty or out of range (22023).
    InvalidArgument {
        argument: &'static str,
        message: String,
        hint: &'static str,
    },
    /// A channel option is unknown, mistyped or out of range (22023).
    InvalidOption {
        option: String,
        message: String,
        hint: Option<&'static str>,
    },
    /// No channel of that name (42704).
    UnknownChannel { name: String },
    /// A channel of that name already exists (42710).
    DuplicateChannel { name: String },
    /// The function a sql channel names does not exist or has the wrong signature (42883).
    UndefinedFunction { name: String, message: String },
    /// The caller may not do this (42501).
    InsufficientPrivilege { message: String, hint: &'static str },
    /// A channel's destination (`endpoint`, `reconcile.url`) is not allowed by
    /// `outbox.allowed_hosts` (42501).
    DestinationRefused {
        option: &'static str,
        refusal: Refusal,
        allowed_hosts: String,
    },
    /// `outbox.allowed_hosts` has an invalid entry (22023).
    InvalidAllowedHosts(InvalidEntry),
}

impl OutboxError {
    pub fn invalid_argument(
        argument: &'static str,
        message: impl Into<String>,
        hint: &'static str,
    ) -> Self {
        OutboxError::InvalidArgument {
            argument,
            message: message.into(),
            hint,
        }
    }

    pub fn sqlstate(&self) -> PgSqlErrorCode {
        match self {
            OutboxError::InvalidArgument { .. }
            | OutboxError::InvalidOption { .. }
            | OutboxError::InvalidAllowedHosts(_) => {
                PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE
            }
            OutboxError::UnknownChannel { .. } => PgSqlErrorCode::ERRCODE_UNDEFINED_OBJECT,
            OutboxError::DuplicateChannel { .. } => PgSqlErrorCode::ERRCODE_DUPLICATE_OBJECT,
            OutboxError::UndefinedFunction { .. } => PgSqlErrorCode::ERRCODE_UNDEFINED_FUNCTION,
            OutboxError::InsufficientPrivilege { .. } | OutboxError::DestinationRefused { .. } => {
                PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE
            }
        }
    }

    pub fn message(&self) -> String {
        match self {
            OutboxError::InvalidArgument {
                argument, message, ..
            } => format!("{argument}: {message}"),
            OutboxError::InvalidOption {
                option, message, ..
            } => {
                format!("channel option \"{option}\": {message}")
            }
            OutboxError::UnknownChannel { name } => format!("channel \"{name}\" does not exist"),
            OutboxError::DuplicateChannel { name } => format!("channel \"{name}\" already exists"),
            OutboxError::UndefinedFunction { name, message } => {
                format!("function {name}(jsonb, text): {message}")
            }
            OutboxError::InsufficientPrivilege { message, .. } => message.clone(),
            OutboxError::DestinationRefused {
                option, refusal, ..
            } => format!(
                "channel option \"{option}\": host {} is not allowed by outbox.allowed_hosts",
                refusal.host
            ),
            OutboxError::InvalidAllowedHosts(e) => {
                format!("invalid value for setting \"outbox.allowed_hosts\": {e}")
            }
        }
    }

    pub fn detail(&self) -> Option<String> {
        match self {
            OutboxError::InvalidOption { .. } => {
                Some("Options are validated as a whole; nothing was written.".to_string())
            }
            OutboxError::DestinationRefused {
                refusal,
                allowed_hosts,
                ..
            } => Some(format!(
                "{} outbox.allowed_hosts is currently \"{allowed_hosts}\".",
                refusal.explanation()
            )),
            _ => None,
        }
    }

    pub fn hint(&self) -> &'static str {
        match self {
            OutboxError::InvalidArgument { hint, .. } => hint,
            OutboxError::InvalidOption { hint, .. } => hint.unwrap_or(
                "The README lists every channel option with its type and default.",
            ),
            OutboxError::UnknownChannel { .. } => {
                "Create it with outbox.create_channel(name, endpoint, options); list them in outbox.channels."
            }
            OutboxError::DuplicateChannel { .. } => {
                "Change an existing channel with outbox.alter_channel(name, options)."
            }
            OutboxError::UndefinedFunction { .. } => {
                "A sql channel calls function(payload jsonb, effect_key text) RETURNS text; create it first."
            }
            OutboxError::InsufficientPrivilege { hint, .. } => hint,
            OutboxError::DestinationRefused { .. } => {
                "An administrator can add the host (or, for a link-local or metadata address, its IP or CIDR) to outbox.allowed_hosts: ALTER SYSTEM SET outbox.allowed_hosts = '...'; SELECT pg_reload_conf();"
            }
            OutboxError::InvalidAllowedHosts(_) => crate::allow_list::LIST_FORMS,
        }
    }

    /// Raises the error as a Postgres ERROR; the current transaction is aborted, so nothing
    /// the failing call began is left half-written.
    pub fn raise(self) -> ! {
        let mut report = ErrorReport::new(self.sqlstate(), self.message(), "outbox_delivery");
        if let Some(detail) = self.detail() {
            report = report.set_detail(detail);
        }
        report = report.set_hint(self.hint());
        report.report(PgLogLevel::ERROR);
        unreachable!("an ERROR report does not return")
    }
}

impl std::fmt::Display for OutboxError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message())
    }
}

/// Unwraps a result or raises its error.
pub trait OrRaise<T> {
    fn or_raise(self) -> T;
}

impl<T> OrRaise<T> for Result<T, OutboxError> {
    fn or_raise(self) -> T {
        match self {
            Ok(v) => v,
            Err(e) => e.raise(),
        }
    }
}

/// An SPI call failed in a way no input explains (a bug, not bad input): raise it as an
/// internal error rather than unwinding through Postgres.
pub fn spi_failure(e: pgrx::spi::Error) -> ! {
    ErrorReport::new(
        PgSqlErrorCode::ERRCODE_INTERNAL_ERROR,
        format!("outbox_delivery: SPI failure: {e}"),
        "outbox_delivery",
    )
    .report(PgLogLevel::ERROR);
    unreachable!("an ERROR report does not return")
}

/// The variable that decides whether `std::backtrace::Backtrace::capture` captures, before
/// `RUST_BACKTRACE` (which also decides how a panic is printed).
const LIBRARY_BACKTRACE_VARIABLE: &str = "RUST_LIB_BACKTRACE";

/// No Rust backtrace ever reaches a client. pgrx captures one whenever a Postgres error (a
/// cancel, a lock timeout, an SPI error) crosses Rust code and, when it was captured, writes
/// it into the error's DETAIL: with `RUST_BACKTRACE=1` in the server's environment, a cancel
/// inside `outbox.reconcile()` showed the caller the extension's frames. Captures are turned
/// off for the process (`RUST_LIB_BACKTRACE=0`, which `capture` reads before
/// `RUST_BACKTRACE` and caches at its first call), from `_PG_init`, before any error can
/// be raised through the extension and while the process has no thread of the extension.
pub fn keep_backtraces_from_clients() {
    std::env::set_var(LIBRARY_BACKTRACE_VARIABLE, "0");
}

/// The 5-character SQLSTATE of an error code, as PostgreSQL writes it.
pub fn sqlstate_text(code: PgSqlErrorCode) -> String {
    let code = code as isize as u32;
    (0..5)
        .map(|i| (((code >> (6 * i)) & 0x3F) as u8 + b'0') as char)
        .collect()
}

/// The SQLSTATE and message of an error caught with `PgTryBuilder` (a Rust panic is
/// XX000, as PostgreSQL reports it).
pub fn sqlstate_and_message(caught: &pgrx::pg_sys::panic::CaughtError) -> (String, String) {
    use pgrx::pg_sys::panic::CaughtError;
    match caught {
        CaughtError::PostgresError(r) | CaughtError::ErrorReport(r) => {
            (sqlstate_text(r.sql_error_code()), r.message().to_string())
        }
        CaughtError::RustPanic { ereport, .. } => {
            ("XX000".to_string(), ereport.message().to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlstates_are_written_as_postgresql_writes_them() {
        for (code, text) in [
            (PgSqlErrorCode::ERRCODE_T_R_DEADLOCK_DETECTED, "40P01"),
            (PgSqlErrorCode::ERRCODE_CHECK_VIOLATION, "23514"),
            (PgSqlErrorCode::ERRCODE_QUERY_CANCELED, "57014"),
            (PgSqlErrorCode::ERRCODE_INSUFFICIENT_PRIVILEGE, "42501"),
        ] {
            assert_eq!(sqlstate_text(code), text);
        }
    }
}
