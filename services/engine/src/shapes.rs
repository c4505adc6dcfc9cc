//! Random-weight models of known shapes ([`llmq_text::shapes`]): Llama's, Qwen3-MoE's for the
//! mixture-of-experts shapes, LFM2's and Qwen3.5's for theirs, for speed measurements that need
//! no files.

use llmq_text::shapes::config;
use mlx_rs::random;

use crate::error::Result;
use crate::model::Model;
use crate::weights::{LoadOptions, Weights};

/// A model of the named shape with normally distributed weights (std 0.02), in the options'
/// dtype (and quantized, where they say).
pub fn random_model(name: &str, opts: impl Into<LoadOptions>, seed: u64) -> Result<Model> {
    let c = config(name)?;
    let opts = opts.into();
    let dtype = opts.dtype;
    let mut w = Weights::new(format!("random:{name}"), opts);
    let mut n = 0u64;
    let mut add = |w: &mut Weights, name: String, shape: &[usize]| -> Result<()> {
        n += 1;
        let k = random::key(seed.wrapping_mul(1_000_003).wrapping_add(n))?;
        let s: Vec<i32> = shape.iter().map(|&d| d as i32).collect();
        let a = if name.ends_with("norm.weight") {
            mlx_rs::ops::ones_dtype(&s, dtype)?
        } else {
            random::normal::<f32>(&s[..], 0.0, 0.02, &k)?.as_dtype(dtype)?
        };
        a.eval()?; // one tensor at a time: peak memory stays near the model's size
        w.insert(name, a)
    };
    add(
        &mut w,
        "model.embed_tokens.weight".into(),
        &[c.vocab_size, c.hidden_size],
    )?;
    let opts = crate::arch::options(c.arch);
    let names = opts.names;
    for i in 0..c.num_layers {
        let p = format!("model.layers.{i}");
        let (h, f, d) = (c.hidden_size, c.intermediate_size, c.head_dim);
        add(&mut w, format!("{p}.{}.weight", names.input_norm), &[h])?;
        add(&mut w, format!("{p}.{}.weight", names.mlp_norm), &[h])?;
        if let Some(conv) = c.conv_at(i) {
            add(&mut w, format!("{p}.conv.in_proj.weight"), &[3 * h, h])?;
            add(&mut w, format!("{p}.conv.out_proj.weight"), &[h, h])?;
            add(
                &mut w,
                format!("{p}.conv.conv.weight"),
                &[h, 1, conv.kernel],
            )?;
        } else if let Some(dn) = c.delta_at(i) {
            let a = format!("{p}.linear_attn");
            let (channels, hv, dv) = (dn.conv_channels(), dn.value_heads, dn.value_dim);
            add(&mut w, format!("{a}.in_proj_qkv.weight"), &[channels, h])?;
            add(&mut w, format!("{a}.in_proj_z.weight"), &[hv * dv, h])?;
            add(&mut w, format!("{a}.in_proj_b.weight"), &[hv, h])?;
            add(&mut w, format!("{a}.in_proj_a.weight"), &[hv, h])?;
            add(
                &mut w,
                format!("{a}.conv1d.weight"),
                &[channels, 1, dn.conv_kernel],
            )?;
            add(&mut w, format!("{a}.A_log"), &[hv])?;
            add(&mut w, format!("{a}.dt_bias"), &[hv])?;
            add(&mut w, format!("{a}.norm.weight"), &[dv])?;
            add(&mut w, format!("{a}.out_proj.weight"), &[h, hv * dv])?;
        } else {
            let a = format!("{p}.self_attn");
            let q_rows = if c.attn_output_gate { 2 } else { 1 } * c.num_heads * d;
            add(&mut w, format!("{a}.q_proj.weight"), &[q_rows, h])?;
            add(
                &mut w,
                format!("{a}.k_proj.weight"),
                &[c.num_kv_heads * d, h],
            )?;
            add(
                &mut w,
                format!("{a}.v_proj.weight"),
                &[c.num_kv_heads * d, h],
            )?;
            add(
                &mut w,
                format!("{a}.{}.weight", names.attn_out),
                &[h, c.num_heads * d],
            )?;
            if opts.qk_norm {
                add(&mut w, format!("{a}.{}.weight", names.q_norm), &[d])?;
                add(&mut w, format!("{a}.{}.weight", names.k_norm), &[d])?;
            }
        }
        match &c.moe {
            Some(m) => {
                add(&mut w, format!("{p}.mlp.gate.weight"), &[m.experts, h])?;
                for e in 0..m.experts {
                    add(
                        &mut w,
                        format!("{p}.mlp.experts.{e}.gate_proj.weight"),
                        &[m.expert_size, h],
                    )?;
                    add(
                        &mut w,
                        format!("{p}.mlp.experts.{e}.up_proj.weight"),
                        &[m.expert_size, h],
                    )?;
                    add(
                        &mut w,
                        format!("{p}.mlp.experts.{e}.down_proj.weight"),
                        &[h, m.expert_size],
                    )?;
                }
            }
            None => {
                let m = format!("{p}.{}", names.mlp);
                add(&mut w, format!("{m}.{}.weight", names.gate), &[f, h])?;
                add(&mut w, format!("{m}.{}.weight", names.up), &[f, h])?;
                add(&mut w, format!("{m}.{}.weight", names.down), &[h, f])?;
            }
        }
    }
    add(&mut w, names.final_norm.into(), &[c.hidden_size])?;
    if !c.tie_word_embeddings {
        add(
            &mut w,
            "lm_head.weight".into(),
            &[c.vocab_size, c.hidden_size],
        )?;
    }
    Model::load(c, w)
}
