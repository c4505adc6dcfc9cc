//! The `llmq` binary as a user runs it: generate with the default model, bench on random weights,
//! and clear errors for bad arguments.

use std::process::Command;

fn llmq(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_llmq"))
        .args(args)
        .output()
        .expect("run llmq")
}

#[test]
fn generate_local_json_answers_the_question() {
    let out = llmq(&[
        "generate",
        "--local",
        "--model",
        "smollm2",
        "--chat",
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "24",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["text"].as_str().unwrap().contains("Paris"), "{v}");
    for k in [
        "token_ids",
        "prompt_token_ids",
        "ttft_ms",
        "ms_per_token",
        "finish_reason",
    ] {
        assert!(!v[k].is_null(), "missing {k}: {v}");
    }
    assert_eq!(v["finish_reason"], "stop");
}

#[test]
fn generate_streams_text_and_honours_sampling_flags() {
    let args = [
        "generate",
        "--local",
        "--chat",
        "--prompt",
        "Name three colours.",
        "--max-tokens",
        "12",
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--seed",
        "42",
        "--json",
    ];
    let a = llmq(&args);
    let b = llmq(&args);
    assert!(a.status.success(), "{}", String::from_utf8_lossy(&a.stderr));
    let (va, vb): (serde_json::Value, serde_json::Value) = (
        serde_json::from_slice(&a.stdout).unwrap(),
        serde_json::from_slice(&b.stdout).unwrap(),
    );
    assert_eq!(va["token_ids"], vb["token_ids"], "same seed, same tokens");
    let plain = llmq(&[
        "generate",
        "--local",
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "8",
    ]);
    assert!(plain.status.success());
    assert!(!String::from_utf8_lossy(&plain.stdout).trim().is_empty());
}

#[test]
fn bench_single_prints_the_peer_fields() {
    let out = llmq(&[
        "bench",
        "single",
        "--random-weights",
        "tiny",
        "--output-tokens",
        "40",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for k in [
        "ms_per_token",
        "tokens_per_s",
        "hbm_roofline_ms",
        "fraction_of_roofline",
        "weight_bytes",
    ] {
        assert!(v[k].as_f64().is_some_and(|x| x > 0.0), "{k}: {v}");
    }
    assert_eq!(v["scenario"], "single");
}

#[test]
fn bad_arguments_are_clear_errors() {
    for (args, needle) in [
        (
            vec![
                "generate",
                "--local",
                "--model",
                "no-such-model",
                "--prompt",
                "x",
            ],
            "unknown model",
        ),
        (
            vec![
                "generate",
                "--local",
                "--prompt",
                "x",
                "--temperature",
                "NaN",
            ],
            "temperature",
        ),
        (
            vec!["generate", "--local", "--prompt", "x", "--max-tokens", "0"],
            "max_tokens",
        ),
        (vec!["generate", "--local", "--prompt", ""], "empty prompt"),
        (
            vec!["bench", "single", "--random-weights", "3b"],
            "unknown shape",
        ),
    ] {
        let out = llmq(&args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}
