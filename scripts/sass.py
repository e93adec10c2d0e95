#!/usr/bin/env python3
"""A kernel's SASS and its loops' instruction mix, on a machine without a GPU.

    scripts/sass.py KERNELS_DIR FUNCTION [--out FILE.sass] [--arch sm_90a]
    scripts/sass.py KERNELS_DIR --waits [--arch sm_90a]

Compiles KERNELS_DIR's common.cuh (else the checkout's) and the .cu file that defines FUNCTION (an `extern "C"`
kernel name, e.g. grouped_gemm_mma_nvfp4) as the engine does (NVRTC, `-std=c++17 -lineinfo`,
the program text of kernels.rs `Source::program_in`), assembles the PTX with ptxas and
disassembles the function. Prints ptxas's registers, spills and shared memory for it, then
every backward branch's loop that holds tensor-core instructions: its length, the MMAs in it,
instructions per MMA and the most frequent opcodes. So a kernel variant's instruction count can
be weighed before device time is spent on it (docs/gpu.md, "SASS without a GPU").

`--waits` compiles every .cu file of KERNELS_DIR and lists each function's store -> load turns:
global loads issued right after a global store in program order. A load the compiler cannot
move above a store that may alias it waits for that store's inputs, so a thread's round trips
to L2 run one after another; a small kernel with many turns on its common path is worth reading.

NVRTC comes from .cache/nvrtc (docs/gpu.md); ptxas and cuobjdump from the PyPI wheels
nvidia-cuda-nvcc and nvidia-cuda-cuobjdump, nvdisasm from nvidia-cuda-nvdisasm, installed into
.cache/sass on first use. ptxas here is the wheel's (13.0), the GPU's driver assembles the
engine's PTX with its own: close, not guaranteed the same.
"""

import collections
import ctypes
import glob
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, ".cache", "sass")
WHEELS = ["nvidia-cuda-nvcc==13.0.88", "nvidia-cuda-cuobjdump==13.2.51", "nvidia-cuda-nvdisasm==13.5.37"]


def tool(name):
    found = glob.glob(os.path.join(TOOLS, "nvidia", "cu13", "bin", name))
    if not found:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", TOOLS, *WHEELS],
            check=True,
        )
        found = glob.glob(os.path.join(TOOLS, "nvidia", "cu13", "bin", name))
    path = found[0]
    os.chmod(path, 0o755)
    return path


def nvrtc_ptx(source, name, arch):
    libs = glob.glob(os.path.join(ROOT, ".cache", "nvrtc", "nvidia", "cu13", "lib", "libnvrtc.so.*"))
    libs = [p for p in libs if "builtins" not in p]
    if not libs:
        sys.exit("no libnvrtc in .cache/nvrtc (docs/gpu.md has the pip command)")
    # libnvrtc opens libnvrtc-builtins by name: loaded first, it is found without LD_LIBRARY_PATH.
    ctypes.CDLL(glob.glob(os.path.join(os.path.dirname(libs[0]), "libnvrtc-builtins.so.*"))[0])
    lib = ctypes.CDLL(libs[0])
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None):
        sys.exit("nvrtcCreateProgram failed")
    opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17", b"-lineinfo"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc:
        sys.exit(log.value.decode())
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(prog, ptx)
    return ptx.value


def loops(sass):
    """(start, end, instructions, MMAs, opcode counts) of each backward branch's loop with MMAs."""
    ins = []
    for line in sass.splitlines():
        m = re.search(r"/\*([0-9a-f]{4,6})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    at = {a: i for i, (a, _) in enumerate(ins)}
    for i, (a, text) in enumerate(ins):
        m = re.search(r"BRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", text)
        if not m or int(m.group(1), 16) >= a or int(m.group(1), 16) not in at:
            continue
        body = ins[at[int(m.group(1), 16)] : i + 1]
        ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for _, t in body)
        mmas = ops["HMMA"] + ops["HGMMA"]
        if mmas:
            yield body[0][0], a, len(body), mmas, ops


GLOBAL_LOADS = {"LDG", "LD"}
GLOBAL_STORES = {"STG", "ST"}


def opcodes(sass):
    """The opcodes of disassembler text in program order (predicates and modifiers dropped)."""
    out = []
    for line in sass.splitlines():
        m = re.search(r"/\*[0-9a-f]{4,6}\*/\s+(.*?);", line)
        if m:
            out.append(re.sub(r"^@!?U?P\w+\s+", "", m.group(1).strip()).split()[0].split(".")[0])
    return out


def store_load_turns(sass):
    """How many times a global load follows a global store among the memory instructions."""
    mem = [o for o in opcodes(sass) if o in GLOBAL_LOADS | GLOBAL_STORES]
    return sum(1 for a, b in zip(mem, mem[1:]) if a in GLOBAL_STORES and b in GLOBAL_LOADS)


def functions(sass):
    """(name, text) of each function in a whole cubin's disassembly."""
    for part in re.split(r"\n\s*Function : ", "\n" + sass)[1:]:
        name, _, text = part.partition("\n")
        yield name.strip(), text


def compile_file(kernels, path, arch):
    """ptxas's report and the cubin of one .cu file of `kernels`, compiled as the engine does."""
    name = os.path.basename(path)
    # A variant directory without its own common.cuh takes the checkout's (as the engine does).
    common_path = os.path.join(kernels, "common.cuh")
    if not os.path.isfile(common_path):
        common_path = os.path.join(ROOT, "kernels", "common.cuh")
    source = f'{open(common_path).read()}\n#line 1 "{name}"\n{open(path).read()}'
    work = os.path.join(TOOLS, "work")
    os.makedirs(work, exist_ok=True)
    ptx, cubin = os.path.join(work, "k.ptx"), os.path.join(work, "k.cubin")
    open(ptx, "wb").write(nvrtc_ptx(source, name, arch))
    info = subprocess.run([tool("ptxas"), f"-arch={arch}", "-v", ptx, "-o", cubin],
                          capture_output=True, text=True, check=True).stderr
    return info, cubin


def disassemble(cubin, function=None):
    env = dict(os.environ, PATH=os.path.dirname(tool("nvdisasm")) + ":" + os.environ["PATH"])  # cuobjdump runs it
    fun = ["-fun", function] if function else []
    return subprocess.run([tool("cuobjdump"), "-sass", *fun, cubin],
                          capture_output=True, text=True, check=True, env=env).stdout


def main():
    args = sys.argv[1:]
    if len(args) < 2:
        sys.exit(__doc__)
    kernels, function = args[0], args[1]
    out = args[args.index("--out") + 1] if "--out" in args else None
    arch = args[args.index("--arch") + 1] if "--arch" in args else "sm_90a"
    if function == "--waits":
        rows = []
        for path in sorted(glob.glob(os.path.join(kernels, "*.cu"))):
            _, cubin = compile_file(kernels, path, arch)
            for name, text in functions(disassemble(cubin)):
                rows.append((store_load_turns(text), len(opcodes(text)), os.path.basename(path), name))
        print("| store -> load turns | instructions | file | function |")
        print("|---|---|---|---|")
        for turns, count, name, fn in sorted(rows, key=lambda r: (-r[0], r[3])):
            print(f"| {turns} | {count} | {name} | {fn} |")
        return
    # Files that name the function, tried in order until one defines it (a comment elsewhere
    # may name it too).
    files = [f for f in sorted(glob.glob(os.path.join(kernels, "*.cu")))
             if re.search(rf'\b{re.escape(function)}\b', open(f).read())]
    if not files:
        sys.exit(f"no .cu file in {kernels} names {function}")
    for path in files:
        info, cubin = compile_file(kernels, path, arch)
        if f"for {function}\n" in info + "\n":
            break
    else:
        sys.exit(f"no .cu file in {kernels} defines {function}")
    lines = info.splitlines()
    for i, line in enumerate(lines):
        if line.endswith(f"for {function}") and "Function properties" in line:
            print(*[l.replace("ptxas info    : ", "") for l in lines[i + 1 : i + 3]], sep="\n")
    sass = disassemble(cubin, function)
    if out:
        open(out, "w").write(sass)
    print("| loop | instructions | MMAs | per MMA | most frequent |")
    print("|---|---|---|---|---|")
    for start, end, count, mmas, ops in loops(sass):
        top = ", ".join(f"{k} {v}" for k, v in ops.most_common(10))
        print(f"| {start:#x}-{end:#x} | {count} | {mmas} | {count / mmas:.2f} | {top} |")


if __name__ == "__main__":
    main()
