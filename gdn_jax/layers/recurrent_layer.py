"""What every recurrent token mixer over short-convolved q, k, v shares, whatever its rule.

``RecurrentLayer`` holds the ``TokenMixer`` methods, the decoding cache and the path from the
layer input to the rule's q, k and v (projections, padding, short convolutions, heads).
``RecurrentMixer`` (Gated DeltaNet and its baselines) and ``KimiDeltaAttention`` are its
subclasses; each builds its own parameters and implements ``_mix`` with its gates, its rule
and its output.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, no_type_check

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from gdn_jax.layers import input_checks
from gdn_jax.layers.conv import ShortConvolution, convolve_qkv
from gdn_jax.layers.params import COLUMNS, ROWS, SEQ_AXIS, bias_free_linear, check_build_args
from gdn_jax.ops import checks, dispatch
from gdn_jax.ops.api import batched
from gdn_jax.ops.rule import Rule
from gdn_jax.ops.sequence_parallel import seq_parallel


def seq_parallel_mesh():
    """The mesh in context when it splits T (a ``SEQ_AXIS`` of more than one device), else
    None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or SEQ_AXIS not in mesh.axis_names or mesh.shape[SEQ_AXIS] == 1:
        return None
    return mesh


class RecurrentCache(NamedTuple):
    """Decoding state of one recurrent layer (a pytree).

    Attributes:
      conv: the last ``conv_size - 1`` inputs of the q, k and v convolutions, each
        ``[B, W-1, channels]``; ``None`` without short convolutions.
      state: the memory ``[B, HV, V, K]`` in float32.
    """

    conv: tuple[Array, Array, Array] | None
    state: Float[Array, "B HV V K"]


def check_head_shapes(
    name, *, hidden_size, num_heads, head_dim, num_v_heads, expand_v, conv_size, norm_eps
) -> int:
    """Check the head layout every recurrent layer takes; return ``head_v_dim``."""
    checks.check_positive_int(
        name,
        hidden_size=hidden_size,
        num_heads=num_heads,
        head_dim=head_dim,
        num_v_heads=num_v_heads,
        conv_size=conv_size,
    )
    checks.check_positive_number(name, expand_v=expand_v, norm_eps=norm_eps)
    head_v_dim = head_dim * expand_v
    checks.require(
        name,
        float(head_v_dim).is_integer(),
        f"head_dim * expand_v = {head_dim} * {expand_v} must be a positive integer",
    )
    checks.require(
        name,
        num_v_heads % num_heads == 0,
        f"num_v_heads={num_v_heads} must be a multiple of num_heads={num_heads}",
    )
    return int(head_v_dim)


def short_convolutions(widths, *, conv_size, conv_bias, dtype, param_dtype, rngs):
    """The q, k and v ``ShortConvolution``s over ``widths = (q, k, v)`` channels."""
    conv = functools.partial(
        ShortConvolution,
        conv_size=conv_size,
        use_bias=conv_bias,
        dtype=dtype,
        param_dtype=param_dtype,
        rngs=rngs,
    )
    return tuple(conv(width) for width in widths)


@no_type_check  # checks.py names bad arguments and inputs
class RecurrentLayer(nnx.Module):
    """The ``TokenMixer`` methods of a recurrent mixer: ``x [B, T, hidden_size] -> [B, T,
    hidden_size]``, with a ``RecurrentCache`` for decoding.

    Its constructor checks and builds what every recurrent mixer has, with
    flash-linear-attention's names: the bias-free ``q_proj``, ``k_proj`` and ``v_proj``,
    the ``q_conv1d``, ``k_conv1d`` and ``v_conv1d`` short convolutions (None without
    ``use_short_conv``), the per-head output norm ``o_norm`` and the bias-free ``o_proj``.
    A subclass calls it first, then builds its gates (with ``params.bias_free_linear`` of
    the same dtypes, initialisation and random streams), and implements ``_mix(x, *, mask, cu_seqlens,
    cache, impl) -> (y, cache)``, which gets q, k and v from ``_qkv``. ``rule`` is what it
    runs (``ops.rules.RULES``), with ``rule_options`` (Gated DeltaProduct's
    ``num_householder``), which also say how many keys and values a token takes;
    ``chunk_size``, ``impl`` and ``schedule`` are its op's. The op L2-normalises q and k
    unless the subclass sets ``qk_l2norm = False`` (GLA's feature map replaces it).
    """

    qk_l2norm: bool = True

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        *,
        expand_v: float,
        num_v_heads: int | None,
        use_gate: bool,
        use_short_conv: bool,
        conv_size: int,
        conv_bias: bool,
        allow_neg_eigval: bool,
        norm_eps: float,
        chunk_size: int,
        impl: checks.Impl,
        schedule: checks.Schedule,
        dtype,
        param_dtype,
        kernel_init,
        rngs: nnx.Rngs,
        rule: Rule,
        rule_options: dict | None = None,
    ):
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        name = type(self).__name__
        head_v_dim = check_head_shapes(
            name,
            hidden_size=hidden_size,
            num_heads=num_heads,
            head_dim=head_dim,
            num_v_heads=num_v_heads,
            expand_v=expand_v,
            conv_size=conv_size,
            norm_eps=norm_eps,
        )
        check_build_args(name, rngs=rngs, kernel_init=kernel_init)
        switches = dict(use_gate=use_gate, use_short_conv=use_short_conv, conv_bias=conv_bias)
        checks.check_flag(name, allow_neg_eigval=allow_neg_eigval, **switches)
        dispatch.check_impl(name, rule, impl)
        self.chunk_size = checks.check_chunk_size(name, chunk_size)
        checks.check_schedule(name, schedule)
        checks.check_floating_dtype(name, dtype=dtype, param_dtype=param_dtype)

        self.hidden_size, self.head_v_dim = hidden_size, head_v_dim
        self.num_heads, self.num_v_heads, self.head_dim = num_heads, num_v_heads, head_dim
        self.key_dim, self.value_dim = num_heads * head_dim, num_v_heads * head_v_dim
        self.allow_neg_eigval, self.use_gate = allow_neg_eigval, use_gate
        self.impl, self.schedule, self.conv_size = impl, schedule, conv_size
        # The rule and its options (a tuple of pairs: static, hashable), and the keys and
        # values it takes a token, each head's side by side ("(h n d)" features, see _steps).
        self.rule, self.rule_options = rule, tuple(sorted((rule_options or {}).items()))
        self.steps_per_token = steps_per_token = rule.steps_per_token(rule_options or {})
        self.widths = (
            self.key_dim,
            self.key_dim * steps_per_token,
            self.value_dim * steps_per_token,
        )

        linear = bias_free_linear(
            dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init, rngs=rngs
        )
        self.q_proj = linear(hidden_size, self.key_dim, COLUMNS)
        self.k_proj = linear(hidden_size, self.widths[1], COLUMNS)
        self.v_proj = linear(hidden_size, self.widths[2], COLUMNS)
        if use_short_conv:
            self.q_conv1d, self.k_conv1d, self.v_conv1d = short_convolutions(
                self.widths,
                conv_size=conv_size,
                conv_bias=conv_bias,
                dtype=dtype,
                param_dtype=param_dtype,
                rngs=rngs,
            )
        else:
            self.q_conv1d = self.k_conv1d = self.v_conv1d = None
        self.o_norm = nnx.RMSNorm(
            head_v_dim, epsilon=norm_eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs
        )
        self.o_proj = linear(self.value_dim, hidden_size, ROWS)

    def __call__(self, x, *, mask=None, cu_seqlens=None):
        """Mix ``x [B, T, D]``.

        Args:
          x: ``[B, T, hidden_size]``.
          mask: optional ``[B, T]`` 0/1 padding mask. Padded tokens neither write to the state
            nor reach the convolution (they enter it as zeros, whatever they hold, NaN and inf
            included), so padding at either end of a sequence leaves the other tokens'
            outputs as they are without it.
          cu_seqlens: optional ``[N+1]`` integer offsets (an array, or a list of ints) of
            sequences packed along T (``B == 1``); the state and the convolutions restart at
            each sequence.
        """
        name = type(self).__name__
        input_checks.check_hidden(name, x, self.hidden_size)
        cu_seqlens = input_checks.check_packed(name, cu_seqlens, x)
        y, _ = self._mix(x, mask=mask, cu_seqlens=cu_seqlens, cache=None, impl=self.impl)
        return y

    def init_cache(self, batch_size: int, max_len: int | None = None) -> RecurrentCache:
        """An empty cache. The recurrent state has one size whatever the length, so any
        ``max_len`` (checked when given) decodes on without limit."""
        checks.check_positive_int(type(self).__name__, batch_size=batch_size)
        if max_len is not None:
            checks.check_positive_int(type(self).__name__, max_len=max_len)
        conv = None
        if self.q_conv1d is not None:
            width = self.conv_size - 1
            conv = tuple(jnp.zeros((batch_size, width, d), self.q_proj.dtype) for d in self.widths)
        state = jnp.zeros((batch_size, self.num_v_heads, self.head_v_dim, self.head_dim))
        return RecurrentCache(conv, state.astype(jnp.float32))

    def prefill(self, x, cache=None, *, mask=None):
        """Run a prompt ``x [B, T, D]`` (left-padded with ``mask``, which is checked when
        concrete) from ``cache`` (empty when ``None``) and return ``(y, cache)`` for decoding
        on."""
        cache = self.init_cache(x.shape[0]) if cache is None else cache
        return self._mix(x, mask=mask, cu_seqlens=None, cache=cache, impl=self.impl)

    def step(self, x, cache):
        """One token per sequence, ``x [B, 1, D]``: ``(y [B, 1, D], cache)``, token by token."""
        return self._mix(x, mask=None, cu_seqlens=None, cache=cache, impl="recurrent")

    def _seq_mesh(self, cache, impl):
        """The mesh in context when it splits T and there is no cache to start from
        (``seq_parallel_mesh``), else None; an ``impl`` that cannot run split is refused
        rather than run unsplit on every device."""
        mesh = seq_parallel_mesh() if cache is None else None
        if mesh is not None and not dispatch.splits_sequence(impl):
            raise ValueError(
                f"{type(self).__name__}: impl={impl!r} cannot split T over the mesh axis "
                f"{SEQ_AXIS!r} of the mesh in context; use impl='auto' or 'chunked'"
            )
        return mesh

    def _recurrence(self, q, k, v, gates: tuple, *, cu_seqlens, cache, impl, seq_mesh):
        """The layer's rule over q, k, v and its ``gates``: ``(o, state)``. With ``seq_mesh``
        (a mesh in context that splits T) the rule passes its state across the shards; else
        it starts from the cache's state (zeros without a cache). Its errors name the rule's
        batched op, or its ``*_seq_parallel`` twin."""
        rule = self.rule
        options = dict(
            chunk_size=self.chunk_size,
            schedule=self.schedule,
            cu_seqlens=cu_seqlens,
            use_qk_l2norm=self.qk_l2norm,
            scale=None,
            **dict(self.rule_options),
        )
        if seq_mesh is not None:
            fn = f"{rule.name}_seq_parallel"
            return seq_parallel(
                rule, q, k, v, gates, fn=fn, mesh=seq_mesh, axis_name=SEQ_AXIS,
                initial_state=None, **options,
            )  # fmt: skip
        initial_state = None if cache is None else cache.state
        return batched(rule, q, k, v, gates, initial_state=initial_state, impl=impl, **options)

    def _qkv(self, x, *, mask, cu_seqlens, cache, seq_mesh):
        """The rule's inputs from ``x [B, T, D]``, after checking ``x``, ``mask`` and ``cache``.

        Returns ``(q [B, T, H, K], k [B, T n, H, K], v [B, T n, HV, V], real, conv_cache)``
        (``n = steps_per_token``, the steps a token of the layer's rule):
        ``real`` is the mask as ``[B, T, 1]`` booleans (None without one), ``conv_cache`` the
        convolution histories to decode on (None without short convolutions). With
        ``seq_mesh`` the convolutions split T over its ``SEQ_AXIS``.
        """
        name = type(self).__name__
        input_checks.check_hidden(name, x, self.hidden_size)
        batch, seq_len, _ = x.shape
        if mask is not None:
            input_checks.check_mask(name, mask, batch, seq_len)
            if cache is not None:  # a prompt: each row decodes on from its last token
                input_checks.check_left_padding(name, mask)
        if cache is not None:
            empty = jax.eval_shape(lambda: self.init_cache(batch))
            input_checks.check_cache(name, cache, empty)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # Padding is selected away, not multiplied by 0: a NaN or inf there times 0 is NaN,
        # which the convolution and the state would carry into the real tokens.
        real = None if mask is None else mask.astype(bool)[..., None]
        if real is not None:
            q, k, v = (jnp.where(real, z, 0) for z in (q, k, v))
        conv_cache = None
        if self.q_conv1d is not None:
            (q, k, v), conv_cache = convolve_qkv(
                (self.q_conv1d, self.k_conv1d, self.v_conv1d),
                (q, k, v),
                histories=None if cache is None else cache.conv,
                cu_seqlens=cu_seqlens,
                seq_mesh=seq_mesh,
            )
        q = q.reshape(batch, seq_len, self.num_heads, self.head_dim)
        k = self._steps(k, self.num_heads, self.head_dim)
        v = self._steps(v, self.num_v_heads, self.head_v_dim)
        return q, k, v, real, conv_cache

    def _steps(self, z, heads, width):
        """``z [B, T, heads * n * width]``, each head's ``n`` steps side by side (head-major,
        so that a ``model`` axis over the columns splits whole heads), as the rule's steps
        ``[B, T n, heads, width]``: a token's ``n`` steps in order."""
        batch, seq_len, _ = z.shape
        n = self.steps_per_token
        z = z.reshape(batch, seq_len, heads, n, width).swapaxes(2, 3)
        return z.reshape(batch, seq_len * n, heads, width)
