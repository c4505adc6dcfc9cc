//! Rotary position embeddings as a checkpoint describes them: the base, how many dimensions of a
//! head rotate, and the scaling that stretches a model past the context it was trained on.
//!
//! Everything reduces to one function of a position: the inverse frequencies its pairs of
//! dimensions rotate at, and a factor on the rotated part (`inv_freq_at`, `attention_factor`).
//! For `linear`, `llama3`, `yarn` and precomputed factors the frequencies do not depend on the position. For
//! `dynamic` and `longrope` Hugging Face recomputes them from the longest position of each
//! forward pass; llmq rotates each position as transformers does when it decodes that position
//! (`dynamic`: the base grown for `position + 1` tokens; `longrope`: the long factors from
//! the original context on), so a position's keys never depend on what follows them, which the
//! KV and prefix caches need. Within the original context every type equals transformers' exactly.

use serde_json::Value as Json;

/// How a model's rotary embedding is scaled.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear {
        factor: f32,
    },
    /// NTK-aware: past `original_max` tokens (the config's `max_position_embeddings`) the base
    /// grows with the length.
    Dynamic {
        factor: f32,
        original_max: usize,
    },
    /// Llama 3.1+: low frequencies divided by `factor`, high ones kept, a smooth ramp between.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max: usize,
    },
    /// YaRN: frequencies interpolated by a ramp over the dimensions, rotated part scaled.
    Yarn {
        factor: f32,
        original_max: usize,
        beta_fast: f32,
        beta_slow: f32,
        attention_factor: f32,
        truncate: bool,
    },
    /// Per-pair divisors of the inverse frequencies, precomputed (a GGUF's `rope_freqs.weight`:
    /// llama.cpp stores Llama 3's scaling so).
    Factors {
        factors: Vec<f32>,
    },
    /// Phi-3's long RoPE: per-pair factors, short within the original context, long past it.
    LongRope {
        short_factor: Vec<f32>,
        long_factor: Vec<f32>,
        original_max: usize,
        attention_factor: f32,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    pub theta: f32,
    /// Dimensions of a head that rotate (the first ones); the rest pass through.
    pub dims: usize,
    pub scaling: RopeScaling,
}

impl RopeConfig {
    pub fn plain(theta: f32, dims: usize) -> Self {
        RopeConfig {
            theta,
            dims,
            scaling: RopeScaling::None,
        }
    }

    /// The unscaled inverse frequencies, one per pair of rotated dimensions.
    fn base_inv_freq(&self, theta: f32) -> Vec<f64> {
        let d = self.dims as f64;
        (0..self.dims / 2)
            .map(|i| 1.0 / (theta as f64).powf(2.0 * i as f64 / d))
            .collect()
    }

    /// The inverse frequencies a token at `position` rotates at.
    pub fn inv_freq_at(&self, position: usize) -> Vec<f32> {
        let f = match &self.scaling {
            RopeScaling::None => self.base_inv_freq(self.theta),
            RopeScaling::Linear { factor } => self
                .base_inv_freq(self.theta)
                .iter()
                .map(|f| f / *factor as f64)
                .collect(),
            RopeScaling::Factors { factors } => self
                .base_inv_freq(self.theta)
                .iter()
                .zip(factors)
                .map(|(f, d)| f / *d as f64)
                .collect(),
            RopeScaling::Dynamic {
                factor,
                original_max,
            } => {
                let len = position + 1;
                if len <= *original_max {
                    self.base_inv_freq(self.theta)
                } else {
                    let (factor, d) = (*factor as f64, self.dims as f64);
                    let grown = self.theta as f64
                        * ((factor * len as f64 / *original_max as f64) - (factor - 1.0))
                            .powf(d / (d - 2.0));
                    self.base_inv_freq(grown as f32)
                }
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max,
            } => {
                let (factor, lo, hi, old) = (
                    *factor as f64,
                    *low_freq_factor as f64,
                    *high_freq_factor as f64,
                    *original_max as f64,
                );
                let (low_wavelen, high_wavelen) = (old / lo, old / hi);
                self.base_inv_freq(self.theta)
                    .into_iter()
                    .map(|f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen > low_wavelen {
                            f / factor
                        } else if wavelen < high_wavelen {
                            f
                        } else {
                            let smooth = (old / wavelen - lo) / (hi - lo);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
            RopeScaling::Yarn {
                factor,
                original_max,
                beta_fast,
                beta_slow,
                truncate,
                ..
            } => {
                let (factor, d, base) = (*factor as f64, self.dims as f64, self.theta as f64);
                let correction = |rotations: f64| {
                    d * (*original_max as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln()
                        / (2.0 * base.ln())
                };
                let (mut low, mut high) =
                    (correction(*beta_fast as f64), correction(*beta_slow as f64));
                if *truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
                if low == high {
                    high += 0.001;
                }
                self.base_inv_freq(self.theta)
                    .into_iter()
                    .enumerate()
                    .map(|(i, f)| {
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrapolate = 1.0 - ramp;
                        (f / factor) * (1.0 - extrapolate) + f * extrapolate
                    })
                    .collect()
            }
            RopeScaling::LongRope {
                short_factor,
                long_factor,
                original_max,
                ..
            } => {
                let ext = if position + 1 > *original_max {
                    long_factor
                } else {
                    short_factor
                };
                self.base_inv_freq(self.theta)
                    .iter()
                    .zip(ext)
                    .map(|(f, e)| f / *e as f64)
                    .collect()
            }
        };
        f.into_iter().map(|x| x as f32).collect()
    }

    /// The factor on the rotated dimensions (YaRN's and long RoPE's; 1 otherwise).
    pub fn attention_factor(&self) -> f32 {
        match &self.scaling {
            RopeScaling::Yarn {
                attention_factor, ..
            }
            | RopeScaling::LongRope {
                attention_factor, ..
            } => *attention_factor,
            _ => 1.0,
        }
    }

    /// The first position whose frequencies differ from those before it (`dynamic`,
    /// `longrope`), None when every position rotates at the same frequencies.
    pub fn switch_position(&self) -> Option<usize> {
        match &self.scaling {
            RopeScaling::Dynamic { original_max, .. }
            | RopeScaling::LongRope { original_max, .. } => Some(*original_max),
            _ => None,
        }
    }
}

/// Why a rope description was refused: the field and its value.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeError {
    pub field: String,
    pub value: String,
    pub reason: &'static str,
}

impl std::fmt::Display for RopeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} = {}: {}", self.field, self.value, self.reason)
    }
}

/// Reads a Hugging Face rope description: `rope_scaling` (transformers 4) or `rope_parameters`
/// (transformers 5) as `params`, beside the config's own `max_position_embeddings`, its
/// `original_max_position_embeddings` (Phi-3) and the rotated `dims`.
pub fn from_hf(
    params: Option<&Json>,
    field: &str,
    theta: f32,
    dims: usize,
    max_positions: usize,
    config_original_max: Option<usize>,
) -> Result<RopeConfig, RopeError> {
    let none = RopeConfig::plain(theta, dims);
    let Some(p) = params.filter(|p| !p.is_null()) else {
        return Ok(none);
    };
    let kind = p
        .get("rope_type")
        .or_else(|| p.get("type"))
        .and_then(Json::as_str)
        .unwrap_or("default");
    let num = |k: &str| p.get(k).and_then(Json::as_f64).map(|v| v as f32);
    let bad = |k: &str, reason: &'static str| RopeError {
        field: format!("{field}.{k}"),
        value: p.get(k).map_or("missing".into(), |v| v.to_string()),
        reason,
    };
    let factor = || -> Result<f32, RopeError> {
        match num("factor") {
            Some(f) if f >= 1.0 => Ok(f),
            Some(_) => Err(bad("factor", "must be at least 1")),
            None => Err(bad("factor", "is required for this rope type")),
        }
    };
    let original_max = || -> usize {
        p.get("original_max_position_embeddings")
            .and_then(Json::as_u64)
            .map(|v| v as usize)
            .or(config_original_max)
            .unwrap_or(max_positions)
    };
    let scaling = match kind {
        "default" | "none" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor: factor()? },
        // transformers grows the base past `max_position_embeddings` itself.
        "dynamic" => RopeScaling::Dynamic {
            factor: factor()?,
            original_max: max_positions,
        },
        "llama3" => {
            let low = num("low_freq_factor")
                .ok_or_else(|| bad("low_freq_factor", "is required for llama3"))?;
            let high = num("high_freq_factor")
                .ok_or_else(|| bad("high_freq_factor", "is required for llama3"))?;
            if high <= low {
                return Err(bad("high_freq_factor", "must exceed low_freq_factor"));
            }
            let original_max = p
                .get("original_max_position_embeddings")
                .and_then(Json::as_u64)
                .ok_or_else(|| bad("original_max_position_embeddings", "is required for llama3"))?
                as usize;
            RopeScaling::Llama3 {
                factor: factor()?,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max,
            }
        }
        "yarn" => {
            let original_max = original_max();
            let factor = match num("factor") {
                Some(_) => factor()?,
                None => max_positions as f32 / original_max as f32,
            };
            let mscale = |scale: f32, m: f32| {
                if scale <= 1.0 {
                    1.0
                } else {
                    0.1 * m * scale.ln() + 1.0
                }
            };
            let attention_factor = match (
                num("attention_factor"),
                num("mscale"),
                num("mscale_all_dim"),
            ) {
                (Some(a), _, _) => a,
                (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                    mscale(factor, m) / mscale(factor, all)
                }
                _ => mscale(factor, 1.0),
            };
            RopeScaling::Yarn {
                factor,
                original_max,
                beta_fast: num("beta_fast").unwrap_or(32.0),
                beta_slow: num("beta_slow").unwrap_or(1.0),
                attention_factor,
                truncate: p.get("truncate").and_then(Json::as_bool).unwrap_or(true),
            }
        }
        "longrope" | "su" => {
            let list = |k: &str| -> Result<Vec<f32>, RopeError> {
                let v: Vec<f32> = p
                    .get(k)
                    .and_then(Json::as_array)
                    .ok_or_else(|| bad(k, "is required for longrope"))?
                    .iter()
                    .filter_map(Json::as_f64)
                    .map(|x| x as f32)
                    .collect();
                if v.len() != dims / 2 {
                    return Err(bad(k, "needs one factor per pair of rotated dimensions"));
                }
                Ok(v)
            };
            let original_max = original_max();
            let factor = num("factor").unwrap_or(max_positions as f32 / original_max as f32);
            let attention_factor = num("attention_factor").unwrap_or(if factor <= 1.0 {
                1.0
            } else {
                (1.0 + factor.ln() / (original_max as f32).ln()).sqrt()
            });
            RopeScaling::LongRope {
                short_factor: list("short_factor")?,
                long_factor: list("long_factor")?,
                original_max,
                attention_factor,
            }
        }
        other => return Err(RopeError {
            field: format!("{field}.rope_type"),
            value: format!("\"{other}\""),
            reason:
                "unknown rope type (llmq knows default, linear, dynamic, llama3, yarn, longrope)",
        }),
    };
    Ok(RopeConfig { scaling, ..none })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn hf(p: Json) -> Result<RopeConfig, RopeError> {
        from_hf(Some(&p), "rope_scaling", 500000.0, 128, 131072, None)
    }

    #[test]
    fn llama3_keeps_high_frequencies_and_divides_low_ones() {
        let r = hf(json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})).unwrap();
        let plain = RopeConfig::plain(500000.0, 128).inv_freq_at(0);
        let scaled = r.inv_freq_at(0);
        assert_eq!(scaled[0], plain[0]);
        assert!((scaled[63] - plain[63] / 8.0).abs() < 1e-12);
        assert!(r.switch_position().is_none() && r.attention_factor() == 1.0);
    }

    #[test]
    fn unknown_types_and_bad_values_name_the_field() {
        let e = hf(json!({"rope_type": "mrope", "factor": 2.0})).unwrap_err();
        assert_eq!(
            (e.field.as_str(), e.value.as_str()),
            ("rope_scaling.rope_type", "\"mrope\"")
        );
        let e = hf(json!({"type": "linear", "factor": 0.5})).unwrap_err();
        assert_eq!(e.field, "rope_scaling.factor");
        let e = hf(json!({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}))
            .unwrap_err();
        assert_eq!(e.field, "rope_scaling.short_factor");
        assert_eq!(
            hf(json!({"rope_type": "default", "rope_theta": 10000.0}))
                .unwrap()
                .scaling,
            RopeScaling::None
        );
    }

    #[test]
    fn longrope_and_dynamic_switch_at_the_original_context() {
        let short = vec![1.0; 64];
        let long = vec![4.0; 64];
        let r = from_hf(
            Some(&json!({"type": "longrope", "short_factor": short, "long_factor": long})),
            "rope_scaling",
            10000.0,
            128,
            131072,
            Some(4096),
        )
        .unwrap();
        assert_eq!(r.switch_position(), Some(4096));
        assert_eq!(
            r.inv_freq_at(4095)[5],
            RopeConfig::plain(10000.0, 128).inv_freq_at(0)[5]
        );
        assert!((r.inv_freq_at(4096)[5] * 4.0 - r.inv_freq_at(4095)[5]).abs() < 1e-9);
        // sqrt(1 + ln(32) / ln(4096))
        assert!((r.attention_factor() - 1.190_239).abs() < 1e-5);
        let d = from_hf(
            Some(&json!({"type": "dynamic", "factor": 2.0})),
            "rope_scaling",
            10000.0,
            64,
            512,
            None,
        )
        .unwrap();
        assert_eq!(
            d.inv_freq_at(511),
            RopeConfig::plain(10000.0, 64).inv_freq_at(0)
        );
        assert!(d.inv_freq_at(600)[1] < d.inv_freq_at(511)[1]);
    }
}
