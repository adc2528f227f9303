"""meshlearn: train transformer language models across a mesh of poorly connected, untrusted GPUs."""

__version__ = "0.1.0"
