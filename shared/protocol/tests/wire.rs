//! Round trips, golden bytes and limits of protocol v1.

use llmq_protocol::*;

fn roundtrip<T: serde::Serialize + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug>(
    m: T,
) {
    let bytes = encode(&m).unwrap();
    assert_eq!(decode::<T>(&bytes).unwrap(), m);
}

fn job() -> Job {
    Job {
        request_id: "r1".into(),
        model: "smollm2".into(),
        prompt_ids: vec![1, 2, 3],
        sampling: Sampling {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.9,
            min_p: 0.0,
            repetition_penalty: 1.1,
            seed: Some(7),
            logprobs: true,
            top_logprobs: 2,
        },
        stop: StopConditions {
            max_tokens: 16,
            stop: vec!["\n\n".into()],
            stop_token_ids: vec![2],
            ignore_eos: false,
            special_text: true,
        },
        stream_subject: "_INBOX.abc".into(),
        accepted_at_ms: 1_700_000_000_000,
        cache_salt: None,
        constraint: None,
        n: 1,
    }
}

#[test]
fn every_message_round_trips() {
    roundtrip(GenerateRequest {
        model: "smollm2".into(),
        messages: Some(vec![ChatMessage::new("user", "hi")]),
        max_tokens: Some(-3),
        temperature: Some(f64::INFINITY),
        stop: vec!["x".into()],
        ..Default::default()
    });
    roundtrip(GenerateRequest {
        model: "m".into(),
        messages: Some(vec![
            ChatMessage {
                role: "assistant".into(),
                tool_calls: vec![ToolCall {
                    id: "abcdefghi".into(),
                    name: "f".into(),
                    arguments: "{}".into(),
                }],
                ..Default::default()
            },
            ChatMessage {
                role: "tool".into(),
                content: "42".into(),
                tool_call_id: Some("abcdefghi".into()),
                ..Default::default()
            },
        ]),
        tools: vec![Tool {
            name: "f".into(),
            description: None,
            parameters: Some("{\"type\":\"object\"}".into()),
        }],
        tool_choice: Some(ToolChoice::Function { name: "f".into() }),
        parallel_tool_calls: Some(false),
        requires: vec![
            "tools".into(),
            "tool_choice".into(),
            "parallel_tool_calls".into(),
        ],
        ..Default::default()
    });
    roundtrip(GenerateReply::Accepted {
        request_id: "r1".into(),
        stream_subject: "llm.v1.stream.r1".into(),
        tool_syntax: Some(ToolSyntax::Mistral),
        job_seq: Some(7),
    });
    roundtrip(JobQuery {
        request_id: "r1".into(),
        job_seq: 7,
    });
    roundtrip(JobState::Pending);
    roundtrip(JobState::Gone);
    roundtrip(GenerateReply::Rejected {
        error: WireError::new(ErrorClass::PromptTooLong, "4097 > 4096"),
    });
    roundtrip(job());
    for event in [
        Event::Queued { position: 3 },
        Event::PrefillProgress {
            done: 256,
            total: 1000,
        },
        Event::Tokens {
            ids: vec![5, 6],
            text: "hé".into(),
            logprobs: vec![],
        },
        Event::Tokens {
            ids: vec![5],
            text: "a".into(),
            logprobs: vec![TokenLogprob {
                token: 5,
                logprob: -0.5,
                top: vec![(5, -0.5)],
                text: "a".into(),
                top_text: vec!["a".into()],
            }],
        },
        Event::Done {
            finish_reason: FinishReason::Length,
            usage: Usage {
                prompt: 10,
                completion: 16,
                cached: 4,
            },
            timings: Timings {
                queue_ms: 1.5,
                ttft_ms: 20.0,
                total_ms: 300.0,
            },
        },
        Event::Error {
            error: WireError::new(ErrorClass::Cancelled, "cancelled"),
        },
    ] {
        roundtrip(StreamEvent {
            request_id: "r1".into(),
            seq: 9,
            event,
            choice: 2,
        });
    }
    roundtrip(Cancel {
        request_id: "r1".into(),
    });
    roundtrip(WorkerStatus {
        worker_id: "w1".into(),
        kv_bytes_free: 1 << 40,
        prefix_hit_rate: 0.25,
        ..Default::default()
    });
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The bytes on the wire are part of the contract: a change here breaks deployed clients.
#[test]
fn golden_bytes() {
    let reply = GenerateReply::Accepted {
        request_id: "r1".into(),
        stream_subject: "s".into(),
        tool_syntax: None,
        job_seq: None,
    };
    assert_eq!(
        hex(&encode(&reply).unwrap()),
        "83a474797065a86163636570746564aa726571756573745f6964a27231ae73747265616d5f7375626a656374a173"
    );
    let ev = StreamEvent {
        request_id: "r".into(),
        seq: 1,
        event: Event::PrefillProgress { done: 2, total: 3 },
        choice: 0,
    };
    assert_eq!(
        hex(&encode(&ev).unwrap()),
        "83aa726571756573745f6964a172a373657101a56576656e7483a474797065b070726566696c6c5f70726f6772657373a4646f6e6502a5746f74616c03"
    );
    let cancel = Cancel {
        request_id: "abc".into(),
    };
    assert_eq!(
        hex(&encode(&cancel).unwrap()),
        "81aa726571756573745f6964a3616263"
    );
}

#[test]
fn named_fields_tolerate_additions_and_omissions() {
    // A newer client sends a field this version does not know; an older one omits optional ones.
    #[derive(serde::Serialize)]
    struct Newer<'a> {
        model: &'a str,
        prompt: &'a str,
        shiny_new_option: u32,
    }
    let bytes = encode(&Newer {
        model: "m",
        prompt: "p",
        shiny_new_option: 1,
    })
    .unwrap();
    let req: GenerateRequest = decode(&bytes).unwrap();
    assert_eq!(req.model, "m");
    assert_eq!(req.prompt.as_deref(), Some("p"));
    assert_eq!(req.max_tokens, None);
}

#[test]
fn garbage_and_oversized_payloads_are_errors() {
    assert!(matches!(
        decode::<GenerateRequest>(b"\xc1\xff not msgpack"),
        Err(ProtocolError::Decode(_))
    ));
    assert!(matches!(
        decode::<Cancel>(&[]),
        Err(ProtocolError::Decode(_))
    ));
    let big = vec![0u8; MAX_MESSAGE_BYTES + 1];
    assert!(matches!(
        decode::<Cancel>(&big),
        Err(ProtocolError::TooLarge(_))
    ));
    let huge = GenerateRequest {
        prompt: Some("x".repeat(MAX_MESSAGE_BYTES)),
        ..Default::default()
    };
    assert!(matches!(encode(&huge), Err(ProtocolError::TooLarge(_))));
}

#[test]
fn subjects() {
    assert_eq!(subjects::stream("abc"), "llm.v1.stream.abc");
    assert_eq!(subjects::worker_status("w-1"), "llm.v1.worker.w-1.status");
    assert_eq!(
        subjects::jobs("Qwen/Qwen3 0.6B"),
        "llm.v1.jobs.Qwen_Qwen3_0_6B"
    );
    assert!(subjects::is_valid_stream_subject("_INBOX.x1.y2"));
    for bad in ["", "a..b", "a.*", "a.>", "a b"] {
        assert!(!subjects::is_valid_stream_subject(bad), "{bad:?}");
    }
}
