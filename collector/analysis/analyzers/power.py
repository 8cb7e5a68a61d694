"""Power-cap recommendations: the power limit for the job or for each rank that saves energy at
an acceptable cost in step time, and how many more nodes a facility's power would hold.

A pure function from a run's rank-steps (with each step's energy and power limit), device
samples and placement to a report and findings. Three analyses:

Job cap, after Zeus's GlobalPowerLimitOptimizer. Each step that every GPU ran under the same
limit (a profiling sweep, or caps changed along the way) is a measurement of that limit: per
limit, the mean step time (median rank) and energy per step (all GPUs), each with its standard
error over steps, the first `warmup` steps after a change left out. That is the time/energy
trade-off curve. A run measured at one limit only gets the curve the GPU's power model
predicts from its steps instead (below). A policy picks a limit on it: the lowest ZeusCost
eta * energy + (1 - eta) * max_power * time, the least energy within a slowdown, the least
energy, or the fastest whose limits sum within a power budget.

Per-rank caps. In synchronous training a rank that finishes its compute early waits for the
slowest in the next collective; that wait, its exposed communication time less the transfer
itself (the least any rank waited at that step), is slack: it can compute more slowly, at a
lower clock and power, without delaying the step. A rank that computes notably longer than the
median rank is one of the slow ones the others wait for: its slack is only a slower one's lead
among them, and it keeps its limit. The clock a rank needs is
clock_now * compute / (compute + safety * slack) (its median compute and slack over the
judged steps), and its cap the power model's power at that clock and its load: the GPU
power model (rankwatch/agent/gpumodel.py), P = P_idle + (P_max - P_idle) * u * (f / f_max)^3, with u
the rank's utilization while busy (a high quantile of its samples). A straggler has no slack
and keeps its limit (as does any slow rank, above); so does a rank that throttles for heat (most
of its samples): its clock is held by its temperature, not its limit, and a cap at its present
draw would bind once it cooled, making it a straggler. `safety` is the largest (up to
`max_safety`) whose predicted step-time loss stays within `max_loss`: with a thousand ranks,
the one whose noise runs long at a step sets that step's pace, so a rank must not fill all of
its median slack.

Predictions replay steps drawn afresh from the judged ones: each a judged step whose ranks'
compute, as ratios to their own median, is shuffled among them (so caps set from the judged
steps are not judged on the very noise they were set from), through whatif's step model: a
step lasts as long as the slowest rank's data and compute, plus the transfer. The energy of
each rank-step is busy power over its compute and waiting power over the rest of the step.
A prediction is the measured value plus the model's difference, and its range is what a re-run
of as many steps would measure: a bootstrap with the before and after steps resampled
independently.

Facility headroom, after POLCA, where the facility's power budget is given (a default would
be a guess). The GPUs' power, averaged per rank over buckets of `bucket_s`, summed per node
(host) and over the job: the nodes' p99 and peak against the power provisioned. Nodes of a
synchronous job draw together, so k more nodes like these draw
the job's total scaled by (N + k) / N at the same moments; the risk is the share of moments
that would exceed the budget.
"""

import math
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from collector import ranksets
from collector.findings import POWER, Finding
from collector.quantities import energy, energy_wh, percent, plural, power
from rankwatch.agent import semconv as sc
from rankwatch.agent.gpumodel import THERMAL, GpuModel, operating_points

ANALYZER = POWER
POWER_METRICS = (sc.POWER_W, sc.POWER_INSTANT_W)
SIMULATED = "simulated GPUs, not measured hardware"  # how advice drawn from simulated samples is labelled


@dataclass(frozen=True)
class Settings:
    window: int = 50  # recent steps the per-rank caps are judged over
    max_safety: float = 0.9  # the most of a rank's slack its slower compute may fill
    max_loss: float = 0.005  # predicted step-time loss per-rank caps may cost
    min_change_w: float = 10.0  # a cap within this of the limit in force is not worth setting
    slow: float = 0.03  # a rank computing this much longer than the median rank is one the others wait for
    warmup: int = 2  # steps after a change of the job's limit that are left out (Zeus's warm-up)
    min_steps: int = 3  # steps a limit needs to be a measured point of the curve
    model_step_w: float = 25.0  # spacing of the limits of a modelled curve
    draws: int = 1000  # steps drawn afresh for predictions
    bucket_s: float = 1.0  # the facility's power is judged per bucket of this length
    risk: float = 0.01  # the share of moments over the budget that is acceptable (p99)
    bootstrap: int = 400
    seed: int = 0


@dataclass(frozen=True)
class Policy:
    """How a job cap is picked from the curve: zeus (value: eta), max-slowdown (value: the
    fraction), min-energy, or budget (value: W for all GPUs together)."""

    kind: str
    value: float | None = None

    @classmethod
    def parse(cls, text: str) -> "Policy":
        """A policy from `zeus:0.5`, `max-slowdown:0.02`, `min-energy` or `budget:WATTS`;
        ValueError with a one-line reason otherwise."""
        kind, _, raw = text.partition(":")
        if kind == "min-energy" and not raw:
            return cls(kind)
        if kind not in ("zeus", "max-slowdown", "budget") or not raw:
            raise ValueError(
                f"unknown policy {text!r}; policies: zeus:ETA, max-slowdown:FRACTION, min-energy, budget:WATTS"
            )
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"policy {text!r}: {raw!r} is not a number") from None
        if (kind == "zeus" and not 0 <= value <= 1) or value < 0 or not math.isfinite(value):
            raise ValueError(f"policy {text!r}: " + ("eta is within 0..1" if kind == "zeus" else "must be >= 0"))
        return cls(kind, value)

    def __str__(self) -> str:
        return self.kind if self.value is None else f"{self.kind}:{self.value:g}"


@dataclass
class Point:
    """One power limit on the trade-off curve: per step, all GPUs together."""

    cap_w: float
    source: str  # measured | model
    steps: int
    step_s: float
    step_s_se: float  # standard error over steps
    energy_j: float
    energy_j_se: float
    power_w: float  # energy / time
    slowdown: float = 1.0  # step time over the curve's highest limit's
    energy_saving: float = 0.0  # 1 - energy over the highest limit's
    zeus_cost: float = 0.0  # eta * energy + (1 - eta) * max_power * time, with the policy's eta (0.5 otherwise)


@dataclass
class RankCap:
    """One rank's recommendation; `cap_w` None: keep the limit in force."""

    rank: int
    cap_w: float | None
    limit_w: float  # in force over the judged steps
    compute_s: float  # median over the judged steps
    slack_s: float  # median
    load: float  # utilization while busy
    clock_mhz: float  # under load now
    new_clock_mhz: float
    stretch: float  # compute at the new clock over now
    saving_j_per_step: float
    kept_because: str | None = None  # where `cap_w` is None: slow (the others wait for it), thermal, or little slack


KEPT_BECAUSE = {  # why a rank keeps its limit, as a finding's summary says it (by the number of ranks)
    "slow": ("the slow one the others wait for", "slow ones the others wait for"),
    "thermal": ("throttled by heat", "throttled by heat"),
    "little slack": ("too little slack", "too little slack"),
}


@dataclass
class PerRank:
    """Per-rank caps and what the replay predicts of them."""

    step_start: int
    step_end: int
    caps: dict[int, float]  # rank -> W: the ranks to cap
    ranks: list[RankCap]
    safety: float  # the share of their slack the capped ranks' compute fills
    step_s: float  # measured before: mean over the judged steps of the median rank's
    energy_j_per_step: float  # measured (or modelled, without energy) before
    saving_j_per_step: float
    saving_j_per_step_range: tuple[float, float]  # what a re-run of as many steps would measure, 95%
    saving_fraction: float
    slowdown: float
    slowdown_range: tuple[float, float]
    saving_kwh_run: float  # had the caps been in force for the whole run


@dataclass
class Headroom:
    """How many more nodes like the job's fit under `facility_w`, and at what risk."""

    facility_w: float
    nodes: int
    buckets: int
    node_nameplate_w: float  # GPUs per node x the highest limit
    node_p99_w: float  # median over nodes of each node's p99
    node_peak_w: float
    job_p99_w: float
    job_peak_w: float
    extra_nodes_nameplate: int
    extra_nodes_peak: int
    extra_nodes: int  # at the risk setting
    risk: float  # of exceeding, with `extra_nodes` more
    risk_by_extra_nodes: dict[int, float] = field(default_factory=dict)


@dataclass
class PowerReport:
    run_id: str
    policy: str
    ranks: int
    steps: int
    curve: list[Point]
    job_cap: Point | None
    per_rank: PerRank | None
    headroom: Headroom | None
    findings: list[Finding]
    simulated: bool = False  # drawn from simulated GPUs' samples (the fleet simulator), not hardware


@dataclass
class _Grid:
    """The judged steps as step x rank arrays."""

    steps: np.ndarray
    ranks: np.ndarray
    duration: np.ndarray
    data: np.ndarray
    compute: np.ndarray
    wait: np.ndarray
    energy: np.ndarray | None  # None where any rank-step lacks it


def _modelled(busy_w: np.ndarray, wait_w: np.ndarray, compute: np.ndarray, duration: np.ndarray) -> np.ndarray:
    """Per rank-step, the GPU's energy under the power model: busy power over the compute,
    waiting power over the rest of the step."""
    return busy_w * compute + wait_w * (duration - compute)


class _Draws:
    """Steps drawn afresh from the judged ones (module docstring), with their measured time and energy."""

    def __init__(self, g: _Grid, profile: pd.DataFrame, count: int, rng: np.random.Generator):
        typical = np.median(g.compute, axis=0)
        self.busy_w, self.wait_w = profile["busy_w"].to_numpy(), profile["wait_w"].to_numpy()
        self.step_time = np.median(g.duration, axis=1)  # of the judged steps
        self.step_energy = (
            g.energy.sum(axis=1)
            if g.energy is not None
            else _modelled(self.busy_w, self.wait_w, g.compute, g.duration).sum(axis=1)
        )
        source = rng.integers(0, len(g.steps), count)
        self.compute = typical * rng.permuted((g.compute / typical)[source], axis=1)
        self.data = g.data[source]
        self.time_s, self.energy = self.step_time[source], self.step_energy[source]
        self.ready = np.max(self.data + self.compute, axis=1)
        self._mean_compute = self.compute.mean(axis=0)
        modelled = _modelled(self.busy_w, self.wait_w, self.compute, self.time_s[:, None])
        self._modelled_sum, self._modelled_mean = modelled.sum(axis=1), modelled.mean(axis=0)

    def predict(
        self, stretch: np.ndarray, busy_w: np.ndarray, wait_w: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """With each rank's compute stretched and its power as given: per draw, the time the step
        gains and the energy the GPUs save; per rank, its mean saving. The modelled energy is
        linear in the compute, so its sums over ranks and means over draws come without the
        draws x ranks table."""
        added = np.max(self.data + self.compute * stretch, axis=1) - self.ready
        time_s = self.time_s + added
        busy_more = (busy_w - wait_w) * stretch  # each second of unstretched compute, over waiting
        saved = self._modelled_sum - (self.compute @ busy_more + time_s * wait_w.sum())
        by_rank = self._modelled_mean - (busy_more * self._mean_compute + wait_w * time_s.mean())
        return added, saved, by_rank


def analyze(
    steps: pd.DataFrame,
    devices: pd.DataFrame | None = None,
    ranks: pd.DataFrame | None = None,
    policy: Policy = Policy("max-slowdown", 0.02),
    facility_w: float | None = None,
    model: GpuModel = GpuModel(),
    settings: Settings = Settings(),
    simulated: bool = False,
) -> PowerReport:
    """The power report of one run.

    `steps`: run_id, rank, step, duration_s, data_s, compute_s, comm_wait_s, energy_j and
    power_limit_w (the limit in force at the step's end; null where unknown).
    `devices`: rank, ts (ns), metric, value: device samples (power, utilization, clock-event reasons).
    `ranks`: rank, host: placement, for the nodes of the headroom.
    `facility_w`: the power the job's nodes may draw; the headroom is judged only against one given.
    `model`: the GPUs' power model and limits.
    `simulated`: the samples are simulated GPUs'; every finding says so (SIMULATED), wherever it is shown."""
    s = settings
    steps = _complete(steps)
    devices = (devices if devices is not None else pd.DataFrame(columns=["rank", "ts", "metric", "value"])).astype(
        {"rank": "int64", "ts": "int64", "value": "float64"}
    )
    run_id, n_ranks, n_steps = str(steps["run_id"].iloc[0]), int(steps["rank"].nunique()), int(steps["step"].nunique())
    profile = _profiles(steps, devices, model)
    judged = _judged(steps, s)
    draws = (
        None
        if judged is None
        else _Draws(
            judged,
            profile.loc[judged.ranks],
            max(min(s.draws, 2_000_000 // n_ranks), 100),
            np.random.default_rng(s.seed),
        )
    )
    curve, measured = _measured_curve(steps, s), True
    if len(curve) < 2:
        curve = [] if judged is None or draws is None else _modelled_curve(draws, profile.loc[judged.ranks], model, s)
        measured = False
    curve.sort(key=lambda p: p.cap_w)
    eta = policy.value if policy.kind == "zeus" else 0.5
    assert eta is not None  # Policy.parse: zeus comes with its eta
    _relative(curve, eta, n_ranks * model.limit_max_w)
    choice = _choose(curve, policy, n_ranks)
    per_rank = (
        None
        if judged is None or draws is None
        else _per_rank(judged, draws, profile.loc[judged.ranks], model, s, n_steps)
    )
    headroom = None if facility_w is None else _headroom(devices, ranks, facility_w, model, s)
    findings = []
    if choice is not None and choice.cap_w < max(p.cap_w for p in curve):
        findings.append(_job_cap_finding(run_id, steps, curve, choice, policy, measured, profile))
    if per_rank is not None and per_rank.caps:
        findings.append(_per_rank_finding(run_id, per_rank, profile))
    if headroom is not None:
        findings.append(_headroom_finding(run_id, headroom, sorted(int(r) for r in profile.index)))
    if simulated:
        findings = [
            replace(f, summary=f"{SIMULATED}: {f.summary}", evidence={**f.evidence, "simulated": True})
            for f in findings
        ]
    return PowerReport(run_id, str(policy), n_ranks, n_steps, curve, choice, per_rank, headroom, findings, simulated)


def _complete(steps: pd.DataFrame) -> pd.DataFrame:
    """Rank-steps with compute filled in (duration less waiting and data, as stragglers does)
    and only the steps every rank finished."""
    wait, data = steps["comm_wait_s"].fillna(0.0), steps["data_s"].fillna(0.0)
    steps = steps.assign(
        comm_wait_s=wait, data_s=data, compute_s=steps["compute_s"].fillna(steps["duration_s"] - wait - data)
    )
    whole = steps.groupby("step")["rank"].transform("size") == steps["rank"].nunique()
    return steps[whole].sort_values(["step", "rank"])


def _profiles(steps: pd.DataFrame, devices: pd.DataFrame, model: GpuModel) -> pd.DataFrame:
    """Per rank: the limit in force at the last step, its utilization busy and waiting (high and
    low quantiles of its samples; 1 and 0 without), whether it throttles thermally, the clock and
    power busy and waiting that the model gives, the measured busy power (a high quantile of its
    power samples), and the share of its samples with each clock-event reason."""
    ranks = np.sort(steps["rank"].unique())
    profile = pd.DataFrame(index=pd.Index(ranks, name="rank"))
    latest = steps[steps["step"] == steps["step"].max()].set_index("rank")["power_limit_w"]
    profile["limit_w"] = latest.reindex(ranks).fillna(model.limit_max_w).clip(model.limit_min_w, model.limit_max_w)
    util = devices[devices["metric"] == sc.GPU_UTIL_PCT].groupby("rank")["value"]
    profile["load"] = (util.quantile(0.9) / 100).reindex(ranks).fillna(1.0).clip(0, 1)
    profile["wait_load"] = (util.quantile(0.1) / 100).reindex(ranks).fillna(0.0).clip(0, 1)
    reasons = devices[devices["metric"] == sc.CLOCK_EVENT_REASONS]
    bits = pd.Series(reasons["value"].to_numpy("int64"), index=reasons["rank"].to_numpy())
    for bit, name in sc.CLOCK_EVENT_REASON_BITS.items():
        profile[f"throttle_{name}"] = ((bits & bit) > 0).groupby(level=0).mean().reindex(ranks).fillna(0.0)
    profile["thermal"] = ((bits & THERMAL) > 0).groupby(level=0).mean().reindex(ranks).fillna(0.0) >= 0.5
    profile["measured_busy_w"] = (
        devices[devices["metric"].isin(POWER_METRICS)].groupby("rank")["value"].quantile(0.9).reindex(ranks)
    )
    profile["clock_mhz"], profile["busy_w"], profile["wait_w"] = _operating(profile, model, profile["limit_w"])
    return profile


def _operating(profile: pd.DataFrame, model: GpuModel, caps) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each rank's clock and power busy, and its power waiting, under `caps` (W per rank)."""
    thermal = profile["thermal"].to_numpy()
    clock, busy_w, _ = operating_points(model, profile["load"].to_numpy(), caps, thermal)
    return clock, busy_w, operating_points(model, profile["wait_load"].to_numpy(), caps, thermal)[1]


def _job_limits(steps: pd.DataFrame) -> pd.Series:
    """Per step, the limit every GPU ran under; NaN where they differ or one is unknown."""
    grouped = steps.groupby("step")["power_limit_w"]
    same = (grouped.max() == grouped.min()) & (grouped.count() == grouped.size())
    return grouped.max().where(same)


def _measured_curve(steps: pd.DataFrame, s: Settings) -> list[Point]:
    """A point per job-wide limit with `min_steps` steps past its warm-up after each change."""
    energy = steps.groupby("step")["energy_j"]
    per_step = pd.DataFrame(
        {
            "cap": _job_limits(steps),
            "time": steps.groupby("step")["duration_s"].median(),
            "energy": energy.sum().where(energy.count() == steps["rank"].nunique()),
        }
    )
    segment = (per_step["cap"] != per_step["cap"].shift()).cumsum()
    per_step = per_step[per_step.groupby(segment).cumcount() >= s.warmup].dropna()
    return [
        _point(cap, "measured", group["time"].to_numpy(), group["energy"].to_numpy(), len(group))
        for cap, group in per_step.groupby("cap")
        if len(group) >= s.min_steps
    ]


def _point(cap: float, source: str, time_s: np.ndarray, energy: np.ndarray, steps: int) -> Point:
    """A point of the curve from per-step values; standard errors as of a mean over `steps` steps."""

    def se(x: np.ndarray) -> float:
        return float(np.std(x, ddof=1) / math.sqrt(steps)) if len(x) > 1 else 0.0

    return Point(
        float(cap),
        source,
        steps,
        float(time_s.mean()),
        se(time_s),
        float(energy.mean()),
        se(energy),
        float(energy.sum() / time_s.sum()),
    )


def _judged(steps: pd.DataFrame, s: Settings) -> _Grid | None:
    """The last `window` steps, from the latest change of any rank's limit on (past its warm-up)."""
    limits = steps.pivot(index="step", columns="rank", values="power_limit_w").fillna(0.0)
    changed = limits.ne(limits.shift()).any(axis=1)
    changed.iloc[0] = False
    since = changed.index[changed].max() if changed.any() else limits.index.min() - s.warmup
    recent = steps[steps["step"] >= since + s.warmup]
    recent = recent[recent["step"].isin(np.sort(recent["step"].unique())[-s.window :])]
    if recent["step"].nunique() < s.min_steps or recent["rank"].nunique() < 2:
        return None
    grid = {
        c: recent.pivot(index="step", columns="rank", values=c).to_numpy(float)
        for c in ("duration_s", "data_s", "compute_s", "comm_wait_s", "energy_j")
    }
    return _Grid(
        np.sort(recent["step"].unique()),
        np.sort(recent["rank"].unique()),
        grid["duration_s"],
        grid["data_s"],
        grid["compute_s"],
        grid["comm_wait_s"],
        None if np.isnan(grid["energy_j"]).any() else grid["energy_j"],
    )


def _modelled_curve(draws: _Draws, profile: pd.DataFrame, model: GpuModel, s: Settings) -> list[Point]:
    """The curve the power model predicts from the judged steps: every GPU under each limit
    from the highest down, `model_step_w` apart."""
    points = []
    for cap in np.arange(model.limit_max_w, model.limit_min_w - 1e-9, -s.model_step_w):
        clock, busy_w, wait_w = _operating(profile, model, np.full(len(profile), cap))
        added, saved, _ = draws.predict(profile["clock_mhz"].to_numpy() / clock, busy_w, wait_w)
        points.append(_point(cap, "model", draws.time_s + added, draws.energy - saved, len(draws.step_time)))
    return points


def _relative(curve: list[Point], eta: float, max_power_w: float) -> None:
    """Each point's slowdown, saving and ZeusCost against the curve's highest limit."""
    if not curve:
        return
    top = max(curve, key=lambda p: p.cap_w)
    for p in curve:
        p.slowdown, p.energy_saving = p.step_s / top.step_s, 1 - p.energy_j / top.energy_j
        p.zeus_cost = eta * p.energy_j + (1 - eta) * max_power_w * p.step_s


def _choose(curve: list[Point], policy: Policy, n_ranks: int) -> Point | None:
    """The point the policy picks; None when none qualifies (a budget below every limit)."""
    bound = policy.value if policy.value is not None else math.inf  # read by max-slowdown and budget, which have one
    if policy.kind == "zeus":
        candidates, key = curve, (lambda p: p.zeus_cost)
    elif policy.kind == "max-slowdown":
        candidates, key = [p for p in curve if p.slowdown <= 1 + bound], (lambda p: p.energy_j)
    elif policy.kind == "min-energy":
        candidates, key = curve, (lambda p: p.energy_j)
    else:  # budget: the limits of all GPUs together bound the job's power
        candidates, key = [p for p in curve if p.cap_w * n_ranks <= bound], (lambda p: p.step_s)
    return min(candidates, key=key, default=None)


def _per_rank(g: _Grid, draws: _Draws, profile: pd.DataFrame, model: GpuModel, s: Settings, run_steps: int) -> PerRank:
    """Each rank's cap from its slack, at the largest safety whose predicted loss is within
    `max_loss` (bisection), and the replay's prediction of the caps together."""
    typical = np.median(g.compute, axis=0)
    slack = np.median(np.clip(g.wait - np.clip(g.wait.min(axis=1, keepdims=True), 0.0, None), 0.0, None), axis=0)
    limit, clock = profile["limit_w"].to_numpy(), profile["clock_mhz"].to_numpy()
    thermal = profile["thermal"].to_numpy()
    slow = (slack <= 0) | (typical > (1 + s.slow) * np.median(typical))  # the ones the others wait for
    held = thermal | slow  # keep their limits whatever the safety

    def at(safety: float) -> tuple:
        target = np.maximum(clock * typical / (typical + safety * slack), model.clock_min_mhz)
        caps = np.clip(np.ceil(model.power(profile["load"].to_numpy(), target)), model.limit_min_w, model.limit_max_w)
        caps = np.where(held | (caps > limit - s.min_change_w), limit, caps)
        new_clock, busy_w, wait_w = _operating(profile, model, caps)
        return (caps, new_clock, *draws.predict(clock / new_clock, busy_w, wait_w))

    def loss(prediction: tuple) -> float:
        return prediction[2].mean() / draws.time_s.mean()

    safety, best = s.max_safety, at(s.max_safety)
    if loss(best) > s.max_loss:  # the largest safety within the loss, to 0.1% of max_safety
        safety, high, best = 0.0, s.max_safety, at(0.0)
        for _ in range(10):
            middle = (safety + high) / 2
            trial = at(middle)
            if loss(trial) <= s.max_loss:
                safety, best = middle, trial
            else:
                high = middle
    caps, new_clock, added, saved, by_rank = best
    rng = np.random.default_rng(s.seed + 1)
    old = rng.integers(0, len(draws.step_time), (s.bootstrap, len(draws.step_time)))
    new = rng.integers(0, len(draws.time_s), (s.bootstrap, len(draws.step_time)))
    rerun_saving = draws.step_energy[old].mean(axis=1) - (draws.energy[new] - saved[new]).mean(axis=1)
    rerun_slowdown = (draws.time_s[new] + added[new]).mean(axis=1) / draws.step_time[old].mean(axis=1)
    energy = float(draws.step_energy.mean())
    rank_caps = [
        RankCap(
            int(r),
            None if cap == lim else float(cap),
            float(lim),
            float(c),
            float(sl),
            float(load),
            float(f),
            float(nf),
            float(f / nf),
            float(saving),
            None if cap != lim else "slow" if sw else "thermal" if th else "little slack",
        )
        for r, cap, lim, c, sl, load, f, nf, saving, sw, th in zip(
            g.ranks, caps, limit, typical, slack, profile["load"], clock, new_clock, by_rank, slow, thermal
        )
    ]
    return PerRank(
        int(g.steps[0]),
        int(g.steps[-1]),
        {c.rank: c.cap_w for c in rank_caps if c.cap_w is not None},
        rank_caps,
        safety,
        float(draws.step_time.mean()),
        energy,
        float(saved.mean()),
        (float(np.quantile(rerun_saving, 0.025)), float(np.quantile(rerun_saving, 0.975))),
        float(saved.mean()) / energy,
        float((draws.time_s + added).mean() / draws.time_s.mean()),
        (float(np.quantile(rerun_slowdown, 0.025)), float(np.quantile(rerun_slowdown, 0.975))),
        float(saved.mean() * run_steps / 3.6e6),
    )


def _headroom(
    devices: pd.DataFrame,
    ranks: pd.DataFrame | None,
    facility_w: float,
    model: GpuModel,
    s: Settings,
) -> Headroom | None:
    """Nodes' power from the GPUs' power samples, and how many more such nodes fit under the budget."""
    power = devices[devices["metric"].isin(POWER_METRICS)]
    if power.empty:
        return None
    bucket = (power["ts"].astype("int64") // int(s.bucket_s * 1e9)).rename("bucket")
    per_rank = power.groupby([bucket, power["rank"]])["value"].mean().unstack("rank").sort_index().ffill().dropna()
    if len(per_rank) < 10:
        return None  # too few moments to speak of a p99
    host = pd.Series(per_rank.columns.astype(str), index=per_rank.columns)
    if ranks is not None and "host" in ranks:
        host.update(ranks.dropna(subset=["host"]).set_index("rank")["host"].astype(str))
    nodes = per_rank.T.groupby(host).sum().T  # bucket x node
    job = nodes.sum(axis=1).to_numpy()
    per_node_gpus = host.value_counts()
    nameplate = float(per_node_gpus.median() * model.limit_max_w)
    budget = facility_w
    n = nodes.shape[1]

    def risk(extra: int) -> float:
        return float(np.mean(job * (n + extra) / n > budget))

    p99, peak = float(np.quantile(job, 1 - s.risk)), float(job.max())
    extra = max(math.floor(n * budget / p99) - n, 0)
    while extra > 0 and risk(extra) > s.risk:  # the quantile's interpolation may overshoot by one
        extra -= 1
    curve: dict[int, float] = {}
    k = 0
    while k <= 4 * n + extra and (not curve or curve[k - 1] < 0.5):
        curve[k] = risk(k)
        k += 1
    return Headroom(
        float(budget),
        n,
        len(job),
        nameplate,
        float(nodes.quantile(1 - s.risk).median()),
        float(nodes.max().median()),
        p99,
        peak,
        max(math.floor(budget / nameplate) - n, 0),
        max(math.floor(n * budget / peak) - n, 0),
        extra,
        risk(extra),
        curve,
    )


def _throttle_evidence(profile: pd.DataFrame, ranks: list[int] | None = None) -> dict:
    """Clock-event reasons seen (share of samples, over the ranks) and the share of samples
    throttled by the power cap: the violation time's share."""
    chosen = profile if ranks is None else profile.loc[ranks]
    shares = {c.removeprefix("throttle_"): float(chosen[c].mean()) for c in chosen.columns if c.startswith("throttle_")}
    return {
        "throttle_reasons": {k: v for k, v in shares.items() if v > 0},
        "power_cap_violation_share": shares.get("sw_power_cap", 0.0),
    }


def _model_check(profile: pd.DataFrame) -> dict:
    """Measured against predicted busy power (median over ranks): how well the model fits these GPUs."""
    measured = profile["measured_busy_w"].median()
    predicted = profile["busy_w"].median()
    return {"busy_power_w": {"measured": None if pd.isna(measured) else float(measured), "predicted": float(predicted)}}


def _job_cap_finding(
    run_id: str,
    steps: pd.DataFrame,
    curve: list[Point],
    choice: Point,
    policy: Policy,
    measured: bool,
    profile: pd.DataFrame,
) -> Finding:
    how = (
        f"measured at {len(curve)} limits over {sum(p.steps for p in curve)} steps"
        if measured
        else "predicted by the power model from steps at one limit"
    )
    return Finding(
        run_id,
        "job_cap",
        sorted(int(r) for r in profile.index),
        int(steps["step"].min()),
        int(steps["step"].max()),
        "info",
        choice.energy_saving,
        f"cap every GPU at {power(choice.cap_w)} ({policy}): {percent(choice.energy_saving)} less energy per step "
        f"({percent.margin(choice.energy_saving, 1.96 * choice.energy_j_se / choice.energy_j)}) for "
        f"{percent(choice.slowdown - 1, signed=True)} step time "
        f"({percent.margin(choice.slowdown - 1, 1.96 * choice.step_s_se / choice.step_s)}), {how}",
        {
            "cap_w": choice.cap_w,
            "policy": str(policy),
            "source": choice.source,
            "slowdown": choice.slowdown,
            "energy_saving": choice.energy_saving,
            "step_s": choice.step_s,
            "step_s_se": choice.step_s_se,
            "energy_j": choice.energy_j,
            "energy_j_se": choice.energy_j_se,
            "curve": [{"cap_w": p.cap_w, "slowdown": p.slowdown, "energy_saving": p.energy_saving} for p in curve],
            **_throttle_evidence(profile),
            **_model_check(profile),
        },
        analyzer=ANALYZER,
    )


def _per_rank_finding(run_id: str, per_rank: PerRank, profile: pd.DataFrame) -> Finding:
    capped = sorted(per_rank.caps)
    kept = [c.rank for c in per_rank.ranks if c.cap_w is None]
    limits = power.span(min(per_rank.caps.values()), max(per_rank.caps.values()))
    why = [
        f"{ranksets.phrase(ranks)} {'keeps its' if len(ranks) == 1 else 'keep theirs'}, "
        + KEPT_BECAUSE[reason][len(ranks) > 1]
        for reason in KEPT_BECAUSE
        if (ranks := [c.rank for c in per_rank.ranks if c.kept_because == reason])
    ]
    return Finding(
        run_id,
        "per_rank_caps",
        capped,
        per_rank.step_start,
        per_rank.step_end,
        "info",
        per_rank.saving_fraction,
        f"{plural(len(capped), 'rank')} {'waits' if len(capped) == 1 else 'wait'} for slower ones and can run under "
        f"lower power limits ({'; '.join([limits, *why])}): {energy(per_rank.saving_j_per_step)} less per step "
        f"({percent(per_rank.saving_fraction)}; a re-run "
        f"would measure {energy.span(*per_rank.saving_j_per_step_range)}), "
        f"{percent(per_rank.slowdown - 1, signed=True)} step time, "
        f"{energy_wh(per_rank.saving_kwh_run * 3.6e6)} over the run",
        {
            "caps": {str(r): w for r, w in per_rank.caps.items()},
            "kept": kept,
            "saving_j_per_step": per_rank.saving_j_per_step,
            "saving_j_per_step_range": list(per_rank.saving_j_per_step_range),
            "saving_fraction": per_rank.saving_fraction,
            "slowdown": per_rank.slowdown,
            "slowdown_range": list(per_rank.slowdown_range),
            "saving_kwh_run": per_rank.saving_kwh_run,
            "slack_s": {str(c.rank): c.slack_s for c in per_rank.ranks},
            **_throttle_evidence(profile),
            **_model_check(profile),
        },
        analyzer=ANALYZER,
    )


def _headroom_finding(run_id: str, h: Headroom, ranks: list[int]) -> Finding:
    return Finding(
        run_id,
        "headroom",
        ranks,
        None,
        None,
        "info",
        float(h.extra_nodes),
        f"{plural(h.nodes, 'node')} draw{'s' * (h.nodes == 1)} {power(h.job_p99_w)} at p99 (peak "
        f"{power(h.job_peak_w)}) against the facility's {power(h.facility_w)}: {h.extra_nodes:,} more such "
        f"node{' fits' if h.extra_nodes == 1 else 's fit'} with {percent(h.risk)} of moments over (by peak "
        f"{h.extra_nodes_peak:,}, by nameplate {h.extra_nodes_nameplate:,}; {plural(h.buckets, 'moment')})",
        {
            "facility_w": h.facility_w,
            "node_p99_w": h.node_p99_w,
            "node_peak_w": h.node_peak_w,
            "node_nameplate_w": h.node_nameplate_w,
            "extra_nodes": h.extra_nodes,
            "risk": h.risk,
            "extra_nodes_peak": h.extra_nodes_peak,
            "extra_nodes_nameplate": h.extra_nodes_nameplate,
        },
        analyzer=ANALYZER,
    )
