//! Mixture-of-experts MLP: a router scores every expert for each row, the top k run, and their
//! outputs are summed weighted by the router's softmax (renormalised over the k where the
//! config says).
//!
//! The experts' weights are stacked ([experts, in, out]) and every row's k experts run through
//! MLX's gathered matmul: one kernel a projection for all rows and experts, no per-token loop.
//! With many (row, expert) pairs (a prefill chunk, a large decode batch) the pairs are sorted by
//! expert first, so rows that picked the same expert share one read of its weights. On an NVIDIA
//! GPU a step of up to `experts::MAX_PAIRS` pairs with full-precision experts goes through llmq's
//! own kernels instead ([`crate::kernels::cuda::experts`]: routing and products grouped by expert, four launches).

use mlx_rs::ops::indexing::{take_along_axis, IndexOp};
use mlx_rs::ops::{argpartition_axis, argsort_axis, gather_mm, gather_qmm, sigmoid, softmax_axis};
use mlx_rs::{Array, Dtype};

use llmq_text::config::MoeConfig;

use super::parts::{Linear, Mlp};
use crate::arch::Names;
use crate::error::Result;
use crate::kernels::cuda::experts;
use crate::kernels::gated;
use crate::quant::{Matrix, QTensor};
use crate::weights::Weights;

/// (row, expert) pairs from this many on are sorted by expert before the gathered matmuls.
const SORT_FROM: i32 = 64;

pub(super) struct Experts {
    router: Linear,
    /// Gate and up projections of every expert, [experts, 2 * size, hidden] (each expert's
    /// rows as the checkpoint has them).
    gate_up: Stack,
    /// Down projections, [experts, hidden, size].
    down: Stack,
    size: i32,
    top_k: i32,
    renormalize: bool,
    /// Qwen2-MoE's shared expert, run by every token, and its gate (one logit a token, through a
    /// sigmoid).
    shared: Option<(Mlp, Linear)>,
}

/// Every expert's weight of one projection, stacked.
enum Stack {
    /// Full precision as the checkpoint has it ([experts, out, in], row-contiguous: llmq's
    /// kernels read it), and the same memory seen transposed ([experts, in, out]) for MLX's
    /// gathered matmul, which then reads each output's weights contiguously.
    Dense {
        w: Array,
        t: Array,
    },
    Quantized(QTensor),
}

impl Stack {
    fn new(m: Matrix) -> Result<Self> {
        Ok(match m {
            Matrix::Dense(w) => {
                let t = w.swap_axes(-1, -2)?;
                Stack::Dense { w, t }
            }
            Matrix::Quantized(q) => Stack::Quantized(q),
        })
    }

    /// The weights llmq's kernels take for a step of `pairs` pairs, if they take it.
    fn for_kernel(&self, pairs: i32, dtype: Dtype) -> Option<&Array> {
        match self {
            Stack::Dense { w, .. } if experts::applies(pairs, w, dtype) => Some(w),
            _ => None,
        }
    }

    /// `x` [..., 1, in] times the weights of `experts` (same leading shape): [..., 1, out].
    fn gather(&self, x: &Array, experts: &Array, sorted: bool) -> Result<Array> {
        Ok(match self {
            Stack::Dense { t, .. } => gather_mm(x, t, None, experts, sorted)?,
            Stack::Quantized(q) => gather_qmm(
                x,
                &q.w,
                &q.scales,
                &q.biases,
                None,
                experts,
                true,
                q.spec.group_size,
                q.spec.bits,
                sorted,
            )?,
        })
    }

    fn parameters(&self) -> Vec<&Array> {
        match self {
            Stack::Dense { w, .. } => vec![w],
            Stack::Quantized(q) => q.parameters().to_vec(),
        }
    }
}

impl Experts {
    /// Loads Mixtral's names (`block_sparse_moe.gate`, `experts.N.w1|w3|w2`), Qwen's
    /// (`mlp.gate`, `experts.N.gate_proj|up_proj|down_proj`), or either with the experts
    /// already stacked as mlx-lm writes them (`switch_mlp.gate_proj|up_proj|down_proj`).
    pub(super) fn load(w: &mut Weights, layer: &str, hidden: usize, m: &MoeConfig) -> Result<Self> {
        let mixtral = w.contains(&format!("{layer}.block_sparse_moe.gate.weight"));
        let (p, gate, up, down) = if mixtral {
            (format!("{layer}.block_sparse_moe"), "w1", "w3", "w2")
        } else {
            (format!("{layer}.mlp"), "gate_proj", "up_proj", "down_proj")
        };
        let router = Linear::load(w, &format!("{p}.gate"), m.experts, hidden, false)?;
        let (f, e) = (m.expert_size, m.experts);
        let (gate_up, down) = if w.contains(&format!("{p}.switch_mlp.gate_proj.weight")) {
            let g = w.take_matrix(&format!("{p}.switch_mlp.gate_proj.weight"), &[e, f, hidden])?;
            let u = w.take_matrix(&format!("{p}.switch_mlp.up_proj.weight"), &[e, f, hidden])?;
            (
                Matrix::join(vec![g, u], false)?,
                w.take_matrix(&format!("{p}.switch_mlp.down_proj.weight"), &[e, hidden, f])?,
            )
        } else {
            let (mut gate_up, mut downs) = (Vec::with_capacity(e), Vec::with_capacity(e));
            for x in 0..e {
                let g = w.take_matrix(&format!("{p}.experts.{x}.{gate}.weight"), &[f, hidden])?;
                let u = w.take_matrix(&format!("{p}.experts.{x}.{up}.weight"), &[f, hidden])?;
                gate_up.push(Matrix::join(vec![g, u], false)?);
                downs.push(w.take_matrix(&format!("{p}.experts.{x}.{down}.weight"), &[hidden, f])?);
            }
            (Matrix::join(gate_up, true)?, Matrix::join(downs, true)?)
        };
        let shared = match m.shared_expert {
            Some(size) => Some((
                Mlp::load(
                    w,
                    &format!("{p}.shared_expert"),
                    hidden,
                    size,
                    false,
                    Names::HF,
                    false,
                )?,
                Linear::load(w, &format!("{p}.shared_expert_gate"), 1, hidden, false)?,
            )),
            None => None,
        };
        Ok(Experts {
            router,
            gate_up: Stack::new(gate_up)?,
            down: Stack::new(down)?,
            size: f as i32,
            top_k: m.experts_per_token as i32,
            renormalize: m.renormalize,
            shared,
        })
    }

    pub(super) fn parameters(&self) -> Vec<&Array> {
        let mut p = self.router.parameters();
        p.extend(self.gate_up.parameters());
        p.extend(self.down.parameters());
        if let Some((mlp, gate)) = &self.shared {
            p.extend(mlp.parameters());
            p.extend(gate.parameters());
        }
        p
    }

    /// Bytes of the experts' weights (the router's not included).
    pub(super) fn expert_bytes(&self) -> usize {
        self.gate_up
            .parameters()
            .iter()
            .chain(&self.down.parameters())
            .map(|a| a.nbytes())
            .sum()
    }

    /// `x` [b, t, hidden] through each row's top-k experts.
    pub(super) fn forward(&self, x: &Array, gelu: bool) -> Result<Array> {
        let shape = x.shape().to_vec();
        let hidden = shape[shape.len() - 1];
        let n: i32 = shape[..shape.len() - 1].iter().product();
        let rows = x.reshape(&[n, hidden])?;
        let k = self.top_k;
        let mut y = match (
            self.gate_up.for_kernel(n * k, x.dtype()),
            self.down.for_kernel(n * k, x.dtype()),
        ) {
            (Some(gate_up), Some(down)) => {
                let (chosen, weights) =
                    experts::route(&self.router.forward(&rows)?, k, self.renormalize)?;
                let h = experts::gate_up(&rows, gate_up, &chosen, &weights, gelu)?;
                experts::down(&h, down, &chosen, &weights)?
                    .reshape(&[n, k, hidden])?
                    .sum_axis(1, false)?
            }
            _ => self.mlx_path(&rows, gelu)?,
        };
        if let Some((mlp, gate)) = &self.shared {
            let scale = sigmoid(&gate.forward(&rows)?)?;
            y = y.add(
                &mlp.forward(&rows.reshape(&[1, n, hidden])?)?
                    .reshape(&[n, hidden])?
                    .multiply(&scale)?,
            )?;
        }
        Ok(y.reshape(&shape)?)
    }

    /// `rows` [n, hidden] through their experts by MLX's operations: [n, hidden].
    fn mlx_path(&self, rows: &Array, gelu: bool) -> Result<Array> {
        let n = rows.shape()[0];
        let k = self.top_k;
        // Router probabilities in f32, the k largest (in no particular order).
        let probs = softmax_axis(
            &self.router.forward(rows)?.as_dtype(Dtype::Float32)?,
            -1,
            None,
        )?;
        let experts = argpartition_axis(&probs.negative()?, k - 1, -1)?.index((.., ..k));
        let mut weights = take_along_axis(&probs, &experts, -1)?;
        if self.renormalize {
            weights = weights.divide(&weights.sum_axis(-1, true)?)?;
        }
        let weights = weights.as_dtype(rows.dtype())?;
        let out = if n * k >= SORT_FROM {
            self.run_sorted(rows, &experts, gelu)?
        } else {
            self.run(rows, &experts, gelu)?
        };
        // [n, k, hidden] weighted over the k.
        Ok(out
            .multiply(&weights.reshape(&[n, k, 1])?)?
            .sum_axis(1, false)?)
    }

    /// Every row against its k experts in place: [n, k, hidden].
    fn run(&self, rows: &Array, experts: &Array, gelu: bool) -> Result<Array> {
        let (n, hidden) = (rows.shape()[0], rows.shape()[1]);
        let x = rows.reshape(&[n, 1, 1, hidden])?;
        let h = self.gate_up.gather(&x, experts, false)?;
        let h = gated(&h, self.size, gelu)?;
        Ok(self
            .down
            .gather(&h, experts, false)?
            .reshape(&[n, self.top_k, hidden])?)
    }

    /// The (row, expert) pairs sorted by expert, run, and put back: [n, k, hidden].
    fn run_sorted(&self, rows: &Array, experts: &Array, gelu: bool) -> Result<Array> {
        let (n, hidden, k) = (rows.shape()[0], rows.shape()[1], self.top_k);
        let flat = experts.reshape(&[n * k])?;
        let order = argsort_axis(&flat, 0)?;
        let sorted_experts = flat.take_axis(&order, 0)?;
        // Pair i is row i / k's.
        let x = rows
            .take_axis(&order.floor_divide(Array::from_int(k))?, 0)?
            .reshape(&[n * k, 1, hidden])?;
        let h = self.gate_up.gather(&x, &sorted_experts, true)?;
        let h = gated(&h, self.size, gelu)?;
        let y = self
            .down
            .gather(&h, &sorted_experts, true)?
            .reshape(&[n * k, hidden])?;
        let back = argsort_axis(&order, 0)?;
        Ok(y.take_axis(&back, 0)?.reshape(&[n, k, hidden])?)
    }
}
