//! GGML blocks read as affine groups of 32: each element is `scale * q + bias` with an unsigned
//! integer `q` and one scale and bias per 32 elements, which is what MLX's quantized matmul
//! computes (its "affine" mode). Q4_0, Q4_1, Q8_0, Q5_0, Q5_1 and the 32-wide sub-blocks of Q4_K
//! and Q5_K are exactly that, so the engine keeps them quantized without changing a value:
//! in f32, `scale * q + bias` equals `quants`' decoded value exactly (a test checks it on the
//! gguf package's reference blocks; only a zero's sign can differ, `d * 8 - 8 * d` being +0
//! where `(8 - 8) * d` is -0 for a negative `d`). The types with 16-wide groups (Q2_K, Q3_K, Q6_K) are
//! not affine groups of 32 and have no form here.

use half::f16;

use crate::gguf::TensorType;

/// Elements sharing one scale and bias.
pub const GROUP: usize = 32;

/// A tensor's elements as unsigned integers of `bits` bits with one (scale, bias) per group of
/// [`GROUP`] consecutive elements (row-major, so a group never spans two rows of a tensor whose
/// row length is a multiple of 32, as every GGML block type's is).
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Affine {
    pub bits: u8,
    pub values: Vec<u8>,
    pub scales: Vec<f32>,
    pub biases: Vec<f32>,
}

impl Affine {
    /// Element `i` as MLX computes it from the groups.
    pub fn value(&self, i: usize) -> f32 {
        self.scales[i / GROUP] * self.values[i] as f32 + self.biases[i / GROUP]
    }

    fn group(&mut self, scale: f32, bias: f32, values: impl IntoIterator<Item = u8>) {
        self.scales.push(scale);
        self.biases.push(bias);
        self.values.extend(values);
    }
}

fn h(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The integer width an exactly affine type has (None: not affine in groups of 32).
pub fn bits(kind: TensorType) -> Option<u8> {
    match kind {
        TensorType::Q4_0 | TensorType::Q4_1 | TensorType::Q4K => Some(4),
        TensorType::Q5_0 | TensorType::Q5_1 | TensorType::Q5K => Some(5),
        TensorType::Q8_0 => Some(8),
        _ => None,
    }
}

/// Whole blocks of `kind` as affine groups; None for a type that is not affine in groups of 32.
pub fn read(kind: TensorType, bytes: &[u8]) -> Option<Affine> {
    let bits = bits(kind)?;
    let (_, block_bytes) = kind.block();
    let mut a = Affine {
        bits,
        ..Default::default()
    };
    for blk in bytes.chunks_exact(block_bytes as usize) {
        match kind {
            TensorType::Q8_0 => {
                // d * q with q signed: (q + 128) unsigned, the offset in the bias.
                let d = h(blk, 0);
                a.group(
                    d,
                    -128.0 * d,
                    blk[2..34].iter().map(|&q| (q as i8 as i16 + 128) as u8),
                );
            }
            TensorType::Q4_0 => {
                let d = h(blk, 0);
                a.group(d, -8.0 * d, nibbles(&blk[2..18]));
            }
            TensorType::Q4_1 => a.group(h(blk, 0), h(blk, 2), nibbles(&blk[4..20])),
            TensorType::Q5_0 => {
                let d = h(blk, 0);
                a.group(d, -16.0 * d, fives(&blk[6..22], &blk[2..6]));
            }
            TensorType::Q5_1 => a.group(h(blk, 0), h(blk, 2), fives(&blk[8..24], &blk[4..8])),
            TensorType::Q4K | TensorType::Q5K => k_quant(&mut a, kind == TensorType::Q5K, blk),
            _ => unreachable!("bits() admits only affine types"),
        }
    }
    Some(a)
}

/// A legacy block's 32 nibbles: low nibbles are elements 0..16, high nibbles 16..32.
fn nibbles(q: &[u8]) -> impl Iterator<Item = u8> + '_ {
    q.iter().map(|&b| b & 0x0f).chain(q.iter().map(|&b| b >> 4))
}

/// Q5_0's and Q5_1's 32 values: nibbles as in `nibbles`, bit j of the little-endian u32 `hi`
/// as element j's fifth bit.
fn fives<'a>(q: &'a [u8], hi: &[u8]) -> impl Iterator<Item = u8> + 'a {
    let hi = u32::from_le_bytes([hi[0], hi[1], hi[2], hi[3]]);
    nibbles(q)
        .enumerate()
        .map(move |(j, n)| n | ((((hi >> j) & 1) as u8) << 4))
}

/// Q4_K and Q5_K: 8 sub-blocks of 32, each `d * sc * q - dmin * m`.
fn k_quant(a: &mut Affine, five: bool, blk: &[u8]) {
    let (d, dmin) = (h(blk, 0), h(blk, 2));
    let scales = &blk[4..16];
    let (qh, qs) = if five {
        (&blk[16..48], &blk[48..176])
    } else {
        (&blk[0..0], &blk[16..144])
    };
    for (pair, q) in qs.chunks_exact(32).enumerate() {
        for (half, shift) in [(0, 0), (1, 4)] {
            let (sc, m) = crate::quants::scale_min_k4(2 * pair + half, scales);
            let high_bit = 1u8 << (2 * pair + half);
            let value = |(j, &b): (usize, &u8)| {
                let low = (b >> shift) & 0x0f;
                if five && qh[j] & high_bit != 0 {
                    low + 16
                } else {
                    low
                }
            };
            a.group(d * sc, -(dmin * m), q.iter().enumerate().map(value));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quants::tests::reference;

    /// Every exactly affine type's groups give the gguf package's values exactly (as numbers:
    /// -0 and +0 are equal).
    #[test]
    fn affine_groups_give_the_gguf_packages_values_exactly() {
        let r = reference();
        let types = [
            ("Q4_0", TensorType::Q4_0),
            ("Q4_1", TensorType::Q4_1),
            ("Q5_0", TensorType::Q5_0),
            ("Q5_1", TensorType::Q5_1),
            ("Q8_0", TensorType::Q8_0),
            ("Q4_K", TensorType::Q4K),
            ("Q5_K", TensorType::Q5K),
        ];
        for (name, kind) in types {
            let a = read(kind, &r[&format!("{name}.blocks")]).unwrap();
            let want: Vec<u32> = r[&format!("{name}.values")]
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            assert_eq!(a.values.len(), want.len(), "{name}");
            assert_eq!(a.scales.len() * GROUP, want.len(), "{name}");
            assert!(
                a.values.iter().all(|&q| (q as u32) < 1u32 << a.bits),
                "{name}: a value wider than {} bits",
                a.bits
            );
            let first = (0..want.len()).find(|&i| a.value(i) != f32::from_bits(want[i]));
            assert_eq!(
                first,
                None,
                "{name}: element {first:?}: {:?} vs {:?}",
                first.map(|i| a.value(i)),
                first.map(|i| f32::from_bits(want[i]))
            );
        }
    }

    #[test]
    fn types_with_16_wide_groups_have_no_affine_form() {
        for kind in [
            TensorType::Q2K,
            TensorType::Q3K,
            TensorType::Q6K,
            TensorType::F16,
        ] {
            assert!(read(kind, &[]).is_none(), "{kind:?}");
        }
    }
}
