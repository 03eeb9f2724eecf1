"""Object detection on the Fashion-MNIST canvases: DETR with Mixture-of-Depths encoders (`amod detect`): the canvas
data set (``canvases``, which ``amod.dense`` draws too), the detector, its COCO AP, its runs and its study. The dense
task on the same canvases (segmentation of patch features, `amod dense-frontier`) is ``amod.dense``."""
