"""The one dtype -> tolerance table that every numeric test uses."""

import jax.numpy as jnp
import numpy as np

# (rtol, atol) for comparing a computation in `dtype` with a float64 (or float32 for bf16)
# result of the same quantity. float32 gaps measured at up to ~5e-7 relative on unit-scale
# data; the margin covers long sequences and gradients that sum over T.
TOLERANCE = {
    jnp.dtype(jnp.float64): (1e-9, 1e-9),
    jnp.dtype(jnp.float32): (2e-4, 2e-4),
    jnp.dtype(jnp.bfloat16): (3e-2, 3e-2),
}


def assert_close(actual, expected, dtype, err_msg=""):
    """Compare arrays with the tolerance of `dtype`, relative to `expected`'s scale."""
    rtol, atol = TOLERANCE[jnp.dtype(dtype)]
    expected = np.asarray(expected, np.float64)
    scale = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
    np.testing.assert_allclose(
        np.asarray(actual, np.float64), expected, rtol=rtol, atol=atol * scale, err_msg=err_msg
    )


# Largest error relative to the largest magnitude of the expected array, for quantities far
# below 1 that assert_close would measure against 1 (the gradients of a strong decay, about
# 1e-4 and smaller): float32 chunked and recurrent forms measured at up to 7.5e-7 of the
# float64 gradient's scale (tests/ops/test_gradients.py), with a 6.7-fold margin.
RELATIVE_TO_SCALE = {
    jnp.dtype(jnp.float32): 5e-6,
}


def assert_close_to_scale(actual, expected, dtype, err_msg=""):
    """Every error within ``RELATIVE_TO_SCALE[dtype]`` of ``expected``'s largest magnitude."""
    expected = np.asarray(expected, np.float64)
    bound = RELATIVE_TO_SCALE[jnp.dtype(dtype)] * float(np.max(np.abs(expected), initial=0.0))
    np.testing.assert_allclose(
        np.asarray(actual, np.float64), expected, rtol=0, atol=bound, err_msg=err_msg
    )


# Relative RMS error, sqrt(mean((a - e)^2) / mean(e^2)), of a whole layer's output against
# another implementation of it (transformers' Qwen3-Next layer): the bar is 1e-5 in
# float32 (measured gaps about 4e-7). In bfloat16 both sides round every projection and the
# output to 8 bits of mantissa, so they differ by a few units of bf16's 2**-8 = 4e-3.
RELATIVE_RMS = {
    jnp.dtype(jnp.float32): 1e-5,
    jnp.dtype(jnp.bfloat16): 2e-2,
}


def assert_relative_rms(actual, expected, dtype, err_msg=""):
    """Compare whole outputs by relative RMS error with the bound of `dtype`."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape, err_msg)
    error = np.sqrt(np.mean((actual - expected) ** 2) / np.mean(expected**2))
    assert error <= RELATIVE_RMS[jnp.dtype(dtype)], f"{err_msg}: relative RMS error {error:.3g}"
