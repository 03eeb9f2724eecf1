"""A-MoD in a Hugging Face DETR encoder: equivalence at capacity 1, routing, cost, save/load, training."""
from __future__ import annotations

import copy
import json

import pytest
import torch

pytest.importorskip("transformers")

import amod  # noqa: E402
from amod.families.detr import capacity_for_encoder_cost, measured  # noqa: E402
from amod.families.detr import DetrMoDLayer, mod_layers
from amod import set_recording  # noqa: E402
from amod.detect.models import small_detr  # noqa: E402
from amod.ops import received_attention  # noqa: E402
from amod.mod.routers import router_class, router_names  # noqa: E402

ROUTERS = router_names("detr")
IMG = 64  # a stride-8 backbone: 8 x 8 = 64 encoder positions


@pytest.fixture(scope="module")
def dense():
    torch.manual_seed(0)
    return small_detr(d_model=64, ffn=128, heads=4, encoder_layers=4, decoder_layers=2, num_queries=8).eval()


@pytest.fixture(scope="module")
def images():
    return torch.rand(2, 3, IMG, IMG, generator=torch.Generator().manual_seed(1))


def _targets():
    return [{"class_labels": torch.tensor([1, 4]), "boxes": torch.tensor([[0.3, 0.3, 0.2, 0.2], [0.6, 0.7, 0.3, 0.2]])},
            {"class_labels": torch.tensor([7]), "boxes": torch.tensor([[0.5, 0.5, 0.4, 0.4]])}]


@pytest.mark.parametrize("router", ROUTERS)
def test_capacity_one_is_the_dense_detr_and_lower_capacity_routes(dense, images, router):
    model = amod.convert(copy.deepcopy(dense), router=router, capacity=1.0, scale_output=False)
    assert [i for i, _ in mod_layers(model)] == [1, 3]
    with torch.no_grad():
        ref, out = dense(pixel_values=images), model(pixel_values=images)
    tol = 1e-5 if router_class(router).needs_attention else 0.0  # amod's score op instead of sdpa in layers 0 and 2
    assert torch.allclose(out.logits, ref.logits, atol=tol, rtol=0)
    assert torch.allclose(out.pred_boxes, ref.pred_boxes, atol=tol, rtol=0)
    # at 0.25 each MoD layer runs on 16 of 64 positions and copies the other 48 through unchanged
    amod.set_capacity(model, 0.25)
    set_recording(model)
    seen = {}
    hooks = [layer.register_forward_hook(lambda m, a, kw, o, i=i: seen.__setitem__(i, (a[0], o)), with_kwargs=True)
             for i, layer in mod_layers(model)]
    with torch.no_grad():
        out = model(pixel_values=images)
    for h in hooks:
        h.remove()
    assert not torch.allclose(out.logits, ref.logits, atol=1e-3)
    for i, layer in mod_layers(model):
        kept = layer.amod_last_index
        assert kept.shape == (2, 16) and bool((kept.diff(dim=1) > 0).all())
        x, y = seen[i]
        skipped = torch.ones(2, 64, dtype=torch.bool).scatter_(1, kept, False)
        assert torch.equal(y[skipped], x[skipped])
        assert not torch.allclose(y[~skipped], x[~skipped])


def test_a_mod_keeps_the_positions_the_previous_layer_attended_to_most(dense, images):
    """Layer 1 keeps the top-k of the attention layer 0 paid each position, position embeddings included, as
    transformers' own eager attention returns it (ranked on the decision grid, near-ties by position: a random
    DETR's attention is nearly uniform)."""
    eager = copy.deepcopy(dense)
    eager.config._attn_implementation = "eager"
    with torch.no_grad():
        attentions = eager(pixel_values=images, output_attentions=True).encoder_attentions
    model = amod.convert(copy.deepcopy(dense), router="attention", capacity=0.25)
    set_recording(model)
    with torch.no_grad():
        model(pixel_values=images)
    received = received_attention(attentions[0])  # (2, 64)
    key = amod.tokens.decision_key(received, 1 / 64).tolist()
    expected = torch.tensor([sorted(sorted(range(64), key=lambda i: (-row[i], i))[:16]) for row in key])
    assert torch.equal(mod_layers(model)[0][1].amod_last_index, expected)


def test_feature_norm_router_keeps_the_largest_encoder_inputs(dense, images):
    model = amod.convert(copy.deepcopy(dense), router="feature-norm", capacity=0.5)
    inputs = {}
    model.model.encoder.register_forward_pre_hook(lambda m, a, kw: inputs.update(x=kw["inputs_embeds"]),
                                                  with_kwargs=True)
    set_recording(model)
    with torch.no_grad():
        model(pixel_values=images)
    expected = inputs["x"].norm(dim=-1).topk(32, dim=1).indices.sort(dim=1).values
    for _, layer in mod_layers(model):  # one ranking for every MoD layer
        assert torch.equal(layer.amod_last_index, expected)


@pytest.mark.parametrize("router", ROUTERS)
def test_cost_matches_the_flop_counter(dense, router):
    model = amod.convert(copy.deepcopy(dense), router=router, capacity=0.5)
    dense_report = amod.flops(dense, IMG)
    assert dense_report.ratio == 1.0 and dense_report.tokens == 64
    total, _, _ = measured(dense, IMG)
    assert dense_report.macs == total
    for capacity in (0.25, 0.5, 1.0):
        amod.set_capacity(model, capacity)
        report = amod.flops(model, IMG)
        total, encoder, _ = measured(model, IMG)
        assert report.encoder_macs == encoder and report.macs == total
        assert [b.tokens for b in report.layers] == [64, -(-64 * capacity // 1), 64, -(-64 * capacity // 1)]
    amod.set_capacity(model, 0.5)
    capacity = capacity_for_encoder_cost(model, 0.5, IMG)
    achieved = amod.flops(model, IMG, capacity=capacity).encoder_ratio
    assert abs(achieved - 0.5) < 0.03 and capacity < 0.5  # the other half of the encoder is dense
    with pytest.raises(ValueError, match="img_size"):
        amod.flops(model)


def test_save_and_load_rebuild_the_converted_detr(dense, images, tmp_path):
    model = amod.convert(copy.deepcopy(dense), router="standard", capacity=0.5)
    with torch.no_grad():
        for _, layer in mod_layers(model):
            layer.router.proj.weight.normal_()  # a trained router, not the initial one
        expected = model(pixel_values=images)
    path = amod.save(model, tmp_path / "detr.safetensors")
    loaded = amod.load(path)
    assert type(loaded).__name__ == "DetrForObjectDetection"
    assert loaded.amod_config == model.amod_config
    with torch.no_grad():
        got = loaded(pixel_values=images)
    assert torch.equal(got.logits, expected.logits) and torch.equal(got.pred_boxes, expected.pred_boxes)


def test_save_load_and_save_pretrained_keep_the_content_queries(dense, images, tmp_path):
    """What amod.save writes, amod.load rebuilds: the content queries are a forward hook, in neither the weights nor
    the config; files from before the hook was recorded in amod.model say it in their own metadata entry."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from amod.families.detr import has_content_queries, use_content_queries

    model = use_content_queries(amod.convert(copy.deepcopy(dense), router="standard", capacity=0.5))
    with torch.no_grad():
        for _, layer in mod_layers(model):
            layer.router.proj.weight.normal_()
        expected = model(pixel_values=images).logits
    path = amod.save(model, tmp_path / "detr.safetensors")
    model.save_pretrained(tmp_path / "hf")
    with safe_open(str(path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    info = json.loads(meta["amod.model"])
    assert info["content_queries"] is True
    info.pop("content_queries")
    legacy = tmp_path / "legacy.safetensors"
    save_file(tensors, str(legacy), metadata={**meta, "amod.model": json.dumps(info), "amod.detr.content_queries": "1"})
    for source in (path, tmp_path / "hf", legacy):
        loaded = amod.load(source)
        assert has_content_queries(loaded) and loaded.amod_config == model.amod_config, source
        with torch.no_grad():
            assert torch.equal(loaded(pixel_values=images).logits, expected), source
    plain = amod.save(copy.deepcopy(dense), tmp_path / "plain.safetensors")
    assert not has_content_queries(amod.load(plain))


def test_refusals_name_the_problem(dense, images):
    with pytest.raises(ValueError, match="decoder reads every position"):
        amod.convert(copy.deepcopy(dense), skipped="fold")
    with pytest.raises(ValueError, match="unknown router 'bogus'"):  # (DETR takes every router of router_names)
        amod.convert(copy.deepcopy(dense), router="bogus")
    with pytest.raises(ValueError, match="cannot route block 0"):
        amod.convert(copy.deepcopy(dense), layers=[0, 1])
    model = amod.convert(copy.deepcopy(dense))
    with pytest.raises(ValueError, match="already converted"):
        amod.convert(model)
    mask = torch.ones(2, IMG, IMG, dtype=torch.long)
    mask[:, :, 40:] = 0  # a padded batch
    with pytest.raises(ValueError, match="without padding"), torch.no_grad():
        model(pixel_values=images, pixel_mask=mask)
    with pytest.raises(ValueError, match="output_attentions is not available"), torch.no_grad():
        model(pixel_values=images, output_attentions=True)  # (the dense model returns them with eager attention)


@pytest.mark.parametrize("router", ["attention", "standard", "random"])
def test_training_with_gradient_checkpointing_gives_the_same_gradients(dense, images, router):
    """DETR's Hungarian-matching loss trains a converted model; checkpointed layers route in their recompute
    exactly as in their forward (same scores, same random draws), so the gradients are the same."""
    def grads(checkpointing: bool) -> dict[str, torch.Tensor]:
        model = amod.convert(copy.deepcopy(dense), router=router, capacity=0.5, layers=[1, 2, 3])
        model.config.dropout = 0.0
        model.train()
        for module in model.modules():
            if hasattr(module, "dropout") and isinstance(module.dropout, float):
                module.dropout = 0.0
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        torch.manual_seed(0)
        loss = model(pixel_values=images, labels=_targets()).loss
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, checkpointed = grads(False), grads(True)
    assert plain.keys() == checkpointed.keys()
    assert any("encoder.layers.1" in n for n in plain)
    if router == "standard":
        assert plain["model.encoder.layers.1.router.proj.weight"].abs().sum() > 0  # it learns through the gate
    for name in plain:
        assert torch.allclose(plain[name], checkpointed[name], atol=1e-6, rtol=1e-4), name


def test_reentrant_checkpointing_refuses_scaled_a_mod_and_trains_the_rest(dense, images):
    """Reentrant checkpointing runs each layer's forward without grad: the gradient that scaled A-MoD outputs send
    through the scores into the layer before would be lost, so it is refused; unscaled A-MoD trains."""
    def loss_of(scale_output: bool) -> torch.Tensor:
        model = amod.convert(copy.deepcopy(dense), router="attention", capacity=0.5, scale_output=scale_output)
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        return model(pixel_values=images.clone().requires_grad_(), labels=_targets()).loss

    with pytest.raises(RuntimeError, match="use_reentrant': False"):
        loss_of(True)
    loss_of(False).backward()


def test_bf16_autocast_runs_and_stays_close(dense, images):
    model = amod.convert(copy.deepcopy(dense), router="attention", capacity=0.5)
    with torch.no_grad():
        ref = model(pixel_values=images)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(pixel_values=images)
    assert out.pred_boxes.shape == ref.pred_boxes.shape
    assert (out.pred_boxes.float() - ref.pred_boxes).abs().max() < 0.05
    assert isinstance(mod_layers(model)[0][1], DetrMoDLayer)


def test_content_queries_start_the_decoder_from_the_query_embeddings(dense, images):
    from amod.families.detr import ContentQueries, use_content_queries

    model = use_content_queries(use_content_queries(copy.deepcopy(dense)))
    assert sum(isinstance(h, ContentQueries) for h in model.model._forward_pre_hooks.values()) == 1
    queries = model.model.query_position_embeddings.weight.unsqueeze(0).expand(2, -1, -1)
    with torch.no_grad():
        hooked = model(pixel_values=images)
        explicit = dense(pixel_values=images, decoder_inputs_embeds=queries)
        plain = dense(pixel_values=images)
    assert torch.equal(hooked.pred_boxes, explicit.pred_boxes)
    assert not torch.allclose(hooked.pred_boxes, plain.pred_boxes)


def test_a_detr_with_a_timm_backbone_saves_and_loads(images, tmp_path):
    """facebook/detr-resnet-50's layout: a timm ResNet backbone, its config asking for pretrained weights."""
    from transformers import DetrConfig, DetrForObjectDetection

    config = DetrConfig(use_timm_backbone=True, backbone="resnet18", use_pretrained_backbone=False, d_model=32,
                        encoder_layers=2, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
                        encoder_ffn_dim=64, decoder_ffn_dim=64, num_queries=5, num_labels=3)
    model = amod.convert(DetrForObjectDetection(config).eval(), router="attention", capacity=0.5)
    model.config.use_pretrained_backbone = True  # as in the hub's config
    path = amod.save(model, tmp_path / "detr_timm.safetensors")
    loaded = amod.load(path)
    with torch.no_grad():
        assert torch.equal(loaded(pixel_values=images).logits, model(pixel_values=images).logits)


# ---------------------------------------------------------------- what users do with a model: compile, ONNX, DDP

@pytest.mark.parametrize("router", ["feature-norm"])  # (A-MoD's router: tests/test_families.py)
def test_compiles_without_graph_breaks_and_matches_eager(dense, images, router):
    """fullgraph=True fails on any graph break. While tracing, transformers hands the all-ones pixel mask on as
    a built mask rather than None; the MoD layers take it (a trace cannot read its values)."""
    import torch._dynamo

    model = amod.convert(copy.deepcopy(dense), router=router, capacity=0.5).eval()
    torch._dynamo.reset()
    with torch.no_grad():
        expected = model(pixel_values=images)
        got = torch.compile(model, backend="aot_eager", fullgraph=True)(pixel_values=images)
    torch._dynamo.reset()
    assert (got.logits - expected.logits).abs().max() < 1e-5
    assert (got.pred_boxes - expected.pred_boxes).abs().max() < 1e-5


def test_onnx_export_with_a_dynamic_batch_matches_onnx_runtime(images, tmp_path):
    """torch.onnx.export (dynamo) of a converted DETR, its two outputs checked in ONNX Runtime on two batch sizes."""
    pytest.importorskip("onnxscript", reason="the dynamo exporter needs the onnx extra: pip install 'amod[onnx]'")
    ort = pytest.importorskip("onnxruntime", reason="the check needs the onnx extra: pip install 'amod[onnx]'")

    class Boxes(torch.nn.Module):  # tensors out, as an exporter wants
        def __init__(self, detr: torch.nn.Module) -> None:
            super().__init__()
            self.detr = detr

        def forward(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            out = self.detr(pixel_values=pixel_values)
            return out.logits, out.pred_boxes

    torch.manual_seed(0)  # (the fewest layers that route: an export costs seconds a layer here)
    small = small_detr(d_model=32, ffn=64, heads=2, encoder_layers=2, decoder_layers=1, num_queries=4).eval()
    model = Boxes(amod.convert(small, router="attention", capacity=0.5)).eval()
    path = tmp_path / "detr.onnx"
    with pytest.raises(TypeError, match="for a DETR, torch.onnx.export a wrapper"):  # amod.export is for ViTs
        amod.export(model.detr, path)
    with torch.no_grad():
        torch.onnx.export(model, (images,), str(path), dynamo=True, input_names=["pixel_values"],
                          output_names=["logits", "pred_boxes"], external_data=False, verbose=False,
                          dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=1024)},))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch in (images, torch.rand(3, 3, IMG, IMG, generator=torch.Generator().manual_seed(2))):
        with torch.no_grad():
            expected = model(batch)
        got = session.run(None, {"pixel_values": batch.numpy()})
        for g, e in zip(got, expected):
            assert g.shape == tuple(e.shape) and abs(g - e.numpy()).max() < 1e-4


# DDP of a converted DETR: tests/ddp_worker.py, in the suite's one torchrun launch (tests/test_pipeline.py).
