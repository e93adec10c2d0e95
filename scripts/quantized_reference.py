#!/usr/bin/env python3
"""Quantized-forward reference logits for the tiny Qwen3-MoE fixture (numpy only).

What it computes
----------------
For each shipped precision recipe (configs/nvfp4.yaml, configs/mxfp8.yaml) and each prompt of
tests/data/reference/qwen3_moe/reference.json, the logits of every prompt position of a
forward pass of the float32 checkpoint in that directory, in which the linear layers the
recipe selects compute with quantized operands exactly as lockstep's CPU backend does:

  * MXFP8 linear: weight quantized rowwise (1x32 blocks along in_features, E4M3 + E8M0) from
    its f32 values; every activation row quantized rowwise MXFP8 from its f32 values;
    out = f32( sum_k f64(deq(x_k)) * f64(deq(w_k)) ).
  * NVFP4 linear: weight quantized with one per-tensor second-level scale (gate_proj and
    up_proj of one expert / one dense MLP share it: the contract's gate/up joint scale),
    activations quantized per token (each row its own amax, no four-over-six);
    acc = f32( sum_k f64(e2m1(xq_k) * s8x) * f64(e2m1(wq_k) * s8w) ),
    out = f32(f32(acc * s_tok) * s_w)   (s_tok = the row's S_dec, 0 for an all-zero row).
  * every other linear layer (and always the router `mlp.gate` and `lm_head`):
    out = f32( sum_k f64(x_k) * f64(w_k) ).

The quantization itself (codecs, MXFP8 rowwise, NVFP4 per-tensor / per-token, gate/up joint)
is NOT re-implemented here: it is imported from scripts/quant_reference.py, the independent
implementation of shared/QUANT_CONTRACT.md whose golden vectors the Rust `quant` module
already reproduces byte for byte. The recipe -> format resolution mirrors lockstep's
`Recipe::format_for` (always-high-precision parts, layer-count exceptions with percentages
rounded up, ordered glob matchers with first match winning, widths that do not tile a block
stay high precision).

Output: tests/data/reference/qwen3_moe/quantized_logits.safetensors with
`{recipe}.prompt{i}.logits`, float32 [prompt_len, vocab]. lockstep's test compares its own
quantized logits to these within 1e-5 relative (max |diff| <= 1e-5 * max |ref| per position).

Why float64 accumulation
------------------------
Every GEMM accumulates in float64 and rounds once to float32. Products of two f32 values
(and a fortiori of two dequantized MXFP8 / block-scaled NVFP4 operands, which have <= 5
significant bits) are exact in f64, and for these widths (K <= 96) the f64 sum is exact or
within ~1e-16 relative of the exact sum, so the single final rounding makes each GEMM output
(almost always) the correctly rounded exact dot product: independent of summation order, of
BLAS, of SIMD width and of thread count. That pins the reference to one well-defined
function that lockstep's f64-accumulating GEMMs reproduce to the last bit or so -- which
matters because quantization is discontinuous: an activation that differs by one ulp can
round to a different E2M1/E4M3 code, and such a flip moves the logits by far more than
1e-5. With f32 accumulation in an unspecified order no two implementations would agree on
those flips.

Everything outside the GEMM accumulations is float32, one numpy op at a time, in the same
order as lockstep: embedding lookup; RMSNorm x * (1/sqrt(sum(x^2)/n + eps)) * w with the sum
of squares accumulated sequentially in f32; Qwen3 per-head q_norm / k_norm; rotate-half RoPE
with inv_freq = f32(1 / theta^(2i/d)) (computed in f64), angle = f32(pos) * inv_freq in f32,
sin / cos correctly rounded from f64; causal GQA attention over f32 K/V with scale
1/sqrt(head_dim), q.k dot products and p.v sums accumulated sequentially in f32 (as
lockstep's CPU paged attention does), softmax max-subtracted with a sequential f32 sum;
SiLU x / (1 + exp(-x)) then * up; MoE routing softmax in f32, top-k by descending probability
(ties to the lower expert index), norm_topk_prob renormalisation summed in slot order,
expert outputs combined in slot order; residual adds in f32. exp is computed in f64 and
rounded to f32 (the correctly rounded value; numpy's own float32 exp is several ulps off and
would add avoidable noise), sin / cos likewise.

The same forward with no quantization at all is checked against the transformers logits in
reference_logits.safetensors (1e-4 relative): that validates the forward itself. The script
also prints, per recipe, the max relative difference between quantized and unquantized
logits (clearly nonzero: quantization is really applied) and the list of quantized layers.

    python3 scripts/quantized_reference.py            # writes the file, prints the checks
    python3 scripts/quantized_reference.py --check-only
    python3 scripts/quantized_reference.py --sensitivity   # also: how much do the quantized
        # logits move under other (plausible) choices for the non-GEMM numerics?

Deterministic: no randomness; the file is written with quant_reference.write_safetensors
(sorted header, tensors in name order), so reruns give identical bytes.
"""

import argparse
import fnmatch
import hashlib
import json
import math
import os
import sys

import numpy as np
import yaml
from safetensors.numpy import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import quant_reference as qr  # noqa: E402  (the contract implementation)

F32 = np.float32
F64 = np.float64
MODEL_DIR = os.path.join(ROOT, "tests", "data", "reference", "qwen3_moe")
OUT_NAME = "quantized_logits.safetensors"
RECIPES = ("nvfp4", "mxfp8")
REF_TOL = 1e-4  # unquantized forward vs transformers

# Non-GEMM numerics options (only changed by --sensitivity).
OPTS = {"exp": "f64", "attn_acc": "f32"}


def f32(x):
    a = np.asarray(x)
    assert a.dtype == F32, a.dtype
    return a


def exp32(x):
    """exp of f32 values, rounded to f32 (from f64: the correctly rounded value)."""
    x = f32(x)
    if OPTS["exp"] == "f64":
        return np.exp(x.astype(F64)).astype(F32)
    return np.exp(x)  # numpy's float32 exp (sensitivity check only)


# ----------------------------------------------------------------------------------------
# Recipes (mirrors lockstep's quant::recipe::Recipe::format_for and the loader's block check)
# ----------------------------------------------------------------------------------------
def always_high_precision(module):
    return (module.endswith("norm") or "embed_tokens" in module or module.endswith("lm_head")
            or module.endswith(".mlp.gate") or module.endswith("shared_expert_gate"))


def layer_index(module):
    parts = module.split("layers.")
    if len(parts) < 2:
        return None
    head = parts[1].split(".")[0]
    return int(head) if head.isdigit() else None


def resolve_span(v, num_layers):
    if v is None:
        return 0
    if isinstance(v, int):
        return min(v, num_layers)
    t = str(v).strip()
    assert t.endswith("%"), v
    p = float(t[:-1].strip())
    return int(math.ceil(round(p * num_layers / 100.0 * 1e9) / 1e9))


class Recipe:
    def __init__(self, path):
        with open(path) as f:
            y = yaml.safe_load(f)
        self.name = y.get("name", "custom")
        configs = y["configs"]
        self.matchers = []
        for mname, m in y["matchers"].items():
            assert m["type"] == "glob"
            if m.get("enabled", True):
                self.matchers.append((mname, m["pattern"], dict(configs[m["config"]])))
        self.start = y.get("num_layers_at_start_in_bf16")
        self.end = y.get("num_layers_at_end_in_bf16")
        self.extra = list(y.get("extra_high_precision_layers") or [])
        for c in configs.values():
            if c["format"] == "nvfp4":
                # this script implements the recipe's per-token, no-four-over-six NVFP4 only
                assert c.get("activation_scale", "per_token") == "per_token", c
                assert not c.get("four_over_six", False), c

    def format_for(self, module, num_layers, in_features):
        """'bf16' (high precision), 'mxfp8' or 'nvfp4' for a linear module name."""
        if always_high_precision(module) or any(fnmatch.fnmatchcase(module, p) for p in self.extra):
            return "bf16"
        layer = layer_index(module)
        if layer is not None:
            start = resolve_span(self.start, num_layers)
            end = resolve_span(self.end, num_layers)
            if layer < start or layer + end >= num_layers:
                return "bf16"
        fmt = "bf16"
        for _, pattern, cfg in self.matchers:
            # Rust glob::Pattern::matches with default options: `*` also matches `.`
            if fnmatch.fnmatchcase(module, pattern):
                fmt = cfg["format"]
                break
        block = {"mxfp8": 32, "nvfp4": 16}.get(fmt)
        if block is not None and in_features % block != 0:
            return "bf16"  # widths a format cannot tile stay high precision (loader)
        return fmt


class AllHighPrecision:
    name = "none"

    def format_for(self, module, num_layers, in_features):
        return "bf16"


# ----------------------------------------------------------------------------------------
# Linear layers
# ----------------------------------------------------------------------------------------
def gemm_f64(a, b):
    """f32 [M, K] x f32 [N, K]^T, products and sums in f64, one rounding to f32."""
    return (f32(a).astype(F64) @ f32(b).astype(F64).T).astype(F32)


def nvfp4_block_scaled(data, scale):
    """e2m1(q) * f32(s8) per element (exact in f32): the operand the tensor cores see."""
    codes = qr.unpack_e2m1(data)
    M, K = codes.shape
    v = qr.e2m1_decode(codes).reshape(M, K // 16, 16)
    sf = qr.e4m3_decode(scale)
    return f32(v * sf[..., None]).reshape(M, K)


class HighPrecisionLinear:
    fmt = "bf16"

    def __init__(self, w):
        self.w = f32(w)

    def __call__(self, x):
        return gemm_f64(x, self.w)


class Mxfp8Linear:
    fmt = "mxfp8"

    def __init__(self, w):
        q, code = qr.mxfp8_rowwise(f32(w))
        self.wdeq = f32(qr.mxfp8_dequant_rowwise(q, code))  # exact: e4m3 * 2^k

    def __call__(self, x):
        q, code = qr.mxfp8_rowwise(f32(x))
        xdeq = f32(qr.mxfp8_dequant_rowwise(q, code))
        return gemm_f64(xdeq, self.wdeq)


class Nvfp4Linear:
    fmt = "nvfp4"

    def __init__(self, data, scale, s_w):
        self.wbs = nvfp4_block_scaled(data, scale)
        self.s_w = F32(s_w)

    def __call__(self, x):
        with np.errstate(divide="ignore"):  # 2688 / 0 for an all-zero row (contract: S_enc = 1)
            data, scale, s_tok = qr.nvfp4_quantize(f32(x), "token")
        acc = gemm_f64(nvfp4_block_scaled(data, scale), self.wbs)
        return f32(f32(acc * f32(s_tok)[:, None]) * self.s_w)


def nvfp4_weight(w):
    data, scale, g = qr.nvfp4_quantize(f32(w), "tensor")
    return Nvfp4Linear(data, scale, g)


# ----------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------
class Model:
    def __init__(self, cfg, weights, recipe):
        self.cfg = cfg
        self.W = weights
        self.recipe = recipe
        self.L = cfg["num_hidden_layers"]
        self.formats = {}  # module -> format, every linear layer
        self.gateup_joint = []  # NVFP4 gate/up pairs sharing one second-level scale
        self.eps = F32(cfg["rms_norm_eps"])
        self.hd = cfg["head_dim"]
        self.nh = cfg["num_attention_heads"]
        self.nkv = cfg["num_key_value_heads"]
        theta = cfg.get("rope_parameters", {}).get("rope_theta", cfg.get("rope_theta"))
        theta = float(F32(theta))  # lockstep stores theta as f32, widens to f64
        half = self.hd // 2
        self.inv_freq = np.array([1.0 / theta ** ((2 * i) / self.hd) for i in range(half)],
                                 dtype=F64).astype(F32)
        self.scale = F32(F32(1.0) / np.sqrt(F32(self.hd)))
        mlp_only = set(cfg.get("mlp_only_layers") or [])
        step = cfg.get("decoder_sparse_step", 1)
        self.n_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        self.top_k = cfg["num_experts_per_tok"]
        self.norm_topk = cfg["norm_topk_prob"]
        self.layers = []
        for l in range(self.L):
            p = f"model.layers.{l}"
            layer = {"input_norm": self.W[f"{p}.input_layernorm.weight"],
                     "post_norm": self.W[f"{p}.post_attention_layernorm.weight"],
                     "q_norm": self.W[f"{p}.self_attn.q_norm.weight"],
                     "k_norm": self.W[f"{p}.self_attn.k_norm.weight"]}
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                layer[n] = self.linear(f"{p}.self_attn.{n}")
            is_moe = l not in mlp_only and (l + 1) % step == 0
            if is_moe:
                layer["router"] = self.linear(f"{p}.mlp.gate")
                layer["experts"] = [self.swiglu(f"{p}.mlp.experts.{e}") for e in range(self.n_experts)]
            else:
                layer["mlp"] = self.swiglu(f"{p}.mlp")
            self.layers.append(layer)
        self.norm = self.W["model.norm.weight"]
        self.embed = self.W["model.embed_tokens.weight"]
        self.lm_head = self.linear("lm_head")

    def fmt(self, module):
        w = self.W[f"{module}.weight"]
        f = self.recipe.format_for(module, self.L, w.shape[1])
        self.formats[module] = f
        return f

    def linear(self, module):
        w = self.W[f"{module}.weight"]
        f = self.fmt(module)
        if f == "bf16":
            return HighPrecisionLinear(w)
        if f == "mxfp8":
            return Mxfp8Linear(w)
        return nvfp4_weight(w)

    def swiglu(self, prefix):
        g, u, d = f"{prefix}.gate_proj", f"{prefix}.up_proj", f"{prefix}.down_proj"
        if self.fmt(g) == "nvfp4" and self.fmt(u) == "nvfp4":
            gd, gs, ud, us, s = qr.nvfp4_gateup_joint(self.W[f"{g}.weight"], self.W[f"{u}.weight"])
            gate, up = Nvfp4Linear(gd, gs, s), Nvfp4Linear(ud, us, s)
            self.gateup_joint.append(prefix)
        else:
            gate, up = self.linear(g), self.linear(u)
        return gate, up, self.linear(d)

    # --- row-wise f32 ops -----------------------------------------------------------------
    def rms_norm(self, x, w):
        """x [..., n] f32 -> x * (1 / sqrt(ss / n + eps)) * w, ss summed sequentially in f32."""
        x = f32(x)
        n = x.shape[-1]
        ss = np.zeros(x.shape[:-1], dtype=F32)
        for i in range(n):
            ss = f32(ss + f32(x[..., i] * x[..., i]))
        inv = f32(F32(1.0) / np.sqrt(f32(f32(ss / F32(n)) + self.eps)))
        return f32(f32(x * inv[..., None]) * f32(w))

    def rope(self, x, positions):
        """x [T, heads, hd] f32, rotate-half, in f32 except sin/cos (correctly rounded)."""
        half = self.hd // 2
        ang = f32(positions.astype(F32)[:, None] * self.inv_freq[None, :])  # [T, half]
        sin = np.sin(ang.astype(F64)).astype(F32)[:, None, :]
        cos = np.cos(ang.astype(F64)).astype(F32)[:, None, :]
        a, b = x[..., :half], x[..., half:]
        out = np.empty_like(x)
        out[..., :half] = f32(f32(a * cos) - f32(b * sin))
        out[..., half:] = f32(f32(b * cos) + f32(a * sin))
        return out

    def softmax_rows(self, s, valid=None):
        """Softmax over the last axis, max-subtracted, sequential f32 sum, divide. `valid`
        (bool, broadcastable) marks the entries that take part (others end up 0)."""
        s = f32(s)
        if valid is None:
            valid = np.ones(s.shape, dtype=bool)
        valid = np.broadcast_to(valid, s.shape)
        m = np.max(np.where(valid, s, F32(-np.inf)), axis=-1)
        e = np.where(valid, exp32(f32(s - m[..., None])), F32(0.0)).astype(F32)
        tot = np.zeros(s.shape[:-1], dtype=F32)
        for t in range(s.shape[-1]):
            tot = f32(tot + e[..., t])  # adding the masked +0.0 entries is exact
        return f32(e / tot[..., None])

    def attention(self, q, k, v):
        """q [T, nh, hd], k/v [T, nkv, hd] (the f32 KV cache) -> [T, nh * hd]."""
        T = q.shape[0]
        group = self.nh // self.nkv
        kh = np.repeat(k, group, axis=1)  # [T, nh, hd]: head h reads kv head h // group
        vh = np.repeat(v, group, axis=1)
        # scores[i, h, t] = (sum_d q[i,h,d] * k[t,h,d]) * scale
        if OPTS["attn_acc"] == "f32":
            acc = np.zeros((T, self.nh, T), dtype=F32)
            for d in range(self.hd):
                acc = f32(acc + f32(q[:, :, d][:, :, None] * kh[:, :, d].T[None, :, :]))
        else:
            acc = np.einsum("ihd,thd->iht", q.astype(F64), kh.astype(F64)).astype(F32)
        scores = f32(acc * self.scale)
        causal = (np.arange(T)[None, :] <= np.arange(T)[:, None])[:, None, :]  # [i, 1, t]
        p = self.softmax_rows(scores, causal)
        if OPTS["attn_acc"] == "f32":
            out = np.zeros((T, self.nh, self.hd), dtype=F32)
            for t in range(T):  # lockstep: acc += p_t * v_t for t = 0..=pos
                term = f32(p[:, :, t][:, :, None] * vh[t][None, :, :])
                out = np.where(causal[:, :, t][:, :, None], f32(out + term), out).astype(F32)
        else:
            out = np.einsum("iht,thd->ihd", p.astype(F64), vh.astype(F64)).astype(F32)
        return out.reshape(T, self.nh * self.hd)

    def swiglu_forward(self, mlp, x):
        gate, up, down = mlp
        g, u = gate(x), up(x)
        silu = f32(g / f32(F32(1.0) + exp32(f32(-g))))
        return down(f32(silu * u))

    def moe_forward(self, layer, x):
        T, H = x.shape
        probs = self.softmax_rows(layer["router"](x))  # [T, E]
        y = np.zeros((T, H), dtype=F32)
        for r in range(T):
            order = sorted(range(self.n_experts), key=lambda i: (-float(probs[r, i]), i))
            top = order[:self.top_k]
            tot = F32(0.0)
            for i in top:
                tot = F32(tot + probs[r, i])
            for i in top:  # slot order
                w = F32(probs[r, i] / tot) if self.norm_topk else probs[r, i]
                eo = self.swiglu_forward(layer["experts"][i], x[r:r + 1])[0]
                y[r] = f32(y[r] + f32(w * eo))
        return y

    def forward(self, tokens):
        T = len(tokens)
        pos = np.arange(T)
        x = self.embed[np.asarray(tokens)].astype(F32)
        for layer in self.layers:
            h = self.rms_norm(x, layer["input_norm"])
            q = layer["q_proj"](h).reshape(T, self.nh, self.hd)
            k = layer["k_proj"](h).reshape(T, self.nkv, self.hd)
            v = layer["v_proj"](h).reshape(T, self.nkv, self.hd)
            q = self.rope(self.rms_norm(q, layer["q_norm"]), pos)
            k = self.rope(self.rms_norm(k, layer["k_norm"]), pos)
            attn = self.attention(q, k, v)
            x = f32(x + layer["o_proj"](attn))
            h = self.rms_norm(x, layer["post_norm"])
            y = self.moe_forward(layer, h) if "experts" in layer else self.swiglu_forward(layer["mlp"], h)
            x = f32(x + y)
        return self.lm_head(self.rms_norm(x, self.norm))

    def quantized_modules(self):
        return {m: f for m, f in sorted(self.formats.items(), key=lambda kv: _natural(kv[0]))
                if f != "bf16"}


def _natural(s):
    return [int(t) if t.isdigit() else t for t in s.replace(".", " . ").split()]


def rel_diff(a, ref):
    """max over positions of max|a - ref| / max|ref| (the Rust test's metric)."""
    a, ref = a.astype(F64), ref.astype(F64)
    return float(np.max(np.max(np.abs(a - ref), axis=-1) / np.max(np.abs(ref), axis=-1)))


def summarize(mods):
    """Compact, exact listing: group module names by layer and by projection."""
    by_layer = {}
    for m, f in mods.items():
        l = layer_index(m)
        rest = m.split(f"layers.{l}.", 1)[1]
        by_layer.setdefault(l, []).append(f"{rest}:{f}")
    lines = []
    for l in sorted(by_layer):
        items = by_layer[l]
        experts = sorted({int(i.split(".")[2]) for i in items if i.startswith("mlp.experts.")})
        other = [i for i in items if not i.startswith("mlp.experts.")]
        projs = sorted({i.split(".", 3)[3] for i in items if i.startswith("mlp.experts.")})
        s = f"  layer {l}: {len(items)} linears"
        if other:
            s += "; " + ", ".join(other)
        if experts:
            s += f"; mlp.experts.{{{','.join(map(str, experts))}}}.{{{', '.join(projs)}}}"
        lines.append(s)
    return "\n".join(lines)


def run_all(cfg, weights, prompts, recipes):
    base = Model(cfg, weights, AllHighPrecision())
    unq = [base.forward(p) for p in prompts]
    out, info = {}, {}
    for name, recipe in recipes.items():
        model = Model(cfg, weights, recipe)
        info[name] = model
        for i, p in enumerate(prompts):
            out[f"{name}.prompt{i}.logits"] = np.ascontiguousarray(model.forward(p), dtype=F32)
    return unq, out, info


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=MODEL_DIR)
    ap.add_argument("--check-only", action="store_true", help="compute and check, write nothing")
    ap.add_argument("--sensitivity", action="store_true",
                    help="also rerun with numpy f32 exp / f64 attention sums and report the change")
    args = ap.parse_args()
    assert sys.byteorder == "little"

    with open(os.path.join(args.model_dir, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "qwen3_moe", cfg["model_type"]
    weights = {k: f32(v) for k, v in load_file(os.path.join(args.model_dir, "model.safetensors")).items()}
    with open(os.path.join(args.model_dir, "reference.json")) as f:
        prompts = json.load(f)["prompts"]
    ref = load_file(os.path.join(args.model_dir, "reference_logits.safetensors"))
    recipes = {r: Recipe(os.path.join(ROOT, "configs", f"{r}.yaml")) for r in RECIPES}
    for r, rec in recipes.items():
        assert rec.name == r, (r, rec.name)

    unq, out, models = run_all(cfg, weights, prompts, recipes)

    # 1. the forward itself: unquantized vs transformers
    ok = True
    for i, p in enumerate(prompts):
        d = rel_diff(unq[i], ref[f"prompt{i}.logits"])
        print(f"unquantized vs transformers prompt{i} (len {len(p)}): max rel diff {d:.3e}")
        ok &= d <= REF_TOL
    assert ok, "unquantized forward does not match the transformers logits"

    # 2. quantization really applied
    for name, model in models.items():
        mods = model.quantized_modules()
        counts = {}
        for f in mods.values():
            counts[f] = counts.get(f, 0) + 1
        diffs = [rel_diff(out[f"{name}.prompt{i}.logits"], unq[i]) for i in range(len(prompts))]
        print(f"{name}: {len(mods)} quantized linear layers {counts}; "
              f"max rel diff vs unquantized per prompt: " + ", ".join(f"{d:.3e}" for d in diffs))
        print(summarize(mods))
        if model.gateup_joint:
            print(f"  NVFP4 gate/up joint second-level scale: {', '.join(model.gateup_joint)}")
        assert len(mods) > 0 and min(diffs) > 1e-4, "quantization has no visible effect"
        for k, v in out.items():
            assert np.all(np.isfinite(v)), k

    if args.sensitivity:
        # Same computation with other plausible choices outside the GEMMs; if these move the
        # quantized logits by << 1e-5 relative, no code flips and the reference is robust.
        for opt, val in (("exp", "numpy_f32"), ("attn_acc", "f64")):
            saved = dict(OPTS)
            OPTS[opt] = val
            _, alt, _ = run_all(cfg, weights, prompts, recipes)
            OPTS.update(saved)
            worst = max(rel_diff(alt[k], out[k]) for k in out)
            nbits = sum(int(np.sum(alt[k] != out[k])) for k in out)
            print(f"sensitivity {opt}={val}: max rel change of quantized logits {worst:.3e} "
                  f"({nbits} of {sum(v.size for v in out.values())} values not bit-identical)")

    if args.check_only:
        return 0
    path = os.path.join(args.model_dir, OUT_NAME)
    meta = {
        "generator": "scripts/quantized_reference.py",
        "contract": "shared/QUANT_CONTRACT.md (via scripts/quant_reference.py)",
        "recipes": ",".join(RECIPES),
        "prompts": json.dumps(prompts, separators=(",", ":")),
        "accumulation": "f64 GEMM accumulation, one rounding to f32; everything else f32",
    }
    qr.write_safetensors(path, out, meta)
    back = load_file(path)
    assert set(back) == set(out)
    for k, v in out.items():
        assert back[k].dtype == F32 and back[k].tobytes() == v.tobytes(), k
    h = hashlib.sha256(open(path, "rb").read()).hexdigest()
    print(f"wrote {os.path.relpath(path, ROOT)}: {os.path.getsize(path)} bytes, sha256 {h}")
    for k in sorted(out):
        print(f"  {k} {list(out[k].shape)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
