//! `--steady-seconds S` / `--steady-only S`: a steady load of `--steady-rate` messages a
//! second (1,000 by default) for S seconds with a retention of 15 s, and the size of every
//! table of the extension as it goes, to see that each stays flat. The load enqueues a
//! tenth of the rate every 100 ms, each tenth in one transaction, on a schedule (a tick
//! that runs late is followed by the next at once), and prints the rate it reached.
//!
//! Every table of the `outbox` schema is measured (with its indexes and TOAST; the ledger's
//! generations together, as `ledger`), every 10 s. A line of the main ones is printed every
//! 20 s (every minute in a load of more than 15 minutes). At the end, for each table: its
//! largest size in each sixth of the run, the ratio of the last sixth's to the second's
//! (the first sixth fills the tables up to their working size), and the rows written to it
//! during the run: inserted, updated (of them HOT), deleted one by one, and how many times
//! it was emptied whole (each `TRUNCATE` gives a table a new file). Retention must empty
//! the ledger whole, never delete its rows one by one. Figures only; nothing is asserted.

use super::alter_system;
use outbox_e2e::cluster::{unique, Cluster};
use outbox_e2e::sim::Simulator;
use postgres::Client;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Each table of the schema, a partition counted as its partitioned table: its size with
/// indexes and TOAST, the rows inserted, updated, HOT-updated and deleted since the
/// statistics began, and the file of each of its tables (`relfilenode`: a TRUNCATE gives a
/// new one), as "a,b,c" in the order of the tables' oids.
const TABLES: &str = "
SELECT coalesce(p.relname, c.relname)::text,
       sum(pg_catalog.pg_total_relation_size(c.oid))::int8,
       sum(coalesce(s.n_tup_ins, 0))::int8, sum(coalesce(s.n_tup_upd, 0))::int8,
       sum(coalesce(s.n_tup_hot_upd, 0))::int8, sum(coalesce(s.n_tup_del, 0))::int8,
       string_agg(pg_catalog.pg_relation_filenode(c.oid)::text, ',' ORDER BY c.oid)
  FROM pg_catalog.pg_class c
  JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace AND n.nspname = 'outbox'
  LEFT JOIN pg_catalog.pg_inherits i ON i.inhrelid = c.oid
  LEFT JOIN pg_catalog.pg_class p ON p.oid = i.inhparent
  LEFT JOIN pg_catalog.pg_stat_user_tables s ON s.relid = c.oid
 WHERE c.relkind = 'r'
 GROUP BY 1";

/// The tables named in the line printed as the load goes (the hot ones); every table is in
/// the report at the end.
const SHOWN: [(&str, &str); 4] = [
    ("_messages", "messages"),
    ("_claims", "claims"),
    ("_attempts", "attempts"),
    ("_ledger", "ledger"),
];

/// One reading of one table.
#[derive(Debug, Clone, Default)]
struct Reading {
    bytes: i64,
    inserted: i64,
    updated: i64,
    hot: i64,
    deleted: i64,
    files: String,
}

fn read_tables(c: &mut Client) -> BTreeMap<String, Reading> {
    c.query(TABLES, &[])
        .unwrap()
        .iter()
        .map(|r| {
            let reading = Reading {
                bytes: r.get(1),
                inserted: r.get(2),
                updated: r.get(3),
                hot: r.get(4),
                deleted: r.get(5),
                files: r.get::<_, Option<String>>(6).unwrap_or_default(),
            };
            (r.get(0), reading)
        })
        .collect()
}

/// One table over the run: its size at each reading, with the second of the run it was
/// read at, and how many times one of its files changed.
#[derive(Debug, Default)]
struct Track {
    sizes: Vec<(f64, i64)>,
    emptied: usize,
}

/// The largest size in each of `parts` equal stretches of `seconds` (None: no reading in it).
fn largest_by_stretch(sizes: &[(f64, i64)], seconds: f64, parts: usize) -> Vec<Option<i64>> {
    let mut out = vec![None; parts];
    for &(at, bytes) in sizes {
        let i = ((at / seconds * parts as f64) as usize).min(parts - 1);
        out[i] = Some(out[i].map_or(bytes, |b: i64| b.max(bytes)));
    }
    out
}

fn mb(bytes: i64) -> f64 {
    bytes as f64 / 1_048_576.0
}

/// The steady load of `rate` messages a second. Every channel's retry horizon is shortened
/// to 10 s, because the ledger keeps entries for at least the longest retry horizon of any
/// channel.
pub fn steady(cluster: &Cluster, sim: &Simulator, seconds: u64, rate: u64) {
    let per_tick = (rate / 10).max(1) as i64;
    let mut c = cluster.connect();
    c.batch_execute(
        "SELECT outbox.alter_channel(name, '{\"retry\": {\"max_age_ms\": 10000}}') FROM outbox._channels",
    )
    .unwrap();
    alter_system(&mut c, "outbox.retention", Some("15"));
    alter_system(&mut c, "outbox.ledger_retention", Some("15"));
    let ch = unique("bench_steady");
    c.execute(
        "SELECT outbox.create_channel($1, $2, '{\"max_in_flight\": 512, \"max_unverifiable_in_flight\": 512, \"retry\": {\"max_age_ms\": 10000}}'::jsonb)",
        &[&ch, &sim.send_url(&ch)],
    )
    .unwrap();
    let first = read_tables(&mut c);
    let mut last = first.clone();
    let mut tracks: BTreeMap<String, Track> = BTreeMap::new();
    let start = Instant::now();
    let print_every = Duration::from_secs(if seconds > 900 { 60 } else { 20 });
    let mut next_print = Duration::ZERO;
    let mut next_reading = Duration::ZERO;
    let mut n = 0i64;
    let mut ticks = 0u32;
    while start.elapsed() < Duration::from_secs(seconds) {
        if start.elapsed() >= next_reading {
            let at = start.elapsed().as_secs_f64();
            let now = read_tables(&mut c);
            for (name, r) in &now {
                let track = tracks.entry(name.clone()).or_default();
                track.sizes.push((at, r.bytes));
                if last.get(name).is_some_and(|l| l.files != r.files) {
                    track.emptied += 1;
                }
            }
            if start.elapsed() >= next_print {
                let shown: Vec<String> = SHOWN
                    .iter()
                    .map(|(table, label)| {
                        let bytes = now.get(*table).map_or(0, |r| r.bytes);
                        format!("{label} {:.1} MB", mb(bytes))
                    })
                    .collect();
                let others: i64 = now
                    .iter()
                    .filter(|(name, _)| !SHOWN.iter().any(|(t, _)| t == name))
                    .map(|(_, r)| r.bytes)
                    .sum();
                println!(
                    "steady_sizes_at_{:>4}s {}, the other tables {:.1} MB ({n} enqueued)",
                    start.elapsed().as_secs(),
                    shown.join(", "),
                    mb(others)
                );
                next_print += print_every;
            }
            last = now;
            next_reading += Duration::from_secs(10);
        }
        c.execute(
            "SELECT outbox.enqueue($1, '{\"steady\": true}'::jsonb, $2 || ':' || g) FROM generate_series(1, $3::int8) g",
            &[&ch, &format!("{ch}-{n}"), &per_tick],
        )
        .unwrap();
        n += per_tick;
        // A generation emptied and refilled within 10 s would be missed by the readings:
        // the ledger's files are looked at every 100 ms.
        let ledger_files = ledger_files(&mut c);
        if let (Some(l), Some(track)) = (last.get_mut("_ledger"), tracks.get_mut("_ledger")) {
            if l.files != ledger_files {
                track.emptied += 1;
                l.files = ledger_files;
            }
        }
        ticks += 1;
        let next_tick = start + Duration::from_millis(100) * ticks;
        std::thread::sleep(next_tick.saturating_duration_since(Instant::now()));
    }
    let end = read_tables(&mut c);
    println!(
        "steady_end {n} enqueued in {seconds} s: {:.0} msg/s (asked {rate})",
        n as f64 / start.elapsed().as_secs_f64()
    );
    println!(
        "steady_table: largest size (MB, with indexes) in each sixth of the run | last sixth / second | rows during the run: inserted, updated (HOT), deleted one by one | emptied whole"
    );
    for (name, r) in &end {
        let before = first.get(name).cloned().unwrap_or_default();
        let track = tracks.remove(name).unwrap_or_default();
        let stretches = largest_by_stretch(&track.sizes, seconds as f64, 6);
        let shown: Vec<String> = stretches
            .iter()
            .map(|b| b.map_or("-".into(), |b| format!("{:.1}", mb(b))))
            .collect();
        let ratio = match (stretches[1], stretches[5]) {
            // Below 1 MB, a page or two more reads as growth: no ratio.
            (Some(second), Some(last)) if second >= 1_048_576 => {
                format!("{:.2}", last as f64 / second as f64)
            }
            _ => "-".into(),
        };
        println!(
            "steady_table {name} {} | {ratio} | {} ins, {} upd ({} HOT), {} del | {}",
            shown.join(" · "),
            r.inserted - before.inserted,
            r.updated - before.updated,
            r.hot - before.hot,
            r.deleted - before.deleted,
            track.emptied
        );
    }
    let ledger_deleted =
        end.get("_ledger").map_or(0, |r| r.deleted) - first.get("_ledger").map_or(0, |r| r.deleted);
    println!("steady_ledger_rows_deleted_one_by_one {ledger_deleted}");
    alter_system(&mut c, "outbox.retention", None);
    alter_system(&mut c, "outbox.ledger_retention", None);
}

/// The files of the ledger's generations, as [`TABLES`] gives them.
fn ledger_files(c: &mut Client) -> String {
    c.query_one(
        "SELECT string_agg(pg_catalog.pg_relation_filenode(relid)::text, ',' ORDER BY relid)
           FROM pg_catalog.pg_partition_tree('outbox._ledger') WHERE isleaf",
        &[],
    )
    .unwrap()
    .get(0)
}

#[cfg(test)]
mod tests {
    use super::largest_by_stretch;

    #[test]
    fn each_stretch_keeps_its_largest_reading_and_an_empty_one_is_none() {
        let sizes = [(0.0, 5), (10.0, 9), (20.0, 7), (55.0, 3), (59.9, 4)];
        assert_eq!(
            largest_by_stretch(&sizes, 60.0, 6),
            vec![Some(5), Some(9), Some(7), None, None, Some(4)]
        );
    }

    #[test]
    fn a_reading_at_the_very_end_counts_in_the_last_stretch() {
        assert_eq!(
            largest_by_stretch(&[(60.0, 1)], 60.0, 3),
            vec![None, None, Some(1)]
        );
    }
}
