"""The channel-decay rules' Mosaic GPU kernels (KDA, GDN-2: a decay a key channel); ``op.py``."""
