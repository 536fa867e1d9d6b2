//! What of a channel is secret, and how it is shown: static header values, signing secrets,
//! the private key of a TLS client certificate, and the
//! userinfo, query values and fragment of its URLs (the endpoint and the reconcile URL), where
//! providers put API keys (`https://user:pass@…`, `…/hook?api_key=…`).
//!
//! Everything a role other than the table's owner can read goes through here: the
//! `outbox.channels` view, the operator log of channel changes, the error texts recorded in
//! `attempts.error` and `messages.last_error`, and the messages of refused options. Pure
//! text work; the SQL wrappers at the end are what the views call.

use pgrx::prelude::*;
use serde_json::Value;

/// What a secret is shown as.
pub const MASK: &str = "********";

/// An option's value as the message that refuses it for its shape quotes it: its JSON type
/// and size, never its content. A value of the wrong shape may still be a secret (a bearer
/// token inside a headers array, a NATS token written as a plain string), and the text of an
/// error reaches the client and the server's log.
pub fn shape(v: &Value) -> String {
    match v {
        Value::Null => "null".to_string(),
        Value::Bool(_) => "a boolean".to_string(),
        Value::Number(_) => "a number".to_string(),
        Value::String(s) => format!("a string of {}", counted(s.chars().count(), "character")),
        Value::Array(a) => format!("an array of {}", counted(a.len(), "element")),
        Value::Object(o) => format!("an object of {}", counted(o.len(), "key")),
    }
}

fn counted(n: usize, what: &str) -> String {
    if n == 1 {
        format!("1 {what}")
    } else {
        format!("{n} {what}s")
    }
}

/// A number as it is (the value of a count or a duration is no secret), anything else by
/// its [`shape`].
pub fn number_or_shape(v: &Value) -> String {
    if v.is_number() {
        v.to_string()
    } else {
        shape(v)
    }
}

/// `url` with its userinfo, every query value and its fragment masked. Works on the text as
/// written (valid or not, template placeholders kept as they are), so that a URL that failed
/// to parse is masked too. A query value that is a single placeholder (`{effect_key}`) is a
/// template, not a secret, and stays.
pub fn mask_url(url: &str) -> String {
    let (before_fragment, fragment) = match url.split_once('#') {
        Some((b, f)) => (b, Some(f)),
        None => (url, None),
    };
    let (before_query, query) = match before_fragment.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (before_fragment, None),
    };
    let mut out = mask_userinfo(before_query);
    if let Some(query) = query {
        out.push('?');
        let parts: Vec<String> = query.split('&').map(mask_query_part).collect();
        out.push_str(&parts.join("&"));
    }
    if let Some(fragment) = fragment {
        out.push('#');
        if !fragment.is_empty() {
            out.push_str(MASK);
        }
    }
    out
}

/// `scheme://userinfo@host…` → `scheme://********@host…`.
fn mask_userinfo(s: &str) -> String {
    let (scheme, rest) = match s.find("://") {
        Some(i) => (&s[..i + 3], &s[i + 3..]),
        None => match s.find(':') {
            // scheme:userinfo@host (no slashes) is still userinfo to a lenient parser.
            Some(i) => (&s[..i + 1], &s[i + 1..]),
            None => ("", s),
        },
    };
    let authority_end = rest.find(['/', '\\']).unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => format!("{scheme}{MASK}{}", &rest[at..]),
        None => s.to_string(),
    }
}

fn is_placeholder(v: &str) -> bool {
    v.len() > 2 && v.starts_with('{') && v.ends_with('}') && !v[1..v.len() - 1].contains(['{', '}'])
}

fn mask_query_part(part: &str) -> String {
    match part.split_once('=') {
        Some((_, value)) if value.is_empty() || is_placeholder(value) => part.to_string(),
        Some((name, _)) => format!("{name}={MASK}"),
        // A bare token (`?SECRET`) may be the key itself.
        None if part.is_empty() || is_placeholder(part) => part.to_string(),
        None => MASK.to_string(),
    }
}

/// `text` with every occurrence of `url` replaced by its masked form (an error text that
/// quotes the URL it was sending to).
pub fn mask_url_in(text: &str, url: &str) -> String {
    if url.is_empty() {
        return text.to_string();
    }
    let masked = mask_url(url);
    if masked == url {
        return text.to_string();
    }
    text.replace(url, &masked)
}

/// A channel's options as shown to anyone but the owner of its table: header values
/// masked, the reconcile URL masked, a `nats` channel's token and password masked.
pub fn mask_options(options: &Value) -> Value {
    let mut v = options.clone();
    if let Some(Value::Object(auth)) = v.get_mut("auth") {
        for key in ["token", "password"] {
            if let Some(value) = auth.get_mut(key) {
                *value = Value::String(MASK.into());
            }
        }
    }
    if let Some(Value::Object(h)) = v.get_mut("headers") {
        for value in h.values_mut() {
            *value = Value::String(MASK.into());
        }
    }
    if let Some(Value::String(url)) = v.get_mut("reconcile").and_then(|r| r.get_mut("url")) {
        *url = mask_url(url);
    }
    if let Some(Value::Array(secrets)) = v.get_mut("signing").and_then(|s| s.get_mut("secrets")) {
        for secret in secrets.iter_mut() {
            *secret = Value::String(MASK.into());
        }
    }
    if let Some(key @ Value::String(_)) = v.get_mut("tls").and_then(|t| t.get_mut("client_key_pem"))
    {
        *key = Value::String(MASK.into());
    }
    v
}

/// The endpoint as `outbox.channels` shows it.
#[pg_extern(immutable, parallel_safe, strict)]
fn _masked_url(url: &str) -> String {
    mask_url(url)
}

/// The options as `outbox.channels` shows them; options that cannot be read as JSON here
/// ([`masked_options_text`]) are shown as one mask.
#[pg_extern(immutable, parallel_safe, strict)]
fn _masked_options(options: JsonbText) -> pgrx::JsonB {
    pgrx::JsonB(masked_options_text(&options.0))
}

/// [`mask_options`] of a jsonb's text. A value the JSON reader refuses (nested deeper than
/// 128 levels, or a number out of its range such as `1e400`; `create_channel` and
/// `alter_channel` refuse such options, but a row can be changed by hand, and any reader
/// of the view may call this) is masked whole: nothing of it is shown, and reading the
/// view does not fail.
pub fn masked_options_text(text: &str) -> Value {
    serde_json::from_str::<Value>(text).map_or_else(
        |_| Value::String(MASK.into()),
        |options| mask_options(&options),
    )
}

/// A jsonb argument as its text (`jsonb_out`), not yet parsed: pgrx's `JsonB` parses it on
/// the way in, and fails with XX000 on a value its reader refuses.
struct JsonbText(String);

impl FromDatum for JsonbText {
    unsafe fn from_polymorphic_datum(
        datum: pg_sys::Datum,
        is_null: bool,
        _: pg_sys::Oid,
    ) -> Option<JsonbText> {
        if is_null {
            return None;
        }
        // jsonb_out detoasts its argument and returns a C string palloc'd in the current
        // memory context, freed here once copied (as pgrx's JsonB does). The database's
        // encoding is UTF-8, which pgrx requires.
        let text = unsafe {
            pgrx::direct_function_call::<&core::ffi::CStr>(pg_sys::jsonb_out, &[Some(datum)])
        }?;
        let owned = text.to_string_lossy().into_owned();
        unsafe { pg_sys::pfree(text.as_ptr() as *mut core::ffi::c_void) };
        Some(JsonbText(owned))
    }
}

// SAFETY: the value is read with FromDatum above, from a jsonb argument (the SQL type the
// mapping below declares), and never returned.
unsafe impl<'fcx> pgrx::callconv::ArgAbi<'fcx> for JsonbText {
    unsafe fn unbox_arg_unchecked(arg: pgrx::callconv::Arg<'_, 'fcx>) -> Self {
        let index = arg.index();
        unsafe { arg.unbox_arg_using_from_datum() }
            .unwrap_or_else(|| panic!("argument {index} must not be null"))
    }

    unsafe fn unbox_nullable_arg(
        arg: pgrx::callconv::Arg<'_, 'fcx>,
    ) -> pgrx::nullable::Nullable<Self> {
        unsafe { arg.unbox_arg_using_from_datum() }.into()
    }
}

pgrx::impl_sql_translatable!(JsonbText, arg_only = "jsonb");

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn options_too_deep_to_read_are_masked_whole() {
        let deep = format!("{}\"SECRET\"{}", "[".repeat(300), "]".repeat(300));
        assert_eq!(masked_options_text(&deep), json!(MASK));
        assert_eq!(masked_options_text("not json"), json!(MASK));
        assert_eq!(masked_options_text(r#"{"n": 1e400}"#), json!(MASK));
        assert_eq!(
            masked_options_text(r#"{"headers": {"A": "SECRET"}, "n": 1}"#),
            json!({"headers": {"A": MASK}, "n": 1})
        );
    }

    #[test]
    fn nats_credentials_are_masked() {
        let masked =
            mask_options(&json!({"kind": "nats", "auth": {"user": "u", "password": "SECRET"}}));
        assert_eq!(masked["auth"], json!({"user": "u", "password": MASK}));
        let masked = mask_options(&json!({"kind": "nats", "auth": {"token": "SECRET"}}));
        assert_eq!(masked["auth"], json!({"token": MASK}));
        assert_eq!(mask_options(&json!({"auth": null}))["auth"], json!(null));
    }

    #[test]
    fn urls_lose_userinfo_query_values_and_fragments() {
        let cases = [
            ("http://h/hook", "http://h/hook"),
            (
                "http://h/hook?api_key=SECRET",
                "http://h/hook?api_key=********",
            ),
            (
                "https://u:SECRET@h:8443/p?a=1&b=SECRET&c=#frag",
                "https://********@h:8443/p?a=********&b=********&c=#********",
            ),
            ("https://SECRET@h/", "https://********@h/"),
            ("http://h/p?SECRET", "http://h/p?********"),
            ("http://h/p?", "http://h/p?"),
            (
                "http://h/m/{effect_key}?key={effect_key}&token=SECRET",
                "http://h/m/{effect_key}?key={effect_key}&token=********",
            ),
            ("http://h/p?x={a}{b}", "http://h/p?x=********"),
            // Not a valid URL (a bad port) still loses its secrets.
            (
                "http://u:SECRET@h:99999/p?k=SECRET",
                "http://********@h:99999/p?k=********",
            ),
            ("h/p?k=SECRET", "h/p?k=********"),
            // An @ after the path is not userinfo.
            ("http://h/a@b", "http://h/a@b"),
            ("http://a@b@h/", "http://********@h/"),
        ];
        for (url, masked) in cases {
            assert_eq!(mask_url(url), masked, "{url}");
            assert!(!mask_url(url).contains("SECRET"), "{url}");
        }
    }

    #[test]
    fn error_texts_quoting_a_url_are_masked() {
        let url = "http://127.0.0.1:9/hook?api_key=SECRET";
        let text = format!("error sending request for url ({url}): connection refused");
        assert_eq!(
            mask_url_in(&text, url),
            "error sending request for url (http://127.0.0.1:9/hook?api_key=********): connection refused"
        );
        assert_eq!(mask_url_in("no url here", url), "no url here");
        assert_eq!(mask_url_in("x", ""), "x");
    }

    #[test]
    fn options_lose_header_values_and_reconcile_url_secrets() {
        let options = json!({
            "headers": {"Authorization": "Bearer SECRET", "X-A": "SECRET"},
            "reconcile": {"url": "http://h/m/{effect_key}?token=SECRET", "method": "GET"},
            "max_in_flight": 3
        });
        let masked = mask_options(&options);
        assert!(!masked.to_string().contains("SECRET"), "{masked}");
        assert_eq!(masked["headers"]["Authorization"], "********");
        assert_eq!(
            masked["reconcile"]["url"],
            "http://h/m/{effect_key}?token=********"
        );
        assert_eq!(masked["max_in_flight"], 3);
        let options = json!({
            "signing": {"scheme": "standard-webhooks", "secrets": ["whsec_SECRET1", "whsec_SECRET2"]},
            "tls": {"ca_pem": "-----BEGIN CERTIFICATE-----", "client_key_pem": "SECRET"}
        });
        let masked = mask_options(&options);
        assert!(!masked.to_string().contains("SECRET"), "{masked}");
        assert_eq!(
            masked["signing"]["secrets"],
            json!(["********", "********"])
        );
        assert_eq!(masked["signing"]["scheme"], "standard-webhooks");
        assert_eq!(masked["tls"]["ca_pem"], "-----BEGIN CERTIFICATE-----");
        assert_eq!(
            mask_options(&json!({"kind": "sql"})),
            json!({"kind": "sql"})
        );
    }
}
