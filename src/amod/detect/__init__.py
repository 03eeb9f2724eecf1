"""The Fashion-MNIST canvas tasks: object detection (DETR with Mixture-of-Depths encoders) and semantic segmentation
of patch features (``segmentation``, `amod dense-frontier`)."""
