"""``benchmarks/gpu_compile_report.py --autotune-results``: a file that is not there is one
error before any compile, and the report says which GPU the file's results are for beside the
target's description (XLA's autotune keys hold it, so results of another find no use)."""

import pytest
from support import benchmark_scripts


@pytest.fixture(scope="module")
def report():
    return benchmark_scripts.load("gpu_compile_report")


def test_a_missing_autotune_file_is_one_error(report, tmp_path, capsys):
    missing = tmp_path / "xla_autotune.textproto"
    with pytest.raises(SystemExit) as exit_info:
        report.main(["--autotune-results", str(missing)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"gpu_compile_report.py: error: --autotune-results {str(missing)!r} is not a file"
    )


def test_the_note_sets_the_file_s_gpus_beside_the_target_s(report, tmp_path):
    # h200.txtpb: sm_90, 132 SMs at 1.98 GHz, 4.8e12 B/s, 52428800 B of L2.
    h200 = (
        "CUDA: 9.0, Cores: 132, GPU clock: 1.98 GHz, Memory bandwidth: 4800 GB/s, L2 cache: 50 MB"
    )
    assert report.target_key("h200") == h200
    assert report.target_key("h100").replace("3350", "4800") == h200
    path = tmp_path / "xla_autotune.textproto"
    gpu = "CUDA: 9.0, Cores: 132, GPU clock: 1.98 GHz, Memory bandwidth: 4915 GB/s, L2 cache: 60 MB"
    path.write_text(f'version: 3\nresults {{\n  device: "{gpu}"\n  hlo: "x"\n}}\n')
    assert report.autotune_note(path, "h200") == (
        f"XLA autotune results from {path}: 1 results for '{gpu}'; the h200 target is "
        f"'{h200}' (a result is found only where these agree)"
    )
    binary = tmp_path / "xla_autotune.pb"
    binary.write_bytes(b"\x08\x03")
    assert report.autotune_note(binary, "h200").startswith(
        f"XLA autotune results from {binary}: 2 bytes (binary: its devices not read);"
    )
