"""`amod frontier` on a small random backbone: every (method, cost) point measured and timed at two batch sizes,
each method's frontier read at fixed speed-ups, a finished sweep reused; and the reading itself on known points."""
from __future__ import annotations

import functools
import json

import pytest
import torch
from conftest import DEVICES, cli_in_process

from amod.methods import parse_method
from amod.experiments.frontier import accuracy_at, pareto




def test_the_frontier_keeps_the_points_nothing_beats_and_interpolates_between_them():
    points = [(1.0, 0.90), (1.3, 0.80), (1.4, 0.85), (1.9, 0.70), (2.0, 0.60), (1.5, 0.50)]
    assert pareto(points) == [(1.0, 0.90), (1.4, 0.85), (1.9, 0.70), (2.0, 0.60)]  # (1.3 and 1.5 are beaten)
    assert accuracy_at(points, 1.2) == pytest.approx(0.875)
    assert accuracy_at(points, 1.95) == pytest.approx(0.65)
    assert accuracy_at(points, 0.8) == 0.90  # a faster point serves a slower need
    assert accuracy_at(points, 2.1) is None  # not reached
    assert accuracy_at([], 1.5) is None


@pytest.mark.parametrize("device", DEVICES)
def test_the_sweep_measures_times_and_reads_every_method_and_reuses_what_it_measured(backbone_path, tmp_path, capsys,
                                                                                     device):
    out = tmp_path / "frontier"
    argv = ["frontier", "--checkpoint", str(backbone_path), "--img-size", "28", "--cost", "0.5", "0.8", "--probe-train",
            "100", "--val-limit", "64", "--speed-batch", "4", "1", "--speed-repeats", "1", "--speedups", "1.05", "50",
            "--methods", "ToMe", "A-MoD fold", "A-MoD calibrated", "--calibration-images", "16",
            "--device", device, "--out", str(out)]
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
            # (only the candidates within 2 % of the cost are run: 12 on the grid, fewer at a cost some cannot reach)
            assert report["images"] == 16 and 1 <= len(report["candidates"]) <= 12
            assert all(abs(c["cost"] - r["cost_target"]) <= 0.02 * r["cost_target"] for c in report["candidates"])
            best = report["candidates"][report["chosen"]]
            assert best["fidelity"] == max(c["fidelity"] for c in report["candidates"])
            method = parse_method(r["setting"])  # (a row keeps its method's spec)
            assert method.shape is not None and method.protect == best["protect"]
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


def test_compile_times_every_model_compiled_and_says_how_long_each_took(backbone_path, tmp_path, capsys, monkeypatch):
    """--compile: dense and every point timed after amod.compile at each batch size (torch.compile's eager backend
    here, to keep the test short), the seconds of each compile in the report's JSON."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    out = tmp_path / "frontier"
    argv = ["frontier", "--checkpoint", str(backbone_path), "--img-size", "28", "--cost", "0.6", "--probe-train", "20",
            "--val-limit", "8", "--speed-batch", "2", "1", "--speed-repeats", "1", "--methods", "ToMe", "A-MoD fold",
            "--compile", "--device", "cpu", "--amp", "bf16", "--out", str(out)]
    res = cli_in_process(argv, capsys)
    assert res.returncode == 0, res.stderr[-3000:]
    data = json.loads((out / "frontier.json").read_text())
    for r in [data["dense"], *data["rows"]]:
        assert all(r["speed"][b]["compile_s"] > 0 and r["speed"][b]["images_per_s"] > 0 for b in ("2", "1"))


def test_points_of_one_setting_are_timed_once_and_share_one_speed_up(backbone_path, tmp_path, capsys, monkeypatch):
    """ToMe and the registered tome are one method: at each cost they resolve to one model, timed once, one speed-up
    for both rows. ToMe at 0.48 and 0.5 reach the same r on this backbone: measured once, and the report says so."""
    from amod.tools import bench

    timed, time_callables = [], bench.time_callables
    monkeypatch.setattr(bench, "time_callables", lambda fns, *a, **k: timed.append(list(fns)) or time_callables(
        fns, *a, **k))
    out = tmp_path / "frontier"
    argv = ["frontier", "--checkpoint", str(backbone_path), "--img-size", "28", "--cost", "0.48", "0.5", "0.8",
            "--probe-train", "20", "--val-limit", "8", "--speed-batch", "2", "--speed-repeats", "1", "--speedups",
            "1.05", "--methods", "ToMe", "tome", "--out", str(out)]
    res = cli_in_process(argv, capsys)
    assert res.returncode == 0, res.stderr[-3000:]
    assert timed == [["dense", "ToMe @ 0.48", "ToMe @ 0.8"]]
    data = json.loads((out / "frontier.json").read_text())
    rows = {(r["method"], r["cost_target"]): r for r in data["rows"]}
    assert set(rows) == {(m, c) for m in ("ToMe", "tome") for c in (0.48, 0.8)}  # (0.5: the setting of 0.48)
    for cost in (0.48, 0.8):
        assert rows[("tome", cost)]["speed"] == rows[("ToMe", cost)]["speed"]
        assert rows[("tome", cost)]["timed_as"] == f"ToMe @ {cost:g}" and "timed_as" not in rows[("ToMe", cost)]
    assert data["same_setting"] == {"ToMe @ 0.5": "ToMe @ 0.48", "tome @ 0.48": "ToMe @ 0.48",
                                    "tome @ 0.5": "ToMe @ 0.48", "tome @ 0.8": "ToMe @ 0.8"}
    assert ("Points of one setting are one model, timed once: ToMe @ 0.5 is ToMe @ 0.48 (measured once, no row of its "
            "own); tome @ 0.48 shares the speed-up of ToMe @ 0.48;") in (out / "frontier.md").read_text()


@pytest.mark.parametrize("extra, message", [(["--speedups", "1"], "--speedups must be finite numbers above 1"),
                                            (["--speedups", "inf"], "--speedups must be finite numbers above 1"),
                                            (["--cost", "0"], "--cost must be a number in (0, 1]"),
                                            (["--methods", "EViT"], "unknown method 'EViT' for --methods"),
                                            (["--probe-train", "8", "--methods", "ToMe"],
                                             "the linear probe needs at least 10 training images and --probe-train "
                                             "is 8")]
                         + ([(["--device", "cuda"], "--device cuda, but torch")] if not torch.cuda.is_available()
                            else []))
def test_bad_settings_are_refused_in_one_line_before_any_work(backbone_path, tmp_path, capsys, extra, message):
    res = cli_in_process(["frontier", "--checkpoint", str(backbone_path), *extra, "--out", str(tmp_path / "f")], capsys)
    assert res.returncode == 2 and message in res.stderr and res.stderr.count("\n") == 1, res.stderr
    assert not (tmp_path / "f").exists()


def test_each_speed_up_is_taken_against_the_dense_runs_around_it(monkeypatch):
    """A fake clock and a slow spell of the machine in the middle of a round: model "a" and the dense runs on either
    side of it take twice as long. Its ratio pairs it with those dense runs, so the spell cancels out; a ratio to a
    dense run at the start of the round would halve it."""
    from amod.tools import bench

    clock, calls, seconds = [0.0], [], {"dense": 1.0, "a": 0.5, "b": 0.25, "c": 0.5, "d": 0.5, "e": 1.0}

    def fn(name):
        def run():
            calls.append(name)
            clock[0] += seconds[name] * (2.0 if 13 <= len(calls) - 1 <= 15 else 1.0)  # round 1: dense, a, dense
        return run

    monkeypatch.setattr(bench.time, "perf_counter", lambda: clock[0])
    timed = bench.time_callables({n: fn(n) for n in seconds}, repeats=3, warmup=1, reference="dense")
    times, ratios = ({n: t[k] for n, t in timed.items()} for k in ("times", "ratios"))
    assert calls[:7] == ["dense", "a", "b", "c", "d", "dense", "e"] and calls[7] == "dense"  # again after 4, and last
    assert calls[8:10] == ["dense", "b"]  # the next round starts one model later
    assert calls[13:16] == ["dense", "a", "dense"]
    assert ratios["a"] == [2.0, 2.0, 2.0] and times["a"] == [1.0, 0.5, 0.5]  # the spell shows in its seconds only
    assert ratios["b"][1:] == [4.0, 4.0] and ratios["e"][1:] == [1.0, 1.0] and ratios["dense"] == [1.0] * 3
    assert timed["a"]["speedup"] == 2.0 and timed["dense"]["speedup"] == 1.0


@pytest.fixture(scope="module")
def small_folders(tmp_path_factory):
    """Two imagefolder data sets of 3-channel 32-px images: ``twelve`` (12 training and 4 test images, two classes)
    and ``one_test`` (12 training images and 1 test image, one class)."""
    from PIL import Image

    root = tmp_path_factory.mktemp("small")
    g = torch.Generator().manual_seed(0)
    layout = {"twelve": {"train": {"a": 6, "b": 6}, "val": {"a": 2, "b": 2}},
              "one_test": {"train": {"a": 12}, "val": {"a": 1}}}
    for name, splits in layout.items():
        for split, classes in splits.items():
            for c, n in classes.items():
                (root / name / split / c).mkdir(parents=True)
                for i in range(n):
                    pixels = (torch.rand(32, 32, 3, generator=g) * 255).byte().numpy()
                    Image.fromarray(pixels).save(root / name / split / c / f"{i}.png")
    return root


@pytest.mark.parametrize("data, extra, message", [
    ("twelve", ["--methods", "A-MoD calibrated", "--calibration-images", "16"],
     "--calibration-images 16: the calibrated methods calibrate on the first of the probe's 12 training images"),
    ("one_test", ["--methods", "ToMe"], "has 1 test image; the frontier needs at least 2"),
])
def test_data_too_small_for_the_sweep_is_refused_before_any_work(backbone_path, small_folders, tmp_path, capsys,
                                                                data, extra, message):
    argv = ["frontier", "--checkpoint", str(backbone_path), "--img-size", "28", "--data",
            f"imagefolder:{small_folders / data}", "--probe-train", "64", *extra, "--out", str(tmp_path / "f")]
    res = cli_in_process(argv, capsys)
    assert res.returncode == 2 and message in res.stderr and res.stderr.count("\n") == 1, res.stderr
    assert not (tmp_path / "f").exists()


def test_a_training_runs_directory_is_refused_and_its_log_left_alone(backbone_path, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("epochs: 1\n")
    (run / "train.log").write_text("the run's log\n")
    res = cli_in_process(["frontier", "--checkpoint", str(backbone_path), "--out", str(run)], capsys)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert f"--out {run} holds an amod train or finetune run (config.yaml)" in res.stderr
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "train.log"]
    assert (run / "train.log").read_text() == "the run's log\n"


def test_torn_lines_of_the_sweeps_files_are_named_in_a_warning(tmp_path, caplog):
    from amod.experiments.features import finished_probe_rows
    from amod.experiments.calibrate_command import CalibrationCache

    rows = tmp_path / "frontier_rows.jsonl"
    rows.write_text(json.dumps({"method": "ToMe", "cost_target": 0.5, "method_repr": "r"}) + "\n" + '{"method": "To')
    calibrations = tmp_path / "calibrations.jsonl"
    calibrations.write_text('{"method"\n' + json.dumps({"method": "c", "cost_target": 0.5, "grid": "g"}) + "\n")
    with caplog.at_level("WARNING", logger="amod"):
        assert list(finished_probe_rows(rows)) == [("ToMe", 0.5, "r")]
        assert list(CalibrationCache(calibrations, None).done) == [("c", 0.5, "g")]
    said = [r.getMessage() for r in caplog.records]
    assert said == [f"{rows}: 1 line that is not a measurement, skipped (line 2)",
                    f"{calibrations}: 1 line that is not a calibration, skipped (line 1)"], said


# ---------------------------------------------------------------- speed-ups faster than the MACs allow

def test_a_speed_up_beyond_the_macs_is_flagged_and_the_frontier_leaves_it_out(recwarn):
    from amod.tools.bench import IMPLAUSIBLE_NOTE, implausible_speedup, speedup_text
    from amod.experiments.frontier import flag_implausible, readings

    # make demo's busy machine: 7.46x at cost 0.56 and 10.13x at 0.40; 1.3x at 0.56 is a measurement
    assert implausible_speedup(7.46, 0.56) and implausible_speedup(10.13, 0.40) and not implausible_speedup(1.3, 0.56)
    assert not implausible_speedup(2.6, 0.40)  # (within 1.5x of its FLOP bound, 2.5x)
    assert speedup_text(7.46, 0.56) == "7.46x (?)" and speedup_text(1.3, 0.56) == "1.30x"
    assert "faster than its MACs allow" in IMPLAUSIBLE_NOTE
    dense = {"method": "dense", "top1": 0.9, "halves": [0.9, 0.9], "cost": 1.0, "cost_target": 1.0,
             "speed": {"32": {"speedup": 1.0}}}
    rows = [{"method": "m", "top1": 0.8, "halves": [0.8, 0.8], "cost": 0.5, "cost_target": 0.5,
             "speed": {"32": {"speedup": 1.6}}},
            {"method": "m", "top1": 0.7, "halves": [0.7, 0.7], "cost": 0.4, "cost_target": 0.4,
             "speed": {"32": {"speedup": 9.0}}}]
    flag_implausible(rows, [32])
    assert [r["speed"]["32"]["implausible"] for r in rows] == [False, True]
    said = [str(w.message) for w in recwarn]
    assert len(said) == 1 and "1 measured speed-up is faster than the MACs allow" in said[0] and "m @ 0.4" in said[0]
    read = readings(rows, dense, 32, [1.6, 2.0], ["m"])
    assert read["1.6"]["m"]["top1"] == pytest.approx(0.8) and read["2"]["m"] is None  # 9x is no reading


def test_compare_and_the_demo_flag_a_speed_up_beyond_the_macs(tmp_path, recwarn, capsys):
    from amod.experiments import compare, demo
    from amod.experiments.finetune_study.plan import ARMS, FinetuneConfig, Planned
    from amod.mod.convert import MoD

    row = {"method": "A-MoD fold", "cost_target": 0.4, "cost": 0.4, "setting": MoD(capacity=0.5).spec(),
           "zero_top1": 0.5, "top1": None, "cosine": 0.9, "run": None, "images_per_s": 100.0, "speedup": 10.13,
           "flop_bound_efficiency": 4.05}
    compare.write_report(tmp_path, compare.CompareConfig(out=str(tmp_path)), tmp_path / "dense.safetensors",
                         "fashion-mnist", 10, 28, 0.6, 10.0, [row], probe_mode=True)
    text = (tmp_path / "compare.md").read_text()
    assert "| 10.13x (?) |" in text and "faster than its MACs allow" in text
    assert json.loads((tmp_path / "compare.json").read_text())["rows"][0]["implausible_speedup"] is True
    arms = {a.name: a for a in ARMS}
    planned = [Planned(arms["dense"], 1.0, arms["dense"].method, 1.0, 4),
               Planned(arms["A-MoD fold"], 0.56, MoD(skipped="fold", capacity=0.8), 0.56, 4)]
    study = FinetuneConfig(checkpoint="backbone.safetensors", steps=4)
    demo.write_report(tmp_path, study, planned, {"dense": 0.9, "A-MoD fold @ 0.56": 0.8},
                      {"dense": 15.3, "A-MoD fold @ 0.56": 114.1}, planned[1], [], 10, 1.0)
    text = (tmp_path / "report.md").read_text()
    assert "| 7.46x (?) |" in text and "faster than its MACs allow" in text
    assert [r["implausible_speedup"] for r in json.loads((tmp_path / "report.json").read_text())["rows"]] == \
        [False, True]
    assert sum("faster than the MACs allow" in str(w.message) for w in recwarn) == 2


def test_the_reports_say_the_cost_tolerance_their_flags_use(tmp_path, monkeypatch, capsys):
    # the "(!)" flag and the words under the tables read the one value, amod.cost.COST_TOLERANCE
    import amod.cost
    from amod.experiments import compare, frontier
    from amod.mod.convert import MoD

    monkeypatch.setattr(amod.cost, "COST_TOLERANCE", 0.1)
    setting = MoD(skipped="fold", capacity=0.8).spec()
    near, far = 0.43, 0.45  # 7.5 % and 12.5 % off the target 0.4: inside 10 %, and outside
    rows = [{"method": "A-MoD fold", "cost_target": 0.4, "cost": cost, "setting": setting, "zero_top1": 0.5,
             "top1": None, "cosine": 0.9, "run": None, "images_per_s": 10.0, "speedup": 1.5,
             "flop_bound_efficiency": 0.7} for cost in (near, far)]
    compare.write_report(tmp_path, compare.CompareConfig(out=str(tmp_path)), tmp_path / "dense.safetensors",
                         "fashion-mnist", 10, 28, 0.6, 10.0, rows, probe_mode=True)
    text = (tmp_path / "compare.md").read_text()
    assert f"| {near:.3f} |" in text and f"| {far:.3f} (!) |" in text
    assert "cannot reach the target cost within 10 % on this model" in text and "within 2 %" not in text

    speed = {"32": {"images_per_s": 10.0, "speedup": 1.5}}
    dense = {"method": "dense", "cost_target": 1.0, "cost": 1.0, "setting": None, "top1": 0.9, "halves": [0.9, 0.9],
             "cosine": 1.0, "speed": {"32": {"images_per_s": 10.0, "speedup": 1.0}}}
    calibration = {"candidates": [{"tilt": 0.0, "protect": 0.0, "capacity": 0.8, "fidelity": 0.9}], "chosen": 0,
                   "seconds": 1.0}
    points = [{"method": "A-MoD calibrated", "cost_target": 0.4, "cost": cost, "setting": setting, "top1": 0.8,
               "halves": [0.8, 0.8], "cosine": 0.9, "speed": speed, "calibration": calibration} for cost in (near, far)]
    cfg = frontier.FrontierConfig(checkpoint="backbone.safetensors", out=str(tmp_path), speed_batches=(32,))
    frontier._write_report(tmp_path, cfg, "fashion-mnist", 10, 10, 28, dense, points, {})
    text = (tmp_path / "frontier.md").read_text()
    assert f"| {near:.3f} |" in text and f"| {far:.3f} (!) |" in text
    assert "cannot reach the cost target within 10 % on this model" in text and "within 10 % of the cost wins" in text
    assert "within 2 %" not in text
