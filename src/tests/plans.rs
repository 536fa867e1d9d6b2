// `#[pg_test]`s of the worker's statements as the worker plans them (`spi::statement`):
// at a backlog, every scan of the message table is bounded by a condition. A statement
// planned once is planned for any values, and a plan that reads the whole message table
// to meet a batch costs more with every message queued.

/// Calls `visit` on every node of `plan` (EXPLAIN's JSON), its plan nodes and their fields.
fn each_node(plan: &serde_json::Value, visit: &mut dyn FnMut(&serde_json::Map<String, serde_json::Value>)) {
    if let Some(node) = plan.as_object() {
        visit(node);
        for child in node.values() {
            each_node(child, visit);
        }
    } else if let Some(items) = plan.as_array() {
        for item in items {
            each_node(item, visit);
        }
    }
}

/// Scans of the message table in `plan` (EXPLAIN's JSON) that no condition bounds.
fn unbounded_message_scans(plan: &serde_json::Value, found: &mut Vec<String>) {
    each_node(plan, &mut |node| {
        if node.get("Relation Name").and_then(|r| r.as_str()) == Some("_messages") {
            let kind = node["Node Type"].as_str().unwrap_or("?");
            let index = node.get("Index Name").and_then(|i| i.as_str()).unwrap_or("");
            let bounded = match kind {
                "Tid Scan" => node.contains_key("TID Cond"),
                "Index Scan" | "Index Only Scan" => node.contains_key("Index Cond"),
                // Its bitmap index scan below carries the condition (checked there); an
                // UPDATE's target is written, not scanned.
                "Bitmap Heap Scan" | "ModifyTable" => true,
                _ => false,
            };
            if !bounded {
                found.push(format!("{kind} {index}"));
            }
        }
        // (The current generation of the ledger is read from a table of at most three rows
        // through its partial index of the one current row.)
        if node.get("Node Type").and_then(|t| t.as_str()) == Some("Bitmap Index Scan")
            && !node.contains_key("Index Cond")
            && node.get("Index Name").and_then(|i| i.as_str()) != Some("_ledger_generations_current_idx")
        {
            found.push(format!("Bitmap Index Scan {}", node["Index Name"]));
        }
    });
}

/// Scans of the partial index of queued messages in `plan`: a statement that names its
/// messages by id must reach each by the primary key. From that index the plan would read
/// every queued message of a channel (its whole backlog, the messages in flight among them)
/// and compare each with the whole array of ids.
fn due_index_scans(plan: &serde_json::Value, found: &mut Vec<String>) {
    each_node(plan, &mut |node| {
        if node.get("Index Name").and_then(|i| i.as_str()) == Some("_messages_due_idx") {
            found.push(format!("{} {}", node["Node Type"], node.get("Filter").unwrap_or(&serde_json::Value::Null)));
        }
    });
}

/// EXPLAIN of `statement` as the worker plans it, for the arguments `args` (SQL text, of
/// the parameter types `types`; both empty for a statement without parameters).
fn worker_plan(statement: &crate::spi::Statement, types: &str, args: &str) -> serde_json::Value {
    plan_as_worker(statement.sql, statement.plan, types, args)
}

/// EXPLAIN of `sql` planned as the worker plans a statement of `plan`.
fn plan_as_worker(sql: &str, plan: crate::spi::Plan, types: &str, args: &str) -> serde_json::Value {
    let mode = plan.plan_cache_mode().to_str().unwrap();
    let parenthesized = |s: &str| if s.is_empty() { String::new() } else { format!("({s})") };
    Spi::run(&format!("SET LOCAL plan_cache_mode = {mode}")).unwrap();
    Spi::run("SET LOCAL enable_seqscan = off").unwrap();
    Spi::run(&format!("PREPARE worker_statement{} AS {}", parenthesized(types), sql)).unwrap();
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
    // Statistics taken while nothing was in flight (a backlog analyzed before its drain
    // starts), then again with 310 in flight.
    Spi::run("ANALYZE outbox._messages").unwrap();
    Spi::run("ANALYZE outbox._channels").unwrap();
    Spi::run(
        "INSERT INTO outbox._claims (channel_id, lease_owner, worker_pid, lease_until, started_at, message_ids)
         SELECT channel_id, 0, 1, now() + interval '1 minute', now(), array_agg(id)
           FROM outbox._messages WHERE id % 200 = 0 GROUP BY channel_id",
    )
    .unwrap();
    for analyzed_in_flight in [false, true] {
        if analyzed_in_flight {
            Spi::run("ANALYZE outbox._messages").unwrap();
            // The claims as the workers' own VACUUM leaves them: a few rows.
            Spi::run("ANALYZE outbox._claims").unwrap();
        }
        check_worker_statements();
    }
}

/// Every statement of the worker that reads the message table, planned as the worker
/// plans it: no unbounded scan, and a statement that names its messages reaches them by
/// their primary key.
fn check_worker_statements() {
    let statements = [
        (
            &crate::worker::claim::CLAIM_DUE,
            "int4, float8, int4, int4, int4[], int8[], int8[], int4[], int4[], int4[], int4[], text[], int4[], text[], int4[]",
            "200, 60000, 0, 1, '{1}', '{0}', '{1}', '{2}', '{5}', '{1,2,3}', '{1}', '{default}', '{2}', '{default}', '{0}'",
        ),
        (
            &crate::worker::due_channels::DUE_CHANNELS,
            "int8, int8, int4[], int8[], int8[], int8",
            "-2147483649, 2147483647, '{1}', '{0}', '{1}', 200",
        ),
        (&crate::worker::claim::NEXT_DUE, "", ""),
        // The sweep's search for lost leases, with a lease of its own slot to take back.
        (&crate::worker::recovery::FIND_LOST_LEASES, "bool, int4, int8, int8", "true, 0, 10, 0"),
        (&crate::worker::recovery::PRUNE_LOST_CLAIMS, "bool, int4, int8", "true, 0, 0"),
        (
            &crate::ledger::RECORD_SENT,
            "int8[], int4[], text[], int4[], text[], bool[], int8[], bool[]",
            "'{1,2}', '{1,1}', '{NULL,NULL}', '{200,200}', '{delivered,delivered}', '{f,f}', '{NULL,NULL}', '{t,f}'",
        ),
        (
            &crate::worker::record::RECORD_LATE_DELIVERED_ATTEMPTS,
            "int8[], int4[], text[], int4[], text[], int8[]",
            "'{1,2}', '{1,1}', '{NULL,NULL}', '{200,200}', '{delivered,delivered}', '{NULL,NULL}'",
        ),
        (&crate::worker::record::LOCK_EFFECT_MESSAGES, "int8[]", "'{1,2,3}'"),
        (
            &crate::worker::record::RECORD_SETTLED,
            "int8[], int4[], text[], int8[], text[], text[], int4[], int8[], text[], bool[], int8[], int4[], int8[], text",
            "'{1}', '{1}', '{queued}', '{0}', '{transient}', '{e}', '{500}', '{NULL}', '{transient}', '{f}', '{NULL}', '{NULL}', '{NULL}', NULL",
        ),
    ];
    for (statement, types, args) in statements {
        let plan = worker_plan(statement, types, args);
        let mut unbounded = Vec::new();
        unbounded_message_scans(&plan, &mut unbounded);
        let head: String = statement.sql.trim().chars().take(40).collect();
        assert!(unbounded.is_empty(), "{head}…: unbounded scans of the message table {unbounded:?}\n{plan:#}");
        // Every statement here but the claim and the next due time names its messages.
        if !std::ptr::eq(statement, &crate::worker::claim::CLAIM_DUE)
            && !std::ptr::eq(statement, &crate::worker::claim::NEXT_DUE)
            && !std::ptr::eq(statement, &crate::worker::due_channels::DUE_CHANNELS)
        {
            let mut queued = Vec::new();
            due_index_scans(&plan, &mut queued);
            assert!(queued.is_empty(), "{head}…: messages named by id read from the index of queued messages {queued:?}\n{plan:#}");
        }
    }

    // The statement of outbox._record_delivered, as its function plans it inside the
    // worker's record (under the settings of the worker's kept statement that calls it).
    let recorded = ledger_record_statement();
    let plan = plan_as_worker(
        &recorded,
        crate::spi::Plan::Once,
        "int8[], text[], int4[], text, bool",
        "'{1,2}', '{NULL,NULL}', '{200,200}', 'worker', false",
    );
    let mut unbounded = Vec::new();
    unbounded_message_scans(&plan, &mut unbounded);
    assert!(unbounded.is_empty(), "outbox._record_delivered: unbounded scans of the message table {unbounded:?}\n{plan:#}");
    let mut queued = Vec::new();
    due_index_scans(&plan, &mut queued);
    assert!(queued.is_empty(), "outbox._record_delivered: messages named by id read from the index of queued messages {queued:?}\n{plan:#}");
}

/// The query of `outbox._record_delivered` (its `RETURN QUERY`), with its arguments as
/// parameters `$1` … `$5`.
fn ledger_record_statement() -> String {
    let body = Spi::get_one::<String>("SELECT prosrc FROM pg_proc WHERE oid = 'outbox._record_delivered'::regproc")
        .unwrap()
        .expect("outbox._record_delivered exists");
    let query = body
        .split_once("RETURN QUERY")
        .and_then(|(_, rest)| rest.rsplit_once(';'))
        .map(|(query, _)| query.to_string())
        .expect("a RETURN QUERY statement");
    let mut sql = query;
    for (n, name) in ["message_ids", "external_ids", "http_statuses", "recorder", "leave_sending"].iter().enumerate() {
        sql = replace_word(&sql, name, &format!("${}", n + 1));
    }
    sql
}

/// `text` with `name` replaced by `with` where it stands as a whole word, not a column of a
/// table named before it (`w.message_ids`).
fn replace_word(text: &str, name: &str, with: &str) -> String {
    let is_word = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '.';
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find(name) {
        let before = rest[..at].chars().next_back();
        let after = rest[at + name.len()..].chars().next();
        out.push_str(&rest[..at]);
        match before.is_some_and(is_word) || after.is_some_and(is_word) {
            true => out.push_str(name),
            false => out.push_str(with),
        }
        rest = &rest[at + name.len()..];
    }
    out.push_str(rest);
    out
}

/// The next due time the worker reads after a claim that came back empty
/// (`claim::NEXT_DUE`), in ms since the epoch.
fn next_due_ms() -> i64 {
    Spi::get_one::<i64>(crate::worker::claim::NEXT_DUE.sql)
        .unwrap()
        .expect("a next due time")
}

/// Milliseconds since the epoch of `expression`, read in this transaction.
fn epoch_ms(expression: &str) -> i64 {
    Spi::get_one::<i64>(&format!("SELECT (extract(epoch FROM {expression}) * 1000)::int8"))
        .unwrap()
        .expect("a time")
}

/// Puts the message of effect key `key` in flight: a claim of its own.
fn claim(key: &str) {
    Spi::run(&format!(
        "INSERT INTO outbox._claims (channel_id, lease_owner, worker_pid, lease_until, started_at, message_ids)
         SELECT channel_id, 0, 1, now() + interval '1 minute', now(), ARRAY[id]
           FROM outbox._messages WHERE effect_key = '{key}'"
    ))
    .unwrap();
}

#[pg_test]
fn a_channel_at_its_bound_is_due_now_and_one_with_room_when_its_first_message_is() {
    Spi::run("SELECT outbox.create_channel('due_bound', 'http://127.0.0.1:9/x', '{\"idempotency_header\": \"Idempotency-Key\", \"max_in_flight\": 2}')").unwrap();
    Spi::run(
        "SELECT count(outbox.enqueue('due_bound', '{\"n\": 1}', 'b' || g, NULL, now() + interval '1 hour'))
           FROM generate_series(1, 3) g",
    )
    .unwrap();
    assert_eq!(next_due_ms(), epoch_ms("now() + interval '1 hour'"), "room: its earliest message");
    claim("b1");
    assert_eq!(next_due_ms(), epoch_ms("now() + interval '1 hour'"), "one of two in flight: still room");
    claim("b2");
    assert_eq!(next_due_ms(), epoch_ms("now()"), "at its bound: due now, until a record makes room");
    Spi::run("SELECT outbox.pause_channel('due_bound', 'paused channels wait')").unwrap();
    assert_eq!(next_due_ms(), epoch_ms("now() + interval '1 day'"), "a paused channel is not due");
}

/// Scans of the message table that ran in `plan` (EXPLAIN ANALYZE's JSON): their node and
/// index, and how often.
fn message_scans_run(plan: &serde_json::Value, found: &mut Vec<String>) {
    each_node(plan, &mut |node| {
        let loops = node.get("Actual Loops").and_then(|l| l.as_i64()).unwrap_or(0);
        // The walk's descents from channel to channel (`channel_id > …`) step past a
        // channel's queue; they read none of it.
        let walk = node.get("Index Cond").and_then(|c| c.as_str()).is_some_and(|c| c.contains("(channel_id > "));
        if node.get("Relation Name").and_then(|r| r.as_str()) == Some("_messages")
            && node["Node Type"] != "ModifyTable"
            && loops > 0
            && !walk
        {
            let index = node.get("Index Name").and_then(|i| i.as_str()).unwrap_or("");
            found.push(format!("{} {index} ({loops} loops)", node["Node Type"]));
        }
    });
}

/// EXPLAIN ANALYZE of a claim of 200 planned as the worker plans it, from the heads of
/// every channel (no cursor, no flow control caps), and of the walk that finds the channels
/// it reads (`due_channels`).
fn analyzed_claim_plans() -> [serde_json::Value; 2] {
    let channels = Spi::get_one::<String>("SELECT coalesce(array_agg(id), '{}')::text FROM outbox._channels")
        .unwrap()
        .unwrap_or_default();
    [
        analyzed_plan(
            &crate::worker::claim::CLAIM_DUE,
            "int4, float8, int4, int4, int4[], int8[], int8[], int4[], int4[], int4[], int4[], text[], int4[], text[], int4[]",
            &format!("200, 60000, 0, 1, '{{}}', '{{}}', '{{}}', '{{}}', '{{}}', '{channels}', '{{}}', '{{}}', '{{}}', '{{}}', '{{}}'"),
        ),
        analyzed_plan(
            &crate::worker::due_channels::DUE_CHANNELS,
            "int8, int8, int4[], int8[], int8[], int8",
            "-2147483649, 2147483647, '{}', '{}', '{}', 200",
        ),
    ]
}

fn analyzed_plan(statement: &crate::spi::Statement, types: &str, args: &str) -> serde_json::Value {
    let mode = statement.plan.plan_cache_mode().to_str().unwrap();
    Spi::run(&format!("SET LOCAL plan_cache_mode = {mode}")).unwrap();
    Spi::run(&format!("PREPARE claim_statement({types}) AS {}", statement.sql)).unwrap();
    let plan = Spi::get_one::<pgrx::Json>(&format!("EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE claim_statement({args})"))
        .unwrap()
        .expect("a plan")
        .0;
    Spi::run("DEALLOCATE claim_statement").unwrap();
    plan
}

#[pg_test]
fn a_claim_reads_nothing_of_the_queue_of_a_channel_at_its_bound() {
    // A channel with a backlog and as many messages in flight as its bound allows, and
    // statistics that make its due messages look cheap to reach: the claim, from the
    // head of every channel (no cursor), must rule the channel out by its room before it
    // looks at its queue, which a drain leaves full of dead entries until a VACUUM.
    Spi::run("SELECT outbox.create_channel('bound_full', 'http://127.0.0.1:9/x', '{\"max_in_flight\": 5, \"max_unverifiable_in_flight\": 5}')").unwrap();
    Spi::run("SELECT count(outbox.enqueue('bound_full', '{\"n\": 1}', 'f' || g)) FROM generate_series(1, 5000) g").unwrap();
    Spi::run("ANALYZE outbox._messages").unwrap();
    Spi::run(
        "INSERT INTO outbox._claims (channel_id, lease_owner, worker_pid, lease_until, started_at, message_ids)
         SELECT channel_id, 0, 1, now() + interval '1 minute', now(), (array_agg(id ORDER BY id))[1:5]
           FROM outbox._messages GROUP BY channel_id",
    )
    .unwrap();
    Spi::run("ANALYZE outbox._claims").unwrap();
    for plan in analyzed_claim_plans() {
        let mut run = Vec::new();
        message_scans_run(&plan, &mut run);
        assert!(run.is_empty(), "the claim read the queue of a channel without room: {run:?}\n{plan:#}");
    }
}

/// Rows read from the materialized messages in flight (`flying`) by the CTE scans of
/// `plan` (EXPLAIN ANALYZE's JSON): those each scan returned and those its filter removed,
/// times its loops.
fn flying_rows_read(plan: &serde_json::Value) -> f64 {
    let mut read = 0.0;
    each_node(plan, &mut |node| {
        if node.get("Node Type").and_then(|t| t.as_str()) == Some("CTE Scan")
            && node.get("CTE Name").and_then(|n| n.as_str()) == Some("flying")
        {
            let field = |name: &str| node.get(name).and_then(|v| v.as_f64()).unwrap_or(0.0);
            read += (field("Actual Rows") + field("Rows Removed by Filter")) * field("Actual Loops");
        }
    });
    read
}

#[pg_test]
fn a_claim_reads_the_messages_in_flight_a_few_times_whatever_the_number_of_channels() {
    // Forty channels with a backlog each and ten messages of each in flight: the claim counts
    // each channel's room from one count of them all, not from a scan of them all for
    // each channel (16,000 rows read here before).
    for i in 0..40 {
        Spi::run(&format!("SELECT outbox.create_channel('flying_{i}', 'http://127.0.0.1:9/x/{i}')")).unwrap();
    }
    Spi::run("SELECT count(outbox.enqueue('flying_' || (g % 40), '{\"n\": 1}', 'fl' || g)) FROM generate_series(1, 4000) g").unwrap();
    Spi::run(
        "INSERT INTO outbox._claims (channel_id, lease_owner, worker_pid, lease_until, started_at, message_ids)
         SELECT channel_id, 0, 1, now() + interval '1 minute', now(), (array_agg(id ORDER BY id))[1:10]
           FROM outbox._messages GROUP BY channel_id",
    )
    .unwrap();
    Spi::run("ANALYZE outbox._messages").unwrap();
    Spi::run("ANALYZE outbox._claims").unwrap();
    let in_flight = Spi::get_one::<i64>("SELECT sum(cardinality(message_ids)) FROM outbox._claims").unwrap().unwrap();
    assert_eq!(in_flight, 400);
    Spi::run("SET LOCAL enable_seqscan = off").unwrap();
    for plan in analyzed_claim_plans() {
        let read = flying_rows_read(&plan);
        assert!(
            read <= 4.0 * in_flight as f64,
            "the claim read {read} rows of the {in_flight} messages in flight\n{plan:#}"
        );
    }
}
