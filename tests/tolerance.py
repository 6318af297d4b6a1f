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
