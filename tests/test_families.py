"""The contract every model family keeps (``amod.families``), the same checks over every registered family, timm's
way: for each model below and each router x skipped mode (and token merging: ToMe, PiToMe) the family accepts, capacity 1 is the
dense model, ``amod.flops`` is what FlopCounterMode measures, ``amod.save``/``amod.load`` give the same outputs,
bf16 autocast runs and gradient checkpointing gives the same gradients; for each skipped mode (A-MoD's router; the
learned router on bypass) ``torch.compile`` has no graph break, on one model of each family; the ONNX export
matches ONNX Runtime (here for the families no other test exports). What is refused is the table ``REFUSED``, each
refusal in one line saying why; every other combination converts. A family takes exactly the routers
``router_names(family)`` gives it. A new family is one adapter module plus one entry in ``MODELS`` (and its rows in
``REFUSED``, if it refuses anything)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import make_model

import amod
from amod.families import family_of
from amod.tome.merging import TokenMerging
from amod.tome.pitome import PiToMe
from amod.mod.calibrate import tilt_shape
from amod.mod.routers import SeededDraws, router_class, router_names
from amod.ppt import PPT

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64, image_size=32,
             patch_size=8)


def _hf(cls: str, config: str, **extra):
    def build(depth: int = 3) -> torch.nn.Module:
        torch.manual_seed(0)
        cfg = getattr(transformers, config)(**{**SMALL, "num_hidden_layers": depth, **extra})
        return getattr(transformers, cls)(cfg).eval()
    return build


def _detr(depth: int = 3) -> torch.nn.Module:
    from amod.detect.models import small_detr

    torch.manual_seed(0)
    return small_detr(d_model=32, ffn=64, heads=2, encoder_layers=depth, decoder_layers=1, num_queries=4, dropout=0.0,
                      attention_dropout=0.0, activation_dropout=0.0).eval()  # (no dropout: gradients compared)


# name -> (builder of the dense model at a depth, 3 by default; input size): every family's models, small enough
# for the CPU
MODELS = {
    "timm-vit": (lambda depth=3: make_model("vit", depth=depth), 32),
    "timm-deit-distilled": (lambda depth=3: make_model("deit_distilled", depth=depth), 32),
    "timm-dinov2-registers": (lambda depth=3: make_model("dinov2_reg", depth=depth), 28),
    "hf-vit": (_hf("ViTForImageClassification", "ViTConfig", num_labels=10), 32),
    "hf-deit": (_hf("DeiTForImageClassificationWithTeacher", "DeiTConfig", num_labels=10), 32),
    "hf-dinov2-registers": (_hf("Dinov2WithRegistersModel", "Dinov2WithRegistersConfig", num_register_tokens=2), 32),
    "hf-clip": (_hf("CLIPVisionModelWithProjection", "CLIPVisionConfig", projection_dim=16), 32),
    "hf-siglip": (_hf("SiglipVisionModel", "SiglipVisionConfig"), 32),
    "detr": (_detr, 64),
}
MODES = ("bypass", "merge", "kv", "fold")
_DENSE: dict[tuple[str, int], torch.nn.Module] = {}


def dense(name: str, depth: int = 3) -> torch.nn.Module:
    if (name, depth) not in _DENSE:
        _DENSE[name, depth] = MODELS[name][0](depth)
    return copy.deepcopy(_DENSE[name, depth])


def images(name: str, batch: int = 2, seed: int = 1) -> torch.Tensor:
    size = MODELS[name][1]
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))


def output(name: str, model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One tensor from every model: timm's logits; a Hugging Face model's logits, image embedding or features
    (its family's ``tensor_module``); a DETR's logits and boxes side by side."""
    if name == "detr":
        out = model(pixel_values=x)
        return torch.cat([out.logits, out.pred_boxes], dim=-1)
    return family_of(model).tensor_module(model)(x)


# The methods besides MoD (``amod.methods``), each at full cost (capacity 1: nothing reduced) and reduced: a new
# registered method is one line here.
METHODS = {"tome": lambda capacity: TokenMerging(r=0 if capacity == 1.0 else 2),
           "pitome": lambda capacity: PiToMe(keep=1.0 if capacity == 1.0 else 0.75),
           "ppt": lambda capacity: PPT(r=0 if capacity == 1.0 else 2)}


def convert(model: torch.nn.Module, router: str, mode: str, capacity: float, **kwargs) -> torch.nn.Module:
    if mode in METHODS:
        return METHODS[mode](capacity).apply(model)
    if mode == "fold":  # amod.calibrate's kind of fold: a per-block schedule (more tokens fold early)
        kwargs.setdefault("shape", tilt_shape(-1.0, family_of(model).layers_count(family_of(model).prepare(model))))
    return amod.convert(model, router=router, skipped=mode, capacity=capacity, **kwargs)


# every model x every registered router x every skipped mode, and every other method (no router: "-")
CASES = [(name, router, mode) for name in MODELS for router in router_names() for mode in MODES] + \
        [(name, "-", method) for name in MODELS for method in METHODS]

# What must be refused: (model, router, mode) -> a fragment of the one-line message it must be refused with. Each row
# says why. Every case of CASES in this table must be refused with its fragment, every other case must convert and
# keep the contract, so a new refusal fails as surely as a lost one.
VITS = [name for name in MODELS if name != "detr"]  # the ViT pattern's models (timm, Hugging Face, CLIP, SigLIP)
REFUSED: dict[tuple[str, str, str], str] = {
    # fold routes unscaled with a parameter-free router: a learned router (standard, hybrid) learns through its gate
    **{(name, router, "fold"): "skipped='fold' routes with a parameter-free router" for name in VITS
       for router in router_names() if router_class(router).learnable},
    # feature-norm ranks a DETR encoder's positions by the norm of the backbone features they start from
    **{(name, "feature-norm", mode): "router='feature-norm' routes detr models only" for name in VITS
       for mode in MODES},
    # DETR's decoder reads the encoder output by position: a skipped position must keep its own content (bypass)
    **{("detr", router, mode): "does not fit a DETR encoder, whose decoder reads every position: use bypass"
       for router in router_names() for mode in MODES if mode != "bypass"},
    # token merging moves a position's content into another, for the same reason
    **{("detr", "-", method): "token merging does not fit a DETR encoder" for method in METHODS},
}


# amod's methods that are not in METHODS, and where they are checked: every other built-in method must be in METHODS
ELSEWHERE = {"mod": "the routers x MODES cases", "calibrated": "the fold cases, with a calibrated shape",
             "isoflop": "not per family: the dense model with fewer blocks (tests/test_methods.py)",
             "dense": "the model itself"}


def test_the_contract_runs_every_built_in_method():
    """A method amod registers is in METHODS or in ELSEWHERE, so a new one cannot skip the contract unseen."""
    from amod.methods import METHOD_CLASSES

    built_in = {kind for kind, cls in METHOD_CLASSES.items() if cls.__module__.split(".")[0] == "amod"}
    assert built_in == set(METHODS) | set(ELSEWHERE), sorted(built_in ^ (set(METHODS) | set(ELSEWHERE)))


def test_the_refusal_table_names_only_cases_that_exist():
    """A row for a case CASES does not hold would check nothing."""
    assert set(REFUSED) <= set(CASES), sorted(set(REFUSED) - set(CASES))


@pytest.mark.parametrize("name", MODELS)
def test_a_family_takes_exactly_the_routers_router_names_gives_it(name):
    """``router_names(family)`` (the routers whose class lists the family, or every family) is what the family
    converts with, and a router that names other families is refused naming them."""
    family = family_of(dense(name)).name
    for router in router_names():
        if router in router_names(family):
            assert amod.convert(dense(name), router=router).amod_config.router == router
        else:
            with pytest.raises(ValueError, match=f"router={router!r} routes .* only .*; this is a {family} model"):
                amod.convert(dense(name), router=router)


@pytest.mark.parametrize("name, router, mode", CASES, ids=[f"{n}-{r}-{m}" for n, r, m in CASES])
def test_every_conversion_keeps_the_contract_or_is_refused_in_one_line(name, router, mode, tmp_path):
    if (name, router, mode) in REFUSED:
        with pytest.raises((ValueError, TypeError)) as refused:
            convert(dense(name), router, mode, 0.75)
        text = str(refused.value)
        assert REFUSED[name, router, mode] in text and "\n" not in text and len(text) < 400, text
        return
    x = images(name)
    base = dense(name)
    with torch.no_grad():
        reference = output(name, base, x)
    # capacity 1 (every token processed, outputs unscaled; no token merged) is the dense model
    merging = mode in METHODS
    full = convert(dense(name), router, mode, 1.0, **({} if merging else {"scale_output": False}))
    with torch.no_grad():
        diff = (output(name, full, x) - reference).abs().max().item()
    scores = not merging and router_class(router).needs_attention and mode != "fold"
    assert diff == 0.0 or (diff < 1e-5 and (scores or not name.startswith("timm"))), diff
    # cost: the analytic MACs are what FlopCounterMode measures (A-MoD's score sums aside)
    model = convert(dense(name), router, mode, 0.8 if mode == "fold" else 0.5)
    img = MODELS[name][1] if name == "detr" else None
    analytic = amod.flops(model, img).macs
    measured = amod.count_flops(model, x[:1]) // 2
    assert abs(analytic - measured) / measured < 0.02, (analytic, measured)
    # save and load: the same model
    path = amod.save(model, tmp_path / "m.safetensors")
    fresh = amod.load(path)
    again = amod.load(path)  # (a random router draws from its call count: two fresh models draw alike)
    with torch.no_grad():
        loaded = output(name, fresh, x)
        assert torch.equal(loaded, output(name, again, x))
        if router == "-" or not issubclass(router_class(router), SeededDraws):  # (draws depend on the call count)
            assert torch.equal(loaded, output(name, model, x))
        assert amod.method_of(fresh) == amod.method_of(model)
        # bf16 autocast runs (and gives finite outputs of the same shape)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            half = output(name, fresh, x)
        assert half.shape == loaded.shape and bool(torch.isfinite(half).all())
    # gradient checkpointing: the same gradients
    assert_same_gradients(name, again, x)


def assert_same_gradients(name: str, model: torch.nn.Module, x: torch.Tensor) -> None:
    def grads(checkpointing: bool) -> dict[str, torch.Tensor]:
        m = copy.deepcopy(model).train()
        if checkpointing:
            if hasattr(m, "set_grad_checkpointing"):
                m.set_grad_checkpointing(True)
            elif hasattr(m, "activation_checkpointing_enable"):  # transformers' (renamed in 5.2x; the old name warns)
                m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        output(name, m, x).square().mean().backward()
        return {n: p.grad for n, p in m.named_parameters() if p.grad is not None}

    plain, checkpointed = grads(False), grads(True)
    assert plain.keys() == checkpointed.keys() and plain
    for n in plain:
        assert torch.allclose(plain[n], checkpointed[n], atol=1e-6, rtol=1e-5), n


# torch.compile: the first model of each family (its models share its code; dynamo's trace costs ~2 s here), for
# A-MoD's router in every mode and the learned router on bypass. Two blocks (a dense one that scores, then the
# converted one: a trace costs about a third less) except fold, whose consecutive fold blocks hand their token sizes
# on. tests/test_export.py compiles timm with inductor.
COMPILED = list({family_of(dense(name)).name: name for name in reversed(list(MODELS))}.values())[::-1]
# ToMe's and PiToMe's merges are the same tensor code on every family (their block is the shared token-reduction
# block): traced on timm and on SigLIP (no class token). The learned router is one module on every family: traced on
# timm and on DETR (its encoder positions), its family's attention path by A-MoD's bypass.
MERGED_ON = ("timm-vit", "hf-siglip")
DEPLOYED = [(name, "attention", mode) for name in COMPILED for mode in MODES] + \
           [(name, router, mode) for name in MERGED_ON for router, mode in (("attention", "tome"), ("-", "pitome"),
                                                                        ("-", "ppt"))] + \
           [(name, "standard", "bypass") for name in COMPILED if name in ("timm-vit", "detr")]
DEPLOYED = [case for case in DEPLOYED if case not in REFUSED]  # (the contract test checks those refusals)


@pytest.mark.parametrize("name, router, mode", DEPLOYED, ids=[f"{n}-{r}-{m}" for n, r, m in DEPLOYED])
def test_every_mode_compiles_without_a_graph_break(name, router, mode):
    import torch._dynamo

    model = convert(dense(name, depth=3 if mode == "fold" else 2), router, mode, 0.8 if mode == "fold" else 0.5)
    x = images(name, 4)
    torch._dynamo.reset()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = output(name, model, x)
        # fullgraph=True fails on any graph break; aot_eager also traces the decomposed graph autograd would run
        got = torch.compile(lambda v: output(name, model, v), backend="aot_eager", fullgraph=True)(x)
    torch._dynamo.reset()
    assert (got - expected).abs().max() < 1e-5


# One export per family whose code path no other export runs (an export costs 10-25 s here): every timm mode in
# tests/test_export.py, the Hugging Face ViT in tests/test_hf.py, DETR through a wrapper in tests/test_detr.py;
# CLIP and SigLIP here, in fold, whose blocks all run amod's sized attention.
EXPORTED = ["hf-clip", "hf-siglip"]  # at 2 blocks (an export costs ~2 s a block)


@pytest.mark.parametrize("name", EXPORTED)
def test_the_new_families_export_to_onnx_and_match_onnx_runtime(name, tmp_path):
    pytest.importorskip("onnxruntime")
    model = convert(dense(name, depth=2), "attention", "fold", 0.8)
    report = amod.export(model, tmp_path / "m.onnx", check_images=4)
    assert report["check"]["max_abs_diff"] <= 1e-4 and report["check"]["batches"] == [4, 3]


# ---------------------------------------------------------------- proportional attention without a mask

class _SDPACalls(torch.utils._python_dispatch.TorchDispatchMode):
    """Records, for each fused attention kernel a forward dispatches, whether an ``attn_mask`` reached it."""

    def __init__(self) -> None:
        super().__init__()
        self.masks: list[bool] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "scaled_dot_product" in func.overloadpacket.__name__:
            names = [a.name for a in func._schema.arguments]
            given = {**dict(zip(names, args)), **kwargs}
            self.masks.append(given.get("attn_mask") is not None)
        return func(*args, **kwargs)


# every method whose tokens carry sizes after a reduction (their attention adds log(size): amod.ops.KeyBias)
BIASED = [(name, router, mode) for name in VITS for router, mode in
          (("-", "tome"), ("-", "pitome"), ("-", "ppt"), ("attention", "fold"), ("attention", "merge"))]


@pytest.mark.parametrize("name, router, mode", BIASED, ids=[f"{n}-{r}-{m}" for n, r, m in BIASED])
def test_proportional_attention_runs_maskless_and_equals_the_masked_kernel(name, router, mode):
    """On CUDA a float mask rules out FlashAttention: there the proportional-attention bias rides in more head
    channels instead (``amod.ops.KeyBias``), and no mask reaches a fused kernel; the outputs equal the masked
    kernel's (the CPU's path) to 1e-5 in fp32, and the gradients too. ``key_bias_path`` takes either path here."""
    from amod.ops import key_bias_path

    model = convert(dense(name), router, mode, 0.8 if mode == "fold" else 0.5)
    x = images(name)
    with torch.no_grad(), key_bias_path("mask"):
        masked = output(name, model, x)
    calls = _SDPACalls()
    with torch.no_grad(), key_bias_path("maskless"), calls:
        maskless = output(name, model, x)
    assert calls.masks and not any(calls.masks), calls.masks  # fused kernels ran, none with a mask
    assert (maskless - masked).abs().max().item() <= 1e-5
    grads = {}
    for path in ("mask", "maskless"):
        m = copy.deepcopy(model).train()
        with key_bias_path(path):
            output(name, m, x).square().mean().backward()
        grads[path] = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
    for n in grads["mask"]:
        assert torch.allclose(grads["mask"][n], grads["maskless"][n], atol=1e-5, rtol=1e-4), n


@pytest.mark.cuda
def test_on_cuda_no_mask_reaches_a_fused_kernel_by_default():
    model = convert(dense("timm-vit"), "-", "tome", 0.5).cuda()
    calls = _SDPACalls()
    with torch.no_grad(), calls:
        output("timm-vit", model, images("timm-vit").cuda())
    assert calls.masks and not any(calls.masks)


@pytest.mark.parametrize("name", MERGED_ON)
def test_the_maskless_path_compiles_without_a_graph_break(name):
    """The path CUDA takes, traced: one graph (aot_eager, fullgraph), equal to eager."""
    import torch._dynamo

    from amod.ops import key_bias_path

    model = convert(dense(name, depth=2), "-", "tome", 0.5)
    x = images(name, 4)
    torch._dynamo.reset()
    with torch.no_grad(), key_bias_path("maskless"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = output(name, model, x)
        got = torch.compile(lambda v: output(name, model, v), backend="aot_eager", fullgraph=True)(x)
    torch._dynamo.reset()
    assert (got - expected).abs().max() < 1e-5
