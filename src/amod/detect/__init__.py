"""Object detection: DETR with Mixture-of-Depths encoders on Fashion-MNIST canvases."""
