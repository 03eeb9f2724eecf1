"""The dense-feature task on the Fashion-MNIST canvases: every patch's feature read by a linear probe as semantic
segmentation (``segmentation``: the canvases with pixel masks, the patch probe, mIoU) and `amod dense-frontier`
(``frontier``: patch-feature mIoU against measured speed-up). It sits above ``amod.detect`` (whose canvases it draws)
and ``amod.experiments`` (the frontier's sweep, timing and caches)."""
