"""``benchmarks/gpu_check.py --smoke`` on this CPU: every part of the GPU check runs at tiny
shapes, the peers that cannot run here are recorded as skipped with the reason, and what it
writes is a table a reader can use."""

import importlib.util
import json
import sys
from pathlib import Path

import jax
import pytest

REPO = Path(__file__).resolve().parents[2]


def load_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks/gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.costly(25)
def test_smoke_run_writes_every_measurement(tmp_path):
    check = load_check()
    with jax.numpy_dtype_promotion("standard"):  # optax mixes float and int32 in Adam
        check.main(
            [
                "--smoke",
                "--out",
                str(tmp_path),
                "--repeats",
                "1",
                "--item",
                "gdn:hoisted,in_scan,pallas",
                "--profile",
                "--pallas-launch",
                "8x2x4x8:ieee",
            ]
        )
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = {row["impl"]: row for row in data["ops"]}
    assert sorted(rows) == [
        "gdn_jax hoisted",
        "gdn_jax in_scan",
        "gdn_jax pallas 8x2x4x8:ieee",  # two value blocks of 8 a forward program, four of 4 back
    ]
    for row in rows.values():
        for part in ("fwd", "fwd+bwd"):
            assert row[part]["ms"] > 0 and row[part]["peak_bytes"] > 0, row
    # The two schedules and the kernel agree on the output, the final state and every
    # input's gradient.
    for later in ("gdn_jax in_scan", "gdn_jax pallas 8x2x4x8:ieee"):
        fractions = rows[later]["agreement"]["gdn_jax hoisted"]
        assert sorted(fractions) == ["dbeta", "dk", "dlog_alpha", "dq", "dv", "final_state", "o"]
        assert max(fractions.values()) <= 1.0, fractions
    skipped = {entry["what"]: entry["why"] for entry in data["skipped"]}
    assert skipped["jla"] in (
        "jax-linear-attention is not installed",
        "its kernels need a GPU backend",
    )
    assert skipped["fla"] in ("fla-core is not installed", "torch sees no CUDA device")
    training = data["training"]
    assert training["step_ms"] > 0
    assert training["train_py"]["final_step"] == 4 and training["train_py"]["reason"] == "steps"
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| Gated DeltaNet | 1×96 | gdn_jax in_scan |" in table
    assert "`python train.py`" in table and "- fla: " in table
    # --profile: each program's time by stage, every stage of its form found in the trace.
    for impl, stages in (
        ("gdn_jax hoisted", ("factors", "state_pass", "state_pass_backward", "input_grads")),
        ("gdn_jax pallas 8x2x4x8:ieee", ("pallas_forward", "pallas_backward")),
    ):
        profile = rows[impl]["fwd+bwd"]["stages"]
        assert profile["where"] == "host" and profile["calls"] == 3, profile
        assert all(profile["ms_per_call"].get(s, 0) > 0 for s in stages), profile
    assert (
        "| Gated DeltaNet | 1×96 | gdn_jax pallas 8x2x4x8:ieee | - |" in table.split("by stage")[1]
    )
    # The launch that was set for a row is undone after it.
    from gdn_jax.ops import chunked_pallas

    assert chunked_pallas.LAUNCH == chunked_pallas.Launch()


def test_a_form_that_fails_is_recorded_and_the_rest_measured(tmp_path, monkeypatch):
    """A kernel that Triton refuses on the GPU must not end the run that measures the rest."""
    check = load_check()
    measure = check.gdn_jax_runs

    def refuse_the_kernel(op, arrays, schedule, chunk, repeats, profile):
        if schedule == "pallas":
            raise RuntimeError("out of shared memory")
        return measure(op, arrays, schedule, chunk, repeats, profile)

    monkeypatch.setattr(check, "gdn_jax_runs", refuse_the_kernel)
    out = ["--smoke", "--out", str(tmp_path), "--repeats", "1", "--skip-training"]
    check.main([*out, "--item", "gdn:pallas,hoisted"])
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [row["impl"] for row in data["ops"]] == ["gdn_jax hoisted"]
    skipped = {entry["what"]: entry["why"] for entry in data["skipped"]}
    assert skipped["gdn_jax pallas Gated DeltaNet 1×96"] == "RuntimeError: out of shared memory"


def test_bad_item_is_one_error_naming_it(capsys):
    check = load_check()
    with pytest.raises(SystemExit) as exit_info:
        check.main(["--smoke", "--out", "unused", "--item", "kdx@1x96:hoisted,bogus"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        "gpu_check.py: error: --item 'kdx@1x96:hoisted,bogus': unknown op 'kdx' (one of "
        "['gdn', 'gdn2', 'kda']), implementation 'bogus' (one of ['fla', 'jla', 'hoisted', "
        "'in_scan', 'pallas'])"
    )
    with pytest.raises(SystemExit) as exit_info:
        check.main(["--smoke", "--out", "unused", "--pallas-launch", "0x4x4x4"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "gpu_check.py: error: --pallas-launch '0x4x4x4': give FBVxFWxBBVxBW[:ieee|:tf32x3] "
        "(each kernel's value block, 0 for a whole value head in the backward, and warps, then "
        "the products' precision), e.g. 64x8x64x8:tf32x3"
    )


@pytest.mark.costly(10)
def test_a_child_measures_what_the_parent_would_and_a_slow_one_is_stopped():
    """The way fla runs on the GPU (a child process with a time limit, since its first call
    can autotune for minutes), tried with gdn_jax's hoisted schedule: the same inputs made
    again there, the same values back; and a child past its limit is a TimeoutError."""
    check = load_check()
    op = check.OPS[0]
    timings, values = check.in_child("hoisted", op, check.SMOKE, (1, 96), repeats=1)
    assert timings["fwd"]["ms"] > 0 and timings["fwd+bwd"]["ms"] > 0
    arrays = check.make_inputs(op, 1, 96, check.SMOKE["heads"], check.SMOKE["dim"])
    _, here = check.gdn_jax_runs(op, arrays, "hoisted", check.SMOKE["chunk"], 1)
    assert sorted(values) == sorted(here)
    fractions = check.agreement(here, values)
    assert max(fractions.values()) < 1e-3, fractions
    with pytest.raises(TimeoutError, match="hoisted did not finish within 0 s"):
        check.in_child("hoisted", op, check.SMOKE, (1, 96), repeats=1, timeout=0.1)
