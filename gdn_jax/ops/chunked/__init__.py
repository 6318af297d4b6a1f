"""The chunked forms in XLA: every rule's chunkwise forward and its hand-derived backward.

``scalar.py`` runs the rules whose decay is one number a token and value head (the gated
delta rule, gated linear attention, Gated DeltaProduct's steps), ``channel.py`` those whose
decay is one a key channel (KDA, GDN-2), both on the same scaffold: the decays of a chunk
(``chunked/decays.py``, ``chunked/channel_decays.py``), the WY factors of its delta steps (``chunked/wy.py``,
``chunked/triangular.py``), the state passed over chunks by a loop (``chunked/blocks.py``) or an associative
scan (``chunked/state_scan.py``), packed sequences (``chunked/varlen.py``), the schedules
(``schedules.py``) and the stages' names in a profile (``chunked/stages.py``).
"""
