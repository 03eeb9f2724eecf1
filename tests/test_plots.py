"""The report figures, read back from their matplotlib Figures: every series of one axes told apart (the finetune
study's curves with its real arms), the frontiers' dense point one marker of its own and off every method's line, their
error bars the tables' ± and their axes naming what is measured."""
from __future__ import annotations

from pathlib import Path

import pytest
from matplotlib.colors import to_hex

from amod.experiments import plots
from amod.experiments.finetune_study.plan import (ARMS, DENSE, HYBRID_STE_FAST, REFERENCE, STANDARD_FAST,
                                                  FinetuneConfig, Planned)
from amod.experiments.finetune_study.report import curve_figures
from amod.methods import Dense


def _styles(ax) -> list[tuple[str, str]]:
    return [(to_hex(line.get_color()), line.get_linestyle()) for line in ax.get_lines()]


# the review's figure (docs/review_curves_0.4.png: three of its five lines were one green) and the whole study's
REVIEW = (DENSE, REFERENCE, "standard MoD", STANDARD_FAST, HYBRID_STE_FAST)


@pytest.mark.parametrize("names", [REVIEW, tuple(a.name for a in ARMS)], ids=["review", "every arm"])
def test_every_curve_of_a_study_figure_has_a_colour_and_style_of_its_own(names):
    arms = [a for a in ARMS if a.name in names]
    cfg = FinetuneConfig(checkpoint="backbone.safetensors", costs=(0.4,), seeds=1, arms=tuple(arms))
    planned = [Planned(a, 1.0 if isinstance(a.method, Dense) else 0.4, a.method, 0.4, 12) for a in arms]
    table = [{"cost_target": p.cost_target, "method": p.arm.name, "steps": [0, 32, 64],
              "curve": [0.1, 0.5, 0.6 + i / 100], "seeds_done": 1} for i, p in enumerate(planned)]
    figures = curve_figures(cfg, planned, table)
    ax = figures[0.4].axes[0]
    assert [line.get_label() for line in ax.get_lines()] == list(names)
    styles = _styles(ax)
    assert len(set(styles)) == len(styles), styles
    assert ax.get_ylabel() == "test top-1 (%)"
    # a variant keeps its counterpart's colour where that pair is free: the distilled A-MoD (paper) dashed
    if REFERENCE + " + distillation" in names:
        by_name = dict(zip(names, styles))
        assert by_name[REFERENCE + " + distillation"] == (by_name[REFERENCE][0], "--")


def test_variants_of_one_series_in_one_style_get_colours_of_their_own():
    styles = plots.series_styles(["a", "b", "c"], {"b": ("a", "--"), "c": ("a", "--")})
    assert styles["b"] == (styles["a"][0], "--") and styles["c"][1] == "--"
    assert styles["c"][0] != styles["a"][0]
    many = plots.series_styles([str(i) for i in range(45)])  # past the palette: colours come back in other styles
    assert len(set(many.values())) == 45 and plots.REFERENCE_COLOUR not in {c for c, _ in many.values()}


def _row(method: str, cost: float, speedup: float, score: float, halves: tuple[float, float], metric: str,
         implausible: bool = False, batch: str = "8") -> dict:
    return {"method": method, "cost_target": cost, "cost": cost, "setting": {}, metric: score, "pixel_acc": 0.9,
            "halves": list(halves), "cosine": 0.9,
            "speed": {batch: {"images_per_s": 10.0, "speedup": speedup, "implausible": implausible}}}


@pytest.fixture
def figures(monkeypatch) -> list:
    """The figures the reports write, kept instead of written."""
    kept = []

    def keep(fig, path, dpi=120):
        kept.append(fig)
        return Path(path)

    from amod.dense import frontier as dense_frontier
    from amod.experiments import frontier
    monkeypatch.setattr(dense_frontier, "save_figure", keep)
    monkeypatch.setattr(frontier, "save_figure", keep)
    return kept


def test_the_dense_frontier_draws_dense_as_one_marker_and_each_method_through_its_own_points(tmp_path, figures):
    from amod.dense.frontier import DenseFrontierConfig, _write_report

    dense = _row("dense", 1.0, 1.0, 0.46, (0.47, 0.45), "miou")
    rows = [_row("ToMe", 0.4, 2.3, 0.43, (0.44, 0.42), "miou"), _row("ToMe", 0.25, 3.6, 0.12, (0.12, 0.12), "miou"),
            _row("A-MoD (paper)", 0.8, 0.94, 0.36, (0.40, 0.32), "miou"),
            _row("A-MoD (paper)", 0.5, 1.2, 0.17, (0.18, 0.16), "miou"),
            _row("A-MoD (paper)", 0.4, 9.0, 0.10, (0.10, 0.10), "miou", implausible=True)]
    cfg = DenseFrontierConfig(checkpoint="backbone.safetensors", out=str(tmp_path), batch=8, img_size=448).only(
        ["ToMe", "A-MoD (paper)"])
    _write_report(tmp_path, cfg, dense, rows, {})
    (fig,) = figures
    (ax,) = fig.axes
    drawn = {c.get_label(): c for c in ax.containers}  # one ErrorbarContainer a series
    assert list(drawn) == ["ToMe", "A-MoD (paper)", "dense"]
    line = {name: c.lines[0] for name, c in drawn.items()}
    assert list(line["dense"].get_xdata()) == [1.0] and list(line["dense"].get_ydata()) == pytest.approx([46.0])
    assert line["dense"].get_linestyle() == "None"
    # each method's line: its own points in speed-up order, dense not among them, a flagged speed-up left out
    assert list(line["ToMe"].get_xdata()) == [2.3, 3.6]
    assert list(line["A-MoD (paper)"].get_xdata()) == [0.94, 1.2]
    assert list(line["A-MoD (paper)"].get_ydata()) == pytest.approx([36.0, 17.0])
    # the error bars: ± half the difference between the two halves, in points (the tables' ±)
    bars = drawn["A-MoD (paper)"].lines[2][0].get_segments()
    assert [seg[1][1] - seg[0][1] for seg in bars] == pytest.approx([8.0, 2.0])
    assert ax.get_ylabel() == "segmentation mIoU on test canvases (%)"
    styles = [(to_hex(c.lines[0].get_color()), c.lines[0].get_linestyle()) for c in drawn.values()]
    assert len(set(styles)) == len(styles)


def test_the_frontier_names_its_test_images_and_draws_their_halves_as_error_bars(tmp_path, figures):
    from amod.experiments.frontier import FrontierConfig, _write_report

    dense = _row("dense", 1.0, 1.0, 0.84, (0.841, 0.839), "top1", batch="32")
    rows = [_row("ToMe", 0.3, 2.8, 0.214, (0.208, 0.22), "top1", batch="32"),
            _row("A-MoD fold", 0.5, 1.5, 0.80, (0.79, 0.81), "top1", batch="32")]
    cfg = FrontierConfig(checkpoint="backbone.safetensors", out=str(tmp_path), speed_batches=(32,)).only(
        ["ToMe", "A-MoD fold"])
    _write_report(tmp_path, cfg, "fashion-mnist", 10, 10, 28, dense, rows, {})
    (fig,) = figures
    (ax,) = fig.axes
    assert ax.get_ylabel() == "probe top-1 on test images (%)" and "val" not in ax.get_ylabel()
    drawn = {c.get_label(): c for c in ax.containers}
    assert list(drawn) == ["ToMe", "A-MoD fold", "dense"]
    assert [list(c.lines[0].get_xdata()) for c in drawn.values()] == [[2.8], [1.5], [1.0]]
    (bar,) = drawn["ToMe"].lines[2][0].get_segments()
    assert bar[1][1] - bar[0][1] == pytest.approx(1.2)  # ± 0.6 points
