//! Weight loading: Hugging Face safetensors directories (single or sharded, full precision or
//! quantized as mlx-lm writes them) and GGUF files, into one map keyed by Hugging Face tensor
//! names, in the compute dtype.
//!
//! Invariants: GGUF tensors are renamed to Hugging Face names and Llama Q/K rows are put back
//! in Hugging Face's rotary order (llama.cpp interleaves them); Gemma's norms keep llama.cpp's
//! 1 + w (`norms_include_one`); `take` checks shapes, so an architecture never runs on a
//! tensor of the wrong size.
//!
//! What a projection's weight becomes is decided here, once ([`LoadOptions`]): quantized weights
//! stay quantized where `keep_quantized` says (else they are dequantized), and full-precision
//! ones are quantized when `quantize` asks. Every decision is counted in `summary`.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use mlx_rs::{Array, Dtype};

use llmq_text::config::{Arch, ModelConfig};
use llmq_text::gguf::{GgufFile, TensorType};

use crate::error::Result;
use crate::quant::{Matrix, QTensor, QuantSpec};

/// How weights are loaded: the compute dtype and what happens to quantized weights.
#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    pub dtype: Dtype,
    /// Quantize full-precision projection and embedding weights at load.
    pub quantize: Option<QuantSpec>,
    /// Keep quantized weights quantized on the device. Default: on a GPU, where reading 4-bit
    /// weights is what makes decode fast; on a CPU dense f32 is faster, so they are dequantized.
    pub keep_quantized: bool,
}

impl LoadOptions {
    pub fn new(dtype: Dtype) -> Self {
        LoadOptions {
            dtype,
            quantize: None,
            keep_quantized: crate::device::on_gpu(),
        }
    }

    /// Quantizes at load (`--quantize`); what is asked for is kept, on any device.
    pub fn quantized(mut self, spec: Option<QuantSpec>) -> Self {
        self.quantize = spec;
        if spec.is_some() {
            self.keep_quantized = true;
        }
        self
    }

    pub fn keep_quantized(mut self, keep: bool) -> Self {
        self.keep_quantized = keep;
        self
    }

    /// From settings as the CLI and the worker take them: a dtype name (default: the device's),
    /// bits to quantize to at load with their group size, and whether to keep quantized weights
    /// quantized (default: the device's choice, or yes when quantizing at load).
    pub fn from_settings(
        dtype: Option<&str>,
        quantize: Option<i32>,
        group_size: i32,
        keep_quantized: Option<bool>,
    ) -> Result<Self> {
        let dtype = dtype
            .map(crate::parse_dtype)
            .transpose()?
            .unwrap_or_else(crate::default_dtype);
        let spec = quantize
            .map(|bits| QuantSpec::new(bits, group_size))
            .transpose()?;
        let opts = LoadOptions::new(dtype).quantized(spec);
        Ok(match keep_quantized {
            Some(k) => opts.keep_quantized(k),
            None => opts,
        })
    }
}

impl From<Dtype> for LoadOptions {
    fn from(dtype: Dtype) -> Self {
        LoadOptions::new(dtype)
    }
}

pub struct Weights {
    source: PathBuf,
    map: HashMap<String, Matrix>,
    opts: LoadOptions,
    /// Gemma's norm weights already hold `1 + w` (llama.cpp stores them so).
    norms_include_one: bool,
    /// Where each weight came from and what it became, counted: e.g. "Q4_K -> 4-bit, groups of
    /// 32 (exact)".
    summary: BTreeMap<String, usize>,
    /// Where each quantized entry came from, for `summary` when it is taken.
    origin: HashMap<String, String>,
}

impl Weights {
    pub fn new(source: impl Into<PathBuf>, opts: impl Into<LoadOptions>) -> Self {
        let opts = opts.into();
        Weights {
            source: source.into(),
            map: HashMap::new(),
            opts,
            norms_include_one: false,
            summary: BTreeMap::new(),
            origin: HashMap::new(),
        }
    }

    pub fn norms_include_one(&self) -> bool {
        self.norms_include_one
    }

    /// Says the norms' weights are stored with their 1 already added (as mlx-lm's conversions
    /// of Qwen3.5 store them).
    pub fn set_norms_include_one(&mut self, yes: bool) {
        self.norms_include_one = yes;
    }

    /// A tensor's shape, without taking it.
    pub fn shape_of(&self, name: &str) -> Option<Vec<usize>> {
        self.map.get(name).map(Matrix::shape)
    }

    /// Removes and returns a depthwise convolution's filters as taps [kernel, channels] (row j
    /// weighs the position `kernel - 1 - j` back), from Hugging Face's layout [channels, 1,
    /// kernel], mlx-lm's [channels, kernel, 1] or GGUF's [channels, kernel].
    pub fn take_conv_taps(&mut self, name: &str, channels: usize, kernel: usize) -> Result<Array> {
        let shape = match self.shape_of(name) {
            Some(s) if kernel > 1 && (s == [channels, kernel, 1] || s == [channels, kernel]) => s,
            _ => vec![channels, 1, kernel],
        };
        let filters = self.take(name, &shape)?;
        Ok(filters
            .reshape(&[channels as i32, kernel as i32])?
            .t()
            .contiguous()?)
    }

    pub fn dtype(&self) -> Dtype {
        self.opts.dtype
    }

    /// A full-precision tensor, in the compute dtype.
    pub fn insert(&mut self, name: impl Into<String>, a: Array) -> Result<()> {
        let a = if a.dtype() == self.opts.dtype {
            a
        } else {
            a.as_dtype(self.opts.dtype)?
        };
        self.map.insert(name.into(), Matrix::Dense(a));
        Ok(())
    }

    /// A quantized tensor, its scales and biases in the compute dtype; `origin` names its
    /// source form for the summary.
    pub fn insert_quantized(
        &mut self,
        name: impl Into<String>,
        mut q: QTensor,
        origin: impl Into<String>,
    ) -> Result<()> {
        let dtype = self.opts.dtype;
        if q.scales.dtype() != dtype {
            q.scales = q.scales.as_dtype(dtype)?;
            q.biases = q.biases.as_dtype(dtype)?;
        }
        let name = name.into();
        self.origin.insert(name.clone(), origin.into());
        self.map.insert(name, Matrix::Quantized(q));
        Ok(())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.map.contains_key(name)
    }

    fn remove(&mut self, name: &str, shape: &[usize]) -> Result<Matrix> {
        let m = self
            .map
            .remove(name)
            .ok_or_else(|| llmq_text::Error::MissingTensor {
                path: self.source.clone(),
                tensor: name.into(),
            })?;
        let actual = m.shape();
        if actual != shape {
            let i64s = |v: &[usize]| v.iter().map(|&d| d as i64).collect();
            return Err(llmq_text::Error::TensorShape {
                path: self.source.clone(),
                tensor: name.into(),
                actual: i64s(&actual),
                expected: i64s(shape),
            }
            .into());
        }
        Ok(m)
    }

    /// Removes and returns a tensor in full precision, checking its shape.
    pub fn take(&mut self, name: &str, shape: &[usize]) -> Result<Array> {
        let origin = self.origin.remove(name);
        let m = self.remove(name, shape)?;
        if let Some(o) = origin {
            self.count(self.dequantized(&o));
        }
        m.into_dense()
    }

    /// The compute dtype's name, as the summary gives it ("float32", "bfloat16").
    fn dense_name(&self) -> String {
        format!("{:?}", self.opts.dtype).to_lowercase()
    }

    fn dequantized(&self, from: &str) -> String {
        format!("{from} -> {} (dequantized)", self.dense_name())
    }

    /// Removes and returns a projection's or an embedding's weight [out, in] as the load options
    /// say: quantized weights kept or dequantized, full-precision ones quantized or kept.
    pub fn take_matrix(&mut self, name: &str, shape: &[usize]) -> Result<Matrix> {
        let origin = self.origin.remove(name);
        let m = self.remove(name, shape)?;
        // A quantized entry always has an origin (`insert_quantized`); a dense one has one when
        // GGUF blocks were dequantized on reading.
        let from = origin.unwrap_or_else(|| self.dense_name());
        let (m, what) = match m {
            Matrix::Quantized(q) if self.opts.keep_quantized => {
                let spec = q.spec;
                (Matrix::Quantized(q), format!("{from} -> {spec}"))
            }
            Matrix::Quantized(q) => (Matrix::Dense(q.dequantize()?), self.dequantized(&from)),
            Matrix::Dense(a) => {
                match self.opts.quantize {
                    Some(spec)
                        if shape[shape.len() - 1].is_multiple_of(spec.group_size as usize) =>
                    {
                        let q = QTensor::quantize(&a, spec)?;
                        // Now, so that the full-precision tensor is freed before the next one.
                        mlx_rs::transforms::eval(q.parameters())?;
                        (
                            Matrix::Quantized(q),
                            format!("{from} -> {spec} (quantized at load)"),
                        )
                    }
                    _ if from != self.dense_name() => (Matrix::Dense(a), self.dequantized(&from)),
                    _ => (Matrix::Dense(a), from),
                }
            }
        };
        self.count(what);
        Ok(m)
    }

    fn count(&mut self, what: String) {
        *self.summary.entry(what).or_default() += 1;
    }

    /// What the weights taken so far became, one line per kind with its count of tensors.
    pub fn summary(&self) -> String {
        self.summary
            .iter()
            .map(|(k, n)| format!("{n} x {k}"))
            .collect::<Vec<_>>()
            .join("; ")
    }

    pub fn source(&self) -> &Path {
        &self.source
    }
}

/// Loads `model.safetensors` or the shards listed in `model.safetensors.index.json`. Weights
/// quantized by mlx-lm (`X.weight` packed, `X.scales`, `X.biases`, the form in config.json's
/// `quantization`) are read as such.
pub fn load_hf_dir(dir: &Path, opts: impl Into<LoadOptions>) -> Result<Weights> {
    let index = dir.join("model.safetensors.index.json");
    let files: Vec<PathBuf> = if index.is_file() {
        let v = read_json(&index)?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| llmq_text::Error::format(&index, "no weight_map"))?;
        let mut names: Vec<String> = map
            .values()
            .filter_map(|s| s.as_str().map(String::from))
            .collect();
        names.sort();
        names.dedup();
        names.into_iter().map(|n| dir.join(n)).collect()
    } else {
        vec![dir.join("model.safetensors")]
    };
    let quantization = MlxQuantization::from_config(&dir.join("config.json"))?;
    let mut w = Weights::new(dir, opts);
    let mut arrays = HashMap::new();
    for file in files {
        if !file.is_file() {
            return Err(llmq_text::Error::io(
                &file,
                std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
            )
            .into());
        }
        let loaded = Array::load_safetensors(&file)
            .map_err(|e| llmq_text::Error::format(&file, format!("bad safetensors file: {e}")))?;
        arrays.extend(loaded);
    }
    let quantized: Vec<String> = arrays
        .keys()
        .filter_map(|k| k.strip_suffix(".scales").map(String::from))
        .collect();
    for module in quantized {
        let scales = arrays.remove(&format!("{module}.scales")).unwrap();
        let (Some(packed), Some(biases)) = (
            arrays.remove(&format!("{module}.weight")),
            arrays.remove(&format!("{module}.biases")),
        ) else {
            return Err(llmq_text::Error::format(
                dir,
                format!("{module}: scales without a packed weight and biases"),
            )
            .into());
        };
        let spec = quantization.as_ref().and_then(|q| q.spec(&module)).ok_or_else(|| {
            llmq_text::Error::format(dir, format!("{module}: quantized, but config.json's quantization gives it no bits and group size"))
        })?;
        let q = QTensor {
            w: packed,
            scales,
            biases,
            spec,
        };
        check_quantized(dir, &module, &q)?;
        if let Some(module) = text_model_name(&module) {
            w.insert_quantized(format!("{module}.weight"), q, format!("mlx {spec}"))?;
        }
    }
    for (name, a) in arrays {
        if let Some(name) = text_model_name(&name) {
            w.insert(name, a)?;
        }
    }
    Ok(w)
}

/// A tensor's name as the text model reads it: a multimodal checkpoint's language model
/// (`model.language_model.*` in Hugging Face's, `language_model.model.*` and
/// `language_model.lm_head` in mlx-lm's) under the text model's names; None for what the text
/// model does not run (a vision tower, a multi-token-prediction head).
fn text_model_name(name: &str) -> Option<String> {
    const SKIPPED: [&str; 4] = ["model.visual.", "visual.", "vision_tower.", "mtp."];
    if SKIPPED.iter().any(|p| name.starts_with(p)) {
        return None;
    }
    Some(
        match name
            .strip_prefix("model.language_model.")
            .or_else(|| name.strip_prefix("language_model.model."))
        {
            Some(rest) => format!("model.{rest}"),
            None => name
                .strip_prefix("language_model.")
                .unwrap_or(name)
                .to_string(),
        },
    )
}

fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).map_err(|e| llmq_text::Error::io(path, e))?;
    Ok(serde_json::from_str(&text).map_err(|e| llmq_text::Error::format(path, e.to_string()))?)
}

/// A quantized tensor's parts agree with each other and with its form.
fn check_quantized(path: &Path, module: &str, q: &QTensor) -> Result<()> {
    let bad = |why: String| -> Result<()> {
        Err(llmq_text::Error::format(path, format!("{module}: {why}")).into())
    };
    if q.w.dtype() != Dtype::Uint32 {
        return bad(format!("a packed weight of {:?}, not uint32", q.w.dtype()));
    }
    let shape = q.shape();
    let cols = shape[shape.len() - 1];
    let mut groups: Vec<i32> = shape.iter().map(|&d| d as i32).collect();
    *groups.last_mut().unwrap() = (cols / q.spec.group_size as usize) as i32;
    if !cols.is_multiple_of(q.spec.group_size as usize)
        || q.scales.shape() != groups
        || q.biases.shape() != groups
    {
        return bad(format!(
            "scales {:?} and biases {:?} do not fit a packed weight {:?} at {}",
            q.scales.shape(),
            q.biases.shape(),
            q.w.shape(),
            q.spec
        ));
    }
    Ok(())
}

/// config.json's `quantization` as mlx-lm writes it: the default form, and per-module forms
/// (`"model.layers.0.mlp.gate": {"group_size": 64, "bits": 8}`) or `false` (kept dense).
struct MlxQuantization {
    default: Option<QuantSpec>,
    modules: HashMap<String, Option<QuantSpec>>,
}

impl MlxQuantization {
    fn from_config(path: &Path) -> Result<Option<Self>> {
        if !path.is_file() {
            return Ok(None);
        }
        let v = read_json(path)?;
        let Some(q) = v
            .get("quantization")
            .or_else(|| v.get("quantization_config"))
            .and_then(|q| q.as_object())
        else {
            return Ok(None);
        };
        let field = |name: &str, v: &serde_json::Value| -> Result<Option<QuantSpec>> {
            let bad =
                |why: &str| llmq_text::Error::format(path, format!("quantization{name}: {why}"));
            if let Some(mode) = v
                .get("mode")
                .and_then(|m| m.as_str())
                .filter(|m| *m != "affine")
            {
                return Err(bad(&format!("mode {mode:?}; only \"affine\" is supported")).into());
            }
            let (Some(bits), Some(group)) = (
                v.get("bits").and_then(|b| b.as_i64()),
                v.get("group_size").and_then(|g| g.as_i64()),
            ) else {
                return Ok(None);
            };
            QuantSpec::new(bits as i32, group as i32)
                .map(Some)
                .map_err(|e| bad(&e.to_string()).into())
        };
        let default = field("", &serde_json::Value::Object(q.clone()))?;
        let mut modules = HashMap::new();
        for (k, v) in q {
            match v {
                serde_json::Value::Object(_) => {
                    modules.insert(k.clone(), field(&format!(".{k}"), v)?);
                }
                serde_json::Value::Bool(false) => {
                    modules.insert(k.clone(), None);
                }
                _ => {}
            }
        }
        Ok(Some(MlxQuantization { default, modules }))
    }

    fn spec(&self, module: &str) -> Option<QuantSpec> {
        match self.modules.get(module) {
            Some(s) => *s,
            None => self.default,
        }
    }
}

fn gguf_to_hf(name: &str, arch: Arch) -> Option<String> {
    let fixed = match name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        // LFM2's norm after the last layer (Hugging Face's `embedding_norm`).
        "token_embd_norm.weight" if arch == Arch::Lfm2 => Some("model.embedding_norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    // Qwen3.5's decay rates (stored as A = -exp(A_log), without a suffix) and time-step bias.
    match (arch, part) {
        (Arch::Qwen35, "ssm_a") => return Some(format!("model.layers.{layer}.linear_attn.A_log")),
        (Arch::Qwen35, "ssm_dt.bias") => {
            return Some(format!("model.layers.{layer}.linear_attn.dt_bias"))
        }
        _ => {}
    }
    let (stem, suffix) = part.rsplit_once('.')?;
    let own = match (arch, stem) {
        (Arch::Lfm2, "attn_norm") => Some("operator_norm"),
        (Arch::Lfm2, "ffn_norm") => Some("ffn_norm"),
        (Arch::Lfm2, "shortconv.conv") => Some("conv.conv"),
        (Arch::Lfm2, "shortconv.in_proj") => Some("conv.in_proj"),
        (Arch::Lfm2, "shortconv.out_proj") => Some("conv.out_proj"),
        (Arch::Lfm2, "attn_output") => Some("self_attn.out_proj"),
        (Arch::Lfm2, "attn_q_norm") => Some("self_attn.q_layernorm"),
        (Arch::Lfm2, "attn_k_norm") => Some("self_attn.k_layernorm"),
        (Arch::Lfm2, "ffn_gate") => Some("feed_forward.w1"),
        (Arch::Lfm2, "ffn_up") => Some("feed_forward.w3"),
        (Arch::Lfm2, "ffn_down") => Some("feed_forward.w2"),
        (Arch::Qwen35, "attn_qkv") => Some("linear_attn.in_proj_qkv"),
        (Arch::Qwen35, "attn_gate") => Some("linear_attn.in_proj_z"),
        (Arch::Qwen35, "ssm_beta") => Some("linear_attn.in_proj_b"),
        (Arch::Qwen35, "ssm_alpha") => Some("linear_attn.in_proj_a"),
        (Arch::Qwen35, "ssm_out") => Some("linear_attn.out_proj"),
        (Arch::Qwen35, "ssm_norm") => Some("linear_attn.norm"),
        (Arch::Qwen35, "ssm_conv1d") => Some("linear_attn.conv1d"),
        _ => None,
    };
    if let Some(hf) = own {
        return Some(format!("model.layers.{layer}.{hf}.{suffix}"));
    }
    let hf = match stem {
        "attn_norm" => "input_layernorm",
        // Gemma's norm before the MLP; Llama's, named after the attention it follows.
        "ffn_norm" if arch.is_gemma() => "pre_feedforward_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "post_attention_norm" => "post_attention_layernorm",
        "post_ffw_norm" => "post_feedforward_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_gate" => "mlp.gate_proj",
        // Phi-3 stores gate and up fused as `ffn_up`, and q/k/v as `attn_qkv`.
        "ffn_up" if arch == Arch::Phi3 => "mlp.gate_up_proj",
        "ffn_up" => "mlp.up_proj",
        "attn_qkv" => "self_attn.qkv_proj",
        "ffn_down" => "mlp.down_proj",
        // Experts, stacked [experts, out, in], and their router.
        "ffn_gate_inp" => "mlp.gate",
        "ffn_gate_exps" => "mlp.switch_mlp.gate_proj",
        "ffn_up_exps" => "mlp.switch_mlp.up_proj",
        "ffn_down_exps" => "mlp.switch_mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{suffix}"))
}

/// llama.cpp's Q/K rows put back in Hugging Face's order: per head it stores the two rotary
/// halves interleaved. Row i of the result is row `order[i]` of the file's.
fn unpermuted_rows(rows: usize, heads: usize) -> Array {
    let per_head = rows / heads;
    let order: Vec<i32> = (0..rows)
        .map(|i| {
            let (head, r) = (i / per_head, i % per_head);
            let (half, j) = (r / (per_head / 2), r % (per_head / 2));
            (head * per_head + 2 * j + half) as i32
        })
        .collect();
    Array::from_slice(&order, &[rows as i32])
}

/// The width GGUF types without an exact affine form (Q2_K, Q3_K, Q6_K: 16-wide groups) are
/// requantized to, in groups of 32: 8 bits keeps the error far below the format's own.
const REQUANTIZED_BITS: i32 = 8;

pub fn load_gguf(f: &GgufFile, cfg: &ModelConfig, opts: impl Into<LoadOptions>) -> Result<Weights> {
    let mut w = Weights::new(f.path(), opts);
    // llama.cpp stores the norms of Gemma and Qwen3.5 (zero-centred weights) as 1 + w.
    w.norms_include_one = cfg.arch.norms_add_one();
    let keep = w.opts.keep_quantized;
    for info in &f.tensors {
        let Some(hf) = gguf_to_hf(&info.name, cfg.arch) else {
            tracing::debug!(tensor = %info.name, "ignoring GGUF tensor");
            continue;
        };
        let shape: Vec<i32> = info.shape.iter().map(|&d| d as i32).collect();
        let order = match cfg.arch {
            Arch::Llama if hf.ends_with("self_attn.q_proj.weight") => {
                Some(unpermuted_rows(shape[0] as usize, cfg.num_heads))
            }
            Arch::Llama if hf.ends_with("self_attn.k_proj.weight") => {
                Some(unpermuted_rows(shape[0] as usize, cfg.num_kv_heads))
            }
            _ => None,
        };
        let reorder = |a: Array| -> Result<Array> {
            Ok(match &order {
                Some(o) => a.take_axis(o, 0)?,
                None => a,
            })
        };
        let quantized = !matches!(
            info.kind,
            TensorType::F32 | TensorType::F16 | TensorType::BF16
        );
        if keep && quantized && shape.len() >= 2 {
            // A matrix, or a stack of them (experts): rows are everything but the last axis.
            let cols = shape[shape.len() - 1] as usize;
            let rows = info.elements() as usize / cols;
            let kind = info.kind.name();
            let (q, origin) = match llmq_text::affine::read(info.kind, f.bytes(info)) {
                Some(a) => (
                    QTensor::from_affine(&a, rows, cols, a.bits as i32, w.dtype())?,
                    format!("{kind} (exact)"),
                ),
                None => {
                    let dense = Array::from_slice(&f.read_f32(info), &[rows as i32, cols as i32]);
                    (
                        QTensor::quantize(&dense, QuantSpec::new(REQUANTIZED_BITS, 32)?)?,
                        format!("{kind} (requantized)"),
                    )
                }
            };
            let lead = &shape[..shape.len() - 1];
            let shaped = |a: Array| -> Result<Array> {
                let mut s = lead.to_vec();
                s.push(a.shape()[1]);
                reorder(a.reshape(&s)?)
            };
            let q = QTensor {
                w: shaped(q.w)?,
                scales: shaped(q.scales)?,
                biases: shaped(q.biases)?,
                spec: q.spec,
            };
            w.insert_quantized(hf, q, origin)?;
        } else {
            let mut a = reorder(Array::from_slice(&f.read_f32(info), &shape))?;
            if hf.ends_with(".linear_attn.A_log") {
                // Stored as A = -exp(A_log).
                a = a.negative()?.log()?;
            }
            if quantized {
                w.origin.insert(hf.clone(), info.kind.name().to_string());
            }
            w.insert(hf, a)?;
        }
    }
    Ok(w)
}
