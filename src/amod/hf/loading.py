"""``load_hf_model``: a Hugging Face vision model from a ``save_pretrained`` directory (or the hub, where the
network allows), for the CLI (``amod flops``, ``bench``, ``eval``, ``compare``) to call.

The CLI's rule (``hf_source``): a model argument that is a directory holding a config.json (written by
``save_pretrained``, with the weights), or a hub id written ``hf:ID``, is a Hugging Face model. ``transformers`` is imported only when one
is loaded."""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from ..family import FAMILIES, family_of
from ..methods import method_from_metadata
from .common import CONFIG_KEY, SIDECAR, SIDECAR_FORMAT
from ..errors import MissingDependencyError, UserError


HF_PREFIX = "hf:"  # a hub id on the command line: hf:facebook/dinov2-small


def _transformers():
    try:
        import transformers
    except ImportError:
        raise MissingDependencyError(
            "Hugging Face models need transformers, the optional extra: pip install 'amod[hf]'") from None
    return transformers


def hf_source(text: Union[str, os.PathLike, None]) -> Optional[str]:
    """What to give ``load_hf_model`` if the command-line model ``text`` names a Hugging Face model (a directory
    with a config.json, or ``hf:ID``), else None (a timm name, an amod file, another directory: the command says
    what is wrong with it). Imports nothing."""
    if text is None:
        return None
    text = os.fspath(text)
    if text.startswith(HF_PREFIX):
        return text[len(HF_PREFIX):]
    return text if (Path(text).expanduser() / "config.json").is_file() else None


def load_hf_source(source: str) -> nn.Module:
    """``load_hf_model(source)`` (a ``hf_source`` answer), with amod's timm-style views in place (``blocks``,
    ``patch_embed``, ...), in eval mode."""
    model = load_hf_model(Path(source).expanduser() if Path(source).expanduser().is_dir() else source)
    return family_of(model).prepare(model)


def _offline() -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    try:
        from huggingface_hub import constants
    except ImportError:
        return False
    return bool(getattr(constants, "HF_HUB_OFFLINE", False))


def _check_hub_reachable(repo_id: str) -> None:
    """Fail fast, with one line, when ``repo_id``'s config.json is not in the hub cache and the hub cannot be
    reached: huggingface_hub would retry for about half a minute, logging each try. One request without
    retries tells; a hub that answers at all (even "no such repository") is left to ``from_pretrained``."""
    try:
        from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
        from huggingface_hub.errors import HfHubHTTPError
    except ImportError:  # transformers says what is missing
        return
    repo, _, revision = repo_id.partition("@")
    try:
        if isinstance(try_to_load_from_cache(repo, "config.json", revision=revision or None), str):
            return
        get_hf_file_metadata(hf_hub_url(repo, "config.json", revision=revision or None))
    except HfHubHTTPError:
        return
    except ValueError as e:  # huggingface_hub's HFValidationError: not a repository id
        raise UserError(f"{repo_id!r} is neither a local directory nor a Hugging Face hub id "
                        f"({' '.join(str(e).split())[:200]})") from None
    except Exception as e:  # no connection, no name resolution, a timeout, a proxy refusing, a malformed id...
        first = " ".join(str(e).split())[:200]
        raise UserError(f"cannot load {repo_id!r} from the Hugging Face hub at {constants.ENDPOINT} (the network "
                        f"is unreachable: {type(e).__name__}: {first}); give a local save_pretrained "
                        "directory") from None


PICKLED_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


def _check_local_folder(path: Path) -> None:
    """Refuse, naming the file, a save_pretrained folder amod cannot read as it is: a config.json that is not a
    JSON object, weights that are pickles (amod never unpickles a user's file), or no weights at all."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path / 'config.json'} is not valid JSON ({' '.join(str(e).split())[:160]}); give a "
                        "directory written by save_pretrained") from None
    if not isinstance(config, dict):
        raise UserError(f"{path / 'config.json'} is not a JSON object; give a directory written by save_pretrained")
    if any(f.name != SIDECAR for f in path.glob("*.safetensors")):
        return
    pickled = sorted(f for pattern in PICKLED_WEIGHTS for f in path.glob(pattern))
    if pickled:
        raise UserError(f"{pickled[0]} holds pickled weights, which amod does not load (a pickle can run code); "
                        "save the model again with save_pretrained, which writes model.safetensors")
    raise UserError(f"{path} holds no weights (no model.safetensors); give a directory written by save_pretrained")


def _architecture(config: Any, source: str, cls: Optional[str]) -> str:
    """The supported class to build, or a one-line refusal."""
    name = cls or next(iter(getattr(config, "architectures", None) or []), None)
    known = [c for family in FAMILIES for c in getattr(family, "classes", ())]  # the Hugging Face families' classes
    if name in known:
        return name
    supported = f"amod takes {', '.join(known)}"
    if name is None:
        kind = getattr(config, "model_type", None) or "unknown"
        raise UserError(f"{source}: config.json names no architecture (model_type {kind!r}); {supported} "
                        "(pass cls= to choose one)")
    raise UserError(f"{source} holds a {name}, which amod does not take; {supported}")


def read_sidecar(path: Path) -> Optional[tuple[dict[str, str], dict[str, torch.Tensor]]]:
    """(metadata, tensors) of the ``amod.safetensors`` beside a save_pretrained folder's config.json (the conversion
    ``save_pretrained`` of an amod model writes), or None where there is none."""
    sidecar = path / SIDECAR
    if not sidecar.is_file():
        return None
    try:
        with safe_open(str(sidecar), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{sidecar} is corrupt ({' '.join(str(e).split())[:160]}); save the model again") from None
    version = meta.get("amod.format", "")
    if not version.isdigit() or int(version) > int(SIDECAR_FORMAT):
        raise UserError(f"{sidecar} is in amod format {version!r}; this amod reads format {SIDECAR_FORMAT} and "
                        "older: upgrade amod to load it")
    return meta, tensors


def _rebuild_conversion(model: nn.Module, path: Path, meta: dict[str, str],
                        tensors: dict[str, torch.Tensor]) -> nn.Module:
    """Convert the dense ``model`` as the sidecar says and load amod's own tensors into it, exactly."""
    family = family_of(model)
    family.restore(model, json.loads(meta.get("amod.model", "{}")), meta)
    dense_keys = set(model.state_dict())
    try:
        model = method_from_metadata(meta).restore(family.prepare(model))
    except (ValueError, TypeError, KeyError) as e:
        raise UserError(f"{path / SIDECAR}: its conversion cannot be applied to the model in {path} "
                        f"({type(e).__name__}: {e})") from None
    own = set(model.state_dict()) - dense_keys
    if own != set(tensors):
        missing, extra = sorted(own - set(tensors)), sorted(set(tensors) - own)
        raise UserError(f"{path / SIDECAR} does not fit its conversion: missing {missing[:3]}, unexpected "
                        f"{extra[:3]}")
    model.load_state_dict(tensors, strict=False)
    return model.eval()


def load_hf_model(path_or_id: Union[str, os.PathLike], cls: Optional[str] = None) -> nn.Module:
    """The supported Hugging Face model in ``path_or_id`` (a ``save_pretrained`` directory: config.json and the
    safetensors weights; or a hub id), in eval mode. ``cls``: the class to build (default: the config's
    ``architectures``). A folder that ``save_pretrained`` of an amod-converted model wrote (its ``amod.safetensors``)
    comes back converted, with its routers' weights.

    Raises a ``ValueError`` (one line) for a file, a directory without config.json or with a broken one, pickled
    weights (never unpickled), an unsupported class, router weights without amod's conversion beside them, and a
    hub id that cannot be fetched (offline, or the hub unreachable).
    """
    transformers = _transformers()
    path = Path(path_or_id)
    if not str(path_or_id).strip():
        raise UserError("give a save_pretrained directory or a hub id (hf:ID), not an empty name")
    if path.is_file():
        raise UserError(f"{path} is a file; give a save_pretrained directory (an amod .safetensors file loads with "
                        "amod.load)")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"{path} has no config.json; give a directory written by save_pretrained")
        _check_local_folder(path)
        source, local = str(path), True
    else:
        source, local = str(path_or_id), False
        if _offline():
            raise UserError(f"{source!r} is not a local directory, and the Hugging Face hub is offline here "
                            "(HF_HUB_OFFLINE); save the model with save_pretrained where the hub is reachable and "
                            "give that directory")
        _check_hub_reachable(source)
    sidecar = read_sidecar(path) if local else None
    try:
        config = transformers.AutoConfig.from_pretrained(source, local_files_only=local)
    except (OSError, ValueError) as e:
        if local:
            raise UserError(f"{path / 'config.json'} is not a config transformers can read "
                            f"({' '.join(str(e).split())[:200]})") from None
        raise _hub_error(source, e) from None
    name = _architecture(config, source, cls)
    conversion = getattr(config, CONFIG_KEY, None)
    if local and sidecar is None and conversion is not None:
        label = conversion.get("method", "an amod") if isinstance(conversion, dict) else "an amod"
        raise UserError(f"{path} was saved from a converted model ({label}), but its {SIDECAR} is missing: as a dense "
                        f"model its numbers would be another model's; copy {SIDECAR} along with the folder (or, for "
                        f"the dense model, delete {CONFIG_KEY!r} from its config.json)")
    hf_logging = transformers.utils.logging
    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()  # ("Loading weights" on stderr; CLI errors are one line)
    hf_logging.set_verbosity_error()  # (its table of keys that did not fit: said below, in one line)
    try:
        # safetensors only: a hub repository with pickled weights alone is refused by transformers, never unpickled
        model, info = getattr(transformers, name).from_pretrained(source, local_files_only=local, use_safetensors=True,
                                                                   output_loading_info=True)
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:  # unreadable weights; the hub unreachable
        if local:
            files = ", ".join(sorted(f.name for f in path.glob("*.safetensors") if f.name != SIDECAR))
            raise UserError(f"cannot read the weights in {path} ({files}): "
                            f"{' '.join(str(e).split())[:200]}") from None
        if not isinstance(e, OSError):
            raise
        raise _hub_error(source, e) from None
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    unexpected, missing = list(info.get("unexpected_keys", [])), list(info.get("missing_keys", []))
    routers = [k for k in unexpected if ".router." in k]
    if sidecar is None and routers:
        raise UserError(f"{source} holds amod router weights ({routers[0]}) but not amod's conversion "
                        f"({SIDECAR}): as a dense model its numbers would be another model's; save it with "
                        "save_pretrained of the converted model (which writes both) or amod.save")
    if unexpected or missing:
        warnings.warn(f"{source}: the weights do not fit {name} exactly (missing {missing[:3]}, unexpected "
                      f"{unexpected[:3]}); missing ones keep their initial values", stacklevel=2)
    model = model.eval()
    return model if sidecar is None else _rebuild_conversion(model, path, *sidecar)


def _hub_error(source: str, e: BaseException) -> ValueError:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return UserError(f"cannot load {source!r} from the Hugging Face hub ({first[:200]}); give a local "
                     "save_pretrained directory")
