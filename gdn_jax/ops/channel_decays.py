"""Per-key-channel decays inside one chunk, and the intra-chunk scores they weight (KDA).

With log-gates ``g [C, K]``, one per token and key channel, write ``G_t = g_1 + ... + g_t``
(per channel, from the chunk's start). The chunked form of Kimi Delta Attention needs

    exp(G_t)         from the chunk's start through token t     [C, K]
    exp(G_C - G_i)   from token i to the chunk's end            [C, K]
    exp(G_C)         over the whole chunk                       [K]
    M_ti = sum_c x_tc k_ic exp(G_tc - G_ic)   for i <= t        [C, C]

for ``x = q`` (the outputs) and ``x = k`` (the WY system). ``M`` sums over channels a decay
that differs per channel, so it is one matmul of decayed factors only if the decay splits:
``exp(G_t) exp(-G_i)`` would overflow once a chunk decays by more than e^88 (float32). So the
chunk is cut into sub-chunks of ``c`` tokens. For a row sub-chunk ``R`` whose first token is
``r`` and an earlier column sub-chunk ``J``, the reference point ``r - 1`` lies between them:

    exp(G_t - G_i) = exp(G_t - G_{r-1}) exp(G_{r-1} - G_i),   both factors in [0, 1],

so ``M[R, J] = (X_R * exp(G_R - G_{r-1})) (K_J * exp(G_{r-1} - G_J))^T`` for all ``J < R`` at
once is one matmul per row sub-chunk. On the diagonal sub-chunks ``exp(G_t - G_i)`` is taken
exactly, as a ``[c, c, K]`` array each. The largest arrays of a chunk are ``[C/c, C, K]`` and
``[C/c, c, c, K]``, never ``[C, C, K]``.

Every exponent is a sum of gates over a segment of tokens, summed directly rather than as a
difference of running sums (as in ``decays.py``): sums of terms ``<= 0`` lose nothing to
cancellation, so the -0.01 steps after a -1e4 reset stay exact, and none is positive, so no
``exp`` overflows. Masked entries are sums over empty segments, 0, zeroed after the ``exp``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

# Tokens per sub-chunk (``c``), or the whole chunk when it is smaller.
SUB_CHUNK = 16

HIGHEST = jax.lax.Precision.HIGHEST  # keeps TPU and GPU from rounding log-decays to bf16/tf32


class ChannelDecays(NamedTuple):
    """The per-channel decays of one chunk of ``C = NB * c`` tokens (``NB`` sub-chunks)."""

    from_start: Float[Array, "C K"]  # exp(G_t)
    to_end: Float[Array, "C K"]  # exp(G_C - G_i)
    whole: Float[Array, " K"]  # exp(G_C)
    from_ref: Float[Array, "C K"]  # exp(G_t - G_{r-1}), r the first token of t's sub-chunk
    ref_from: Float[Array, "NB C K"]  # [R, i]: exp(G_{r-1} - G_i) for i before R's r, else 0
    within: Float[Array, "NB c c K"]  # [R, t, i]: exp(G_t - G_i) for i <= t in R, else 0


def masked_sums(spec: str, mask: np.ndarray, g):
    """``einsum(spec, mask, g)`` for a constant 0/1 ``mask``: sums of gates over segments,
    exact (HIGHEST) and summed in one product."""
    return jnp.einsum(spec, jnp.asarray(mask, g.dtype), g, precision=HIGHEST)


def channel_decays(log_alpha: Float[Array, "C K"], sub_chunk: int = SUB_CHUNK) -> ChannelDecays:
    """Every decay of one chunk from its gates ``log_alpha [C, K]`` (each ``<= 0``, finite)."""
    chunk, key_dim = log_alpha.shape
    sub = min(sub_chunk, chunk)
    num = chunk // sub
    g = log_alpha.reshape(num, sub, key_dim)
    t, s = np.arange(sub)[:, None], np.arange(sub)[None, :]
    prefix = masked_sums("ts,rsk->rtk", s <= t, g)  # [R, t]: g summed over [r, t]
    suffix = masked_sums("ts,rsk->rtk", s > t, g)  # [J, i]: over (i, last token of J]
    totals = prefix[:, -1]  # [NB, K]
    a, b, m = np.arange(num)[:, None, None], np.arange(num)[None, :, None], np.arange(num)
    before = masked_sums("ab,bk->ak", b[..., 0] < a[..., 0], totals)  # sub-chunks before R
    after = masked_sums("ab,bk->ak", b[..., 0] > a[..., 0], totals)  # sub-chunks after J
    between = masked_sums("abm,mk->abk", (b < m) & (m < a), totals)  # [R, J]: J < m < R
    earlier = (b < a)[..., None]  # [R, J, 1, 1]
    ref_from = jnp.where(earlier, jnp.exp(suffix[None] + between[:, :, None]), 0)
    i, u = np.arange(sub)[None, :, None], np.arange(sub)[None, None, :]
    segment = masked_sums("tiu,ruk->rtik", (i < u) & (u <= t[..., None]), g)  # over (i, t]
    causal = (s <= t)[None, :, :, None]
    return ChannelDecays(
        from_start=jnp.exp(prefix + before[:, None]).reshape(chunk, key_dim),
        to_end=jnp.exp(suffix + after[:, None]).reshape(chunk, key_dim),
        whole=jnp.exp(totals.sum(0)),
        from_ref=jnp.exp(prefix).reshape(chunk, key_dim),
        ref_from=ref_from.reshape(num, chunk, key_dim),
        within=jnp.where(causal, jnp.exp(segment), 0),
    )


def channel_scores(
    x: Float[Array, "P C K"], k: Float[Array, "C K"], decays: ChannelDecays
) -> Float[Array, "P C C"]:
    """``M_ti = sum_c x_tc k_ic exp(G_tc - G_ic)`` for ``i <= t``, zero above the diagonal,
    for each of ``P`` row factors ``x`` (queries and keys, say) against one ``k``."""
    num, sub = decays.within.shape[:2]
    parts, chunk, key_dim = x.shape
    left = (x * decays.from_ref[None]).reshape(parts, num, sub, key_dim)
    off_diagonal = jnp.einsum("prtk,rik->prti", left, k[None] * decays.ref_from)  # [P, NB, c, C]
    k_within = k.reshape(num, 1, sub, key_dim) * decays.within  # [R, t, i, K]
    diagonal = jnp.einsum("prtk,rtik->prti", x.reshape(parts, num, sub, key_dim), k_within)
    on_diagonal = jnp.eye(num, dtype=x.dtype)[None, :, None, :, None]
    full = off_diagonal.reshape(parts, num, sub, num, sub) + diagonal[:, :, :, None] * on_diagonal
    return full.reshape(parts, chunk, chunk)
