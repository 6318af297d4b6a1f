"""The interface every token mixer implements, so the language model can hold any of them."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from jaxtyping import Array, Float, Int


@runtime_checkable
class TokenMixer(Protocol):
    """A sequence-mixing layer ``x [B, T, D] -> [B, T, D]`` that also decodes from a cache.

    Implemented by the ``RecurrentMixer``s (``GatedDeltaNet`` and its baselines) and
    ``SoftmaxAttention``;
    ``tests/layers/test_layers.py`` checks that each one's methods take exactly these arguments.
    """

    def __call__(
        self,
        x: Float[Array, "B T D"],
        *,
        mask: Array | None = None,
        cu_seqlens: Int[Array, " N+1"] | None = None,
    ) -> Float[Array, "B T D"]:
        """Mix ``x`` with an optional ``[B, T]`` padding mask or packed ``cu_seqlens``."""

    def init_cache(self, batch_size: int, max_len: int | None = None) -> Any:
        """An empty decoding cache for ``batch_size`` rows and up to ``max_len`` tokens
        (``None``: as many as the prompt, where the layer needs a bound at all)."""

    def prefill(
        self, x: Float[Array, "B T D"], cache: Any = None, *, mask: Array | None = None
    ) -> tuple[Float[Array, "B T D"], Any]:
        """Run a left-padded prompt from ``cache`` (a fresh one when ``None``)."""

    def step(self, x: Float[Array, "B 1 D"], cache: Any) -> tuple[Float[Array, "B 1 D"], Any]:
        """One token per row."""
