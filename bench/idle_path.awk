# Reads `perf script -F pid,tid,time,event` of bench/profile_idle_path.sh's probes (group
# prefix removed) and prints, for the claims that took a message after a wake and for the
# record transactions, the median and 90th percentile of each step, in microseconds.
# A statement is one run through SPI_execute_plan from the worker itself; executors started
# inside it (a function's own statements) count as part of it.

function us(d) { return sprintf("%.0f", d * 1e6) }
function keep(kind, label, value) {
  key = kind SUBSEP label
  if (!(key in count)) { order[kind, ++labels[kind]] = label }
  samples[key, ++count[key]] = value
}
function quantile(key, q,    n, i, j, tmp, a) {
  n = count[key]
  for (i = 1; i <= n; i++) a[i] = samples[key, i] + 0
  for (i = 2; i <= n; i++) {               # insertion sort: a few thousand samples at most
    tmp = a[i]
    for (j = i - 1; j >= 1 && a[j] > tmp; j--) a[j + 1] = a[j]
    a[j + 1] = tmp
  }
  return a[int((n - 1) * q) + 1]
}
function reset(pid) {
  inside[pid] = 0; es_depth[pid] = 0; run_depth[pid] = 0; stmts[pid] = 0
  locked[pid] = 0; flush[pid] = 0; line[pid] = ""; es_done[pid] = 0
}
# One step of the transaction under way: its label and duration, kept until the
# transaction is known to be a claim that took a message or a record.
function step(pid, label, d) { line[pid] = line[pid] label "=" us(d) ";" }
function flush_steps(pid, kind,    n, i, kv) {
  n = split(line[pid], parts, ";")
  for (i = 1; i < n; i++) {
    split(parts[i], kv, "=")
    keep(kind, kv[1], kv[2])
  }
}

{
  split($1, ids, "/"); pid = ids[1]; tid = (ids[2] == "" ? ids[1] : ids[2])
  t = $2 + 0; ev = $3
}
# The send thread of a worker: the first request written after a claim's commit.
tid != pid {
  if (ev == "epoll_woke" && pending[pid] && handed[pid] > commit_ret[pid] && thread_woke[pid] < handed[pid]) {
    thread_woke[pid] = t
  }
  # The request: one write of an `http://` channel's own connections, a writev of reqwest's.
  if ((ev == "write" || ev == "writev") && pending[pid]) {
    line[pid] = pending_line[pid]
    step(pid, "commit returned -> sends handed over", handed[pid] - commit_ret[pid])
    step(pid, "handed over -> send thread awake", thread_woke[pid] - handed[pid])
    step(pid, "send thread awake -> request written", t - thread_woke[pid])
    step(pid, "WAKE -> REQUEST WRITTEN", t - claim_wake[pid])
    flush_steps(pid, "claim")
    claims_with[pending_stmts[pid]]++
    pending[pid] = 0; line[pid] = ""
  }
  next
}
# The worker's first write after a claim's commit wakes its send thread.
ev == "write" && pending[pid] && handed[pid] < commit_ret[pid] { handed[pid] = t; next }
ev == "WaitEventSetWait_ret" { wake[pid] = t; woken[pid] = 1; next }
ev == "StartTransactionCommand" {
  reset(pid); start[pid] = t; last_end[pid] = t
  from_wake[pid] = woken[pid]; woken[pid] = 0
  if (from_wake[pid]) step(pid, "wake -> transaction started", t - wake[pid])
  next
}
ev == "NewGUCNestLevel" && !inside[pid] { nest[pid] = t; next }
ev == "SPI_execute_plan" && !inside[pid] {
  inside[pid] = 1; s = ++stmts[pid]; spi[pid] = t
  step(pid, "statement " s ": worker before it", nest[pid] - last_end[pid])
  step(pid, "statement " s ": GUCs and arguments", t - nest[pid])
  next
}
ev == "standard_ExecutorStart" && inside[pid] {
  if (es_depth[pid]++ == 0 && !es_done[pid]) {
    es[pid] = t
    step(pid, "statement " stmts[pid] ": plan cache", t - spi[pid])
  }
  next
}
ev == "standard_ExecutorStart_ret" && inside[pid] {
  if (--es_depth[pid] == 0 && !es_done[pid]) {
    es_done[pid] = 1
    step(pid, "statement " stmts[pid] ": executor start", t - es[pid])
  }
  next
}
ev == "standard_ExecutorRun" && inside[pid] { if (run_depth[pid]++ == 0) run[pid] = t; next }
ev == "standard_ExecutorRun_ret" && inside[pid] {
  if (--run_depth[pid] == 0) { run_end[pid] = t; step(pid, "statement " stmts[pid] ": run", t - run[pid]) }
  next
}
ev == "standard_ExecutorEnd_ret" && inside[pid] && run_depth[pid] == 0 {
  step(pid, "statement " stmts[pid] ": end", t - run_end[pid])
  inside[pid] = 0; es_done[pid] = 0; last_end[pid] = t
  next
}
ev == "claim_due" { locked[pid] = 1; next }
ev == "CommitTransactionCommand" {
  commit[pid] = t
  step(pid, "worker after the last statement", t - last_end[pid])
  next
}
ev == "XLogFlush" { fsync_at[pid] = t; next }
ev == "XLogFlush_ret" { flush[pid] += t - fsync_at[pid]; next }
ev == "CommitTransactionCommand_ret" {
  if (flush[pid] == 0) next             # wrote nothing: an empty claim
  step(pid, "commit", t - commit[pid])
  step(pid, "commit: of it the WAL flush", flush[pid])
  if (locked[pid] && from_wake[pid]) {
    pending[pid] = 1; pending_line[pid] = line[pid]; pending_stmts[pid] = stmts[pid]
    commit_ret[pid] = t; claim_wake[pid] = wake[pid]
  } else if (!locked[pid]) {
    step(pid, "TRANSACTION", t - start[pid])
    flush_steps(pid, "record")
    records++
  }
  line[pid] = ""
  next
}

END {
  split("claim record", kinds, " ")
  for (k = 1; k <= 2; k++) {
    kind = kinds[k]
    if (kind == "claim") {
      printf "claims that took a message after a wake, by statements run:"
      for (n in claims_with) printf " %d with %d", claims_with[n], n
      print " (a sweep adds statements; steps of other counts mix in the statement lines)"
    } else {
      print "record transactions: " records + 0
    }
    printf "  %-48s %8s %8s %6s\n", "step (us)", "median", "p90", "n"
    for (i = 1; i <= labels[kind]; i++) {
      label = order[kind, i]; key = kind SUBSEP label
      printf "  %-48s %8d %8d %6d\n", label, quantile(key, 0.5), quantile(key, 0.9), count[key]
    }
  }
}
