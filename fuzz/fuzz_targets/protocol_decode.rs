//! Any bytes on a subject: every message type decodes or is refused, never panics.
#![no_main]
use libfuzzer_sys::fuzz_target;
use llmq_protocol::*;

fuzz_target!(|data: &[u8]| {
    let _ = decode::<GenerateRequest>(data);
    let _ = decode::<GenerateReply>(data);
    let _ = decode::<Job>(data);
    let _ = decode::<StreamEvent>(data);
    let _ = decode::<Cancel>(data);
    let _ = decode::<WorkerStatus>(data);
    let _ = decode::<ClearCache>(data);
});
