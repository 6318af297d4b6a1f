"""The model of a kernel's time from its machine code (``gdn_jax.gpu_compile.sass``), on
written SASS whose floors can be counted by hand: loops by their trips (read from the code,
or given), a wait's retries left out, a warp-specialised kernel's longest path and summed
issue, and a wave of programs sharing an SM. The model on real kernels is in
``tests/test_gpu_compile.py`` and ``tests/ops/test_mosaic_compile.py``."""

import pytest

from gdn_jax.gpu_compile import sass
from gdn_jax.gpu_compile.kernels import Limits


def code(*lines):
    """SASS as Mosaic GPU dumps it: ``(stall, text)`` instructions and ``".L_x_n:"`` labels."""
    out, address = [], 0
    for line in lines:
        if isinstance(line, str):
            out.append(line)
            continue
        stall, text = line
        out.append(f"   -:-:-:Y:{stall:02d}        /*{address:04x}*/    {text} ;")
        address += 16
    return "\n".join(out)


def counted_loop(trips_text, body_stall=10):
    """A loop of one body instruction, a step of 1 from 0, and a compare with ``trips_text``."""
    return [
        (1, "IMAD.MOV.U32 R4, RZ, RZ, RZ"),
        ".L_x_0:",
        (body_stall, "FFMA R1, R2, R3, R1"),
        (1, "VIADD R4, R4, 0x1"),
        (1, f"ISETP.NE.U32.AND P0, PT, R4, {trips_text}, PT"),
        (2, "@P0 BRA `(.L_x_0)"),
        (3, "EXIT"),
    ]


def test_a_loop_counted_to_a_constant_is_read_and_weighs_its_trips():
    floor = sass.floor(code(*counted_loop("0x7")))
    assert floor.stall_path == 1 + 7 * (10 + 1 + 1 + 2) + 3
    assert floor.issue_count == 1 + 7 * 4 + 1


def test_a_count_down_loop_and_a_uniform_compare_copied_to_a_predicate_are_read():
    down = code(
        (1, "UMOV UR50, 0xf40"),
        ".L_x_0:",
        (5, "UIADD3 UR50, UR50, -0x40, URZ"),
        (1, "UISETP.NE.U32.AND UP0, UPT, UR50, -0x40, UPT"),
        (1, "PLOP3.LUT P1, PT, PT, PT, UP0, 0x80, 0x0"),
        (1, "@P1 BRA `(.L_x_0)"),
        (1, "EXIT"),
    )
    # From 3904 down by 64 to -64: 62 trips.
    assert sass.floor(down).stall_path == 1 + 62 * 8 + 1


def test_loops_of_two_trips_on_a_flag_and_a_step_through_a_copy_are_read():
    flag = code(
        (1, "PLOP3.LUT P0, PT, PT, PT, PT, 0x80, 0x0"),  # true
        ".L_x_0:",
        (1, "P2R R176, PR, RZ, 0x1"),  # kept in a register
        (6, "FFMA R1, R2, R3, R1"),
        (1, "ISETP.NE.AND P6, PT, R176, RZ, PT"),
        (1, "PLOP3.LUT P0, PT, PT, PT, PT, 0x8, 0x0"),  # false
        (1, "@P6 BRA `(.L_x_0)"),
        (1, "EXIT"),
    )
    assert sass.floor(flag).stall_path == 1 + 2 * 10 + 1
    copied = code(
        (1, "UMOV UR4, URZ"),
        ".L_x_0:",
        (2, "UIADD3 UR44, UR4, 0x1, URZ"),
        (1, "UMOV UR4, UR44"),
        (1, "UISETP.NE.U32.AND UP1, UPT, UR44, 0x40, UPT"),
        (1, "PLOP3.LUT P1, PT, PT, PT, UP1, 0x80, 0x0"),
        (1, "@P1 BRA `(.L_x_0)"),
        (1, "EXIT"),
    )
    assert sass.floor(copied).stall_path == 1 + 64 * 6 + 1
    carried = code(
        (1, "UMOV UR4, URZ"),
        ".L_x_0:",
        (2, "UIADD3 UR4, UP1, UR4, 0x200, URZ"),  # with a carry out
        (1, "UISETP.NE.U32.AND UP0, UPT, UR4, 0x800, UPT"),
        (1, "PLOP3.LUT P3, PT, PT, PT, UP0, 0x80, 0x0"),
        (1, "@P3 BRA `(.L_x_0)"),
        (1, "EXIT"),
    )
    assert sass.floor(carried).stall_path == 1 + 4 * 5 + 1
    uniform = code(  # the flag in a uniform predicate, cleared by a table of bit 7 clear
        (1, "UPLOP3.LUT UP0, UPT, UPT, UPT, UPT, 0x80, 0x0"),  # true
        ".L_x_0:",
        (1, "PLOP3.LUT P3, PT, PT, PT, UP0, 0x80, 0x0"),
        (6, "FFMA R1, R2, R3, R1"),
        (1, "UPLOP3.LUT UP0, UPT, UPT, UPT, UPT, 0x40, 0x0"),  # false
        (1, "@P3 BRA `(.L_x_0)"),
        (1, "EXIT"),
    )
    assert sass.floor(uniform).stall_path == 1 + 2 * 9 + 1
    in_a_bit = code(  # and copied into bit 25 of a register, tested before the branch
        (1, "UPLOP3.LUT UP0, UPT, UPT, UPT, UPT, 0x80, 0x0"),
        ".L_x_0:",
        (1, "PLOP3.LUT P0, PT, PT, PT, UP0, 0x80, 0x0"),
        (1, "LOP3.LUT R0, R0, 0xfdffffff, RZ, 0xc0, !PT"),
        (1, "@P0 LOP3.LUT R0, R0, 0x2000000, RZ, 0xfc, !PT"),
        (6, "FFMA R1, R2, R3, R1"),
        (1, "LOP3.LUT P3, RZ, R0, 0x2000000, RZ, 0xc0, !PT"),
        (1, "UPLOP3.LUT UP0, UPT, UPT, UPT, UPT, 0x40, 0x0"),
        (1, "@P3 BRA `(.L_x_0)"),
        (1, "EXIT"),
    )
    assert sass.floor(in_a_bit).stall_path == 1 + 2 * 12 + 1


def test_a_bound_read_at_run_time_must_be_given():
    runtime = code(
        (1, "LDG.E R7, desc[UR4][R2.64]"),
        (1, "IADD3 R7, R7, 0x2, RZ"),
        ".L_x_0:",
        (4, "FFMA R1, R2, R3, R1"),
        (1, "IADD3 R7, R7, -0x1, RZ"),
        (1, "ISETP.NE.U32.AND P2, PT, R7, RZ, PT"),
        (1, "@P2 BRA `(.L_x_0)"),
        (1, "EXIT"),
    )
    with pytest.raises(sass.OpenLoops, match="1 loops read their bounds at run time"):
        sass.floor(runtime)
    assert sass.open_loops(runtime) == 1
    assert sass.floor(runtime, (3,)).stall_path == 2 + 3 * 7 + 1
    with pytest.raises(sass.OpenLoops, match="trips given for 2"):
        sass.floor(runtime, (3, 3))


def test_a_wait_s_retries_are_left_out_in_line_and_out_of_line():
    waits = code(
        (2, "SYNCS.ARRIVE.TRANS64 RZ, [UR4], R5"),
        ".L_x_0:",
        (2, "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R24+URZ], R5"),
        (5, "@!P1 BRA `(.L_x_0)"),  # in line: counted once
        (2, "SYNCS.PHASECHK.TRANS64.TRYWAIT P2, [R24+URZ], R6"),
        (5, "@!P2 BRA `(.L_x_2)"),
        ".L_x_1:",
        (7, "FFMA R1, R2, R3, R1"),
        (1, "EXIT"),
        ".L_x_2:",  # out of line, after the last EXIT: the retry and its way back
        (9, "@!P2 SYNCS.PHASECHK.TRANS64 P2, [R24+URZ], R6"),
        (9, "@!P2 BRA `(.L_x_2)"),
        (9, "BRA `(.L_x_1)"),
        ".L_x_3:",
        (0, "BRA `(.L_x_3)"),
    )
    floor = sass.floor(waits)
    assert floor.stall_path == 2 + 7 + 7 + 7 + 1
    assert floor.issue_count == 7


def test_a_warp_specialised_kernel_takes_one_branch_s_path_and_every_branch_s_issue():
    specialised = code(
        (1, "ISETP.NE.U32.AND P0, PT, R5, RZ, PT"),
        (1, "@P0 BRA `(.L_x_1)"),
        (20, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24"),  # warpgroup 0
        (20, "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24"),
        (1, "EXIT"),
        ".L_x_1:",
        (3, "UTMALDG.5D [UR8], [UR4]"),  # warpgroup 1: the producer
        (1, "EXIT"),
    )
    floor = sass.floor(specialised)
    assert floor.stall_path == 1 + 1 + 20 + 20 + 1
    assert floor.issue_count == 7
    assert floor.of_wave(2) == 43 and floor.of_wave(10) == 70


def test_the_modelled_time_is_the_waves_at_their_floor_over_the_clock():
    limits = Limits(232448, 65536, 233472, 65536, sms=132, clock_ghz=2.0)
    floor = sass.Floor(stall_path=2000, issue_count=1500)
    # 264 programs: two each per SM, at one a time (two waves) or together (one, issue-bound).
    assert limits.modelled_us(floor, 1, (264, 1, 1)) == pytest.approx(2 * 2000 / 2000)
    assert limits.modelled_us(floor, 2, (264, 1, 1)) == pytest.approx(3000 / 2000)
    # Fewer programs than SMs: one wave, whatever an SM could hold.
    assert limits.modelled_us(floor, 2, (100, 1, 1)) == pytest.approx(2000 / 2000)
    assert limits.modelled_us(floor, None, (100, 1, 1)) is None
