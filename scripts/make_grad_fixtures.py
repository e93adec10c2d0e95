#!/usr/bin/env python3
"""Gradient fixtures from PyTorch autograd for the trainer's hand-written backward.

For each tiny reference checkpoint in tests/data/reference (made by scripts/make_reference.py
with transformers' own model classes, float32), computes with autograd the gradient of

    L = sum over sequences s, completion positions j of  c[s][j] * log_softmax(logits)[token]

with respect to every weight, and stores the loss plus the gradient at 24 random positions of
each tensor (by checkpoint name) in grad_fixture.json beside the checkpoint. lockstep's
tests/train_autograd.rs recomputes L and the gradients with its own forward and backward.

Needs torch and transformers (CPU is enough); nothing is downloaded:
    python3 scripts/make_grad_fixtures.py --dir tests/data/reference
"""

import argparse
import json
import os

import torch

SEQUENCES = [
    {"prompt": [1, 2, 3, 4, 5], "completion": [9, 33, 250, 7]},
    {"prompt": [17, 300, 42], "completion": [42, 7, 99, 128, 255, 3]},
]
PER_TENSOR = 24


def checkpoint_grads(model):
    """Gradients by checkpoint name; fused expert parameters are split per expert."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        if name.endswith("mlp.experts.gate_up_proj"):
            # [experts, 2 * inter, hidden]: gate rows first, then up rows.
            prefix = name[: -len("gate_up_proj")]
            inter = g.shape[1] // 2
            for e in range(g.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = g[e, :inter]
                out[f"{prefix}{e}.up_proj.weight"] = g[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            for e in range(g.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = g[e]
        else:
            out[name] = g
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="tests/data/reference")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    for name in sorted(os.listdir(args.dir)):
        path = os.path.join(args.dir, name)
        if not os.path.exists(os.path.join(path, "model.safetensors")):
            continue
        torch.manual_seed(4321)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        coeffs = [torch.randn(len(s["completion"])).tolist() for s in SEQUENCES]
        loss = 0.0
        for s, c in zip(SEQUENCES, coeffs):
            ids = s["prompt"] + s["completion"]
            logits = model(torch.tensor([ids[:-1]])).logits[0].float()
            lp = torch.log_softmax(logits, dim=-1)
            rows = lp[len(s["prompt"]) - 1:]
            picked = rows[torch.arange(len(s["completion"])), torch.tensor(s["completion"])]
            loss = loss + (picked * torch.tensor(c)).sum()
        loss.backward()
        grads = checkpoint_grads(model)
        fixture = {"generator": "scripts/make_grad_fixtures.py", "sequences": SEQUENCES,
                   "coeffs": coeffs, "loss": loss.item(), "grads": {}}
        for gname in sorted(grads):
            g = grads[gname].detach().reshape(-1)
            idx = torch.randint(0, g.numel(), (PER_TENSOR,)).tolist()
            fixture["grads"][gname] = {"shape": list(grads[gname].shape), "index": idx,
                                       "value": [g[i].item() for i in idx]}
        with open(os.path.join(path, "grad_fixture.json"), "w") as f:
            json.dump(fixture, f, indent=0)
        print(name, "loss", loss.item(), len(fixture["grads"]), "tensors")


if __name__ == "__main__":
    main()
