"""Deprecated alias of ``amod.tome`` (token merging, ToMe); it will be removed in the next release."""
import warnings

from .tome import *  # noqa: F401,F403
from .tome import __all__  # noqa: F401

warnings.warn("amod.merge is deprecated and will be removed in the next release: use amod.tome "
              "(token merging, ToMe)", FutureWarning, stacklevel=2)
