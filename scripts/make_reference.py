#!/usr/bin/env python3
"""Reference fixtures from a peer implementation (torch + transformers; not run in CI).

Builds tiny random Qwen3-MoE, Qwen3 and Llama checkpoints with transformers' own classes,
saves them in float32 (safetensors + config.json), and records, for several prompts given as
token ids, the logits of every prompt position and an 8-token greedy continuation. lockstep's
tests load these checkpoints and must match the logits within 1e-4 relative and the greedy
tokens exactly.

Run where torch and transformers are installed (e.g. the GPU host, which has no internet;
nothing here downloads anything):
    python3 scripts/make_reference.py --out tests/data/reference
"""

import argparse
import json
import os

import torch
from safetensors.torch import save_file

PROMPTS = [[1, 2, 3, 4, 5], [17, 300, 42, 42, 7, 99, 128, 255, 3, 61, 400, 8], [250]]
GREEDY_TOKENS = 8


def tiny_configs():
    from transformers import LlamaConfig, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6)
    return {
        "qwen3_moe": Qwen3MoeConfig(**common, num_hidden_layers=3, intermediate_size=96,
                                    moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
                                    rope_theta=1000000.0, tie_word_embeddings=False),
        "qwen3": Qwen3Config(**common, num_hidden_layers=2, intermediate_size=96,
                             rope_theta=1000000.0, tie_word_embeddings=True),
        "llama": LlamaConfig(**common, num_hidden_layers=2, intermediate_size=96, rope_theta=100000.0,
                             tie_word_embeddings=True,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/data/reference")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    for name, cfg in tiny_configs().items():
        try:
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        except TypeError:  # transformers < 4.56 names it torch_dtype
            model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32).eval()
        model = model.float()
        # Random init gives near-uniform logits; widen the weights so greedy choices are clear.
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                else:
                    p.copy_(torch.randn_like(p) * (2.0 / p.shape[-1] ** 0.5))
        out = os.path.join(args.out, name)
        os.makedirs(out, exist_ok=True)
        model.save_pretrained(out, safe_serialization=True)
        for f in os.listdir(out):
            if f not in ("model.safetensors", "config.json"):
                os.remove(os.path.join(out, f))
        tensors = {}
        meta = {"prompts": PROMPTS, "greedy": []}
        with torch.no_grad():
            for i, prompt in enumerate(PROMPTS):
                ids = torch.tensor([prompt])
                tensors[f"prompt{i}.logits"] = model(ids).logits[0].float().contiguous()
                gen = model.generate(ids, max_new_tokens=GREEDY_TOKENS, do_sample=False, eos_token_id=None,
                                     pad_token_id=0)
                meta["greedy"].append(gen[0, len(prompt):].tolist())
        save_file(tensors, os.path.join(out, "reference_logits.safetensors"))
        with open(os.path.join(out, "reference.json"), "w") as f:
            json.dump(meta, f, indent=1)
        print(name, "ok", meta["greedy"])


if __name__ == "__main__":
    main()
