//! The workload: which prompts the bench sends, how long each answer should be, and how
//! requests group into arrivals (one request each, or an RL prompt's n samples together).

use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;

use super::rng::BenchRng;
use super::{BenchError, BenchTokenizer};

#[derive(Clone, Debug, PartialEq)]
pub struct BenchRequest {
    pub prompt: String,
    /// Prompt length in tokens as far as the bench can tell (exact with a tokenizer, else an
    /// estimate); the server's own count replaces it in the report when the server sends one.
    pub prompt_len: usize,
    pub output_len: usize,
    pub group: Option<usize>,
    pub sampling_seed: Option<u64>,
}

/// Requests that arrive together: one for random/sharegpt, n samples of a prompt for rl.
pub type Arrival = Vec<BenchRequest>;

/// Short, common English words: each is one token (with its leading space) in the BPE
/// vocabularies of Llama, Qwen and GPT tokenizers, so a prompt of L words is close to L
/// tokens when no tokenizer is given.
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "it", "you", "that", "he", "was", "for", "on", "are",
    "with", "as", "his", "they", "be", "at", "one", "have", "this", "from", "or", "had", "by",
    "word", "but", "what", "some", "we", "can", "out", "other", "were", "all", "there", "when",
    "up", "use", "your", "how", "said", "an", "each", "she", "which", "do", "their", "time", "if",
    "will", "way", "about", "many", "then", "them", "would", "write", "like", "so", "these", "her",
    "long", "make", "thing", "see", "him", "two", "has", "look", "more", "day", "could", "go",
    "come", "did", "number", "sound", "no", "most", "people", "my", "over", "know", "water",
    "than", "call", "first", "who", "may", "down", "side", "been", "now", "find", "any", "new",
    "work", "part", "take", "get", "place", "made", "live", "where", "after", "back", "little",
    "only", "round", "man", "year", "came", "show", "every", "good", "me", "give", "our", "under",
    "name", "very", "through", "just", "form", "great", "think", "say", "help", "low", "line",
    "before", "turn", "cause", "same", "mean", "differ", "move", "right", "boy", "old", "too",
    "does", "tell", "set", "three", "want", "air", "well", "also", "play", "small", "end", "put",
    "home", "read", "hand", "port", "large", "spell", "add", "even", "land", "here", "must", "big",
    "high", "such", "follow", "act", "why", "ask", "men", "change", "went", "light", "kind", "off",
    "need", "house", "picture", "try", "us", "again", "animal", "point", "mother", "world", "near",
    "build", "self", "earth", "father", "head", "stand", "own", "page", "should", "country",
    "found", "answer", "school", "grow", "study", "still", "learn", "plant", "cover", "food",
    "sun", "four", "thought", "let", "keep", "eye", "never", "last", "door", "between", "city",
    "tree", "cross", "since", "hard", "start", "might", "story", "saw", "far", "sea", "draw",
    "left", "late", "run",
];

/// Words per token for the ShareGPT answer-length estimate without a tokenizer (the usual
/// rule of thumb for English with BPE vocabularies: 1 word is about 1.3 tokens).
pub const TOKENS_PER_WORD: f64 = 1.3;

/// Token length of `text`: exact with a tokenizer, else words * 1.3.
pub fn token_len(text: &str, tok: Option<&Arc<dyn BenchTokenizer>>) -> usize {
    match tok {
        Some(t) => t.encode(text).len(),
        None => (text.split_whitespace().count() as f64 * TOKENS_PER_WORD).round() as usize,
    }
}

/// sglang's `--random-range-ratio`: a length uniform in [max(1, L * r), L].
fn sample_len(rng: &mut BenchRng, len: usize, range_ratio: f64) -> usize {
    let lo = ((len as f64 * range_ratio) as usize).max(1);
    rng.range_inclusive(lo.min(len.max(1)), len.max(1))
}

/// A prompt of `len` tokens: random token ids decoded, as sglang does, when a tokenizer is
/// given; else `len` random words.
pub fn random_prompt(
    rng: &mut BenchRng,
    len: usize,
    tok: Option<&Arc<dyn BenchTokenizer>>,
) -> (String, usize) {
    match tok {
        Some(t) => {
            let vocab = t.vocab_size().max(1);
            let ids: Vec<u32> = (0..len)
                .map(|_| (rng.next_u64() % vocab as u64) as u32)
                .collect();
            let text = t.decode(&ids);
            let n = t.encode(&text).len();
            (text, n)
        }
        None => {
            let words: Vec<&str> = (0..len)
                .map(|_| WORDS[rng.range_inclusive(0, WORDS.len() - 1)])
                .collect();
            (words.join(" "), len)
        }
    }
}

pub struct RandomSpec {
    pub num_prompts: usize,
    pub input_len: usize,
    pub output_len: usize,
    pub range_ratio: f64,
}

pub fn random(
    spec: &RandomSpec,
    rng: &mut BenchRng,
    tok: Option<&Arc<dyn BenchTokenizer>>,
) -> Vec<Arrival> {
    (0..spec.num_prompts)
        .map(|_| {
            let in_len = sample_len(rng, spec.input_len, spec.range_ratio);
            let out_len = sample_len(rng, spec.output_len, spec.range_ratio);
            let (prompt, prompt_len) = random_prompt(rng, in_len, tok);
            vec![BenchRequest {
                prompt,
                prompt_len,
                output_len: out_len,
                group: None,
                sampling_seed: None,
            }]
        })
        .collect()
}

/// GRPO's pattern: P prompts, each sent n times with sampling seeds 0..n, all n arriving
/// together (a trainer submits a prompt's group at once).
pub fn rl(
    spec: &RandomSpec,
    group_size: usize,
    rng: &mut BenchRng,
    tok: Option<&Arc<dyn BenchTokenizer>>,
) -> Vec<Arrival> {
    random(spec, rng, tok)
        .into_iter()
        .enumerate()
        .map(|(g, mut one)| {
            let base = one.remove(0);
            (0..group_size as u64)
                .map(|seed| BenchRequest {
                    group: Some(g),
                    sampling_seed: Some(seed),
                    ..base.clone()
                })
                .collect()
        })
        .collect()
}

#[derive(Deserialize)]
struct ShareGptEntry {
    #[serde(default)]
    conversations: Vec<Turn>,
}

#[derive(Deserialize)]
struct Turn {
    from: String,
    value: String,
}

/// sglang's ShareGPT filter: drop pairs whose prompt or answer is under 4 tokens (too short
/// to measure anything), or whose prompt exceeds 1024 / prompt + answer 2048 tokens
/// (would not fit the context of the models these numbers are usually quoted for).
const MIN_LEN: usize = 4;
const MAX_PROMPT_LEN: usize = 1024;
const MAX_TOTAL_LEN: usize = 2048;

/// Reads a ShareGPT JSON file: the first human turn of each conversation is the prompt, the
/// gpt turn after it sets the output length. Conversations are taken in a seeded shuffled
/// order (as sglang samples them) until `num_prompts` pass the filter. `--output-len`, when
/// given, overrides the answer's length as sglang's `--sharegpt-output-len` does.
pub fn sharegpt(
    path: &Path,
    num_prompts: usize,
    fixed_output_len: Option<usize>,
    rng: &mut BenchRng,
    tok: Option<&Arc<dyn BenchTokenizer>>,
) -> Result<Vec<Arrival>, BenchError> {
    let text = std::fs::read_to_string(path).map_err(|source| BenchError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let entries: Vec<ShareGptEntry> = serde_json::from_str(&text)
        .map_err(|e| BenchError::Dataset(format!("{}: {e}", path.display())))?;
    let mut pairs: Vec<(String, String)> = entries
        .into_iter()
        .filter_map(|e| {
            let first_human = e
                .conversations
                .iter()
                .position(|t| t.from == "human" || t.from == "user")?;
            let answer = e.conversations.get(first_human + 1)?;
            (answer.from == "gpt" || answer.from == "assistant").then(|| {
                (
                    e.conversations[first_human].value.clone(),
                    answer.value.clone(),
                )
            })
        })
        .collect();
    // Fisher-Yates with the bench's seeded generator.
    for i in (1..pairs.len()).rev() {
        pairs.swap(i, rng.range_inclusive(0, i));
    }
    let mut out = Vec::with_capacity(num_prompts);
    for (prompt, answer) in pairs {
        if out.len() == num_prompts {
            break;
        }
        let prompt_len = token_len(&prompt, tok);
        let output_len = fixed_output_len.unwrap_or_else(|| token_len(&answer, tok));
        let too_short = prompt_len < MIN_LEN || output_len < MIN_LEN;
        let too_long = prompt_len > MAX_PROMPT_LEN || prompt_len + output_len > MAX_TOTAL_LEN;
        if too_short || too_long {
            continue;
        }
        out.push(vec![BenchRequest {
            prompt,
            prompt_len,
            output_len,
            group: None,
            sampling_seed: None,
        }]);
    }
    if out.is_empty() {
        return Err(BenchError::Dataset(format!(
            "{}: no conversation passed the length filter",
            path.display()
        )));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_prompts_have_the_asked_lengths_and_repeat_per_seed() {
        let spec = RandomSpec {
            num_prompts: 50,
            input_len: 32,
            output_len: 16,
            range_ratio: 0.5,
        };
        let a = random(&spec, &mut BenchRng::new(1), None);
        let b = random(&spec, &mut BenchRng::new(1), None);
        assert_eq!(a, b);
        assert_eq!(a.len(), 50);
        for r in a.iter().map(|w| &w[0]) {
            assert!((16..=32).contains(&r.prompt_len), "{}", r.prompt_len);
            assert!((8..=16).contains(&r.output_len));
            assert_eq!(r.prompt.split(' ').count(), r.prompt_len);
        }
        let fixed = RandomSpec {
            range_ratio: 1.0,
            ..spec
        };
        assert!(random(&fixed, &mut BenchRng::new(2), None)
            .iter()
            .all(|w| w[0].prompt_len == 32 && w[0].output_len == 16));
    }

    #[test]
    fn rl_groups_share_a_prompt_and_differ_by_seed() {
        let spec = RandomSpec {
            num_prompts: 3,
            input_len: 8,
            output_len: 4,
            range_ratio: 1.0,
        };
        let arrivals = rl(&spec, 4, &mut BenchRng::new(9), None);
        assert_eq!(arrivals.len(), 3);
        for (g, group) in arrivals.iter().enumerate() {
            assert_eq!(group.len(), 4);
            assert!(group
                .iter()
                .all(|r| r.prompt == group[0].prompt && r.group == Some(g)));
            let seeds: Vec<u64> = group.iter().map(|r| r.sampling_seed.unwrap()).collect();
            assert_eq!(seeds, vec![0, 1, 2, 3]);
        }
        assert_ne!(arrivals[0][0].prompt, arrivals[1][0].prompt);
    }

    #[test]
    fn sharegpt_first_human_turn_and_filter() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sg.json");
        let long = "w ".repeat(2000);
        let json = serde_json::json!([
            {"conversations": [{"from": "system", "value": "be nice"},
                               {"from": "human", "value": "tell me about the sea and sky please"},
                               {"from": "gpt", "value": "the sea is big and blue and deep ok"},
                               {"from": "human", "value": "ignored second turn"}]},
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there how are you"}]},
            {"conversations": [{"from": "human", "value": long}, {"from": "gpt", "value": "fine fine fine fine"}]},
            {"conversations": [{"from": "human", "value": "only a question with no answer"}]},
            {"id": "no conversations"}
        ]);
        std::fs::write(&path, json.to_string()).unwrap();
        let got = sharegpt(&path, 10, None, &mut BenchRng::new(1), None).unwrap();
        // Only the first survives: "hi" is under 4 tokens, the long one over 1024.
        assert_eq!(got.len(), 1);
        let r = &got[0][0];
        assert_eq!(r.prompt, "tell me about the sea and sky please");
        assert_eq!(r.prompt_len, 10); // 8 words * 1.3 = 10.4
        assert_eq!(r.output_len, 12); // 9 words * 1.3 = 11.7
        let fixed = sharegpt(&path, 10, Some(64), &mut BenchRng::new(1), None).unwrap();
        assert_eq!(fixed[0][0].output_len, 64);
        assert!(matches!(
            sharegpt(
                &dir.path().join("missing.json"),
                1,
                None,
                &mut BenchRng::new(1),
                None
            ),
            Err(BenchError::Io { .. })
        ));
    }
}
