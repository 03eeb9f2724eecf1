"""Build the model a run trains: a timm name with overrides, a pretrained hub model or a checkpoint
file, fitted to the data, then turned into the method the run config selects (``amod.methods``)."""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Optional

import timm
import torch
from safetensors.torch import load_file
from timm.models._manipulate import adapt_input_conv
from timm.models.vision_transformer import checkpoint_filter_fn
from torch import nn

from .. import files
from ..families import claimed, family_of
from ..methods import Dense, Method, apply_found, method_from_metadata, method_of
from ..arch import set_input_size
from ..mod.convert import MoD, set_capacity
from ..checkpoint import load as load_amod, load_weightless, read_metadata
from ..errors import UserError

log = logging.getLogger("amod")

ARCH_OVERRIDES = ("img_size", "patch_size", "depth", "embed_dim", "num_heads")


def model_overrides(cfg: Any, num_classes: int, in_chans: int, img_size: int) -> dict[str, Any]:
    """timm ``create_model`` kwargs from a run config and the data."""
    kwargs = {k: getattr(cfg, k) for k in ARCH_OVERRIDES if getattr(cfg, k, None) is not None}
    kwargs.setdefault("img_size", img_size)
    kwargs["num_classes"] = num_classes
    kwargs["in_chans"] = in_chans
    if getattr(cfg, "drop_path", 0.0):
        kwargs["drop_path_rate"] = cfg.drop_path
    return kwargs


def load_state_dict_file(path: Path) -> dict[str, torch.Tensor]:
    """A plain state dict from a timm/DeiT ``.pth``/``.pt``/``.bin`` or a safetensors file."""
    if path.suffix == ".safetensors":
        try:
            return load_file(str(path))
        except Exception as e:
            raise UserError(f"cannot read checkpoint {path}: {e}") from None
    ckpt = files.load_torch(path)
    if isinstance(ckpt, dict):
        for key in ("model_ema", "state_dict_ema", "state_dict", "model"):
            if isinstance(ckpt.get(key), dict):
                ckpt = ckpt[key]
                break
    if not isinstance(ckpt, dict) or not all(isinstance(v, torch.Tensor) for v in ckpt.values()):
        raise UserError(f"{path} does not hold a state dict of tensors")
    return {k.removeprefix("module."): v for k, v in ckpt.items()}


STUDENT_HINT = "set --model, --embed-dim, --depth and --num-heads to the checkpoint's architecture"
# a .pth teacher has no architecture of its own: it is read into the run's (the student's) model
TEACHER_HINT = ("a .pth teacher is read into the student's architecture (--model, --embed-dim, --depth, --num-heads): "
                "give a teacher of that architecture, or an amod .safetensors teacher, which keeps its own")


def _load_into(model: nn.Module, state: dict[str, torch.Tensor], path: Path, hint: str = STUDENT_HINT) -> bool:
    """Load a foreign (timm/DeiT) state dict: resample pos_embed, adapt input channels, drop a head of
    another size. Anything else that does not fit is an error (ending in ``hint``: what to change). Returns whether
    the model's classifier came from the file (False: it was dropped for another size, or the model has none)."""
    own = model.state_dict()
    try:
        state = checkpoint_filter_fn(state, model)
    except (RuntimeError, ValueError, AssertionError, KeyError, IndexError) as e:
        raise UserError(f"checkpoint {path} does not fit the model ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}); {hint}") from None
    w = state.get("patch_embed.proj.weight")
    if w is not None and w.shape[1] != own["patch_embed.proj.weight"].shape[1]:
        state["patch_embed.proj.weight"] = adapt_input_conv(own["patch_embed.proj.weight"].shape[1], w)
    dropped = [k for k in list(state) if k.startswith(("head.", "head_dist.")) and k in own
               and state[k].shape != own[k].shape]
    for k in dropped:
        del state[k]
    wrong = [k for k in state if k in own and state[k].shape != own[k].shape]
    if wrong:
        k = wrong[0]
        raise UserError(f"checkpoint {path} does not fit the model: {k} is {tuple(state[k].shape)} in the file and "
                        f"{tuple(own[k].shape)} in the model ({len(wrong)} tensors differ); {hint}")
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in dropped]
    if missing or unexpected:
        raise UserError(f"checkpoint {path} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}; "
                        f"{hint}")
    if dropped:
        log.info("checkpoint head has another number of classes: new head initialised")
    return not dropped and "head.weight" in own and "head.weight" in state


def fit_to_data(model: nn.Module, in_chans: int, img_size: int) -> nn.Module:
    """Adapt a loaded ViT to the data, in place, through its family: its patch embedding to ``in_chans`` channels
    (``set_input_channels``; a timm model's filters by timm's ``adapt_input_conv``: e.g. an RGB model sums its filters
    for grayscale images, which is the same as feeding the gray image three times), and its position grid to
    ``img_size`` (``set_input_size``; a timm model's resampled once, bicubic without antialiasing:
    ``amod.arch.set_input_size``). Each change is logged; a family that cannot make one refuses it (ValueError)."""
    family = family_of(model)
    chans = model.patch_embed.proj.in_channels
    if chans != in_chans:
        family.set_input_channels(model, in_chans)
        log.info("patch embedding adapted from %d to %d input channels", chans, in_chans)
    if tuple(model.patch_embed.img_size) != (img_size, img_size):
        old = model.patch_embed.img_size[0]
        family.set_input_size(model, img_size)
        log.info("position grid resampled from %d px to %d px (bicubic, no antialiasing)", old, img_size)
    return model


def check_vit_name(name: str) -> None:
    """Refuse a name that is not a timm model, or a timm model that is not a ``VisionTransformer``."""
    if not isinstance(name, str) or not timm.is_model(name):
        raise UserError(f"unknown timm model {name!r}; amod supports timm's VisionTransformer models "
                        "(vit_*, deit_*, deit3_*, *_reg*, *_dinov2)")
    with torch.device("meta"):  # the class only: no memory, no weights
        model = timm.create_model(name, pretrained=False)
    if claimed(model) is None:
        raise UserError(f"{name} is a {type(model).__name__}; amod supports timm's VisionTransformer models "
                        "(vit_*, deit_*, deit3_*, *_reg*, *_dinov2)")


def check_hub_reachable(name: str) -> None:
    """Fail fast, with one message, when timm's pretrained weights of ``name`` must be downloaded and the
    model hub cannot be reached.

    huggingface_hub retries a failed connection for about a minute, logging each try, and timm asks for
    two files. One request without retries tells first; weights already in the hub cache, a model not
    on the hub, offline mode, and a hub that answers at all are left to timm.
    """
    try:
        from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
        from huggingface_hub.errors import HfHubHTTPError
    except ImportError:  # timm says what is missing
        return
    with torch.device("meta"):
        repo = timm.create_model(name, pretrained=False).pretrained_cfg.get("hf_hub_id")
    if not repo or constants.HF_HUB_OFFLINE:
        return
    repo, _, revision = repo.partition("@")
    revision = revision or None
    if any(isinstance(try_to_load_from_cache(repo, f, revision=revision), str)
           for f in ("model.safetensors", "pytorch_model.bin")):
        return
    try:
        get_hf_file_metadata(hf_hub_url(repo, "model.safetensors", revision=revision))
    except HfHubHTTPError:
        return  # the hub answered (e.g. no such file): timm takes it from here
    except Exception as e:  # no connection, no name resolution, a timeout, a proxy refusing...
        raise ConnectionError(f"cannot download the pretrained weights of {name} from {constants.ENDPOINT} "
                              f"({type(e).__name__}: {e}); connect to the network, or start from a local file "
                              "with --checkpoint") from None


def _create(name: str, pretrained: bool, kwargs: dict[str, Any]) -> nn.Module:
    """``timm.create_model`` of a ViT, with the settings named in the error when timm refuses them."""
    check_vit_name(name)
    if pretrained:
        check_hub_reachable(name)
    try:
        return timm.create_model(name, pretrained=pretrained, **kwargs)
    except (RuntimeError, AssertionError, TypeError, ValueError) as e:  # e.g. widths that do not divide
        settings = ", ".join(f"{k}={v}" for k, v in kwargs.items())
        raise UserError(f"cannot build {name} with {settings}: {e}") from None


def _is_amod_file(path: Path) -> bool:
    if path.suffix != ".safetensors":
        return False
    try:
        read_metadata(path)
    except ValueError as e:
        if "was not written by amod.save" in str(e):
            return False
        raise
    return True


def checkpoint_architecture(path: Any) -> Optional[tuple[str, dict[str, Any]]]:
    """(timm name, ``create_model`` kwargs) of a model saved by amod; None for any other file or a
    path that is not a file (``build_model`` says what is wrong with those)."""
    path = Path(path)
    if not path.is_file() or not _is_amod_file(path):
        return None
    try:
        info = json.loads(read_metadata(path)["amod.model"])
        return str(info["arch"]), dict(info["args"])
    except (ValueError, TypeError, KeyError):  # broken metadata: loading the file says so
        return None


def saved_method(path: Any) -> Optional[Method]:
    """The method a model saved by amod runs (``Dense`` for a dense one); None for any other file or a path that is not
    a file (``build_model`` says what is wrong with those)."""
    path = Path(path)
    if not path.is_file() or not _is_amod_file(path):
        return None
    return method_from_metadata(read_metadata(path))


def checkpoint_settings(cfg: Any) -> dict[str, Any]:
    """The run-config fields that a model saved by amod (``cfg.checkpoint``) decides, with its values:
    the architecture (model, patch_size, depth, embed_dim, num_heads) and, when ``cfg`` selects no
    method, the file's method (MoD, ToMe, PiToMe). Empty for any other starting point.

    Raises:
        ValueError: ``cfg`` asks for another architecture, or for stochastic depth, which such a file
            does not take (it is rebuilt as it was saved).
    """
    arch = checkpoint_architecture(cfg.checkpoint) if cfg.checkpoint else None
    if arch is None:
        return {}
    name, args = arch
    patch = args.get("patch_size")
    patch = patch[0] if isinstance(patch, (list, tuple)) and len(set(patch)) == 1 else patch
    own = {"patch_size": patch if isinstance(patch, int) else None, "depth": args.get("depth"),
           "embed_dim": args.get("embed_dim"), "num_heads": args.get("num_heads")}
    for field, value in own.items():
        given = getattr(cfg, field)
        if given is not None and value is not None and given != value:
            flag = field.replace("_", "-")
            raise UserError(f"--{flag} {given} does not match {cfg.checkpoint}, which has {field} {value}: a model "
                            f"saved by amod keeps its architecture; drop --{flag}")
    if getattr(cfg, "drop_path", 0.0):
        raise UserError(f"--drop-path does not apply to {cfg.checkpoint}: a model saved by amod is rebuilt as it was "
                        "saved, without stochastic depth; drop --drop-path")
    settings: dict[str, Any] = {"model": name, **{k: v for k, v in own.items() if v is not None}}
    saved = method_from_metadata(read_metadata(cfg.checkpoint))
    if isinstance(cfg.method(), Dense) and not isinstance(saved, Dense):
        settings["method_spec"] = saved.spec()
    return {k: v for k, v in settings.items() if getattr(cfg, k) != v}


def check_trainable(model: nn.Module, source: str) -> nn.Module:
    """``model`` if amod's classifier training takes it (its family is ``trainable``); a ValueError naming
    ``source`` otherwise (e.g. a Hugging Face model saved by amod: it has no timm classifier to train)."""
    family = family_of(model)
    if not family.trainable:
        raise UserError(f"{source} holds a {family.models} model, which amod's training does not take (it trains "
                        "timm models); amod compare and amod frontier measure it without training")
    return model


def build_model(cfg: Any, num_classes: int, in_chans: int, img_size: int) -> nn.Module:
    """The model of a run, before any training.

    ``cfg`` fields used: model, pretrained, checkpoint, the ARCH_OVERRIDES, drop_path, and the method
    (``method_spec``, ``seed``: ``RunConfig.method``).
    """
    if cfg.checkpoint:
        path = Path(cfg.checkpoint)
        if path.is_dir():
            raise UserError(f"checkpoint {path} is a directory; give the model file (an amod .safetensors or a "
                            "timm/DeiT .pth)")
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint {path} does not exist")
        if _is_amod_file(path):
            model = load_amod(path)  # an amod file knows its architecture
            fit_to_data(check_trainable(model, f"checkpoint {path}"), in_chans, img_size)
        else:
            model, _ = _from_weights_file(cfg, path, num_classes, in_chans, img_size)
        if family_of(model).num_classes(model) != num_classes:
            model.reset_classifier(num_classes)
            log.info("classifier reset to %d classes", num_classes)
    else:
        model = _create(cfg.model, cfg.pretrained, model_overrides(cfg, num_classes, in_chans, img_size))
    ph, pw = model.patch_embed.patch_size
    h, w = model.patch_embed.img_size
    if h % ph or w % pw:
        raise UserError(f"the input size {h}x{w} is not a multiple of the patch size {ph}x{pw}; "
                        "change --img-size or --patch-size")
    declared = cfg.declared_method()
    running = method_of(model)
    # --seed alone does not reseed a saved router: the file's seed, where the spec leaves the seed unset
    method = declared.seeded(running.seed if type(running) is type(declared) and isinstance(running, MoD) else cfg.seed)
    if isinstance(method, Dense) or method == running:
        return model  # a checkpoint keeps the method it was saved with (``checkpoint_settings`` records it)
    if isinstance(running, MoD) and type(method) is type(running) and \
            dataclasses.replace(method, capacity=running.capacity) == running:
        set_capacity(model, method.capacity)  # its method at another capacity: the dial, as amod eval --capacity turns it
        log.info("capacity set from %g to %g", running.capacity, method.capacity)
        return model
    if not isinstance(running, Dense):
        dial = " (--capacity alone sets its capacity)" if isinstance(running, MoD) else ""
        raise UserError(f"the checkpoint already runs {running.label()}; drop the method options "
                        f"(--router, --tome-cost, ...) to keep it{dial}")
    return apply_found(method, model)  # (what the run's files will name)


def build_teacher(cfg: Any, num_classes: int, in_chans: int, img_size: int) -> nn.Module:
    """The dense model a distilled run learns from: ``cfg.teacher`` (a model file), or else the run's starting
    weights as a dense model. Refuses a teacher that runs a method (it must be dense), and logit distillation from
    starting weights whose classifier was not trained for the data's classes (its logits would teach nothing).
    ``cfg``: the run's ``RunConfig``."""
    if cfg.teacher is not None:
        path = Path(cfg.teacher).expanduser()
        if path.is_dir():
            raise UserError(f"the teacher {path} is a directory; give the model file (an amod .safetensors or a "
                            "timm/DeiT .pth)")
        if not path.is_file():
            raise FileNotFoundError(f"no teacher at {path}")
        if _is_amod_file(path):
            teacher = fit_to_data(check_trainable(load_amod(path), f"the teacher {path}"), in_chans, img_size)
        else:
            teacher, head_loaded = _from_weights_file(cfg, path, num_classes, in_chans, img_size, TEACHER_HINT)
            if not head_loaded and cfg.distill_logits > 0:
                raise UserError(f"the teacher {path} has no classifier for the data's {num_classes} classes, so its "
                                "logits would teach nothing: give a teacher finetuned on this data, or distil "
                                "features alone (--distill-logits 0 --distill-features 1)")
        source = str(path)
    else:
        source = "the starting weights"
        if cfg.checkpoint and not _is_amod_file(Path(cfg.checkpoint)):  # a state dict file: loading it tells
            teacher, trained_head = _from_weights_file(cfg, Path(cfg.checkpoint), num_classes, in_chans, img_size)
        else:
            teacher = build_model(cfg.without_method(), num_classes, in_chans, img_size)
            trained_head = _trained_head(cfg, num_classes)
        if cfg.distill_logits > 0 and not trained_head:
            raise UserError(f"the starting weights have no classifier trained for the data's {num_classes} classes, "
                            "so their logits teach nothing: give --teacher FILE (a dense model finetuned on this "
                            "data), or distil features alone (--distill-logits 0 --distill-features 1)")
    if not isinstance(method_of(teacher), Dense):
        raise UserError(f"the teacher ({source}) runs {method_of(teacher).label()}; distil from a dense model")
    classes = family_of(teacher).num_classes(teacher)
    if classes != num_classes and cfg.distill_logits > 0:
        raise UserError(f"the teacher ({source}) has {classes} classes and the data {num_classes}: distil from a "
                        "teacher trained on the same classes")
    return teacher


def _from_weights_file(cfg: Any, path: Path, num_classes: int, in_chans: int, img_size: int,
                       hint: str = STUDENT_HINT) -> tuple[nn.Module, bool]:
    """``cfg.model`` with a timm/DeiT state dict file's weights (a head of another size is dropped), and whether
    its classifier came from the file; ``hint``: what to change where it does not fit."""
    model = _create(cfg.model, False, model_overrides(cfg, num_classes, in_chans, img_size))
    head_loaded = _load_into(model, load_state_dict_file(path), path, hint)
    return model, head_loaded


def _trained_head(cfg: Any, num_classes: int) -> bool:
    """Whether the run's starting weights bring a classifier for ``num_classes`` classes (an amod file that has
    one, or timm's pretrained head where it has that many classes; a state dict file says so as it loads:
    ``_from_weights_file``)."""
    if cfg.checkpoint:
        path = Path(cfg.checkpoint)
        if not _is_amod_file(path):
            return False
        model = load_weightless(path)
        return family_of(model).num_classes(model) == num_classes
    if cfg.pretrained:
        pretrained = timm.models.get_pretrained_cfg(cfg.model)
        return pretrained is not None and pretrained.num_classes == num_classes
    return False
