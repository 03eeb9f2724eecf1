"""``amod.train.resume``: the one journal of finished work and the one training state every resumable command keeps;
and the files of earlier versions (``tests/fixtures/resume_dfaf1c7``, written by amod at dfaf1c7) still resume."""
from __future__ import annotations

import importlib.util
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

import amod

from amod.mod.convert import MoD
from amod.train import engine
from amod.train.resume import Journal, load_training_checkpoint, restore_training_state, save_training_state, \
    training_state

FIXTURES = Path(__file__).parent / "fixtures" / "resume_dfaf1c7"
_spec = importlib.util.spec_from_file_location("resume_fixtures", FIXTURES / "written_by.py")
written_by = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(written_by)
tiny_model, tiny_run = written_by.tiny_model, written_by.tiny_run  # the fixtures' model and run


def key(row):
    return row["name"]


# ---------------------------------------------------------------- the journal

def test_a_journal_keeps_the_last_row_of_a_key_and_only_its_own_settings(tmp_path):
    path = tmp_path / "done.jsonl"
    mine = Journal(path, key, fingerprint="a")
    mine.add({"name": "x", "value": 1})
    Journal(path, key, fingerprint="b").add({"name": "x", "value": 2})  # another setting's row: kept, not used
    mine.add({"name": "x", "value": 3})  # the same work again: the last one written wins
    mine.add({"name": "y", "value": 4})
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["fingerprint"], r["value"]) for r in lines] == [("a", 1), ("b", 2), ("a", 3), ("a", 4)]
    again = Journal(path, key, fingerprint="a")
    assert list(again) == ["x", "y"] and again.get("x")["value"] == 3 and again.get("z") is None
    assert Journal(path, key, fingerprint="b").get("x")["value"] == 2
    assert len(Journal(path, key)) == 2  # no fingerprint: the file's name binds its rows, every row is used
    # every row names the amod that wrote it: its version and a digest of its source, the same for the same code
    from amod import provenance as prov

    assert {json.dumps(r["amod"]) for r in lines} == {json.dumps(prov.provenance())}
    assert prov.provenance() == {"version": amod.__version__, "source": prov.source_digest()}
    source = tmp_path / "source"
    (source / "sub").mkdir(parents=True)
    (source / "sub" / "a.py").write_text("x = 1\n")
    digests = []
    for change in ("", "x = 2\n"):
        if change:
            (source / "sub" / "a.py").write_text(change)
        prov.source_digest.cache_clear()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(prov, "PACKAGE", source)
            digests.append(prov.source_digest())
        prov.source_digest.cache_clear()
    assert len(digests[0]) == 12 and digests[0] != digests[1]  # (a change of the source is a new digest)


def test_a_torn_last_line_is_dropped_with_a_warning_and_the_next_row_starts_a_line(tmp_path, caplog):
    """A process killed mid-write leaves half a line without its newline: it is said, left out (that work runs
    again), and the row appended next is not glued onto it."""
    path = tmp_path / "done.jsonl"
    Journal(path, key, fingerprint="a").add({"name": "x", "value": 1})
    with open(path, "a") as f:
        f.write('{"fingerprint": "a", "name": "y", "val')
    with caplog.at_level(logging.WARNING, logger="amod"):
        torn = Journal(path, key, fingerprint="a", what="a test row")
    assert list(torn) == ["x"] and "1 line that is not a test row, skipped (line 2)" in caplog.text
    torn.add({"name": "y", "value": 2})
    assert {k: r["value"] for k, r in Journal(path, key, fingerprint="a").rows.items()} == {"x": 1, "y": 2}


def test_a_journal_without_a_key_is_a_sequence_and_reads_older_rows_through_older(tmp_path):
    path = tmp_path / "rounds.jsonl"
    path.write_text('{"key": "a", "t": 1}\n{"key": "b", "t": 2}\n')  # rows of the older format (no fingerprint)
    rounds = Journal(path, fingerprint="a", older=lambda r: {"fingerprint": r.pop("key"), **r})
    rounds.add({"t": 3})
    rounds.add({"t": 3})  # no key: a repeated row is another row
    assert [r["t"] for r in Journal(path, fingerprint="a", older=lambda r: {"fingerprint": r.pop("key"), **r})
            .values()] == [1, 3, 3]


# ---------------------------------------------------------------- the training state

def test_a_training_state_restores_a_run_as_it_was(tmp_path):
    torch.manual_seed(0)
    model = MoD(router="random", capacity=0.5, layers=(0,)).apply(tiny_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    model(torch.randn(2, 1, 28, 28)).sum().backward()
    optimizer.step()
    scheduler.step()
    path = save_training_state(tmp_path / "state.pt", training_state(model, optimizer, scheduler, step=3,
                                                                     config={"a": 1}))
    drawn = torch.rand(3)
    saved = load_training_checkpoint(path, frozenset({"step", "config", "model", "routers"}))
    assert saved["step"] == 3 and saved["config"] == {"a": 1} and set(saved["routers"].values()) == {1}

    torch.manual_seed(1)
    fresh = MoD(router="random", capacity=0.5, layers=(0,)).apply(tiny_model())
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    fresh_scheduler = torch.optim.lr_scheduler.LambdaLR(fresh_optimizer, lambda s: 1.0)
    restore_training_state(saved, fresh, fresh_optimizer, fresh_scheduler)
    assert torch.equal(torch.rand(3), drawn)  # the generators go on from where the state was saved
    assert engine.router_state(fresh) == engine.router_state(model)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    assert fresh_scheduler.last_epoch == 1 and fresh_optimizer.state_dict()["state"][0]["step"] == 1


# ---------------------------------------------------------------- files of earlier versions

def test_a_finetune_study_run_killed_by_the_former_version_resumes_with_the_same_results(tmp_path):
    """The fixture's ``evals.jsonl`` and ``state.pt`` (a run killed after its step-1 evaluation): this version
    takes the step-1 row as done, resumes from the state (its routers' draws under the former name ``router``), and
    ends with the rows of an unbroken run of this version."""
    from amod.experiments.finetune_study import finetune_run
    from amod.experiments.finetune_study.rows import EvalRows

    old = torch.load(FIXTURES / "run" / "state.pt", weights_only=True)
    assert old["step"] == 1 and "router" in old and "routers" not in old  # the former format, as written
    killed = tmp_path / "killed"
    shutil.copytree(FIXTURES, killed, ignore=shutil.ignore_patterns("*.py", "__pycache__"))
    rows = EvalRows(killed / "evals.jsonl", "tiny")
    assert sorted(k[4] for k in rows) == [1]
    finetune_run(*tiny_run(rows, killed / "run"))
    assert not (killed / "run" / "state.pt").exists()  # resumed (a state not used would have been replaced)

    (tmp_path / "whole").mkdir()
    whole = EvalRows(tmp_path / "whole" / "evals.jsonl", "tiny")
    finetune_run(*tiny_run(whole, tmp_path / "whole"))
    strip = ("train_images_per_s", "amod")  # (a speed; the amod that wrote the row, which the fixture's predate)
    assert {k: {f: v for f, v in r.items() if f not in strip} for k, r in EvalRows(killed / "evals.jsonl", "tiny")
            .rows.items()} == {k: {f: v for f, v in r.items() if f not in strip} for k, r in whole.rows.items()}
    assert len((killed / "evals.jsonl").read_text().splitlines()) == 2  # step 1 was not evaluated again


def test_the_former_versions_records_of_finished_work_are_read_and_skip_that_work(tmp_path):
    from amod.tools.bench import TimingRounds
    from amod.experiments.calibrate_command import CalibrationCache
    from amod.experiments.features import finished_probe_rows

    def never(*args):
        raise AssertionError("finished work was done again")

    cache = CalibrationCache(FIXTURES / "calibrations.jsonl", never)
    method, report = cache.get("calibrated fold", 0.5, "grid", never)
    assert (method.capacity, method.layers, method.skipped, report) == (0.5, (1,), "fold", {"chosen": 0})
    probe = finished_probe_rows(FIXTURES / "probe_rows.jsonl")
    assert probe.get(("ToMe", 0.5, "TokenMerging(cost=0.5)"))["zero_top1"] == 0.75
    rounds = TimingRounds(FIXTURES / "speed_rounds.jsonl", "k")
    assert rounds.done(1) and rounds.rounds == [{"times": {"dense": 1.0}, "ratios": {"dense": 1.0}}]
    assert not TimingRounds(FIXTURES / "speed_rounds.jsonl", "another").rounds
    shutil.copy(FIXTURES / "speed_rounds.jsonl", tmp_path / "rounds.jsonl")
    TimingRounds(tmp_path / "rounds.jsonl", "k").add({"times": {"dense": 2.0}, "ratios": {"dense": 1.0}})
    assert [r["times"]["dense"] for r in TimingRounds(tmp_path / "rounds.jsonl", "k").rounds] == [1.0, 2.0]
