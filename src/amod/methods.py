"""The method a model runs: dense, Mixture-of-Depths, the isoFLOP dense baseline of an MoD setup, token merging
(ToMe, PiToMe), or a calibrated A-MoD fold; and the open registry of them.

One class per method, registered with ``@register_method`` under its ``kind``, knows how to turn a dense timm ViT
into itself (``apply``), price itself (``cost_of``), name itself in reports (``label``, ``setting_text``), the
checkpoint metadata (``metadata_key``, ``metadata``, ``from_metadata``), how to find itself in a model (``of_model``) and how to set itself
to a share of the dense model's MACs (``at_cost``; a method with ``needs_images`` chooses its setting on unlabeled
images given there). Any registered method is also selected by a spec string, ``KIND:FIELD=VALUE,...``
(``parse_method``, ``Method.spec``): the one way a run configuration, ``config.yaml``, a report row and the
command line carry a method. The built-in methods' older options (``--router``, ``--capacity``, ``--tome-cost``,
...) are shorthand for a spec, stated once in ``SHORTHANDS``; configurations, checkpoints and report rows written
with them read back through the same table (``method_from_shorthand``). Run configurations, model building, checkpoints, ``amod flops``,
``amod compare``, ``amod frontier`` and ``amod study`` all read the registry when they run, so a method registered
later (in any module imported before use) is found by all of them. An installed package makes its methods known to
the shipped ``amod`` command through the entry-point group ``amod.methods`` (``ENTRY_POINT_GROUP``), loaded the first
time the registry is consulted. A file names the method that wrote it (``METHOD_ENTRY``); one whose method is not
registered is refused, never opened as a dense model.
"""
from __future__ import annotations

import copy
import dataclasses
import importlib.metadata
import json
import math
import os
import sys
import traceback
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator, Optional, Union

import torch
from torch import nn

from .family import weightless_copy
from .cost import flops, validate_cost
from .mod.calibrate import (DEFAULT_PROTECTS, DEFAULT_TILTS, calibrate, validate_calibration_router, validate_protects,
                             validate_stages, validate_tilts)
from .mod.config import (LAYER_PRESETS, MoDConfig, validate_capacity, validate_protect, validate_router, validate_shape,
                          validate_skipped)
from .mod.modes import skipped_mode, skipped_mode_names
from .mod.routers import vit_routers
from .mod.convert import DEFAULT_LAYERS, capacity_for_cost, convert
from .mod.isoflop import isoflop_baseline
from . import tome
from .tome import pitome
from .errors import UserError

Layers = Optional[Union[str, list[int], tuple[int, ...]]]


def _as_list(value: Any) -> Any:
    """A tuple as a list (what configurations and ``amod.convert`` take); anything else as it is."""
    return list(value) if isinstance(value, tuple) else value


def _as_tuple(value: Any) -> Any:
    """A list as a tuple (what the frozen method dataclasses hold, hashable); anything else as it is."""
    return tuple(value) if isinstance(value, list) else value


def _is_union(origin: Any) -> bool:
    return origin is Union or (sys.version_info >= (3, 10) and origin is types.UnionType)


# the items of a bare ``tuple`` or ``list`` field: each read as the first of these it parses as
_ANY_ITEM = Union[int, float, bool, str]


def _settable(tp: Any) -> bool:
    """Whether a spec string can set a field of type hint ``tp`` (``_parse_value`` reads it)."""
    if tp in (int, float, bool, str, type(None), tuple, list):
        return True
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if _is_union(origin):
        return all(_settable(a) for a in args)
    if origin in (tuple, list):
        items = [a for a in args if a is not Ellipsis]
        return len(items) == 1 and items[0] not in (tuple, list) and _settable(items[0])
    return False



class Method:
    """Base class of the methods; subclasses are frozen dataclasses registered with ``@register_method``. Their
    fields are the method's settings: a spec string sets them by name (``parse_method``), so give each a type hint
    (int, float, bool, str, Optional, Union, tuple)."""

    kind: ClassVar[str]
    # the checkpoint metadata entry this method writes and is found by: every registered method but ``Dense`` has one
    # (``register_method`` refuses a class without), so a file of it never reads back as a dense model
    metadata_key: ClassVar[Optional[str]]
    # whether ``at_cost`` chooses the setting on unlabeled images (callers pass them as ``images``)
    needs_images: ClassVar[bool] = False
    # the fields ``at_cost`` sets (the method's setting for a cost): a spec that gives them to a command that sets
    # every method to its costs is refused (``given_setting``), as a field named ``cost`` always is
    setting_fields: ClassVar[tuple[str, ...]] = ()

    # metadata entries older files name this method by: read (``from_metadata``), never written
    former_metadata_keys: ClassVar[tuple[str, ...]] = ()

    # The version of what the method computes from the same weights and setting. A change of its outputs bumps it
    # (tests/test_method_versions.py keeps a reference output of each built-in per version and fails where one moves
    # without a bump), and says what changed in ``behaviour_changes``. A file records the version that wrote it
    # (``BEHAVIOUR_ENTRY``); one of another version is refused in one line (``check_method_file``), never run by
    # another rule than the one it was measured with.
    behaviour: ClassVar[int] = 1
    behaviour_changes: ClassVar[dict[int, str]] = {}  # version -> what it changed (named when an older file is refused)
    # The version of a file that records none: (one that names its method in ``METHOD_ENTRY``, one from before that
    # entry). None: files of that age were written by more than one version, which cannot be told apart (refused).
    unrecorded_behaviour: ClassVar[tuple[Optional[int], Optional[int]]] = (1, 1)

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Refuse bad or conflicting fields with an ``amod.UserError`` (one line naming them: the command prints it as
        the user's mistake, where any other exception is reported as a bug in the method's package): run when the
        method is made, so a spec (``parse_method``), ``--method``, ``--methods`` and the library refuse them
        alike."""

    def apply(self, model: nn.Module) -> nn.Module:
        """Turn the dense timm ViT ``model`` into this method (in place where possible); returns the model."""
        raise NotImplementedError

    def restore(self, model: nn.Module) -> nn.Module:
        """This method on the dense model that a checkpoint's description rebuilds (``amod.load``): ``apply``, unless
        the description already holds what the method changed (``IsoFLOP``'s fewer blocks)."""
        return self.apply(model)

    def cost_of(self, dense: nn.Module, img_size=None) -> float:
        """This method's cost as a share of the dense model's MACs (priced on a weightless copy). Over ``dense``'s
        own MACs, not the method's model's ``flops(...).ratio``: a model with fewer blocks (``IsoFLOP``) is dense in
        itself."""
        return flops(self.apply(weightless_copy(dense)), img_size).macs / flops(dense, img_size).dense_macs

    def spec(self) -> str:
        """The spec string that selects this method (``parse_method``): its kind, then the fields that differ from
        their defaults, e.g. ``tome:cost=0.5``."""
        given = [f"{f.name}={_spec_value(getattr(self, f.name))}" for f in dataclasses.fields(self)
                 if getattr(self, f.name) != f.default]
        return self.kind + (":" + ",".join(given) if given else "")

    def label(self) -> str:
        """Short description, as in run summaries: ``dense``, ``attention@0.5``, ``tome@0.56``."""
        return self.spec()

    def setting_text(self) -> str:
        """What it runs, in a report's setting column (``setting_text_of`` gives it for a report row's fields)."""
        return self.spec()

    def metadata(self) -> dict[str, str]:
        """Entries of a checkpoint's metadata that rebuild this method (by default its fields as JSON under
        ``metadata_key``; none without one, as for a dense model); ``from_metadata`` reads them back as this method.
        A file holds a model's (``method_of(model).metadata()``: the setting it runs) beside its kind under
        ``METHOD_ENTRY`` (``file_metadata``); a method not yet set (a cost, a default to resolve) writes its fields as
        given."""
        if getattr(self, "metadata_key", None) is None:  # Dense
            return {}
        return {self.metadata_key: json.dumps({f.name: _as_list(getattr(self, f.name))
                                               for f in dataclasses.fields(self)})}

    @classmethod
    def stored_settings(cls, meta: dict[str, str]) -> Optional[Any]:
        """The settings this method's entry in a file's metadata ``meta`` holds (JSON, under ``metadata_key`` or, in
        an older file, one of ``former_metadata_keys``), or None where ``meta`` has no such entry."""
        key = next((k for k in (getattr(cls, "metadata_key", None), *cls.former_metadata_keys)
                    if k is not None and k in meta), None)
        return None if key is None else json.loads(meta[key])

    @classmethod
    def from_metadata(cls, meta: dict[str, str]) -> Optional["Method"]:
        """This method, if the checkpoint metadata ``meta`` names it (by default: its fields, JSON, under
        ``metadata_key``)."""
        data = cls.stored_settings(meta)
        if data is None:
            return None
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise UserError(f"{cls.metadata_key}: unknown fields {unknown}; {cls.kind} has {', '.join(names)}")
        return cls(**{k: _as_tuple(v) for k, v in data.items()})

    @classmethod
    def of_model(cls, model: nn.Module) -> Optional["Method"]:
        """This method as ``model`` runs it, if it does; None for any other model. Every method but ``Dense`` defines
        it (``register_method`` refuses one without): it is how ``method_of`` finds the method, and so what
        ``amod.save`` writes; without it a model of the method would be saved as the dense model."""
        return None

    def at_cost(self, dense: nn.Module, cost: float, images: Optional[torch.Tensor] = None) -> "Method":
        """A copy set to the cost closest to ``cost`` x the dense model's MACs (priced on a weightless copy);
        ``images``: unlabeled images of the data, for a method that ``needs_images`` to choose its setting."""
        return self

    def given_setting(self) -> list[str]:
        """The fields of its setting for a cost (``setting_fields``, and ``cost``) that this method gives other than
        their defaults, as ``name=value``: what ``at_cost`` would replace."""
        names = dict.fromkeys((*self.setting_fields, "cost"))
        return [f"{f.name}={_spec_value(getattr(self, f.name))}" for f in dataclasses.fields(self)
                if f.name in names and getattr(self, f.name) != f.default]

    def seeded(self, seed: int) -> "Method":
        """This method as a run seeded with ``seed`` runs it: a method that draws (a random router) and leaves its
        own seed unset takes the run's; any other is returned as it is."""
        return self


# The registered method classes by kind, in lookup order (the first whose metadata or model matches is the one;
# ``Dense``, the fallback, is asked last). ``register_method`` adds to it; the lookups below (``method_classes``,
# ``method_kinds``, ``parse_method``, ``method_from_metadata``) first load the installed packages' methods.
METHOD_CLASSES: dict[str, type[Method]] = {}

# the entry-point group through which an installed package registers methods: ``NAME = module`` (importing the module
# registers them with ``@register_method``) or ``NAME = module:Class`` (that class, registered if it is not yet).
# amod's own methods register when amod is imported; the group is for other packages.
ENTRY_POINT_GROUP = "amod.methods"
# a file's metadata entry naming the kind of the method that wrote it (files written before it name a method only by
# its ``metadata_key`` entry)
METHOD_ENTRY = "amod.method"
# the version of the method's behaviour that wrote a file (``Method.behaviour``), and the package (distribution and
# version) whose method it is: amod's own, or the package that registered it
BEHAVIOUR_ENTRY = "amod.method.behaviour"
PROVIDER_ENTRY = "amod.method.provider"
# the metadata entries of a file that are not a method's
_FILE_ENTRIES = ("amod.format", "amod.model", METHOD_ENTRY)

_plugins = {"loaded": False, "loading": False}


@dataclass(frozen=True)
class Provider:
    """The package a method class comes from: its distribution's name and version (``amod`` for the built-ins)."""

    name: str
    version: str

    def __str__(self) -> str:
        return f"{self.name} {self.version}"

    @classmethod
    def parse(cls, text: str) -> "Provider":
        name, _, version = text.strip().partition(" ")
        return cls(name, version.strip())

    def same_package(self, other: "Provider") -> bool:
        return _normalized(self.name) == _normalized(other.name)


def _normalized(name: str) -> str:
    """A distribution name as packaging compares them (PEP 503)."""
    return "-".join(name.replace("_", "-").replace(".", "-").lower().split("-"))


# the provider of each class an installed package's entry point registered (the others are looked up)
_ENTRY_PROVIDERS: dict[type, Provider] = {}
_loading_provider: list[Provider] = []  # the package whose entry point is being loaded (its module's registrations)


def method_provider(cls: type[Method]) -> Optional[Provider]:
    """The package ``cls`` comes from: ``amod`` for amod's own methods; for another's, the distribution whose
    entry point registered it, or that installed its top-level module; None for a class of code no installed package
    holds (a script, a test)."""
    if cls in _ENTRY_PROVIDERS:
        return _ENTRY_PROVIDERS[cls]
    top = cls.__module__.partition(".")[0]
    if top == __name__.partition(".")[0]:
        return Provider("amod", getattr(sys.modules.get(top), "__version__", "unknown"))
    dists = importlib.metadata.packages_distributions().get(top, [])
    if len(set(map(_normalized, dists))) == 1:
        try:
            return Provider(dists[0], importlib.metadata.version(dists[0]))
        except importlib.metadata.PackageNotFoundError:
            return None
    return None


def _described(cls: type[Method]) -> str:
    """A method class as a refusal names it: its module and name, and its package."""
    provider = method_provider(cls)
    if provider is not None and provider.name == "amod":
        return f"amod's built-in {cls.__name__}"
    package = f"package {provider}" if provider is not None else "no installed package"
    return f"{cls.__module__}.{cls.__qualname__} ({package})"


def _same_class(a: type, b: type) -> bool:
    """Whether ``a`` and ``b`` are one class (or one class's definition run again: a module reloaded)."""
    return a is b or (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__)


def register_method(cls: type[Method]) -> type[Method]:
    """Class decorator: register a ``Method`` subclass under its ``kind``, so that ``method_of``,
    ``method_from_metadata``, checkpoint loading, ``RunConfig.method()``, ``parse_method`` and the experiments'
    ``--methods`` find it. A kind names one method: a class may not take a kind that another class (a built-in or
    another package's) has already (registering the same class again does nothing). The class must name its
    ``metadata_key``, the checkpoint metadata entry it writes (e.g. ``"amod.random-drop"``; unique among the
    registered methods), and define ``of_model``: without either a model of it would be saved as the dense model.
    Each field needs a type hint that a spec string can set (``parse_method``). Refusals are one-line UserErrors."""
    kind = getattr(cls, "kind", None)
    if not isinstance(kind, str) or not kind or any(c in kind for c in ":,= "):
        raise UserError(f"{cls.__name__}: a method's kind must be a non-empty name without ':', ',', '=' or spaces, "
                        f"got {kind!r}")
    if _loading_provider and cls not in _ENTRY_PROVIDERS and cls.__module__.partition(".")[0] != "amod":
        _ENTRY_PROVIDERS[cls] = _loading_provider[-1]  # (registered while its package's entry point loads)
    existing = METHOD_CLASSES.get(kind)
    if existing is not None and not _same_class(existing, cls):
        raise UserError(f"{_described(cls)} registers the method kind {kind!r}, which is {_described(existing)}'s "
                        f"already: a kind names one method, so that a spec and a file mean one model; give "
                        f"{cls.__name__} another kind")
    key = getattr(cls, "metadata_key", None)
    if not isinstance(key, str) or not key.strip() or key in _FILE_ENTRIES:
        raise UserError(f"{cls.__name__} (kind {kind!r}): a method must set metadata_key, the checkpoint metadata "
                        f"entry it writes and is found by (e.g. metadata_key: ClassVar[str] = 'amod.{kind}'), "
                        f"got {key!r}")
    taken = [c.kind for c in METHOD_CLASSES.values() if c.kind != kind  # (an older file's key counts: it still reads)
             and key in (getattr(c, "metadata_key", None), *getattr(c, "former_metadata_keys", ()))]
    if taken:
        raise UserError(f"{cls.__name__} (kind {kind!r}): metadata_key {key!r} is the {taken[0]} method's already; "
                        "give another")
    if getattr(cls.of_model, "__func__", None) is Method.of_model.__func__:
        raise UserError(f"{cls.__name__} (kind {kind!r}): a method must define of_model(model), how amod.method_of "
                        "finds it in a model its apply made: without it amod.save would write that model as the "
                        "dense one")
    behaviour = getattr(cls, "behaviour", None)
    if isinstance(behaviour, bool) or not isinstance(behaviour, int) or behaviour < 1:
        raise UserError(f"{cls.__name__} (kind {kind!r}): behaviour must be an integer >= 1 (the version of what the "
                        f"method computes), got {behaviour!r}")
    try:
        hints = typing.get_type_hints(cls)
    except Exception as e:  # (a hint naming what its module does not define)
        raise UserError(f"{cls.__name__} (kind {kind!r}): its type hints cannot be read ({type(e).__name__}: {e})") \
            from None
    for f in dataclasses.fields(cls):
        if not _settable(hints.get(f.name)):
            raise UserError(f"{cls.__name__} (kind {kind!r}): field {f.name}'s type {hints.get(f.name)!r} is not "
                            "one a spec can set: int, float, bool, str, None, their Optional and Union, tuple[X, "
                            "...], list[X] or a bare tuple or list")
    METHOD_CLASSES[kind] = cls
    return cls


def package_at_fault(tb: Optional[types.TracebackType]) -> Optional[str]:
    """Which registered method of another package than amod raised in a traceback, in words (``the toy-skip method
    of amod-toy-method 0.1``): the innermost frame that is in amod's code or in a module of such a method's package
    decides; None where it is amod's, or no such method's code is in the traceback."""
    amod_root = os.path.dirname(os.path.abspath(__file__))
    roots: dict[str, type[Method]] = {}
    for cls in METHOD_CLASSES.values():
        module = sys.modules.get(cls.__module__.partition(".")[0])
        file = getattr(module, "__file__", None)
        if file and not os.path.abspath(file).startswith(amod_root + os.sep):
            file = os.path.abspath(file)
            roots[os.path.dirname(file) if os.path.basename(file) == "__init__.py" else file] = cls
    if not roots:
        return None
    for frame, _ in reversed(list(traceback.walk_tb(tb))):
        filename = os.path.abspath(frame.f_code.co_filename)
        if filename.startswith(amod_root + os.sep):
            return None
        for root, cls in roots.items():
            if filename == root or filename.startswith(root + os.sep):
                provider = method_provider(cls)
                package = f"package {provider}" if provider is not None else f"module {cls.__module__}"
                return f"the {cls.kind} method of {package} ({os.path.basename(filename)}, line {frame.f_lineno})"
    return None


def _method_entry_points() -> Iterator[importlib.metadata.EntryPoint]:
    """The ``amod.methods`` entry points of every installed distribution but amod (whose methods register on
    import), one distribution of each name (the first on the path, the one Python imports); each keeps its
    distribution (``entry.dist``)."""
    seen = set()
    for dist in importlib.metadata.distributions():
        name = _normalized(dist.metadata["Name"] or "")
        if name in seen or name == "amod":
            continue
        seen.add(name)
        for entry in dist.entry_points:
            if entry.group == ENTRY_POINT_GROUP:
                yield entry


def _entry_point_text(entry: importlib.metadata.EntryPoint) -> str:
    package = f" of {entry.dist.name} {entry.dist.version}" if getattr(entry, "dist", None) is not None else ""
    return f"the {ENTRY_POINT_GROUP} entry point {entry.name} = {entry.value}{package}"


def load_method_plugins() -> None:
    """Register the methods of the installed packages' ``amod.methods`` entry points (once; the registry's lookups
    call it). An entry point that fails to load, names something that is not a method class or a module that
    registers one, or registers a kind another class has (a built-in's, or another package's) raises a UserError in
    one line naming it (and it is tried again at the next lookup)."""
    if _plugins["loaded"] or _plugins["loading"]:
        return
    _plugins["loading"] = True  # a plugin's module may consult the registry while it is imported
    try:
        for entry in _method_entry_points():
            dist = getattr(entry, "dist", None)
            provider = Provider(dist.name, dist.version) if dist is not None else None
            try:
                _loading_provider.extend([provider] if provider is not None else [])
                try:
                    loaded = entry.load()
                finally:
                    del _loading_provider[len(_loading_provider) - (provider is not None):]
                if isinstance(loaded, type) and issubclass(loaded, Method):
                    if provider is not None:
                        _ENTRY_PROVIDERS.setdefault(loaded, provider)
                    register_method(loaded)
                elif isinstance(loaded, types.ModuleType):
                    mine = [c for c in METHOD_CLASSES.values()
                            if c.__module__ == loaded.__name__ or c.__module__.startswith(loaded.__name__ + ".")]
                    if not mine:
                        raise UserError(f"module {loaded.__name__} registers no method (a module named there "
                                        "registers its classes with @amod.methods.register_method when imported)")
                    for c in mine:
                        if provider is not None:
                            _ENTRY_PROVIDERS.setdefault(c, provider)
                else:
                    raise UserError(f"it names {loaded!r}, which is neither an amod Method class nor a module that "
                                    "registers one")
            except UserError as e:
                raise UserError(f"{_entry_point_text(entry)}: {' '.join(str(e).split())}") from e
            except Exception as e:
                raise UserError(f"{_entry_point_text(entry)} failed to load "
                                f"({type(e).__name__}: {' '.join(str(e).split())})") from e
        _plugins["loaded"] = True
    finally:
        _plugins["loading"] = False


def registered_method(kind: str) -> Optional[type[Method]]:
    """The method class registered under ``kind`` (installed packages' methods included), or None."""
    load_method_plugins()
    return METHOD_CLASSES.get(kind)


def method_classes() -> tuple[type[Method], ...]:
    """The registered method classes in lookup order: as registered, ``Dense`` last."""
    load_method_plugins()
    classes = tuple(c for c in METHOD_CLASSES.values() if c is not Dense)
    return classes + (Dense,)


def metadata_keys() -> tuple[str, ...]:
    """The checkpoint metadata entries that name a method (a file names one at most; none: a dense model), those
    older files name one by (``former_metadata_keys``) included."""
    return tuple(key for cls in method_classes() if cls.metadata_key
                 for key in (cls.metadata_key, *cls.former_metadata_keys))


def file_metadata(method: "Method") -> dict[str, str]:
    """The metadata entries a file of a model running ``method`` holds for it: its kind under ``METHOD_ENTRY``, its
    own ``metadata()``, and (any method but dense) the version of its behaviour (``BEHAVIOUR_ENTRY``) and the package
    it comes from (``PROVIDER_ENTRY``, where one is installed)."""
    entries = {METHOD_ENTRY: method.kind, **method.metadata()}
    if not isinstance(method, Dense):
        entries[BEHAVIOUR_ENTRY] = str(type(method).behaviour)
        provider = method_provider(type(method))
        if provider is not None:
            entries[PROVIDER_ENTRY] = str(provider)
    return entries


def method_entries(meta: dict[str, str]) -> list[str]:
    """The entries of a file's metadata ``meta`` that hold a method's settings: the registered methods' keys, and any
    other ``amod.NAME`` entry (a method of a package not installed, in a file from before ``METHOD_ENTRY``; amod's
    other entries are ``amod.format``, ``amod.model`` and dotted ones such as ``amod.detect.step``)."""
    keys = metadata_keys()
    others = sorted(k for k in meta if k not in keys and k.startswith("amod.") and "." not in k[5:]
                    and k not in _FILE_ENTRIES)
    return [k for k in keys if k in meta] + others  # (in the registry's order)


def unregistered_method(meta: dict[str, str]) -> Optional[str]:
    """What names a method that no loaded package registers in a file's metadata ``meta`` (its ``METHOD_ENTRY``
    kind, or an unknown ``amod.NAME`` entry of an older file), in words; None when its method is known (or dense)."""
    kind = meta.get(METHOD_ENTRY)
    if kind is not None:
        return None if registered_method(kind) is not None else f"method {kind!r}"
    known = set(metadata_keys())
    unknown = [k for k in method_entries(meta) if k not in known]
    return f"method entry {unknown[0]!r}" if unknown else None


def unregistered_method_error(what: str, source: str) -> UserError:
    """The refusal of a file (``source``) whose metadata names a method that is not registered (``what``)."""
    return UserError(f"{source} was saved by {what}, which is not registered in this amod: install (or import) the "
                     f"package that registers it (entry-point group {ENTRY_POINT_GROUP}); registered methods: "
                     f"{', '.join(method_kinds())}")


def behaviour_versions() -> dict[str, int]:
    """The behaviour version of every registered method but dense, by kind: what a documented measurement records
    it was measured with (tests/test_docs_measured.py says which documented numbers a bump makes stale)."""
    return {kind: cls.behaviour for kind, cls in METHOD_CLASSES.items() if cls is not Dense}


def file_method_class(meta: dict[str, str]) -> Optional[type[Method]]:
    """The registered class of the method a file's metadata ``meta`` names (its ``METHOD_ENTRY`` kind, or in a file
    from before that entry the class whose metadata entry it holds); None where it names none (dense) or one not
    registered."""
    kind = meta.get(METHOD_ENTRY)
    if kind is not None:
        return registered_method(kind)
    return next((c for c in method_classes() if c.metadata_key is not None
                 and any(k in meta for k in (c.metadata_key, *c.former_metadata_keys))), None)


def file_behaviour(cls: type[Method], meta: dict[str, str], source: str) -> Optional[int]:
    """The version of ``cls``'s behaviour that wrote a file (``BEHAVIOUR_ENTRY``, or where it records none the class's
    ``unrecorded_behaviour`` for a file of its age); None where that cannot be told."""
    text = meta.get(BEHAVIOUR_ENTRY)
    if text is None:
        return cls.unrecorded_behaviour[0 if METHOD_ENTRY in meta else 1]
    if not text.strip().isdigit() or int(text) < 1:
        raise UserError(f"{source}: its {BEHAVIOUR_ENTRY} entry must be a version number >= 1, got {text!r}")
    return int(text)


def _changes(cls: type[Method], since: int) -> str:
    return "; ".join(f"version {v}: {cls.behaviour_changes.get(v, 'not described')}"
                     for v in range(since + 1, cls.behaviour + 1))


def check_method_file(meta: dict[str, str], source: str) -> None:
    """Refuse, in one line naming ``source``, a file (its metadata ``meta``) that this amod would not rebuild into the
    model that was saved: its method is not registered, is another package's than the one registered under its kind
    (``PROVIDER_ENTRY``), or was written by another version of the method's behaviour (``BEHAVIOUR_ENTRY``; an older
    one cannot be run by the rule it was measured with, a newer one is unknown here)."""
    what = unregistered_method(meta)
    if what is not None:
        raise unregistered_method_error(what, source)
    cls = file_method_class(meta)
    if cls is None or cls is Dense:
        return
    recorded, provider = meta.get(PROVIDER_ENTRY), method_provider(cls)
    if recorded and provider is not None and not Provider.parse(recorded).same_package(provider):
        raise UserError(f"{source} was saved by the {cls.kind} method of {recorded}; here {cls.kind!r} is "
                        f"{_described(cls)}, another method: open it where {Provider.parse(recorded).name} is "
                        "installed instead")
    version = file_behaviour(cls, meta, source)
    again = "make the model again with this amod, or open the file with the amod that wrote it"
    if version is None:
        raise UserError(f"{source} holds a {cls.kind} model from before files recorded a method's behaviour (no "
                        f"{METHOD_ENTRY} entry), when {cls.kind} ran more than one rule ({_changes(cls, 1)}); which "
                        f"one wrote it cannot be told, and this amod runs version {cls.behaviour}: {again}")
    if version < cls.behaviour:
        raise UserError(f"{source} holds a {cls.kind} model of behaviour version {version}; this amod runs version "
                        f"{cls.behaviour} ({_changes(cls, version)}), which would not compute the model that was "
                        f"saved: {again}")
    if version > cls.behaviour:
        owner = provider.name if provider is not None else "the package that registers it"
        raise UserError(f"{source} holds a {cls.kind} model of behaviour version {version}, newer than this amod's "
                        f"{cls.kind} (version {cls.behaviour}): upgrade {owner} to open it")


@dataclass(frozen=True)
class Dense(Method):
    """The dense model as it is: no settings, no metadata entry of its own (a file of it names ``dense``)."""

    kind: ClassVar[str] = "dense"
    metadata_key: ClassVar[Optional[str]] = None

    def apply(self, model: nn.Module) -> nn.Module:
        return model

    def label(self) -> str:
        return "dense"

    def setting_text(self) -> str:
        return "–"



METHOD_CLASSES[Dense.kind] = Dense  # the one method without settings or a metadata entry (register_method asks one)

# what the near-tie grid changed, in every method that chooses tokens on scores
NEAR_TIE_GRID = ("every choice made on scores rounded to a grid, near-ties broken by position "
                 "(amod.tokens.decision_key, amod 52c60d6)")


@register_method
@dataclass(frozen=True)
class MoD(Method):
    """Mixture-of-Depths: ``amod.convert`` with these arguments (and its defaults, ``MoDConfig``'s)."""

    kind: ClassVar[str] = "mod"
    setting_fields: ClassVar[tuple[str, ...]] = ("capacity",)
    metadata_key: ClassVar[Optional[str]] = "amod.mod"
    behaviour: ClassVar[int] = 2
    behaviour_changes: ClassVar[dict[int, str]] = {2: NEAR_TIE_GRID}
    unrecorded_behaviour: ClassVar[tuple[Optional[int], Optional[int]]] = (2, None)
    router: str = MoDConfig.router
    capacity: float = MoDConfig.capacity
    layers: Layers = None  # None: the skipped mode's default_layers ("all" for fold, "alternate" otherwise)
    scale_output: Optional[bool] = None  # None: the router's default_scale_output
    seed: int = MoDConfig.seed  # the router's seed (in a run: 0 leaves it to the run's --seed)
    skipped: str = MoDConfig.skipped
    protect: float = MoDConfig.protect  # fold only
    shape: Optional[tuple[float, ...]] = None  # fold only: one capacity exponent per block (``amod.calibrate``)

    def check(self) -> None:
        validate_router(self.router)
        validate_capacity(self.capacity)
        validate_skipped(self.skipped)
        validate_protect(self.protect)
        validate_shape(self.shape)  # (its length: when it converts a model)
        if isinstance(self.layers, str) and self.layers not in LAYER_PRESETS:
            raise UserError(f"mod: layers must be one of {', '.join(LAYER_PRESETS)} or a list of block indices, got "
                            f"{self.layers!r}")
        if self.skipped != "fold":  # fold's settings would be dropped without a word by another mode
            given = [f"{name}={_spec_value(getattr(self, name))}" for name, default in
                     (("protect", MoDConfig.protect), ("shape", None)) if getattr(self, name) != default]
            if given:
                raise UserError(f"mod: {' and '.join(given)} set{'s' if len(given) == 1 else ''} what "
                                f"skipped=fold protects and folds; skipped={self.skipped} has neither: give "
                                "skipped=fold or drop it")

    def __repr__(self) -> str:
        # shape is named only when set: a plain MoD keeps the repr that finished measurements are keyed by
        shown = [f for f in dataclasses.fields(self) if f.name != "shape" or self.shape is not None]
        return f"MoD({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in shown)})"

    def seeded(self, seed: int) -> "MoD":
        return self if self.seed else dataclasses.replace(self, seed=seed)  # (0: the run's seed)

    def apply(self, model: nn.Module) -> nn.Module:
        layers = _as_list(self.layers)
        return convert(model, router=self.router, capacity=self.capacity, layers=layers, scale_output=self.scale_output,
                       seed=self.seed, skipped=self.skipped, protect=self.protect, shape=_as_list(self.shape))

    def label(self) -> str:
        return (f"{self.router}@{self.capacity:g}" + ("" if self.skipped == "bypass" else f" skipped={self.skipped}")
                + (" shaped" if self.shape is not None else ""))

    def setting_text(self) -> str:
        layers = blocks = _as_list(self.layers)
        if isinstance(layers, list) and layers == list(range(layers[0], layers[-1] + 1)) and len(layers) > 2:
            layers = f"{layers[0]}–{layers[-1]}"
        text = f"C = {self.capacity:.3f}, blocks {layers}"
        if self.skipped != "bypass":
            text += f", skipped={self.skipped}"
        if self.skipped == "fold":
            text += f", protect {self.protect:g}" + ("" if self.router == "attention" else f" ({self.router})")
        shape = list(self.shape or [])
        if shape and 0 in shape and isinstance(blocks, list):  # a stage schedule: the blocks that reduce
            stages = [(block, w) for block, w in zip(blocks, shape) if w != 0]
            text += f", reduces in blocks {', '.join(str(block) for block, _ in stages)}"
            if any(w != 1 for _, w in stages):
                text += f", shape {stages[0][1]:.2f}…{stages[-1][1]:.2f}"
        elif shape:  # a calibrated schedule: the first and last blocks' exponents
            text += f", shape {shape[0]:.2f}…{shape[-1]:.2f}"
        return text

    def metadata(self) -> dict[str, str]:
        # the MoDConfig's JSON for a model's (resolved) method; None, a preset name where they are given
        return {self.metadata_key: json.dumps({f.name: _as_list(getattr(self, f.name))
                                               for f in dataclasses.fields(self)}, sort_keys=True)}

    @classmethod
    def from_metadata(cls, meta: dict[str, str]) -> Optional["MoD"]:
        data = cls.stored_settings(meta)
        if data is None:
            return None
        config = MoDConfig.from_dict(data)  # (refuses keys it does not know)
        if isinstance(config.layers, list) and isinstance(config.scale_output, bool):
            return cls._of_config(config)  # a model's: what every file holds
        return cls(**{k: _as_tuple(v) for k, v in data.items()})  # a method's, as given (resolved when applied)

    @classmethod
    def of_model(cls, model: nn.Module) -> Optional["MoD"]:
        config = getattr(model, "amod_config", None)
        return None if config is None else cls._of_config(config)

    @classmethod
    def _of_config(cls, config: MoDConfig) -> "MoD":
        fields = {**dataclasses.asdict(config), "layers": tuple(config.layers), "shape": _as_tuple(config.shape)}
        if fields["skipped"] != "fold":  # (amod.convert takes a protect for any mode; only fold reads it)
            fields["protect"] = MoDConfig.protect
        return cls(**fields)

    def at_cost(self, dense: nn.Module, cost: float, images: Optional[torch.Tensor] = None) -> "MoD":
        # converted at full capacity (below a fold model's floor it would warn): the capacity is searched for
        model = dataclasses.replace(self, capacity=1.0).apply(weightless_copy(dense))
        return dataclasses.replace(MoD.of_model(model), capacity=capacity_for_cost(model, cost))


def _one_of(kind: str, method: Method, names: tuple[str, str], meanings: tuple[str, str]) -> None:
    """Refuse ``method`` where both of the fields ``names`` (one setting, two ways) are given."""
    if all(getattr(method, n) is not None for n in names):
        given = ", ".join(f"{n}={_spec_value(getattr(method, n))}" for n in names)
        raise UserError(f"{kind}: give {names[0]} ({meanings[0]}) or {names[1]} ({meanings[1]}), not both; got "
                        f"{given}")


def _merging_metadata(fields: dict[str, Any]) -> str:
    """A token-merging method's metadata entry: the fields that are set."""
    return json.dumps({k: _as_list(v) for k, v in fields.items() if v is not None})


@register_method
@dataclass(frozen=True)
class TokenMerging(Method):
    """Token merging (ToMe): ``r`` tokens merged per block (an int or one per block), or ``cost``."""

    kind: ClassVar[str] = "tome"
    setting_fields: ClassVar[tuple[str, ...]] = ("r", "cost")
    metadata_key: ClassVar[Optional[str]] = "amod.tome"
    # older files name ToMe "amod.merge", which is also the name of a skipped mode: read, never written
    former_metadata_keys: ClassVar[tuple[str, ...]] = ("amod.merge",)
    behaviour: ClassVar[int] = 2
    behaviour_changes: ClassVar[dict[int, str]] = {2: NEAR_TIE_GRID}
    unrecorded_behaviour: ClassVar[tuple[Optional[int], Optional[int]]] = (2, None)
    r: Optional[Union[int, tuple[int, ...]]] = None
    cost: Optional[float] = None

    def check(self) -> None:
        _one_of(self.kind, self, ("r", "cost"), ("tokens merged per block", "a share of the dense MACs"))
        if self.cost is not None:
            validate_cost(self.cost, f"{self.kind}: cost")

    def apply(self, model: nn.Module) -> nn.Module:
        r = _as_list(self.r)
        return tome.apply(model, r=r, cost=self.cost)

    def label(self) -> str:
        if self.cost is not None:
            return f"tome@{self.cost:g}"
        return f"tome r={_as_list(self.r)}"

    def setting_text(self) -> str:
        if self.r is None and self.cost is None:
            return self.spec()  # not set yet
        return f"r = {_as_list(self.r)}" if self.r is not None else f"cost {self.cost:g}"

    def metadata(self) -> dict[str, str]:
        # a model's schedule under "schedule", the name files have always had; a cost where one is given
        return {self.metadata_key: _merging_metadata({"schedule": self.r, "cost": self.cost})}

    @classmethod
    def from_metadata(cls, meta: dict[str, str]) -> Optional["TokenMerging"]:
        data = cls.stored_settings(meta)
        if data is None:
            return None
        return cls(r=_as_tuple(data.get("schedule")), cost=data.get("cost"))

    @classmethod
    def of_model(cls, model: nn.Module) -> Optional["TokenMerging"]:
        merging = getattr(model, "amod_tome", None)
        return None if merging is None else cls(r=tuple(merging.schedule))

    def at_cost(self, dense: nn.Module, cost: float, images: Optional[torch.Tensor] = None) -> "TokenMerging":
        return TokenMerging(r=tuple(tome.schedule_for_cost(dense, cost, tolerance=1.0)))  # closest; a miss is flagged


@register_method
@dataclass(frozen=True)
class PiToMe(Method):
    """PiToMe (``amod.pitome``): every block keeps the share ``keep`` of its patch tokens, or ``cost``."""

    kind: ClassVar[str] = "pitome"
    setting_fields: ClassVar[tuple[str, ...]] = ("keep", "cost")
    metadata_key: ClassVar[Optional[str]] = "amod.pitome"
    behaviour: ClassVar[int] = 3
    behaviour_changes: ClassVar[dict[int, str]] = {
        2: "the public algorithm's schedule: the first half of the blocks match every token, margin 0.75 - 0.75 l/L "
           "(amod 838defc)",
        3: NEAR_TIE_GRID}
    unrecorded_behaviour: ClassVar[tuple[Optional[int], Optional[int]]] = (3, None)
    keep: Optional[float] = None
    cost: Optional[float] = None

    def check(self) -> None:
        _one_of(self.kind, self, ("keep", "cost"), ("the share of its patch tokens each block keeps",
                                                    "a share of the dense MACs"))
        if self.cost is not None:
            validate_cost(self.cost, f"{self.kind}: cost")

    def apply(self, model: nn.Module) -> nn.Module:
        return pitome.apply(model, keep=self.keep, cost=self.cost)

    def label(self) -> str:
        return f"pitome@{self.cost:g}" if self.cost is not None else f"pitome keep={self.keep:g}"

    def setting_text(self) -> str:
        if self.keep is None and self.cost is None:
            return self.spec()  # not set yet
        return f"keep {self.keep:g} a block" if self.keep is not None else f"cost {self.cost:g}"

    def metadata(self) -> dict[str, str]:
        return {self.metadata_key: _merging_metadata({"keep": self.keep, "cost": self.cost})}

    @classmethod
    def from_metadata(cls, meta: dict[str, str]) -> Optional["PiToMe"]:
        data = cls.stored_settings(meta)
        if data is None:
            return None
        keep, cost = data.get("keep"), data.get("cost")
        return cls(keep=None if keep is None else float(keep), cost=None if cost is None else float(cost))

    @classmethod
    def of_model(cls, model: nn.Module) -> Optional["PiToMe"]:
        config = getattr(model, "amod_pitome", None)
        return None if config is None else cls(keep=config.keep)

    def at_cost(self, dense: nn.Module, cost: float, images: Optional[torch.Tensor] = None) -> "PiToMe":
        model = PiToMe(keep=1.0).apply(weightless_copy(dense))
        return PiToMe(keep=pitome.keep_for_cost(model, cost, tolerance=1.0))  # closest; a miss is flagged


@register_method
@dataclass(frozen=True)
class IsoFLOP(Method):
    """The dense baseline of an MoD setup: fewer blocks, the MoD model's cost (``amod.isoflop_baseline``). A file of
    one is a dense model of the fewer blocks (its description) with this method's metadata, which marks it."""

    kind: ClassVar[str] = "isoflop"
    metadata_key: ClassVar[Optional[str]] = "amod.isoflop"
    router: str = MoDConfig.router
    capacity: float = MoDConfig.capacity
    layers: Layers = DEFAULT_LAYERS  # the default MoD setup's ("alternate")

    def apply(self, model: nn.Module) -> nn.Module:
        layers = _as_list(self.layers)
        return isoflop_baseline(model, self.capacity, layers=layers or DEFAULT_LAYERS, router=self.router)

    def restore(self, model: nn.Module) -> nn.Module:
        # the file's description is of the fewer blocks already: marked, not cut again
        model.amod_isoflop = {"router": self.router, "capacity": self.capacity, "layers": _as_list(self.layers)}
        return model

    @classmethod
    def of_model(cls, model: nn.Module) -> Optional["IsoFLOP"]:
        setup = getattr(model, "amod_isoflop", None)
        if setup is None or "router" not in setup:
            return None
        return cls(router=setup["router"], capacity=setup["capacity"], layers=_as_tuple(setup["layers"]))

    def label(self) -> str:
        return f"isoflop@{self.capacity:g}"

    def setting_text(self) -> str:
        return f"isoFLOP of C = {self.capacity:.3f}, blocks {_as_list(self.layers)}"




@register_method
@dataclass(frozen=True)
class Calibrated(Method):
    """A-MoD fold on the per-block schedule (and protection) that ``amod.calibrate`` chooses at a cost on unlabeled
    images: ``at_cost(dense, cost, images)`` is the calibrated ``MoD`` (with its ``shape``). It runs only once set to
    a cost; its ``router`` decides what is protected (``"random"``: the control); ``stages``: the tokens fold in that
    many blocks only (``amod.calibrate``'s stage schedules), None: in every block. A model it makes runs that ``MoD``
    (``method_of``), which its file names; this method's own metadata (its fields) reads back as itself, and a file
    of it is refused as ``apply`` is."""

    kind: ClassVar[str] = "calibrated"
    metadata_key: ClassVar[Optional[str]] = "amod.calibrated"
    needs_images: ClassVar[bool] = True
    router: str = MoDConfig.router
    protects: tuple[float, ...] = DEFAULT_PROTECTS
    tilts: tuple[float, ...] = DEFAULT_TILTS
    stages: Optional[int] = None

    def check(self) -> None:
        validate_calibration_router(self.router)
        validate_protects(self.protects)
        validate_tilts(self.tilts)
        validate_stages(self.stages)

    def __repr__(self) -> str:
        # stages is named only when set: the calibrations measured before it are keyed by the repr of before
        shown = [f for f in dataclasses.fields(self) if f.name != "stages" or self.stages is not None]
        return f"Calibrated({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in shown)})"

    @classmethod
    def of_model(cls, model: nn.Module) -> None:
        return None  # a model it makes runs an MoD, which method_of finds (and its file names)

    def apply(self, model: nn.Module) -> nn.Module:
        raise UserError(f"{self.spec()} chooses its schedule at a cost on unlabeled images: set it to a cost first "
                        "(at_cost with images; amod calibrate saves a calibrated model to start from)")

    def at_cost(self, dense: nn.Module, cost: float, images: Optional[torch.Tensor] = None) -> MoD:
        return self.calibrated(dense, cost, images)[0]

    def calibrated(self, dense: nn.Module, cost: float, images: Optional[torch.Tensor],
                   closest: bool = True) -> tuple[MoD, dict[str, Any]]:
        """The method at ``cost`` (``amod.calibrate`` on a copy of ``dense``) and what the calibration tried and
        chose (the frontier's report): seconds, images, the chosen candidate's index and every candidate.
        ``closest``: where no candidate comes within the cost tolerance, take the closest (a sweep flags the miss)
        rather than refuse."""
        if images is None:
            raise UserError(f"{self.spec()} is set to a cost on unlabeled images; give images")
        model = calibrate(copy.deepcopy(dense), images, cost, router=self.router, tilts=self.tilts,
                          protects=self.protects, closest=closest, stages=self.stages)
        return MoD.of_model(model), model.amod_calibration.report()


def cost_of(method: Method, dense: nn.Module, img_size=None) -> float:
    """``method``'s cost as a share of the dense model's MACs (priced on a weightless copy)."""
    return method.cost_of(dense, img_size)


def method_of(model: nn.Module) -> Method:
    """The method ``model`` runs (``Dense`` for a dense model)."""
    for cls in method_classes():
        method = cls.of_model(model)
        if method is not None:
            return method
    return Dense()


def apply_found(method: Method, model: nn.Module) -> nn.Module:
    """``method.apply(model)``, checked to make a model that ``method_of`` finds running ``method``'s kind, so that a
    file of it names that method (a method whose ``of_model`` misses its own models would be saved as another, or
    as the dense model); refused in one line otherwise."""
    model = method.apply(model)
    found = method_of(model)
    if found.kind != method.kind:
        raise UserError(f"{method.spec()}: amod.method_of finds {found.spec()} in the model its apply made, so a file "
                        f"of it would be saved as {found.kind}: its class {type(method).__name__}'s of_model must "
                        "find it")
    return model


def method_from_metadata(meta: dict[str, str]) -> Method:
    """The method a checkpoint's metadata names: its ``METHOD_ENTRY`` kind read by that class, or (a file from before
    that entry) the registered method whose ``metadata_key`` entry it holds; ``Dense`` when it names none. Metadata
    that names a method not registered raises a ValueError naming it (never a dense model)."""
    check_method_file(meta, "the file")
    kind = meta.get(METHOD_ENTRY)
    if kind is not None:
        cls = registered_method(kind)
        method = Dense() if cls is Dense else cls.from_metadata(meta)
        if method is None:
            raise UserError(f"the file names method {kind!r} but holds no {cls.metadata_key} entry for its settings")
        return method
    for cls in method_classes():
        method = cls.from_metadata(meta)
        if method is not None:
            return method
    return Dense()


# ---------------------------------------------------------------- shorthand: options that build a method

@dataclass(frozen=True)
class Shorthand:
    """An option that sets one field of a built-in method: ``--capacity 0.5`` is ``mod:capacity=0.5``. The command
    line's method flags are these (``amod train --router attention --capacity 0.5``), and so are the fields that run
    configurations, report rows and checkpoints held before a run's method was its spec alone."""

    name: str  # the option: its flag is --name with dashes, and older files hold it under this name
    kind: str  # the method it sets a field of
    field: Optional[str]  # that field (None: the option is a switch that makes the MoD setup this method, --isoflop)
    selects: bool  # giving it selects its method (--router, --tome-cost); the others adjust a selected one
    help: str
    choices: Optional[Any] = None  # a function giving the allowed values, where the registry limits them


SHORTHANDS: tuple[Shorthand, ...] = (
    Shorthand("router", "mod", "router", True, "Mixture-of-Depths, its tokens ranked by this router",
              vit_routers),
    Shorthand("capacity", "mod", "capacity", False, f"share of patch tokens an MoD block processes (default "
              f"{MoDConfig.capacity})"),
    Shorthand("layers", "mod", "layers", False, "alternate | later | last-two-thirds | all | 1,3,5 (default: all for --skipped fold, "
              "alternate otherwise)"),
    Shorthand("scale_output", "mod", "scale_output", False, "true | false: scale a processed token's block output by "
              "its router gate (default: per router)"),
    Shorthand("router_seed", "mod", "seed", False, "seed of a router that draws (default: --seed)"),
    Shorthand("skipped", "mod", "skipped", False, f"what MoD blocks do with skipped tokens (default "
              f"{MoDConfig.skipped})", lambda: tuple(skipped_mode_names())),
    Shorthand("protect", "mod", "protect", False, f"--skipped fold: share of a fold block's patch tokens the router "
              f"protects (default {MoDConfig.protect})"),
    Shorthand("shape", "mod", "shape", False, "--skipped fold: one capacity exponent per block, 1.6,1.4,...; block i "
              "keeps capacity ** w_i of its patch tokens (amod calibrate prints one; default: all 1)"),
    Shorthand("isoflop", "isoflop", None, False, "the dense isoFLOP baseline of --router/--capacity/--layers instead"),
    Shorthand("tome_cost", "tome", "cost", True, "token merging (ToMe): the share of the dense MACs to match, e.g. "
              "0.56"),
    Shorthand("tome_r", "tome", "r", True, "token merging (ToMe): tokens merged per block, 8 or 8,8,6,..."),
    Shorthand("pitome_cost", "pitome", "cost", True, "PiToMe: the share of the dense MACs to match, e.g. 0.56"),
    Shorthand("pitome_keep", "pitome", "keep", True, "PiToMe: the share of its patch tokens every block keeps"),
)
SHORTHAND_NAMES = tuple(s.name for s in SHORTHANDS)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def shorthand_type(shorthand: Shorthand) -> Any:
    """The type hint of the method field ``shorthand`` sets (bool for a switch)."""
    if shorthand.field is None:
        return bool
    return typing.get_type_hints(registered_method(shorthand.kind))[shorthand.field]


def parse_shorthand(shorthand: Shorthand, text: str) -> Any:
    """A flag's text as the value of the field it sets: as in a spec (``parse_method``), and lists also without
    brackets (``--layers 1,3,5``, ``--tome-r 8,8,6``; numbers are never a name: ``--layers 5`` is block 5). Raises a
    UserError saying what is allowed."""
    tp = shorthand_type(shorthand)
    text = text.strip()
    numbers = bool(text) and all(t.strip().lstrip("-").replace(".", "", 1).isdigit() for t in text.split(",")
                                 if t.strip())
    if text.startswith("[") or not numbers:
        candidates = [text]
    else:
        candidates = [f"[{text}]"] if "," in text else [text, f"[{text}]"]
    for candidate in candidates:
        try:
            value = _parse_value(candidate, tp)
        except ValueError:
            continue
        if not (numbers and isinstance(value, str)):
            return value
    raise UserError(f"{_flag(shorthand.name)} must be {_type_name(tp)}, got {text!r}")


def method_from_shorthand(values: dict[str, Any], lenient: bool = False) -> Optional[Method]:
    """The method that shorthand options select (``SHORTHANDS``, by name; None values count as not given), or None
    where none selects one. Refuses, in one line naming the options, two methods, an option of another method than
    the one selected, and --isoflop without --router; the method's own ``check`` refuses bad values.

    ``lenient``: read the fields an older run configuration or report row holds, where every option is present at
    its default: options of a method not selected are dropped, as that code dropped them, and so are fold's options
    of another skipped mode and the skipped mode's default layers (written out by that code)."""
    given = {s.name: values[s.name] for s in SHORTHANDS  # (a switch given as false is not given)
             if values.get(s.name) is not None and not (s.field is None and values[s.name] is False)}
    kinds = list(dict.fromkeys(s.kind for s in SHORTHANDS if s.selects and s.name in given))
    if "isoflop" in given:
        if "mod" not in kinds:
            raise UserError("--isoflop needs the MoD setup to match: give --router, --capacity and --layers")
        kinds[kinds.index("mod")] = "isoflop"
    if len(kinds) > 1:
        raise UserError(" and ".join(", ".join(_flag(s.name) for s in SHORTHANDS if s.name in given and s.selects
                                               and (s.kind == k or (k == "isoflop" and s.kind == "mod")))
                                     for k in kinds) + " select two methods; give the options of one")
    if not kinds:
        return None
    cls = registered_method(kinds[0])
    names = {f.name for f in dataclasses.fields(cls)}
    fields, foreign = {}, []
    for s in SHORTHANDS:
        if s.name not in given or s.field is None:
            continue
        if s.field in names and (s.kind == cls.kind or cls.kind == "isoflop"):
            fields[s.field] = _as_tuple(given[s.name])
        else:
            foreign.append(_flag(s.name))
    if foreign and not lenient:
        raise UserError(f"{', '.join(foreign)} {'does' if len(foreign) == 1 else 'do'} not apply to "
                        f"{cls.kind} ({', '.join(_flag(s.name) for s in SHORTHANDS if s.selects and s.name in given)})")
    if lenient and cls is MoD:
        skipped = fields.get("skipped", MoDConfig.skipped)
        if skipped != "fold":
            fields.pop("protect", None)
            fields.pop("shape", None)
        if fields.get("layers") == skipped_mode(skipped).default_layers:
            fields.pop("layers")
    return cls(**fields)


def with_shorthand(method: Method, options: dict[str, Any]) -> Method:
    """``method`` with the fields that the shorthand ``options`` (by name; None: not given) set: each sets the field
    of its name (``--capacity 0.25`` on ``mod:capacity=0.125``, ``--router random`` on ``calibrated``); an option
    that names no field of ``method`` is refused in one line."""
    given = [s for s in SHORTHANDS if options.get(s.name) is not None]
    names = {f.name for f in dataclasses.fields(method)}
    foreign = [_flag(s.name) for s in given if s.field not in names]
    if foreign:
        raise UserError(f"{', '.join(foreign)} {'does' if len(foreign) == 1 else 'do'} not apply to {method.spec()}")
    return dataclasses.replace(method, **{s.field: _as_tuple(options[s.name]) for s in given})


def setting_text_of(setting: Union[str, dict[str, Any]]) -> str:
    """A report's setting column for a row's ``setting``: the spec of the method it measured, or (a row written before
    rows held specs) the shorthand options of it; the method is rebuilt and asked for its ``setting_text``."""
    if isinstance(setting, str):
        return parse_method(setting).setting_text()
    if setting.get("method_spec"):
        return parse_method(setting["method_spec"]).setting_text()
    return (method_from_shorthand(setting, lenient=True) or Dense()).setting_text()


# ---------------------------------------------------------------- spec strings: KIND:FIELD=VALUE,...

def _spec_value(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_spec_value(v) for v in value) + "]"
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _type_name(tp: Any) -> str:
    names = {int: "an integer", float: "a number", str: "a name", bool: "true or false", type(None): "none"}
    if tp in names:
        return names[tp]
    if tp in (tuple, list):
        return "a list [...]"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if _is_union(origin):
        return " or ".join(_type_name(a) for a in args)
    if origin in (list, tuple):
        return f"a list [{_type_name(args[0])}, ...]"
    return getattr(tp, "__name__", str(tp))


def _split(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    parts, depth, current = [], 0, ""
    for c in text:
        depth += {"[": 1, "]": -1}.get(c, 0)
        if c == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += c
    return parts + [current]


def _parse_value(text: str, tp: Any) -> Any:
    """``text`` as a value of the type hint ``tp``; raises ValueError where it is not one."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    text = text.strip()
    if tp in (tuple, list):  # a bare tuple or list: items of any plain type
        origin, args = tp, (_ANY_ITEM,)
    if _is_union(origin):
        for option in sorted(args, key=lambda a: a is str):  # a name last: "[1,3]" is a list, not a name
            try:
                return _parse_value(text, option)
            except ValueError:
                pass
        raise UserError(text)
    if tp is type(None):
        if text.lower() in ("none", "null"):
            return None
        raise UserError(text)
    if tp is bool:
        if text.lower() in ("true", "yes", "1", "on"):
            return True
        if text.lower() in ("false", "no", "0", "off"):
            return False
        raise UserError(text)
    if tp is int:
        return int(text)
    if tp is float:
        value = float(text)
        if not math.isfinite(value):
            raise UserError(text)
        return value
    if tp is str:
        if not text or any(c in text for c in "[],="):
            raise UserError(text)
        return text
    if origin in (list, tuple):
        if not (text.startswith("[") and text.endswith("]")):
            raise UserError(text)
        inner = text[1:-1].strip()
        return tuple(_parse_value(v, args[0]) for v in (_split(inner) if inner else []))
    raise UserError(text)


def method_kinds(strict: bool = True) -> tuple[str, ...]:
    """The kinds of the registered methods (what a spec starts with). ``strict=False``: where an installed package's
    entry point fails to load, the kinds registered without it rather than its ValueError (for a help line: the
    command refuses in one line when it reads the registry)."""
    try:
        load_method_plugins()
    except ValueError:
        if strict:
            raise
    return tuple(METHOD_CLASSES)


def parse_method(text: str) -> Method:
    """The registered method a spec string selects: ``KIND`` or ``KIND:FIELD=VALUE,FIELD=VALUE``, each value read by
    the field's type (numbers, ``true``/``false``, ``none``, names, lists in brackets: ``layers=[1,3]``); fields
    not given keep their defaults. E.g. ``tome:cost=0.5``, ``pitome:keep=0.7``,
    ``mod:router=attention,capacity=0.5,skipped=fold``. Raises ValueError naming the kind or field and what is
    allowed."""
    kind, _, body = text.strip().partition(":")
    cls = registered_method(kind.strip())
    if cls is None:
        raise UserError(f"unknown method {kind.strip()!r} in {text!r}; registered methods: "
                        f"{', '.join(method_kinds())}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    values: dict[str, Any] = {}
    for item in (_split(body) if body.strip() else []):
        name, eq, value = item.partition("=")
        name = name.strip()
        if not eq:
            raise UserError(f"{kind}: expected FIELD=VALUE, got {item.strip()!r} in {text!r}")
        if name not in names:
            raise UserError(f"{kind} has no field {name!r}; its fields: {', '.join(names) or 'none'}")
        if name in values:
            raise UserError(f"{kind}: {name} is given twice in {text!r}")
        try:
            values[name] = _parse_value(value, hints[name])
        except ValueError:
            raise UserError(f"{kind}: {name} must be {_type_name(hints[name])}, got {value.strip()!r}") from None
    return cls(**values)
