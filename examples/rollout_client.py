#!/usr/bin/env python3
"""A GRPO-style rollout against `lockstep serve` (or SGLang) with the native /generate API.

For each prompt it asks for N samples that differ only by `sampling_seed`'s sample index,
with the logprob of every generated token and, when the server runs with
--enable-return-routed-experts, the experts each token was routed to (for routing replay in
the trainer). The same seed, prompt and weights give the same samples again.

    cargo run --release -- serve --enable-return-routed-experts &
    python3 examples/rollout_client.py --url http://127.0.0.1:30000 --n 4
"""

import argparse
import base64
import json
import struct
import urllib.request


def generate(url, payload):
    req = urllib.request.Request(url + "/generate", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        return json.load(r)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--routed-experts", action="store_true")
    args = ap.parse_args()
    prompts = ["What is 12 + 30?", "Sort: 3 1 2"]
    out = generate(args.url, {
        "text": prompts,
        "sampling_params": {"max_new_tokens": 16, "temperature": 1.0, "n": args.n,
                            "sampling_seed": args.seed},
        "return_logprob": True,
        "return_routed_experts": args.routed_experts,
    })
    # n samples per prompt, flat in prompt order.
    for i, sample in enumerate(out):
        meta = sample["meta_info"]
        logprobs = [lp for lp, _tok, _text in meta["output_token_logprobs"]]
        line = (f"prompt {i // args.n} sample {i % args.n}: {len(sample['output_ids'])} tokens, "
                f"sum logprob {sum(logprobs):.3f}, weight version {meta['weight_version']}")
        if "routed_experts" in meta:
            raw = base64.b64decode(meta["routed_experts"])
            ids = struct.unpack(f"<{len(raw) // 4}i", raw)
            line += f", routed experts {meta['routed_experts_shape']} (first token {ids[:8]})"
        print(line)


if __name__ == "__main__":
    main()
