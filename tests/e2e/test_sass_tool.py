"""scripts/sass.py's loop finder on disassembler text (the tool itself needs NVRTC and the
CUDA wheels; its parsing of cuobjdump's SASS is what these check)."""

import importlib.util
import pathlib

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "sass.py"
spec = importlib.util.spec_from_file_location("sass_tool", SCRIPT)
sass_tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sass_tool)


def line(addr, text):
    return f"        /*{addr:04x}*/                   {text} ;                 /* 0x000fe20000000f00 */"


def test_a_loop_is_the_span_from_a_backward_branch_target_to_the_branch():
    sass = "\n".join(
        [
            line(0x00, "MOV R1, c[0x0][0x28]"),
            line(0x10, "PRMT R2, R3, 0x5140, R4"),  # the loop starts here
            line(0x20, "HMMA.16816.F32 R8, R12, R16, R8"),
            line(0x30, "@!P0 LDS R5, [R6+0x10]"),
            line(0x40, "HMMA.16816.F32 R8, R12, R18, R8"),
            line(0x50, "@P1 BRA 0x10"),
            line(0x60, "BRA 0x60"),  # a branch to itself (the kernel's end): no MMA, no loop
            line(0x70, "EXIT"),
        ]
    )
    found = list(sass_tool.loops(sass))
    assert len(found) == 1
    start, end, count, mmas, ops = found[0]
    assert (start, end, count, mmas) == (0x10, 0x50, 5, 2)
    # Predicates are not opcodes; modifiers after the first dot are dropped.
    assert ops["LDS"] == 1 and ops["HMMA"] == 2 and ops["BRA"] == 1 and ops["PRMT"] == 1


def test_forward_branches_and_loops_without_mmas_are_left_out():
    sass = "\n".join(
        [
            line(0x00, "IADD3 R1, R1, 0x1, RZ"),
            line(0x10, "ISETP.GE.AND P0, PT, R1, R2, PT"),
            line(0x20, "@!P0 BRA 0x00"),  # a loop of integer work only
            line(0x30, "@P0 BRA 0x50"),  # forward
            line(0x40, "HMMA.16816.F32 R8, R12, R16, R8"),
            line(0x50, "EXIT"),
        ]
    )
    assert list(sass_tool.loops(sass)) == []
