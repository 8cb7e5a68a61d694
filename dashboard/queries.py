"""Every query the dashboard runs, by name: the one place its SQL lives.

They go through the same read-only path as anyone's SQL (collector/store/readonly.py)
and aggregate in DuckDB, so what crosses to the page is small whatever the
job's size: steps are downsampled to about $points points, ranks binned into
about $rank_bins rows, and a heatmap cell keeps its worst rank. Parameters are
named ($run, ...); each query takes exactly those it names.
"""

from rankwatch.agent import semconv as sc

# A rank-step's own time, as the straggler analyzer judges it: its compute and its wait for input (a slow data
# loader holds the others up as a slow GPU does); the whole step where it times no phases.
_OWN_TIME = "coalesce(compute_s + coalesce(data_s, 0), duration_s)"

# Runs, newest first, with what their status is drawn from (dashboard/ui.py `run_status`): when each was
# first and last heard from (its first step or event, or when the collector first saw it, whichever came first;
# its newest step or event), whether it is an imported trace, how many ranks said their loop ended and when, the
# findings firing (recommendations, severity info, aside), whether a hang fires, its worst finding ever (a rank's
# failure first: it ended the job) and, where a failure holds (not resolved by a restart), at which step and how.
RUNS = f"""
SELECT r.run_id, greatest(r.world_size, k.ranks) AS ranks, r.first_seen, s.last_step,
       make_timestamp_ns(least(epoch_ns(r.first_seen), s.first_start_ns, e.first_event_ns)) AS first_heard,
       make_timestamp_ns(greatest(s.last_end_ns, e.last_event_ns)) AS last_heard,
       coalesce(e.imported, false) AS imported,
       coalesce(e.ended_ranks, 0) AS ended_ranks, make_timestamp_ns(e.ended_ns) AS ended_at,
       make_timestamp_ns(s.last_end_ns) AS last_step_end,
       coalesce(f.firing, 0) AS firing, coalesce(f.hung, false) AS hung, w.worst, w.worst_severity,
       x.failed_step, x.failed_as
FROM runs r
LEFT JOIN (SELECT run_id, count(*) AS ranks FROM ranks GROUP BY run_id) k USING (run_id)
LEFT JOIN (SELECT run_id, max(step) AS last_step, epoch_ns(min(start_ts)) AS first_start_ns,
                  epoch_ns(max(end_ts)) AS last_end_ns FROM steps GROUP BY run_id) s USING (run_id)
LEFT JOIN (SELECT run_id, epoch_ns(min(ts)) AS first_event_ns, epoch_ns(max(ts)) AS last_event_ns,
                  bool_or(event = '{sc.EVENT_IMPORTED}') AS imported,
                  count(DISTINCT rank) FILTER (WHERE event = '{sc.EVENT_ENDED}') AS ended_ranks,
                  epoch_ns(max(ts) FILTER (WHERE event = '{sc.EVENT_ENDED}')) AS ended_ns
           FROM events GROUP BY run_id) e USING (run_id)
LEFT JOIN (SELECT run_id, count(*) FILTER (WHERE state = 'firing') AS firing,
                  bool_or(state = 'firing' AND analyzer = 'hangs') AS hung
           FROM findings WHERE severity != 'info' GROUP BY run_id) f USING (run_id)
LEFT JOIN (SELECT run_id, analyzer || ' / ' || kind || ': ' || summary AS worst, severity AS worst_severity
           FROM findings WHERE severity != 'info' AND kind != 'not_judged'
           QUALIFY row_number() OVER (PARTITION BY run_id
                                      ORDER BY analyzer = 'failures' DESC, severity = 'critical' DESC,
                                               score DESC NULLS LAST, id) = 1) w USING (run_id)
LEFT JOIN (SELECT run_id, arg_max(step_start, id) AS failed_step, arg_max(evidence->>'$.in_short', id) AS failed_as
           FROM findings WHERE analyzer = 'failures' AND state != 'resolved' GROUP BY run_id) x USING (run_id)
ORDER BY r.first_seen DESC
"""

# The newest $window steps, one row per step: how fast the job goes now.
RECENT_STEPS = """
SELECT step, count(*) AS ranks, median(duration_s) AS step_s, sum(tokens) / median(duration_s) AS tokens_per_s,
       avg(mfu) AS mfu, max(end_ts) AS end_ts
FROM current_steps
WHERE run_id = $run AND step > (SELECT max(step) FROM current_steps WHERE run_id = $run) - $window
GROUP BY step ORDER BY step
"""

# Queries of a run's steps take the sidebar's window of steps, $first to $last (dashboard/ui.py `step_window`).

# The run's steps in the window, downsampled: medians over ranks per step, averaged over bins of steps.
STEP_SERIES = """
WITH per_step AS (
    SELECT step, max(end_ts) AS end_ts, median(duration_s) AS step_s, median(compute_s) AS compute_s,
           median(comm_wait_s) AS comm_wait_s, median(data_s) AS data_s,
           sum(tokens) / median(duration_s) AS tokens_per_s, avg(mfu) AS mfu,
           avg(loss) FILTER (WHERE isfinite(loss)) AS loss,
           avg(grad_norm) FILTER (WHERE isfinite(grad_norm)) AS grad_norm,
           count(*) FILTER (WHERE NOT isfinite(loss) OR NOT isfinite(grad_norm)) AS non_finite
    FROM current_steps WHERE run_id = $run AND step BETWEEN $first AND $last GROUP BY step),
bins AS (SELECT min(step) AS lo, greatest(1, ceil((max(step) - min(step) + 1) / $points))::BIGINT AS width
         FROM per_step)
SELECT min(step) AS step, max(end_ts) AS end_ts, avg(step_s) AS step_s, avg(compute_s) AS compute_s,
       avg(comm_wait_s) AS comm_wait_s, avg(data_s) AS data_s, avg(tokens_per_s) AS tokens_per_s, avg(mfu) AS mfu,
       avg(loss) AS loss, avg(grad_norm) AS grad_norm, sum(non_finite) AS non_finite
FROM per_step, bins GROUP BY (step - lo) // width ORDER BY step
"""

FINDINGS = """
SELECT id, analyzer, kind, ranks, step_start, step_end, severity, score, summary, evidence, state, created_at,
       updated_at
FROM findings WHERE run_id = $run ORDER BY state = 'firing' DESC, severity = 'critical' DESC, id DESC
"""

# The run's telemetry loss: rank-steps the collector never got, what the agents dropped (collector/analysis/losses.py).
TELEMETRY_LOSS = """
SELECT settled_step, ranks, expected, missing, gaps, gaps_left_out, agent_spans_dropped, agent_rank_steps_dropped
FROM telemetry_loss WHERE run_id = $run
"""

COMMANDS = """
SELECT id, kind, state, created_by, finding_id, apply_step, args, result, created_at, updated_at
FROM commands WHERE run_id = $run ORDER BY id
"""

# Power drawn at the newest samples: each rank's mean over the newest minute of samples, summed; when
# that was, and whether every one of those samples is a simulated GPU's.
POWER_NOW = f"""
WITH power AS (SELECT rank, ts, value, source FROM device_samples
               WHERE run_id = $run AND metric IN ('DCGM_FI_DEV_POWER_USAGE', 'DCGM_FI_DEV_POWER_USAGE_INSTANT'))
SELECT count(*) AS ranks, sum(watts) AS watts, max(as_of) AS as_of, bool_and(simulated) AS simulated
FROM (SELECT rank, avg(value) AS watts, max(ts) AS as_of, bool_and(source = '{sc.SOURCE_SIMULATED}') AS simulated
      FROM power WHERE ts > (SELECT max(ts) FROM power) - INTERVAL 60 SECOND GROUP BY rank)
"""

# Whether a run can be acted on now: how many of its ranks said their loop ended, whether a hang fires,
# and when it last sent anything.
RUN_ACTIVITY = f"""
SELECT (SELECT count(DISTINCT rank) FROM events WHERE run_id = $run AND event = '{sc.EVENT_ENDED}') AS ended_ranks,
       (SELECT count(*) FROM ranks WHERE run_id = $run) AS ranks,
       (SELECT count(*) > 0 FROM findings WHERE run_id = $run AND analyzer = 'hangs' AND state = 'firing') AS hung,
       (SELECT count(*) > 0 FROM events WHERE run_id = $run AND event = '{sc.EVENT_IMPORTED}') AS imported,
       greatest((SELECT max(end_ts) FROM steps WHERE run_id = $run), (SELECT max(ts) FROM events WHERE run_id = $run),
                (SELECT max(ts) FROM device_samples WHERE run_id = $run)) AS last_seen
"""

# The MegaScale view: each rank-step's own time over the step's median, in cells of about
# $rank_bins x $step_bins; a cell shows its worst rank-step, so one slow rank stays visible. A cell's
# ranks and steps are rank_lo to rank_hi and step_lo to step_hi, both ends in it. $ranks (a list;
# empty for all) keeps those rows only, against the median of every rank.
HEATMAP = f"""
WITH s AS (SELECT rank, step, {_OWN_TIME} AS c FROM current_steps
           WHERE run_id = $run AND step BETWEEN $first AND $last),
med AS (SELECT step, median(c) AS m FROM s GROUP BY step),
kept AS (SELECT * FROM s WHERE len($ranks) = 0 OR list_contains($ranks, rank)),
bins AS (SELECT min(step) AS lo, max(step) AS hi,
                greatest(1, ceil((max(step) - min(step) + 1) / $step_bins))::BIGINT AS sw,
                min(rank) AS r0, max(rank) AS r1,
                greatest(1, ceil((max(rank) - min(rank) + 1) / $rank_bins))::BIGINT AS rw FROM kept),
cells AS (SELECT lo + (step - lo) // sw * sw AS step_lo, least(lo + (step - lo) // sw * sw + sw - 1, hi) AS step_hi,
                 r0 + (rank - r0) // rw * rw AS rank_lo, least(r0 + (rank - r0) // rw * rw + rw - 1, r1) AS rank_hi,
                 rank, step, c / m AS ratio
          FROM kept JOIN med USING (step), bins WHERE m > 0)
SELECT step_lo, step_hi, rank_lo, rank_hi, max(ratio) AS ratio, arg_max(rank, ratio) AS worst_rank,
       arg_max(step, ratio) AS worst_step
FROM cells GROUP BY ALL
"""

# Ranks by their mean own time over the step median, slowest first, with the phases it is made of; of
# $ranks only (empty: all).
SLOWEST_RANKS = f"""
WITH s AS (SELECT rank, step, {_OWN_TIME} AS c, data_s, compute_s, comm_wait_s FROM current_steps
           WHERE run_id = $run AND step BETWEEN $first AND $last),
med AS (SELECT step, median(c) AS m FROM s GROUP BY step)
SELECT rank, avg(c / m) AS time_ratio, avg(data_s) AS data_s, avg(compute_s) AS compute_s,
       avg(comm_wait_s) AS comm_wait_s
FROM s JOIN med USING (step) WHERE m > 0 AND (len($ranks) = 0 OR list_contains($ranks, rank))
GROUP BY rank ORDER BY time_ratio DESC LIMIT $limit
"""

# Every rank of the run with its placement (host, stage, replica, TP rank, device), how its own time compares
# with the step median (as SLOWEST_RANKS), its input wait, compute, exposed communication, step time and newest
# step, and its GPU's mean power over the run's newest minute of samples (null where it sends none).
RANK_TABLE = f"""
WITH s AS (SELECT rank, step, {_OWN_TIME} AS c, data_s, compute_s, comm_wait_s, duration_s FROM current_steps
           WHERE run_id = $run AND step BETWEEN $first AND $last),
med AS (SELECT step, median(c) AS m FROM s GROUP BY step),
per_rank AS (SELECT rank, avg(c / m) AS time_ratio, median(data_s) AS data_s, median(compute_s) AS compute_s,
                    median(comm_wait_s) AS comm_wait_s, median(duration_s) AS step_s, max(step) AS last_step,
                    count(*) AS steps
             FROM s JOIN med USING (step) WHERE m > 0 GROUP BY rank),
power AS (SELECT rank, ts, value FROM device_samples
          WHERE run_id = $run AND metric IN ('DCGM_FI_DEV_POWER_USAGE', 'DCGM_FI_DEV_POWER_USAGE_INSTANT')),
watts AS (SELECT rank, avg(value) AS watts FROM power WHERE ts > (SELECT max(ts) FROM power) - INTERVAL 60 SECOND
          GROUP BY rank)
SELECT rank, host, local_rank, pp_stage, dp_rank, tp_rank, device, steps, last_step, time_ratio, data_s, compute_s,
       comm_wait_s, step_s, watts
FROM ranks LEFT JOIN per_rank USING (rank) LEFT JOIN watts USING (rank)
WHERE run_id = $run ORDER BY rank
"""

# One step of a few ranks, laid out in time from the step's first start: the ops the agent sent
# (phases, collectives), and for a rank-step without phase spans its data, compute and exposed
# communication from the step row. The ranks: the $slowest slowest of that step (of $ranks, where
# that list is not empty) and $typical around its median.
TIMELINE = f"""
WITH s AS (SELECT rank, epoch_ns(start_ts) AS t, data_s, coalesce(compute_s, duration_s) AS c, {_OWN_TIME} AS own,
                  duration_s
           FROM current_steps WHERE run_id = $run AND step = $step),
picked AS (
    (SELECT rank FROM s WHERE len($ranks) = 0 OR list_contains($ranks, rank) ORDER BY own DESC LIMIT $slowest)
    UNION
    (SELECT rank FROM s ORDER BY abs(own - (SELECT median(own) FROM s)) LIMIT $typical)),
t0 AS (SELECT min(t) AS t0 FROM s),
o AS (SELECT rank, kind, name, epoch_ns(start_ts) AS t, epoch_ns(end_ts) AS e FROM ops
      WHERE run_id = $run AND step = $step AND kind <> 'other' AND rank IN (SELECT rank FROM picked)),
derived AS (
    SELECT rank, unnest(['data', 'compute', 'exposed comm']) AS name,
           unnest([0, coalesce(data_s, 0), coalesce(data_s, 0) + c]) AS start_s,
           unnest([coalesce(data_s, 0), coalesce(data_s, 0) + c, duration_s]) AS end_s, t
    FROM s WHERE rank IN (SELECT rank FROM picked) AND rank NOT IN (SELECT rank FROM o WHERE kind = 'phase'))
SELECT rank, kind, name, (t - t0) / 1e9 AS start_s, (e - t0) / 1e9 AS end_s FROM o, t0
UNION ALL
SELECT rank, 'step' AS kind, name, (t - t0) / 1e9 + start_s, (t - t0) / 1e9 + end_s FROM derived, t0
WHERE end_s > start_s
ORDER BY rank, start_s
"""

# A finding's ranks against their peers, step by step from $first to $last (downsampled to about $points
# points): the median compute and input wait of $ranks, of the other ranks, and the median rank's step time.
SUSPECTS_VS_PEERS = """
WITH s AS (SELECT step, list_contains($ranks, rank) AS suspect, coalesce(compute_s, duration_s) AS c, data_s,
                  duration_s
           FROM current_steps WHERE run_id = $run AND step BETWEEN $first AND $last),
per_step AS (SELECT step, median(c) FILTER (WHERE suspect) AS suspects_compute_s,
                    median(c) FILTER (WHERE NOT suspect) AS peers_compute_s,
                    median(data_s) FILTER (WHERE suspect) AS suspects_data_s,
                    median(data_s) FILTER (WHERE NOT suspect) AS peers_data_s, median(duration_s) AS step_s
             FROM s GROUP BY step),
bins AS (SELECT min(step) AS lo, greatest(1, ceil((max(step) - min(step) + 1) / $points))::BIGINT AS width
         FROM per_step)
SELECT min(step) AS step, avg(suspects_compute_s) AS suspects_compute_s, avg(peers_compute_s) AS peers_compute_s,
       avg(suspects_data_s) AS suspects_data_s, avg(peers_data_s) AS peers_data_s, avg(step_s) AS step_s
FROM per_step, bins GROUP BY (step - lo) // width ORDER BY step
"""

# The run's first and last step, for step pickers.
STEP_RANGE = "SELECT min(step) AS first, max(step) AS last FROM current_steps WHERE run_id = $run"

# When a window of steps ran: its first step's start and its last step's end, on the wall clock.
STEP_TIMES = """
SELECT min(start_ts) AS start_ts, max(end_ts) AS end_ts FROM current_steps
WHERE run_id = $run AND step BETWEEN $first AND $last
"""

# Bus bandwidth by collective, size and group size (nccl-tests' busbw): its median and 10th percentile
# from one sort (the only sort: a median is the costliest thing here), the mean duration.
BUSBW = """
SELECT op, bytes, group_size, calls, q[1] AS busbw_gbps, q[2] AS busbw_p10_gbps, duration_s FROM (
    SELECT name AS op, bytes, group_size, count(*) AS calls, quantile_cont(busbw_gbps, [0.5, 0.1]) AS q,
           avg(duration_s) AS duration_s
    FROM ops WHERE run_id = $run AND kind = 'comm' AND busbw_gbps IS NOT NULL GROUP BY ALL)
ORDER BY op, bytes
"""

# The process groups with the lowest mean bus bandwidth (a slow link drags every call of its groups),
# against the median group of their op; means, not medians, so the scan needs no sort.
SLOWEST_GROUPS = """
WITH g AS (SELECT name AS op, comm_group, avg(busbw_gbps) AS busbw_gbps, count(*) AS calls FROM ops
           WHERE run_id = $run AND kind = 'comm' AND busbw_gbps IS NOT NULL GROUP BY ALL)
SELECT op, comm_group, busbw_gbps, busbw_gbps / median(busbw_gbps) OVER (PARTITION BY op) AS of_median, calls
FROM g ORDER BY of_median LIMIT $limit
"""

# Exposed communication per rank, in about $rank_bins bins of ranks.
EXPOSED_COMM = """
WITH s AS (SELECT rank, comm_wait_s, duration_s FROM current_steps
           WHERE run_id = $run AND step BETWEEN $first AND $last AND comm_wait_s IS NOT NULL),
bins AS (SELECT greatest(1, ceil((max(rank) + 1) / $rank_bins))::BIGINT AS rw FROM s)
SELECT rank // rw * rw AS rank_lo, max(rank) AS rank_hi, avg(comm_wait_s) AS comm_wait_s,
       avg(comm_wait_s / duration_s) AS share
FROM s, bins GROUP BY ALL ORDER BY rank_lo
"""

# What happened to a run's trajectory, by step: anomalies, rollbacks, checkpoints, injected faults.
# the steps a rollback abandoned, per step: what the kept curve no longer shows (a spike rolled back)
ROLLED_BACK = """
SELECT step, avg(loss) FILTER (WHERE isfinite(loss)) AS loss, avg(grad_norm) FILTER (WHERE isfinite(grad_norm))
       AS grad_norm
FROM rolled_back_steps WHERE run_id = $run GROUP BY step ORDER BY step LIMIT 10000
"""

MARKERS = f"""
SELECT step_start AS step, 'anomaly: ' || kind AS marker, summary AS detail FROM findings
WHERE run_id = $run AND analyzer = 'anomalies'
UNION ALL
SELECT CAST(args->>'before_step' AS BIGINT), 'rollback target', 'command ' || id || ', ' || state
FROM commands WHERE run_id = $run AND kind = 'rollback'
UNION ALL
SELECT CAST(result->>'restored_step' AS BIGINT), 'rollback restored', 'command ' || id FROM commands
WHERE run_id = $run AND kind = 'rollback' AND (result->>'restored_step') IS NOT NULL
UNION ALL
SELECT step, event, count(*) || ' rank(s)' || coalesce(': ' || any_value(attrs->>{sc.json_path(sc.FAULT_SPEC)}), '')
FROM events WHERE run_id = $run AND step IS NOT NULL
  AND event IN ('checkpoint_saved', 'checkpoint_restored', 'checkpoint_corrupt', 'fault_injected')
  -- snapshots in memory come every few steps: only those on disk are marked
  AND (event != 'checkpoint_saved' OR (attrs->>{sc.json_path(sc.CKPT_TIER)}) IS DISTINCT FROM '{sc.TIER_MEMORY}')
GROUP BY step, event
ORDER BY step
"""

# Where each rank was when last heard from, grouped: a hung job is many ranks in one collective
# and a few elsewhere.
LAST_HEARTBEATS = f"""
WITH last AS (
    SELECT rank, max(ts) AS last_seen, arg_max({{'step': step, 'phase': attrs->>{sc.json_path(sc.PHASE)},
           'op': attrs->>{sc.json_path(sc.COMM_OP)}, 'group': attrs->>{sc.json_path(sc.COMM_GROUP)},
           'seq': TRY_CAST(attrs->>{sc.json_path(sc.COMM_SEQ)} AS BIGINT),
           'done': TRY_CAST(attrs->>{sc.json_path(sc.COMM_DONE)} AS BOOLEAN)}}, ts) AS hb
    FROM events WHERE run_id = $run AND event = 'heartbeat' GROUP BY rank)
SELECT hb.step AS step, nullif(hb.phase, '') AS phase, hb.op AS op, hb."group" AS "group", hb.seq AS seq,
       hb.done AS done, count(*) AS ranks, list(rank ORDER BY rank) AS which, max(last_seen) AS last_seen
FROM last GROUP BY ALL ORDER BY ranks, step
"""

# Without heartbeats (an imported Flight Recorder dump): where each rank stands in each process group's
# collectives, grouped: the newest it entered, in what state, and the newest it completed. A group
# blocked in a collective shows most members inside it and its culprits before it. Point-to-point ops
# are left out: their numbers count a pair's transfers, not the group's collectives.
COLLECTIVE_PROGRESS = """
WITH last AS (
    SELECT comm_group, rank, max(seq) AS seq, arg_max(name, seq) AS op, arg_max(attrs->>'$.state', seq) AS state,
           max(seq) FILTER (WHERE (attrs->>'$.state') = 'completed') AS completed
    FROM ops WHERE run_id = $run AND kind = 'comm' AND seq IS NOT NULL AND (attrs->>'$.is_p2p') = 'false'
    GROUP BY comm_group, rank)
SELECT comm_group AS "group", op, seq, state, completed, count(*) AS ranks,
       list(rank ORDER BY rank) AS which
FROM last GROUP BY ALL ORDER BY "group", seq DESC, ranks DESC
"""

# Whether a run has GPU samples (NVML's, or a simulated GPU's), and whether any of them is simulated.
GPU_SAMPLES = f"""
SELECT EXISTS (SELECT 1 FROM device_samples WHERE run_id = $run
               AND source IN ('{sc.SOURCE_NVML}', '{sc.SOURCE_SIMULATED}')) AS gpus,
       EXISTS (SELECT 1 FROM device_samples WHERE run_id = $run AND source = '{sc.SOURCE_SIMULATED}') AS simulated
"""

# Which device metrics a run has, from how many ranks, and where they came from (nvml, simulated, rapl).
DEVICE_METRICS = """
SELECT metric, count(DISTINCT rank) AS ranks, count(*) AS samples, string_agg(DISTINCT source, ', ') AS sources
FROM device_samples WHERE run_id = $run
GROUP BY metric ORDER BY metric
"""

# Power, clocks, temperature, utilization, memory and link traffic per rank (each rank's mean;
# memory as a share of the GPU's), in about $rank_bins bins of ranks.
DEVICE_BY_RANK = """
WITH per_rank AS (
    SELECT metric, rank, avg(value) AS value FROM device_samples
    WHERE run_id = $run AND metric IN ('DCGM_FI_DEV_POWER_USAGE', 'DCGM_FI_DEV_POWER_USAGE_INSTANT',
                                       'DCGM_FI_DEV_SM_CLOCK', 'DCGM_FI_DEV_GPU_TEMP', 'DCGM_FI_DEV_GPU_UTIL',
                                       'DCGM_FI_PROF_NVLINK_TX_BYTES', 'DCGM_FI_PROF_PCIE_RX_BYTES')
    GROUP BY ALL
    UNION ALL
    SELECT 'memory_used_pct', rank, 100 * avg(value) FILTER (WHERE metric = 'DCGM_FI_DEV_FB_USED')
                                    / avg(value) FILTER (WHERE metric = 'DCGM_FI_DEV_FB_TOTAL')
    FROM device_samples WHERE run_id = $run AND metric IN ('DCGM_FI_DEV_FB_USED', 'DCGM_FI_DEV_FB_TOTAL')
    GROUP BY rank HAVING count(*) FILTER (WHERE metric = 'DCGM_FI_DEV_FB_TOTAL') > 0),
bins AS (SELECT greatest(1, ceil((max(rank) + 1) / $rank_bins))::BIGINT AS rw FROM per_rank)
SELECT metric, rank // rw * rw AS rank_lo, avg(value) AS mean, min(value) AS low, max(value) AS high,
       arg_min(rank, value) AS lowest_rank, arg_max(rank, value) AS highest_rank
FROM per_rank, bins GROUP BY ALL ORDER BY metric, rank_lo
"""

# Energy per step, all ranks together: the median step's, where the agent measured each rank-step's
# energy (rankwatch.energy_j), else each rank's mean power times the median step time.
ENERGY_PER_STEP = f"""
WITH measured AS (
    SELECT median(joules) AS joules FROM (
        SELECT step, sum(TRY_CAST(attrs->>{sc.json_path(sc.STEP_ENERGY_J)} AS DOUBLE)) AS joules FROM current_steps
        WHERE run_id = $run GROUP BY step)),
estimated AS (
    SELECT sum(watts) * (SELECT median(duration_s) FROM current_steps WHERE run_id = $run) AS joules
    FROM (SELECT rank, avg(value) AS watts FROM device_samples
          WHERE run_id = $run AND metric IN ('DCGM_FI_DEV_POWER_USAGE', 'DCGM_FI_DEV_POWER_USAGE_INSTANT')
          GROUP BY rank))
SELECT coalesce(measured.joules, estimated.joules) AS joules, measured.joules IS NOT NULL AS measured
FROM measured, estimated
"""

# Ranks whose clocks were held back, with the reasons' bits OR-ed and how often.
THROTTLED = """
SELECT rank, bit_or(value::BIGINT) AS reasons, count(*) FILTER (WHERE value > 0) AS throttled_samples,
       count(*) AS samples
FROM device_samples WHERE run_id = $run AND metric = 'DCGM_FI_DEV_CLOCKS_EVENT_REASONS'
GROUP BY rank HAVING bit_or(value::BIGINT) > 0 ORDER BY throttled_samples DESC, rank LIMIT $limit
"""

# GPUs with errors over the run: ECC errors that arose (the volatile counters' rise) and XIDs, per rank.
GPU_ERRORS = """
SELECT rank, max(value) FILTER (WHERE metric = 'DCGM_FI_DEV_ECC_SBE_VOL_TOTAL')
             - min(value) FILTER (WHERE metric = 'DCGM_FI_DEV_ECC_SBE_VOL_TOTAL') AS ecc_corrected,
       max(value) FILTER (WHERE metric = 'DCGM_FI_DEV_ECC_DBE_VOL_TOTAL')
             - min(value) FILTER (WHERE metric = 'DCGM_FI_DEV_ECC_DBE_VOL_TOTAL') AS ecc_uncorrected,
       list(DISTINCT value::BIGINT) FILTER (WHERE metric = 'DCGM_FI_DEV_XID_ERRORS') AS xids,
       max(ts) FILTER (WHERE metric = 'DCGM_FI_DEV_XID_ERRORS') AS last_xid
FROM device_samples
WHERE run_id = $run AND metric IN ('DCGM_FI_DEV_ECC_SBE_VOL_TOTAL', 'DCGM_FI_DEV_ECC_DBE_VOL_TOTAL',
                                   'DCGM_FI_DEV_XID_ERRORS')
GROUP BY rank
HAVING ecc_corrected > 0 OR ecc_uncorrected > 0 OR len(xids) > 0
ORDER BY ecc_uncorrected DESC NULLS LAST, len(xids) DESC, ecc_corrected DESC NULLS LAST, rank LIMIT $limit
"""

# The job's power over the run, in about $points bins of time from its first sample: the mean over the
# ranks sampled in the bin of each one's mean there, times the run's GPUs. Bins shorter than the sample
# period hold some ranks only: their sum drew a sawtooth between all GPUs and a few.
POWER_SERIES = """
WITH p AS (SELECT rank, epoch_ns(ts) AS t, value FROM device_samples
           WHERE run_id = $run AND metric IN ('DCGM_FI_DEV_POWER_USAGE', 'DCGM_FI_DEV_POWER_USAGE_INSTANT')),
b AS (SELECT min(t) AS t0, greatest(1, ceil((max(t) - min(t) + 1) / $points))::BIGINT AS w,
             count(DISTINCT rank) AS gpus FROM p),
per_rank AS (SELECT (t - t0) // w AS bin, rank, avg(value) AS watts FROM p, b GROUP BY ALL)
SELECT any_value(bin * w / 1e9) AS elapsed_s, avg(watts) * any_value(gpus) AS watts, any_value(gpus) AS gpus
FROM per_rank, b
GROUP BY bin ORDER BY bin
"""

# Memory tiers, per step in the window, downsampled: the time steps waited on copies between tiers no compute
# hid (mean over ranks), its share of the step, the copies' time and the host optimizer's (docs/telemetry.md).
TIER_SERIES = f"""
WITH per_step AS (
    SELECT step, avg(TRY_CAST(attrs->>{sc.json_path(sc.TRANSFER_EXPOSED_S)} AS DOUBLE)) AS exposed_s,
           avg(TRY_CAST(attrs->>{sc.json_path(sc.TRANSFER_EXPOSED_S)} AS DOUBLE) / duration_s) AS exposed_share,
           avg(TRY_CAST(attrs->>{sc.json_path(sc.TRANSFER_S)} AS DOUBLE)) AS transfer_s,
           avg(TRY_CAST(attrs->>{sc.json_path(sc.HOST_OPTIMIZER_S)} AS DOUBLE)) AS host_optimizer_s,
           max(duration_s) AS step_s
    FROM current_steps WHERE run_id = $run AND step BETWEEN $first AND $last
      AND ((attrs->>{sc.json_path(sc.TRANSFER_S)}) IS NOT NULL
           OR (attrs->>{sc.json_path(sc.HOST_OPTIMIZER_S)}) IS NOT NULL)
    GROUP BY step),
bins AS (SELECT min(step) AS lo, greatest(1, ceil((max(step) - min(step) + 1) / $points))::BIGINT AS width
         FROM per_step)
SELECT min(step) AS step, avg(exposed_s) AS exposed_s, avg(exposed_share) AS exposed_share,
       avg(transfer_s) AS transfer_s, avg(host_optimizer_s) AS host_optimizer_s, avg(step_s) AS step_s
FROM per_step, bins GROUP BY (step - lo) // width ORDER BY step
"""

# Each direction's bandwidth (bytes over the copies' time, all ranks) per step in the window, downsampled.
TIER_BANDWIDTH = f"""
WITH t AS (SELECT step, name AS direction, TRY_CAST(attrs->>{sc.json_path(sc.TRANSFER_BYTES)} AS BIGINT) AS bytes,
                  duration_s
           FROM ops WHERE run_id = $run AND kind = '{sc.KIND_TRANSFER}' AND step BETWEEN $first AND $last),
bins AS (SELECT min(step) AS lo, greatest(1, ceil((max(step) - min(step) + 1) / $points))::BIGINT AS width FROM t)
SELECT lo + (step - lo) // width * width AS step, direction, sum(bytes) / sum(duration_s) AS bytes_per_s
FROM t, bins WHERE duration_s > 0 GROUP BY ALL ORDER BY step, direction
"""

# What the disk the ranks swap to gave large sequential I/O at the job's start (the median rank's).
DISK_PROBE = f"""
SELECT median(TRY_CAST(attrs->>{sc.json_path(sc.DISK_PROBE_READ_BPS)} AS DOUBLE)) AS read_bps,
       median(TRY_CAST(attrs->>{sc.json_path(sc.DISK_PROBE_WRITE_BPS)} AS DOUBLE)) AS write_bps, count(*) AS ranks
FROM events WHERE run_id = $run AND event = '{sc.EVENT_DISK_PROBE}'
"""

QUERIES = {
    name.lower(): sql
    for name, sql in globals().items()
    if name.isupper() and not name.startswith("_") and isinstance(sql, str)
}
