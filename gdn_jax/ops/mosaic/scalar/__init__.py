"""The gated delta rule's Mosaic GPU kernels (a decay a token and value head); ``op.py``."""
