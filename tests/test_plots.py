"""Every figure the project writes can be read on its own: each plotting module's figures, drawn
from the records in results/ (and the benchmark's JSON), have x and y labels and ticks on every
panel and a label on every colour bar; the learned B and C heatmaps name the query and key axes
and say which way the offset j - i runs. Checked on the matplotlib Figure objects, not pixels."""

import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("safetensors")
from matplotlib.figure import Figure  # noqa: E402

from urpe.experiments.records import RecordStore  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def saved(monkeypatch) -> list[Figure]:
    """Every Figure saved while the test runs (saved as usual, then kept for inspection)."""
    figures: list[Figure] = []
    original = Figure.savefig

    def keep(self, *args, **kwargs):
        figures.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    return figures


def unreadable(figure: Figure) -> list[str]:
    """What a reader of `figure` alone could not tell: panels without axis labels or ticks,
    colour bars without a label."""
    bars = {
        mappable.colorbar.ax: mappable.colorbar
        for ax in figure.axes
        for mappable in [*ax.images, *ax.collections]
        if getattr(mappable, "colorbar", None) is not None
    }
    problems = []
    for ax in figure.axes:
        if not ax.get_visible() or not ax.axison:
            continue
        if ax in bars:
            bar = bars[ax]
            label = bar.ax.get_ylabel() if bar.orientation == "vertical" else bar.ax.get_xlabel()
            problems += [] if label else [f"colour bar of {bar.mappable.axes.get_title()!r}"]
            continue
        name = ax.get_title() or figure.get_suptitle() or "a panel"
        for axis, label, ticks in (
            ("x", ax.get_xlabel(), ax.get_xticks()),
            ("y", ax.get_ylabel(), ax.get_yticks()),
        ):
            if not label:
                problems.append(f"{name!r}: no {axis} label")
            if len(ticks) == 0:
                problems.append(f"{name!r}: no {axis} ticks")
    return problems


def _records(folder: Path, tmp_path: Path, keep=lambda record: True) -> tuple[list[dict], Path]:
    """The records of a results folder, and an output folder whose records/ is that folder's."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "records").symlink_to(folder / "records")
    records = [r for r in RecordStore(folder).load_all(lambda message: None) if keep(r)]
    assert records
    return records, out


def _assert_readable(figures: list[Figure], count: int) -> None:
    assert len(figures) == count
    for figure in figures:
        assert unreadable(figure) == [], figure.get_suptitle()


def test_synthetic_figures_are_readable_alone(saved, tmp_path):
    from urpe.experiments.synthetic.plots import figures, learning_curves_chart
    from urpe.experiments.synthetic.report import rows

    records, out = _records(
        ROOT / "results/synthetic", tmp_path, lambda r: r["config"]["task"] == "pi"
    )
    written = figures(records, rows(records), out)
    assert [p.name for p in written] == ["accuracy.png", "learned_BC_pi.png"]
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "logs/metrics.csv").write_text("step,train/acc,val/acc\n0,0.1,\n9,0.5,\n9,,0.6\n")
    learning_curves_chart([run], tmp_path / "curves.png")
    _assert_readable(saved, 3)


def test_learned_heatmaps_name_query_and_key_and_the_offsets_direction(saved, tmp_path):
    import torch

    from urpe.experiments.synthetic.plots import learned_matrices_chart

    matrices = {"B": torch.randn(2, 6, 6), "C": torch.rand(2, 6, 6)}
    learned_matrices_chart(matrices, "a run", tmp_path / "learned.png")
    (figure,) = saved
    panels = [ax for ax in figure.axes if ax.get_title()]
    assert len(panels) == 4
    assert {(ax.get_ylabel(), ax.get_xlabel()) for ax in panels} == {("query i", "key j")}
    for ax in panels:  # integer positions, from the first token on
        shown = [t for t in ax.get_xticks() if -0.5 <= t <= 5.5]
        assert shown[0] == 0 and len(shown) >= 3 and all(t == int(t) for t in shown)
    note = figure.get_suptitle()
    assert "above it j - i > 0" in note and "below it j - i < 0" in note
    bars = {ax.images[0].colorbar.ax.get_ylabel() for ax in panels}
    assert bars == {"B[i, j], added to the logits", "C[i, j], multiplies the softmax"}
    assert unreadable(figure) == []


# The width of a documentation page's text column (furo: 46em of 16 px): wider figures are
# shown scaled down to it.
PAGE_WIDTH_PX = 736


@pytest.mark.parametrize("heads", [4, 3])
def test_learned_heatmaps_stay_legible_at_a_pages_width(saved, tmp_path, heads):
    """The reproducing guide shows learned_BC_pi.png in a page's column: its smallest text must
    still show at 9 px there (8 px and less: illegible). It was 1,488 px wide, its ticks 5 px."""
    import torch
    from matplotlib.text import Text

    from urpe.experiments.synthetic.plots import learned_matrices_chart

    matrices = {"B": torch.randn(heads, 24, 24), "C": torch.rand(heads, 24, 24)}
    learned_matrices_chart(
        matrices, "learned B and C of a run with a long title " * 3, tmp_path / "b.png"
    )
    (figure,) = saved
    width_px = figure.get_figwidth() * figure.dpi
    shrink = min(1.0, PAGE_WIDTH_PX / width_px)
    texts = [t for t in figure.findobj(Text) if t.get_text().strip() and t.get_visible()]
    smallest = min(t.get_fontsize() for t in texts) * figure.dpi / 72 * shrink
    assert smallest >= 9, f"{smallest:.1f} px at {PAGE_WIDTH_PX} px"
    assert len([ax for ax in figure.axes if ax.get_title()]) == 2 * heads
    assert unreadable(figure) == []


@pytest.mark.parametrize("dataset", ["moses-plogp", "qm9"])
def test_graph_figures_are_readable_alone(saved, tmp_path, dataset):
    from urpe.experiments.graph.plots import figures
    from urpe.experiments.graph.report import rows

    records, out = _records(ROOT / "results/graph" / dataset, tmp_path)
    assert [p.name for p in figures(records, rows(records), out)] == ["curves.png", "gate.png"]
    _assert_readable(saved, 2)


@pytest.mark.parametrize("folder", ["results/lm", "results/finetune"])
def test_language_model_figures_are_readable_alone(saved, tmp_path, folder):
    from urpe.experiments.lm.plots import curves_chart, extrapolation_chart

    records, _ = _records(ROOT / folder, tmp_path)
    if folder.endswith("lm"):
        from urpe.experiments.lm.report import rows
    else:
        from urpe.experiments.finetune.report import rows
    curves_chart(records, tmp_path / "curves.png")
    extrapolation_chart(rows(records), tmp_path / "extrapolation.png")
    _assert_readable(saved, 2)


def test_benchmark_memory_figure_is_readable_alone(saved, tmp_path):
    from harness.plots import plot_memory

    results = json.loads((ROOT / "benchmarks/attention.json").read_text())
    plot_memory(results["memory"], tmp_path / "memory.png", results["shape"])
    _assert_readable(saved, 1)
