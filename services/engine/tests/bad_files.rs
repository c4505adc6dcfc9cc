//! Bad model files give an error that names the file and the problem; never a panic.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use llmq_engine::load_model;
use llmq_text::resolve_model;
use mlx_rs::Dtype;

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("llmq-bad-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn load_err(path: &Path) -> String {
    match load_model(path, Dtype::Float32) {
        Ok(_) => panic!("{} loaded", path.display()),
        Err(e) => {
            let s = e.to_string();
            assert!(
                s.contains(&path.display().to_string())
                    || s.contains(path.file_name().unwrap().to_str().unwrap()),
                "error does not name the file: {s}"
            );
            s
        }
    }
}

/// A minimal GGUF: string metadata and tensors given as (name, dims innermost first, type, bytes).
fn write_gguf(path: &Path, kv: &[(&str, &str)], tensors: &[(&str, Vec<u64>, u32, usize)]) {
    let mut b = Vec::new();
    let s = |b: &mut Vec<u8>, x: &str| {
        b.extend((x.len() as u64).to_le_bytes());
        b.extend(x.as_bytes());
    };
    b.extend(b"GGUF");
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((kv.len() as u64).to_le_bytes());
    for (k, v) in kv {
        s(&mut b, k);
        b.extend(8u32.to_le_bytes());
        s(&mut b, v);
    }
    let mut off = 0u64;
    for (name, dims, ty, nbytes) in tensors {
        s(&mut b, name);
        b.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(ty.to_le_bytes());
        b.extend(off.to_le_bytes());
        off += (*nbytes as u64).div_ceil(32) * 32;
    }
    b.resize(b.len().div_ceil(32) * 32, 0);
    b.resize(b.len() + off as usize, 0);
    std::fs::write(path, b).unwrap();
}

#[test]
fn missing_files_and_unknown_names() {
    let p = PathBuf::from("/nonexistent/model.gguf");
    assert!(matches!(
        resolve_model(p.to_str().unwrap()),
        Err(llmq_text::Error::UnknownModel(..))
    ));
    let d = tmpdir("empty");
    let err = load_err(&d);
    assert!(err.contains("config.json"), "{err}");
}

#[test]
fn truncated_gguf() {
    let d = tmpdir("trunc");
    let full = std::fs::read(fixture("tiny-llama.gguf")).unwrap();
    for (i, keep) in [3usize, 100, 5000, full.len() - 100]
        .into_iter()
        .enumerate()
    {
        let p = d.join(format!("cut{i}.gguf"));
        std::fs::write(&p, &full[..keep]).unwrap();
        let err = load_err(&p);
        assert!(err.contains("truncated"), "{keep} bytes: {err}");
    }
}

#[test]
fn wrong_magic() {
    let d = tmpdir("magic");
    let p = d.join("model.gguf");
    let mut bytes = std::fs::read(fixture("tiny-llama.gguf")).unwrap();
    bytes[..4].copy_from_slice(b"GGML");
    std::fs::write(&p, bytes).unwrap();
    assert!(load_err(&p).contains("not a GGUF file"));
}

#[test]
fn unknown_architecture() {
    let d = tmpdir("arch");
    let p = d.join("neox.gguf");
    write_gguf(
        &p,
        &[("general.architecture", "gptneox")],
        &[("token_embd.weight", vec![32, 4], 0, 512)],
    );
    assert!(load_err(&p).contains("unsupported architecture \"gptneox\""));
    let hf = d.join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    let cfg = std::fs::read_to_string(fixture("tiny-llama/config.json"))
        .unwrap()
        .replace("\"llama\"", "\"falcon\"");
    std::fs::write(hf.join("config.json"), cfg).unwrap();
    assert!(load_err(&hf).contains("falcon"));
}

/// A rope type llmq does not know, or a scaling missing what its type needs, is refused with
/// the field and its value.
#[test]
fn unknown_rope_scaling() {
    let d = tmpdir("rope");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("tiny-llama3/config.json")).unwrap())
            .unwrap();
    for (params, expect) in [
        (
            serde_json::json!({"rope_type": "mrope", "rope_theta": 10000.0, "factor": 2.0}),
            "rope_parameters.rope_type = \"mrope\"",
        ),
        (
            serde_json::json!({"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}),
            "rope_parameters.low_freq_factor = missing",
        ),
    ] {
        let mut c = cfg.clone();
        c["rope_parameters"] = params;
        let hf = d.join(expect.len().to_string());
        copy_dir(&fixture("tiny-llama3"), &hf);
        std::fs::write(hf.join("config.json"), c.to_string()).unwrap();
        let err = load_err(&hf);
        assert!(err.contains(expect), "{err}");
    }
}

#[test]
fn unknown_tensor_type() {
    let d = tmpdir("qtype");
    let p = d.join("iq4xs.gguf");
    // type 23 is IQ4_XS: 256-element blocks of 136 bytes
    write_gguf(
        &p,
        &[("general.architecture", "llama")],
        &[("blk.0.attn_q.weight", vec![256, 4], 23, 544)],
    );
    let err = load_err(&p);
    assert!(
        err.contains("IQ4_XS") && err.contains("blk.0.attn_q.weight") && err.contains("Q6_K"),
        "{err}"
    );
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[test]
fn tokenizer_larger_than_the_embedding() {
    let d = tmpdir("vocab").join("tiny");
    copy_dir(&fixture("tiny-llama"), &d);
    let mut tj: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("tokenizer.json")).unwrap()).unwrap();
    tj["added_tokens"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({
        "id": 1000, "content": "<|extra|>", "single_word": false, "lstrip": false, "rstrip": false,
        "normalized": false, "special": true}));
    std::fs::write(d.join("tokenizer.json"), tj.to_string()).unwrap();
    let err = load_err(&d);
    assert!(err.contains("embedding has only 384 rows"), "{err}");
}

#[test]
fn truncated_safetensors_and_wrong_shapes() {
    let d = tmpdir("st").join("tiny");
    copy_dir(&fixture("tiny-llama"), &d);
    let bytes = std::fs::read(d.join("model.safetensors")).unwrap();
    std::fs::write(d.join("model.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
    let err = load_err(&d);
    assert!(err.contains("model.safetensors"), "{err}");

    let d2 = tmpdir("shape").join("tiny");
    copy_dir(&fixture("tiny-llama"), &d2);
    let cfg = std::fs::read_to_string(d2.join("config.json"))
        .unwrap()
        .replace("\"intermediate_size\": 128", "\"intermediate_size\": 96");
    std::fs::write(d2.join("config.json"), cfg).unwrap();
    let err = load_err(&d2);
    assert!(err.contains("shape"), "{err}");
}
