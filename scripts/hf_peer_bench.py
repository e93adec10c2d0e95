"""The transformers peer of the CUDA baseline: the same config, random BF16 weights, on the same
GPU, timed with the same shapes as examples/cuda_bench.rs (prefill 8x2048; decode from a
512-token prompt). Decode runs fewer steps than lockstep's because eager MoE decode is slow.

usage: python3 scripts/hf_peer_bench.py configs/qwen3-30b-a3b.json [--steps 32]
"""
import json
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def main():
    path = sys.argv[1]
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 32
    cfg = AutoConfig.for_model(**{k: v for k, v in json.load(open(path)).items() if k != "architectures"})
    torch.manual_seed(0)
    t = time.time()
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    model.eval()
    torch.cuda.synchronize()
    print(f"transformers {__import__('transformers').__version__}, torch {torch.__version__}: "
          f"random init in {time.time() - t:.1f}s")
    print("| peer | what | batch | tokens/s | ms/step |")
    print("|---|---|---|---|---|")
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        ids = torch.randint(0, 150000, (8, 2048), device="cuda", generator=g)
        model(ids[:1, :128])
        torch.cuda.synchronize()
        t = time.time()
        for i in range(8):
            model(ids[i:i + 1])
        torch.cuda.synchronize()
        s = time.time() - t
        print(f"| transformers bf16 | prefill 8x2048 | 8 | {8 * 2048 / s:.0f} | {s * 1e3:.1f} |")
        for b in (1, 8, 64):
            prompt = torch.randint(0, 150000, (b, 512), device="cuda", generator=g)
            model.generate(prompt, max_new_tokens=2, min_new_tokens=2, do_sample=False)
            torch.cuda.synchronize()
            t0 = time.time()
            model.generate(prompt, max_new_tokens=1, min_new_tokens=1, do_sample=False)
            torch.cuda.synchronize()
            first = time.time() - t0
            t0 = time.time()
            model.generate(prompt, max_new_tokens=steps + 1, min_new_tokens=steps + 1, do_sample=False)
            torch.cuda.synchronize()
            s = (time.time() - t0 - first) / steps
            print(f"| transformers bf16 | decode (prompt 512, {steps} steps) | {b} | {b / s:.0f} | {s * 1e3:.2f} |")


if __name__ == "__main__":
    main()
