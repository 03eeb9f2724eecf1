"""Mixture-of-Depths: routers, the MoD and fold blocks, and the conversion of timm ViTs.

``routing`` (which tokens an MoD block keeps), ``routers`` (how tokens are ranked, and their registry),
``modes`` (the skipped modes' base class and registry), ``block`` (the MoD block and its skipped
modes), ``fold`` (the fold mode), ``config`` (``MoDConfig`` and its
checks), ``convert`` (``amod.convert`` and friends), ``isoflop`` (the dense baseline of an MoD setup).
"""
from . import block, fold  # noqa: F401,E402 (they register the built-in skipped modes in amod.mod.modes)
