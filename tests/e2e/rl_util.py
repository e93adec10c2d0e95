"""Helpers for the RL-surface tests: safetensors bodies written by hand (no numpy or torch
needed) and a model directory with a byte-level BPE tokenizer.json."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EMBEDDED_CONFIG = json.loads((REPO / "configs" / "embedded-qwen3-moe.json").read_text())
REFERENCE_MOE = REPO / "tests" / "data" / "reference" / "qwen3_moe"


def safetensors_f32(tensors: dict[str, tuple[list[int], list[float]]]) -> bytes:
    """A safetensors file of F32 tensors: {name: (shape, flat values)}."""
    header: dict = {}
    data = b""
    for name, (shape, values) in tensors.items():
        raw = struct.pack(f"<{len(values)}f", *values)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head + data


def norm_bucket(scale: float) -> bytes:
    """The final norm of the embedded model, every weight `scale`: a one-tensor update."""
    hidden = EMBEDDED_CONFIG["hidden_size"]
    return safetensors_f32({"model.norm.weight": ([hidden], [scale] * hidden)})


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet (the table byte-level BPE vocabularies are written in)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    table, n = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return table


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_level_model_dir(dest: Path) -> Path:
    """The committed tiny Qwen3-MoE reference checkpoint (vocabulary 512) with a byte-level BPE
    tokenizer: ids 0..255 are the bytes, then <|endoftext|>, <|im_start|>, <|im_end|>; no merges,
    so every byte of text is one token. A served model with a real tokenizer.json on disk, as
    gateways that load a worker's tokenizer expect."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(REFERENCE_MOE / name, dest / name)
    table = bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": 256 + i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for i, s in enumerate(specials)
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                          "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": []},
    }
    (dest / "tokenizer.json").write_text(json.dumps(tokenizer))
    (dest / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "chat_template": CHATML, "add_bos_token": False}))
    return dest
