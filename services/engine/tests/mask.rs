//! The greedy token under a token mask (`MaskLayout::argmax`: llmq's kernel on a GPU, a scan of
//! the mask's words on the host elsewhere) against a scan on the host: random logits in bf16 and f32,
//! masks from dense to a single allowed token, ties, vocabularies not a multiple of 32. Runs on
//! whichever device MLX defaults to (on an NVIDIA GPU, `cargo test -p llmq-engine --test mask`
//! checks the kernel).

use llmq_engine::mask::MaskLayout;
use mlx_rs::{random, Array, Dtype};

fn host(a: &Array) -> Vec<f32> {
    a.as_dtype(Dtype::Float32)
        .unwrap()
        .to_vec_exact::<f32>()
        .unwrap()
}

/// A small deterministic generator for the masks.
fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

#[test]
fn masked_argmax_picks_the_best_allowed_token_of_each_row() {
    for (vocab, rows) in [(70usize, 3i32), (49_152, 8), (128_256, 64)] {
        let layout = MaskLayout::new(vocab);
        let words = layout.words();
        for dtype in [Dtype::Bfloat16, Dtype::Float32] {
            let key = random::key(vocab as u64).unwrap();
            let logits = random::normal::<f32>(&[rows, 1, vocab as i32], 0.0, 1.0, &key)
                .unwrap()
                .as_dtype(dtype)
                .unwrap();
            let values = host(&logits);
            let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ vocab as u64;
            let mut masks = vec![0u32; rows as usize * words];
            for r in 0..rows as usize {
                let row = &mut masks[r * words..(r + 1) * words];
                match r % 4 {
                    // Everything allowed (an unconstrained row), then denser to sparser masks.
                    0 => row.fill(u32::MAX),
                    1 => row.iter_mut().for_each(|w| *w = next(&mut state) as u32),
                    2 => row.iter_mut().for_each(|w| {
                        *w = (next(&mut state) & next(&mut state) & next(&mut state)) as u32
                    }),
                    _ => {
                        let t = next(&mut state) as usize % vocab;
                        row[t / 32] = 1 << (t % 32);
                    }
                }
                if vocab % 32 != 0 {
                    // Bits past the vocabulary are never read.
                    row[words - 1] |= !0u32 << (vocab % 32);
                }
            }
            let got: Vec<i32> = layout
                .argmax(&logits, &masks)
                .unwrap()
                .to_vec_exact::<i32>()
                .unwrap();
            for r in 0..rows as usize {
                let allowed = |t: usize| masks[r * words + t / 32] >> (t % 32) & 1 == 1;
                let row = &values[r * vocab..(r + 1) * vocab];
                let want =
                    (0..vocab)
                        .filter(|&t| allowed(t))
                        .fold(None, |best: Option<usize>, t| match best {
                            Some(b) if row[b] >= row[t] => Some(b),
                            _ => Some(t),
                        });
                assert_eq!(
                    Some(got[r] as usize),
                    want,
                    "vocab {vocab}, {dtype:?}, row {r}"
                );
            }
        }
    }
    // Equal logits: the lowest allowed index, as an argmax.
    let layout = MaskLayout::new(100);
    let logits = Array::from_slice(&[1.0f32; 200], &[2, 1, 100]);
    let masks = [0, 1 << 7, 1 << 1, 0, 0, 0, 0, 1 << 3];
    let got: Vec<i32> = layout
        .argmax(&logits, &masks)
        .unwrap()
        .to_vec_exact::<i32>()
        .unwrap();
    assert_eq!(got, vec![39, 99]);
}
