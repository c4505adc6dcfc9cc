//! Any file as a GGUF model: it opens or is refused, never panics; what opens has tensors
//! whose reads stay inside the file.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = std::env::temp_dir().join(format!("llmq-fuzz-{}.gguf", std::process::id()));
    std::fs::write(&path, data).unwrap();
    if let Ok(f) = llmq_text::gguf::GgufFile::open(&path) {
        let _ = f.get("general.architecture");
        let _ = f.tensor("token_embd.weight");
    }
});
