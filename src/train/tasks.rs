//! Built-in verifiable tasks over the embedded byte tokenizer (token id = byte), with exact
//! rewards: the fraction of answer positions (the answer's bytes, then end-of-text) that the
//! completion gets right.

use crate::tokenizer::ByteTokenizer;

/// `--task`.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum TaskKind {
    /// `c:ab=` -> `ab`: one or two letters from `abcd` (the easiest).
    Copy,
    /// `s:dbc=` -> `bcd`: three letters from `abcdef`, sorted.
    Sort,
    /// `12+7=` -> `19`: two numbers below 50.
    Add,
}

/// One problem: the prompt's tokens and the exact answer (bytes, then end-of-text).
#[derive(Clone, Debug, PartialEq)]
pub struct Problem {
    pub prompt: Vec<u32>,
    pub answer: Vec<u32>,
}

/// SplitMix64: problems depend only on (seed, index).
fn mix(seed: u64, i: u64) -> u64 {
    let mut z = seed.wrapping_add(i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn letters(r: u64, n: usize, alphabet: &[u8]) -> Vec<u8> {
    (0..n)
        .map(|i| alphabet[((r >> (8 * i)) % alphabet.len() as u64) as usize])
        .collect()
}

fn tokens(text: &[u8]) -> Vec<u32> {
    text.iter().map(|&b| b as u32).collect()
}

impl TaskKind {
    /// Problem `index` of the stream `seed`.
    pub fn problem(self, seed: u64, index: u64) -> Problem {
        let r = mix(seed, index);
        let (prompt, answer) = match self {
            TaskKind::Copy => {
                let s = letters(r >> 1, 1 + (r & 1) as usize, b"abcd");
                ([b"c:".as_slice(), &s, b"="].concat(), s)
            }
            TaskKind::Sort => {
                let s = letters(r, 3, b"abcdef");
                let mut sorted = s.clone();
                sorted.sort_unstable();
                ([b"s:".as_slice(), &s, b"="].concat(), sorted)
            }
            TaskKind::Add => {
                let (a, b) = (r % 50, (r >> 16) % 50);
                (
                    format!("{a}+{b}=").into_bytes(),
                    (a + b).to_string().into_bytes(),
                )
            }
        };
        let mut answer = tokens(&answer);
        answer.push(ByteTokenizer::ENDOFTEXT);
        Problem {
            prompt: tokens(&prompt),
            answer,
        }
    }
}

impl Problem {
    /// Exact reward in [0, 1]: answer positions the completion matches, over the answer length.
    pub fn reward(&self, completion: &[u32]) -> f32 {
        let right = self
            .answer
            .iter()
            .zip(completion)
            .filter(|(a, c)| a == c)
            .count();
        right as f32 / self.answer.len() as f32
    }

    /// Tokens a completion needs: the answer and its end-of-text.
    pub fn max_new_tokens(&self) -> usize {
        self.answer.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(t: &[u32]) -> String {
        t.iter()
            .filter(|&&x| x < 256)
            .map(|&x| x as u8 as char)
            .collect()
    }

    /// Answers are checked by recomputing the task from the prompt text.
    #[test]
    fn answers_solve_their_prompts_and_rewards_are_exact() {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64;
        for i in 0..200 {
            let p = TaskKind::Add.problem(seed, i);
            let prompt = text(&p.prompt);
            let (a, b) = prompt.trim_end_matches('=').split_once('+').unwrap();
            let sum: u64 = a.parse::<u64>().unwrap() + b.parse::<u64>().unwrap();
            assert_eq!(text(&p.answer), sum.to_string());
            let s = TaskKind::Sort.problem(seed, i);
            let mut letters: Vec<char> = text(&s.prompt)[2..5].chars().collect();
            letters.sort();
            assert_eq!(text(&s.answer), letters.into_iter().collect::<String>());
            let c = TaskKind::Copy.problem(seed, i);
            let body = text(&c.prompt);
            assert_eq!(text(&c.answer), body[2..body.len() - 1]);
            assert_eq!(*c.answer.last().unwrap(), ByteTokenizer::ENDOFTEXT);
            assert_eq!(c.reward(&c.answer), 1.0);
            assert_eq!(c.reward(&[]), 0.0);
            let mut wrong = c.answer.clone();
            wrong[0] = b'z' as u32;
            let n = c.answer.len();
            assert_eq!(c.reward(&wrong), (n - 1) as f32 / n as f32);
        }
    }
}
