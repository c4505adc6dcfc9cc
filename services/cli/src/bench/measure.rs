//! What every scenario measures with: the peer's prompts and the statistics of the figures.

/// The peer's prompt: token ids drawn from [10, 4000), fixed seed.
pub(crate) fn random_prompt(n: usize, seed: u64) -> Vec<u32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            10 + ((x >> 33) % 3990) as u32
        })
        .collect()
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub(crate) fn round(x: f64, digits: i32) -> f64 {
    let p = 10f64.powi(digits);
    (x * p).round() / p
}

/// Prints a scenario's figures: one JSON line, or pretty-printed.
pub(crate) fn print(v: &serde_json::Value, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{v}");
    } else {
        println!("{}", serde_json::to_string_pretty(v)?);
    }
    Ok(())
}
