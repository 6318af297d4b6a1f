"""The Mosaic GPU kernels of the chunked rules for Hopper (``impl="mosaic_gpu"``).

``limits.py`` holds their tile sizes and every limit, ``tiles.py`` the tile primitives
(pieces, fences, products), ``layout.py`` the token layout and padding, ``state_pass.py``
the state passes' program. Each gate kind has its own folder with the same stage words as
the XLA engine (``ops/chunked/``): ``scalar/`` (the gated delta rule, Gated DeltaProduct's
steps) and ``channel/`` (KDA, GDN-2), each with ``chunk.py`` (inside one chunk),
``factors.py``, ``states.py``, ``reverse.py``, ``grads.py`` (and ``levels.py``), and
``op.py``, the op's ``custom_vjp`` over them. Neither gate kind imports the other's.
"""
