#!/usr/bin/env python3
"""A capacity model of N databases (shards) x M delivery workers feeding one NATS cluster,
from the figures `bench/bench_nats.sh` measured on one machine (costs.json: CPU, WAL and
table growth per enqueue and per delivery; baseline.json: a plain client's publish-with-ack
rate into one stream and nats-server's CPU per message).

It answers: how many deliveries per second N shards sustain, which resource runs out first
(CPU, the workers, WAL bandwidth, fsyncs, the bus), and what a burst of one tenant does to
the others. Every figure it does not measure is an argument with a stated default.

Assumptions (docs/scaling.md says why):
  - steady state: every message is enqueued and delivered once, so a shard's CPU pays the
    enqueue and the delivery of each message (server CPU, all of the server's processes);
  - a delivery worker is one process: it uses at most one core;
  - CPU, WAL bandwidth and fsyncs are independent ceilings; the lowest one binds;
  - the WAL figures were measured right after a CHECKPOINT (full-page images for every
    page touched first): an upper bound for checkpoints minutes apart;
  - fsyncs: one per committing transaction, no group commit (pessimistic): the application
    commits `msgs_per_tx` messages per transaction, the worker one batch per transaction;
  - the bus: every message is processed by `replicas` nats-servers at the measured CPU per
    message each (followers cost what the leader costs); one stream has one leader, so one
    stream carries at most what the plain client reached into one stream;
  - claims: a worker's batch is shared evenly between the channels with due messages; on one
    channel, messages go in order of due time (FIFO across the tenants sharing it).

Usage: bench/scaling_model.py COSTS.json BASELINE.json [--kind nats] [--shards 1,2,4,8,16]
       [--cores 2] [--workers 2] [--wal-mb-s 200] [--fsyncs-s 5000] [--msgs-per-tx 1]
       [--batch 200] [--bus-nodes 3] [--bus-cores 2] [--replicas 3] [--streams 1]
       [--burst 100000] [--tenant-channels 10]
"""
import argparse
import json


def shard_ceilings(costs, kind, a):
    """Deliveries per second one shard sustains, by each resource."""
    enq, dl = costs["enqueue"], costs[kind]
    cpu_us = enq["server_cpu_us"] + dl["server_cpu_us"]
    wal_b = enq["wal_bytes"] + dl["wal_bytes"]
    commits_per_msg = 1.0 / a.msgs_per_tx + 1.0 / a.batch
    return {
        "cpu": a.cores * 1e6 / cpu_us,
        "workers": a.workers * 1e6 / dl["worker_cpu_us"],
        "wal": a.wal_mb_s * 1e6 / wal_b,
        "fsync": a.fsyncs_s / commits_per_msg,
    }


def bus_ceilings(costs, base, kind, a):
    """Messages per second the NATS cluster takes, by each resource."""
    # The nats-server CPU per message the channel's drain measured (the sink's), or the
    # plain client's when the kind is not nats.
    per_msg_us = costs["nats"]["sink_cpu_us"] or base["server_cpu_us"]
    return {
        "bus_cpu": a.bus_nodes * a.bus_cores * 1e6 / (per_msg_us * a.replicas),
        "bus_streams": a.streams * base["rate"],
    }


def total(costs, base, kind, a, n):
    shard = shard_ceilings(costs, kind, a)
    bus = bus_ceilings(costs, base, kind, a) if kind == "nats" else {}
    sums = {k: v * n for k, v in shard.items()}
    sums.update(bus)
    first = min(sums, key=sums.get)
    return sums[first], first, shard


def burst(rate_shard, a):
    """A tenant enqueues `burst` messages at once on a shard running at `rate_shard`."""
    # Tenants sharing its channel take turns with it (src/worker/lane_turns.rs): they wait
    # one turn, not the burst; `shared` is what the burst would add in due order.
    shared = a.burst / rate_shard
    # On channels of their own, the batch is shared evenly: the bursting channel gets one
    # share of `tenant_channels`, and each other channel keeps its share.
    own_share = rate_shard / a.tenant_channels
    return shared, a.burst / own_share, own_share


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("costs")
    p.add_argument("baseline")
    p.add_argument("--kind", default="nats", choices=["nats", "http", "sql"])
    p.add_argument("--shards", default="1,2,4,8,16")
    for name, default in [("cores", 2), ("workers", 2), ("wal-mb-s", 200.0), ("fsyncs-s", 5000.0),
                          ("msgs-per-tx", 1.0), ("batch", 200.0), ("bus-nodes", 3), ("bus-cores", 2),
                          ("replicas", 3), ("streams", 1), ("burst", 100000.0), ("tenant-channels", 10)]:
        p.add_argument("--" + name, type=type(default), default=default)
    a = p.parse_args()
    costs, base = json.load(open(a.costs)), json.load(open(a.baseline))
    k = a.kind
    print(f"measured ({costs['cores']} cores, backlog {costs['backlog']}): enqueue "
          f"{costs['enqueue']['server_cpu_us']:.0f} us + delivery {costs[k]['server_cpu_us']:.0f} us of server CPU, "
          f"WAL {costs['enqueue']['wal_bytes']:.0f} + {costs[k]['wal_bytes']:.0f} B per message ({k}); "
          f"plain client into one stream {base['rate']:.0f} msg/s, nats-server {base['server_cpu_us']:.0f} us/msg")
    shard = shard_ceilings(costs, k, a)
    print("one shard (%d cores, %d workers): " % (a.cores, a.workers)
          + ", ".join(f"{r} {v:,.0f}/s" for r, v in shard.items()))
    if k == "nats":
        print("the bus (%d nodes x %d cores, R%d, %d stream(s)): " % (a.bus_nodes, a.bus_cores, a.replicas, a.streams)
              + ", ".join(f"{r} {v:,.0f}/s" for r, v in bus_ceilings(costs, base, k, a).items()))
    print(f"{'shards':>6} {'deliveries/s':>13}  first bottleneck")
    for n in [int(s) for s in a.shards.split(",")]:
        rate, first, _ = total(costs, base, k, a, n)
        print(f"{n:>6} {rate:>13,.0f}  {first}")
    rate_shard = min(shard.values())
    shared, alone, share = burst(rate_shard, a)
    print(f"burst of {a.burst:,.0f} messages by one tenant on a shard at {rate_shard:,.0f}/s:")
    print(f"  tenants sharing its channel take turns with it: one turn added to each of their messages, "
          f"not the {shared:.1f} s the burst takes")
    print(f"  tenants on channels of their own keep 1/{a.tenant_channels} of the shard each "
          f"({share:,.0f}/s); the burst drains in {alone:.1f} s if all {a.tenant_channels} channels stay busy")
    print("  other shards: unaffected while the bus has room (their rate is their own shard's)")


if __name__ == "__main__":
    main()
