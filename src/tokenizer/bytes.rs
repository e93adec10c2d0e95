//! The embedded default model's vocabulary: one token per byte plus three ChatML special
//! tokens, built in code so the embedded model needs no tokenizer file.

use super::{Result, TokenizerError};

/// Text of the special tokens, in id order starting at [`FIRST_SPECIAL`].
const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
pub(super) const FIRST_SPECIAL: u32 = 256;
pub(super) const IM_END_TEXT: &str = SPECIALS[2];

/// ChatML as Qwen3 writes it, without the `<think>` tags: every message is
/// `<|im_start|>{role}\n{content}<|im_end|>\n`, and the generation prompt opens an assistant turn.
pub(super) const CHAT_TEMPLATE: &str = "{%- for message in messages %}\n    {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n";

/// Byte-level vocabulary: ids 0..=255 are the bytes, then `<|endoftext|>` (256),
/// `<|im_start|>` (257), `<|im_end|>` (258).
///
/// Encoding a string gives its UTF-8 bytes, except that the special tokens' text is always
/// recognized and becomes the special id (as HF does for added tokens), whatever
/// `add_special_tokens` says: there is no BOS to add. Decoding concatenates bytes and decodes
/// UTF-8 (lossily) once at the end, so a character split over several tokens comes back whole.
/// Byte tokens are named `<0xNN>` (SentencePiece's convention) by [`ByteTokenizer::id_to_token`].
#[derive(Clone, Copy, Debug, Default)]
pub struct ByteTokenizer;

impl ByteTokenizer {
    pub const VOCAB_SIZE: usize = 256 + SPECIALS.len();
    pub const ENDOFTEXT: u32 = FIRST_SPECIAL;
    pub const IM_START: u32 = FIRST_SPECIAL + 1;
    pub const IM_END: u32 = FIRST_SPECIAL + 2;

    pub fn encode(&self, text: &str) -> Vec<u32> {
        let bytes = text.as_bytes();
        let mut ids = Vec::with_capacity(bytes.len());
        let mut i = 0;
        while i < bytes.len() {
            // Every special token starts with `<`, so only there is a match possible.
            if bytes[i] == b'<' {
                if let Some(k) = SPECIALS
                    .iter()
                    .position(|s| bytes[i..].starts_with(s.as_bytes()))
                {
                    ids.push(FIRST_SPECIAL + k as u32);
                    i += SPECIALS[k].len();
                    continue;
                }
            }
            ids.push(u32::from(bytes[i]));
            i += 1;
        }
        ids
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        let mut bytes = Vec::with_capacity(ids.len());
        for &id in ids {
            match special_index(id) {
                None => bytes.push(u8::try_from(id).expect("ids below FIRST_SPECIAL are bytes")),
                Some(Some(k)) if !skip_special_tokens => {
                    bytes.extend_from_slice(SPECIALS[k].as_bytes())
                }
                Some(Some(_)) => {}
                Some(None) => {
                    return Err(TokenizerError::UnknownTokenId {
                        id,
                        vocab_size: Self::VOCAB_SIZE,
                    })
                }
            }
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        if let Some(k) = SPECIALS.iter().position(|s| *s == token) {
            return Some(FIRST_SPECIAL + k as u32);
        }
        let hex = token.strip_prefix("<0x")?.strip_suffix('>')?;
        if hex.len() != 2 {
            return None;
        }
        u8::from_str_radix(hex, 16).ok().map(u32::from)
    }

    /// The bytes token `id` stands for: its byte, or a special token's text.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        match special_index(id) {
            None => Some(vec![
                u8::try_from(id).expect("ids below FIRST_SPECIAL are bytes")
            ]),
            Some(k) => k.map(|k| SPECIALS[k].as_bytes().to_vec()),
        }
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        match special_index(id) {
            None => Some(format!("<0x{id:02X}>")),
            Some(k) => k.map(|k| SPECIALS[k].to_string()),
        }
    }
}

/// `None` for a byte id, `Some(Some(k))` for special token `k`, `Some(None)` past the vocabulary.
fn special_index(id: u32) -> Option<Option<usize>> {
    if id < FIRST_SPECIAL {
        return None;
    }
    let k = (id - FIRST_SPECIAL) as usize;
    Some((k < SPECIALS.len()).then_some(k))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn special_tokens_are_recognized_in_text() {
        let t = ByteTokenizer;
        assert_eq!(
            t.encode("<|im_start|>a<|im_end|><|x"),
            vec![257, 97, 258, b'<' as u32, b'|' as u32, b'x' as u32]
        );
        assert_eq!(t.encode(""), Vec::<u32>::new());
    }

    #[test]
    fn decode_joins_bytes_before_utf8() {
        let t = ByteTokenizer;
        let ids = t.encode("é🦀");
        assert_eq!(ids.len(), 2 + 4);
        assert_eq!(t.decode(&ids, false).unwrap(), "é🦀");
        // An incomplete character decodes lossily, as HF byte-level decoders do.
        assert_eq!(t.decode(&ids[..3], false).unwrap(), "é\u{FFFD}");
        // Bytes are joined before UTF-8 decoding: a skipped special token inside a character
        // leaves it whole; a kept one splits it.
        assert_eq!(t.decode(&[0xC3, 256, 0xA9], true).unwrap(), "é");
        assert_eq!(
            t.decode(&[0xC3, 256, 0xA9], false).unwrap(),
            "\u{FFFD}<|endoftext|>\u{FFFD}"
        );
    }

    #[test]
    fn out_of_vocab_ids_are_an_error() {
        let err = ByteTokenizer.decode(&[1, 259], false).unwrap_err();
        assert!(matches!(
            err,
            TokenizerError::UnknownTokenId {
                id: 259,
                vocab_size: 259
            }
        ));
        assert_eq!(ByteTokenizer.id_to_token(259), None);
    }

    #[test]
    fn token_names_round_trip() {
        let t = ByteTokenizer;
        for id in 0..ByteTokenizer::VOCAB_SIZE as u32 {
            let name = t.id_to_token(id).unwrap();
            assert_eq!(t.token_to_id(&name), Some(id), "{name}");
        }
        assert_eq!(t.token_to_id("<0x1>"), None);
        assert_eq!(t.token_to_id("a"), None);
    }
}
