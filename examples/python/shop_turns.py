#!/usr/bin/env python3
"""One shop turn per request, through PgBouncer in pool_mode = transaction: the order (the
business write) and its confirmation (outbox.enqueue) commit in one transaction, or
neither does.

What transaction pooling asks of an application, and how this one answers:
- the tenant is named inside each transaction with SET LOCAL outbox.tenant, never with a
  session-level SET (the next client of the same server connection would inherit it);
- no named prepared statements: prepare_threshold=None (PgBouncer 1.18 does not carry
  named statements from one server connection to another);
- a serialization failure (40001) runs the whole turn again: the effect key derives from
  the request id, so a retried or re-run turn finds its message instead of making another.

Usage: shop_turns.py --dsn DSN --tenant T --channel CH --run ID [--clients N] [--turns N]
Prints one JSON line: the tenant, turns, retries and the message id of every request.
"""
import argparse
import json
import random
import sys
import threading
import time

import psycopg
from psycopg import errors, sql

MAX_ATTEMPTS = 50

# The order: written once per request, and the one stock row of the tenant's item counts it
# (the hot row that concurrent turns of a tenant contend on).
PLACE_ORDER = """INSERT INTO shop.orders (tenant, request_id, item, client)
                 VALUES (%s, %s, 'widget', 'python') ON CONFLICT DO NOTHING RETURNING true"""
COUNT_SALE = "UPDATE shop.stock SET sold = sold + 1 WHERE tenant = %s AND item = 'widget'"
# The confirmation, keyed by the request: the same request always gives the same key.
ENQUEUE_CONFIRMATION = """SELECT outbox.enqueue(%s,
        jsonb_build_object('tenant', %s::text, 'request_id', %s::text, 'client', 'python'),
        outbox.effect_key(%s, 'order_confirmation'))"""


def try_turn(conn, tenant, channel, request):
    """One try of a turn: its transaction, committed. Returns the message id."""
    with conn.transaction():
        conn.execute(sql.SQL("SET LOCAL outbox.tenant = {}").format(sql.Literal(tenant)))
        if conn.execute(PLACE_ORDER, (tenant, request)).fetchone():
            conn.execute(COUNT_SALE, (tenant,))
        (message_id,) = conn.execute(
            ENQUEUE_CONFIRMATION, (channel, tenant, request, request)
        ).fetchone()
    return message_id


def turn(conn, args, request):
    """A turn, run again after each serialization failure: (message id, retries)."""
    for attempt in range(MAX_ATTEMPTS):
        try:
            return try_turn(conn, args.tenant, args.channel, request), attempt
        except errors.SerializationFailure:
            time.sleep(random.uniform(0, 0.002) * (min(attempt, 10) + 1))
    raise RuntimeError(f"request {request}: still failing after {MAX_ATTEMPTS} attempts")


def client(args, n, results, failures):
    """One client: its own connection (through the pooler), its own requests."""
    try:
        with psycopg.connect(args.dsn, autocommit=True, prepare_threshold=None) as conn:
            conn.isolation_level = psycopg.IsolationLevel.SERIALIZABLE
            for t in range(args.turns):
                request = f"{args.run}-{args.tenant}-py{n}-{t}"
                message_id, retries = turn(conn, args, request)
                results.append((request, message_id, retries))
    except Exception as e:  # reported by the main thread
        failures.append(f"client {n}: {e!r}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dsn", required=True)
    p.add_argument("--tenant", required=True)
    p.add_argument("--channel", required=True)
    p.add_argument("--run", required=True, help="prefix of the request ids")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--turns", type=int, default=10)
    args = p.parse_args()

    results, failures = [], []
    threads = [
        threading.Thread(target=client, args=(args, n, results, failures))
        for n in range(args.clients)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        print("shop_turns.py: " + "; ".join(failures), file=sys.stderr)
        sys.exit(1)
    print(json.dumps({
        "example": "python",
        "tenant": args.tenant,
        "turns": len(results),
        "retries": sum(r for _, _, r in results),
        "ids": {request: message_id for request, message_id, _ in results},
    }))


if __name__ == "__main__":
    main()
