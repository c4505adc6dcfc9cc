//! GGML's quantized block formats, decoded to f32: the legacy 32-wide blocks (Q4_0, Q4_1, Q5_0,
//! Q5_1, Q8_0) and the 256-wide K-quant super-blocks (Q2_K..Q6_K) that Q4_K_M and Q5_K_M files
//! mix. Layouts are ggml's (`ggml-common.h`): little-endian f16 scales, nibbles low-first.
//! Each decoder is checked bit for bit against PyPI's `gguf.quants.dequantize` on random
//! blocks (tests/fixtures/gguf-quants-reference.safetensors).

use half::f16;

/// Elements of a K-quant super-block.
const QK_K: usize = 256;

fn h(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

pub fn q8_0(blk: &[u8], out: &mut Vec<f32>) {
    let d = h(blk, 0);
    out.extend(blk[2..34].iter().map(|&q| q as i8 as f32 * d));
}

pub fn q4_0(blk: &[u8], out: &mut Vec<f32>) {
    let d = h(blk, 0);
    let q = &blk[2..18];
    // Low nibbles hold elements 0..16, high nibbles 16..32.
    out.extend(q.iter().map(|&b| ((b & 0x0f) as i32 - 8) as f32 * d));
    out.extend(q.iter().map(|&b| ((b >> 4) as i32 - 8) as f32 * d));
}

pub fn q4_1(blk: &[u8], out: &mut Vec<f32>) {
    let (d, m) = (h(blk, 0), h(blk, 2));
    let q = &blk[4..20];
    out.extend(q.iter().map(|&b| (b & 0x0f) as f32 * d + m));
    out.extend(q.iter().map(|&b| (b >> 4) as f32 * d + m));
}

/// The fifth bits of a Q5 block's 32 elements: bit j of the little-endian u32 for element j.
fn fifth_bits(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

pub fn q5_0(blk: &[u8], out: &mut Vec<f32>) {
    let d = h(blk, 0);
    let hi = fifth_bits(&blk[2..6]);
    let q = &blk[6..22];
    let val = |j: usize, nib: u8| (((nib as u32) | (((hi >> j) & 1) << 4)) as i32 - 16) as f32 * d;
    out.extend(q.iter().enumerate().map(|(j, &b)| val(j, b & 0x0f)));
    out.extend(q.iter().enumerate().map(|(j, &b)| val(j + 16, b >> 4)));
}

pub fn q5_1(blk: &[u8], out: &mut Vec<f32>) {
    let (d, m) = (h(blk, 0), h(blk, 2));
    let hi = fifth_bits(&blk[4..8]);
    let q = &blk[8..24];
    let val = |j: usize, nib: u8| ((nib as u32) | (((hi >> j) & 1) << 4)) as f32 * d + m;
    out.extend(q.iter().enumerate().map(|(j, &b)| val(j, b & 0x0f)));
    out.extend(q.iter().enumerate().map(|(j, &b)| val(j + 16, b >> 4)));
}

/// Q4_K's and Q5_K's 6-bit scale and min of sub-block `j` (of 8), packed in 12 bytes.
pub(crate) fn scale_min_k4(j: usize, s: &[u8]) -> (f32, f32) {
    if j < 4 {
        ((s[j] & 63) as f32, (s[j + 4] & 63) as f32)
    } else {
        let sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        let m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
        (sc as f32, m as f32)
    }
}

/// The scale and min of Q4_K's and Q5_K's two sub-blocks that share the bytes of `pair`: the
/// low nibbles are sub-block 2 * pair, the high ones 2 * pair + 1.
fn sub_block_pair(pair: usize, scales: &[u8], d: f32, dmin: f32) -> [(f32, f32); 2] {
    [2 * pair, 2 * pair + 1].map(|j| {
        let (sc, m) = scale_min_k4(j, scales);
        (d * sc, dmin * m)
    })
}

/// Q4_K: d, dmin (f16), 12 bytes of scales and mins, 128 bytes of nibbles; 8 sub-blocks of 32.
pub fn q4_k(blk: &[u8], out: &mut Vec<f32>) {
    let (d, dmin) = (h(blk, 0), h(blk, 2));
    let scales = &blk[4..16];
    let qs = &blk[16..144];
    for (pair, q) in qs.chunks_exact(32).enumerate() {
        let [(d1, m1), (d2, m2)] = sub_block_pair(pair, scales, d, dmin);
        out.extend(q.iter().map(|&b| d1 * (b & 0x0f) as f32 - m1));
        out.extend(q.iter().map(|&b| d2 * (b >> 4) as f32 - m2));
    }
}

/// Q5_K: Q4_K's layout with 32 bytes of fifth bits after the scales.
pub fn q5_k(blk: &[u8], out: &mut Vec<f32>) {
    let (d, dmin) = (h(blk, 0), h(blk, 2));
    let scales = &blk[4..16];
    let qh = &blk[16..48];
    let qs = &blk[48..176];
    for (pair, q) in qs.chunks_exact(32).enumerate() {
        let [(d1, m1), (d2, m2)] = sub_block_pair(pair, scales, d, dmin);
        let (u1, u2) = (1u8 << (2 * pair), 2u8 << (2 * pair));
        out.extend(
            q.iter()
                .zip(qh)
                .map(|(&b, &hb)| d1 * ((b & 0x0f) + if hb & u1 != 0 { 16 } else { 0 }) as f32 - m1),
        );
        out.extend(
            q.iter()
                .zip(qh)
                .map(|(&b, &hb)| d2 * ((b >> 4) + if hb & u2 != 0 { 16 } else { 0 }) as f32 - m2),
        );
    }
}

/// Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 signed 8-bit scales, d (f16);
/// 16 sub-blocks of 16.
pub fn q6_k(blk: &[u8], out: &mut Vec<f32>) {
    let d = h(blk, 208);
    let start = out.len();
    out.resize(start + QK_K, 0.0);
    let y = &mut out[start..];
    for half in 0..2 {
        let ql = &blk[64 * half..64 * half + 64];
        let qh = &blk[128 + 32 * half..128 + 32 * half + 32];
        let sc = &blk[192 + 8 * half..192 + 8 * half + 8];
        let y = &mut y[128 * half..128 * half + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            y[l] = d * (sc[is] as i8 as f32) * q1 as f32;
            y[l + 32] = d * (sc[is + 2] as i8 as f32) * q2 as f32;
            y[l + 64] = d * (sc[is + 4] as i8 as f32) * q3 as f32;
            y[l + 96] = d * (sc[is + 6] as i8 as f32) * q4 as f32;
        }
    }
}

/// Q2_K: 16 bytes of 4-bit scale|min pairs, 64 bytes of 2-bit values, d, dmin (f16);
/// 16 sub-blocks of 16.
pub fn q2_k(blk: &[u8], out: &mut Vec<f32>) {
    let scales = &blk[0..16];
    let qs = &blk[16..80];
    let (d, dmin) = (h(blk, 80), h(blk, 82));
    let mut is = 0;
    for q in qs.chunks_exact(32) {
        for shift in [0, 2, 4, 6] {
            for part in [&q[..16], &q[16..]] {
                let sc = scales[is];
                is += 1;
                let (dl, ml) = (d * (sc & 0x0f) as f32, dmin * (sc >> 4) as f32);
                out.extend(part.iter().map(|&b| dl * ((b >> shift) & 3) as f32 - ml));
            }
        }
    }
}

/// Q3_K: 32 bytes of high bits (set: +0, clear: -4), 64 bytes of 2-bit values, 12 bytes of
/// 6-bit scales (offset 32), d (f16); 16 sub-blocks of 16.
pub fn q3_k(blk: &[u8], out: &mut Vec<f32>) {
    let hmask = &blk[0..32];
    let qs = &blk[32..96];
    let packed = &blk[96..108];
    let d = h(blk, 108);
    // The 16 scales: low 4 bits from bytes 0..8 (low then high nibbles), high 2 bits from 8..12.
    let scale = |i: usize| -> i32 {
        let low = if i < 8 {
            packed[i] & 0x0f
        } else {
            packed[i - 8] >> 4
        };
        let high = (packed[8 + i % 4] >> (2 * (i / 4))) & 3;
        (low | (high << 4)) as i32 - 32
    };
    let mut is = 0;
    let mut m = 1u8;
    for q in qs.chunks_exact(32) {
        for shift in [0, 2, 4, 6] {
            for (part, hm) in [(&q[..16], &hmask[..16]), (&q[16..], &hmask[16..])] {
                let dl = d * scale(is) as f32;
                is += 1;
                out.extend(part.iter().zip(hm).map(|(&b, &hb)| {
                    dl * (((b >> shift) & 3) as i32 - if hb & m != 0 { 0 } else { 4 }) as f32
                }));
            }
            m <<= 1;
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use crate::gguf::TensorType;

    /// tests/fixtures/gguf-quants-reference.safetensors: a tensor's raw little-endian bytes.
    pub(crate) fn reference() -> std::collections::HashMap<String, Vec<u8>> {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/gguf-quants-reference.safetensors"
        );
        let bytes = std::fs::read(path).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        let data = &bytes[8 + n..];
        header
            .as_object()
            .unwrap()
            .iter()
            .filter(|(k, _)| *k != "__metadata__")
            .map(|(k, v)| {
                let off = &v["data_offsets"];
                let (a, b) = (
                    off[0].as_u64().unwrap() as usize,
                    off[1].as_u64().unwrap() as usize,
                );
                (k.clone(), data[a..b].to_vec())
            })
            .collect()
    }

    /// Every block type decodes random blocks to exactly what PyPI's gguf package does.
    #[test]
    fn blocks_decode_as_the_gguf_package_does_bit_for_bit() {
        let r = reference();
        let types = [
            ("Q4_0", TensorType::Q4_0),
            ("Q4_1", TensorType::Q4_1),
            ("Q5_0", TensorType::Q5_0),
            ("Q5_1", TensorType::Q5_1),
            ("Q8_0", TensorType::Q8_0),
            ("Q2_K", TensorType::Q2K),
            ("Q3_K", TensorType::Q3K),
            ("Q4_K", TensorType::Q4K),
            ("Q5_K", TensorType::Q5K),
            ("Q6_K", TensorType::Q6K),
        ];
        for (name, kind) in types {
            let blocks = &r[&format!("{name}.blocks")];
            let want: Vec<u32> = r[&format!("{name}.values")]
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            let mut got = vec![];
            kind.decode(blocks, &mut got);
            let got: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
            assert_eq!(got.len(), want.len(), "{name}");
            let first = got.iter().zip(&want).position(|(a, b)| a != b);
            assert_eq!(
                first,
                None,
                "{name}: element {first:?} differs: {:?} vs {:?}",
                first.map(|i| f32::from_bits(got[i])),
                first.map(|i| f32::from_bits(want[i]))
            );
        }
    }
}
