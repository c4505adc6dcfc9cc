//! Shared helpers for the engine's tests: fixture paths, reference files, comparisons.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;

use llmq_engine::cache::SequenceCache;
use llmq_engine::model::host_f32;
use llmq_engine::{load_model, LoadedModel, Model};
use mlx_rs::{Array, Dtype};

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub fn fixture(name: &str) -> PathBuf {
    repo().join("tests/fixtures").join(name)
}

pub fn load(name: &str) -> LoadedModel {
    load_model(&fixture(name), Dtype::Float32).unwrap_or_else(|e| panic!("loading {name}: {e}"))
}

/// A reference case: prompt ids and transformers' logits for every position [T, V].
pub struct Case {
    pub ids: Vec<u32>,
    pub logits: Vec<f32>,
    pub vocab: usize,
}

impl Case {
    pub fn row(&self, t: usize) -> &[f32] {
        &self.logits[t * self.vocab..(t + 1) * self.vocab]
    }
}

pub fn reference(path: PathBuf) -> Vec<Case> {
    let mut map: HashMap<String, Array> = Array::load_safetensors(&path).expect("reference file");
    let mut out = vec![];
    for i in 0.. {
        let Some(ids) = map.remove(&format!("case{i}.ids")) else {
            break;
        };
        let logits = map.remove(&format!("case{i}.logits")).unwrap();
        let vocab = logits.shape()[1] as usize;
        out.push(Case {
            ids: ids.as_slice::<i32>().iter().map(|&v| v as u32).collect(),
            logits: logits.as_slice::<f32>().to_vec(),
            vocab,
        });
    }
    assert!(!out.is_empty());
    out
}

pub fn tensor(path: &PathBuf, name: &str) -> Array {
    let mut map = Array::load_safetensors(path).expect("reference file");
    map.remove(name)
        .unwrap_or_else(|| panic!("{name} in {}", path.display()))
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Token ids stored as a JSON array (the references' JSON files).
pub fn json_ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

pub fn ids_array(ids: &[u32]) -> Array {
    let v: Vec<i32> = ids.iter().map(|&t| t as i32).collect();
    Array::from_slice(&v, &[1, v.len() as i32])
}

/// Runs ids through the model in chunks; returns the logits of every position, flattened.
pub fn run_chunked(
    model: &Model,
    cache: &mut SequenceCache,
    ids: &[u32],
    chunk: usize,
) -> Vec<f32> {
    let mut all = vec![];
    for part in ids.chunks(chunk) {
        let l = model
            .forward(&ids_array(part), &mut [&mut *cache], false)
            .unwrap();
        all.extend(host_f32(&l).unwrap());
    }
    all
}

pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for i in 0..x.len() {
        if x[i] > x[best] {
            best = i;
        }
    }
    best as u32
}

/// Milliseconds one call of `f` takes on average over 50, after one to warm up: the 50 results
/// built first and evaluated together (as a decode step's operations are), launches included.
pub fn time_ms(f: &dyn Fn() -> Array) -> f64 {
    f().eval().unwrap();
    let reps = 50;
    let t = std::time::Instant::now();
    let outs: Vec<Array> = (0..reps).map(|_| f()).collect();
    mlx_rs::transforms::eval(outs.iter()).unwrap();
    t.elapsed().as_secs_f64() * 1000.0 / reps as f64
}
