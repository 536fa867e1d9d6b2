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
}
