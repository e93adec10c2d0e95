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
5. With --scale-gb N: the same update at the size of a real model against a dummy-loaded server,
   timed end to end and checked tensor by tensor with xxh3_64 (scale_round).
6. A colocated trainer's release and resume (release_round): torch allocates 90% of the bytes
   `/release_memory_occupation` freed; after the resume the greedy output is as before, bitwise.
"""

import argparse
import base64
import dataclasses
import io
import json
import os
import re
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

    def greedy(self):
        """A short greedy completion's tokens and logprobs: what the served bytes compute."""
        s, v = self.call("POST", "/generate", {
            "input_ids": [11, 257, 1024, 7, 99, 4000, 31, 5],
            "sampling_params": {"max_new_tokens": 8, "temperature": 0},
            "return_logprob": True})
        assert s == 200, v
        return v["output_ids"], v["meta_info"]["output_token_logprobs"]


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


def scale_round(a, tmp: Path, failures: list) -> None:
    """The colocated update at the size of a real model: `lockstep serve --load-format dummy` of
    a made-up BF16 Qwen3-MoE of about --scale-gb GB (weights only on the device), then every
    weight replaced from fresh random torch CUDA tensors in --bucket-mb buckets, each its own
    `/update_weights_from_tensor` (what slime and verl send), in each load format. Times the
    whole update from the first request to the last answer, then checks every tensor's
    xxh3_64 in the server's /weights_checksum against the trainer's own bytes."""
    import xxhash
    sys.path.insert(0, str(REPO / "scripts"))
    import make_push_checkpoint as mpc

    model = tmp / "scale"
    model.mkdir()
    c = mpc.config(mpc.layers_for(a.scale_gb))
    mpc.write_config(model, c)
    shapes = sorted(mpc.shapes(c).items())
    print(f"scale: {c['num_hidden_layers']} layers, {len(shapes)} tensors, {mpc.bytes_of(c) / 1e9:.2f} GB",
          flush=True)
    log = open(tmp / "serve_scale.log", "w")
    proc = subprocess.Popen([a.bin, "serve", "--device", "cuda", "--model-path", str(model),
                             "--load-format", "dummy", "--port", str(a.port + 1),
                             "--mem-fraction-static", "0.4", "--weights-root", str(tmp)],
                            stdout=log, stderr=subprocess.STDOUT)
    srv = Server(f"http://127.0.0.1:{a.port + 1}")
    try:
        wait_healthy(srv, proc, tmp / "serve_scale.log")
        gen = torch.Generator(device="cuda").manual_seed(2)
        for fmt in ["flattened_bucket", None]:
            before = srv.checksum()
            named = [(n, torch.randn(s, device="cuda", generator=gen, dtype=torch.bfloat16))
                     for n, s in shapes]
            torch.cuda.synchronize()
            sent = d2d = 0
            pause = client_s = 0.0
            server = {"open_s": 0.0, "hash_s": 0.0, "write_s": 0.0, "close_s": 0.0, "copy_s": 0.0}
            requests = 0
            t0 = time.perf_counter()
            for b in buckets(named, a.bucket_mb << 20):
                c0 = time.perf_counter()
                obj = flattened_bucket(b) if fmt else b
                body = {"serialized_named_tensors": [serialize(obj)], "load_format": fmt,
                        "flush_cache": True}
                client_s += time.perf_counter() - c0
                s, v = srv.call("POST", "/update_weights_from_tensor", body)
                if s != 200 or not v.get("success"):
                    raise RuntimeError(f"scale {fmt}: {s} {v}")
                del obj
                sent += v["copied_bytes"]
                d2d += v["device_to_device_bytes"]
                for k in server:
                    server[k] += v[k]
                pause = max(pause, v["commit_pause_s"])
                requests += 1
            wall = time.perf_counter() - t0
            print(f"scale load_format {fmt}: {sent / 1e9:.2f} GB ({d2d / 1e9:.2f} GB device to device) in "
                  f"{requests} requests, {wall:.2f} s end to end = {sent / 1e9 / wall:.2f} GB/s; client bucketing "
                  f"and pickling {client_s:.2f} s; server {server['copy_s']:.2f} s (opening handles "
                  f"{server['open_s']:.2f}, hashing {server['hash_s']:.2f}, hashing and committing "
                  f"{server['write_s']:.2f}, closing {server['close_s']:.2f}); longest commit pause "
                  f"{pause * 1e3:.1f} ms", flush=True)
            # The engine's own split of the last commits (written, hashes, version).
            log.flush()
            commits = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip()
                       for line in open(tmp / "serve_scale.log") if "weights committed" in line]
            for line in commits[-3:]:
                print(f"scale load_format {fmt}: {line[line.find('weights committed'):]}", flush=True)
            torch.cuda.ipc_collect()
            after = srv.checksum()
            own = {n: xxhash.xxh3_64_intdigest(t.contiguous().view(torch.uint8).cpu().numpy())
                   for n, t in named}
            ok = compare(failures, f"scale {fmt}", before, after, own, "the trainer's bytes")
            print(f"scale load_format {fmt}: {'OK' if ok else 'MISMATCH'}: every tensor's "
                  f"xxh3_64 in /weights_checksum equals the trainer's bytes", flush=True)
            del named
            torch.cuda.empty_cache()
    finally:
        stop(proc, log)


def release_round(a, tmp: Path, model: Path, failures: list) -> None:
    """A colocated trainer's turn (verl, slime): `/release_memory_occupation` of the weights and
    the KV cache frees their device memory; this torch process (the trainer) then allocates at
    least 90% of the released bytes and frees them; after `/resume_memory_occupation` the
    server (weights restored from `--enable-weights-cpu-backup`) must compute the greedy tokens
    and logprobs it computed before, bit for bit."""
    log = open(tmp / "serve_release.log", "w")
    proc = subprocess.Popen([a.bin, "serve", "--device", "cuda", "--model-path", str(model),
                             "--port", str(a.port), "--weights-root", str(tmp),
                             "--enable-weights-cpu-backup"],
                            stdout=log, stderr=subprocess.STDOUT)
    srv = Server(f"http://127.0.0.1:{a.port}")
    try:
        wait_healthy(srv, proc, tmp / "serve_release.log")
        before = srv.greedy()
        torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info()[0]
        s, v = srv.call("POST", "/release_memory_occupation", {"tags": ["weights", "kv_cache"]})
        if s != 200 or not v.get("success"):
            failures.append(f"release answered {s}: {v}")
            return
        released = int(v["bytes"])
        free_after = torch.cuda.mem_get_info()[0]
        want = released * 9 // 10
        try:
            held = torch.empty(want, dtype=torch.uint8, device="cuda")
            held.fill_(1)
            torch.cuda.synchronize()
            del held
        except torch.cuda.OutOfMemoryError as e:
            failures.append(f"release: torch could not allocate 90% of the {released} released bytes: {e}")
        torch.cuda.empty_cache()
        print(f"release: {released / 1e9:.2f} GB released (free {free_before / 1e9:.2f} -> "
              f"{free_after / 1e9:.2f} GB); torch allocated {want / 1e9:.2f} GB and freed it", flush=True)
        s, v = srv.call("POST", "/resume_memory_occupation", {"tags": ["weights", "kv_cache"]})
        if s != 200 or not v.get("success"):
            failures.append(f"resume answered {s}: {v}")
            return
        after = srv.greedy()
        if after != before:
            failures.append(f"release/resume: the greedy completion differs: {before} -> {after}")
        else:
            print("release/resume: greedy tokens and logprobs as before, bitwise", flush=True)
    finally:
        stop(proc, log)


def stop(proc, log) -> None:
    """Ends a server started by this script and closes its log."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def push_round(a, srv, pushed: Path, label: str, failures: list) -> None:
    """`lockstep push` of the checkpoint `pushed`, checked against its disk load: the same
    checksum and the same greedy tokens and logprobs."""
    before = srv.checksum()
    out = subprocess.run([a.bin, "push", "--server", srv.url, "--checkpoint", str(pushed)],
                         capture_output=True, text=True)
    print(f"{label}: " + " | ".join(line for line in out.stdout.splitlines() + out.stderr.splitlines()
                                    if "GB/s" in line or "rror" in line or "paused" in line), flush=True)
    if out.returncode != 0:
        raise RuntimeError(f"{label}: lockstep push failed: {out.stderr[-2000:]}")
    after, written = srv.checksum(), srv.greedy()
    ok = compare(failures, label, before, after, disk_load(srv, pushed), "the disk load")
    ok &= same_output(failures, label, written, srv.greedy())
    print(f"{label}: {'OK' if ok else 'MISMATCH'} (checksum {after['overall']})", flush=True)


def send_ipc(srv, named, fmt, limit: int, session: bool):
    """`named` through /update_weights_from_tensor in buckets of at most `limit` bytes (`fmt`:
    the load format), inside one /begin_weight_update .. /end_weight_update when `session`.
    Returns (bytes sent, bytes that never went through the host, the server's copy seconds,
    the mode it reported, wall seconds)."""
    if session:
        s, v = srv.call("POST", "/begin_weight_update", {})
        if s != 200:
            raise RuntimeError(f"begin_weight_update: {s} {v}")
    sent, d2d, copy_s, mode, t0 = 0, 0, 0.0, "one update", time.perf_counter()
    for b in buckets(named, limit):
        obj = flattened_bucket(b) if fmt else b
        body = {"serialized_named_tensors": [serialize(obj)], "load_format": fmt,
                "flush_cache": True}
        s, v = srv.call("POST", "/update_weights_from_tensor", body)
        if s != 200 or not v.get("success"):
            raise RuntimeError(f"{fmt}: {s} {v}")
        sent += v["copied_bytes"]
        d2d += v["device_to_device_bytes"]
        copy_s += v["copy_s"]
        mode = v.get("mode", "one update")
    if session:
        s, v = srv.call("POST", "/end_weight_update", {})
        if s != 200:
            raise RuntimeError(f"end_weight_update: {s} {v}")
    return sent, d2d, copy_s, mode, time.perf_counter() - t0


def check_against_disk(srv, failures, label, before, named, ref: Path, model: Path) -> None:
    """The served weights after an update of `named` equal the same tensors loaded from disk
    (written as a checkpoint at `ref`): the same checksum, and so the same greedy tokens and
    logprobs; no tensor kept its checksum from `before`."""
    after, written = srv.checksum(), srv.greedy()
    ref = reference_checkpoint(ref, model, named)
    ok = compare(failures, label, before, after, disk_load(srv, ref), "the disk load")
    ok &= same_output(failures, label, written, srv.greedy())
    print(f"{label}: {'OK' if ok else 'MISMATCH'} "
          f"(checksum {after['overall']}, version {after['weight_version']})", flush=True)


def quantized_round(a, tmp: Path, model: Path, tensors, pushed: Path, failures: list) -> None:
    """A server that quantizes its experts to NVFP4 (`--quantization nvfp4_online`) updated with
    BF16 tensors: CUDA IPC in one request (every gate/up pair complete, so quantized on the
    device), then through a session in buckets (pairs split across buckets wait and are
    quantized on the host), then `lockstep push` (into the device shadow, quantized there),
    then the same push in place (no shadow, most slots spilled, read back at the commit).
    Each must equal the disk load of the same BF16 checkpoint, which the server quantizes with
    the same recipe: checksum, and a greedy completion's tokens and logprobs."""
    log = open(tmp / "serve_nvfp4.log", "w")
    proc = subprocess.Popen([a.bin, "serve", "--device", "cuda", "--model-path", str(model),
                             "--port", str(a.port), "--weights-root", str(tmp),
                             "--quantization", "nvfp4_online"],
                            stdout=log, stderr=subprocess.STDOUT)
    srv = Server(f"http://127.0.0.1:{a.port}")
    try:
        wait_healthy(srv, proc, tmp / "serve_nvfp4.log")
        gen = torch.Generator(device="cuda").manual_seed(3)
        for round_, (label, limit, session) in enumerate(
                [("one request", 1 << 40, False), ("session", a.bucket_mb << 20, True)]):
            before = srv.checksum()
            named = [(n, (torch.randn(s, device="cuda", generator=gen) * 0.02).to(DTYPES[d]))
                     for n, d, s in tensors]
            torch.cuda.synchronize()
            sent, d2d, _, _, wall = send_ipc(srv, named, "flattened_bucket", limit, session)
            label = f"nvfp4 experts, IPC {label}"
            print(f"{label}: {sent / 1e9:.2f} GB ({d2d / 1e9:.2f} GB never through the host) in "
                  f"{wall:.2f} s", flush=True)
            check_against_disk(srv, failures, label, before, named, tmp / f"nvfp4_ref{round_}", model)
            del named
            torch.cuda.empty_cache()
        push_round(a, srv, pushed, "nvfp4 experts, push (shadow)", failures)
        for line in open(tmp / "serve_nvfp4.log"):
            if "quantiz" in line and "WARN" in line:
                failures.append(f"nvfp4: {line.strip()[-300:]}")
        stop(proc, log)
        # In place, most slots spilled in their stored (quantized) form and read back at the
        # commit through host memory.
        log = open(tmp / "serve_nvfp4_in_place.log", "w")
        proc = subprocess.Popen([a.bin, "serve", "--device", "cuda", "--model-path", str(model),
                                 "--port", str(a.port), "--weights-root", str(tmp),
                                 "--quantization", "nvfp4_online", "--weight-update-shadow", "off",
                                 "--max-prepared-weight-bytes", str(256 << 20)],
                                stdout=log, stderr=subprocess.STDOUT)
        wait_healthy(srv, proc, tmp / "serve_nvfp4_in_place.log")
        push_round(a, srv, pushed, "nvfp4 experts, push (in place, spilled)", failures)
    finally:
        stop(proc, log)


def reference_checkpoint(ref: Path, model: Path, named) -> Path:
    """`named` written as a checkpoint of the served model's config at `ref`."""
    ref.mkdir()
    for f in ("config.json", "tokenizer.json"):
        if (model / f).exists():
            shutil.copy(model / f, ref / f)
    write_safetensors(ref / "model.safetensors", named)
    return ref


def disk_load(srv, ref: Path) -> dict:
    """Loads `ref` with /update_weights_from_disk; the served hash of each tensor."""
    s, v = srv.call("POST", "/update_weights_from_disk", {"model_path": str(ref)})
    if s != 200:
        raise RuntimeError(f"update_weights_from_disk: {s} {v}")
    return {n: int(h, 16) for n, h in srv.checksum()["tensors"].items()}


def same_output(failures, label, written, loaded) -> bool:
    """The greedy completion after the update equals the one after the disk load, bitwise."""
    if written != loaded:
        failures.append(f"{label}: the greedy completion differs from the disk load's: "
                        f"{written} against {loaded}")
    return written == loaded


def compare(failures, label, before, after, want, source) -> bool:
    """`after` (a /weights_checksum answer) holds the hash `want` gives each tensor (from
    `source`), and no tensor kept its hash from `before`; failures are recorded."""
    got = {n: int(h, 16) for n, h in after["tensors"].items()}
    differ = [n for n, h in want.items() if got.get(n) != h]
    # A quantized slot's scalars may keep their value: `input_scale` is always 1.0, and a
    # `weight_scale_2` comes from an amax that new random weights can repeat.
    scalar = (".input_scale", ".weight_scale_2")
    kept = [n for n, h in after["tensors"].items()
            if before["tensors"].get(n) == h and not n.endswith(scalar)]
    if differ:
        failures.append(f"{label}: {len(differ)} tensors differ from {source}, e.g. {differ[:3]}")
    if kept:
        failures.append(f"{label}: {len(kept)} tensors kept their old checksum, e.g. {kept[:3]}")
    return not differ and not kept


def wait_healthy(srv, proc, log):
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}); see {log}")
        try:
            if srv.call("GET", "/health", timeout=5)[0] == 200:
                return
        except Exception:
            pass
        time.sleep(1)
    raise RuntimeError("the server did not become healthy in 600 s")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=".bin/lockstep")
    ap.add_argument("--gb", type=float, default=2.0, help="size of the made-up model")
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--port", type=int, default=30571)
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    ap.add_argument("--scale-gb", type=float, default=0,
                    help="then the timed round at this size (dummy-loaded server, no disk)")
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
        wait_healthy(srv, proc, tmp / "serve.log")
        gen = torch.Generator(device="cuda").manual_seed(1)
        # The third round stages flattened buckets into a session (/begin_weight_update ..
        # /end_weight_update): into a shadow copy on the device, when the device holds one.
        for round_, (fmt, session) in enumerate([(None, False), ("flattened_bucket", False),
                                                 ("flattened_bucket", True)]):
            before = srv.checksum()
            named = [(n, (torch.randn(s, device="cuda", generator=gen) * 0.02).to(DTYPES[d]))
                     for n, d, s in tensors]
            torch.cuda.synchronize()
            sent, d2d, copy_s, mode, wall = send_ipc(srv, named, fmt, a.bucket_mb << 20, session)
            fmt = f"{fmt} ({'session, ' + mode if session else 'one update per request'})"
            print(f"load_format {fmt}: {sent / 1e9:.2f} GB ({d2d / 1e9:.2f} GB device to device) in {wall:.2f} s "
                  f"= {sent / 1e9 / wall:.2f} GB/s end to end (server side {copy_s:.2f} s)", flush=True)
            # The same tensors through the disk path: the server must hold the same bytes, so
            # it must also compute the same tokens and logprobs from them.
            check_against_disk(srv, failures, f"load_format {fmt}", before, named, tmp / f"ref{round_}",
                               model)
            del named
            torch.cuda.empty_cache()
        # `lockstep push` of a new checkpoint: BF16 buckets go through a device shadow as
        # device tensors (uploaded, hashed on the device); checked against the disk load.
        named = [(n, (torch.randn(s, device="cuda", generator=gen) * 0.02).to(DTYPES[d]))
                 for n, d, s in tensors]
        pushed = reference_checkpoint(tmp / "pushed", model, named)
        del named
        push_round(a, srv, pushed, "push (shadow)", failures)
        # A payload the server must refuse: a non-contiguous tensor.
        t = torch.zeros(16, 8, device="cuda", dtype=torch.bfloat16).t()
        s, v = srv.call("POST", "/update_weights_from_tensor",
                        {"serialized_named_tensors": [serialize([(tensors[0][0], t)])]})
        if s != 400:
            failures.append(f"a non-contiguous tensor answered {s}: {v}")
        stop(proc, log)
        # The same push into a server with no shadow and a 256 MiB bound on prepared slots:
        # written in place, most slots waiting in the spill file and read back at the commit:
        # before the pause (onto the device), during it (no read-ahead room), and keeping an
        # undo file of what it overwrites.
        for label, extra in [("read ahead", []),
                             ("read in the pause", ["--max-read-ahead-weight-bytes", "0"]),
                             ("with rollback", ["--weight-update-rollback"])]:
            name = "serve_in_place_" + label.replace(" ", "_") + ".log"
            log = open(tmp / name, "w")
            proc = subprocess.Popen([a.bin, "serve", "--device", "cuda", "--model-path", str(model),
                                     "--port", str(a.port), "--weights-root", str(tmp),
                                     "--weight-update-shadow", "off",
                                     "--max-prepared-weight-bytes", str(256 << 20)] + extra,
                                    stdout=log, stderr=subprocess.STDOUT)
            wait_healthy(srv, proc, tmp / name)
            push_round(a, srv, pushed, f"push (in place, spilled, {label})", failures)
            stop(proc, log)
            for line in open(tmp / name):
                if "in-place commit" in line or "weights committed" in line:
                    print(f"  {label}: {line.strip()[-220:]}", flush=True)
        quantized_round(a, tmp, model, tensors, pushed, failures)
        release_round(a, tmp, model, failures)
        if a.scale_gb > 0:
            scale_round(a, tmp, failures)
    except Exception as e:  # noqa: BLE001
        failures.append(str(e))
    finally:
        stop(proc, log)
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
