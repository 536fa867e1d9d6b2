// `#[pg_test]`s of the worker's statements as the worker plans them (`worker::prepared`):
// at a backlog, every scan of the message table is bounded by a condition. A statement
// planned once is planned for any values, and a plan that reads the whole message table
// to meet a batch costs more with every message queued.

/// Scans of the message table in `plan` (EXPLAIN's JSON) that no condition bounds.
fn unbounded_message_scans(plan: &serde_json::Value, found: &mut Vec<String>) {
    if let Some(node) = plan.as_object() {
        if node.get("Relation Name").and_then(|r| r.as_str()) == Some("_messages") {
            let kind = node["Node Type"].as_str().unwrap_or("?");
            let index = node.get("Index Name").and_then(|i| i.as_str()).unwrap_or("");
            let bounded = match kind {
                "Tid Scan" => node.contains_key("TID Cond"),
                "Index Scan" | "Index Only Scan" => {
                    // The partial index of in-flight messages holds at most the batches
                    // being sent (and the leases a crash left), whatever the backlog.
                    node.contains_key("Index Cond") || index == "_messages_sending_idx"
                }
                // Its bitmap index scan below carries the condition (checked there); an
                // UPDATE's target is written, not scanned.
                "Bitmap Heap Scan" | "ModifyTable" => true,
                _ => false,
            };
            if !bounded {
                found.push(format!("{kind} {index}"));
            }
        }
        if node.get("Node Type").and_then(|t| t.as_str()) == Some("Bitmap Index Scan")
            && !node.contains_key("Index Cond")
        {
            found.push(format!("Bitmap Index Scan {}", node["Index Name"]));
        }
        for child in node.values() {
            unbounded_message_scans(child, found);
        }
    } else if let Some(items) = plan.as_array() {
        for item in items {
            unbounded_message_scans(item, found);
        }
    }
}

/// EXPLAIN of `statement` as the worker plans it, for the arguments `args` (SQL text, of
/// the parameter types `types`; both empty for a statement without parameters).
fn worker_plan(statement: &crate::worker::prepared::Statement, types: &str, args: &str) -> serde_json::Value {
    let mode = statement.plan.plan_cache_mode().to_str().unwrap();
    let parenthesized = |s: &str| if s.is_empty() { String::new() } else { format!("({s})") };
    Spi::run(&format!("SET LOCAL plan_cache_mode = {mode}")).unwrap();
    Spi::run("SET LOCAL enable_seqscan = off").unwrap();
    Spi::run(&format!("PREPARE worker_statement{} AS {}", parenthesized(types), statement.sql)).unwrap();
    let plan = Spi::get_one::<pgrx::Json>(&format!("EXPLAIN (FORMAT JSON) EXECUTE worker_statement{}", parenthesized(args)))
        .unwrap()
        .expect("a plan");
    Spi::run("DEALLOCATE worker_statement").unwrap();
    plan.0
}

#[pg_test]
fn the_worker_plans_bounded_scans_of_the_message_table_at_a_backlog() {
    // Many channels, and a backlog of 60,000 on one of them and a few on another, as in a
    // large drain: the planner then expects each channel to have a large share of it.
    for i in 0..150 {
        Spi::run(&format!("SELECT outbox.create_channel('plan_{i}', 'http://127.0.0.1:9/x/{i}', '{{\"max_in_flight\": 1000}}')")).unwrap();
    }
    Spi::run("SELECT count(outbox.enqueue('plan_0', '{\"n\": 1}', 'k' || g)) FROM generate_series(1, 60000) g").unwrap();
    Spi::run("SELECT count(outbox.enqueue('plan_1', '{\"n\": 1}', 'o' || g)) FROM generate_series(1, 2000) g").unwrap();
    Spi::run("UPDATE outbox._messages SET state = 'sending', lease_until = now() + interval '1 minute', attempts = 1 WHERE id % 200 = 0").unwrap();
    Spi::run("ANALYZE outbox._messages").unwrap();
    Spi::run("ANALYZE outbox._channels").unwrap();

    let statements = [
        (&crate::worker::claim::CLAIM_DUE, "int4, float8, int4, int4, int4[], int8[], int8[]", "200, 60000, 0, 1, '{1}', '{0}', '{1}'"),
        (&crate::worker::claim::NEXT_DUE, "", ""),
        (
            &crate::worker::record::RECORD_DELIVERED,
            "int8[], int8[], text[], int4[], text[]",
            "'{1,2}', '{1,2}', '{NULL,NULL}', '{200,200}', '{delivered,delivered}'",
        ),
        (&crate::worker::record::LOCK_EFFECT_MESSAGES, "int8[]", "'{1,2,3}'"),
        (
            &crate::worker::record::RECORD_SETTLED,
            "int8[], int8[], int4[], text[], int8[], text[], text[], int4[], int8[], text[]",
            "'{1}', '{1}', '{1}', '{queued}', '{0}', '{transient}', '{e}', '{500}', '{NULL}', '{transient}'",
        ),
    ];
    for (statement, types, args) in statements {
        let plan = worker_plan(statement, types, args);
        let mut unbounded = Vec::new();
        unbounded_message_scans(&plan, &mut unbounded);
        let head: String = statement.sql.trim().chars().take(40).collect();
        assert!(unbounded.is_empty(), "{head}…: unbounded scans of the message table {unbounded:?}\n{plan:#}");
    }
}
