//! DeepSeek-style block FP8 (an input format only): E4M3 weights with one f32
//! `weight_scale_inv` per 128x128 block. `convert` and `nvfp4_online` dequantize it first.

use rayon::prelude::*;

use super::codec::e4m3_decode;
use super::{check_len, QuantError};

/// The block edge used by DeepSeek-V3 / Qwen3 FP8 checkpoints.
pub const FP8_BLOCK: usize = 128;

/// `w[i, j] = e4m3(q[i, j]) * scale_inv[i / bn, j / bk]` with `block = (bn, bk)`.
pub fn dequantize(
    weight: &[u8],
    scale_inv: &[f32],
    rows: usize,
    cols: usize,
    block: (usize, usize),
) -> Result<Vec<f32>, QuantError> {
    check_len(weight.len(), rows, cols)?;
    let (bn, bk) = block;
    if bn == 0 || bk == 0 {
        return Err(QuantError::Invalid(
            "weight_block_size must be positive".into(),
        ));
    }
    let scale_cols = cols.div_ceil(bk);
    let want = rows.div_ceil(bn) * scale_cols;
    if scale_inv.len() != want {
        return Err(QuantError::Invalid(format!(
            "weight_scale_inv has {} elements, expected {} ([{}, {}]) for a [{rows}, {cols}] weight",
            scale_inv.len(),
            want,
            rows.div_ceil(bn),
            scale_cols
        )));
    }
    let mut out = vec![0f32; rows * cols];
    if cols == 0 {
        return Ok(out);
    }
    out.par_chunks_mut(cols).enumerate().for_each(|(i, row)| {
        let scales = &scale_inv[(i / bn) * scale_cols..][..scale_cols];
        for (j, o) in row.iter_mut().enumerate() {
            *o = e4m3_decode(weight[i * cols + j]) * scales[j / bk];
        }
    });
    Ok(out)
}
