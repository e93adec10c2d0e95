#!/usr/bin/env python3
"""Writes tests/data/tensor_ipc/*.b64: `/update_weights_from_tensor` payloads as SGLang sends
them, made without torch.

    python3 scripts/make_tensor_ipc_fixtures.py

SGLang's `MultiprocessingSerializer.serialize(obj, output_str=True)` is
`base64(ForkingPickler(buf).dump(obj))`: ForkingPickler is `pickle.Pickler` (default protocol,
4 on Python 3.8-3.13) plus torch's reducers. For a CUDA tensor torch's `reduce_tensor` returns
`(rebuild_cuda_tensor, (type(tensor), tensor.size(), tensor.stride(), tensor.storage_offset(),
type(storage), tensor.dtype, device, handle, storage_size_bytes, storage_offset_bytes,
requires_grad, ref_counter_handle, ref_counter_offset, event_handle, event_sync_required))`
(torch/multiprocessing/reductions.py). The stand-ins below have the same module and qualified
names as torch's objects and reduce the same way, so pickle writes the same opcodes:
- `torch.Size` reduces to `(torch.Size, (tuple(self),))`; a dtype reduces to its name, so it is
  written as the global `torch.bfloat16`;
- `type(tensor)` is the global `torch.Tensor`, `type(storage)` `torch.storage.TypedStorage`;
- the storage handle is torch >= 2.2's `shareIpcHandle` string: a version byte, `c` (a
  cudaMalloc block), then the 64-byte cudaIpcMemHandle_t;
- SGLang's `monkey_patch_torch_reductions` pickles the function as
  `sglang.srt.utils.patch_torch._rebuild_cuda_tensor_modified` with the device as a UUID string;
- FlattenedTensorMetadata and LocalSerializedTensor are SGLang's dataclasses (pickled as
  NEWOBJ + BUILD of their `__dict__`).
The handles are made-up bytes: the fixtures test the reader, not a GPU.
"""

import base64
import dataclasses
import pickle
import sys
import types
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "tensor_ipc"
PROTOCOL = 4  # pickle.DEFAULT_PROTOCOL of Python 3.8-3.13, what ForkingPickler uses


def module(name: str) -> types.ModuleType:
    # Parents too: pickle imports the dotted name, which needs every package above it.
    parts = name.split(".")
    for i in range(1, len(parts)):
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    m = sys.modules.get(name) or types.ModuleType(name)
    sys.modules[name] = m
    return m


torch = module("torch")
torch_storage = module("torch.storage")
reductions = module("torch.multiprocessing.reductions")
patch_torch = module("sglang.srt.utils.patch_torch")
tensor_bucket = module("sglang.srt.weight_sync.tensor_bucket")
weight_updater = module("sglang.srt.model_executor.model_runner_components.weight_updater")


class Size(tuple):
    def __reduce__(self):
        return (Size, (tuple(self),))


Size.__module__, Size.__qualname__ = "torch", "Size"
torch.Size = Size


class dtype:
    __module__ = "torch"

    def __init__(self, name):
        self.name = name

    def __reduce__(self):
        return self.name


for _name in ["bfloat16", "float32", "uint8", "float8_e4m3fn", "complex64"]:
    setattr(torch, _name, dtype(_name))


def named(mod, name, obj):
    obj.__module__, obj.__qualname__, obj.__name__ = mod.__name__, name, name
    setattr(mod, name, obj)
    return obj


Tensor = named(torch, "Tensor", type("Tensor", (), {}))
TypedStorage = named(torch_storage, "TypedStorage", type("TypedStorage", (), {}))
rebuild_cuda_tensor = named(reductions, "rebuild_cuda_tensor", lambda *a: None)
rebuild_tensor = named(reductions, "rebuild_tensor", lambda *a: None)
rebuild_storage_filename = named(reductions, "rebuild_storage_filename", lambda *a: None)
rebuild_patched = named(patch_torch, "_rebuild_cuda_tensor_modified", lambda *a: None)


def mem_handle(seed: int) -> bytes:
    return bytes([2]) + b"c" + bytes((seed + i) % 256 for i in range(64))


def event_handle(seed: int) -> bytes:
    return bytes((seed * 7 + i) % 256 for i in range(64))


class CudaTensor:
    """What torch's reduce_tensor gives for a CUDA tensor (its args, verbatim)."""

    def __init__(self, shape, dt, handle_seed, offset=0, storage_offset_bytes=0,
                 stride=None, ref_offset=0, fn=rebuild_cuda_tensor, device=0,
                 storage_bytes=None):
        itemsize = {"bfloat16": 2, "float32": 4, "uint8": 1, "float8_e4m3fn": 1,
                    "complex64": 8}[dt]
        numel = 1
        for d in shape:
            numel *= d
        if stride is None:
            stride, acc = [], 1
            for d in reversed(shape):
                stride.insert(0, acc)
                acc *= d
        size_bytes = storage_bytes or (offset + numel) * itemsize
        self.fn = fn
        self.args = (Tensor, Size(shape), tuple(stride), offset, TypedStorage,
                     getattr(torch, dt), device, mem_handle(handle_seed), size_bytes,
                     storage_offset_bytes, False, b"/torch_4242_1234567_0", ref_offset,
                     event_handle(handle_seed), True)

    def __reduce__(self):
        return (self.fn, self.args)


class CpuTensor:
    """torch's reduce_tensor for a CPU tensor with the file_system sharing strategy."""

    class Storage:
        def __reduce__(self):
            return (rebuild_storage_filename,
                    (TypedStorage, b"/torch_manager", b"/torch_4242_99", 256))

    def __reduce__(self):
        return (rebuild_tensor, (Tensor, CpuTensor.Storage(), (0, Size([128]), (1,), False)))


@dataclasses.dataclass
class FlattenedTensorMetadata:
    name: str
    shape: Size
    dtype: dtype
    start_idx: int
    end_idx: int
    numel: int


named(tensor_bucket, "FlattenedTensorMetadata", FlattenedTensorMetadata)


@dataclasses.dataclass
class LocalSerializedTensor:
    values: list


named(weight_updater, "LocalSerializedTensor", LocalSerializedTensor)


class Forbidden:
    def __reduce__(self):
        import os
        return (os.system, ("true",))


def dumps(obj) -> bytes:
    return pickle.dumps(obj, protocol=PROTOCOL)


def write(name: str, obj) -> None:
    (OUT / f"{name}.b64").write_text(base64.b64encode(dumps(obj)).decode() + "\n")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    # Two tensors of the embedded model (configs/embedded-qwen3-moe.json); the second sits at
    # element 16 of its storage, which sits 512 bytes into its allocation.
    write("direct", [
        ("model.norm.weight", CudaTensor([128], "bfloat16", 1)),
        ("model.layers.0.mlp.gate.weight",
         CudaTensor([8, 128], "bfloat16", 2, offset=16, storage_offset_bytes=512, ref_offset=5)),
    ])
    # A bucket of the same two tensors: 256 + 2048 bytes of one uint8 tensor.
    meta = [
        FlattenedTensorMetadata("model.norm.weight", Size([128]), torch.bfloat16, 0, 256, 256),
        FlattenedTensorMetadata("model.layers.0.mlp.gate.weight", Size([8, 128]),
                                torch.bfloat16, 256, 2304, 2048),
    ]
    write("flattened_bucket", {
        "flattened_tensor": CudaTensor([2304], "uint8", 3, storage_offset_bytes=1024),
        "metadata": meta,
    })
    # sglang.srt.weight_sync.utils.update_weights: each tensor pickled on its own (patched
    # reductions: device as a UUID), wrapped per TP rank.
    inner = dumps(CudaTensor([128], "bfloat16", 4, fn=rebuild_patched,
                             device="5f3d7c1e-0000-4000-8000-000000000001"))
    write("local_serialized", [("model.norm.weight", LocalSerializedTensor(values=[inner]))])
    write("cpu_tensor", [("model.norm.weight", CpuTensor())])
    write("forbidden_global", [("model.norm.weight", Forbidden())])
    write("noncontiguous", [
        ("model.layers.0.mlp.gate.weight", CudaTensor([8, 128], "bfloat16", 5, stride=[1, 8])),
    ])
    write("unknown_name", [("model.layers.99.mlp.gate.weight", CudaTensor([8, 128], "bfloat16", 7))])
    write("wrong_shape", [("model.norm.weight", CudaTensor([64], "bfloat16", 8))])
    write("bad_dtype", [("model.norm.weight", CudaTensor([128], "complex64", 6))])
    full = dumps([("model.norm.weight", CudaTensor([128], "bfloat16", 1))])
    (OUT / "truncated.b64").write_text(base64.b64encode(full[: len(full) // 2]).decode() + "\n")


if __name__ == "__main__":
    main()
