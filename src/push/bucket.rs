//! Splitting a weight update into buckets (one `PUT /update_weights` each) of bounded size,
//! keeping every part of a layer and both halves of a gate/up pair in the same bucket: the
//! server quantizes an NVFP4 pair with one shared scale, and a client quantizing for it needs
//! both halves at hand.

use crate::model::layout::gate_up_pair;
use crate::quant::slot;

/// The layer a checkpoint tensor name belongs to, with a gate/up pair folded onto its gate:
/// `...experts.3.up_proj.weight_scale` -> `...experts.3.gate_proj`.
pub fn group_key(name: &str) -> String {
    let module = slot::split(name).map_or(name, |(m, _)| m);
    gate_up_pair(module).map_or_else(|| module.to_string(), |(gate, _)| gate)
}

/// Indices into `sizes` (tensor `i` has `names[i]`, `sizes[i]` bytes), grouped into buckets of
/// at most `max_bytes` each, in name order. A group larger than `max_bytes` gets a bucket of
/// its own (it cannot be split).
pub fn buckets(names: &[&str], sizes: &[usize], max_bytes: usize) -> Vec<Vec<usize>> {
    let mut groups: std::collections::BTreeMap<String, Vec<usize>> = Default::default();
    for (i, n) in names.iter().enumerate() {
        groups.entry(group_key(n)).or_default().push(i);
    }
    let mut out: Vec<Vec<usize>> = Vec::new();
    let mut current: Vec<usize> = Vec::new();
    let mut current_bytes = 0;
    for (_, members) in groups {
        let bytes: usize = members.iter().map(|&i| sizes[i]).sum();
        if !current.is_empty() && current_bytes + bytes > max_bytes {
            out.push(std::mem::take(&mut current));
            current_bytes = 0;
        }
        current.extend(members);
        current_bytes += bytes;
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_and_parts_stay_together_and_buckets_stay_bounded() {
        let names = [
            "model.layers.0.mlp.experts.0.gate_proj.weight",
            "model.layers.0.mlp.experts.0.gate_proj.weight_scale",
            "model.layers.0.mlp.experts.0.up_proj.weight",
            "model.layers.0.mlp.experts.0.up_proj.weight_scale",
            "model.layers.0.mlp.experts.1.down_proj.weight",
            "model.layers.0.mlp.experts.1.gate_proj.weight",
            "model.layers.0.mlp.experts.1.up_proj.weight",
            "model.norm.weight",
        ];
        let sizes = [40, 5, 40, 5, 60, 30, 30, 10];
        let b = buckets(&names, &sizes, 100);
        let of = |i: usize| b.iter().position(|bk| bk.contains(&i)).unwrap();
        assert_eq!(of(0), of(2), "gate and up of expert 0 together");
        assert_eq!(of(0), of(1));
        assert_eq!(of(2), of(3), "a weight travels with its scales");
        assert_eq!(of(5), of(6), "gate and up of expert 1 together");
        let mut all: Vec<usize> = b.concat();
        all.sort();
        assert_eq!(
            all,
            (0..names.len()).collect::<Vec<_>>(),
            "every tensor once"
        );
        for bk in &b {
            let bytes: usize = bk.iter().map(|&i| sizes[i]).sum();
            assert!(bytes <= 100 || bk.len() == 1, "{bk:?} is {bytes} bytes");
        }
        // A group larger than the bound is a bucket of its own, not split.
        let big = buckets(&names[..4], &[400, 5, 400, 5], 100);
        assert_eq!(big, vec![vec![0, 1, 2, 3]]);
    }
}
