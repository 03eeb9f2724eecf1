"""Save -> load round trips, and refusals for files that do not fit."""
from __future__ import annotations


import pytest
import torch
from conftest import images, make_model

import amod
from amod.mod.routers import router_class, vit_routers


@pytest.mark.parametrize("family", ["vit", "deit_distilled", "dinov2_reg", "qk_norm"])
# dense, A-MoD, and every router with weights (whose weights must come back)
@pytest.mark.parametrize("router", [None, "attention", *(r for r in vit_routers() if router_class(r).learnable)])
def test_save_load_round_trip_gives_identical_logits(tmp_path, family, router):
    model = make_model(family)
    if router:
        amod.convert(model, router=router, capacity=0.4, layers=[1, 2])
        if router_class(router).learnable:  # make the router weights matter
            torch.nn.init.normal_(model.blocks[1].router.proj.weight)
    path = amod.save(model, tmp_path / "m.safetensors")
    loaded = amod.load(path).eval()
    x = images(model, 3)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    if router:
        assert amod.get_config(loaded) == amod.get_config(model)
    else:
        assert getattr(loaded, "amod_config", None) is None


def test_pretrained_dense_weights_load_into_a_converted_model():
    dense = make_model("deit3_layerscale")
    mod = amod.convert(make_model("deit3_layerscale", seed=5), router="attention", capacity=1.0)
    mod.load_state_dict(dense.state_dict())  # strict: the keys are unchanged
    x = images(dense)
    with torch.no_grad():
        assert (mod(x) - dense(x)).abs().max() < 1e-5


def test_corrupt_and_foreign_files_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        amod.load(tmp_path / "missing.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a checkpoint at all")
    with pytest.raises(ValueError, match="is not a readable safetensors checkpoint"):
        amod.load(junk)
    from safetensors.torch import save_file

    foreign = tmp_path / "foreign.safetensors"
    save_file({"w": torch.zeros(2)}, str(foreign))
    with pytest.raises(ValueError, match="was not written by amod.save"):
        amod.load(foreign)
    good = amod.save(make_model("vit"), tmp_path / "good.safetensors")
    data = bytearray(good.read_bytes())
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(ValueError, match="truncated.safetensors"):
        amod.load(truncated)


def test_a_newer_format_two_methods_and_a_wrong_shape_are_refused_naming_the_file(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from amod.checkpoint import check_dense_file

    good = amod.save(make_model("vit"), tmp_path / "good.safetensors")
    with safe_open(str(good), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}

    def variant(name: str, meta: dict = meta, tensors: dict = tensors):
        save_file(tensors, str(tmp_path / name), metadata=meta)
        return tmp_path / name

    with pytest.raises(ValueError, match=r"newer\.safetensors is in amod file format '4'; this amod reads format 3"):
        amod.load(variant("newer.safetensors", {**meta, "amod.format": "4"}))
    both = {**meta, "amod.mod": amod.MoDConfig(layers=[1, 3]).to_json(), "amod.merge": '{"schedule": [2, 2, 2, 2]}'}
    with pytest.raises(ValueError, match=r"both\.safetensors names two methods \(amod\.mod and amod\.merge"):
        amod.load(variant("both.safetensors", both))
    with pytest.raises(ValueError, match=r"shaped\.safetensors does not fit .* pos_embed is \(1, 5, 192\) in the file"):
        amod.load(variant("shaped.safetensors", tensors={**tensors, "pos_embed": torch.zeros(1, 5, 192)}))
    # what older amod versions wrote still loads: no format entry, and token merging under "amod.merge"
    old = {k: v for k, v in meta.items() if k != "amod.format"}
    assert amod.load(variant("old.safetensors", old)).num_classes == 10
    merged = amod.load(amod.save(amod.tome.apply(make_model("vit"), r=2), tmp_path / "tome.safetensors"))
    assert merged.amod_tome.schedule == [2, 2, 2, 2]
    with safe_open(str(tmp_path / "tome.safetensors"), framework="pt") as f:
        tome_meta, tome_tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    # ToMe's entry is "amod.tome", which no skipped mode is called; older files' "amod.merge" still loads as ToMe
    assert "amod.tome" in tome_meta and "amod.merge" not in tome_meta
    # an amod that reads format 1 refuses a file of "amod.tome" (format 2), which it would open as a dense model, and
    # one of MoD, which it would run by the rule before the near-tie grid; a dense or isoFLOP file stays format 1
    mod_path = amod.save(amod.convert(make_model("vit")), tmp_path / "mod.safetensors")
    iso_path = amod.save(amod.IsoFLOP().apply(make_model("vit")), tmp_path / "iso.safetensors")
    formats = [amod.checkpoint.read_metadata(p)["amod.format"] for p in (good, mod_path, iso_path)]
    assert (tome_meta["amod.format"], *formats) == ("2", "1", "2", "1")
    assert amod.load(mod_path)
    old_tome = {**{k: v for k, v in tome_meta.items() if k not in ("amod.tome", "amod.format")},
                "amod.merge": tome_meta["amod.tome"]}
    path = variant("old_tome.safetensors", old_tome, tome_tensors)
    old_merged = amod.load(path)
    assert old_merged.amod_tome.schedule == [2, 2, 2, 2] and amod.method_of(old_merged) == amod.TokenMerging(r=(2,) * 4)
    torch.testing.assert_close(old_merged(images(old_merged)), merged(images(merged)), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"old_tome\.safetensors is not a dense model \(it runs tome r="):
        check_dense_file(path)
