#!/usr/bin/env python3
"""Prints the expected values hard-coded in src/tokenizer/qwen3_tests.rs.

Independent of the Rust code: token ids come from the Python `tokenizers` package and chat
prompts from `jinja2`, set up the way transformers' `apply_chat_template` sets it up
(ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, loopcontrols, its own `tojson`
and `raise_exception`; variables messages / tools / documents / add_generation_prompt plus
the tokenizer's special tokens map). Run after scripts/fetch_test_assets.sh:

    pip install tokenizers jinja2
    python3 scripts/tokenizer_expectations.py
"""
import json
import pathlib

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

ASSETS = pathlib.Path(__file__).resolve().parent.parent / ".cache/assets/qwen3"

# Inputs shared with the Rust tests (keep in sync).
TEXT = "Hello, world! 你好世界 🦀🎉 naïve café"
SYSTEM_USER = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2+2? Answer in 中文."},
]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers",
          "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                         "required": ["a", "b"]}}}]
AGENT = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "2+3?"},
    {"role": "assistant", "content": "<think>\nNeed the tool.\n</think>\n\n",
     "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
    {"role": "tool", "content": "5"},
    {"role": "assistant", "content": "<think>\nGot it.\n</think>\n\nIt is 5."},
    {"role": "user", "content": "Thanks!"},
]


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def render(config, messages, tools=None, add_generation_prompt=False, **kwargs):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    special = {k: config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if config.get(k) is not None}
    template = env.from_string(config["chat_template"])
    return template.render(messages=messages, tools=tools, documents=None,
                           add_generation_prompt=add_generation_prompt, **{**special, **kwargs})


def main():
    tok = Tokenizer.from_file(str(ASSETS / "tokenizer.json"))
    config = json.loads((ASSETS / "tokenizer_config.json").read_text())
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    print("ids of", json.dumps(TEXT, ensure_ascii=False), "=", ids)
    print("tokens:", tok.encode(TEXT, add_special_tokens=False).tokens)
    print("system+user, add_generation_prompt:")
    print(json.dumps(render(config, SYSTEM_USER, add_generation_prompt=True), ensure_ascii=False))
    print("agent with tools, add_generation_prompt, enable_thinking=False:")
    print(json.dumps(render(config, AGENT, tools=TOOLS, add_generation_prompt=True, enable_thinking=False), ensure_ascii=False))
    print("first four agent messages (mid tool call), add_generation_prompt:")
    print(json.dumps(render(config, AGENT[:4], tools=TOOLS, add_generation_prompt=True), ensure_ascii=False))


if __name__ == "__main__":
    main()
