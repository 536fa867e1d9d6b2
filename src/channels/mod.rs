//! Channels: where messages go and how (options, the SQL to manage them, the HTTP transport).

pub mod admin;
pub mod http;
pub mod options;
pub mod sql;
