"""What a model runs, and the open registry of methods: the ``Method`` contract, ``@register_method``, the lookups
(``method_of``, ``method_from_metadata``, ``check_method_file``) and the spec grammar ``KIND:FIELD=VALUE,...``
(``parse_method``, ``Method.spec``). It holds no method but ``Dense``, the fallback (a model that runs none).

Each method is one class, registered with ``@register_method`` under its ``kind`` in the module of its mechanism:
``MoD`` in ``amod.mod.convert``, ``IsoFLOP`` in ``amod.mod.isoflop``, ``Calibrated`` in ``amod.mod.calibrate``,
``TokenMerging`` in ``amod.tome.merging``, ``PiToMe`` in ``amod.tome.pitome``, ``PPT`` in ``amod.ppt``. A class knows
how to turn a dense timm ViT into itself (``apply``), price itself (``cost_of``), name itself in reports (``label``,
``setting_text``), the checkpoint metadata (``metadata_key``, ``metadata``, ``from_metadata``), how to find itself in
a model (``of_model``) and how to set itself to a share of the dense model's MACs (``at_cost``; a method with
``needs_images`` chooses its setting on unlabeled images given there).

amod's own methods register when ``amod`` is imported, found without a list: every module of the package whose
source registers a method (a line ``@register_method``) is imported (``load_builtin_methods``), so a new built-in is
one module. An installed package makes its methods known through the entry-point group ``amod.methods``
(``ENTRY_POINT_GROUP``), loaded the first time the registry is consulted. A file names the method that wrote it
(``METHOD_ENTRY``); one whose method is not registered is refused, never opened as a dense model. The command line's
older method options (``--router``, ``--tome-cost``, ...) are ``amod.shorthand``'s.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import math
import os
import re
import sys
import traceback
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator, Optional, Union

import torch
from torch import nn

from .family import weightless_copy
from .cost import flops
from .errors import UserError


def as_list(value: Any) -> Any:
    """A tuple as a list (what configurations and ``amod.convert`` take); anything else as it is."""
    return list(value) if isinstance(value, tuple) else value


def as_tuple(value: Any) -> Any:
    """A list as a tuple (what the frozen method dataclasses hold, hashable); anything else as it is."""
    return tuple(value) if isinstance(value, list) else value


def _is_union(origin: Any) -> bool:
    return origin is Union or (sys.version_info >= (3, 10) and origin is types.UnionType)


# the items of a bare ``tuple`` or ``list`` field: each read as the first of these it parses as
_ANY_ITEM = Union[int, float, bool, str]


def _settable(tp: Any) -> bool:
    """Whether a spec string can set a field of type hint ``tp`` (``parse_value`` reads it)."""
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
        given = [f"{f.name}={spec_value(getattr(self, f.name))}" for f in dataclasses.fields(self)
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
        return {self.metadata_key: json.dumps({f.name: as_list(getattr(self, f.name))
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
        return cls(**{k: as_tuple(v) for k, v in data.items()})

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
        return [f"{f.name}={spec_value(getattr(self, f.name))}" for f in dataclasses.fields(self)
                if f.name in names and getattr(self, f.name) != f.default]

    def seeded(self, seed: int) -> "Method":
        """This method as a run seeded with ``seed`` runs it: a method that draws (a random router) and leaves its
        own seed unset takes the run's; any other is returned as it is."""
        return self


# The registered method classes by kind (``method_classes``: in lookup order, ``Dense``, the fallback, last).
# ``register_method`` adds to it; the lookups below (``method_classes``, ``method_kinds``, ``parse_method``,
# ``method_from_metadata``) first load amod's own methods and the installed packages'.
METHOD_CLASSES: dict[str, type[Method]] = {}

# the entry-point group through which an installed package registers methods: ``NAME = module`` (importing the module
# registers them with ``@register_method``) or ``NAME = module:Class`` (that class, registered if it is not yet).
# amod's own methods register when amod is imported (``load_builtin_methods``); the group is for other packages.
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
_builtins = {"loaded": False}


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


# a module that registers a method: one with a line that starts with the decorator (not a mention in a docstring)
_REGISTERS = re.compile(r"^@register_method\b", re.MULTILINE)


def builtin_method_modules() -> list[str]:
    """The modules of the ``amod`` package that register methods, by name, in path order: every one whose source has a
    line starting ``@register_method``. Read from the source tree, so that a new built-in method is its own module
    and no list names it."""
    root = os.path.dirname(os.path.abspath(__file__))
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            with open(path, encoding="utf-8") as f:
                if not _REGISTERS.search(f.read()):
                    continue
            parts = os.path.relpath(path, root)[:-3].split(os.sep)
            found.append(".".join([__name__.rpartition(".")[0], *(parts[:-1] if parts[-1] == "__init__" else parts)]))
    return found


def load_builtin_methods() -> None:
    """Import amod's modules that register methods (``builtin_method_modules``; once: ``import amod`` and the
    registry's lookups call it), so that every built-in is registered whichever of amod's modules was imported."""
    if _builtins["loaded"]:
        return
    _builtins["loaded"] = True  # (set first: a module imported here may consult the registry)
    for name in builtin_method_modules():
        importlib.import_module(name)


def load_method_plugins() -> None:
    """Register the methods of the installed packages' ``amod.methods`` entry points (once; the registry's lookups
    call it). An entry point that fails to load, names something that is not a method class or a module that
    registers one, or registers a kind another class has (a built-in's, or another package's) raises a UserError in
    one line naming it (and it is tried again at the next lookup)."""
    load_builtin_methods()
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


def _builtin(cls: type[Method]) -> bool:
    return cls.__module__.partition(".")[0] == __name__.partition(".")[0]


def method_classes() -> tuple[type[Method], ...]:
    """The registered method classes in lookup order: amod's own by kind, then other packages' as registered,
    ``Dense`` last. (An order that does not hang on which module was imported first: the lookups ask each class in
    turn, and a model or file is any one method's only.)"""
    load_method_plugins()
    return _in_lookup_order()


def _in_lookup_order() -> tuple[type[Method], ...]:
    classes = [c for c in METHOD_CLASSES.values() if c is not Dense]
    ours = sorted((c for c in classes if _builtin(c)), key=lambda c: c.kind)
    return (*ours, *(c for c in classes if not _builtin(c)), Dense)


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
    load_builtin_methods()
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


def refuse_both(kind: str, method: Method, names: tuple[str, str], meanings: tuple[str, str]) -> None:
    """Refuse ``method`` where both of the fields ``names`` (one setting, two ways) are given."""
    if all(getattr(method, n) is not None for n in names):
        given = ", ".join(f"{n}={spec_value(getattr(method, n))}" for n in names)
        raise UserError(f"{kind}: give {names[0]} ({meanings[0]}) or {names[1]} ({meanings[1]}), not both; got "
                        f"{given}")

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

# ---------------------------------------------------------------- spec strings: KIND:FIELD=VALUE,...

def spec_value(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(spec_value(v) for v in value) + "]"
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def type_name(tp: Any) -> str:
    names = {int: "an integer", float: "a number", str: "a name", bool: "true or false", type(None): "none"}
    if tp in names:
        return names[tp]
    if tp in (tuple, list):
        return "a list [...]"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if _is_union(origin):
        return " or ".join(type_name(a) for a in args)
    if origin in (list, tuple):
        return f"a list [{type_name(args[0])}, ...]"
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


def parse_value(text: str, tp: Any) -> Any:
    """``text`` as a value of the type hint ``tp``; raises ValueError where it is not one."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    text = text.strip()
    if tp in (tuple, list):  # a bare tuple or list: items of any plain type
        origin, args = tp, (_ANY_ITEM,)
    if _is_union(origin):
        for option in sorted(args, key=lambda a: a is str):  # a name last: "[1,3]" is a list, not a name
            try:
                return parse_value(text, option)
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
        return tuple(parse_value(v, args[0]) for v in (_split(inner) if inner else []))
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
    return (Dense.kind, *(c.kind for c in _in_lookup_order() if c is not Dense))


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
            values[name] = parse_value(value, hints[name])
        except ValueError:
            raise UserError(f"{kind}: {name} must be {type_name(hints[name])}, got {value.strip()!r}") from None
    return cls(**values)


class HoldsMethod:
    """Mixin of a settings dataclass that names its method by a spec in the field ``spec_field``: the spec is parsed
    (and so checked) once, and the method kept beside it, in these settings and in their copies (``replace``,
    ``with_method``), so that a run reads one method object from its flags to its files."""

    spec_field: ClassVar[str]
    no_method: ClassVar[Optional[Method]] = None  # what no spec selects (``Dense()`` for a run)

    def declared_method(self) -> Optional[Method]:
        """The method the spec selects, as given (``no_method`` without one); parsed the first time only."""
        spec = getattr(self, self.spec_field)
        kept = self.__dict__.get("_method")
        if kept is None or kept[0] != spec:
            kept = self.__dict__["_method"] = (spec, parse_method(spec) if spec else self.no_method)
        return kept[1]

    def keep_method(self, method: Optional[Method]) -> None:
        """Hold ``method``: its spec, in one spelling (none for ``no_method`` or dense), and the method itself."""
        spec = None if method is None or isinstance(method, Dense) else method.spec()
        setattr(self, self.spec_field, spec)
        self.__dict__["_method"] = (spec, method if method is not None else self.no_method)

    def with_method(self, method: Optional[Method]):
        """These settings running ``method`` (its spec written in, the method itself kept: not parsed again)."""
        held = dataclasses.replace(self, **{self.spec_field: None})
        held.keep_method(method)
        return held

    def replace(self, **changes: Any):
        """``dataclasses.replace`` that keeps the parsed method where the spec is not changed."""
        held = dataclasses.replace(self, **changes)
        if "_method" in self.__dict__ and getattr(held, self.spec_field) == getattr(self, self.spec_field):
            held.__dict__["_method"] = self.__dict__["_method"]
        return held

