//! End-to-end tests of webhook-grade HTTP channels, against the real cluster
//! (`scripts/cluster.sh`, located by `OUTBOX_BASE` / `OUTBOX_PGPORT`), the real delivery
//! workers and the provider simulator:
//!
//! 1. `signing`: Standard Webhooks signatures checked by an independent receiver
//!    (`outbox_e2e::webhook_verify`, its own HMAC) on every attempt, with rotating secrets;
//!    malformed secrets refused with 22023; secrets masked in every view.
//!
//! Run: `cargo test -p outbox_e2e --release --test webhooks -- --test-threads=1`.

mod signing;
