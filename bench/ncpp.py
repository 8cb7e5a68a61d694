"""NCPP against its baselines on PerfCastDB: a server's benchmark score from its hardware.

Fits NCPP (collector/predict: the per-test median of the training servers, corrected by its
group-attention network from the servers' hardware, the correction shrunk by the scale that did best
on training servers held out) and each baseline on --train. With --test, each is fitted on the whole
of --train and judged on --test; without, on --train's own servers held out one at a time
(pod-grouped: a server's repeats of a test never sit on both sides of a split).

Printed per predictor: MAPE, P90 of the absolute percentage error, the share within 5% and R² of log
scores, over every held-out row and over the rows whose test some training server ran (a test no
training server ran is one no method has seen: NCPP leaves its prior's guess there uncorrected); then
the prior and the correction's scale each fit of NCPP chose. The last line is one JSON object:
ncpp_mape, best_baseline, best_baseline_mape (every row), the same over the seen rows (`seen`), the
fits' priors and scales, and the rest of the figures.

Usage: python bench/ncpp.py --train FILE [--test FILE] [--epochs 600] [--seed 0]
"""

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from collector.predict import perfcastdb
from collector.predict.baselines import Boosted, Ncpp, Ridge
from collector.predict.evaluate import held_out, metrics
from collector.predict.priors import Median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", type=Path, required=True)
    parser.add_argument("--test", type=Path)
    parser.add_argument("--epochs", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        train, score = perfcastdb.load(args.train)
        test, test_score = perfcastdb.load(args.test) if args.test else (train, score)
    except perfcastdb.DataError as e:
        parser.exit(2, f"ncpp.py: error: {e}\n")
    groups = perfcastdb.groups(list(train.columns))
    fits: list[Ncpp] = []

    def ncpp() -> Ncpp:
        """NCPP made for one fit, kept to say what the fit chose."""
        made = Ncpp(groups, [median], by=perfcastdb.SERVER, epochs=args.epochs, seed=args.seed, target="score")
        fits.append(made)
        return made

    def median() -> Median:
        return Median(perfcastdb.CONFIGURATION)

    predictors = [
        ncpp,
        median,
        lambda: Ridge(groups),
        lambda: Boosted(groups, seed=args.seed),
    ]
    if args.test:
        predicted = {p.name: p.predict(test) for p in (make().fit(train, score) for make in predictors)}
        seen = (
            test[perfcastdb.CONFIGURATION]
            .apply(tuple, axis=1)
            .isin(set(train[perfcastdb.CONFIGURATION].apply(tuple, axis=1)))
        )
        how = f"fitted on {args.train} ({len(train)} rows), judged on {args.test} ({len(test)} rows)"
    else:
        servers = train[perfcastdb.SERVER].astype(str)
        predicted = held_out(train, score, servers, predictors)
        # a row's test is seen when another server ran it too
        seen = train.groupby(perfcastdb.CONFIGURATION)[perfcastdb.SERVER].transform("nunique") > 1
        how = f"{args.train}: {len(train)} rows, {servers.nunique()} servers, each held out in turn"
    seen = seen.to_numpy()
    figures = {
        name: {"all": metrics(test_score, p), "seen": metrics(test_score[seen], p[seen]) if seen.any() else None}
        for name, p in predicted.items()
    }
    console = Console(width=110)
    console.print(how)
    for subset, title in (
        ("all", "every held-out row"),
        ("seen", f"rows whose test a training server ran ({seen.sum()} of {len(seen)})"),
    ):
        table = Table("predictor", "MAPE %", "P90 %", "within 5%", "R² (log)", title=title)
        for name, f in figures.items():
            if f[subset]:
                m = f[subset]
                table.add_row(name, f"{m['mape']:.1f}", f"{m['p90']:.1f}", f"{m['within5']:.0%}", f"{m['r2_log']:.3f}")
        console.print(table)
    chosen = [{"prior": f.model.prior.name, "shrink": f.model.shrink} for f in fits]
    counted = Counter(f"{c['prior']} corrected at scale {c['shrink']:.1f}" for c in chosen)
    console.print("NCPP's fits: " + ", ".join(f"{what} ({n} of {len(chosen)})" for what, n in counted.items()))
    print(
        json.dumps(
            {
                **versus_best(figures, "all"),
                "seen": versus_best(figures, "seen") if seen.any() else None,
                "fits": chosen,
                "rows": len(test_score),
                "seen_rows": int(seen.sum()),
                "figures": figures,
            }
        )
    )


def versus_best(figures: dict, subset: str) -> dict:
    """NCPP's MAPE over `subset` of the rows, and the best baseline's there."""
    baselines = {name: f[subset]["mape"] for name, f in figures.items() if name != "ncpp"}
    best = min(baselines, key=baselines.__getitem__)
    ncpp = figures["ncpp"][subset]["mape"]
    return {
        "ncpp_mape": ncpp,
        "best_baseline": best,
        "best_baseline_mape": baselines[best],
        "ncpp_beats_baseline": ncpp < baselines[best],
    }


if __name__ == "__main__":
    main()
