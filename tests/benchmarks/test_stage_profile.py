"""``benchmarks/stage_profile.py`` reading traces it did not make: HLO metadata to stages,
nested events to their own time, and a GPU trace's "XLA Ops" line chosen over its kernels.
(The smoke test of ``gpu_check.py`` profiles real programs on this CPU.)"""

import pytest
from support import benchmark_scripts


@pytest.fixture(scope="module")
def profile():
    return benchmark_scripts.load("stage_profile")


HLO = """\
HloModule jit_loss, entry_computation_layout={...}
  %fusion.3 = f32[4,64,64]{2,1,0} fusion(%p0), kind=kLoop, calls=%fc, metadata={op_name="jit(loss)/jvp(factors)/dot_general" source_file="x.py" source_line=3}
  ROOT %while.2 = (f32[8]) while(%t), condition=%c, body=%b, metadata={op_name="jit(loss)/while"}
  dot.9 = f32[8] dot(%a, %b), metadata={op_name="jit(loss)/transpose(jvp(factors_again))/factors/dot_general"}
  custom-call.1 = f32[8] custom-call(%a), custom_call_target="mosaic_gpu_v2", metadata={op_name="jit(loss)/transpose(jvp())/gdn_mosaic_grads/mpmd_map"}
  %add.4 = f32[8] add(%a, %b), metadata={op_name="jit(loss)/jvp()/gdn_mosaic_states/while/body/add"}
  %p0 = f32[8] parameter(0)
"""


def test_instructions_take_the_outermost_stage_of_their_scopes(profile):
    """A chunked form's stage, else the Mosaic GPU kernel's: its launch on a GPU, or an
    instruction of its interpreter elsewhere."""
    assert profile.op_stages(HLO) == {
        "fusion.3": "factors",
        "while.2": "other",
        "dot.9": "factors_again",
        "custom-call.1": "gdn_mosaic_grads",
        "add.4": "gdn_mosaic_states",
    }
    found = {"other", "gdn_mosaic_states", "input_grads", "gdn_mosaic_factors", "factors"}
    assert profile.ordered(found) == [
        "factors", "input_grads", "gdn_mosaic_factors", "gdn_mosaic_states", "other"
    ]  # fmt: skip


def event(name, ts, dur, pid=1, tid=1, **args):
    return dict(ph="X", name=name, ts=ts, dur=dur, pid=pid, tid=tid, args=dict(hlo_op=name, **args))


def meta(kind, pid, name, tid=None):
    return dict(ph="M", name=kind, pid=pid, tid=tid, args=dict(name=name))


def test_a_loop_counts_its_own_time_not_its_body_s(profile):
    events = [
        meta("process_name", 1, "/host:CPU"),
        event("while.2", 0, 100),  # holds the two below
        event("fusion.3", 10, 30),
        event("dot.9", 50, 40),
        event("fusion.3", 200, 30),  # the next call
        event("bitcast.7", 300, 5),  # not in the program's HLO
    ]
    reading = profile.attribute(events, profile.op_stages(HLO), calls=2)
    assert reading["where"] == "host"
    assert reading["ms_per_call"] == pytest.approx(
        {"factors": 0.03, "factors_again": 0.02, "other": 0.015}
    )
    assert reading["unmatched_ms_per_call"] == pytest.approx(0.0025)
    assert [t["op"] for t in reading["top"]] == ["fusion.3", "dot.9", "while.2"]


def test_a_gpu_trace_is_read_on_its_xla_ops_line(profile):
    events = [
        meta("process_name", 1, "/host:CPU"),
        meta("process_name", 2, "/device:GPU:0"),
        meta("thread_name", 2, "Stream #7(Compute)", tid=7),
        meta("thread_name", 2, "XLA Ops", tid=8),
        event("fusion.3", 0, 1000, pid=1),  # the host's launch, not the device's time
        event("fusion.3", 5, 20, pid=2, tid=7),  # the kernel, also on the XLA Ops line
        # The line's events are named by their instruction, with no hlo_op argument.
        dict(ph="X", name="fusion.3", ts=5, dur=20, pid=2, tid=8),
        dict(ph="X", name="%custom-call.1", ts=30, dur=60, pid=2, tid=8),
    ]
    reading = profile.attribute(events, profile.op_stages(HLO), calls=1)
    assert reading["where"] == "device, XLA Ops line"
    assert reading["ms_per_call"] == pytest.approx({"factors": 0.02, "gdn_mosaic_grads": 0.06})


def test_a_trace_without_the_program_says_so(profile):
    events = [meta("process_name", 2, "/device:GPU:0"), event("fusion.77", 0, 5, pid=2)]
    reading = profile.attribute(events, profile.op_stages(HLO), calls=1)
    assert reading["error"] == "no op events of this program in the trace"
    assert "/device:GPU:0" in reading["threads"]
