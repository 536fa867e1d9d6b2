//! One shop turn per request, through PgBouncer in `pool_mode = transaction`: the order (the
//! business write) and its confirmation (`outbox.enqueue`) commit in one transaction, or
//! neither does.
//!
//! What transaction pooling asks of an application, and how this one answers:
//! - the tenant is named inside each transaction with `SET LOCAL outbox.tenant`, never with
//!   a session-level `SET` (the next client of the same server connection would inherit it);
//! - no named prepared statements: every statement goes through `query_typed`, an unnamed
//!   statement sent with its parameters in one round trip (PgBouncer 1.18 does not carry
//!   named statements from one server connection to another);
//! - a serialization failure (40001) runs the whole turn again: the effect key derives from
//!   the request id, so a retried or re-run turn finds its message instead of making another.
//!
//! Usage: `shop_turns --dsn DSN --tenant T --channel CH --run ID [--clients N] [--turns N]`.
//! Prints one JSON line: the tenant, turns, retries and the message id of every request.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio_postgres::error::SqlState;
use tokio_postgres::types::Type;
use tokio_postgres::{Client, IsolationLevel, NoTls};

/// How often one turn is tried before the client gives up.
const MAX_ATTEMPTS: u32 = 50;

/// The order: written once per request, and the one stock row of the tenant's item counts
/// it (the hot row that concurrent turns of a tenant contend on).
const PLACE_ORDER: &str = "INSERT INTO shop.orders (tenant, request_id, item, client)
                           VALUES ($1, $2, 'widget', 'rust') ON CONFLICT DO NOTHING RETURNING true";
const COUNT_SALE: &str =
    "UPDATE shop.stock SET sold = sold + 1 WHERE tenant = $1 AND item = 'widget'";
/// The confirmation, keyed by the request: the same request always gives the same key.
const ENQUEUE_CONFIRMATION: &str = "SELECT outbox.enqueue($1,
        jsonb_build_object('tenant', $2::text, 'request_id', $3::text, 'client', 'rust'),
        outbox.effect_key($3, 'order_confirmation'))";

struct Args {
    dsn: String,
    tenant: String,
    channel: String,
    run: String,
    clients: usize,
    turns: usize,
}

fn parse_args() -> Result<Args, String> {
    let mut named = BTreeMap::new();
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let name = flag
            .strip_prefix("--")
            .ok_or(format!("unexpected {flag}"))?;
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        named.insert(name.to_string(), value);
    }
    let mut take = |k: &str| named.remove(k).ok_or(format!("--{k} is required"));
    let number = |v: String| v.parse::<usize>().map_err(|e| format!("{v}: {e}"));
    Ok(Args {
        dsn: take("dsn")?,
        tenant: take("tenant")?,
        channel: take("channel")?,
        run: take("run")?,
        clients: number(take("clients").unwrap_or_else(|_| "4".into()))?,
        turns: number(take("turns").unwrap_or_else(|_| "10".into()))?,
    })
}

/// A string literal for `SET LOCAL`, which takes no parameters (standard_conforming_strings
/// is on, so only the quote is doubled).
fn literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

/// A JSON string.
fn json_string(s: &str) -> String {
    let mut out = String::from("\"");
    for ch in s.chars() {
        match ch {
            '"' | '\\' => {
                out.push('\\');
                out.push(ch);
            }
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The whole of an error, as psql would show it: for an error the server sent, its severity,
/// message and SQLSTATE, then its DETAIL, HINT and CONTEXT where it has them; for any other
/// error (connecting, authentication, a closed connection), the error and each of its
/// causes. (`Display` of a server error says only "db error".)
fn describe(e: &tokio_postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        let mut text = format!(
            "{}: {} (SQLSTATE {})",
            db.severity(),
            db.message(),
            db.code().code()
        );
        for (label, field) in [
            ("DETAIL", db.detail()),
            ("HINT", db.hint()),
            ("CONTEXT", db.where_()),
        ] {
            if let Some(value) = field {
                text.push_str(&format!("\n{label}:  {value}"));
            }
        }
        return text;
    }
    let mut text = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        text.push_str(&format!(": {c}"));
        cause = c.source();
    }
    text
}

/// One try of a turn: its transaction, committed. Returns the message id.
async fn try_turn(
    client: &mut Client,
    tenant: &str,
    channel: &str,
    request: &str,
) -> Result<i64, tokio_postgres::Error> {
    let tx = client
        .build_transaction()
        .isolation_level(IsolationLevel::Serializable)
        .start()
        .await?;
    tx.batch_execute(&format!("SET LOCAL outbox.tenant = {}", literal(tenant)))
        .await?;
    let placed = tx
        .query_typed(
            PLACE_ORDER,
            &[(&tenant, Type::TEXT), (&request, Type::TEXT)],
        )
        .await?;
    if !placed.is_empty() {
        tx.query_typed(COUNT_SALE, &[(&tenant, Type::TEXT)]).await?;
    }
    let row = tx
        .query_typed_one(
            ENQUEUE_CONFIRMATION,
            &[
                (&channel, Type::TEXT),
                (&tenant, Type::TEXT),
                (&request, Type::TEXT),
            ],
        )
        .await?;
    let id: i64 = row.get(0);
    tx.commit().await?;
    Ok(id)
}

/// A turn, run again after each serialization failure. Returns the message id and the
/// number of retries.
async fn turn(client: &mut Client, args: &Args, request: &str) -> Result<(i64, u32), String> {
    for attempt in 0..MAX_ATTEMPTS {
        match try_turn(client, &args.tenant, &args.channel, request).await {
            Ok(id) => return Ok((id, attempt)),
            Err(e) if e.code() == Some(&SqlState::T_R_SERIALIZATION_FAILURE) => {
                tokio::time::sleep(backoff(attempt)).await;
            }
            Err(e) => return Err(format!("request {request}: {}", describe(&e))),
        }
    }
    Err(format!(
        "request {request}: still failing after {MAX_ATTEMPTS} attempts"
    ))
}

/// A few milliseconds, more with each attempt, jittered.
fn backoff(attempt: u32) -> Duration {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .subsec_nanos();
    Duration::from_micros(u64::from(nanos % 2000) * u64::from(attempt.min(10) + 1))
}

/// One client: its own connection (through the pooler), its own requests.
async fn client(args: std::sync::Arc<Args>, n: usize) -> Result<(Vec<(String, i64)>, u32), String> {
    let (mut c, connection) = tokio_postgres::connect(&args.dsn, NoTls)
        .await
        .map_err(|e| format!("connect: {}", describe(&e)))?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            eprintln!(
                "shop_turns: client {n}: the connection failed: {}",
                describe(&e)
            );
        }
    });
    let mut ids = Vec::new();
    let mut retries = 0;
    for t in 0..args.turns {
        let request = format!("{}-{}-rs{n}-{t}", args.run, args.tenant);
        let (id, r) = turn(&mut c, &args, &request).await?;
        ids.push((request, id));
        retries += r;
    }
    Ok((ids, retries))
}

#[tokio::main]
async fn main() {
    let args = match parse_args() {
        Ok(a) => std::sync::Arc::new(a),
        Err(e) => {
            eprintln!("shop_turns: {e}");
            std::process::exit(2);
        }
    };
    let tasks: Vec<_> = (0..args.clients)
        .map(|n| tokio::spawn(client(args.clone(), n)))
        .collect();
    let (mut ids, mut retries) = (Vec::new(), 0);
    for task in tasks {
        match task.await {
            Ok(Ok((i, r))) => {
                ids.extend(i);
                retries += r;
            }
            Ok(Err(e)) => {
                eprintln!("shop_turns: {e}");
                std::process::exit(1);
            }
            Err(e) => {
                eprintln!("shop_turns: a client panicked: {e}");
                std::process::exit(1);
            }
        }
    }
    let ids: Vec<String> = ids
        .iter()
        .map(|(r, id)| format!("{}: {id}", json_string(r)))
        .collect();
    println!(
        "{{\"example\": \"rust\", \"tenant\": {}, \"turns\": {}, \"retries\": {retries}, \"ids\": {{{}}}}}",
        json_string(&args.tenant),
        ids.len(),
        ids.join(", ")
    );
}
