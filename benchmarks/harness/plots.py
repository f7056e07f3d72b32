"""The peak-memory curves of the CPU report as a PNG (matplotlib, the `train` extra)."""

from __future__ import annotations

from pathlib import Path

from urpe.bench.memory import MEMORY_ROWS

from .targets import fit_quadratic


def plot_memory(memory: list[dict], path: Path, shape: dict) -> None:
    """Peak MB against L on log-log axes, one curve per row; the reference's curve is carried
    on past its last measured length by its fit a + b L^2 (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in MEMORY_ROWS:
        points = sorted(
            (r["length"], r["peak_mb"]) for r in memory if r["name"] == name and "peak_mb" in r
        )
        if not points:
            continue
        ax.plot(*zip(*points, strict=True), marker="o", label=name)
        fit = fit_quadratic(points) if name == "reference_urpe" else None
        wanted = sorted({r["length"] for r in memory} - {length for length, _ in points})
        if fit is not None and wanted:
            xs = [points[-1][0], *wanted]
            ys = [points[-1][1], *(fit[0] + fit[1] * x**2 for x in wanted)]
            ax.plot(xs, ys, "--", color=ax.lines[-1].get_color(), label="reference (fit a+bL²)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length L")
    ax.set_ylabel("peak memory above inputs (MB)")
    ax.set_title(
        f"forward+backward, float32, B={shape['batch']}, H={shape['heads']}, D={shape['head_dim']}"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
