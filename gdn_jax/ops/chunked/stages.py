"""The names of the chunked forms' stages in a compiled program's op metadata.

``ops/chunked/scalar.py`` and ``ops/chunked/channel.py`` run each stage under ``jax.named_scope`` of its
name here. The scopes are metadata only (the
programs are the same without them); ``benchmarks/stage_profile.py`` reads a profile's time
by them.
"""

# The XLA forms' stages: 1, 2 and 3 of the forward (``ops/chunked/scalar.py``), then the backward's
# stage 1 again, its reverse state pass and every input's gradient.
FORWARD = (FACTORS, STATE_PASS, OUTPUTS) = ("factors", "state_pass", "outputs")
BACKWARD = (FACTORS_AGAIN, STATE_PASS_BACKWARD, INPUT_GRADS) = (
    "factors_again",
    "state_pass_backward",
    "input_grads",
)
# A kernel (``Rule.kernels``) is a stage of its own, named by the kernel.
ALL = (*FORWARD, *BACKWARD)
