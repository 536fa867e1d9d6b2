//! End-to-end test support for the `outbox_delivery` extension.
//!
//! - [`sim`]: the provider simulator, a real HTTP/1.1 server on loopback that plays the
//!   "external provider" the extension's background worker delivers to. The end-to-end
//!   tests script its behaviour per channel (accept, fail, hang, drop the connection,
//!   dedupe by idempotency key) and inspect what it received; the `provider-sim` binary
//!   runs it standalone for the demo.
//! - [`cluster`]: the real PostgreSQL cluster started by `scripts/cluster.sh`.
//! - [`costs`]: what a piece of work cost: CPU of processes, WAL, growth of the tables.
//! - [`helpers`]: what the tests share besides the cluster: enqueue, count, wait for a
//!   state, error text, roles, server-wide settings and fault points reset on drop.
//! - [`releases`]: packages, released versions built from their commits, private copies of
//!   PostgreSQL to install them into, and clusters on those copies.
//! - [`pooler`]: PgBouncer in transaction mode in front of the cluster, as applications reach it.
//! - [`test_ca`], [`tls_front`]: certificates made at test time and HTTPS in front of the
//!   simulator (a private CA, mutual TLS).
//! - [`webhook_verify`]: a receiver's check of Standard Webhooks signatures.
//! - [`handwritten`]: the outbox an application writes by hand, the delivery benchmark's
//!   baseline; [`cli`]: the benchmark programs' command lines.
//! - [`schema_dump`]: the extension's schema as comparable text (fresh install vs upgrade).

pub mod cli;
pub mod cluster;
pub mod costs;
pub mod handwritten;
pub mod helpers;
pub mod nats;
pub mod pooler;
pub mod releases;
pub mod schema_dump;
pub mod sim;
pub mod test_ca;
pub mod tls_front;
pub mod webhook_verify;
