//! Row-wise CPU ops of the forward pass: RMSNorm, RoPE, SwiGLU, softmax and top-k routing.
//! Every op works on one row at a time, so rows never influence each other.

use rayon::prelude::*;

/// `out = x / rms(x) * w` per row of width `w.len()` (f32, sequential sum of squares).
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    out.par_chunks_mut(d)
        .zip(x.par_chunks(d))
        .for_each(|(o, row)| rms_norm_row(row, w, eps, o));
}

#[inline]
pub fn rms_norm_row(row: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let mut ss = 0f32;
    for v in row {
        ss += v * v;
    }
    let inv = 1.0 / (ss / row.len() as f32 + eps).sqrt();
    for ((o, v), g) in out.iter_mut().zip(row).zip(w) {
        *o = v * inv * g;
    }
}

/// Per-head RMSNorm in place (Qwen3's q_norm / k_norm): `x` is `[rows, heads * head_dim]`.
pub fn head_rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let d = w.len();
    x.par_chunks_mut(d).for_each(|head| {
        let copy: Vec<f32> = head.to_vec();
        rms_norm_row(&copy, w, eps, head);
    });
}

/// `x += y` element-wise (residual add).
pub fn add_inplace(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `out[r, i] = silu(gate[r, i]) * up[r, i]`.
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
        *o = silu(*g) * u;
    }
}

/// Rotary embedding (rotate-half layout, as HF Llama/Qwen) in place on `[heads * head_dim]`.
pub fn apply_rope(x: &mut [f32], head_dim: usize, pos: usize, inv_freq: &[f32]) {
    let half = head_dim / 2;
    for head in x.chunks_mut(head_dim) {
        for i in 0..half {
            // HF computes the angle in f32 as pos * inv_freq; match it.
            let angle = pos as f32 * inv_freq[i];
            let (sin, cos) = angle.sin_cos();
            let (a, b) = (head[i], head[i + half]);
            head[i] = a * cos - b * sin;
            head[i + half] = b * cos + a * sin;
        }
    }
}

/// Softmax in place over one row (max-subtracted, sequential sum).
pub fn softmax_inplace(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for v in row.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in row.iter_mut() {
        *v /= sum;
    }
}

/// Top-k of a row: indices by descending value, ties to the lower index (as torch.topk on CPU
/// is not guaranteed to be, so we fix it).
pub fn top_k(row: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}
