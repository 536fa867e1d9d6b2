//! Channels: where messages go and how. `options` (and `nats::target`) parse and validate a
//! channel's options; `admin` is the SQL to manage channels; `crate::allow_list` holds every
//! destination to `outbox.allowed_hosts`; `remote` is the `Channel` trait that the HTTP
//! (`http`, `request`, `lookup`) and NATS JetStream (the folder `nats`: `subject`, `target`,
//! `window`) transports implement;
//! `sql_effect` runs a `sql` channel's function in the record transaction; `pool_budget`
//! bounds the idle HTTP connections a worker keeps across its channels, `connection_slots`
//! the requests it sends to one channel at once.

pub mod admin;
pub mod answer_excerpt;
pub mod answer_rules;
pub mod circuit;
pub mod connection_slots;
pub mod effect_bound;
pub mod fence;
pub mod http;
pub mod json_pointer;
pub mod lookup;
pub mod lookup_url;
pub mod nats;
pub mod option_error;
pub mod options;
pub mod pool_budget;
pub mod rate_limit;
pub mod remote;
pub mod request;
pub mod secrets;
pub mod signing;
pub mod sql_effect;
pub mod tls;
pub mod wire;
