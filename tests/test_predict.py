"""NCPP's group-attention regressor and its baselines (collector/predict): the numpy forward pass the
collector runs is the torch network's, a saved model predicts the same after loading, the collector's
side never imports torch, and bench/ncpp.py judges every predictor on servers it did not train on,
on PerfCastDB's real file."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import bench

from collector.predict import perfcastdb
from collector.predict.baselines import Median
from collector.predict.evaluate import held_out, metrics
from collector.predict.fit import GroupAttention, fit
from collector.predict.groups import UNSEEN, Encoder
from collector.predict.ncpp import Model

ROOT = Path(__file__).resolve().parent.parent
PERFCASTDB = ROOT.parent / "shared" / "data" / "perfcastdb" / "train_data.csv"
GROUPS = {"compute": ["clock", "load"], "memory": ["used", "kind"], "workload": ["model"]}


def table(n: int, seed: int = 0) -> tuple[pd.DataFrame, np.ndarray]:
    """A target that is a product of a clock, a load and a per-model constant, with a category that
    means nothing (`kind`)."""
    rng = np.random.default_rng(seed)
    frame = pd.DataFrame(
        {
            "clock": rng.uniform(1.0, 2.0, n),
            "load": rng.uniform(0.0, 1.0, n),
            "used": rng.uniform(10, 80, n),
            "kind": rng.choice(["a", "b", "c"], n),
            "model": rng.choice(["small", "large"], n),
        }
    )
    target = np.where(frame["model"] == "large", 4.0, 1.0) / frame["clock"] * (1 + 0.5 * frame["load"])
    return frame, target.to_numpy()


def test_the_numpy_forward_pass_is_the_torch_networks():
    frame, _ = table(64)
    encoder = Encoder.fit(frame, GROUPS)
    torch.manual_seed(3)
    net = GroupAttention(encoder)
    encoded = encoder.encode(frame)
    with torch.no_grad():
        expected = net(torch.from_numpy(encoded.numbers), torch.from_numpy(encoded.codes)).numpy()
    model = Model(encoder, net.export(), 0.0, 1.0, "target")
    np.testing.assert_allclose(model.forward(encoded), expected, rtol=1e-4, atol=1e-5)


def test_a_fitted_model_learns_and_predicts_the_same_once_saved_and_loaded(tmp_path):
    frame, target = table(400)
    model = fit(frame, target, GROUPS, epochs=150)
    assert metrics(target, model.predict(frame))["mape"] < 5
    model.save(tmp_path / "model.npz", trained_on="test")
    loaded, meta = Model.load(tmp_path / "model.npz")
    assert meta == {"trained_on": "test"}
    np.testing.assert_allclose(loaded.predict(frame), model.predict(frame), rtol=1e-6)
    assert (tmp_path / "model.npz").stat().st_size < 100_000
    # a held-out table: other rows of the same process are predicted nearly as well
    other, other_target = table(200, seed=1)
    assert metrics(other_target, loaded.predict(other))["mape"] < 8


def test_the_encoding_reads_unseen_categories_and_missing_columns_as_unknown():
    frame, _ = table(32)
    encoder = Encoder.fit(frame, GROUPS)
    new = pd.DataFrame({"clock": [1.5, None], "kind": ["z", "a"], "model": ["small", None]})
    encoded = encoder.encode(new)
    names = [f.name for f in encoder.categorical]
    assert encoded.codes[0, names.index("kind")] == UNSEEN and encoded.codes[1, names.index("kind")] != UNSEEN
    assert encoded.codes[1, names.index("model")] == UNSEEN
    numeric = [f.name for f in encoder.numeric]
    assert encoded.numbers[1, numeric.index("clock")] == 0.0  # missing: the mean
    assert np.all(encoded.numbers[:, numeric.index("load")] == 0.0)  # a column the table lacks


def test_a_constant_column_is_no_feature_and_a_table_of_constants_is_refused():
    frame, _ = table(16)
    frame["same"] = 7
    assert "same" not in [f.name for f in Encoder.fit(frame, {**GROUPS, "system": ["same"]}).features]
    with pytest.raises(ValueError, match="nothing to learn"):
        Encoder.fit(frame, {"system": ["same"]})


def test_the_collector_side_never_imports_torch():
    code = (
        "import sys; import collector.server, collector.reports.postmortem, collector.predict.stepmodel, "
        "collector.predict.perfcastdb; assert 'torch' not in sys.modules and 'sklearn' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_median_falls_back_to_coarser_configurations_then_to_every_row():
    train = pd.DataFrame({"suite": ["a", "a", "a", "b"], "test": ["x", "x", "y", "z"]})
    median = Median(["suite", "test"]).fit(train, np.array([1.0, 3.0, 100.0, 5.0]))
    new = pd.DataFrame({"suite": ["a", "a", "c"], "test": ["x", "w", "x"]})
    np.testing.assert_allclose(median.predict(new), [np.sqrt(3.0), 3.0, np.sqrt(3.0 * 5.0)], rtol=1e-9)


def test_held_out_never_fits_on_the_group_it_predicts():
    frame, target = table(60)
    servers = np.repeat(["s1", "s2", "s3", "s4"], 15)
    seen_by_fit = []

    class Spy(Median):
        def fit(self, table, target):
            seen_by_fit.append(set(servers[table.index]))
            return super().fit(table, target)

    predictions = held_out(frame, target, servers, [lambda: Spy(["model"])])
    every = {"s1", "s2", "s3", "s4"}
    assert sorted(map(sorted, seen_by_fit)) == sorted(sorted(every - {s}) for s in every)
    assert not np.isnan(predictions["median"]).any()


@pytest.mark.skipif(not PERFCASTDB.exists(), reason="PerfCastDB's file is not beside the project")
def test_the_bench_judges_ncpp_and_the_baselines_on_perfcastdb_by_server(tmp_path):
    """The real file, each server held out in turn; then the same file cut by server into a training
    and a test file, as another file of the same format would come."""
    result, printed = bench("ncpp.py", "--train", str(PERFCASTDB), "--epochs", "5")
    assert {"ncpp_mape", "best_baseline", "best_baseline_mape"} <= result.keys()
    assert result["best_baseline"] in {"median", "ridge", "boosted trees"} and result["rows"] == 145
    assert "each held out in turn" in printed and "7 servers" in printed
    # repeats of one test on one server are nearly equal: the median of the same test on other servers
    # is what any method must match where the test was seen
    assert result["figures"]["median"]["seen"]["mape"] < 2

    rows = pd.read_csv(PERFCASTDB)
    servers = sorted(rows[perfcastdb.SERVER].unique())
    rows[rows[perfcastdb.SERVER].isin(servers[:5])].to_csv(tmp_path / "train.csv", index=False)
    rows[rows[perfcastdb.SERVER].isin(servers[5:])].to_csv(tmp_path / "test.csv", index=False)
    result, _ = bench(
        "ncpp.py", "--train", str(tmp_path / "train.csv"), "--test", str(tmp_path / "test.csv"), "--epochs", "5"
    )
    assert result["rows"] == int(rows[perfcastdb.SERVER].isin(servers[5:]).sum())


def test_a_file_not_in_perfcastdbs_format_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    run = subprocess.run(
        [sys.executable, "bench/ncpp.py", "--train", str(tmp_path / "bad.csv")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "lacks the column(s)" in run.stderr
