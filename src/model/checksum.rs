//! Checksums of served weights in checkpoint layout, so a trainer can verify what a server
//! holds (`GET /weights_checksum`, `/end_weight_update {checksum}`, `lockstep push`).
//!
//! Each tensor is hashed with xxh3_64 over its raw little-endian bytes exactly as a checkpoint
//! made by `lockstep convert` with the same recipe holds them (see [`CheckpointPart`]); the
//! overall hash is xxh3_64 of the text `"{name}:{hash:016x}\n"` for every tensor in name
//! order. Both are easy to recompute from a safetensors file in any language.

use std::collections::BTreeMap;

use rayon::prelude::*;
use xxhash_rust::xxh3::xxh3_64;

use crate::checkpoint::CheckpointPart;

pub const ALGORITHM: &str = "xxh3_64";

/// Per-tensor hashes by checkpoint name.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WeightsChecksum {
    pub tensors: BTreeMap<String, u64>,
}

impl WeightsChecksum {
    /// The hash over the sorted (name, hash) list.
    pub fn overall(&self) -> u64 {
        let mut text = String::with_capacity(self.tensors.len() * 64);
        for (name, h) in &self.tensors {
            text.push_str(name);
            text.push(':');
            text.push_str(&hex(*h));
            text.push('\n');
        }
        xxh3_64(text.as_bytes())
    }

    /// Records the parts of the layer/tensor `module` (`...q_proj` for `...q_proj.weight`).
    pub fn insert_parts(&mut self, module: &str, parts: &[CheckpointPart<'_>]) {
        for p in parts {
            self.tensors
                .insert(format!("{module}.{}", p.suffix), xxh3_64(&p.data));
        }
    }

    /// Hashes many modules' parts in parallel (xxh3 runs at memory speed; a large model
    /// still has gigabytes to read).
    pub fn of_parts<'a>(modules: Vec<(String, Vec<CheckpointPart<'a>>)>) -> WeightsChecksum {
        let tensors = modules
            .into_par_iter()
            .flat_map_iter(|(module, parts)| {
                parts
                    .into_iter()
                    .map(move |p| (format!("{module}.{}", p.suffix), xxh3_64(&p.data)))
            })
            .collect();
        WeightsChecksum { tensors }
    }

    /// `self` with the entries of `other` replacing or adding to its own.
    pub fn overlaid(&self, other: &WeightsChecksum) -> WeightsChecksum {
        let mut out = self.clone();
        out.tensors
            .extend(other.tensors.iter().map(|(k, v)| (k.clone(), *v)));
        out
    }

    /// The wire shape: `{algorithm, overall, tensors: {name: hex}}`.
    pub fn to_json(&self) -> serde_json::Value {
        let tensors: serde_json::Map<String, serde_json::Value> = self
            .tensors
            .iter()
            .map(|(k, v)| (k.clone(), serde_json::Value::String(hex(*v))))
            .collect();
        serde_json::json!({
            "algorithm": ALGORITHM,
            "overall": hex(self.overall()),
            "tensors": tensors,
        })
    }
}

/// 16 lowercase hex digits.
pub fn hex(h: u64) -> String {
    format!("{h:016x}")
}

/// Parses [`hex`]'s output (case-insensitive, an optional `0x`).
pub fn parse_hex(s: &str) -> Option<u64> {
    let s = s.strip_prefix("0x").unwrap_or(s);
    (!s.is_empty() && s.len() <= 16)
        .then(|| u64::from_str_radix(s, 16).ok())
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::Dtype;

    #[test]
    fn overall_follows_the_documented_text_and_order() {
        let mut c = WeightsChecksum::default();
        let b = [1u8, 2, 3];
        c.insert_parts(
            "m.z",
            &[CheckpointPart::bytes("weight", Dtype::U8, vec![3], &b)],
        );
        c.insert_parts(
            "m.a",
            &[CheckpointPart::bytes("weight", Dtype::U8, vec![2], &b[..2])],
        );
        let text = format!(
            "m.a.weight:{:016x}\nm.z.weight:{:016x}\n",
            xxh3_64(&b[..2]),
            xxh3_64(&b)
        );
        assert_eq!(c.overall(), xxh3_64(text.as_bytes()));
        assert_eq!(parse_hex(&hex(c.overall())), Some(c.overall()));
        assert_eq!(parse_hex("xyz"), None);
    }
}
