//! Tests against the real Qwen3 tokenizer and chat template, fetched by
//! scripts/fetch_test_assets.sh into .cache/assets/qwen3/ (skipped, with a message, when absent).
//! Expected values come from scripts/tokenizer_expectations.py (Python `tokenizers` and
//! `jinja2` set up as transformers does), run once and pasted here.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use super::{ChatMessage, IncrementalDecoder, TemplateArgs, Tokenizer};

fn assets() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(".cache/assets/qwen3")
}

/// Loaded once: parsing the 11 MB tokenizer.json takes a while in a test build. `None`, after
/// saying why, when the assets were not fetched.
fn qwen3() -> Option<Arc<Tokenizer>> {
    static TOKENIZER: OnceLock<Option<Arc<Tokenizer>>> = OnceLock::new();
    let path = assets().join("tokenizer.json");
    let tok = TOKENIZER.get_or_init(|| {
        path.is_file().then(|| {
            Arc::new(Tokenizer::from_dir(assets()).expect("the fetched Qwen3 tokenizer loads"))
        })
    });
    if tok.is_none() {
        crate::testing::skip(
            "Qwen3 tokenizer tests",
            &format!(
                "{} is missing; run scripts/fetch_test_assets.sh",
                path.display()
            ),
        );
    }
    tok.clone()
}

/// Same input as TEXT in scripts/tokenizer_expectations.py.
const TEXT: &str = "Hello, world! 你好世界 🦀🎉 naïve café";

#[test]
fn known_token_ids() {
    let Some(tok) = qwen3() else { return };
    // From scripts/tokenizer_expectations.py: Tokenizer.from_file(...).encode(TEXT,
    // add_special_tokens=False).ids with Python tokenizers 0.23.3. The crab (U+1F980) spans
    // three tokens (' \xf0\x9f', '\xa6', '\x80'), which the incremental test relies on.
    let expected = [
        9707, 11, 1879, 0, 220, 108386, 99489, 11162, 99, 222, 144841, 94880, 586, 51950,
    ];
    assert_eq!(tok.encode(TEXT, false).unwrap(), expected);
    // Qwen3 adds no BOS, so add_special_tokens changes nothing.
    assert_eq!(tok.encode(TEXT, true).unwrap(), expected);
}

#[test]
fn model_dir_facts() {
    let Some(tok) = qwen3() else { return };
    assert_eq!(tok.vocab_size(), 151_669);
    assert_eq!(tok.eos_token(), Some("<|im_end|>"));
    assert_eq!(tok.bos_token(), None);
    // No generation_config.json in the package, so only the tokenizer's eos.
    assert_eq!(tok.eos_token_ids(), &[151_645]);
    assert_eq!(tok.token_to_id("<|endoftext|>"), Some(151_643));
    assert_eq!(tok.id_to_token(1879).as_deref(), Some("Ġworld"));
    assert!(tok.is_special(151_643) && tok.is_special(151_644) && !tok.is_special(1879));
    // <think> is an added token but not a special one: it survives skip_special_tokens.
    let think = tok.token_to_id("<think>").unwrap();
    assert!(!tok.is_special(think));
}

#[test]
fn round_trip_mixed_text() {
    let Some(tok) = qwen3() else { return };
    let texts = [
        TEXT,
        "日本語のテキストと한국어 텍스트, Ελληνικά, русский, עברית, العربية",
        "emoji: 👩‍👩‍👧‍👦 🏳️‍🌈 🇫🇷 1️⃣ 😀😃😄",
        "code:\n\tfn main() {\n        println!(\"{}\", 1 + 2);\n    }\r\n\n\n  trailing  ",
        "",
    ];
    for text in texts {
        let ids = tok.encode(text, false).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), text, "{ids:?}");
    }
    let chat = "<|im_start|>user\n你好<|im_end|>";
    let ids = tok.encode(chat, false).unwrap();
    assert_eq!(ids.first(), Some(&151_644));
    assert_eq!(ids.last(), Some(&151_645));
    assert_eq!(tok.decode(&ids, false).unwrap(), chat);
    assert_eq!(tok.decode(&ids, true).unwrap(), "user\n你好");
}

#[test]
fn incremental_decoding_matches_full_decode() {
    let Some(tok) = qwen3() else { return };
    let prompt = tok.encode("<|im_start|>assistant\n", false).unwrap();
    for text in [
        TEXT,
        "🦀🦀🦀 世界 👩‍👩‍👧‍👦 ok",
        "<think>\n思考\n</think>\n\n答案是🎉<|im_end|>",
    ] {
        let ids = tok.encode(text, false).unwrap();
        for skip in [false, true] {
            let mut dec = IncrementalDecoder::new(tok.clone(), &prompt, skip).unwrap();
            let mut pieces = Vec::new();
            for &id in &ids {
                pieces.push(dec.push(id).unwrap().to_string());
            }
            pieces.push(dec.finish().unwrap().to_string());
            let full = tok.decode(&ids, skip).unwrap();
            assert_eq!(pieces.concat(), full, "skip_special_tokens={skip}");
            assert_eq!(dec.text(), full);
            // Never half a character: no piece carries a replacement character.
            assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{pieces:?}");
        }
    }
    // The crab's three tokens emit nothing until the last one.
    let mut dec = IncrementalDecoder::new(tok.clone(), &[], false).unwrap();
    let pieces: Vec<String> = [11162, 99, 222]
        .iter()
        .map(|&id| dec.push(id).unwrap().to_string())
        .collect();
    assert_eq!(pieces, ["", "", " 🦀"]);
}

fn agent_messages() -> Vec<ChatMessage> {
    // AGENT in scripts/tokenizer_expectations.py.
    serde_json::from_value(serde_json::json!([
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "<think>\nNeed the tool.\n</think>\n\n",
         "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "<think>\nGot it.\n</think>\n\nIt is 5."},
        {"role": "user", "content": "Thanks!"}
    ]))
    .unwrap()
}

fn tools() -> Vec<serde_json::Value> {
    vec![
        serde_json::json!({"type": "function", "function": {"name": "add", "description": "Add two numbers",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}),
    ]
}

#[test]
fn chat_template_system_user_generation_prompt() {
    let Some(tok) = qwen3() else { return };
    let messages = [
        ChatMessage::text("system", "You are a helpful assistant."),
        ChatMessage::text("user", "What is 2+2? Answer in 中文."),
    ];
    let args = TemplateArgs {
        add_generation_prompt: true,
        ..Default::default()
    };
    // From scripts/tokenizer_expectations.py: the tokenizer_config.json template rendered by
    // Python jinja2 3.1.6 the way transformers renders it.
    let expected = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is 2+2? Answer in 中文.<|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(tok.apply_chat_template(&messages, &args).unwrap(), expected);
}

/// The parts of Qwen3's template that lean on Python semantics: reversed slices, namespace,
/// `.split('</think>')[-1].lstrip('\n')`, `tojson` of tools and arguments, `enable_thinking`.
#[test]
fn chat_template_tools_and_reasoning() {
    let Some(tok) = qwen3() else { return };
    let tools_header = "<|im_start|>system\nUse tools.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"add\", \"description\": \"Add two numbers\", \"parameters\": {\"type\": \"object\", \"properties\": {\"a\": {\"type\": \"number\"}, \"b\": {\"type\": \"number\"}}, \"required\": [\"a\", \"b\"]}}}\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n";

    // From scripts/tokenizer_expectations.py (AGENT, tools, enable_thinking=False): reasoning
    // before the last user turn is dropped.
    let mut kwargs = serde_json::Map::new();
    kwargs.insert("enable_thinking".into(), false.into());
    let args = TemplateArgs {
        add_generation_prompt: true,
        tools: Some(tools()),
        kwargs,
    };
    let expected = format!("{tools_header}<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{{\"name\": \"add\", \"arguments\": {{\"a\": 2, \"b\": 3}}}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\nIt is 5.<|im_end|>\n<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
    assert_eq!(
        tok.apply_chat_template(&agent_messages(), &args).unwrap(),
        expected
    );

    // From the same script (AGENT[:4]): mid tool call, the reasoning of the current turn stays.
    let args = TemplateArgs {
        add_generation_prompt: true,
        tools: Some(tools()),
        ..Default::default()
    };
    let expected = format!("{tools_header}<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n<think>\nNeed the tool.\n</think>\n\n<tool_call>\n{{\"name\": \"add\", \"arguments\": {{\"a\": 2, \"b\": 3}}}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n");
    assert_eq!(
        tok.apply_chat_template(&agent_messages()[..4], &args)
            .unwrap(),
        expected
    );
}

#[test]
fn token_bytes_reassemble_the_text_even_inside_characters() {
    let Some(tok) = qwen3() else { return };
    let ids = tok.encode(TEXT, false).unwrap();
    let joined: Vec<u8> = ids
        .iter()
        .flat_map(|&id| tok.token_bytes(id).unwrap())
        .collect();
    assert_eq!(joined, TEXT.as_bytes());
    // Some token holds only part of a character: its text is U+FFFD, its bytes are not.
    assert!(
        ids.iter().any(|&id| {
            let bytes = tok.token_bytes(id).unwrap();
            std::str::from_utf8(&bytes).is_err()
                && tok.decode(&[id], false).unwrap().contains('\u{FFFD}')
        }),
        "TEXT has a character split over tokens"
    );
    let im_end = tok.token_to_id("<|im_end|>").unwrap();
    assert_eq!(tok.token_bytes(im_end).unwrap(), b"<|im_end|>");
}
