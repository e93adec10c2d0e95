//! Element codecs of the contract: E4M3 (fp8 e4m3fn, satfinite), E2M1 (fp4) and E8M0 scales.
//!
//! Every encoder here is exact IEEE binary32 arithmetic or bit manipulation, so the same
//! input gives the same byte on every machine, thread count and backend.

/// Largest finite E4M3 magnitude.
pub const E4M3_MAX: f32 = 448.0;
/// Canonical NaN byte written by [`e4m3_encode`] (the contract allows 0x7F/0xFF; we emit one).
pub const E4M3_NAN: u8 = 0x7F;
/// E8M0 code for NaN.
pub const E8M0_NAN: u8 = 0xFF;

/// Encodes an f32 as E4M3 with round-to-nearest-even and saturation to ±448 (±Inf included).
///
/// Written without branches (every case computed, then selected) so block loops vectorize.
#[inline]
pub fn e4m3_encode(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = (bits >> 24) & 0x80;
    let mag = bits & 0x7FFF_FFFF;
    // Normal range: keep 3 mantissa bits, round-to-nearest-even on the dropped 20 bits; a carry
    // out of the mantissa correctly bumps the exponent. Rebias 127 -> 7.
    let rounded = (mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20;
    let normal = rounded.wrapping_sub((127 - 7) << 3);
    // Below 2^-6 the grid is uniform with step 2^-9: round |x| * 2^9 (exact scaling) to an
    // integer; 8 lands on the smallest normal (code 0x08).
    // Adding and subtracting 1.5 * 2^23 rounds to an integer with IEEE round-to-nearest-even
    // (exact for |v| < 2^22; here v < 8), without a libm call on CPUs lacking SSE4.1.
    const MAGIC: f32 = 12_582_912.0;
    let v = f32::from_bits(mag.min(0x3C80_0000)) * 512.0;
    let subnormal = ((v + MAGIC) - MAGIC) as u32;
    let code = if mag < 0x3C80_0000 { subnormal } else { normal };
    // |x| >= 448 saturates (values in (448, 464) would round to 448 anyway).
    let code = if mag >= 0x43E0_0000 { 0x7E } else { code };
    let byte = (sign | code) as u8;
    if mag > 0x7F80_0000 {
        E4M3_NAN
    } else {
        byte
    }
}

/// Decodes an E4M3 byte to f32 (exact). 0x7F/0xFF decode to NaN.
#[inline]
pub fn e4m3_decode(code: u8) -> f32 {
    E4M3_TABLE[code as usize]
}

const fn e4m3_decode_const(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0f32 } else { 1.0f32 };
    let exp = ((code >> 3) & 0xF) as i32;
    let mant = (code & 7) as i32;
    if exp == 15 && mant == 7 {
        return f32::NAN;
    }
    // Built from exact powers of two and small integers, so const evaluation is exact.
    let mag = if exp == 0 {
        mant as f32 * (1.0 / 512.0)
    } else {
        let mut p = 1.0f32;
        let mut e = exp - 7;
        while e > 0 {
            p *= 2.0;
            e -= 1;
        }
        while e < 0 {
            p *= 0.5;
            e += 1;
        }
        (8 + mant) as f32 / 8.0 * p
    };
    sign * mag
}

const E4M3_TABLE: [f32; 256] = {
    let mut t = [0.0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = e4m3_decode_const(i as u8);
        i += 1;
    }
    t
};

/// Magnitudes of the eight E2M1 codes.
pub const E2M1_VALUES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// Encodes an f32 as an E2M1 nibble: round-to-nearest with ties to the even code, saturating
/// to ±6, NaN -> +6, sign kept (so a negative value rounding to zero is 0x8).
#[inline]
pub fn e2m1_encode(x: f32) -> u8 {
    let sign = ((x.to_bits() >> 28) & 0x8) as u8;
    let a = x.abs();
    // Count the midpoints below |x|; `>` where the tie goes to the lower (even) code, `>=`
    // where it goes to the upper one. Branch-free so block loops vectorize.
    let code = (a > 0.25) as u8
        + (a >= 0.75) as u8
        + (a > 1.25) as u8
        + (a >= 1.75) as u8
        + (a > 2.5) as u8
        + (a >= 3.5) as u8
        + (a > 5.0) as u8;
    if x.is_nan() {
        0x7
    } else {
        sign | code
    }
}

/// Decodes an E2M1 nibble (low 4 bits of `code`).
#[inline]
pub fn e2m1_decode(code: u8) -> f32 {
    let mag = E2M1_VALUES[(code & 7) as usize];
    if code & 0x8 != 0 {
        -mag
    } else {
        mag
    }
}

/// The E8M0 code of the smallest power of two >= `v` (the MXFP8 scale rule, step 3).
#[inline]
pub fn e8m0_round_up(v: f32) -> u8 {
    if v.is_nan() {
        return E8M0_NAN;
    }
    if v == f32::INFINITY {
        return 0xFE;
    }
    if v == 0.0 {
        return 0x00;
    }
    let bits = v.to_bits();
    let mut e = bits >> 23;
    let m = bits & 0x7F_FFFF;
    if m > 0 && e != 0xFE && !(e == 0 && m <= 0x40_0000) {
        e += 1;
    }
    e as u8
}

/// Decodes an E8M0 code to 2^(code-127); 0xFF is NaN. Code 0 (2^-127) is an f32 subnormal.
#[inline]
pub fn e8m0_decode(code: u8) -> f32 {
    match code {
        E8M0_NAN => f32::NAN,
        0 => f32::from_bits(0x0040_0000),
        c => f32::from_bits((c as u32) << 23),
    }
}

/// The exact multiplier 2^(127-code) that maps a block into E4M3 range (MXFP8 step 4).
#[inline]
pub fn e8m0_inverse(code: u8) -> f32 {
    match code {
        E8M0_NAN => f32::NAN,
        0xFE => f32::from_bits(0x0040_0000),
        c => f32::from_bits((254 - c as u32) << 23),
    }
}

/// `min(a, b)` with IEEE minNum semantics (a NaN operand loses), as the contract's `min`.
#[inline]
pub(crate) fn min_num(a: f32, b: f32) -> f32 {
    a.min(b)
}

/// Max |x| ignoring NaN; NaN only when every element is NaN (or the slice is empty of numbers).
#[inline]
pub fn amax(xs: &[f32]) -> f32 {
    amax_of(xs.iter().copied())
}

/// [`amax`] over any sequence of values (e.g. BF16 widened on the fly).
#[inline]
pub fn amax_of(xs: impl Iterator<Item = f32>) -> f32 {
    // |x| bit patterns order like the values; NaN patterns are mapped to 0 so they never win.
    let mut max_bits = 0u32;
    let mut numbers = 0u32;
    let mut any = false;
    for x in xs {
        any = true;
        let b = x.to_bits() & 0x7FFF_FFFF;
        let is_number = b <= 0x7F80_0000;
        numbers += is_number as u32;
        max_bits = max_bits.max(if is_number { b } else { 0 });
    }
    if numbers == 0 && any {
        f32::NAN
    } else {
        f32::from_bits(max_bits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_round_trips_every_finite_code() {
        for code in 0u8..=255 {
            let v = e4m3_decode(code);
            if v.is_nan() {
                assert!(code & 0x7F == 0x7F);
                continue;
            }
            assert_eq!(e4m3_encode(v), code, "code {code:#x} value {v}");
        }
    }

    #[test]
    fn e4m3_saturates_and_rounds_to_even() {
        assert_eq!(e4m3_encode(f32::INFINITY), 0x7E);
        assert_eq!(e4m3_encode(f32::NEG_INFINITY), 0xFE);
        assert_eq!(e4m3_encode(1e9), 0x7E);
        assert_eq!(e4m3_encode(f32::NAN), E4M3_NAN);
        // 2^-10 is the midpoint between 0 and the smallest subnormal 2^-9: ties to even (0).
        assert_eq!(e4m3_encode(2f32.powi(-10)), 0x00);
        assert_eq!(e4m3_encode(-2f32.powi(-10)), 0x80);
        // 1.0625 sits between 1.0 (0x38) and 1.125 (0x39): ties to even.
        assert_eq!(e4m3_encode(1.0625), 0x38);
        assert_eq!(e4m3_encode(1.1875), 0x3A);
    }

    #[test]
    fn e2m1_ties_go_to_even_codes() {
        let cases = [
            (0.25, 0.0),
            (0.75, 1.0),
            (1.25, 1.0),
            (1.75, 2.0),
            (2.5, 2.0),
            (3.5, 4.0),
            (5.0, 4.0),
            (7.0, 6.0),
        ];
        for (x, want) in cases {
            assert_eq!(e2m1_decode(e2m1_encode(x)), want, "{x}");
            assert_eq!(e2m1_decode(e2m1_encode(-x)), -want, "-{x}");
        }
        assert_eq!(e2m1_encode(-0.1), 0x8);
        assert_eq!(e2m1_encode(f32::NAN), 0x7);
    }

    #[test]
    fn e8m0_rounds_up_to_powers_of_two() {
        assert_eq!(e8m0_round_up(1.0), 127);
        assert_eq!(e8m0_round_up(1.5), 128);
        assert_eq!(e8m0_round_up(0.0), 0);
        assert_eq!(e8m0_round_up(f32::INFINITY), 0xFE);
        for code in 1u8..0xFE {
            assert_eq!(e8m0_round_up(e8m0_decode(code)), code);
            assert_eq!(e8m0_decode(code) * e8m0_inverse(code), 1.0);
        }
    }
}
