"""A run's time/energy trade-off as PNG: each power limit a point (step time against energy
per step, with 95% bars), the policy's pick ringed, and the per-rank caps' prediction with the
range a re-run would measure."""

from pathlib import Path

from collector.analysis.analyzers.power import PowerReport


def write_curve(report: PowerReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    curve = sorted(report.curve, key=lambda p: p.cap_w)
    if curve:
        source = "measured" if curve[0].source == "measured" else "predicted by the power model"
        ax.errorbar(
            [p.step_s for p in curve],
            [p.energy_j / 1e3 for p in curve],
            xerr=[1.96 * p.step_s_se for p in curve],
            yerr=[1.96 * p.energy_j_se / 1e3 for p in curve],
            fmt="o-",
            capsize=2,
            label=f"every GPU at one limit ({source})",
        )
        for p in curve:
            ax.annotate(
                f"{p.cap_w:.0f} W", (p.step_s, p.energy_j / 1e3), textcoords="offset points", xytext=(5, 3), fontsize=8
            )
    if report.job_cap:
        ax.plot(
            report.job_cap.step_s,
            report.job_cap.energy_j / 1e3,
            "o",
            ms=16,
            mfc="none",
            mec="tab:red",
            label=f"{report.policy}: {report.job_cap.cap_w:.0f} W",
        )
    r = report.per_rank
    if r and r.caps:
        x, y = r.step_s * r.slowdown, (r.energy_j_per_step - r.saving_j_per_step) / 1e3
        ax.errorbar(
            x,
            y,
            xerr=[[x - r.step_s * r.slowdown_range[0]], [r.step_s * r.slowdown_range[1] - x]],
            yerr=[
                [y - (r.energy_j_per_step - r.saving_j_per_step_range[1]) / 1e3],
                [(r.energy_j_per_step - r.saving_j_per_step_range[0]) / 1e3 - y],
            ],
            fmt="*",
            ms=14,
            color="tab:green",
            capsize=2,
            label=f"per-rank caps on {len(r.caps)} ranks (re-run range)",
        )
    ax.set(xlabel="step time, s", ylabel="energy per step, all GPUs, kJ", title=f"run {report.run_id}: power limits")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
