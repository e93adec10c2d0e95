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
    /// How a vocabulary entry spells its bytes (see [`Tokenizer::token_bytes`]).
    spelling: Spelling,
    /// Added tokens (specials and the like) by id: their text is their bytes.
    added: std::collections::HashMap<u32, String>,
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

/// How the entries of a vocabulary spell the bytes of their tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Spelling {
    /// GPT-2's byte-level BPE (Qwen, Llama 3, ...): each char of an entry stands for one byte
    /// through the byte-to-unicode table.
    ByteLevel,
    /// SentencePiece with byte fallback (Llama 2, Mistral): `<0xNN>` is byte NN, `▁` a space.
    ByteFallback,
    /// Anything else: an entry is its decoded text.
    Text,
    /// The embedded byte vocabulary.
    Bytes,
}

/// GPT-2's byte-to-unicode table inverted: printable Latin-1 bytes stand for themselves, the
/// other 68 are shifted to U+0100 and up, in byte order.
fn byte_level_byte(c: char) -> Option<u8> {
    let printable = |b: u32| {
        (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b)
    };
    let cp = c as u32;
    if cp < 0x100 {
        return printable(cp).then_some(cp as u8);
    }
    let n = cp - 0x100;
    (0u32..0x100)
        .filter(|&b| !printable(b))
        .nth(n as usize)
        .map(|b| b as u8)
}

fn spelling_of(hf: &tokenizers::Tokenizer) -> Spelling {
    use tokenizers::DecoderWrapper as D;
    fn of(d: &D) -> Option<Spelling> {
        match d {
            D::ByteLevel(_) => Some(Spelling::ByteLevel),
            D::ByteFallback(_) => Some(Spelling::ByteFallback),
            D::Sequence(s) => s.get_decoders().iter().find_map(of),
            _ => None,
        }
    }
    hf.get_decoder().and_then(of).unwrap_or(Spelling::Text)
}

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
            spelling: Spelling::Bytes,
            added: Default::default(),
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
        let added_tokens = hf.get_added_tokens_decoder();
        let special_ids = added_tokens
            .iter()
            .filter(|(_, t)| t.special)
            .map(|(id, _)| *id)
            .collect();
        let added = added_tokens
            .into_iter()
            .map(|(id, t)| (id, t.content))
            .collect();
        Ok(Tokenizer {
            spelling: spelling_of(&hf),
            added,
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

    /// The bytes token `id` stands for, as OpenAI's logprobs `bytes` reports them: a token that
    /// holds part of a UTF-8 character gives that part, not U+FFFD. None past the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        if let Vocab::Bytes(b) = &self.vocab {
            return b.token_bytes(id);
        }
        if let Some(text) = self.added.get(&id) {
            return Some(text.as_bytes().to_vec());
        }
        let entry = self.id_to_token(id)?;
        let spelled = match self.spelling {
            Spelling::ByteLevel => entry
                .chars()
                .map(byte_level_byte)
                .collect::<Option<Vec<u8>>>(),
            Spelling::ByteFallback => Some(
                match entry
                    .strip_prefix("<0x")
                    .and_then(|h| h.strip_suffix('>'))
                    .filter(|h| h.len() == 2)
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                {
                    Some(b) => vec![b],
                    None => entry.replace('\u{2581}', " ").into_bytes(),
                },
            ),
            Spelling::Text | Spelling::Bytes => None,
        };
        spelled.or_else(|| self.decode(&[id], false).ok().map(String::into_bytes))
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
    fn byte_level_table_inverts_gpt2s() {
        // GPT-2's table: space is `Ġ` (U+0120), newline `Ċ` (U+010A), NUL `Ā` (U+0100),
        // printable ASCII and most of Latin-1 stand for themselves.
        assert_eq!(byte_level_byte('Ġ'), Some(b' '));
        assert_eq!(byte_level_byte('Ċ'), Some(b'\n'));
        assert_eq!(byte_level_byte('Ā'), Some(0));
        assert_eq!(byte_level_byte('a'), Some(b'a'));
        assert_eq!(byte_level_byte('é'), Some(0xe9));
        assert_eq!(
            byte_level_byte(' '),
            None,
            "a raw space is not in the alphabet"
        );
        let all: std::collections::HashSet<u8> = (0u32..0x200)
            .filter_map(char::from_u32)
            .filter_map(byte_level_byte)
            .collect();
        assert_eq!(all.len(), 256, "every byte has exactly one char");
    }

    #[test]
    fn embedded_token_bytes_are_single_bytes_and_special_texts() {
        let tok = Tokenizer::embedded();
        assert_eq!(tok.token_bytes(0xe2), Some(vec![0xe2]));
        assert_eq!(
            tok.token_bytes(ByteTokenizer::IM_END),
            Some(b"<|im_end|>".to_vec())
        );
        assert_eq!(tok.token_bytes(ByteTokenizer::VOCAB_SIZE as u32), None);
    }

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
