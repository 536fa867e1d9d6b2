//! End-to-end tests of webhook-grade HTTP channels, against the real cluster
//! (`scripts/cluster.sh`, located by `OUTBOX_BASE` / `OUTBOX_PGPORT`), the real delivery
//! workers and the provider simulator:
//!
//! 1. `signing`: Standard Webhooks signatures checked by an independent receiver
//!    (`outbox_e2e::webhook_verify`, its own HMAC) on every attempt, with rotating secrets;
//!    malformed secrets refused with 22023; secrets masked in every view.
//! 2. `tls`: HTTPS with a test CA made at test time (`outbox_e2e::test_ca`) in front of the
//!    simulator (`outbox_e2e::tls_front`): a private CA, an unknown CA, a wrong host name,
//!    mutual TLS without and with a client certificate, invalid PEM.
//! 3. `circuit`: a provider down for 30 s, probes, the views, a manual pause, the backlog.
//! 4. `rate_limit`: 600 messages at 100/s over two workers; a channel-wide Retry-After.
//! 5. `/metrics`: `outbox.metrics_address` scraped by a real Prometheus; one scrape of a
//!    server serving four databases (two served, one without the extension, one dropped);
//!    the alert rules checked by promtool; every expression of the Grafana dashboard
//!    (docs/grafana-dashboard.json) evaluated by Prometheus, with data.
//!
//! Run: `cargo test -p outbox_e2e --release --test webhooks -- --test-threads=1`.

mod circuit;
mod metrics;
mod rate_limit;
mod signing;
mod tls;
