-- outbox_delivery: metrics, alerts and the Prometheus exposition.
-- Cheap at any backlog: state counts read the partial indexes (never the table), the
-- queue's age reads the head of the due index, and rates come from counters the worker keeps.

CREATE FUNCTION outbox._setting(name text, fallback integer) RETURNS integer
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT coalesce(pg_catalog.current_setting(name, true)::integer, fallback)
$fn$;

-- Message counts by channel, for every channel with any, each read once from its partial
-- index (the queued messages from the due index, those waiting for an operator from the
-- work queue's) and from the claims: one read for all channels, where a read per channel
-- cost about 80 µs each, most of a second with 10,000 channels. Then the age of the oldest
-- due queued message of each channel with a queued message not in flight: the head of each
-- part of its due index (the messages free to be claimed, and those held behind their
-- ordering key, which wait too). The planner would pick a sequential scan when its
-- statistics see few channels; the counts must not depend on that. Without JIT: a probe per
-- channel looks costly to the planner, whose JIT then took 400 ms of a read of 10,000.
CREATE FUNCTION outbox._state_counts()
RETURNS TABLE (channel_id integer, queued bigint, sending bigint, uncertain bigint,
               exhausted bigint, failed bigint, oldest_queued_age_s numeric)
LANGUAGE sql STABLE
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
SET jit = off
AS $fn$
    WITH flying AS MATERIALIZED (
        SELECT pg_catalog.unnest(w.message_ids) AS id FROM outbox._claims w
    )
    SELECT k.channel_id, k.queued, k.sending, k.uncertain, k.exhausted, k.failed,
           CASE WHEN k.queued > 0 THEN
           (SELECT greatest(0, extract(epoch FROM pg_catalog.now() - min(h.next_attempt_at)))
              FROM (VALUES (false), (true)) AS part(held)
             CROSS JOIN LATERAL (
                   SELECT m.next_attempt_at FROM outbox._messages m
                    WHERE m.channel_id = k.channel_id AND m.state = 'queued'
                      AND m.held_by_key = part.held
                      AND m.id NOT IN (SELECT flying.id FROM flying)
                    ORDER BY m.next_attempt_at LIMIT 1) h
            -- NULL, not 0, for a channel with nothing queued.
            HAVING count(*) > 0) END
      FROM (
    SELECT s.channel_id, sum(s.queued) - sum(s.sending) AS queued, sum(s.sending) AS sending,
           sum(s.uncertain) AS uncertain, sum(s.exhausted) AS exhausted, sum(s.failed) AS failed
      FROM (
            -- A message in flight is a queued row in a claim (sql/schema.sql, outbox._claims).
            SELECT w.channel_id, 0::bigint AS queued,
                   pg_catalog.cardinality(w.message_ids)::bigint AS sending,
                   0::bigint AS uncertain, 0::bigint AS exhausted, 0::bigint AS failed
              FROM outbox._claims w
            UNION ALL
            SELECT m.channel_id, 1, 0, 0, 0, 0 FROM outbox._messages m WHERE m.state = 'queued'
            UNION ALL
            SELECT m.channel_id, 0, 0, (m.state = 'uncertain')::int, (m.state = 'exhausted')::int,
                   (m.state = 'failed')::int
              FROM outbox._messages m WHERE m.state IN ('uncertain', 'exhausted', 'failed')
           ) s
     GROUP BY s.channel_id) k
$fn$;

-- The bounds of the latency histograms' buckets in ms, each inclusive (Prometheus' le),
-- with one more bucket past the last for +Inf (src/metrics/latency.rs, BOUNDS_MS; a test
-- holds the two equal).
CREATE FUNCTION outbox._latency_bounds_ms() RETURNS bigint[]
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT '{5,10,25,50,100,250,500,1000,2500,5000,10000,30000,60000,300000,900000,3600000}'::bigint[]
$fn$;

-- The q quantile (0 to 1) of a histogram's per-bucket counts, in ms, estimated as
-- Prometheus' histogram_quantile does: linearly inside the bucket that holds the rank, from
-- 0 below the first bound; the highest finite bound when the rank falls in +Inf. NULL for
-- an empty histogram (latency::quantile_ms; a test holds the two equal).
CREATE FUNCTION outbox._quantile_ms(counts bigint[], q double precision) RETURNS numeric
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
SET search_path = pg_catalog, pg_temp
AS $fn$
    WITH k AS (SELECT outbox._latency_bounds_ms() AS bs, greatest(0, least(1, q)) AS q),
    b AS (
        SELECT u.i::int AS i, u.c, sum(u.c) OVER (ORDER BY u.i) AS upto, sum(u.c) OVER () AS total
          FROM unnest(counts) WITH ORDINALITY AS u(c, i)
    )
    SELECT (CASE WHEN b.i > cardinality(k.bs) THEN k.bs[cardinality(k.bs)]
                 ELSE coalesce(k.bs[b.i - 1], 0)
                      + (k.bs[b.i] - coalesce(k.bs[b.i - 1], 0))
                        * (k.q * b.total::float8 - (b.upto - b.c)::float8) / b.c::float8 END)::numeric
      FROM b, k
     WHERE b.c > 0 AND b.upto::float8 >= k.q * b.total::float8
     ORDER BY b.i LIMIT 1
$fn$;

CREATE VIEW outbox.metrics AS
WITH counts AS MATERIALIZED (
    SELECT * FROM outbox._state_counts()
), minutes AS MATERIALIZED (
    SELECT b.channel_id, sum(b.delivered) AS delivered, sum(b.failed) AS failed,
           outbox._counts_sum(b.send_ms_counts) AS send_ms_counts,
           outbox._counts_sum(b.delivery_ms_counts) AS delivery_ms_counts
      FROM outbox._channel_minutes b
     WHERE b.minute >= date_trunc('minute', pg_catalog.now()) - interval '4 minutes'
     GROUP BY b.channel_id
), per_channel AS (
    SELECT c.id,
           c.name AS channel,
           coalesce(n.queued, 0) AS queued, coalesce(n.sending, 0) AS sending,
           coalesce(n.uncertain, 0) AS uncertain, coalesce(n.exhausted, 0) AS exhausted,
           coalesce(n.failed, 0) AS failed,
           n.oldest_queued_age_s::numeric(12, 3) AS oldest_queued_age_s,
           coalesce(b.delivered, 0)::bigint AS delivered_5m,
           coalesce(b.failed, 0)::bigint AS failed_5m,
           coalesce(s.error_streak, 0) AS error_streak,
           s.error_streak_since,
           coalesce(s.exhausted_total, 0) AS exhausted_total,
           coalesce(s.delivered_total, 0) AS delivered_total,
           coalesce(s.attempts_failed_total, 0) AS attempts_failed_total,
           coalesce(s.failed_total, 0) AS failed_total,
           c.paused, b.send_ms_counts, b.delivery_ms_counts
      FROM outbox._channels c
      LEFT JOIN counts n ON n.channel_id = c.id
      LEFT JOIN minutes b ON b.channel_id = c.id
      LEFT JOIN outbox._channel_stats s ON s.channel_id = c.id
), rows AS (
    SELECT 'channel'::text AS scope, channel, queued, sending, uncertain, exhausted, failed,
           oldest_queued_age_s, delivered_5m, failed_5m, error_streak, error_streak_since,
           exhausted_total, delivered_total, attempts_failed_total, failed_total, paused,
           send_ms_counts, delivery_ms_counts
      FROM per_channel
    UNION ALL
    SELECT 'total', NULL, coalesce(sum(queued), 0)::bigint, coalesce(sum(sending), 0)::bigint,
           coalesce(sum(uncertain), 0)::bigint, coalesce(sum(exhausted), 0)::bigint,
           coalesce(sum(failed), 0)::bigint, max(oldest_queued_age_s),
           coalesce(sum(delivered_5m), 0)::bigint, coalesce(sum(failed_5m), 0)::bigint,
           coalesce(max(error_streak), 0), min(error_streak_since),
           coalesce(sum(exhausted_total), 0)::bigint, coalesce(sum(delivered_total), 0)::bigint,
           coalesce(sum(attempts_failed_total), 0)::bigint, coalesce(sum(failed_total), 0)::bigint,
           NULL, outbox._counts_sum(send_ms_counts), outbox._counts_sum(delivery_ms_counts)
      FROM per_channel
)
SELECT scope, channel, queued, sending, uncertain, exhausted, failed, oldest_queued_age_s,
       delivered_5m, failed_5m,
       CASE WHEN delivered_5m + failed_5m > 0
            THEN round(delivered_5m::numeric / (delivered_5m + failed_5m), 4) END AS success_rate_5m,
       error_streak, exhausted_total, delivered_total, attempts_failed_total, failed_total,
       error_streak_since, paused,
       outbox._quantile_ms(send_ms_counts, 0.5)::numeric(12, 1) AS send_p50_ms,
       outbox._quantile_ms(send_ms_counts, 0.95)::numeric(12, 1) AS send_p95_ms,
       outbox._quantile_ms(send_ms_counts, 0.99)::numeric(12, 1) AS send_p99_ms,
       outbox._quantile_ms(delivery_ms_counts, 0.5)::numeric(12, 1) AS delivery_p50_ms,
       outbox._quantile_ms(delivery_ms_counts, 0.95)::numeric(12, 1) AS delivery_p95_ms,
       outbox._quantile_ms(delivery_ms_counts, 0.99)::numeric(12, 1) AS delivery_p99_ms
  FROM rows;
COMMENT ON VIEW outbox.metrics IS
    'One row per channel and one total: messages by state, oldest due queued age, deliveries and failed attempts in the last 5 minutes, success rate, error streak, totals, and the p50/p95/p99 of send duration and of enqueue-to-delivered latency over the last 5 minutes.';

CREATE VIEW outbox.alerts AS
SELECT 'queue_age'::text AS alert,
       m.channel,
       CASE WHEN m.oldest_queued_age_s > 4 * outbox._setting('outbox.alert_queue_age_s', 300)
            THEN 'critical' ELSE 'warning' END AS severity,
       m.oldest_queued_age_s AS value,
       outbox._setting('outbox.alert_queue_age_s', 300)::numeric AS threshold,
       pg_catalog.now() - make_interval(secs => m.oldest_queued_age_s::double precision) AS since
  FROM outbox.metrics m
 WHERE m.scope = 'channel' AND NOT m.paused
   AND m.oldest_queued_age_s > outbox._setting('outbox.alert_queue_age_s', 300)
UNION ALL
SELECT 'error_streak', c.name, 'warning', s.error_streak::numeric,
       outbox._setting('outbox.alert_error_streak', 10)::numeric, s.error_streak_since
  FROM outbox._channel_stats s
  JOIN outbox._channels c ON c.id = s.channel_id
 WHERE s.error_streak >= outbox._setting('outbox.alert_error_streak', 10)
UNION ALL
SELECT 'terminal_failures', c.name, 'critical', count(*)::numeric, 0::numeric, min(m.updated_at)
  FROM outbox._messages m
  JOIN outbox._channels c ON c.id = m.channel_id
 WHERE m.state IN ('failed', 'exhausted') AND m.updated_at > pg_catalog.now() - interval '1 hour'
 GROUP BY c.name
UNION ALL
SELECT 'uncertain', c.name, 'critical', count(*)::numeric,
       outbox._setting('outbox.alert_uncertain_age_s', 300)::numeric, min(u.since)
  FROM outbox._messages m
  JOIN outbox._channels c ON c.id = m.channel_id
  -- Uncertain since the send (or the recovery of a lost lease) that left it so: the
  -- inconclusive lookups that follow change the row, not how long nobody has known.
  CROSS JOIN LATERAL (
      SELECT coalesce((SELECT coalesce(a.finished_at, a.started_at)
                         FROM outbox._attempts a
                        WHERE a.message_id = m.id AND a.kind IN ('send', 'recovery')
                        ORDER BY a.id DESC LIMIT 1),
                      m.updated_at) AS since) u
 WHERE m.state = 'uncertain'
   AND (NOT outbox._can_look_up(c.options)
        OR u.since < pg_catalog.now() - make_interval(secs => outbox._setting('outbox.alert_uncertain_age_s', 300)))
 GROUP BY c.name
UNION ALL
-- A channel whose circuit is open (or half open, probing): value = seconds in that state.
SELECT 'circuit_open', c.name, 'critical',
       round(extract(epoch FROM pg_catalog.now() - f.circuit_since), 3)::numeric, 0::numeric,
       f.circuit_since
  FROM outbox._channel_flow f
  JOIN outbox._channels c ON c.id = f.channel_id
 WHERE f.circuit_state IN ('open', 'half_open')
   AND jsonb_typeof(c.options -> 'circuit') = 'object'
UNION ALL
-- A channel paused for longer than outbox.alert_paused_s: its queue raises no queue_age alert
-- while it is paused. value = seconds since it was paused.
SELECT 'channel_paused', c.name, 'warning',
       round(extract(epoch FROM pg_catalog.now() - c.paused_at), 3)::numeric,
       outbox._setting('outbox.alert_paused_s', 3600)::numeric, c.paused_at
  FROM outbox._channels c
 WHERE c.paused
   AND c.paused_at < pg_catalog.now() - make_interval(secs => outbox._setting('outbox.alert_paused_s', 3600))
UNION ALL
-- No delivery worker serves this database (it is not in outbox.database, or the library is
-- not preloaded): whatever is enqueued here stays queued. value = 0.
SELECT 'database_not_served', NULL, 'critical', 0::numeric, 0::numeric, NULL::timestamptz
 WHERE NOT outbox._database_served()
UNION ALL
-- The ledger's retention has put off emptying a due generation for five minutes: a session
-- holds its table (docs/runbook.md). value = seconds since the first time it was put off.
SELECT 'ledger_retention_deferred', NULL, 'warning',
       round(extract(epoch FROM pg_catalog.now() - g.emptying_deferred_since), 3)::numeric,
       300::numeric, g.emptying_deferred_since
  FROM outbox._ledger_generations g
 WHERE g.emptying_deferred_since < pg_catalog.now() - interval '5 minutes'
UNION ALL
-- A channel whose sends of the last hour came out ambiguous more often than
-- outbox.alert_ambiguous_pct percent, with at least 20 sends: a timeout shorter than the
-- provider's answers, a gateway that gives up first, or a classification to look at
-- (outbox.ambiguity_review). value = the percentage.
SELECT 'ambiguity_high', c.name, 'warning', round(100.0 * b.ambiguous / b.sends, 2),
       outbox._setting('outbox.alert_ambiguous_pct', 5)::numeric, b.since
  FROM (SELECT b.channel_id, sum(b.ambiguous) AS ambiguous, sum(b.delivered + b.failed) AS sends,
               min(b.minute) FILTER (WHERE b.ambiguous > 0) AS since
          FROM outbox._channel_minutes b
         WHERE b.minute >= date_trunc('minute', pg_catalog.now()) - interval '59 minutes'
         GROUP BY b.channel_id) b
  JOIN outbox._channels c ON c.id = b.channel_id
 WHERE b.sends >= 20
   AND 100 * b.ambiguous > outbox._setting('outbox.alert_ambiguous_pct', 5) * b.sends
UNION ALL
-- Messages waiting for an operator that nobody has taken for outbox.alert_unowned_s (a
-- day): the daily review of the work queue is not happening. value = how many.
SELECT 'work_queue_unowned', c.name, 'warning', count(*)::numeric,
       outbox._setting('outbox.alert_unowned_s', 86400)::numeric, min(m.updated_at)
  FROM outbox._messages m
  JOIN outbox._channels c ON c.id = m.channel_id
 WHERE m.state IN ('uncertain', 'exhausted', 'failed') AND m.owner IS NULL
   AND m.updated_at < pg_catalog.now() - make_interval(secs => outbox._setting('outbox.alert_unowned_s', 86400))
 GROUP BY c.name;
COMMENT ON VIEW outbox.alerts IS
    'What needs a human, not every transient error: queue age over outbox.alert_queue_age_s, an error streak of outbox.alert_error_streak failed attempts on one channel, terminal failures in the last hour, uncertain messages (at once where the channel cannot reconcile, after outbox.alert_uncertain_age_s since the send that left them uncertain where it can), a channel whose circuit is open, a channel paused longer than outbox.alert_paused_s, a database no delivery worker serves, a generation of the ledger whose emptying has been put off for five minutes, a channel whose sends of the last hour came out ambiguous more often than outbox.alert_ambiguous_pct percent, messages in the work queue without an owner for outbox.alert_unowned_s. since = when it began.';

-- The review of ambiguous outcomes that operators are asked to hold regularly
-- (docs/runbook.md, "Reviewing ambiguity"): frequent ambiguity points to a timeout shorter
-- than the provider's answers, a gateway that gives up first, lost external ids, or a wrong
-- classification. Per channel with sends since `since` ago: the ambiguous outcomes by cause,
-- the lookups found and not found, the deliveries without an external id, the permanent
-- errors that an operator's retry then delivered, the answer time's p99 beside timeout_ms,
-- and what to change. The caller's rights and row-level security apply, as in the views.
-- Reads the attempts of the window whole: an operator's call, not a scrape.
CREATE FUNCTION outbox.ambiguity_review(since interval DEFAULT '7 days')
RETURNS TABLE (channel text, sends bigint, ambiguous bigint, ambiguous_pct numeric,
               timed_out bigint, lost_after_write bigint, worker_interrupted bigint,
               gateway bigint, lookups_found bigint, lookups_not_found bigint,
               delivered_without_external_id bigint, permanent_then_delivered bigint,
               answer_p99_ms numeric, timeout_ms integer, suggestion text)
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
WITH a AS (
    -- The attempts of the window with their channel: from the queue, or from the ledger
    -- entry of a delivered message.
    SELECT a.message_id, a.kind, a.outcome, a.error_class, a.http_status, a.error,
           a.started_at, a.finished_at,
           coalesce((SELECT m.channel_id FROM outbox._messages m WHERE m.id = a.message_id),
                    (SELECT l.channel_id FROM outbox._ledger l WHERE l.message_id = a.message_id LIMIT 1))
             AS channel_id
      FROM outbox._attempts a
     WHERE a.started_at >= pg_catalog.now() - ambiguity_review.since
), per_channel AS (
    SELECT a.channel_id,
           count(*) FILTER (WHERE a.kind = 'send' AND a.outcome IS DISTINCT FROM 'not sent') AS sends,
           count(*) FILTER (WHERE a.kind IN ('send', 'recovery') AND a.error_class = 'ambiguous') AS ambiguous,
           count(*) FILTER (WHERE a.kind = 'send' AND a.error_class = 'ambiguous'
                              AND a.http_status IS NULL AND a.error LIKE '%timed out%') AS timed_out,
           count(*) FILTER (WHERE a.kind = 'send' AND a.error_class = 'ambiguous'
                              AND a.http_status IS NULL AND a.error NOT LIKE '%timed out%') AS lost_after_write,
           count(*) FILTER (WHERE a.kind = 'recovery') AS worker_interrupted,
           count(*) FILTER (WHERE a.kind = 'send' AND a.error_class = 'ambiguous'
                              AND a.http_status IN (502, 504)) AS gateway,
           count(*) FILTER (WHERE a.kind = 'reconcile' AND a.outcome = 'delivered') AS lookups_found,
           count(*) FILTER (WHERE a.kind = 'reconcile' AND a.outcome = 'not_found') AS lookups_not_found,
           (percentile_cont(0.99) WITHIN GROUP (
                ORDER BY extract(epoch FROM a.finished_at - a.started_at) * 1000)
              FILTER (WHERE a.kind = 'send' AND a.http_status IS NOT NULL))::numeric(12, 1) AS answer_p99_ms
      FROM a
     WHERE a.channel_id IS NOT NULL
     GROUP BY a.channel_id
), entries AS (
    SELECT l.channel_id, count(*) AS without_external_id
      FROM outbox._ledger l
     WHERE l.recorded_at >= pg_catalog.now() - ambiguity_review.since
       AND l.recorded_by = 'worker' AND l.external_id IS NULL
     GROUP BY l.channel_id
), rescued AS (
    -- Failed as permanent, then delivered after an operator's retry: a status the channel
    -- classifies as permanent that was not.
    SELECT l.channel_id, count(DISTINCT l.message_id) AS permanent_then_delivered
      FROM outbox._ledger l
     WHERE l.recorded_at >= pg_catalog.now() - ambiguity_review.since
       AND EXISTS (SELECT 1 FROM outbox._attempts p
                    WHERE p.message_id = l.message_id AND p.kind = 'send' AND p.error_class = 'permanent')
       AND EXISTS (SELECT 1 FROM outbox._operator_log o
                    WHERE o.message_id = l.message_id AND o.action = 'retry')
     GROUP BY l.channel_id
)
SELECT c.name,
       p.sends,
       p.ambiguous,
       round(100.0 * p.ambiguous / nullif(p.sends, 0), 2),
       p.timed_out, p.lost_after_write, p.worker_interrupted, p.gateway,
       p.lookups_found, p.lookups_not_found,
       coalesce(e.without_external_id, 0),
       coalesce(r.permanent_then_delivered, 0),
       p.answer_p99_ms,
       t.timeout_ms,
       CASE
           WHEN p.timed_out > 0 AND p.timed_out * 100 >= p.sends
               THEN pg_catalog.format('%s of %s sends timed out: raise timeout_ms above the provider''s slowest answers (now %s ms; try %s), or ask the provider why it is slow',
                                      p.timed_out, p.sends, t.timeout_ms, t.timeout_ms * 2)
           WHEN p.answer_p99_ms >= 0.8 * t.timeout_ms
               THEN pg_catalog.format('answers take up to %s ms (p99), close to timeout_ms %s: raise it to about %s',
                                      p.answer_p99_ms, t.timeout_ms, ceil(p.answer_p99_ms * 2))
           WHEN p.gateway > 0
               THEN pg_catalog.format('%s answers of 502/504 from a gateway: set idempotency_header where the provider dedupes by a key, so that they are resent safely', p.gateway)
           WHEN p.lookups_not_found > 0 AND outbox._can_look_up(c.options)
               THEN pg_catalog.format('%s lookups found nothing: check the reconcile lookup and where the provider''s answers keep their id (external_id)', p.lookups_not_found)
           WHEN coalesce(r.permanent_then_delivered, 0) > 0
               THEN pg_catalog.format('%s messages failed as permanent and were delivered by a retry: classify that status as transient (the classify option)', r.permanent_then_delivered)
           WHEN p.worker_interrupted > 0
               THEN pg_catalog.format('%s attempts were interrupted by a worker crash or stall: see the server log', p.worker_interrupted)
           WHEN coalesce(e.without_external_id, 0) > 0 AND outbox._can_look_up(c.options)
               THEN pg_catalog.format('%s deliveries kept no external id: a lookup by id cannot find them; check the channel''s external id setting', e.without_external_id)
           ELSE 'nothing to change'
       END
  FROM per_channel p
  JOIN outbox.channels c ON c.id = p.channel_id
  LEFT JOIN entries e ON e.channel_id = p.channel_id
  LEFT JOIN rescued r ON r.channel_id = p.channel_id
 CROSS JOIN LATERAL (SELECT coalesce(outbox._option_int(c.options, '{timeout_ms}'), 10000) AS timeout_ms) t
 ORDER BY p.ambiguous DESC, c.name
$fn$;
COMMENT ON FUNCTION outbox.ambiguity_review(interval) IS
    'The review of ambiguous outcomes per channel since an interval ago: their causes (timeout, connection lost after writing, worker crash or stall, gateway 502/504), lookups found and not found, deliveries without an external id, permanent errors a retry delivered, the answer time p99 beside timeout_ms, and a suggested change.';

CREATE FUNCTION outbox._prom_label(v text) RETURNS text
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
    SELECT replace(replace(replace(coalesce(v, ''), E'\\', E'\\\\'), '"', E'\\"'), E'\n', E'\\n')
$fn$;

-- The latency histograms of every channel since the start, for prometheus() (read by its
-- caller, pg_monitor or outbox_admin, who may not read the tables).
CREATE VIEW outbox._latency AS
SELECT c.name AS channel, s.send_ms_counts, s.send_ms_sum, s.delivery_ms_counts, s.delivery_ms_sum
  FROM outbox._channels c
  JOIN outbox._channel_stats s ON s.channel_id = c.id;

-- One histogram of one channel in the text exposition: its cumulative buckets with le in
-- seconds, its sum in seconds and its count.
CREATE FUNCTION outbox._prom_histogram(name text, channel text, counts bigint[], sum_ms bigint)
RETURNS text
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
    WITH k AS (SELECT outbox._latency_bounds_ms() AS bs),
    b AS (
        SELECT g.i,
               CASE WHEN g.i <= cardinality(k.bs) THEN trim_scale(k.bs[g.i] / 1000.0)::text
                    ELSE '+Inf' END AS le,
               sum(coalesce(counts[g.i], 0)) OVER (ORDER BY g.i) AS upto
          FROM k, generate_series(1, cardinality(k.bs) + 1) AS g(i)
    )
    SELECT string_agg(format('%s_bucket{channel="%s",le="%s"} %s', name, outbox._prom_label(channel),
                             b.le, b.upto), E'\n' ORDER BY b.i)
           || format(E'\n%s_sum{channel="%s"} %s', name, outbox._prom_label(channel),
                     trim_scale(coalesce(sum_ms, 0) / 1000.0))
           || format(E'\n%s_count{channel="%s"} %s', name, outbox._prom_label(channel), max(b.upto))
      FROM b
$fn$;

CREATE FUNCTION outbox.prometheus() RETURNS text
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $fn$
-- A series per channel while there are at most outbox.metrics_channel_series channels;
-- above it, the total of every channel as channel "*".
WITH every AS MATERIALIZED (SELECT * FROM outbox.metrics),
m AS (
    SELECT e.scope, CASE WHEN e.scope = 'total' THEN '*' ELSE e.channel END AS channel, e.queued,
           e.sending, e.uncertain, e.exhausted, e.failed, e.oldest_queued_age_s, e.delivered_total,
           e.attempts_failed_total, e.exhausted_total, e.failed_total, e.error_streak,
           e.success_rate_5m,
           CASE WHEN e.scope = 'total'
                THEN (SELECT count(*) FROM every p WHERE p.scope = 'channel' AND p.paused)
                ELSE e.paused::int END AS paused
      FROM every e
     WHERE e.scope = CASE WHEN (SELECT count(*) FROM every c WHERE c.scope = 'channel')
                               <= outbox._setting('outbox.metrics_channel_series', 1000)
                          THEN 'channel' ELSE 'total' END
),
latency AS (
    SELECT m.channel, l.send_ms_counts, l.send_ms_sum, l.delivery_ms_counts, l.delivery_ms_sum
      FROM m JOIN outbox._latency l ON l.channel = m.channel
     WHERE m.scope = 'channel'
    UNION ALL
    SELECT '*', outbox._counts_sum(l.send_ms_counts), sum(l.send_ms_sum)::bigint,
           outbox._counts_sum(l.delivery_ms_counts), sum(l.delivery_ms_sum)::bigint
      FROM outbox._latency l
     WHERE EXISTS (SELECT 1 FROM m WHERE m.scope = 'total')
    HAVING count(*) > 0
),
families(ord, name, kind, help) AS (VALUES
    (1, 'outbox_messages', 'gauge', 'Messages by channel and state.'),
    (2, 'outbox_oldest_queued_age_seconds', 'gauge', 'How long the oldest due queued message of a channel has waited.'),
    (3, 'outbox_delivered_total', 'counter', 'Messages confirmed delivered (by a 2xx or by reconcile).'),
    (4, 'outbox_attempts_failed_total', 'counter', 'Attempts that did not deliver.'),
    (5, 'outbox_exhausted_total', 'counter', 'Messages whose retry budget ran out.'),
    (6, 'outbox_failed_total', 'counter', 'Messages that failed permanently.'),
    (7, 'outbox_error_streak', 'gauge', 'Consecutive failed attempts on a channel.'),
    (8, 'outbox_success_rate_5m', 'gauge', 'Share of attempts in the last 5 minutes that delivered.'),
    (9, 'outbox_alert', 'gauge', 'Active alerts (1 per alert).'),
    (10, 'outbox_worker_up', 'gauge', 'Delivery workers running.'),
    (11, 'outbox_queued', 'gauge', 'Queued messages of a channel (outbox_messages with state queued).'),
    (12, 'outbox_channel_paused', 'gauge', 'Whether a channel is paused (1) or not (0); for channel "*", how many are.'),
    (13, 'outbox_send_duration_seconds', 'histogram', 'How long each send took, from its start to its answer or failure.'),
    (14, 'outbox_delivery_latency_seconds', 'histogram', 'How long each delivered message waited from enqueue to delivered.')
),
samples(ord, line) AS (
    SELECT 1, format('outbox_messages{channel="%s",state="%s"} %s', outbox._prom_label(m.channel), s.state, s.n)
      FROM m CROSS JOIN LATERAL (VALUES ('queued', m.queued), ('sending', m.sending), ('uncertain', m.uncertain),
                                        ('exhausted', m.exhausted), ('failed', m.failed)) AS s(state, n)
    UNION ALL
    SELECT 2, format('outbox_oldest_queued_age_seconds{channel="%s"} %s', outbox._prom_label(m.channel), coalesce(m.oldest_queued_age_s, 0)) FROM m
    UNION ALL
    SELECT 3, format('outbox_delivered_total{channel="%s"} %s', outbox._prom_label(m.channel), m.delivered_total) FROM m
    UNION ALL
    SELECT 4, format('outbox_attempts_failed_total{channel="%s"} %s', outbox._prom_label(m.channel), m.attempts_failed_total) FROM m
    UNION ALL
    SELECT 5, format('outbox_exhausted_total{channel="%s"} %s', outbox._prom_label(m.channel), m.exhausted_total) FROM m
    UNION ALL
    SELECT 6, format('outbox_failed_total{channel="%s"} %s', outbox._prom_label(m.channel), m.failed_total) FROM m
    UNION ALL
    SELECT 7, format('outbox_error_streak{channel="%s"} %s', outbox._prom_label(m.channel), m.error_streak) FROM m
    UNION ALL
    SELECT 8, format('outbox_success_rate_5m{channel="%s"} %s', outbox._prom_label(m.channel), m.success_rate_5m)
      FROM m WHERE m.success_rate_5m IS NOT NULL
    UNION ALL
    SELECT 9, format('outbox_alert{alert="%s",channel="%s",severity="%s"} 1', a.alert, outbox._prom_label(a.channel), a.severity)
      FROM outbox.alerts a
    UNION ALL
    SELECT 10, format('outbox_worker_up %s', count(*)) FROM outbox.worker_status() w WHERE w.pid IS NOT NULL
    UNION ALL
    SELECT 11, format('outbox_queued{channel="%s"} %s', outbox._prom_label(m.channel), m.queued) FROM m
    UNION ALL
    SELECT 12, format('outbox_channel_paused{channel="%s"} %s', outbox._prom_label(m.channel), m.paused) FROM m
    UNION ALL
    SELECT 13, outbox._prom_histogram('outbox_send_duration_seconds', l.channel, l.send_ms_counts, l.send_ms_sum)
      FROM latency l
    UNION ALL
    SELECT 14, outbox._prom_histogram('outbox_delivery_latency_seconds', l.channel, l.delivery_ms_counts,
                                      l.delivery_ms_sum)
      FROM latency l
)
SELECT string_agg(x.line, E'\n' ORDER BY x.ord, x.sub, x.line) || E'\n'
  FROM (SELECT f.ord, 0 AS sub, format('# HELP %s %s', f.name, f.help) AS line FROM families f
        UNION ALL
        SELECT f.ord, 1, format('# TYPE %s %s', f.name, f.kind) FROM families f
        UNION ALL
        SELECT s.ord, 2, s.line FROM samples s) x
$fn$;
COMMENT ON FUNCTION outbox.prometheus() IS
    'Prometheus text exposition of outbox.metrics, outbox.alerts and the workers; *_total counters are kept in the database and only grow across restarts.';

-- Who may read these: sql/privileges.sql.
