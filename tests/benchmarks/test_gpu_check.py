"""``benchmarks/gpu_check.py --smoke`` on this CPU: every part of the GPU check runs at tiny
shapes, the peers that cannot run here and the forms this JAX cannot run are recorded as
skipped with the reason, and what it writes is a table a reader can use."""

import json

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
from support import benchmark_scripts

# Mosaic GPU's interpret mode, which runs impl="mosaic_gpu" off a GPU (jax >= 0.11).
INTERPRETS = hasattr(plgpu, "InterpretGPUParams")
FORMS = ["gdn_jax mosaic_gpu", "gdn_jax associative", "gdn_jax hoisted", "gdn_jax in_scan"]
GDN_VALUES = ["dbeta", "dk", "dlog_alpha", "dq", "dv", "final_state", "loss", "o"]


def load_check():
    return benchmark_scripts.load("gpu_check")


def skipped(data) -> dict[str, str]:
    return {entry["what"]: entry["why"] for entry in data["skipped"]}


@pytest.mark.slow
@pytest.mark.costly(25)
def test_smoke_run_writes_every_measurement(tmp_path):
    check = load_check()
    autotune = tmp_path / "xla_autotune.textproto"
    with jax.numpy_dtype_promotion("standard"):  # optax mixes float and int32 in Adam
        check.main(
            ["--smoke", "--out", str(tmp_path), "--repeats", "1", "--profile",
             "--item", "gdn:mosaic_gpu,associative,hoisted,in_scan",
             "--autotune-to", str(autotune)]
        )  # fmt: skip
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = {row["impl"]: row for row in data["ops"]}
    measured = FORMS if INTERPRETS else FORMS[1:]
    assert list(rows) == measured  # in the order the item names them
    if not INTERPRETS:
        assert skipped(data)["gdn_jax mosaic_gpu Gated DeltaNet 1×96"].startswith(
            "ValueError: gated_delta_rule: impl='mosaic_gpu' cannot take these inputs: needs "
            f"jax >= 0.11 (Python >= 3.12; the Mosaic GPU API the kernels are written in, and "
            f"its interpreter off a GPU), got jax {jax.__version__}"
        )
    for row in rows.values():
        for part in ("fwd", "fwd+bwd"):
            assert row[part]["ms"] > 0 and row[part]["peak_bytes"] > 0, row
            # The profiler's time beside the wall time: on this CPU the host's op events.
            kernels = row[part]["kernels"]
            assert kernels["where"] == "host" and kernels["ms_per_call"] > 0, kernels
            assert kernels["top"] and kernels["launches_per_call"] >= len(kernels["top"])
    # Each form agrees with every one measured before it on the output, the final state and
    # every input's gradient.
    for i, impl in enumerate(measured):
        assert sorted(rows[impl]["agreement"]) == sorted(measured[:i])
        for fractions in rows[impl]["agreement"].values():
            assert sorted(fractions) == GDN_VALUES
            assert max(fractions.values()) <= 1.0, fractions
    assert skipped(data)["jla"] in (
        "jax-linear-attention is not installed",
        "its kernels need a GPU backend",
    )
    assert skipped(data)["fla"] in ("fla-core is not installed", "torch sees no CUDA device")
    training = data["training"]
    assert training["step_ms"] > 0
    assert training["train_py"]["final_step"] == 4 and training["train_py"]["reason"] == "steps"
    # No GPU compiled anything here, so XLA autotuned nothing and wrote no file.
    assert data["autotune"] == dict(
        file="xla_autotune.textproto", written=False, why="no program was compiled for a GPU"
    )
    assert not autotune.exists()
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| Gated DeltaNet | 1×96 | gdn_jax in_scan |" in table
    assert "`python train.py`" in table and "- fla: " in table
    assert "XLA autotune results: none written to `xla_autotune.textproto`" in table
    # --profile: each program's time by stage, every stage of its form found in the trace,
    # each kernel of impl="mosaic_gpu" its own.
    chunked = ("factors", "state_pass", "factors_again", "state_pass_backward", "input_grads")
    kernels = ("gdn_mosaic_factors", "gdn_mosaic_states", "gdn_mosaic_reverse", "gdn_mosaic_grads")
    for impl in measured:
        profile = rows[impl]["fwd+bwd"]["stages"]
        assert profile["where"] == "host" and profile["calls"] == 3, profile
        stages = kernels if impl == "gdn_jax mosaic_gpu" else chunked
        assert all(profile["ms_per_call"].get(s, 0) > 0 for s in stages), profile
    by_stage = table.split("by stage")[1]
    assert "| op | B×T | implementation | factors | state_pass | " in by_stage
    assert ("gdn_mosaic_grads" in by_stage) == INTERPRETS


def test_a_form_that_fails_is_recorded_and_the_rest_measured(tmp_path, monkeypatch):
    """A kernel that fails to compile on the GPU must not end the run that measures the
    rest."""
    check = load_check()
    measure = check.gdn_jax_runs

    def refuse_the_kernel(op, arrays, form, chunk, repeats, profile):
        if form == "mosaic_gpu" and op.key == "gdn":
            raise RuntimeError("out of shared memory")
        return measure(op, arrays, form, chunk, repeats, profile)

    monkeypatch.setattr(check, "gdn_jax_runs", refuse_the_kernel)
    out = ["--smoke", "--out", str(tmp_path), "--repeats", "1", "--skip-training"]
    check.main([*out, "--item", "gdn:mosaic_gpu,hoisted"])
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [row["impl"] for row in data["ops"]] == ["gdn_jax hoisted"]
    assert skipped(data)["gdn_jax mosaic_gpu Gated DeltaNet 1×96"] == (
        "RuntimeError: out of shared memory"
    )
    assert "autotune" not in data  # not asked for


@pytest.mark.slow
@pytest.mark.costly(20)
def test_the_dry_run_traces_every_program_each_in_its_own_child(tmp_path):
    """The device check's one call as prepared, down to where it needs the GPU: each
    implementation's forward and training step built at the check's shapes and traced in a
    child process of its own; what this JAX refuses is recorded as it would be there."""
    check = load_check()
    out = ["--dry-run", "--out", str(tmp_path), "--skip-training"]
    check.main([*out, "--item", "kda@4x4096:associative,mosaic_gpu,jla,fla"])
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["ops"] == []  # nothing ran
    traced = {row["impl"]: row for row in data["dry_run"]}
    ours = ["gdn_jax associative", "gdn_jax mosaic_gpu"][: 1 + INTERPRETS]
    assert [impl for impl in traced if impl != "jla"] == ours  # in the order named
    for row in traced.values():
        assert row["shape"] == "4×4096"
        assert row["fwd+bwd"]["equations"] > row["fwd"]["equations"] > 0, row
    why = skipped(data)
    assert why["fla"] == "a dry run traces JAX programs only"
    # jla where it is installed (its kernels traced as if on a Hopper GPU), else why not.
    assert "jla" in traced or any(what.startswith("jla") for what in why)
    if not INTERPRETS:
        assert why["gdn_jax mosaic_gpu KDA 4×4096"].startswith(
            "RuntimeError: ValueError: kda: impl='mosaic_gpu' cannot take these inputs: needs "
            "jax >= 0.11"
        )
    assert "Dry run" in (tmp_path / "gpu_check.md").read_text()


def test_the_children_s_autotune_results_are_merged_each_once(tmp_path):
    """Each stage's child writes its own process's autotune results; the check keeps one
    file with every result once, and removes the children's."""
    check = load_check()

    def result(hlo):
        return f'results {{\n  device: "sm_90"\n  hlo: "{hlo}"\n}}\n'

    out = tmp_path / "xla_autotune.textproto"
    parts = [tmp_path / f".part{i}.textproto" for i in range(3)]
    parts[0].write_text("version: 3\n" + result("a") + result("b"))
    parts[1].write_text("version: 3\n" + result("b") + result("c"))
    check.merge_autotune(parts, out)  # the third child wrote nothing
    assert out.read_text() == "version: 3\n" + result("a") + result("b") + result("c")
    assert not any(p.exists() for p in parts)
    parts[2].write_text("version: 3\n" + result("d"))
    check.merge_autotune(parts[2:], out)  # a later stage adds to what the file holds
    assert out.read_text().count("results {") == 4


def test_bad_item_is_one_error_naming_it(capsys):
    check = load_check()
    with pytest.raises(SystemExit) as exit_info:
        check.main(["--smoke", "--out", "unused", "--item", "kdx@1x96:hoisted,pallas"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        "gpu_check.py: error: --item 'kdx@1x96:hoisted,pallas': unknown op 'kdx' (one of "
        "['gdn', 'gdn2', 'kda']), implementation 'pallas' (one of ['mosaic_gpu', "
        "'associative', 'jla', 'hoisted', 'in_scan', 'fla'])"
    )


def test_the_autotune_dump_is_an_option_xla_takes_for_one_block(tmp_path):
    """The option reaches each timed program's compile (XLA refuses one it does not know)
    while the block runs, and none after."""
    check = load_check()
    path = tmp_path / "sub" / "xla_autotune.textproto"
    x = jnp.ones((8, 8))
    with check.dumping_autotune(path):
        assert check.COMPILE_OPTIONS == {"xla_gpu_dump_autotune_results_to": str(path.resolve())}
        check.jax_program(lambda a: a @ a, [x], repeats=1)
        check.COMPILE_OPTIONS["xla_gpu_dump_autotune_resultz_to"] = str(path)
        with pytest.raises(Exception, match="No such compile option"):
            check.jax_program(lambda a: a @ a + 1, [x], repeats=1)
        del check.COMPILE_OPTIONS["xla_gpu_dump_autotune_resultz_to"]
    assert check.COMPILE_OPTIONS == {} and path.parent.is_dir()


def test_the_autotune_record_counts_results_by_device(tmp_path):
    load_check()  # puts benchmarks/ on the path
    from gpu_report import autotune_record, markdown

    device = "CUDA: 9.0, Cores: 132, GPU clock: 1.98 GHz, Memory bandwidth: 4800 GB/s"
    result = f'results {{\n  device: "{device}"\n  hlo: "(f32[8]) fusion"\n  result {{\n  }}\n}}\n'
    path = tmp_path / "xla_autotune.textproto"
    path.write_text("version: 3\n" + result * 2)
    record = autotune_record(path)
    assert record == dict(
        file="xla_autotune.textproto", written=True, bytes=path.stat().st_size, results=2,
        devices=[device],
    )  # fmt: skip
    data = dict(environment={}, ops=[], training={}, skipped=[], autotune=record)
    assert f"XLA autotune results: `xla_autotune.textproto`, 2 results for {device}" in (
        markdown(data)
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
