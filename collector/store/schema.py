"""The DuckDB schema: the one definition of every table the collector writes.

docs/telemetry.md documents each column and how OTLP maps onto it. Ingest
builds Arrow batches whose column names match these tables and inserts them
BY NAME, so a column missing from a batch takes its default.
"""

DDL = """
CREATE TABLE IF NOT EXISTS runs (
    run_id      VARCHAR PRIMARY KEY,
    world_size  INTEGER,
    first_seen  TIMESTAMPTZ NOT NULL
);

CREATE TABLE IF NOT EXISTS ranks (
    run_id      VARCHAR NOT NULL,
    rank        INTEGER NOT NULL,
    host        VARCHAR,
    local_rank  INTEGER,
    dp_rank     INTEGER,
    pp_stage    INTEGER,
    tp_rank     INTEGER,
    device      VARCHAR,
    pid         BIGINT,
    first_seen  TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (run_id, rank)
);

CREATE TABLE IF NOT EXISTS steps (
    run_id       VARCHAR NOT NULL,
    rank         INTEGER NOT NULL,
    step         BIGINT NOT NULL,
    start_ts     TIMESTAMP_NS NOT NULL,
    end_ts       TIMESTAMP_NS NOT NULL,
    duration_s   DOUBLE NOT NULL,
    data_s       DOUBLE,
    compute_s    DOUBLE,
    comm_wait_s  DOUBLE,
    loss         DOUBLE,
    grad_norm    DOUBLE,
    tokens       BIGINT,
    lr           DOUBLE,
    mfu          DOUBLE,
    energy_j     DOUBLE,
    trace_id     BLOB,
    span_id      BLOB,
    attrs        JSON
);

CREATE TABLE IF NOT EXISTS ops (
    run_id          VARCHAR NOT NULL,
    rank            INTEGER NOT NULL,
    step            BIGINT,
    kind            VARCHAR NOT NULL,
    name            VARCHAR NOT NULL,
    start_ts        TIMESTAMP_NS NOT NULL,
    end_ts          TIMESTAMP_NS NOT NULL,
    duration_s      DOUBLE NOT NULL,
    microbatch      INTEGER,
    comm_group      VARCHAR,
    group_size      INTEGER,
    seq             BIGINT,
    bytes           BIGINT,
    algbw_gbps      DOUBLE,
    busbw_gbps      DOUBLE,
    trace_id        BLOB,
    span_id         BLOB,
    parent_span_id  BLOB,
    attrs           JSON
);

CREATE TABLE IF NOT EXISTS device_samples (
    run_id  VARCHAR NOT NULL,
    rank    INTEGER NOT NULL,
    ts      TIMESTAMP_NS NOT NULL,
    metric  VARCHAR NOT NULL,
    value   DOUBLE NOT NULL,
    gpu     INTEGER,
    source  VARCHAR,
    attrs   JSON
);

CREATE TABLE IF NOT EXISTS events (
    run_id    VARCHAR NOT NULL,
    rank      INTEGER,
    ts        TIMESTAMP_NS NOT NULL,
    event     VARCHAR NOT NULL,
    step      BIGINT,
    severity  VARCHAR,
    body      VARCHAR,
    attrs     JSON
);

CREATE SEQUENCE IF NOT EXISTS findings_id;
CREATE TABLE IF NOT EXISTS findings (
    id          BIGINT PRIMARY KEY DEFAULT nextval('findings_id'),
    run_id      VARCHAR NOT NULL,
    analyzer    VARCHAR NOT NULL,
    kind        VARCHAR NOT NULL,
    ranks       INTEGER[],
    step_start  BIGINT,
    step_end    BIGINT,
    severity    VARCHAR NOT NULL,
    score       DOUBLE,
    summary     VARCHAR,
    evidence    JSON,
    state       VARCHAR NOT NULL DEFAULT 'firing',
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);

CREATE SEQUENCE IF NOT EXISTS commands_id;
CREATE TABLE IF NOT EXISTS commands (
    id          BIGINT PRIMARY KEY DEFAULT nextval('commands_id'),
    run_id      VARCHAR NOT NULL,
    kind        VARCHAR NOT NULL,
    args        JSON,
    state       VARCHAR NOT NULL DEFAULT 'pending',
    created_by  VARCHAR NOT NULL,
    finding_id  BIGINT,
    apply_step  BIGINT,
    result      JSON,
    created_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    updated_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- The steps of each run's current trajectory: the rows a rollback abandoned (the restored step
-- and those after it that finished before training resumed: a checkpoint of step N holds N
-- steps done, so training goes on at step N) left out. An anti-join written as a LEFT
-- JOIN: DuckDB pushes a filter on steps (end_ts, run_id) through it, where a NOT EXISTS made it
-- read every row of the table (10x slower on 15M rank-steps).
CREATE OR REPLACE VIEW current_steps AS
SELECT s.* FROM steps s LEFT JOIN commands c
    ON c.run_id = s.run_id AND c.kind = 'rollback' AND c.state = 'applied'
   AND s.step >= CAST(c.result->>'restored_step' AS BIGINT)
   AND epoch_ns(s.end_ts) < CAST(c.result->>'resumed_ns' AS BIGINT)
WHERE c.id IS NULL;

-- Their complement: the rows a rollback abandoned (a loss spike that was rolled back is there).
CREATE OR REPLACE VIEW rolled_back_steps AS
SELECT s.* FROM steps s JOIN commands c
    ON c.run_id = s.run_id AND c.kind = 'rollback' AND c.state = 'applied'
   AND s.step >= CAST(c.result->>'restored_step' AS BIGINT)
   AND epoch_ns(s.end_ts) < CAST(c.result->>'resumed_ns' AS BIGINT);

CREATE TABLE IF NOT EXISTS exports (
    digest       BLOB PRIMARY KEY,
    signal       VARCHAR NOT NULL,
    items        INTEGER NOT NULL,
    received_at  TIMESTAMPTZ NOT NULL
);

-- Alerts raised by findings: one row per firing episode of a label set (a finding that
-- escalates from warning to critical ends one alert and starts another).
CREATE SEQUENCE IF NOT EXISTS alerts_id;
CREATE TABLE IF NOT EXISTS alerts (
    id           BIGINT PRIMARY KEY DEFAULT nextval('alerts_id'),
    finding_id   BIGINT NOT NULL,
    run_id       VARCHAR NOT NULL,
    analyzer     VARCHAR NOT NULL,
    fingerprint  VARCHAR NOT NULL,
    labels       JSON NOT NULL,
    annotations  JSON NOT NULL,
    starts_at    TIMESTAMPTZ NOT NULL,
    ends_at      TIMESTAMPTZ
);

-- Webhook notifications, written in the transaction that changed their findings and posted
-- from here (collector/alerts/delivery.py): pending -> delivered, expired or dropped.
CREATE SEQUENCE IF NOT EXISTS outbox_id;
CREATE TABLE IF NOT EXISTS outbox (
    id               BIGINT PRIMARY KEY DEFAULT nextval('outbox_id'),
    receiver         VARCHAR NOT NULL,
    webhook_id       VARCHAR NOT NULL,
    body             VARCHAR NOT NULL,
    state            VARCHAR NOT NULL DEFAULT 'pending',
    attempts         INTEGER NOT NULL DEFAULT 0,
    next_attempt_at  TIMESTAMPTZ NOT NULL DEFAULT now(),
    last_error       VARCHAR,
    created_at       TIMESTAMPTZ NOT NULL DEFAULT now(),
    settled_at       TIMESTAMPTZ
);

-- Where the analysis engine stands on each run (collector/analysis/engine.py): the newest step it judged,
-- the newest applied rollback it saw and the ranks it knew, written in the transaction of the
-- pass's findings, so that a collector started again (after a crash too) judges each step once still.
CREATE TABLE IF NOT EXISTS analysis_cursors (
    run_id    VARCHAR PRIMARY KEY,
    step      BIGINT NOT NULL,
    rollback  BIGINT NOT NULL,
    world     INTEGER NOT NULL
);

-- The rank-steps each run's collector expected but never got (collector/analysis/losses.py): a rank
-- of the run silent at a step its peers reported, counted once the step is settled (the run moved
-- MARGIN steps past it, or ended). `gaps`: where, as [first rank, last rank, first step, last step]
-- blocks (the steps those ranks all lack within the range), at most a few hundred; the counts are exact.
-- `agent_*`: what the ranks' agents reported dropping (`telemetry_loss` events): the sums, each
-- rank's largest counts ({rank: [spans, rank-steps]}), and the newest report read.
CREATE TABLE IF NOT EXISTS telemetry_loss (
    run_id        VARCHAR PRIMARY KEY,
    settled_step  BIGINT NOT NULL,
    ranks         INTEGER NOT NULL,
    expected      BIGINT NOT NULL,
    missing       BIGINT NOT NULL,
    gaps          JSON NOT NULL,
    gaps_left_out BIGINT NOT NULL,
    agent_spans_dropped       BIGINT NOT NULL,
    agent_rank_steps_dropped  BIGINT NOT NULL,
    agent_ranks   JSON NOT NULL,
    agent_seen_ns BIGINT NOT NULL,
    updated_at    TIMESTAMPTZ NOT NULL DEFAULT now()
);
"""

# A finding's states (`findings.state`): it holds, it stopped holding, it held to its run's end
FIRING, RESOLVED, ENDED = "firing", "resolved", "ended"
# Why findings stopped firing all at once (their evidence's `resolved`)
RUN_ENDED = "run ended"  # every rank of the run said its loop ended
TRACE_ENDED = "trace ended"  # an imported run's findings, drawn over the whole trace
ROLLED_BACK = "rolled back"  # found on steps a rollback abandoned

# Tables that ingest appends Arrow batches to, by OTLP signal.
TELEMETRY_TABLES = ("steps", "ops", "device_samples", "events")

# A lake (collector/store/lake.py) holds what is appended in its Parquet files, and the other tables, which
# are keyed and updated in place, in its catalog database (PostgreSQL), with two tables of its own:
LAKE_TABLES = (*TELEMETRY_TABLES, "exports")
LAKE_ONLY_DDL = """
-- Which collector may store an export (by its digest): the first to claim it, or one that takes over a
-- claim older than the claim's lease (its collector died). The export is stored once its digest is in
-- `exports`, in the transaction of its rows.
CREATE TABLE IF NOT EXISTS claims (
    digest      BLOB PRIMARY KEY,
    holder      VARCHAR NOT NULL,
    claimed_at  TIMESTAMPTZ NOT NULL
);

-- Which collector does a job that one alone may do, until `expires_at`: lead a run's analysis (`kind`
-- 'run', `name` its id), deliver the alerts (`kind` 'alerts'). It renews the lease as it works; another
-- takes it once it has expired.
CREATE TABLE IF NOT EXISTS leases (
    kind        VARCHAR NOT NULL,
    name        VARCHAR NOT NULL,
    holder      VARCHAR NOT NULL,
    expires_at  TIMESTAMPTZ NOT NULL,
    PRIMARY KEY (kind, name)
);
"""
