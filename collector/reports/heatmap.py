"""A rank x step heatmap of compute time against the step's median, as PNG: stragglers are
rows that glow, slow stages bands, data skew confetti."""

from pathlib import Path

import pandas as pd


def write_heatmap(steps: pd.DataFrame, path: Path, title: str) -> None:
    """`steps`: rank, step, compute_s (or duration_s where compute is unknown)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    compute = steps["compute_s"].fillna(steps["duration_s"])
    grid = steps.assign(compute=compute).pivot_table(index="rank", columns="step", values="compute")
    ratio = grid / grid.median(axis=0)
    fig, ax = plt.subplots(figsize=(10, min(max(3.0, len(ratio) / 16), 12)))
    image = ax.imshow(
        ratio.to_numpy(),
        aspect="auto",
        cmap="magma",
        interpolation="nearest",
        vmin=0.9,
        vmax=max(1.1, float(ratio.stack().quantile(0.999))),
        extent=(grid.columns.min() - 0.5, grid.columns.max() + 0.5, grid.index.max() + 0.5, grid.index.min() - 0.5),
    )
    ax.set(xlabel="step", ylabel="rank", title=title)
    fig.colorbar(image, ax=ax, label="compute / step median")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
