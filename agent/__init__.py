"""gpu-ready: tells Kubernetes whether a node's NVIDIA GPUs are really usable."""

__version__ = "0.1.0"
