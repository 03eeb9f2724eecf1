"""Hugging Face DETRs with a Mixture-of-Depths encoder: ``convert`` (what ``amod.convert`` runs on a DETR),
``cost`` (what ``amod.flops`` returns for one) and ``models`` (the small DETR amod trains and tests).

Importing this package imports nothing; its modules need ``transformers`` (``pip install 'amod[detr]'``).
Training and evaluation on the Fashion-MNIST canvases live in ``amod.detect`` (the application side).
"""

# the routers a DETR encoder takes (the feature-norm router is DETR's own: amod.detr.convert.FeatureNormRouter)
ROUTERS = ("attention", "standard", "random", "feature-norm")
