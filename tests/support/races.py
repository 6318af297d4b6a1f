"""Mosaic GPU's interpreter with its race detector on, for the kernel tests.

``detecting_races`` is a fixture: the test runs with every Mosaic GPU kernel it lowers
interpreted under ``InterpretGPUParams(detect_races=True)``, and fails if the detector
reported a race (jax 0.11 prints ``RACE DETECTED`` with the two accesses; jax 0.12 raises
it, which fails the test by itself). The detector follows
the TMA copies, barriers and the warpgroup's own loads and stores; it does not follow wgmma
reads of shared memory, which ``gdn_jax.gpu_compile``'s fence scan reads from the SASS.

``racy_kernel`` is the positive control: a TMA store out of a tile that the warpgroup then
overwrites before the store is known to have read it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

REPORT = "RACE DETECTED"


@pytest.fixture
def detecting_races(capfd):
    """Run the test under the race detector and assert it reported nothing."""
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=True)):
        yield
    out, err = capfd.readouterr()
    races = (out + err).count(REPORT)
    assert races == 0, f"{races} races reported:\n{(out + err)[:4000]}"


def races_reported(run, capfd) -> int:
    """How many races the detector reports while ``run()`` lowers and runs its kernels: jax
    0.11 prints each and runs on, jax 0.12 raises at the first."""
    capfd.readouterr()
    raised = ""
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=True)):
        try:
            jax.block_until_ready(run())
        except jax.errors.JaxRuntimeError as error:
            raised = str(error)
    out, err = capfd.readouterr()
    return max((out + err).count(REPORT), raised.count(REPORT))


def racy_kernel():
    """A kernel with a race: its tile copied out by TMA, then overwritten with no wait."""

    def body(x_gmem, o_gmem, smem, barrier):
        plgpu.copy_gmem_to_smem(x_gmem, smem, barrier)
        plgpu.barrier_wait(barrier)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, o_gmem)
        smem[...] = jnp.zeros_like(smem)  # the TMA store may not have read it yet
        plgpu.wait_smem_to_gmem(0)

    out = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    scratch = [plgpu.SMEM((64, 64), jnp.float32), plgpu.Barrier()]
    return plgpu.kernel(body, out_type=out, scratch_types=scratch)
