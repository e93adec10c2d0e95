//! Reading a streamed generation: split the SSE byte stream into `data:` payloads (frames may
//! arrive split across reads, or several in one read) and turn each payload of the three wire
//! formats into "this many new tokens arrived" events.
//!
//! SGLang's native stream repeats the whole text and `output_ids` so far in every frame; the
//! OpenAI forms send deltas. Both are reduced here to the same events so the metrics never
//! depend on the wire format.

use serde_json::Value;

/// Splits an SSE byte stream into the data of each event (the `data:` lines of one event,
/// joined by newlines, as the SSE spec says).
#[derive(Default)]
pub struct SseDecoder {
    /// Bytes after the last complete line; kept as bytes because a read may end inside a
    /// multi-byte UTF-8 character.
    partial: Vec<u8>,
    data: Vec<String>,
}

impl SseDecoder {
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.partial.extend_from_slice(bytes);
        let mut events = Vec::new();
        let mut start = 0;
        while let Some(pos) = self.partial[start..].iter().position(|&b| b == b'\n') {
            let end = start + pos;
            let mut line = &self.partial[start..end];
            if line.last() == Some(&b'\r') {
                line = &line[..line.len() - 1];
            }
            let line = String::from_utf8_lossy(line).into_owned();
            start = end + 1;
            self.line(line, &mut events);
        }
        self.partial.drain(..start);
        events
    }

    /// Whatever the stream left undelimited at its end (a server that omits the final blank
    /// line still sent an event).
    pub fn finish(&mut self) -> Vec<String> {
        let mut events = Vec::new();
        if !self.partial.is_empty() {
            let line = String::from_utf8_lossy(&std::mem::take(&mut self.partial)).into_owned();
            self.line(line.trim_end_matches('\r').to_string(), &mut events);
        }
        if !self.data.is_empty() {
            events.push(self.data.join("\n"));
            self.data.clear();
        }
        events
    }

    fn line(&mut self, line: String, events: &mut Vec<String>) {
        if line.is_empty() {
            if !self.data.is_empty() {
                events.push(self.data.join("\n"));
                self.data.clear();
            }
        } else if let Some(rest) = line.strip_prefix("data:") {
            self.data
                .push(rest.strip_prefix(' ').unwrap_or(rest).to_string());
        }
        // `event:`, `id:`, `retry:` and `:` comments carry nothing the bench measures.
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum WireFormat {
    /// SGLang `/generate`: cumulative `text`/`output_ids` plus `meta_info`.
    Native,
    /// `/v1/completions`: `choices[0].text` deltas, `usage` in the last chunk.
    Completions,
    /// `/v1/chat/completions`: `choices[0].delta.content` deltas, `usage` in the last chunk.
    Chat,
}

#[derive(Debug, PartialEq)]
pub enum StreamEvent {
    /// Output arrived: `tokens` new tokens (0 when only text moved, e.g. a held-back
    /// partial character was released) and `text_bytes` new bytes of text.
    Output {
        tokens: usize,
        text_bytes: usize,
    },
    /// A frame that carried no output (role header, usage-only chunk, keep-alive).
    Nothing,
    Done,
}

/// What one streamed response has said so far.
pub struct StreamState {
    format: WireFormat,
    text_len: usize,
    text: String,
    ids_len: usize,
    chunk_tokens: usize,
    pub prompt_tokens: Option<usize>,
    pub completion_tokens: Option<usize>,
    pub finish_reason: Option<String>,
}

impl StreamState {
    pub fn new(format: WireFormat) -> Self {
        Self {
            format,
            text_len: 0,
            text: String::new(),
            ids_len: 0,
            chunk_tokens: 0,
            prompt_tokens: None,
            completion_tokens: None,
            finish_reason: None,
        }
    }

    /// Output tokens of the request: the server's count when it gave one (the number the
    /// server billed and that sglang's bench reports), else the tokens seen in chunks.
    pub fn output_tokens(&self) -> usize {
        self.completion_tokens.unwrap_or(self.chunk_tokens)
    }

    pub fn text(&self) -> &str {
        &self.text
    }

    /// Interprets one `data:` payload; `Err` carries the server's error message.
    pub fn on_data(&mut self, payload: &str) -> Result<StreamEvent, String> {
        let payload = payload.trim();
        if payload == "[DONE]" {
            return Ok(StreamEvent::Done);
        }
        if payload.is_empty() {
            return Ok(StreamEvent::Nothing);
        }
        let v: Value = serde_json::from_str(payload)
            .map_err(|e| format!("bad stream frame ({e}): {}", truncate(payload, 200)))?;
        if let Some(err) = v.get("error") {
            let msg = err
                .get("message")
                .and_then(Value::as_str)
                .map(str::to_string)
                .unwrap_or_else(|| err.to_string());
            return Err(msg);
        }
        match self.format {
            WireFormat::Native => self.native(&v),
            WireFormat::Completions => self.openai(&v, |c| c.get("text")),
            WireFormat::Chat => self.openai(&v, |c| c.get("delta").and_then(|d| d.get("content"))),
        }
    }

    fn native(&mut self, v: &Value) -> Result<StreamEvent, String> {
        let meta = v.get("meta_info");
        if let Some(fr) = meta.and_then(|m| m.get("finish_reason")) {
            if fr.get("type").and_then(Value::as_str) == Some("abort") {
                let msg = fr
                    .get("message")
                    .and_then(Value::as_str)
                    .unwrap_or("aborted");
                return Err(format!("aborted by server: {msg}"));
            }
            if !fr.is_null() {
                self.finish_reason = Some(
                    fr.get("type")
                        .and_then(Value::as_str)
                        .map(str::to_string)
                        .unwrap_or_else(|| fr.to_string()),
                );
            }
        }
        if let Some(p) = meta
            .and_then(|m| m.get("prompt_tokens"))
            .and_then(Value::as_u64)
        {
            self.prompt_tokens = Some(p as usize);
        }
        let text = v.get("text").and_then(Value::as_str).unwrap_or("");
        // Cumulative by default; a server in incremental mode sends only the new part, which
        // shows as a text that does not extend what we have.
        let new_text = if text.len() >= self.text_len && text.starts_with(self.text.as_str()) {
            let n = text.len() - self.text_len;
            self.text = text.to_string();
            n
        } else {
            self.text.push_str(text);
            text.len()
        };
        self.text_len = self.text.len();
        let ids = v.get("output_ids").and_then(Value::as_array).map(Vec::len);
        let completion = meta
            .and_then(|m| m.get("completion_tokens"))
            .and_then(Value::as_u64)
            .map(|c| c as usize);
        // Prefer completion_tokens (what sglang's bench uses), then the id list's growth.
        let total_so_far = match (completion, ids) {
            (Some(c), _) => c,
            (None, Some(n)) if n >= self.ids_len => n,
            (None, Some(n)) => self.ids_len + n, // incremental ids
            (None, None) => self.chunk_tokens + usize::from(new_text > 0),
        };
        if let Some(n) = ids {
            self.ids_len = if n >= self.ids_len {
                n
            } else {
                self.ids_len + n
            };
        }
        let new_tokens = total_so_far.saturating_sub(self.chunk_tokens);
        self.chunk_tokens = self.chunk_tokens.max(total_so_far);
        if completion.is_some() {
            self.completion_tokens = completion;
        }
        if new_tokens == 0 && new_text == 0 {
            Ok(StreamEvent::Nothing)
        } else {
            Ok(StreamEvent::Output {
                tokens: new_tokens,
                text_bytes: new_text,
            })
        }
    }

    fn openai(
        &mut self,
        v: &Value,
        content: impl Fn(&Value) -> Option<&Value>,
    ) -> Result<StreamEvent, String> {
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            if let Some(p) = u.get("prompt_tokens").and_then(Value::as_u64) {
                self.prompt_tokens = Some(p as usize);
            }
            if let Some(c) = u.get("completion_tokens").and_then(Value::as_u64) {
                self.completion_tokens = Some(c as usize);
            }
        }
        let choice = v
            .get("choices")
            .and_then(Value::as_array)
            .and_then(|c| c.first());
        let Some(choice) = choice else {
            return Ok(StreamEvent::Nothing);
        };
        if let Some(fr) = choice.get("finish_reason").and_then(Value::as_str) {
            self.finish_reason = Some(fr.to_string());
        }
        let text = content(choice).and_then(Value::as_str).unwrap_or("");
        if text.is_empty() {
            return Ok(StreamEvent::Nothing);
        }
        self.text.push_str(text);
        self.text_len = self.text.len();
        // One chunk is one token in the OpenAI streams of sglang and vllm (and vllm's bench
        // counts it so); the final usage replaces this count when present.
        self.chunk_tokens += 1;
        Ok(StreamEvent::Output {
            tokens: 1,
            text_bytes: text.len(),
        })
    }
}

pub fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed_all(chunks: &[&[u8]]) -> Vec<String> {
        let mut d = SseDecoder::default();
        let mut out = Vec::new();
        for c in chunks {
            out.extend(d.push(c));
        }
        out.extend(d.finish());
        out
    }

    #[test]
    fn frames_split_across_reads_and_joined_in_one_read() {
        let whole: &[u8] = b"data: {\"a\":1}\n\ndata: {\"a\":2}\n\ndata: [DONE]\n\n";
        let expected = vec!["{\"a\":1}", "{\"a\":2}", "[DONE]"];
        assert_eq!(feed_all(&[whole]), expected);
        // Every possible split point, including inside "data:" and between the two newlines.
        for cut in 0..whole.len() {
            assert_eq!(
                feed_all(&[&whole[..cut], &whole[cut..]]),
                expected,
                "cut {cut}"
            );
        }
        // One byte at a time.
        let bytes: Vec<&[u8]> = whole.chunks(1).collect();
        assert_eq!(feed_all(&bytes), expected);
    }

    #[test]
    fn crlf_comments_multiline_and_unterminated_last_event() {
        let got = feed_all(&[b": keep-alive\r\n\r\ndata: x\r\ndata: y\r\n\r\nevent: e\ndata:z"]);
        assert_eq!(got, vec!["x\ny", "z"]);
    }

    #[test]
    fn utf8_character_split_between_reads() {
        let s = "data: {\"text\":\"h\u{e9}\"}\n\n".as_bytes();
        let cut = s.iter().position(|&b| b == 0xC3).unwrap() + 1; // inside 'é'
        assert_eq!(
            feed_all(&[&s[..cut], &s[cut..]]),
            vec!["{\"text\":\"h\u{e9}\"}"]
        );
    }

    #[test]
    fn sglang_cumulative_frames_become_deltas() {
        let mut st = StreamState::new(WireFormat::Native);
        let frame = |text: &str, ids: &[u32], ct: usize, fin: &str| {
            serde_json::json!({
                "text": text, "output_ids": ids,
                "meta_info": {"prompt_tokens": 7, "completion_tokens": ct,
                              "finish_reason": if fin.is_empty() { Value::Null }
                                               else { serde_json::json!({"type": fin, "length": 3}) }}
            })
            .to_string()
        };
        assert_eq!(
            st.on_data(&frame("He", &[1], 1, "")).unwrap(),
            StreamEvent::Output {
                tokens: 1,
                text_bytes: 2
            }
        );
        // Two tokens in one frame (the server coalesced them).
        assert_eq!(
            st.on_data(&frame("Hello w", &[1, 2, 3], 3, "")).unwrap(),
            StreamEvent::Output {
                tokens: 2,
                text_bytes: 5
            }
        );
        // A repeated frame carries nothing new.
        assert_eq!(
            st.on_data(&frame("Hello w", &[1, 2, 3], 3, "length"))
                .unwrap(),
            StreamEvent::Nothing
        );
        assert_eq!(st.on_data("[DONE]").unwrap(), StreamEvent::Done);
        assert_eq!(st.text(), "Hello w");
        assert_eq!(st.output_tokens(), 3);
        assert_eq!(st.prompt_tokens, Some(7));
        assert_eq!(st.finish_reason.as_deref(), Some("length"));
    }

    #[test]
    fn sglang_without_completion_tokens_counts_ids() {
        let mut st = StreamState::new(WireFormat::Native);
        st.on_data(r#"{"text":"a","output_ids":[5]}"#).unwrap();
        let ev = st
            .on_data(r#"{"text":"abc","output_ids":[5,6,7]}"#)
            .unwrap();
        assert_eq!(
            ev,
            StreamEvent::Output {
                tokens: 2,
                text_bytes: 2
            }
        );
        assert_eq!(st.output_tokens(), 3);
    }

    #[test]
    fn errors_mid_stream_and_aborts_are_failures() {
        let mut st = StreamState::new(WireFormat::Native);
        assert_eq!(
            st.on_data(r#"{"error":{"message":"KV cache full"}}"#),
            Err("KV cache full".to_string())
        );
        let e = st
            .on_data(
                r#"{"text":"","meta_info":{"finish_reason":{"type":"abort","message":"bye"}}}"#,
            )
            .unwrap_err();
        assert!(e.contains("bye"), "{e}");
        assert!(st
            .on_data("{not json")
            .unwrap_err()
            .contains("bad stream frame"));
    }

    #[test]
    fn openai_completion_and_chat_chunks() {
        let mut st = StreamState::new(WireFormat::Completions);
        assert_eq!(
            st.on_data(r#"{"choices":[{"index":0,"text":"Hi","finish_reason":null}]}"#)
                .unwrap(),
            StreamEvent::Output {
                tokens: 1,
                text_bytes: 2
            }
        );
        st.on_data(r#"{"choices":[{"index":0,"text":" there","finish_reason":"length"}]}"#)
            .unwrap();
        assert_eq!(st.output_tokens(), 2);
        // The usage chunk (empty choices) replaces the chunk count with the server's count.
        assert_eq!(
            st.on_data(r#"{"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":3,"total_tokens":7}}"#)
                .unwrap(),
            StreamEvent::Nothing
        );
        assert_eq!((st.prompt_tokens, st.output_tokens()), (Some(4), 3));
        assert_eq!(st.text(), "Hi there");
        assert_eq!(st.finish_reason.as_deref(), Some("length"));

        let mut chat = StreamState::new(WireFormat::Chat);
        // The role header has no content: not the first token.
        assert_eq!(
            chat.on_data(r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#)
                .unwrap(),
            StreamEvent::Nothing
        );
        assert_eq!(
            chat.on_data(r#"{"choices":[{"index":0,"delta":{"content":"Yo"}}]}"#)
                .unwrap(),
            StreamEvent::Output {
                tokens: 1,
                text_bytes: 2
            }
        );
        assert_eq!(chat.output_tokens(), 1);
        assert_eq!(chat.prompt_tokens, None);
    }
}
