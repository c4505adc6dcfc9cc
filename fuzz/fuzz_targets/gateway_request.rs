//! Any body on /v1/chat/completions and /v1/completions: parsed and turned into a job request,
//! or refused with an error, never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;
use llmq_gateway::openai;

fuzz_target!(|data: &[u8]| {
    if let Ok(r) = serde_json::from_slice::<openai::ChatRequest>(data) {
        let _ = openai::chat_request(r);
    }
    if let Ok(r) = serde_json::from_slice::<openai::CompletionRequest>(data) {
        let _ = openai::completion_request(r);
    }
});
