//! Channels: where messages go and how (options, the SQL to manage them, the destinations
//! they may reach, the HTTP transport).

pub mod admin;
pub mod guard;
pub mod http;
pub mod options;
pub mod secrets;
pub mod sql;
