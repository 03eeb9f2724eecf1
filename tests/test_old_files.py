"""Files written by amod before a run's method was its spec alone (tests/fixtures/written_by_dfaf1c7, see its
README) still open: a run's config.yaml, a killed run's training checkpoint (it resumes and ends as the unbroken run
did), its model file, and the settings that report rows kept."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

import amod
from amod.methods import method_of, parse_method
from amod.mod.convert import MoD
from amod.mod.isoflop import IsoFLOP
from amod.shorthand import method_from_shorthand, setting_text_of
from amod.tome.merging import TokenMerging
from amod.tome.pitome import PiToMe
from amod.train.config import RunConfig
from amod.train.engine import read_metrics
from conftest import cli_in_process

OLD = Path(__file__).parent / "fixtures" / "written_by_dfaf1c7"
TIMINGS = ("epoch_time_s", "images_per_s")  # (the keys of a row that time it)


@pytest.mark.parametrize("name, method", [
    ("fold", MoD(skipped="fold", protect=0.3)), ("tome", TokenMerging(cost=0.7)), ("pitome", PiToMe(keep=0.8)),
    ("iso", IsoFLOP(router="random")),  # (its --router-seed was not IsoFLOP's: that code dropped it too)
])
def test_an_old_config_yaml_reads_as_its_method(name, method):
    data = yaml.safe_load((OLD / "configs" / f"{name}.yaml").read_text())
    assert "router" in data and "tome_cost" in data  # (an old file: every shorthand option written out)
    cfg = RunConfig.from_dict(data).validate()
    assert (cfg.method(), cfg.method_spec) == (method, method.spec())


def test_a_killed_old_run_resumes_from_its_checkpoint_and_ends_as_the_unbroken_run(tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(OLD / "fold_run_killed_after_epoch_1", run)
    assert amod.load(run / "model.safetensors").amod_config.skipped == "fold"  # its model file opens as it was
    res = cli_in_process(["train", "--resume", "--out", str(run)], capsys)
    assert res.returncode == 0, res.stderr[-3000:]

    def without_timings(rows):
        return [{k: v for k, v in r.items() if not any(t in k for t in TIMINGS)} for r in rows]

    rows = without_timings(read_metrics(run / "metrics.jsonl"))
    assert [r["epoch"] for r in rows] == [1, 2]
    assert rows == without_timings(read_metrics(OLD / "fold_run_uninterrupted_metrics.jsonl"))
    assert method_of(amod.load(run / "model.safetensors")) == MoD(skipped="fold", protect=0.3, layers=(0, 1),
                                                                  scale_output=False)
    assert RunConfig.from_dict(yaml.safe_load((run / "config.yaml").read_text())).method_spec == \
        "mod:skipped=fold,protect=0.3"


def test_the_settings_old_report_rows_kept_render_as_they_did():
    rows = json.loads((OLD / "report_settings.json").read_text())["rows"]
    assert len(rows) == 8
    for row in rows:
        assert setting_text_of(row["setting"]) == row["setting_text"], row
        method = method_from_shorthand(row["setting"], lenient=True)
        assert (method.label(), method.spec()) == (row["label"], row["spec"]), row
        assert parse_method(row["spec"]).setting_text() == row["setting_text"]
