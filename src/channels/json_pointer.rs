//! Values a channel reads out of JSON by pointer (RFC 6901): the external id in a
//! provider's answer, `{payload:/ptr}` in a lookup URL. Pure Rust.

/// A string, number or boolean at `pointer` in a JSON body. The body may be cut short
/// (`max_response_bytes`): the document is walked from its start along the pointer and the
/// walk stops at the value, so an id that comes before the cut is found.
pub fn body_pointer(body: &[u8], pointer: &str) -> Option<String> {
    let path: Vec<String> = match pointer {
        "" => Vec::new(),
        p => p
            .strip_prefix('/')?
            .split('/')
            .map(|t| t.replace("~1", "/").replace("~0", "~"))
            .collect(),
    };
    let found = std::cell::RefCell::new(None);
    let mut reader = serde_json::Deserializer::from_slice(body);
    // The walk ends with an error once it has the value (or at the cut); what it found
    // before that is the answer.
    let _ = serde::de::DeserializeSeed::deserialize(
        pointer_walk::Walk {
            path: &path,
            found: &found,
        },
        &mut reader,
    );
    match found.into_inner()? {
        serde_json::Value::String(s) => Some(s),
        // A number at the cut may go on past it ("12" of "123"): it counts only in a body
        // read whole. Strings and booleans end in themselves.
        serde_json::Value::Number(n) => serde_json::from_slice::<serde::de::IgnoredAny>(body)
            .is_ok()
            .then(|| n.to_string()),
        serde_json::Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

/// Follows a JSON pointer through a document as it is read, without reading past the value.
mod pointer_walk {
    use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
    use std::cell::RefCell;
    use std::fmt;

    pub struct Walk<'a> {
        pub path: &'a [String],
        pub found: &'a RefCell<Option<serde_json::Value>>,
    }

    /// The error that ends the walk once the value is found.
    const DONE: &str = "found";

    impl<'de> DeserializeSeed<'de> for Walk<'_> {
        type Value = ();

        fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
            if self.path.is_empty() {
                let value = <serde_json::Value as de::Deserialize>::deserialize(d)?;
                *self.found.borrow_mut() = Some(value);
                return Err(de::Error::custom(DONE));
            }
            d.deserialize_any(self)
        }
    }

    impl<'de> Visitor<'de> for Walk<'_> {
        type Value = ();

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a JSON document")
        }

        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
            while let Some(key) = map.next_key::<String>()? {
                if key == self.path[0] {
                    return map.next_value_seed(Walk {
                        path: &self.path[1..],
                        found: self.found,
                    });
                }
                map.next_value::<IgnoredAny>()?;
            }
            Ok(())
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
            let Ok(index) = self.path[0].parse::<usize>() else {
                return Ok(());
            };
            for _ in 0..index {
                if seq.next_element::<IgnoredAny>()?.is_none() {
                    return Ok(());
                }
            }
            seq.next_element_seed(Walk {
                path: &self.path[1..],
                found: self.found,
            })
            .map(|_| ())
        }

        // A scalar where the path goes on: nothing there.
        fn visit_bool<E>(self, _: bool) -> Result<(), E> {
            Ok(())
        }
        fn visit_i64<E>(self, _: i64) -> Result<(), E> {
            Ok(())
        }
        fn visit_u64<E>(self, _: u64) -> Result<(), E> {
            Ok(())
        }
        fn visit_f64<E>(self, _: f64) -> Result<(), E> {
            Ok(())
        }
        fn visit_str<E>(self, _: &str) -> Result<(), E> {
            Ok(())
        }
        fn visit_unit<E>(self) -> Result<(), E> {
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pointers() {
        assert_eq!(body_pointer(br#"{"id":"m-1"}"#, "/id"), Some("m-1".into()));
        assert_eq!(
            body_pointer(br#"{"data":{"id":42}}"#, "/data/id"),
            Some("42".into())
        );
        assert_eq!(body_pointer(br#"{"id":null}"#, "/id"), None);
        assert_eq!(body_pointer(b"not json", "/id"), None);
        assert_eq!(body_pointer(br#"{"ok":true}"#, "/ok"), Some("true".into()));
        assert_eq!(
            body_pointer(br#"{"a":[{"x":1},{"id":"second"}]}"#, "/a/1/id"),
            Some("second".into())
        );
        assert_eq!(body_pointer(br#"{"a":[1]}"#, "/a/5"), None);
        assert_eq!(
            body_pointer(br#"{"a/b":{"~c":"esc"}}"#, "/a~1b/~0c"),
            Some("esc".into())
        );
        assert_eq!(
            body_pointer(br#"{"id":{"deep":1}}"#, "/id"),
            None,
            "not a scalar"
        );
        assert_eq!(
            body_pointer(br#"{"pad":"x","id":"late"}"#, "/id"),
            Some("late".into())
        );
        assert_eq!(body_pointer(br#""top""#, ""), Some("top".into()));
        assert_eq!(
            body_pointer(br#"{"id":"m-1"}"#, "id"),
            None,
            "not a pointer"
        );
    }

    #[test]
    fn pointers_reach_values_before_a_cut() {
        let body = br#"{"id":"m-7","status":"accepted","pad":"xxxxxxxxxxxxxxxxxxxxxxxx"#;
        assert_eq!(body_pointer(body, "/id"), Some("m-7".into()));
        assert_eq!(body_pointer(body, "/status"), Some("accepted".into()));
        assert_eq!(body_pointer(body, "/pad"), None, "cut inside the value");
        assert_eq!(body_pointer(body, "/later"), None, "past the cut");
        assert_eq!(body_pointer(br#"{"id":"m-"#, "/id"), None);
        assert_eq!(
            body_pointer(br#"{"n":12"#, "/n"),
            None,
            "a number cut short may be longer"
        );
    }
}
