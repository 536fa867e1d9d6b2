//! outbox_delivery: durable, visible, recoverable delivery of side effects from a
//! PostgreSQL transaction. This file only wires the parts together.

use pgrx::prelude::*;

pub mod allow_list;
pub mod channels;
pub mod classify;
pub mod clock;
pub mod config_cache;
pub mod effect_key;
pub mod error;
pub mod gucs;
pub mod identity;
pub mod ledger;
pub mod metrics;
pub mod outbox;
pub mod pg_timeout;
pub mod random;
pub mod reconcile;
pub mod retry_policy;
pub mod runtime;
pub mod served_database;
pub mod spi;
pub mod tenancy;
pub mod worker;
pub mod worker_locks;
pub mod worker_slots;

::pgrx::pg_module_magic!();

extension_sql_file!("../sql/schema.sql", name = "schema", bootstrap);
extension_sql_file!(
    "../sql/tenancy.sql",
    name = "tenancy",
    requires = [
        "schema",
        _caller_oid,
        _caller_name,
        _caller_is_superuser,
        _effect_tenant,
        _check_tenant_name
    ]
);
extension_sql_file!(
    "../sql/channels.sql",
    name = "channels",
    requires = ["schema"]
);
extension_sql_file!("../sql/ledger.sql", name = "ledger", requires = ["schema"]);
extension_sql_file!(
    "../sql/views.sql",
    name = "views",
    requires = [
        "tenancy",
        "channels",
        _masked_url,
        _masked_options,
        _provider_key
    ]
);
extension_sql_file!(
    "../sql/operator.sql",
    name = "operator",
    requires = ["views", "ledger"]
);
extension_sql_file!(
    "../sql/observability.sql",
    name = "observability",
    requires = ["operator", worker_status, _database_served]
);
extension_sql_file!(
    "../sql/api.sql",
    name = "api",
    requires = [
        "observability",
        _wake_at_commit,
        create_channel,
        alter_channel
    ]
);
extension_sql_file!("../sql/privileges.sql", name = "privileges", finalize);

#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    error::keep_backtraces_from_clients();
    gucs::init();
    worker::register();
    metrics::register();
}

#[cfg(any(test, feature = "pg_test"))]
#[pg_schema]
mod tests {
    include!("tests/sql_api.rs");
    include!("tests/operator.rs");
    include!("tests/observability.rs");
    include!("tests/tenancy.rs");
    include!("tests/plans.rs");
    include!("tests/claims.rs");
    include!("tests/times.rs");
}

/// Required by `cargo pgrx test`.
#[cfg(test)]
pub mod pg_test {
    pub fn setup(_options: Vec<&str>) {}

    pub fn postgresql_conf_options() -> Vec<&'static str> {
        vec![]
    }
}
