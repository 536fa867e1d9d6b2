//! The effect key: a stable name for one side effect, derived from the originating request
//! and the operation, never from an attempt.
//!
//! `key = hex(SHA-256(len(source) ‖ source ‖ len(operation) ‖ operation))`, where each
//! length is the UTF-8 byte length as a big-endian u64. The length prefixes make the
//! encoding unambiguous: ("a|b", "c") and ("a", "b|c") are different effects.

use crate::error::{OrRaise, OutboxError};
use pgrx::prelude::*;
use sha2::{Digest, Sha256};

/// Pure derivation; both parts must be non-empty.
pub fn derive(source: &str, operation: &str) -> Result<String, OutboxError> {
    if source.is_empty() {
        return Err(empty_part("source"));
    }
    if operation.is_empty() {
        return Err(empty_part("operation"));
    }
    let mut hasher = Sha256::new();
    for part in [source, operation] {
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part.as_bytes());
    }
    Ok(hex(&hasher.finalize()))
}

fn empty_part(argument: &'static str) -> OutboxError {
    OutboxError::invalid_argument(
        argument,
        "must not be NULL or empty",
        "Use the id of the originating request (e.g. the assistant turn) and a name for the operation.",
    )
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(DIGITS[(b >> 4) as usize] as char);
        out.push(DIGITS[(b & 0x0f) as usize] as char);
    }
    out
}

/// `outbox.effect_key(source, operation)`: the stable key of one side effect.
#[pg_extern(immutable, parallel_safe)]
fn effect_key(source: Option<&str>, operation: Option<&str>) -> String {
    let source = source.ok_or_else(|| empty_part("source")).or_raise();
    let operation = operation.ok_or_else(|| empty_part("operation")).or_raise();
    derive(source, operation).or_raise()
}

extension_sql!(
    r#"COMMENT ON FUNCTION outbox.effect_key(text, text) IS
    'Stable key of one side effect: hex SHA-256 over the length-prefixed source (request id) and operation. NULL or empty part: error 22023.';"#,
    name = "effect_key_comment",
    requires = [effect_key]
);

/// The effect key as providers see it (idempotency and reference headers, reconcile URLs,
/// the argument of a sql channel's function). Keys are unique per tenant, and a channel may
/// be shared by tenants whose provider dedupes by key across all of them: outside the
/// default tenant the key is qualified, unambiguously (length-prefixed), by its tenant, so
/// that one tenant's key can never make a provider drop another tenant's effect. A
/// default-tenant key that itself starts like a qualified one (digits, then a colon) is
/// qualified too, so that no two (tenant, key) pairs ever give the same text.
pub fn for_provider<'a>(tenant: &str, effect_key: &'a str) -> std::borrow::Cow<'a, str> {
    if goes_as_it_is(tenant, effect_key) {
        std::borrow::Cow::Borrowed(effect_key)
    } else {
        std::borrow::Cow::Owned(qualified(tenant, effect_key))
    }
}

/// [`for_provider`] of a key the caller owns: the key itself when it goes as it is.
pub fn into_provider(tenant: &str, effect_key: String) -> String {
    if goes_as_it_is(tenant, &effect_key) {
        effect_key
    } else {
        qualified(tenant, &effect_key)
    }
}

fn goes_as_it_is(tenant: &str, effect_key: &str) -> bool {
    tenant == "default" && !looks_qualified(effect_key)
}

fn qualified(tenant: &str, effect_key: &str) -> String {
    format!("{}:{tenant}:{effect_key}", tenant.len())
}

/// Whether `key` starts with one or more ASCII digits and then a colon, as a qualified key
/// does (the length of its tenant in bytes).
fn looks_qualified(key: &str) -> bool {
    let digits = key.bytes().take_while(u8::is_ascii_digit).count();
    digits > 0 && key.as_bytes().get(digits) == Some(&b':')
}

/// `outbox._provider_key(tenant, effect_key)`: [`for_provider`], for the views (every row
/// they show) and the worker's rarer statements. The claim returns the stored key and the
/// worker qualifies it ([`into_provider`]). The SQL definition's regular expression cost
/// 0.53 µs a row (BENCHMARKS.md).
#[pg_extern(immutable, strict, parallel_safe)]
fn _provider_key(tenant: &str, effect_key: &str) -> String {
    for_provider(tenant, effect_key).into_owned()
}

extension_sql!(
    r#"COMMENT ON FUNCTION outbox._provider_key(text, text) IS
    'The effect key a provider receives: the key itself in tenant default (unless it starts with digits and a colon), else <bytes of tenant>:<tenant>:<key>.';"#,
    name = "provider_key_comment",
    requires = [_provider_key]
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_vector() {
        assert_eq!(
            derive("turn-42", "send_reply").unwrap(),
            "b19a783b1ddf6318099a5f26d19af2c6961ab378d598b5248db3c16b721d07f1"
        );
    }

    #[test]
    fn separator_inside_a_part_does_not_collide() {
        let a = derive("a|b", "c").unwrap();
        let b = derive("a", "b|c").unwrap();
        assert_ne!(a, b);
        assert_eq!(
            a,
            "06f4aee86c37742da9a45a4e0e291c7391ad9de261c419c45114c93931de4d44"
        );
        assert_eq!(
            b,
            "e0c567de1f2966dd0548a60b602d44e00132ba102d8b1fd0c88b685448ba0e34"
        );
    }

    #[test]
    fn swapping_parts_changes_the_key() {
        assert_ne!(derive("x", "y").unwrap(), derive("y", "x").unwrap());
    }

    #[test]
    fn stable_and_hex() {
        let k = derive("req-1", "create_task").unwrap();
        assert_eq!(k, derive("req-1", "create_task").unwrap());
        assert_eq!(k.len(), 64);
        assert!(k
            .bytes()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
    }

    #[test]
    fn empty_parts_are_refused() {
        assert!(matches!(
            derive("", "op"),
            Err(OutboxError::InvalidArgument {
                argument: "source",
                ..
            })
        ));
        assert!(matches!(
            derive("src", ""),
            Err(OutboxError::InvalidArgument {
                argument: "operation",
                ..
            })
        ));
    }

    #[test]
    fn unicode_parts() {
        let k = derive("ход-7", "отправить ответ").unwrap();
        assert_eq!(k.len(), 64);
        assert_ne!(k, derive("ход-7", "отправить  ответ").unwrap());
    }

    /// The SQL definition the function replaced: `CASE WHEN tenant = 'default' AND
    /// effect_key !~ '^[0-9]+:' THEN effect_key ELSE octet_length(tenant)::text || ':' ||
    /// tenant || ':' || effect_key END`, with the expression spelled out character by
    /// character.
    fn as_sql_had_it(tenant: &str, key: &str) -> String {
        let mut chars = key.chars().peekable();
        let mut digits = 0;
        while chars.peek().is_some_and(|c| c.is_ascii_digit()) {
            chars.next();
            digits += 1;
        }
        let qualified_looking = digits >= 1 && chars.next() == Some(':');
        if tenant == "default" && !qualified_looking {
            key.to_string()
        } else {
            format!("{}:{}:{}", tenant.len(), tenant, key)
        }
    }

    /// Every key of up to four characters from digits, a colon, a letter and a non-ASCII
    /// digit, in the default tenant and in others: the same text as the SQL definition, and
    /// no two (tenant, key) pairs give the same provider key.
    #[test]
    fn provider_keys_as_sql_had_them_and_never_shared() {
        let alphabet = ['0', '7', ':', 'a', '٣'];
        let mut keys = vec![String::new()];
        let mut last = vec![String::new()];
        for _ in 0..4 {
            last = last
                .iter()
                .flat_map(|k| alphabet.iter().map(move |c| format!("{k}{c}")))
                .collect();
            keys.extend(last.iter().cloned());
        }
        let tenants = ["default", "acme", "7", "", "défaut", "default:"];
        let mut seen = std::collections::HashMap::new();
        for tenant in tenants {
            for key in &keys {
                let got = for_provider(tenant, key);
                assert_eq!(got, as_sql_had_it(tenant, key), "{tenant:?} {key:?}");
                assert_eq!(into_provider(tenant, key.clone()), got);
                if let Some(other) = seen.insert(got.to_string(), (tenant, key.clone())) {
                    panic!("{tenant:?} {key:?} and {other:?} give the same provider key");
                }
            }
        }
    }

    #[test]
    fn provider_keys_borrow_the_plain_default_key() {
        assert!(matches!(
            for_provider("default", "order-7"),
            std::borrow::Cow::Borrowed("order-7")
        ));
        assert_eq!(for_provider("default", "12:x"), "7:default:12:x");
        assert_eq!(for_provider("default", "12x:"), "12x:");
        assert_eq!(for_provider("acme", "k"), "4:acme:k");
        assert_eq!(for_provider("ä", "k"), "2:ä:k");
    }
}
