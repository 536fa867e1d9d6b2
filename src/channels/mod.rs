//! Channels: where messages go and how (options, the SQL to manage them, the destinations
//! they may reach, the HTTP transport).

pub mod admin;
pub mod circuit;
pub mod guard;
pub mod http;
pub mod json_pointer;
pub mod lookup;
pub mod lookup_url;
pub mod options;
pub mod rate_limit;
pub mod request;
pub mod secrets;
pub mod signing;
pub mod sql_effect;
pub mod tls;
