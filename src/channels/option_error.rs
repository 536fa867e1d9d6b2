//! The error of a rejected channel option, shared by the options and by each option group
//! parsed in a module of its own (signing, tls, rate_limit, circuit, nats): they depend on
//! it, not on one another.

/// A rejected option, named by its path (e.g. `retry.base_ms`).
#[derive(Debug, Clone, PartialEq)]
pub struct OptionError {
    pub option: String,
    pub message: String,
    /// What to do instead, where it is more than "see the list of options".
    pub hint: Option<&'static str>,
}

impl OptionError {
    pub(crate) fn new(option: impl Into<String>, message: impl Into<String>) -> Self {
        OptionError {
            option: option.into(),
            message: message.into(),
            hint: None,
        }
    }

    pub(crate) fn with_hint(mut self, hint: &'static str) -> Self {
        self.hint = Some(hint);
        self
    }
}
