"""Kimi Delta Attention against transformers' own PyTorch KDA, the path its Kimi-Linear,
Bailing-hybrid and GLM-5 Next models take on CPU (without flash-linear-attention)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from support.reference import random_inputs, random_state  # noqa: E402
from support.tolerance import assert_close  # noqa: E402
from test_interop import Lazy, torch  # noqa: E402

import gdn_jax  # noqa: E402

HEADS, KEY, VALUE, SEQ = 2, 16, 12, 100  # T = 100: not a multiple of the chunk

# Imported when used, as test_interop.py's torch and transformers are.
KIMI = "transformers.models.kimi_linear.modeling_kimi_linear"
chunk_kimi_delta_attention = Lazy(KIMI, "chunk_kimi_delta_attention")
recurrent_kimi_delta_attention = Lazy(KIMI, "recurrent_kimi_delta_attention")

kda = jax.jit(gdn_jax.kda, static_argnames=("impl", "chunk_size", "use_qk_l2norm"))


@pytest.mark.parametrize("torch_form", ["chunk", "recurrent"])
def test_outputs_and_final_state_equal_transformers(torch_form):
    q, k, v, la, b = random_inputs(
        0, SEQ, KEY, VALUE, lead=(2,), heads=(HEADS, HEADS), per_channel=True, unit_keys=False
    )
    state = random_state(1, 2, HEADS, VALUE, KEY)  # ours [V, K]; fla's and transformers' [K, V]
    out, final = kda(q, k, v, la, b, initial_state=state, chunk_size=32, use_qk_l2norm=True)

    q_t, k_t, v_t, la_t, b_t = (torch.from_numpy(np.array(x)) for x in (q, k, v, la, b))
    state_t = torch.from_numpy(np.array(state).swapaxes(-1, -2).copy())  # in NumPy: no compile
    options = dict(initial_state=state_t, output_final_state=True, use_qk_l2norm_in_kernel=True)
    if torch_form == "chunk":
        out_t, final_t = chunk_kimi_delta_attention(
            q_t, k_t, v_t, la_t, b_t, chunk_size=64, **options
        )
    else:
        out_t, final_t = recurrent_kimi_delta_attention(q_t, k_t, v_t, la_t, b_t, **options)
    assert_close(out, out_t.numpy(), jnp.float32)
    assert_close(final, final_t.numpy().swapaxes(-1, -2), jnp.float32)
