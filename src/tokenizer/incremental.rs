//! Streaming detokenization: turns generated ids into text one token at a time, emitting
//! only text that later tokens cannot change.
//!
//! Decoding a token alone is wrong in two ways: a byte-level BPE token may hold half a UTF-8
//! character (it decodes to U+FFFD until the rest arrives), and SentencePiece-style decoders
//! drop or change a token's leading space depending on what precedes it. So, as HF TGI and
//! vLLM do, we decode a small window `ids[prefix_offset..]` and emit what it adds over
//! `ids[prefix_offset..read_offset]` (text already emitted), and only once that addition does
//! not end in U+FFFD.

use std::sync::Arc;

use super::{Result, Tokenizer};

/// Prompt tokens kept as left context for the first generated tokens (vLLM uses 5 too):
/// enough for a decoder to see that the first generated token is not at the start of text.
const PROMPT_CONTEXT: usize = 5;

/// Per-request streaming decoder. Feed it every generated id with [`push`](Self::push); at the
/// end call [`finish`](Self::finish) to flush text held back (an incomplete character then
/// comes out as U+FFFD). [`text`](Self::text) is everything emitted so far, for stop strings.
#[derive(Debug)]
pub struct IncrementalDecoder {
    tokenizer: Arc<Tokenizer>,
    skip_special_tokens: bool,
    /// The decode window: prompt context and generated ids not yet behind `prefix_offset`.
    /// Ids before `prefix_offset` are dropped, so memory stays bounded on long generations.
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    /// Decode of `ids[prefix_offset..read_offset]`, cached because it only changes on emit.
    prefix_text: String,
    text: String,
    num_tokens: usize,
}

impl IncrementalDecoder {
    /// A decoder for a completion of `prompt_ids` (may be empty); the prompt's last few ids are
    /// decoding context only and never appear in [`text`](Self::text).
    pub fn new(
        tokenizer: Arc<Tokenizer>,
        prompt_ids: &[u32],
        skip_special_tokens: bool,
    ) -> Result<IncrementalDecoder> {
        let ids = prompt_ids[prompt_ids.len().saturating_sub(PROMPT_CONTEXT)..].to_vec();
        let prefix_text = tokenizer.decode(&ids, skip_special_tokens)?;
        Ok(IncrementalDecoder {
            read_offset: ids.len(),
            prefix_offset: 0,
            ids,
            prefix_text,
            tokenizer,
            skip_special_tokens,
            text: String::new(),
            num_tokens: 0,
        })
    }

    /// Adds one generated id; returns the text it completes (often empty: held back or skipped).
    pub fn push(&mut self, id: u32) -> Result<&str> {
        self.ids.push(id);
        self.num_tokens += 1;
        let start = self.text.len();
        let new_text = self
            .tokenizer
            .decode(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
        if new_text.len() > self.prefix_text.len() && !new_text.ends_with('\u{FFFD}') {
            self.text
                .push_str(suffix_after(&new_text, &self.prefix_text));
            self.advance()?;
        }
        Ok(&self.text[start..])
    }

    /// Flushes text held back, lossily; call once after the last id.
    pub fn finish(&mut self) -> Result<&str> {
        let start = self.text.len();
        if self.read_offset < self.ids.len() {
            let new_text = self
                .tokenizer
                .decode(&self.ids[self.prefix_offset..], self.skip_special_tokens)?;
            self.text
                .push_str(suffix_after(&new_text, &self.prefix_text));
            self.advance()?;
        }
        Ok(&self.text[start..])
    }

    /// All text emitted so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Number of ids pushed.
    pub fn num_tokens(&self) -> usize {
        self.num_tokens
    }

    /// Everything up to the end is now emitted: the last read window becomes the new prefix.
    fn advance(&mut self) -> Result<()> {
        self.ids.drain(..self.read_offset);
        self.prefix_offset = 0;
        self.read_offset = self.ids.len();
        self.prefix_text = self.tokenizer.decode(&self.ids, self.skip_special_tokens)?;
        Ok(())
    }
}

/// The part of `new` after the already-emitted `prefix`. Normally `new` starts with `prefix`;
/// when a decoder rewrote the prefix's text (or it ended in U+FFFD that is now a character),
/// fall back to skipping as many characters as the prefix has, as vLLM does.
fn suffix_after<'a>(new: &'a str, prefix: &str) -> &'a str {
    if let Some(rest) = new.strip_prefix(prefix) {
        return rest;
    }
    match new.char_indices().nth(prefix.chars().count()) {
        Some((i, _)) => &new[i..],
        None => "",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stream(dec: &mut IncrementalDecoder, ids: &[u32]) -> Vec<String> {
        let mut pieces: Vec<String> = ids
            .iter()
            .map(|&id| dec.push(id).unwrap().to_string())
            .collect();
        pieces.push(dec.finish().unwrap().to_string());
        pieces
    }

    #[test]
    fn multibyte_characters_are_held_until_complete() {
        let tok = Arc::new(Tokenizer::embedded());
        let ids = tok.encode("a€🦀", false).unwrap();
        let mut dec = IncrementalDecoder::new(tok.clone(), &[], false).unwrap();
        let pieces = stream(&mut dec, &ids);
        assert_eq!(pieces, ["a", "", "", "€", "", "", "", "🦀", ""]);
        assert_eq!(dec.text(), "a€🦀");
        assert_eq!(dec.num_tokens(), ids.len());
    }

    #[test]
    fn finish_flushes_an_incomplete_character() {
        let tok = Arc::new(Tokenizer::embedded());
        let mut dec = IncrementalDecoder::new(tok, &[], false).unwrap();
        assert_eq!(dec.push(b'x' as u32).unwrap(), "x");
        assert_eq!(dec.push(0xF0).unwrap(), "");
        assert_eq!(dec.finish().unwrap(), "\u{FFFD}");
        assert_eq!(dec.finish().unwrap(), "");
        assert_eq!(dec.text(), "x\u{FFFD}");
    }

    #[test]
    fn special_tokens_are_skipped_or_kept() {
        let tok = Arc::new(Tokenizer::embedded());
        let ids = tok.encode("hi<|im_end|>", false).unwrap();
        let prompt = tok.encode("<|im_start|>assistant\n", false).unwrap();
        let mut skip = IncrementalDecoder::new(tok.clone(), &prompt, true).unwrap();
        stream(&mut skip, &ids);
        assert_eq!(skip.text(), "hi");
        let mut keep = IncrementalDecoder::new(tok, &prompt, false).unwrap();
        stream(&mut keep, &ids);
        assert_eq!(keep.text(), "hi<|im_end|>");
    }

    /// A SentencePiece-style decoder drops the leading space of the first token it sees, so
    /// decoding tokens one by one would lose every space; the window keeps them.
    #[test]
    fn leading_spaces_survive_a_metaspace_decoder() {
        let dir = tempfile::tempdir().unwrap();
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null,
            "decoder": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true},
            "model": {"type": "WordLevel", "vocab": {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3}, "unk_token": "<unk>"}
        });
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, json.to_string()).unwrap();
        let tok = Arc::new(Tokenizer::from_file(&path).unwrap());
        assert_eq!(tok.decode(&[2], false).unwrap(), "world");
        assert_eq!(tok.decode(&[1, 2, 3], false).unwrap(), "Hello world!");

        let mut dec = IncrementalDecoder::new(tok.clone(), &[], false).unwrap();
        assert_eq!(stream(&mut dec, &[1, 2, 3]), ["Hello", " world", "!", ""]);
        // With the prompt as context, the first generated token keeps its space too.
        let mut dec = IncrementalDecoder::new(tok, &[1], false).unwrap();
        stream(&mut dec, &[2, 3]);
        assert_eq!(dec.text(), " world!");
    }

    #[test]
    fn suffix_after_falls_back_to_char_count() {
        assert_eq!(suffix_after("abc", "ab"), "c");
        assert_eq!(suffix_after("x€y", "a\u{FFFD}"), "y");
        assert_eq!(suffix_after("ab", "abc"), "");
    }
}
