#!/usr/bin/env python3
"""GPU check of `POST /update_weights_from_tensor` with real torch CUDA IPC handles, serialized
the way SGLang serializes them. From the repo root, on a CUDA host with PyTorch:

    /opt/torch/.venv/bin/python scripts/ipc_update_test.py --bin .bin/lockstep [--gb 2]

1. Writes a made-up BF16 Qwen3-MoE checkpoint of about --gb GB (scripts/make_push_checkpoint.py)
   and starts `lockstep serve --device cuda` on it.
2. Builds new random BF16 CUDA tensors for every weight (names, shapes and dtypes from the
   checkpoint's safetensors headers) and sends them in buckets as SGLang does:
   `base64(ForkingPickler.dumps(obj))` (MultiprocessingSerializer), load_format null (a list of
   (name, tensor)) and, with another set, `flattened_bucket` (FlattenedTensorBucket's dict).
3. Verifies each: the server's /weights_checksum after the IPC update must equal its checksum
   after loading the same tensors from disk (written as safetensors, /update_weights_from_disk),
   and differ from the checksum before.
4. Prints the copy rate (GB/s over all requests) and exits nonzero on any mismatch or error.
"""

import argparse
import base64
import dataclasses
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import types
import urllib.error
import urllib.request
from pathlib import Path

import torch
import torch.multiprocessing  # noqa: F401  (registers torch's reductions with ForkingPickler)
from multiprocessing.reduction import ForkingPickler

REPO = Path(__file__).resolve().parent.parent
DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def serialize(obj) -> str:
    """SGLang's MultiprocessingSerializer.serialize(obj, output_str=True)."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("utf-8")


def metadata_class():
    """SGLang's FlattenedTensorMetadata (a stand-in of the same module and name without sglang)."""
    try:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata
        return FlattenedTensorMetadata
    except Exception:
        pass
    name = "sglang.srt.weight_sync.tensor_bucket"
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))

    @dataclasses.dataclass
    class FlattenedTensorMetadata:
        name: str
        shape: torch.Size
        dtype: torch.dtype
        start_idx: int
        end_idx: int
        numel: int

    FlattenedTensorMetadata.__module__ = name
    FlattenedTensorMetadata.__qualname__ = "FlattenedTensorMetadata"
    setattr(sys.modules[name], "FlattenedTensorMetadata", FlattenedTensorMetadata)
    return FlattenedTensorMetadata


def flattened_bucket(named):
    """FlattenedTensorBucket(named_tensors) as {"flattened_tensor", "metadata"} (SGLang/slime)."""
    meta_cls = metadata_class()
    flats, metadata, at = [], [], 0
    for name, t in named:
        f = t.flatten().view(torch.uint8)
        metadata.append(meta_cls(name=name, shape=t.shape, dtype=t.dtype, start_idx=at,
                                 end_idx=at + f.numel(), numel=f.numel()))
        flats.append(f)
        at += f.numel()
    return {"flattened_tensor": torch.cat(flats, dim=0), "metadata": metadata}


def headers(model: Path):
    """(name, dtype, shape) of every tensor of the checkpoint, in file order."""
    out = []
    for f in sorted(model.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            h = json.loads(fh.read(n))
        for name, v in h.items():
            if name != "__metadata__":
                out.append((name, v["dtype"], v["shape"]))
    return out


def write_safetensors(path: Path, named):
    header, offset, blobs = {}, 0, []
    for name, t in named:
        b = t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
        dt = {v: k for k, v in DTYPES.items()}[t.dtype]
        header[name] = {"dtype": dt, "shape": list(t.shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(h)))
        fh.write(h)
        for b in blobs:
            fh.write(b)


class Server:
    def __init__(self, url):
        self.url = url

    def call(self, method, path, body=None, timeout=600):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")

    def checksum(self):
        s, v = self.call("GET", "/weights_checksum")
        assert s == 200, v
        return v


def buckets(named, limit):
    cur, size = [], 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if cur and size + n > limit:
            yield cur
            cur, size = [], 0
        cur.append((name, t))
        size += n
    if cur:
        yield cur


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=".bin/lockstep")
    ap.add_argument("--gb", type=float, default=2.0, help="size of the made-up model")
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--port", type=int, default=30571)
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="lockstep-ipc-"))
    model = tmp / "model"
    subprocess.run([sys.executable, str(REPO / "scripts/make_push_checkpoint.py"), "--out",
                    str(model), "--gb", str(a.gb)], check=True)
    tensors = headers(model)
    total = sum(torch.Size(s).numel() * DTYPES[d].itemsize for _, d, s in tensors)
    print(f"model: {len(tensors)} tensors, {total / 1e9:.2f} GB", flush=True)
    log = open(tmp / "serve.log", "w")
    proc = subprocess.Popen([a.bin, "serve", "--device", "cuda", "--model-path", str(model),
                             "--port", str(a.port), "--weights-root", str(tmp)],
                            stdout=log, stderr=subprocess.STDOUT)
    srv = Server(f"http://127.0.0.1:{a.port}")
    failures = []
    try:
        for _ in range(600):
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited ({proc.returncode}); see {tmp}/serve.log")
            try:
                if srv.call("GET", "/health", timeout=5)[0] == 200:
                    break
            except Exception:
                pass
            time.sleep(1)
        else:
            raise RuntimeError("the server did not become healthy in 600 s")
        gen = torch.Generator(device="cuda").manual_seed(1)
        for round_, fmt in enumerate([None, "flattened_bucket"]):
            before = srv.checksum()
            named = [(n, (torch.randn(s, device="cuda", generator=gen) * 0.02).to(DTYPES[d]))
                     for n, d, s in tensors]
            torch.cuda.synchronize()
            sent, t0 = 0, time.perf_counter()
            copy_s = 0.0
            for b in buckets(named, a.bucket_mb << 20):
                obj = flattened_bucket(b) if fmt else b
                body = {"serialized_named_tensors": [serialize(obj)], "load_format": fmt,
                        "flush_cache": True}
                s, v = srv.call("POST", "/update_weights_from_tensor", body)
                if s != 200 or not v.get("success"):
                    raise RuntimeError(f"{fmt}: {s} {v}")
                sent += v["copied_bytes"]
                copy_s += v["copy_s"]
            wall = time.perf_counter() - t0
            print(f"load_format {fmt}: {sent / 1e9:.2f} GB in {wall:.2f} s = {sent / 1e9 / wall:.2f} GB/s "
                  f"end to end (device->host copies {copy_s:.2f} s = {sent / 1e9 / max(copy_s, 1e-9):.2f} GB/s)",
                  flush=True)
            after = srv.checksum()
            # The same tensors through the disk path: the server must hold the same bytes.
            ref = tmp / f"ref{round_}"
            ref.mkdir()
            for f in ("config.json", "tokenizer.json"):
                if (model / f).exists():
                    shutil.copy(model / f, ref / f)
            write_safetensors(ref / "model.safetensors", named)
            s, v = srv.call("POST", "/update_weights_from_disk", {"model_path": str(ref)})
            if s != 200:
                raise RuntimeError(f"update_weights_from_disk: {s} {v}")
            disk = srv.checksum()
            differ = [n for n in disk["tensors"] if disk["tensors"][n] != after["tensors"].get(n)]
            unchanged = [n for n, h in after["tensors"].items() if before["tensors"].get(n) == h]
            if differ:
                failures.append(f"{fmt}: {len(differ)} tensors differ from the disk load, e.g. {differ[:3]}")
            if unchanged:
                failures.append(f"{fmt}: {len(unchanged)} tensors kept their old checksum, e.g. {unchanged[:3]}")
            print(f"load_format {fmt}: {'OK' if not differ and not unchanged else 'MISMATCH'} "
                  f"(checksum {after['overall']}, version {after['weight_version']})", flush=True)
            del named
            torch.cuda.empty_cache()
        # A payload the server must refuse: a non-contiguous tensor.
        t = torch.zeros(16, 8, device="cuda", dtype=torch.bfloat16).t()
        s, v = srv.call("POST", "/update_weights_from_tensor",
                        {"serialized_named_tensors": [serialize([(tensors[0][0], t)])]})
        if s != 400:
            failures.append(f"a non-contiguous tensor answered {s}: {v}")
    except Exception as e:  # noqa: BLE001
        failures.append(str(e))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        if failures or a.keep:
            print(f"kept {tmp} (serve.log)")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    for f in failures:
        print("FAIL:", f)
    print("PASS" if not failures else "FAIL")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
