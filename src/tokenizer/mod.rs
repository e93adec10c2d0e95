//! Text <-> token ids for the server: one [`Tokenizer`] over either a Hugging Face
//! `tokenizer.json` or the embedded byte-level vocabulary of the embedded default model,
//! plus streaming detokenization ([`IncrementalDecoder`]) and chat templates ([`ChatTemplate`]).
//!
//! Nothing here knows about HTTP or the engine: handlers tokenize prompts on the blocking pool
//! and turn the engine's token events back into text with an [`IncrementalDecoder`].

mod bytes;
mod chat;
mod incremental;
#[cfg(test)]
mod qwen3_tests;

pub use bytes::ByteTokenizer;
pub use chat::{ChatMessage, ChatTemplate, ContentPart, MessageContent, TemplateArgs};
pub use incremental::IncrementalDecoder;

use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// Everything that can go wrong loading a tokenizer, tokenizing, or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: invalid JSON: {source}")]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{path}: {reason}")]
    Config { path: PathBuf, reason: String },
    #[error("{path}: cannot load tokenizer: {reason}")]
    Load { path: PathBuf, reason: String },
    #[error("tokenizer failed: {0}")]
    Backend(String),
    #[error("token id {id} is outside the vocabulary (size {vocab_size})")]
    UnknownTokenId { id: u32, vocab_size: usize },
    #[error("this model has no chat template")]
    NoChatTemplate,
    #[error("chat template is invalid: {0}")]
    TemplateInvalid(String),
    /// The template called `raise_exception(message)`: the conversation is one the model's
    /// template refuses (e.g. roles that do not alternate). A client error.
    #[error("chat template rejected the conversation: {0}")]
    TemplateRaised(String),
    #[error("chat template failed: {0}")]
    Template(String),
    #[error("message {index}: content part of type `{kind}` is not supported (only `text`)")]
    UnsupportedContentPart { index: usize, kind: String },
}

pub type Result<T, E = TokenizerError> = std::result::Result<T, E>;

/// A tokenizer with the same API whatever its vocabulary, and the model-level facts that go
/// with it (end-of-sequence ids, special tokens, chat template).
///
/// Cheap to share behind an `Arc`; every method takes `&self`.
pub struct Tokenizer {
    vocab: Vocab,
    vocab_size: usize,
    special_ids: HashSet<u32>,
    eos_token_ids: Vec<u32>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    add_bos_token: bool,
    chat_template: Option<ChatTemplate>,
}

// Handlers share one tokenizer across the blocking pool and stream tasks.
const _: () = {
    const fn shareable<T: Send + Sync>() {}
    shareable::<Tokenizer>();
    shareable::<IncrementalDecoder>();
};

/// The two vocabularies. An enum rather than a trait object: there are exactly two, both
/// implement every operation, and the match keeps each call site a plain function call.
enum Vocab {
    Hf(Box<tokenizers::Tokenizer>),
    Bytes(ByteTokenizer),
}

impl Tokenizer {
    /// The embedded byte-level tokenizer with its ChatML template; see [`ByteTokenizer`].
    pub fn embedded() -> Tokenizer {
        let vocab = ByteTokenizer;
        let special_ids = (bytes::FIRST_SPECIAL..ByteTokenizer::VOCAB_SIZE as u32).collect();
        Tokenizer {
            vocab_size: ByteTokenizer::VOCAB_SIZE,
            special_ids,
            eos_token_ids: vec![ByteTokenizer::IM_END, ByteTokenizer::ENDOFTEXT],
            bos_token: None,
            eos_token: Some(bytes::IM_END_TEXT.to_string()),
            add_bos_token: false,
            chat_template: Some(
                ChatTemplate::new(bytes::CHAT_TEMPLATE)
                    .expect("the embedded chat template compiles (tested)")
                    .with_special_tokens(None, Some(bytes::IM_END_TEXT.to_string())),
            ),
            vocab: Vocab::Bytes(vocab),
        }
    }

    /// A bare `tokenizer.json`: no chat template, no end-of-sequence ids (use [`Tokenizer::from_dir`]
    /// for a model directory).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Tokenizer> {
        let path = path.as_ref();
        if !path.is_file() {
            return Err(TokenizerError::Io {
                path: path.to_path_buf(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
            });
        }
        let hf = tokenizers::Tokenizer::from_file(path).map_err(|e| TokenizerError::Load {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        // get_vocab_size(true) builds the whole vocabulary map, so it is computed once here.
        let vocab_size = hf.get_vocab_size(true);
        let special_ids = hf
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, _)| id)
            .collect();
        Ok(Tokenizer {
            vocab: Vocab::Hf(Box::new(hf)),
            vocab_size,
            special_ids,
            eos_token_ids: Vec::new(),
            bos_token: None,
            eos_token: None,
            add_bos_token: false,
            chat_template: None,
        })
    }

    /// A Hugging Face model directory: `tokenizer.json` (required; only "fast" tokenizers are
    /// supported), `tokenizer_config.json` (special tokens, `add_bos_token`, `chat_template`),
    /// `chat_template.jinja` (overrides the config's template, as in transformers) and
    /// `generation_config.json` (`eos_token_id`, an int or a list).
    ///
    /// `eos_token_ids` is the tokenizer's `eos_token` followed by generation_config's ids,
    /// without repeats: instruct models often stop on both (`<|im_end|>` and `<|endoftext|>`).
    /// The template is compiled here so that a template minijinja cannot parse fails at
    /// startup rather than on the first chat request.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Tokenizer> {
        let dir = dir.as_ref();
        let mut tok = Tokenizer::from_file(dir.join("tokenizer.json"))?;

        let config_path = dir.join("tokenizer_config.json");
        let config = read_json_if_exists(&config_path)?.unwrap_or_default();
        let token_field = |key: &str| -> Result<Option<String>> {
            match config.get(key) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
                // transformers also saves special tokens as serialized AddedToken objects.
                Some(serde_json::Value::Object(o)) => match o.get("content") {
                    Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
                    _ => Err(TokenizerError::Config {
                        path: config_path.clone(),
                        reason: format!("`{key}` object has no string `content`"),
                    }),
                },
                Some(other) => Err(TokenizerError::Config {
                    path: config_path.clone(),
                    reason: format!("`{key}` is neither a string nor an object: {other}"),
                }),
            }
        };
        tok.bos_token = token_field("bos_token")?;
        tok.eos_token = token_field("eos_token")?;
        tok.add_bos_token = config
            .get("add_bos_token")
            .and_then(|v| v.as_bool())
            .unwrap_or(false);

        let jinja_path = dir.join("chat_template.jinja");
        let template = if jinja_path.is_file() {
            let source =
                std::fs::read_to_string(&jinja_path).map_err(|source| TokenizerError::Io {
                    path: jinja_path.clone(),
                    source,
                })?;
            Some(ChatTemplate::new(&source)?)
        } else {
            match config.get("chat_template") {
                None | Some(serde_json::Value::Null) => None,
                Some(serde_json::Value::String(s)) => Some(ChatTemplate::new(s)?),
                Some(serde_json::Value::Array(list)) => {
                    let named = list
                        .iter()
                        .map(|t| match (t.get("name").and_then(|n| n.as_str()), t.get("template").and_then(|s| s.as_str())) {
                            (Some(n), Some(s)) => Ok((n.to_string(), s.to_string())),
                            _ => Err(TokenizerError::Config { path: config_path.clone(), reason: "`chat_template` list entries need string `name` and `template`".into() }),
                        })
                        .collect::<Result<Vec<_>>>()?;
                    Some(ChatTemplate::named(named)?)
                }
                Some(_) => {
                    return Err(TokenizerError::Config {
                        path: config_path.clone(),
                        reason: "`chat_template` is neither a string nor a list".into(),
                    })
                }
            }
        };
        tok.chat_template =
            template.map(|t| t.with_special_tokens(tok.bos_token.clone(), tok.eos_token.clone()));

        if let Some(eos) = tok.eos_token.clone() {
            let id = tok
                .token_to_id(&eos)
                .ok_or_else(|| TokenizerError::Config {
                    path: config_path.clone(),
                    reason: format!("eos_token `{eos}` is not in the vocabulary"),
                })?;
            tok.eos_token_ids.push(id);
        }
        let gen_path = dir.join("generation_config.json");
        if let Some(gen) = read_json_if_exists(&gen_path)? {
            let ids = match gen.get("eos_token_id") {
                None | Some(serde_json::Value::Null) => Some(Vec::new()),
                Some(serde_json::Value::Array(a)) => {
                    a.iter().map(as_token_id).collect::<Option<Vec<_>>>()
                }
                Some(v) => as_token_id(v).map(|id| vec![id]),
            }
            .ok_or_else(|| TokenizerError::Config {
                path: gen_path.clone(),
                reason: "`eos_token_id` is neither a token id nor a list of them".into(),
            })?;
            for id in ids {
                if !tok.eos_token_ids.contains(&id) {
                    tok.eos_token_ids.push(id);
                }
            }
        }
        Ok(tok)
    }

    /// Token ids of `text`. Special tokens written in the text (e.g. `<|im_end|>`) are always
    /// recognized, as in HF with `split_special_tokens=False`; `add_special_tokens` only adds
    /// what the tokenizer's post-processor adds (e.g. a BOS). Chat prompts already carry their
    /// special tokens from the template, so they are encoded with `add_special_tokens = false`.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        match &self.vocab {
            Vocab::Hf(hf) => hf
                .encode_fast(text, add_special_tokens)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| TokenizerError::Backend(e.to_string())),
            Vocab::Bytes(b) => Ok(b.encode(text)),
        }
    }

    /// Text of `ids`; invalid UTF-8 (an incomplete character at the end, say) becomes U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        match &self.vocab {
            Vocab::Hf(hf) => hf
                .decode(ids, skip_special_tokens)
                .map_err(|e| TokenizerError::Backend(e.to_string())),
            Vocab::Bytes(b) => b.decode(ids, skip_special_tokens),
        }
    }

    /// Number of token ids the tokenizer knows, added tokens included. The model's embedding
    /// table may be larger (padded); ids past this decode to nothing.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        match &self.vocab {
            Vocab::Hf(hf) => hf.token_to_id(token),
            Vocab::Bytes(b) => b.token_to_id(token),
        }
    }

    /// The vocabulary entry of `id` (for a byte-level BPE, in its byte-to-unicode alphabet,
    /// e.g. `Ġthe`), not its decoded text.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        match &self.vocab {
            Vocab::Hf(hf) => hf.id_to_token(id),
            Vocab::Bytes(b) => b.id_to_token(id),
        }
    }

    /// Whether `id` is a special token (the ones `skip_special_tokens` drops).
    pub fn is_special(&self, id: u32) -> bool {
        self.special_ids.contains(&id)
    }

    /// Ids that end generation unless the request says `ignore_eos`.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// tokenizer_config's `add_bos_token`, for information: `encode` relies on tokenizer.json's
    /// post-processor, which already adds the BOS where the model wants one.
    pub fn add_bos_token(&self) -> bool {
        self.add_bos_token
    }

    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// Renders `messages` with the model's chat template ([`ChatTemplate::render`]).
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        args: &TemplateArgs,
    ) -> Result<String> {
        self.chat_template
            .as_ref()
            .ok_or(TokenizerError::NoChatTemplate)?
            .render(messages, args)
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.vocab {
            Vocab::Hf(_) => "huggingface",
            Vocab::Bytes(_) => "bytes",
        };
        f.debug_struct("Tokenizer")
            .field("kind", &kind)
            .field("vocab_size", &self.vocab_size)
            .field("eos_token_ids", &self.eos_token_ids)
            .field("has_chat_template", &self.chat_template.is_some())
            .finish()
    }
}

fn as_token_id(v: &serde_json::Value) -> Option<u32> {
    v.as_u64().and_then(|id| u32::try_from(id).ok())
}

fn read_json_if_exists(path: &Path) -> Result<Option<serde_json::Map<String, serde_json::Value>>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|source| TokenizerError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    match serde_json::from_str(&text).map_err(|source| TokenizerError::Json {
        path: path.to_path_buf(),
        source,
    })? {
        serde_json::Value::Object(map) => Ok(Some(map)),
        _ => Err(TokenizerError::Config {
            path: path.to_path_buf(),
            reason: "not a JSON object".into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_tokenizer_has_chatml_eos_and_specials() {
        let tok = Tokenizer::embedded();
        assert_eq!(tok.vocab_size(), 259);
        assert_eq!(tok.eos_token_ids(), &[258, 256]);
        assert_eq!(tok.eos_token(), Some("<|im_end|>"));
        assert!(tok.is_special(257) && !tok.is_special(255));
        assert_eq!(tok.token_to_id("<|im_start|>"), Some(257));
        assert_eq!(tok.id_to_token(0x41).as_deref(), Some("<0x41>"));
    }

    #[test]
    fn embedded_tokenizer_encodes_bytes_and_round_trips() {
        let tok = Tokenizer::embedded();
        let text = "héllo 世界 🦀<|im_end|>";
        let ids = tok.encode(text, true).unwrap();
        assert_eq!(&ids[..2], &[b'h' as u32, 0xC3]);
        assert_eq!(*ids.last().unwrap(), 258);
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
        assert_eq!(tok.decode(&ids, true).unwrap(), "héllo 世界 🦀");
    }

    #[test]
    fn from_dir_reads_configs_and_merges_eos_ids() {
        let dir = tempfile::tempdir().unwrap();
        // A word-level tokenizer.json small enough to write by hand.
        let tokenizer_json = serde_json::json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": [
                {"id": 3, "content": "<eos>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
                {"id": 4, "content": "<eot>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
            ],
            "normalizer": null,
            "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": null,
            "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "hello": 1, "world": 2, "<eos>": 3, "<eot>": 4}, "unk_token": "<unk>"}
        });
        std::fs::write(
            dir.path().join("tokenizer.json"),
            tokenizer_json.to_string(),
        )
        .unwrap();
        let config = serde_json::json!({
            "eos_token": {"content": "<eos>", "special": true},
            "bos_token": null,
            "add_bos_token": false,
            "chat_template": [
                {"name": "default", "template": "{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"},
                {"name": "tool_use", "template": "tools:{{ tools | length }}"}
            ]
        });
        std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
        std::fs::write(
            dir.path().join("generation_config.json"),
            r#"{"eos_token_id": [4, 3]}"#,
        )
        .unwrap();

        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(tok.eos_token_ids(), &[3, 4]);
        assert_eq!(tok.eos_token(), Some("<eos>"));
        assert_eq!(tok.bos_token(), None);
        assert_eq!(
            tok.encode("hello world <eot>", false).unwrap(),
            vec![1, 2, 4]
        );
        assert!(tok.is_special(4) && !tok.is_special(1));
        assert_eq!(tok.vocab_size(), 5);

        let msgs = [ChatMessage::text("user", "hi")];
        assert_eq!(
            tok.apply_chat_template(&msgs, &TemplateArgs::default())
                .unwrap(),
            "hi<eos>"
        );
        let args = TemplateArgs {
            tools: Some(vec![serde_json::json!({"name": "f"})]),
            ..Default::default()
        };
        assert_eq!(tok.apply_chat_template(&msgs, &args).unwrap(), "tools:1");

        // A single int works too, and chat_template.jinja overrides the config's template.
        std::fs::write(
            dir.path().join("generation_config.json"),
            r#"{"eos_token_id": 4}"#,
        )
        .unwrap();
        std::fs::write(
            dir.path().join("chat_template.jinja"),
            "J{{ messages[0].content }}",
        )
        .unwrap();
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(tok.eos_token_ids(), &[3, 4]);
        assert_eq!(
            tok.apply_chat_template(&msgs, &TemplateArgs::default())
                .unwrap(),
            "Jhi"
        );
    }

    #[test]
    fn from_dir_errors_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let err = Tokenizer::from_dir(dir.path()).unwrap_err();
        assert!(err.to_string().contains("tokenizer.json"), "{err}");
        assert!(Tokenizer::from_file(dir.path().join("nope.json")).is_err());
        std::fs::write(dir.path().join("tokenizer.json"), "{").unwrap();
        assert!(matches!(
            Tokenizer::from_dir(dir.path()),
            Err(TokenizerError::Load { .. })
        ));
    }

    #[test]
    fn bare_tokenizer_file_has_no_chat_template() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokenizer.json");
        let json = r#"{"version": "1.0", "added_tokens": [], "normalizer": null, "pre_tokenizer": null, "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"<unk>": 0}, "unk_token": "<unk>"}}"#;
        std::fs::write(&path, json).unwrap();
        let tok = Tokenizer::from_file(&path).unwrap();
        assert!(tok.eos_token_ids().is_empty() && tok.chat_template().is_none());
        let err = tok
            .apply_chat_template(&[ChatMessage::text("user", "x")], &TemplateArgs::default())
            .unwrap_err();
        assert!(matches!(err, TokenizerError::NoChatTemplate));
    }
}
