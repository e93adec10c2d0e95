//! The "128x4" scale layout that block-scaled tensor-core GEMMs read. Checkpoints keep the
//! plain row-major layout; kernels get this one.

/// Length of the swizzled buffer for a `[rows, cols]` scale matrix (rows padded to 128,
/// cols to 4).
pub fn swizzled_len(rows: usize, cols: usize) -> usize {
    rows.div_ceil(128) * 128 * cols.div_ceil(4) * 4
}

/// Offset of scale (i, j) in the swizzled buffer.
#[inline]
pub fn swizzled_offset(i: usize, j: usize, cols: usize) -> usize {
    ((i / 128) * cols.div_ceil(4) + j / 4) * 512 + (i % 32) * 16 + ((i % 128) / 32) * 4 + (j % 4)
}

/// Plain `[rows, cols]` scales -> 128x4 layout, padding zero.
pub fn swizzle_128x4(scales: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    assert_eq!(scales.len(), rows * cols, "scale matrix length");
    let mut out = vec![0u8; swizzled_len(rows, cols)];
    for i in 0..rows {
        for j in 0..cols {
            out[swizzled_offset(i, j, cols)] = scales[i * cols + j];
        }
    }
    out
}

/// Inverse of [`swizzle_128x4`]: drops the padding.
pub fn unswizzle_128x4(swizzled: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    assert_eq!(swizzled.len(), swizzled_len(rows, cols), "swizzled length");
    let mut out = vec![0u8; rows * cols];
    for i in 0..rows {
        for j in 0..cols {
            out[i * cols + j] = swizzled[swizzled_offset(i, j, cols)];
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn swizzle_is_a_bijection_on_the_unpadded_part() {
        for (rows, cols) in [(1, 1), (128, 4), (200, 7), (257, 13)] {
            let plain: Vec<u8> = (0..rows * cols).map(|k| (k % 251 + 1) as u8).collect();
            let swz = swizzle_128x4(&plain, rows, cols);
            assert_eq!(unswizzle_128x4(&swz, rows, cols), plain);
            let nonzero = swz.iter().filter(|&&b| b != 0).count();
            assert_eq!(
                nonzero,
                rows * cols,
                "padding must be zero and no slot reused"
            );
        }
    }
}
