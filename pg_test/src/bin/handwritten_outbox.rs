//! The hand-written outbox worker, the baseline of the delivery benchmark
//! (`outbox_e2e::handwritten`, `bench --anchors`): one application process that drains
//! `handwritten.outbox` to a provider over HTTP, as a reader would write it by hand.
//!
//! Each of `--loops` loops (one connection each, tokio-postgres) repeats: BEGIN; claim up
//! to `--batch` pending rows with `FOR UPDATE SKIP LOCKED`; POST every payload to `--url`
//! (reqwest, keep-alive connections, up to `--in-flight` requests at once per loop); mark
//! the accepted rows sent and the others failed once; COMMIT. A loop ends when a claim
//! finds nothing. Prints `handwritten_drain N messages in S s`.
//!
//! ```text
//! handwritten-outbox --conninfo CONNINFO --url URL [--batch 200] [--in-flight 64] [--loops 1]
//! ```

use outbox_e2e::cli::{num_arg, text_arg};
use outbox_e2e::handwritten::{partition, Outcome, CLAIM, MARK_FAILED, MARK_SENT, MAX_ATTEMPTS};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_postgres::{Client, NoTls};

/// POSTs each claimed row's payload, at most `in_flight` at once; the outcome of each.
async fn post_all(
    http: &reqwest::Client,
    url: &str,
    rows: Vec<(i64, String)>,
    in_flight: &Arc<Semaphore>,
) -> Vec<Outcome> {
    let mut tasks = JoinSet::new();
    for (id, payload) in rows {
        let (http, url, in_flight) = (http.clone(), url.to_string(), in_flight.clone());
        tasks.spawn(async move {
            let _permit = in_flight.acquire_owned().await.expect("semaphore");
            let answer = http
                .post(&url)
                .header("Content-Type", "application/json")
                .body(payload)
                .send()
                .await;
            let result = match answer {
                // The body is read so that the connection goes back to the pool.
                Ok(r) if r.status().is_success() => {
                    r.bytes().await.map(|_| ()).map_err(|e| e.to_string())
                }
                Ok(r) => Err(format!("HTTP {}", r.status())),
                Err(e) => Err(e.to_string()),
            };
            (id, result)
        });
    }
    let mut outcomes = Vec::new();
    while let Some(done) = tasks.join_next().await {
        outcomes.push(done.expect("a POST task"));
    }
    outcomes
}

/// One loop on a connection of its own: claims, sends and marks until a claim is empty.
/// Returns the rows it marked sent.
async fn drain_loop(
    conninfo: String,
    url: String,
    http: reqwest::Client,
    batch: i64,
    in_flight: usize,
) -> Result<u64, tokio_postgres::Error> {
    let (mut client, connection) = tokio_postgres::connect(&conninfo, NoTls).await?;
    tokio::spawn(connection);
    let in_flight = Arc::new(Semaphore::new(in_flight));
    let mut sent_total = 0;
    loop {
        let (sent, claimed) = one_batch(&mut client, &http, &url, batch, &in_flight).await?;
        if claimed == 0 {
            return Ok(sent_total);
        }
        sent_total += sent;
    }
}

/// One transaction: claim, POST, mark, commit. Returns (rows sent, rows claimed).
async fn one_batch(
    client: &mut Client,
    http: &reqwest::Client,
    url: &str,
    batch: i64,
    in_flight: &Arc<Semaphore>,
) -> Result<(u64, usize), tokio_postgres::Error> {
    let tx = client.transaction().await?;
    let rows: Vec<(i64, String)> = tx
        .query(CLAIM, &[&batch])
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let claimed = rows.len();
    if claimed == 0 {
        tx.commit().await?;
        return Ok((0, 0));
    }
    let (sent, failed) = partition(post_all(http, url, rows, in_flight).await);
    tx.execute(MARK_SENT, &[&sent]).await?;
    for (id, error) in &failed {
        tx.execute(MARK_FAILED, &[id, error, &MAX_ATTEMPTS]).await?;
    }
    tx.commit().await?;
    Ok((sent.len() as u64, claimed))
}

fn main() {
    let conninfo = text_arg("--conninfo").expect("--conninfo 'host=... port=... dbname=...'");
    let url = text_arg("--url").expect("--url http://host:port/path");
    let batch = num_arg("--batch", 200) as i64;
    let in_flight = num_arg("--in-flight", 64);
    let loops = num_arg("--loops", 1).max(1);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    // One pool of keep-alive connections for the process, as an application keeps one client.
    let http = reqwest::Client::new();
    let start = Instant::now();
    let sent: u64 = runtime.block_on(async {
        let mut set = JoinSet::new();
        for _ in 0..loops {
            set.spawn(drain_loop(
                conninfo.clone(),
                url.clone(),
                http.clone(),
                batch,
                in_flight,
            ));
        }
        let mut sent = 0;
        while let Some(done) = set.join_next().await {
            sent += done.expect("a loop").expect("the database");
        }
        sent
    });
    let secs = start.elapsed().as_secs_f64();
    println!("handwritten_drain {sent} messages in {secs:.3} s ({loops} loop(s), batches of {batch}, {in_flight} in flight per loop)");
}
