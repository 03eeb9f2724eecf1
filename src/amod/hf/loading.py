"""``load_hf_model``: a Hugging Face vision model from a ``save_pretrained`` directory (or the hub, where the
network allows), for the CLI (``amod flops``, ``bench``, ``eval``, ``compare``) to call.

The CLI's rule (``hf_source``): a model argument that is a directory holding a config.json (written by
``save_pretrained``, with the weights), or a hub id written ``hf:ID``, is a Hugging Face model. ``transformers`` is imported only when one
is loaded."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

from torch import nn

from . import SUPPORTED


HF_PREFIX = "hf:"  # a hub id on the command line: hf:facebook/dinov2-small


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ImportError("Hugging Face models need transformers, the optional extra: pip install 'amod[hf]'") from None
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
    from . import prepare

    return prepare(load_hf_model(Path(source).expanduser() if Path(source).expanduser().is_dir() else source))


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
        raise ValueError(f"{repo_id!r} is neither a local directory nor a Hugging Face hub id "
                         f"({' '.join(str(e).split())[:200]})") from None
    except Exception as e:  # no connection, no name resolution, a timeout, a proxy refusing, a malformed id...
        first = " ".join(str(e).split())[:200]
        raise ValueError(f"cannot load {repo_id!r} from the Hugging Face hub at {constants.ENDPOINT} (the network "
                         f"is unreachable: {type(e).__name__}: {first}); give a local save_pretrained "
                         "directory") from None


def load_hf_model(path_or_id: Union[str, os.PathLike], cls: Optional[str] = None) -> nn.Module:
    """The supported Hugging Face model in ``path_or_id`` (a ``save_pretrained`` directory: config.json and the
    weights; or a hub id), in eval mode. ``cls``: the class to build (default: the config's ``architectures``).

    Raises a ``ValueError`` (one line) for a file, a directory without config.json, an unsupported class, and a
    hub id that cannot be fetched (offline, or the hub unreachable).
    """
    transformers = _transformers()
    path = Path(path_or_id)
    if not str(path_or_id).strip():
        raise ValueError("give a save_pretrained directory or a hub id (hf:ID), not an empty name")
    if path.is_file():
        raise ValueError(f"{path} is a file; give a save_pretrained directory (an amod .safetensors file loads with "
                         "amod.load)")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} has no config.json; give a directory written by save_pretrained")
        source, local = str(path), True
    else:
        source, local = str(path_or_id), False
        if _offline():
            raise ValueError(f"{source!r} is not a local directory, and the Hugging Face hub is offline here "
                             "(HF_HUB_OFFLINE); save the model with save_pretrained where the hub is reachable and "
                             "give that directory")
        _check_hub_reachable(source)
    try:
        config = transformers.AutoConfig.from_pretrained(source, local_files_only=local)
        name = cls or next(iter(config.architectures or []), None)
        if name not in SUPPORTED:
            raise ValueError(f"{source}: {name or 'no architecture in config.json'} is not a model amod takes; "
                             f"supported: {', '.join(SUPPORTED)} (pass cls= to choose one)")
        bars = transformers.utils.logging.is_progress_bar_enabled()
        transformers.utils.logging.disable_progress_bar()  # ("Loading weights" on stderr; CLI errors are one line)
        try:
            return getattr(transformers, name).from_pretrained(source, local_files_only=local).eval()
        finally:
            if bars:
                transformers.utils.logging.enable_progress_bar()
    except OSError as e:  # the hub unreachable, or the id unknown
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"cannot load {source!r} from the Hugging Face hub ({first[:200]}); give a local "
                         "save_pretrained directory") from None
