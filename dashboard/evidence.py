"""A finding's evidence as people read it, whatever the analyzer: its figures in words and units,
its per-rank values (a 1,024-rank map is a top-N chart, not 1,024 lines of floats), its per-step
values as a series, its records as tables; and what to do about each kind of finding, by the phase
it blames where it names one."""

from dataclasses import dataclass

import pandas as pd

from collector import ranksets
from dashboard.markdown import literal
from dashboard.units import figure, label, unit
from rankwatch.agent import semconv as sc

TOP_RANKS = 10  # ranks a per-rank chart draws; the rest are summed up in words
TABLE_ROWS = 20  # rows of an evidence table shown; the rest are counted
# the phase a straggler's evidence blames, in words
PHASES = {sc.KIND_DATA: "input wait (data loading)", sc.KIND_COMPUTE: "compute"}
# Evidence drawn from device samples (the straggler analyzer's GPU readings and what they say of why): said to
# be simulated where the run's GPUs are
FROM_DEVICES = ("devices", "hardware")

# What to do about a finding, by "analyzer / phase" (the phase its evidence blames, where it names one: what
# to do differs by where the time goes), else by "analyzer / kind", else by analyzer: the one place these
# texts live
NEXT_STEPS: dict[str, str] = {
    f"stragglers / {sc.KIND_DATA}": "The slow ranks wait for their input: give their DataLoader more workers "
    "(`num_workers`) and batches in flight (`prefetch_factor`), pin its memory (`pin_memory=True`), check the "
    "storage it reads (a local copy or cache of the data set, its read throughput), and what else contends for "
    "that host's CPUs (other jobs, preprocessing threads).",
    "stragglers / rank": "The slow ranks compute slower than their peers: check their GPUs' clocks, throttling "
    "and temperature (Power page), then drain the node if the hardware is at fault.",
    "stragglers / node": "One host is slow: check its GPUs' clocks and thermals (Power page) and its CPU, "
    "then drain it and restart from the last checkpoint.",
    "stragglers / stage": "One pipeline stage is slow: rebalance its layers across stages, or check its hosts.",
    "stragglers / widespread": "Work is uneven across ranks: balance sequence lengths (packing, length-bucketed "
    "batches) rather than looking for one bad host.",
    "hangs": "The culprit ranks never entered the collective the others wait in: the Hangs page shows the line "
    "each rank is stuck at and what their Flight Recorders say (asked of every rank when the hang fired; "
    "`rankwatch stacks RUN` asks again). Fix or drain the culprit's node (`rankwatch nodes RUN --unhealthy`), "
    "then restart from the last checkpoint.",
    "anomalies / nan": "Rolled back automatically where the job takes commands (Checkpoints page); if it "
    "recurs, check the data batch at the first bad step, lower the learning rate or clip gradients.",
    "anomalies / loss_spike": "Rolled back automatically where the job takes commands (Checkpoints page); check "
    "the data batch at the spike, and the learning rate schedule there.",
    "anomalies / grad_spike": "Check the data batch at the spike; clip gradients if spikes recur.",
    "links": "Check the NICs and NVLink of those ranks (`ibstat`, `nvidia-smi nvlink -s`, link error counters) "
    "and the topology NCCL chose (`NCCL_DEBUG=INFO`).",
    "collectives": "The ranks called different collectives: find the code path that diverged (rank-dependent "
    "branches, uneven data) from the calls in the evidence.",
    "rollbacks": "A rollback did not get past the anomaly: inspect the data from the restored step on before "
    "resuming by hand.",
    "power / job_cap": "Apply the cap with the command on the Power page while the job runs, or set it in the "
    "next run's launch script.",
    "power / per_rank_caps": "Apply the per-rank caps (`rankwatch power recommend --json`, then `power apply "
    "--caps`) while the job runs.",
    "power / headroom": "Size the next job or the facility's budget from the nodes' p99 draw (Power page).",
    "predicted": "Every rank computes slower than its devices' and hosts' state predicts: look for what they "
    "share and the model does not read (a new software version or setting, the data pipeline, a job sharing "
    "the hosts); compare a step's profile with one from a run at the predicted speed.",
    "tiers / host_bound": "The host's work holds the step: overlap it with compute (`--offload-schedule overlap`), "
    "give each rank more of the host's cores, or keep the optimizer on the device if its memory allows.",
    "tiers / swap_bound": "The steps wait on copies between tiers: overlap them with compute (`--offload-schedule "
    "overlap`), copy in larger blocks, or keep more on the device; the figures above say which tier limits them.",
    "tiers / slow_disk": "One rank's disk runs at a fraction of its peers': check that disk (its health, another job "
    "on it, its queue), or move the rank's swap files to another.",
    "tiers / checkpoint_contention": "A checkpoint to the same disk slowed the swaps: write checkpoints to another "
    "disk, or less often.",
    "whatif": "Open the named ranks' steps in the trace (Perfetto, Holistic Trace Analysis) and compare their "
    "kernels with a peer's; launch delay and idle well above 1x the ops back to back point at the host side "
    "(data loading, Python overhead, synchronisations) rather than the GPU.",
}


def next_step(finding: pd.Series) -> str | None:
    """The line saying what to do about a finding (a row of the findings query), as Markdown: its evidence's
    own (`what_to_do`, in the figures it holds: a failed rank's host, its stack's last lines; stored text, so
    shown as written), else by the phase its evidence blames, its analyzer and kind; None where none is known."""
    if told := (finding["evidence"] or {}).get("what_to_do"):
        return "  \n".join(literal(line) for line in str(told).splitlines())
    phase = (finding["evidence"] or {}).get("phase")
    keys = (f"{finding['analyzer']} / {phase}", f"{finding['analyzer']} / {finding['kind']}", finding["analyzer"])
    return next((NEXT_STEPS[key] for key in keys if key in NEXT_STEPS), None)


@dataclass(frozen=True)
class Evidence:
    """An evidence dict taken apart by shape: `figures` (what, value: scalars in words and units),
    `by_rank` and `by_step` (key, values indexed by rank or step), `tables` (key, rows as text)."""

    figures: pd.DataFrame
    by_rank: list[tuple[str, pd.Series]]
    by_step: list[tuple[str, pd.Series]]
    tables: list[tuple[str, pd.DataFrame]]


def read(evidence: dict) -> Evidence:
    """The shapes analyzers put in evidence: {rank: number} maps, {step: number} series (anomalies'
    `values`, `*_by_step`), {name: {field: value}} and [{field: value}] records, {field: value}
    groups of figures, and figures; and a hang's merged stacks (`stacks`), a table of where each group
    of ranks is, and its ranks' Flight Recorders matched (`flight_recorder`), a table of what they say."""
    figures: list[tuple[str, str]] = []
    by_rank: list[tuple[str, pd.Series]] = []
    by_step: list[tuple[str, pd.Series]] = []
    tables: list[tuple[str, pd.DataFrame]] = []
    for key, value in evidence.items():
        if key == "stacks" and isinstance(value, dict):
            stacks_table, unanswered = stacks(value)
            tables += [("stacks", stacks_table)] if not stacks_table.empty else []
            figures += [("stacks: not answered", unanswered)] if unanswered else []
        elif key == "flight_recorder" and isinstance(value, dict):
            verdicts, said = recorders(value)
            tables += [("flight_recorder", verdicts)] if not verdicts.empty else []
            figures.append(("flight recorder", said))
        elif isinstance(value, dict) and value and all(str(k).isdigit() and _number(v) for k, v in value.items()):
            series = pd.Series({int(k): float(v) for k, v in value.items()}).sort_index()
            (by_step if key == "values" or key.endswith("by_step") else by_rank).append((key, series))
        elif isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            rows = pd.DataFrame([_row(name, fields) for name, fields in value.items()])
            tables.append(
                (key, rows.rename(columns={"": "rank" if all(str(k).isdigit() for k in value) else label(key)}))
            )
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            rows = pd.DataFrame([_row("", fields) for fields in value]).drop(columns="")
            tables.append((key, rows.fillna("—")))  # a field some records lack
        elif isinstance(value, dict):  # a group: in the unit its key names (`busy_power_w`), else each field's
            figures += [(f"{label(key)}: {label(k)}", _shown(key if unit(key) else k, v)) for k, v in value.items()]
        else:
            figures.append((label(key), _shown(key, value)))
    return Evidence(pd.DataFrame(figures, columns=["what", "value"]), by_rank, by_step, tables)


def stacks(merged: dict) -> tuple[pd.DataFrame, str]:
    """A hang's merged stacks (collector/analysis/stacks.py) as people read them: a row per group of ranks
    (its ranks as ranges, where its main thread is, the odd group out marked), and the ranks asked that did
    not answer as ranges ("" for none)."""
    rows = [
        {
            "ranks": ranksets.compact(group.get("ranks", [])),
            "where": str(group.get("where", "")) + ("  (the odd one out)" if i == merged.get("odd") else ""),
        }
        for i, group in enumerate(merged.get("groups") or [])
        if isinstance(group, dict)
    ]
    unanswered = ranksets.compact(merged.get("unanswered") or [])
    if unanswered and not merged.get("settled"):
        unanswered += " (so far)"
    return pd.DataFrame(rows, columns=["ranks", "where"]), unanswered


def recorders(told: dict) -> tuple[pd.DataFrame, str]:
    """What a hang's ranks' Flight Recorder entries say, matched across ranks (collector/analysis/recorded.py):
    a row per finding (its culprit ranks as ranges, its summary), and in words how many ranks' entries were
    matched, how many findings the rows leave out, and the ranks whose Flight Recorder could not be read."""
    rows = [
        {"culprits": ranksets.compact(v.get("ranks") or []), "verdict": str(v.get("summary", ""))}
        for v in told.get("verdicts") or []
        if isinstance(v, dict)
    ]
    said = f"the entries of {told.get('ranks')} ranks matched across ranks"
    if told.get("more"):
        said += f"; {told['more']} more findings than shown"
    elif not rows:
        said += ": all matched"
    if told.get("unreadable"):
        said += f"; what {ranksets.phrase(told['unreadable'])} gave is no Flight Recorder"
    return pd.DataFrame(rows, columns=["culprits", "verdict"]), said


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _shown(key: str, value: object) -> str:
    """One value in words: a list of ranks as ranges, a `*_range` pair in its unit, else `figure`."""
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return ranksets.compact(value)
    if key.endswith("_range") and isinstance(value, list) and len(value) == 2:
        return " to ".join(figure(key.removesuffix("_range"), v) for v in value)
    return figure(key, value)


def _row(name: str, fields: dict) -> dict[str, str]:
    """A record's fields as text, each in its field's unit, else in the unit its row names (a device metric); a
    `metric` field (the device metric a hardware cause names) by its heading."""
    return {
        "": label(name),
        **{
            label(k): label(v) if k == "metric" and isinstance(v, str) else _shown(k if unit(k) else name, v)
            for k, v in fields.items()
        },
    }


def rest_of_ranks(key: str, series: pd.Series) -> str | None:
    """What a top-N chart of `series` leaves out, in words; None where it draws every rank."""
    rest = series.sort_values(ascending=False).iloc[TOP_RANKS:]
    if rest.empty:
        return None
    low, high = figure(key, rest.min()), figure(key, rest.max())
    if low == high:
        return f"{len(rest):,} more ranks, all {low}"
    return f"{len(rest):,} more ranks, {low} to {high} (median of all {figure(key, series.median())})"
