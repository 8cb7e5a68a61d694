"""What each rank-step's compute should have taken, from the state it ran in (NCPP's step-time model,
collector/predict), against what it took. Runs only where the collector (or `rankwatch analyze`) was
given a model (`--model FILE`), and draws nothing from a model that did not beat every baseline on
held-out runs (`Fitted.trusted`).

Two conclusions, and the model's view of the run as advice redrawn every pass (`tracking`: the
median rank's compute measured and predicted over recent steps, and each rank's; the dashboard draws
them):

- `judge`: the whole job computing slower than its predicted step time for `patience` steps in a row,
  by more than the margin and the model's own held-out error: a slowdown every rank shares, which
  comparing ranks cannot see. Its finding gives the predicted and measured times (median rank).
- `revise`: a straggler finding (a rank's or a node's) gains how much of its slowdown the slow ranks'
  own state explains, and through which group: each group of their features set to their peers' in
  turn, the drop in predicted compute time is that group's share, in points of the slowdown. A
  slowdown the GPU's state (compute, memory, power/thermal, interconnect) explains for the most part is
  the hardware's; else its cause lies outside the GPU (the host, the data, the software).
"""

from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from collector.analysis.analyzers import Frames, Reads
from collector.findings import Finding
from collector.predict import steptime
from collector.predict.stepmodel import Fitted

ANALYZER = "predicted"
SLOWER = "slower_than_predicted"
TRACKING = "prediction"  # the model's view of a run, measured against predicted: advice, every pass
EXPLAINED = ("stragglers", ("rank", "node"))  # the findings `revise` explains: analyzer, kinds
SERIES = 256  # steps of a slow stretch its evidence keeps, the newest
EXPLAINED_STEPS = 16  # the newest steps of a straggler's episode its explanation reads
HISTORY = 32  # steps a first pass (or one after the engine dropped what was kept) predicts


@dataclass(frozen=True)
class Settings:
    model: Fitted | None = field(default=None, compare=False)
    margin: float = 0.10  # slower than predicted by at least this share...
    error_multiple: float = 2.0  # ...and by this many times the model's held-out MAPE
    patience: int = 5  # steps in a row


READS = Reads(history=Settings().patience, linger=Settings().patience, devices=True, workload=True)


def predict(fitted: Fitted, features: pd.DataFrame) -> np.ndarray:
    """Each rank-step's predicted compute time, s."""
    return fitted.model.predict(features)


def per_step(steps: pd.DataFrame, predicted: np.ndarray) -> pd.DataFrame:
    """Per step, the median rank's measured and predicted compute time (index: step)."""
    frame = pd.DataFrame({"step": steps["step"].to_numpy(), "measured": steps["compute_s"].to_numpy()})
    return frame.assign(predicted=predicted).groupby("step").median()


def slower(run_id: str, steps: pd.DataFrame, fitted: Fitted, s: Settings, after: int | None = None) -> list[Finding]:
    """The stretches of at least `patience` steps of `steps` (per_step's) whose median rank computed
    slower than predicted by more than the margin, those reaching past step `after`."""
    if not fitted.trusted or steps.empty:
        return []
    margin = max(s.margin, s.error_multiple * fitted.figures["ncpp"]["mape"] / 100)
    slow = (steps["measured"] > (1 + margin) * steps["predicted"]).to_numpy()
    edges = np.flatnonzero(np.diff(np.r_[0, slow.astype(np.int8), 0]))
    found = []
    for start, stop in zip(edges[::2], edges[1::2], strict=True):
        stretch = steps.iloc[start:stop]
        if stop - start < s.patience or (after is not None and stretch.index[-1] <= after):
            continue
        measured, expected = float(stretch["measured"].median()), float(stretch["predicted"].median())
        first, last, ratio = int(stretch.index[0]), int(stretch.index[-1]), measured / expected
        found.append(
            Finding(
                run_id,
                SLOWER,
                [],
                first,
                last,
                "critical" if ratio >= 1.3 else "warning",
                ratio,
                f"the whole job computes {100 * (ratio - 1):.0f}% slower than its predicted step time since step "
                f"{first} ({measured * 1e3:.1f} ms measured, {expected * 1e3:.1f} ms predicted from its devices' "
                "and hosts' state, median rank): every rank at once, so no rank stands out; the cause is one "
                "they share that the model does not read (software, data, the input pipeline, a job beside it)",
                {
                    "measured_s": measured,
                    "predicted_s": expected,
                    "margin": margin,
                    "model": fitted.verdict,
                    # the stretch over time (its last SERIES steps), as the dashboard draws a `*_by_step` series
                    "measured_s_by_step": _series(stretch["measured"]),
                    "predicted_s_by_step": _series(stretch["predicted"]),
                },
                analyzer=ANALYZER,
            )
        )
    return found


def _series(values: pd.Series, last: int = SERIES) -> dict[int, float]:
    """The `last` values of a series by step (or rank), as evidence keeps them."""
    return {int(key): float(v) for key, v in values.iloc[-last:].items()}


def explain(finding: Finding, steps: pd.DataFrame, features: pd.DataFrame, fitted: Fitted) -> Finding:
    """A straggler finding with how much of its slowdown each group of the slow ranks' state explains,
    in points (`evidence["explained"]`, `evidence["explained_points"]` by group) and in its summary.
    `steps`: rank, step, compute_s; `features` aligned with it."""
    if not fitted.trusted or not finding.ranks or finding.step_start is None or finding.step_end is None:
        return finding
    during = steps["step"].between(finding.step_start, finding.step_end).to_numpy()
    theirs = steps["rank"].isin(finding.ranks).to_numpy()
    if not (during & theirs).any() or not (during & ~theirs).any():
        return finding
    # the newest EXPLAINED_STEPS steps of the episode: what its state is now, at a bounded cost
    during = during & (steps["step"].to_numpy() > steps["step"][during].max() - EXPLAINED_STEPS)
    measured, peers_measured = (float(steps["compute_s"][during & w].median()) for w in (theirs, ~theirs))
    slower_by = 100 * (measured / peers_measured - 1)
    by_rank = (
        pd.DataFrame({"rank": steps["rank"][during], "measured": steps["compute_s"][during]})
        .assign(predicted=fitted.model.predict(features[during]))  # each rank-step predicted once
        .groupby("rank")
        .median()
    )
    slow = by_rank.index.isin(finding.ranks)
    predicted, peers_predicted = float(by_rank["predicted"][slow].median()), float(by_rank["predicted"][~slow].median())
    shares = steptime.explain(fitted.model, features[during & theirs], features[during & ~theirs], predicted)
    points = {group: 100 * share / peers_measured for group, share in shares.items()}
    hardware = sum(p for g, p in points.items() if g in steptime.HARDWARE)
    top = steptime.named(shares)
    cause = "hardware" if hardware >= slower_by / 2 else "outside the GPU"
    if top and points[top] >= 0.5:
        said = f"; its {top} state explains {points[top]:.1f} of its {slower_by:.1f} points"
        said += " (the hardware's)" if cause == "hardware" else " (not the GPU's: look at the host, data, software)"
    else:
        said = f"; its state explains none of its {slower_by:.1f} points: the cause is outside what the model reads"
    explained = {
        "slower_percent": slower_by,
        "predicted_s": predicted,
        "peer_predicted_s": peers_predicted,
        "hardware_points": hardware,
        "cause": cause,
    }
    evidence = {
        **finding.evidence,
        "explained": explained,
        "explained_points": points,
        "measured_s_by_rank": _series(by_rank["measured"], len(by_rank)),
        "predicted_s_by_rank": _series(by_rank["predicted"], len(by_rank)),
    }
    return replace(finding, summary=finding.summary + said, evidence=evidence)


def features(frames: Frames, steps: pd.DataFrame) -> pd.DataFrame:
    """The features of rank-steps of `frames` (`steps`: some of its steps), from its device samples
    around them and its workload."""
    assert frames.devices is not None and frames.workload is not None, "READS asks for both"
    if steps.empty:
        return pd.DataFrame(index=steps.index)
    since = int((steps["end_ts"] - steps["duration_s"] * 1e9).min() - steptime.STALE_S * 1e9)
    samples = frames.devices(since, int(steps["end_ts"].max()))
    work = steps[["rank", "step"]].merge(frames.workload(), on=["rank", "step"], how="left").set_index(steps.index)
    ranks = frames.ranks.assign(world_size=frames.world_size or len(frames.ranks))
    return steptime.features(steps.assign(tokens=work["tokens"], flops=work["flops"]), samples, ranks)


def judge(frames: Frames, settings: Settings = Settings()) -> list[Finding]:
    """The stretches of steps slower than predicted that the new steps extend, and the model's view
    of the run (`tracking`). Each step's medians are kept for the next pass (`frames.kept`), which
    predicts its new steps alone."""
    fitted = settings.model
    if fitted is None or not fitted.trusted or frames.new_steps.empty:
        return []
    kept = frames.kept.setdefault(ANALYZER, {})
    medians: pd.DataFrame | None = kept.get("per_step")
    # a first pass, or one after the engine dropped what was kept (late steps, a quiet run): up to
    # HISTORY steps of the history the pass has, so the view over time does not restart at the newest
    fresh = frames.steps_after(frames.last - HISTORY if medians is None else kept["upto"])
    fresh = fresh[fresh["compute_s"] > 0]
    if fresh.empty:
        return []
    expected = predict(fitted, features(frames, fresh))
    medians = per_step(fresh, expected) if medians is None else pd.concat([medians, per_step(fresh, expected)])
    medians = medians.iloc[-SERIES:]
    kept.update(per_step=medians, upto=int(medians.index.max()))
    found = slower(frames.run_id, medians, fitted, settings, after=frames.first_new - 1)
    return [*found, tracking(frames.run_id, medians, fresh, expected, fitted)]


def tracking(run_id: str, medians: pd.DataFrame, steps: pd.DataFrame, expected: np.ndarray, fitted: Fitted) -> Finding:
    """The model's view of a run, as advice (severity info) redrawn every pass: the median rank's
    compute, measured and predicted, over its recent steps (`medians`, per_step's), and each rank's
    over the newest (`steps`, predicted `expected`)."""
    first, last = int(medians.index[0]), int(medians.index[-1])
    measured, predicted = float(medians["measured"].median()), float(medians["predicted"].median())
    by_rank = pd.DataFrame({"rank": steps["rank"], "measured": steps["compute_s"], "predicted": expected})
    by_rank = by_rank.groupby("rank").median()
    return Finding(
        run_id,
        TRACKING,
        [],
        first,
        last,
        "info",
        0.0,  # every pass's speaks for the episode: the newest
        f"the median rank computes in {measured * 1e3:.1f} ms a step against {predicted * 1e3:.1f} ms predicted "
        f"from its state over steps {first}-{last} ({measured / predicted:.2f}x); {fitted.verdict}",
        {
            "measured_s": measured,
            "predicted_s": predicted,
            "measured_s_by_step": _series(medians["measured"]),
            "predicted_s_by_step": _series(medians["predicted"]),
            "measured_s_by_rank": _series(by_rank["measured"], len(by_rank)),
            "predicted_s_by_rank": _series(by_rank["predicted"], len(by_rank)),
        },
        analyzer=ANALYZER,
    )


def revise(found: dict[str, list[Finding]], frames: Frames, settings: Settings) -> dict[str, list[Finding]]:
    """The pass's findings, its rank and node stragglers with what their state explains."""
    fitted = settings.model
    analyzer, kinds = EXPLAINED
    if fitted is None or not fitted.trusted or not any(f.kind in kinds for f in found.get(analyzer, [])):
        return found
    ends = [f.step_end for f in found[analyzer] if f.kind in kinds and f.step_end is not None]
    steps = frames.steps_after(min(ends, default=frames.last) - EXPLAINED_STEPS)
    steps = steps[steps["compute_s"] > 0]  # the features of the steps the explanations read, no more
    drawn = features(frames, steps)
    return {
        **found,
        analyzer: [explain(f, steps, drawn, fitted) if f.kind in kinds else f for f in found[analyzer]],
    }
