"""flash-linear-attention's naive GLA (``fla/ops/gla/naive.py``, ``naive_recurrent_gla``),
written again in PyTorch from its definition for tests/interop/test_gla_torch.py; torch is
imported when first used (``lazy.py``).

In fla's layout, q, k and the log-decays ``gk`` ``[B, T, H, K]``, v ``[B, T, H, V]``, the state
``h [B, H, K, V]`` (the transpose of this package's ``[V, K]``), in float32, one token at a
time: ``h = h * exp(gk_t)[:, None] + k_t v_t^T``, ``o_t = (K^-0.5 q_t) h``.
"""

from support.lazy import Lazy

torch = Lazy("torch")


def naive_recurrent_gla(q, k, v, gk, initial_state=None, output_final_state=False):
    """``(o [B, T, H, V] in q's dtype, h [B, H, K, V] in float32 or None)``, as fla's."""
    dtype = q.dtype
    q, k, v, gk = (x.transpose(1, 2).float() for x in (q, k, v, gk))
    batch, heads, seq_len, key_dim = q.shape
    scale = key_dim**-0.5
    h = q.new_zeros(batch, heads, key_dim, v.shape[-1], dtype=torch.float32)
    if initial_state is not None:
        h = h + initial_state.float()
    outputs = []
    for t in range(seq_len):
        h = h * gk[:, :, t].exp()[..., None] + k[:, :, t, :, None] * v[:, :, t, None, :]
        outputs.append(((q[:, :, t] * scale)[..., None] * h).sum(-2))
    o = torch.stack(outputs, 2).transpose(1, 2).to(dtype)
    return o, (h if output_final_state else None)
