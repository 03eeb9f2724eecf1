"""`amod frontier` on a small random backbone: every (method, cost) point measured and timed at two batch sizes,
each method's frontier read at fixed speed-ups, a finished sweep reused; and the reading itself on known points."""
from __future__ import annotations

import json

import pytest
from conftest import cli_in_process

from amod.experiments.frontier import accuracy_at, pareto




def test_the_frontier_keeps_the_points_nothing_beats_and_interpolates_between_them():
    points = [(1.0, 0.90), (1.3, 0.80), (1.4, 0.85), (1.9, 0.70), (2.0, 0.60), (1.5, 0.50)]
    assert pareto(points) == [(1.0, 0.90), (1.4, 0.85), (1.9, 0.70), (2.0, 0.60)]  # (1.3 and 1.5 are beaten)
    assert accuracy_at(points, 1.2) == pytest.approx(0.875)
    assert accuracy_at(points, 1.95) == pytest.approx(0.65)
    assert accuracy_at(points, 0.8) == 0.90  # a faster point serves a slower need
    assert accuracy_at(points, 2.1) is None  # not reached
    assert accuracy_at([], 1.5) is None


def test_the_sweep_measures_times_and_reads_every_method_and_reuses_what_it_measured(backbone_path, tmp_path, capsys):
    out = tmp_path / "frontier"
    argv = ["frontier", "--checkpoint", str(backbone_path), "--img-size", "28", "--cost", "0.5", "0.8", "--probe-train",
            "100", "--val-limit", "64", "--speed-batch", "4", "1", "--speed-repeats", "1", "--speedups", "1.05", "50",
            "--methods", "ToMe", "A-MoD fold", "A-MoD calibrated", "--calibration-images", "16",
            "--out", str(out)]
    res = cli_in_process(argv, capsys)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads((out / "frontier.json").read_text())
    assert data["test_images"] == 64 and data["dense"]["speed"]["4"]["speedup"] == 1.0
    assert {(r["method"], r["cost_target"]) for r in data["rows"]} == \
        {(m, c) for m in ("ToMe", "A-MoD fold", "A-MoD calibrated") for c in (0.5, 0.8)}
    for r in data["rows"]:
        assert 0 <= r["top1"] <= 1 and sum(r["halves"]) / 2 == pytest.approx(r["top1"])  # two halves of 32
        assert r["cost"] < 0.95 and all(r["speed"][b]["images_per_s"] > 0 for b in ("4", "1"))
    for batch in ("4", "1"):
        assert all(v is None for v in data["readings"][batch]["50"].values())  # no method is 50x faster
        reached = data["readings"][batch]["1.05"]
        assert set(reached) == {"ToMe", "A-MoD fold", "A-MoD calibrated"}
    for r in data["rows"]:  # the calibrated points: the candidate chosen is the most faithful one at the cost
        if r["method"] == "A-MoD calibrated":
            report = r["calibration"]
            assert report["images"] == 16 and len(report["candidates"]) == 12
            best = report["candidates"][report["chosen"]]
            assert best["fidelity"] == max(c["fidelity"] for c in report["candidates"]
                                           if abs(c["cost"] - r["cost_target"]) <= 0.02 * r["cost_target"])
            assert r["setting"]["shape"] is not None and r["setting"]["protect"] == best["protect"]
    report = (out / "frontier.md").read_text()
    assert "| 50x | – | – | – | – |" in report and "## Accuracy at measured speed-up, batch 1" in report
    assert "## Calibration" in report
    assert (out / "frontier.png").stat().st_size > 10_000
    # a second sweep in the same directory measures no point again: the same accuracies, the rows file unchanged
    rows_file, calibrations = next(out.glob("frontier_rows_*.jsonl")), next(out.glob("calibrations_*.jsonl"))
    measured, calibrated = rows_file.read_text(), calibrations.read_text()
    assert len(measured.splitlines()) == 6 and len(calibrated.splitlines()) == 2
    assert cli_in_process(argv, capsys).returncode == 0
    assert rows_file.read_text() == measured and calibrations.read_text() == calibrated
    again = json.loads((out / "frontier.json").read_text())
    assert [r["top1"] for r in again["rows"]] == [r["top1"] for r in data["rows"]]


@pytest.mark.parametrize("extra, message", [(["--speedups", "1"], "--speedups must be numbers above 1"),
                                            (["--cost", "0"], "--cost must be a number in (0, 1]"),
                                            (["--methods", "EViT"], "unknown method 'EViT' for --methods")])
def test_bad_settings_are_refused_in_one_line_before_any_work(backbone_path, tmp_path, capsys, extra, message):
    res = cli_in_process(["frontier", "--checkpoint", str(backbone_path), *extra, "--out", str(tmp_path / "f")], capsys)
    assert res.returncode == 2 and message in res.stderr and res.stderr.count("\n") == 1, res.stderr
    assert not (tmp_path / "f").exists()


def test_each_speed_up_is_taken_against_the_dense_runs_around_it(monkeypatch):
    """A fake clock and a slow spell of the machine in the middle of a round: model "a" and the dense runs on either
    side of it take twice as long. Its ratio pairs it with those dense runs, so the spell cancels out; a ratio to a
    dense run at the start of the round would halve it."""
    from amod.experiments import frontier

    clock, calls, seconds = [0.0], [], {"dense": 1.0, "a": 0.5, "b": 0.25, "c": 0.5, "d": 0.5, "e": 1.0}

    def fn(name):
        def run():
            calls.append(name)
            clock[0] += seconds[name] * (2.0 if 13 <= len(calls) - 1 <= 15 else 1.0)  # round 1: dense, a, dense
        return run

    monkeypatch.setattr(frontier.time, "perf_counter", lambda: clock[0])
    times, ratios = frontier.interleaved_with_reference({n: fn(n) for n in seconds}, "dense", repeats=3, warmup=1,
                                                        device=frontier.torch.device("cpu"))
    assert calls[:7] == ["dense", "a", "b", "c", "d", "dense", "e"] and calls[7] == "dense"  # again after 4, and last
    assert calls[8:10] == ["dense", "b"]  # the next round starts one model later
    assert calls[13:16] == ["dense", "a", "dense"]
    assert ratios["a"] == [2.0, 2.0, 2.0] and times["a"] == [1.0, 0.5, 0.5]  # the spell shows in its seconds only
    assert ratios["b"][1:] == [4.0, 4.0] and ratios["e"][1:] == [1.0, 1.0] and ratios["dense"] == [1.0] * 3
