"""A file means the model that was measured: every method's behaviour has a version, a file records it, and a file
of another version is refused in one line (``amod.methods.check_method_file``), never run by another rule.

- The files of the previous release (tests/fixtures/files_by_release/aaa1793: one tiny model per method, written by
  that amod with ``write_files.py``) open with outputs equal to that amod's; those of an amod from before files named
  their method (d5855d8, before the near-tie grid) open where the method's rule has not changed since (dense,
  isoFLOP) and are refused where it has.
- Each built-in method's output on a fixed model and images is kept per behaviour version
  (tests/fixtures/method_behaviours.json): a change of a method's output without a bump of its ``behaviour`` fails
  here. Regenerate after a bump: ``python tests/test_method_versions.py --regenerate``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import amod
from amod.methods import METHOD_CLASSES, file_metadata, method_from_metadata, method_of, method_provider, parse_method
from amod.mod.convert import MoD

FIXTURES = Path(__file__).parent / "fixtures"
RELEASES = FIXTURES / "files_by_release"
REFERENCES = FIXTURES / "method_behaviours.json"
sys.path.insert(0, str(RELEASES))
from write_files import check_images, dense_model  # noqa: E402  (the model and images the files were written with)

# the files of each release that today's amod refuses, by the rule that changed since (none: it opens them all)
REFUSED = {
    "aaa1793": {},
    "d5855d8": {name: kind for name, kind in (
        ("mod_attention", "mod"), ("mod_standard", "mod"), ("mod_random", "mod"), ("mod_merge", "mod"),
        ("mod_kv", "mod"), ("fold", "mod"), ("tome", "tome"), ("pitome", "pitome"))},
}


@pytest.mark.parametrize("release", sorted(REFUSED))
def test_a_file_of_an_earlier_amod_is_rebuilt_with_its_outputs_or_refused_in_one_line(release):
    folder = RELEASES / release
    written = json.loads((folder / "written.json").read_text())["methods"]
    outputs = load_file(str(folder / "outputs.safetensors"))
    assert set(written) <= set(json.loads((RELEASES / "aaa1793" / "written.json").read_text())["methods"])
    for name in written:
        path = folder / f"{name}.safetensors"
        if name in REFUSED[release]:
            kind = REFUSED[release][name]
            with pytest.raises(ValueError, match=rf"^{path} holds a {kind} model from before files recorded a "
                                                 rf"method's behaviour \(no amod\.method entry\), when {kind} ran "
                                                 r"more than one rule \(.*52c60d6.*\); which one wrote it cannot be "
                                                 r"told"):
                amod.load(path)
            continue
        model = amod.load(path)
        with torch.no_grad():
            torch.testing.assert_close(model(outputs["images"]), outputs[name], rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{release}/{name}: {m}")
        kind = written[name].partition(":")[0] or "dense"
        if (release, name) == ("d5855d8", "isoflop"):
            kind = "dense"  # (that amod saved an isoFLOP model as what it is: a dense model of fewer blocks)
        assert method_of(model).kind == kind, name


def test_a_file_of_another_behaviour_version_is_refused_naming_both():
    """A file records the version of its method's behaviour; an older one (the rule it ran is gone) or a newer one
    (an amod that is not this one) is refused in one line naming the versions and what changed."""
    meta = file_metadata(MoD(layers=(1, 3), scale_output=False))
    assert meta["amod.method.behaviour"] == "2" and meta["amod.method.provider"] == f"amod {amod.__version__}"
    assert method_from_metadata(meta) == MoD(layers=(1, 3), scale_output=False)
    with pytest.raises(ValueError, match=r"^the file holds a mod model of behaviour version 1; this amod runs version 2 "
                                         r"\(version 2: every choice made on scores rounded to a grid, near-ties "
                                         r"broken by position \(amod\.tokens\.decision_key, amod 52c60d6\)\), which "
                                         r"would not compute the model that was saved: make the model again with this "
                                         r"amod, or open the file with the amod that wrote it$"):
        method_from_metadata({**meta, "amod.method.behaviour": "1"})
    with pytest.raises(ValueError, match=r"^the file holds a mod model of behaviour version 3, newer than this amod's mod "
                                         r"\(version 2\): upgrade amod to open it$"):
        method_from_metadata({**meta, "amod.method.behaviour": "3"})
    with pytest.raises(ValueError, match=r"its amod\.method\.behaviour entry must be a version number >= 1, got 'x'"):
        method_from_metadata({**meta, "amod.method.behaviour": "x"})


# ---------------------------------------------------------------- each built-in's output, per behaviour version

# specs whose outputs are kept: every built-in method, MoD with each router and skipped mode
REFERENCE_SPECS = ("dense", "mod", "mod:router=standard", "mod:router=random,seed=3", "mod:router=hybrid",
                   "mod:router=shuffled-attention,seed=3", "mod:router=inverse-attention", "mod:skipped=merge",
                   "mod:skipped=kv", "mod:capacity=0.8,skipped=fold", "tome:r=2", "pitome:keep=0.8", "isoflop",
                   "calibrated:protects=[0.0,0.25],tilts=[0.0,1.0]", "calibrated:protects=[0.0],tilts=[0.0],stages=1",
                   "ppt:r=2")
CALIBRATION_COST = 0.8


def reference_output(spec: str) -> torch.Tensor:
    """What the method ``spec`` (a ``calibrated`` one set to ``CALIBRATION_COST`` on the check images) outputs on
    the fixed model and images."""
    method, dense = parse_method(spec), dense_model()
    if method.needs_images:
        method = method.at_cost(dense, CALIBRATION_COST, check_images().repeat(4, 1, 1, 1))
    torch.manual_seed(2)  # (a learned router's initial weights)
    model = method.apply(dense).eval()
    with torch.no_grad():
        return model(check_images())


def builtin_kinds() -> set[str]:
    return {kind for kind, cls in METHOD_CLASSES.items() if method_provider(cls).name == "amod"}


def test_every_built_in_method_has_a_reference_output():
    kinds = {spec.partition(":")[0] for spec in REFERENCE_SPECS}
    assert kinds == builtin_kinds(), "a built-in method without a reference output: add one to REFERENCE_SPECS"
    assert set(json.loads(REFERENCES.read_text())) == set(REFERENCE_SPECS), "regenerate the references (see above)"


@pytest.mark.parametrize("spec", REFERENCE_SPECS)
def test_a_method_s_output_changes_only_with_its_behaviour_version(spec):
    kept = json.loads(REFERENCES.read_text())[spec]
    cls = METHOD_CLASSES[spec.partition(":")[0]]
    behaviour = getattr(cls, "behaviour", None) if cls is not amod.Dense else None
    assert kept["behaviour"] == behaviour, (
        f"{spec}: {cls.__name__}.behaviour is {behaviour}, its reference output was kept at {kept['behaviour']}: "
        "regenerate the references (python tests/test_method_versions.py --regenerate)")
    output = reference_output(spec)
    moved = (output - torch.tensor(kept["output"])).abs().max().item()
    assert moved <= 1e-4, (
        f"{spec}: its output on the fixed model and images moved by {moved:.3g} at behaviour {behaviour}: a change of "
        f"what a method computes bumps {cls.__name__}.behaviour and says what changed in behaviour_changes (files of "
        "the old version are then refused, not run by the new rule); then regenerate the references")


def regenerate() -> None:
    kept = {}
    for spec in REFERENCE_SPECS:
        cls = METHOD_CLASSES[spec.partition(":")[0]]
        kept[spec] = {"behaviour": None if cls is amod.Dense else cls.behaviour,
                      "output": [[round(v, 6) for v in row] for row in reference_output(spec).tolist()]}
    REFERENCES.write_text(json.dumps(kept, indent=1) + "\n")
    print(f"{len(kept)} reference outputs written to {REFERENCES}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit("usage: python tests/test_method_versions.py --regenerate")
    regenerate()
