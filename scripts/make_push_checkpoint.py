#!/usr/bin/env python3
"""Writes a made-up BF16 Qwen3-MoE checkpoint of about --gb gigabytes (random weights, a
word-level tokenizer) for measuring `lockstep push`. Not a model: only its size matters.

    python3 scripts/make_push_checkpoint.py --out /tmp/push-1g --gb 1.0 [--seed 0]
    python3 scripts/make_push_checkpoint.py --out DIR --gb 31 --config-only   # for --load-format dummy

Tensors are written one at a time, so memory stays near the largest tensor.
"""

import argparse
import json
import struct
from pathlib import Path

import numpy as np


def config(layers: int) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 4096,
        "hidden_size": 1024,
        "num_hidden_layers": layers,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 2048,
        "moe_intermediate_size": 512,
        "num_experts": 32,
        "num_experts_per_tok": 4,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }


def shapes(c: dict) -> dict:
    h, v, hd = c["hidden_size"], c["vocab_size"], c["head_dim"]
    q, kv, inter = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd, c["moe_intermediate_size"]
    out = {"model.embed_tokens.weight": [v, h], "model.norm.weight": [h], "lm_head.weight": [v, h]}
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}"
        out[f"{p}.input_layernorm.weight"] = [h]
        out[f"{p}.post_attention_layernorm.weight"] = [h]
        out[f"{p}.self_attn.q_proj.weight"] = [q, h]
        out[f"{p}.self_attn.k_proj.weight"] = [kv, h]
        out[f"{p}.self_attn.v_proj.weight"] = [kv, h]
        out[f"{p}.self_attn.o_proj.weight"] = [h, q]
        out[f"{p}.self_attn.q_norm.weight"] = [hd]
        out[f"{p}.self_attn.k_norm.weight"] = [hd]
        out[f"{p}.mlp.gate.weight"] = [c["num_experts"], h]
        for e in range(c["num_experts"]):
            out[f"{p}.mlp.experts.{e}.gate_proj.weight"] = [inter, h]
            out[f"{p}.mlp.experts.{e}.up_proj.weight"] = [inter, h]
            out[f"{p}.mlp.experts.{e}.down_proj.weight"] = [h, inter]
    return out


def bytes_of(c: dict) -> int:
    return sum(int(np.prod(s)) * 2 for s in shapes(c).values())


def layers_for(gb: float) -> int:
    """The layer count that makes the model about `gb` GB of BF16."""
    per_layer = sum(np.prod(s) for n, s in shapes(config(1)).items() if ".layers.0." in n) * 2
    fixed = sum(np.prod(s) for n, s in shapes(config(1)).items() if ".layers." not in n) * 2
    return max(1, round((gb * 1e9 - fixed) / per_layer))


def write_config(out: Path, c: dict) -> None:
    (out / "config.json").write_text(json.dumps(c, indent=2))
    tokenizer = {
        "version": "1.0", "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "hello": 1}, "unk_token": "<unk>"},
    }
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config-only", action="store_true",
                    help="write config.json and tokenizer.json only (serve it with --load-format dummy)")
    a = ap.parse_args()
    layers = layers_for(a.gb)
    c = config(layers)
    a.out.mkdir(parents=True, exist_ok=True)
    write_config(a.out, c)
    if a.config_only:
        print(f"{a.out}: config of {layers} layers, {bytes_of(c) / 1e9:.3f} GB of BF16 tensors")
        return
    tensors = sorted(shapes(c).items())
    header, offset = {}, 0
    for name, shape in tensors:
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    rng = np.random.default_rng(a.seed)
    with open(a.out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, shape in tensors:
            if name.endswith("norm.weight"):
                x = np.ones(shape, dtype=np.float32)
            else:
                x = rng.standard_normal(shape, dtype=np.float32) * (1.0 / np.sqrt(shape[-1]))
            # BF16 = the high half of the f32 bits (truncation is fine for random data).
            f.write((x.astype(np.float32).view(np.uint32) >> 16).astype("<u2").tobytes())
    print(f"{a.out}: {layers} layers, {offset / 1e9:.3f} GB of BF16 tensors")


if __name__ == "__main__":
    main()
