"""The fleet simulator's training curve (trainer/curve.py): shaped like GPT-2's first steps on an
H100; its clean curves draw no rollback-worthy finding and its injected spikes and NaNs are rolled
back within two steps, over seeds and noise levels, judged as bench/anomalies.py judges (the anomaly
analyzer after every step over the newest steps, the default rollback policy)."""

import numpy as np
import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.anomalies import FIRST, H100, SIM_NOISE, WINDOW, rollbacks, simulated
from trainer import simulate
from trainer.faults import parse

SEEDS = st.integers(0, 2**32 - 1)


@settings(max_examples=6, deadline=None)
@given(seed=SEEDS, noise=st.sampled_from(SIM_NOISE))
def test_clean_simulated_curves_draw_no_rollback(seed, noise):
    assert rollbacks(simulated(seed, noise, 300)) == {}


@settings(max_examples=12, deadline=None)
@given(
    seed=SEEDS,
    noise=st.sampled_from(SIM_NOISE),
    at=st.integers(FIRST, 400),
    spec=st.sampled_from(["spike:at={},scale=5", "spike:at={},scale=50", "nan:at={}"]),
)
def test_injected_spikes_and_nans_are_rolled_back_within_two_steps(seed, noise, at, spec):
    hit = simulated(seed, noise, at + 3, (spec.format(at),))
    found = rollbacks(hit[hit["step"] > at - WINDOW], last=at + 2)
    assert at in found and found[at] - at <= 2, found


def test_the_curve_is_shaped_like_the_h100s():
    """The early fall and the level reached as on the H100; natural gradient-norm excursions of 2x
    and more past warmup while the loss goes on falling."""
    h100 = pd.read_csv(H100).set_index("step")
    sim = simulated(0, 1.0, 1000).groupby("step").median()
    for step in (10, 20, 50, 100, 140, 190):  # 150 is the injected spike
        assert abs(sim.loc[step, "loss"] / h100.loc[step, "loss"] - 1) < 0.1, step
    noise = np.log(sim["loss"]).diff().loc[100:200].std()
    assert 0.005 < noise < 0.03  # the H100's step-to-step noise is about 1.5%
    late = sim.loc[FIRST:, "grad_norm"]
    assert (late / late.rolling(20).median()).max() > 2
    assert sim["loss"].loc[500:].median() < sim["loss"].loc[FIRST:500].median()


def test_the_simulator_sends_the_curve_and_its_faults_leave_the_timing_alone():
    topology = simulate.Topology(dp=4, pp=2)
    clean = pd.concat(simulate.steps(topology, 30, [], seed=3))
    faults = [parse(spec, simulate.SIMULATOR_KINDS) for spec in ("spike:at=22,scale=5", "nan:at=27")]
    hit = pd.concat(simulate.steps(topology, 30, faults, seed=3))
    assert hit["duration_s"].tolist() == clean["duration_s"].tolist()
    assert (clean.groupby("step")["grad_norm"].nunique() == 1).all()  # the gradients are all-reduced
    assert clean["loss"].gt(0).all() and clean.groupby("step")["loss"].nunique().eq(8).all()
    spiked = hit["step"] == 22
    assert np.allclose(hit.loc[spiked, ["loss", "grad_norm"]], 5 * clean.loc[spiked, ["loss", "grad_norm"]])
    assert hit.loc[hit["step"] == 27, ["loss", "grad_norm"]].isna().all().all()
    other = ~hit["step"].isin([22, 27])
    assert hit.loc[other, ["loss", "grad_norm"]].equals(clean.loc[other, ["loss", "grad_norm"]])
