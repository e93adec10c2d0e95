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


def test_store_load_turns_count_the_global_loads_right_after_a_global_store():
    sass = "\n".join(
        [
            line(0x00, "LDG.E R2, desc[UR4][R4.64]"),
            line(0x10, "LDG.E R3, desc[UR4][R6.64]"),
            line(0x20, "STS [R1], R2"),  # shared memory: neither
            line(0x30, "STG.E desc[UR4][R8.64], R2"),
            line(0x40, "@!P0 LDG.E R5, desc[UR4][R10.64]"),  # a turn (predicated all the same)
            line(0x50, "LDS R7, [R1]"),
            line(0x60, "STG.E desc[UR4][R8.64+0x4], R5"),
            line(0x70, "ST.E desc[UR4][R12.64], R7"),
            line(0x80, "LD.E R9, desc[UR4][R12.64+0x8]"),  # a turn: generic store, generic load
            line(0x90, "LDG.E R11, desc[UR4][R14.64]"),  # loads in a row: one turn before them
            line(0xA0, "EXIT"),
        ]
    )
    assert sass_tool.opcodes(sass)[:5] == ["LDG", "LDG", "STS", "STG", "LDG"]
    assert sass_tool.store_load_turns(sass) == 2


def test_a_cubins_disassembly_splits_into_its_functions():
    sass = "\n".join(
        [
            "Fatbin elf code:",
            "        Function : first_kernel",
            line(0x00, "STG.E desc[UR4][R2.64], R0"),
            line(0x10, "LDG.E R0, desc[UR4][R2.64]"),
            "        Function : second_kernel",
            line(0x00, "LDG.E R0, desc[UR4][R2.64]"),
            line(0x10, "STG.E desc[UR4][R2.64], R0"),
        ]
    )
    found = {name: sass_tool.store_load_turns(text) for name, text in sass_tool.functions(sass)}
    assert found == {"first_kernel": 1, "second_kernel": 0}
