"""No file a user hands amod is unpickled. A crafted pickle, whose unpickling would create a marker file, is put
at every path a command or a library loader reads: each refuses it in one line that names the file, and the marker
never appears. The source itself is checked too: ``torch.load`` is called in one place (``amod.files.load_torch``,
with ``weights_only=True``) and no other unpickler is used, so a new loader cannot slip past these tests."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import timm
import torch
from conftest import run_in_process

import amod
from amod import files

SRC = Path(amod.__file__).parent
TINY = ["--model", "vit_tiny_patch16_224", "--img-size", "28", "--patch-size", "7", "--depth", "2", "--embed-dim",
        "32", "--num-heads", "2", "--epochs", "1", "--train-limit", "64", "--val-limit", "64"]


class Payload:
    """Unpickled, it opens (creates) ``marker``: proof that the file's code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


@pytest.fixture
def crafted(tmp_path):
    """``crafted(path)`` writes a torch.save file at ``path`` holding the payload beside the entries of a training
    checkpoint; ``crafted.ran()`` says whether any payload ran."""
    marker = tmp_path / "payload_ran"

    class Crafted:
        def __call__(self, path: Path) -> Path:
            path.parent.mkdir(parents=True, exist_ok=True)
            entries = dict.fromkeys(("model", "optimizer", "scheduler", "epoch", "rng", "config", "format", "step",
                                     "routers", "rows", "fingerprint"), 0)
            torch.save({**entries, "model": Payload(marker)}, path)
            return path

        @staticmethod
        def ran() -> bool:
            return marker.exists()

    return Crafted()


def _refused(code: int, err: str, path: Path) -> None:
    """Exit status 2, one error line (after progress lines, if any) naming ``path``, no traceback."""
    errors = [line for line in err.splitlines() if "error" in line]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith("amod ") and str(path) in errors[0] and "pickle" in errors[0], err


def test_torch_load_is_called_once_in_the_source_with_weights_only_and_nothing_else_unpickles():
    calls, unpicklers = [], []
    for file in SRC.rglob("*.py"):
        tree = ast.parse(file.read_text())
        for node in ast.walk(tree):  # function bodies included
            if isinstance(node, ast.Call):
                name = ast.unparse(node.func)
                if name.endswith("torch.load"):
                    calls.append((file.relative_to(SRC), node))
                if name.split(".")[-1] in ("loads", "load", "Unpickler") and name.split(".")[0] in (
                        "pickle", "cPickle", "dill", "cloudpickle", "joblib", "_pickle"):
                    unpicklers.append((file.relative_to(SRC), name))
                if name.endswith("jit.load") or (name.endswith("np.load") or name.endswith("numpy.load")) and any(
                        k.arg == "allow_pickle" for k in node.keywords):
                    unpicklers.append((file.relative_to(SRC), name))
            if isinstance(node, ast.ImportFrom) and node.module == "torch" and any(a.name == "load" for a in node.names):
                unpicklers.append((file.relative_to(SRC), "from torch import load"))  # a torch.load by another name
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                if any(n and n.split(".")[0] in ("pickle", "dill", "cloudpickle", "_pickle") for n in names):
                    unpicklers.append((file.relative_to(SRC), "import " + ", ".join(filter(None, names))))
    assert [str(f) for f, _ in calls] == ["files.py"], calls
    keywords = {k.arg: ast.unparse(k.value) for k in calls[0][1].keywords}
    assert keywords.get("weights_only") == "True"
    assert not unpicklers, unpicklers


def test_every_command_that_reads_a_torch_file_refuses_a_crafted_one(crafted, tmp_path, capsys):
    # amod train --resume: the run's checkpoint.pt
    ckpt = crafted(tmp_path / "run" / "checkpoint.pt")
    _refused(*run_in_process(["train", "--resume", "--out", str(tmp_path / "run")], capsys), ckpt)
    # amod finetune --checkpoint a .pth (timm/DeiT weights)
    pth = crafted(tmp_path / "weights.pth")
    _refused(*run_in_process(["finetune", *TINY, "--checkpoint", str(pth), "--out", str(tmp_path / "ft")], capsys), pth)
    assert not (tmp_path / "ft").exists()
    # a Hugging Face folder whose weights are a pickle: never read
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "vit", "architectures": ["ViTModel"]}))
    binary = crafted(folder / "pytorch_model.bin")
    for argv in (["flops", str(folder)], ["eval", "--checkpoint", str(folder)],
                 ["bench", "--model", str(folder), "--no-memory"]):
        code, err = run_in_process(argv, capsys)
        _refused(code, err, binary)
    assert not crafted.ran()


@pytest.mark.slow
def test_detection_runs_refuse_a_crafted_checkpoint(crafted, tmp_path, capsys):
    pytest.importorskip("transformers")
    from amod.detect.models import small_detr

    tiny = ["--steps", "1", "--batch-size", "4", "--train-canvases", "8", "--val-limit", "2"]
    ckpt = crafted(tmp_path / "det" / "checkpoint.pt")
    _refused(*run_in_process(["detect", "train", "--out", str(tmp_path / "det"), *tiny], capsys), ckpt)
    assert sorted(p.name for p in (tmp_path / "det").iterdir()) == ["checkpoint.pt"]  # nothing added
    dense = amod.save(small_detr(d_model=32, ffn=64), tmp_path / "dense.safetensors")
    run = crafted(tmp_path / "study" / "dense" / "seed0" / "checkpoint.pt")
    _refused(*run_in_process(["detect", "study", "--dense", str(dense), "--out", str(tmp_path / "study"), "--seeds",
                              "1", "--cost", "0.5", "--routers", "attention", *tiny], capsys), run)
    assert not crafted.ran()


def test_every_library_loader_refuses_a_crafted_file(crafted, tmp_path):
    from amod.experiments.features import read_features
    from amod.experiments.probe import fit_probe_cached
    from amod.train.engine import load_training_checkpoint
    from amod.train.models import load_state_dict_file

    path = crafted(tmp_path / "x.pt")
    for load in (files.load_torch, load_state_dict_file):
        with pytest.raises(ValueError, match=f"{path}.*pickle"):
            load(path)
    with pytest.raises(ValueError, match=f"{path}.*pickle.*another --out"):
        load_training_checkpoint(path)
    with pytest.raises(ValueError, match="not a readable safetensors checkpoint"):
        amod.load(path)
    # caches a command wrote itself are computed again, not trusted
    assert read_features(path, 1, 1)[0] is None
    g = torch.Generator().manual_seed(0)
    feats, labels = torch.randn(40, 4, generator=g), torch.arange(40) % 2
    assert fit_probe_cached(crafted(tmp_path / "probe.pt"), feats, labels).held_out_accuracy >= 0
    assert not crafted.ran()
    # a torn file is named too
    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(3)}, good)
    torn = tmp_path / "torn.pt"
    torn.write_bytes(good.read_bytes()[:100])
    with pytest.raises(files.UnreadableFileError, match=f"{torn} is corrupt or unreadable: torn"):
        files.load_torch(torn)
    assert torch.equal(files.load_torch(good)["w"], torch.ones(3))


def test_the_finetune_study_refuses_a_crafted_run_state(crafted, tmp_path):
    """The study's own resume path (``OUT/runs/.../state.pt``): ``finetune_run`` reads it before anything else."""
    from amod.experiments.finetune_study import finetune_run
    from amod.experiments.finetune_study.plan import ARMS, FinetuneConfig, Planned
    from amod.experiments.finetune_study.rows import EvalRows
    from amod.methods import Dense

    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=28, patch_size=7, depth=1,
                              embed_dim=32, num_heads=2, in_chans=1, num_classes=10)
    run_dir = tmp_path / "runs" / "seed0"
    state = crafted(run_dir / "state.pt")
    planned = Planned(next(a for a in ARMS if a.name == "dense"), 1.0, Dense(), 1.0, 1)
    with pytest.raises(ValueError, match=f"{state}.*pickle.*remove it"):
        finetune_run(FinetuneConfig(checkpoint="unused", steps=2), model, planned, 0, "off", [], [],
                     EvalRows(tmp_path / "evals.jsonl", "f"), run_dir, torch.device("cpu"))
    assert not crafted.ran()
