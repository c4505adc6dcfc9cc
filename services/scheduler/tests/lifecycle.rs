//! A request's life in the scheduler on a fake executor: admission against the KV budget and the
//! batch limit, static batching, cancels and ends, usage and timings.

use llmq_protocol::{ErrorClass, Event, FinishReason, WireError};
use llmq_scheduler::*;

mod common;

use common::*;

#[test]
fn cancel_while_queued_mid_prefill_and_decoding_frees_everything() {
    let mut h = Harness::new(SchedulerConfig {
        kv_budget_bytes: 3000,
        ..cfg()
    });
    h.submit(1, 10, 40); // decoding
    h.tick();
    h.submit(2, 1000, 10); // prefilling (chunks of 256)
    h.submit(3, 2000, 10); // must wait: 1 + 63 + 126 blocks > 187
    h.submit(4, 10, 20); // behind 3 in the queue
    h.tick();
    assert!(h.of(3).iter().any(|e| matches!(e, Event::Queued { .. })));
    h.tick();
    assert!(matches!(
        h.of(2).last(),
        Some(Event::PrefillProgress { done: 512, .. })
    ));
    h.s.cancel(3); // queued
    h.s.cancel(2); // mid-prefill
    h.s.cancel(1); // decoding
    let (ev, _) = h.tick();
    for id in [1, 2, 3] {
        let t: Vec<_> = ev.iter().filter(|e| e.id == id).collect();
        assert!(
            matches!(&t[0].event, Event::Error { error } if error.class == ErrorClass::Cancelled),
            "{id}: {t:?}"
        );
    }
    h.run_until_idle(100);
    assert!(
        matches!(h.of(4).last(), Some(Event::Done { .. })),
        "request 4 unaffected"
    );
    h.assert_all_ended(&[1, 2, 3, 4]);
    assert!(!h.s.cancel(4), "nothing to cancel after the end");
}

/// A stopping worker ends everything it holds at the next tick, queued, mid-prefill and
/// decoding alike, with its own error; a request the client cancelled first keeps `cancelled`.
#[test]
fn end_all_ends_every_request_once_with_its_error() {
    let mut h = Harness::new(SchedulerConfig {
        kv_budget_bytes: 3000,
        ..cfg()
    });
    h.submit(1, 10, 40); // decoding
    h.tick();
    h.submit(2, 1000, 10); // prefilling
    h.submit(3, 2000, 10); // queued: does not fit beside 1 and 2
    h.tick();
    h.s.cancel(1);
    h.s.end_all(&WireError::new(ErrorClass::WorkerLost, "stopping"));
    let (ev, rep) = h.tick();
    assert_eq!(
        (rep.decoded, rep.prefill_tokens),
        (0, 0),
        "nothing runs after the end"
    );
    let class = |id: ReqId| match ev.iter().find(|e| e.id == id).map(|e| &e.event) {
        Some(Event::Error { error }) => error.class,
        other => panic!("request {id}: {other:?}"),
    };
    assert_eq!(class(1), ErrorClass::Cancelled);
    assert_eq!(
        (class(2), class(3)),
        (ErrorClass::WorkerLost, ErrorClass::WorkerLost)
    );
    assert!(h.s.is_idle());
    h.tick();
    h.assert_all_ended(&[1, 2, 3]);
}

#[test]
fn the_pool_admits_by_prompt_and_refuses_prompts_that_never_fit() {
    // 1000 bytes at 1 byte a token: 62 blocks of 16 positions.
    let mut h = Harness::new(SchedulerConfig {
        kv_budget_bytes: 1000,
        ..cfg()
    });
    assert_eq!(h.s.pool().total(), 62);
    h.submit(1, 600, 100); // 602 positions: 38 blocks
    h.submit(2, 400, 100); // 26 more blocks than the 24 left: waits
    h.submit(3, 1000, 10); // 63 blocks > 62: never fits
    assert!(matches!(h.of(3)[0], Event::Error { error } if error.class == ErrorClass::NeverFits));
    assert!(matches!(h.of(2)[0], Event::Queued { position: 1 }));
    h.tick();
    assert!(matches!(
        h.of(2).last(),
        Some(Event::Queued { position: 0 })
    ));
    assert_eq!(h.s.pool().used(), 38);
    h.run_until_idle(2000);
    h.assert_all_ended(&[1, 2, 3]);
    assert!(h.e.preempted.is_empty());
}

#[test]
fn max_batch_limits_running_sequences() {
    let mut h = Harness::new(SchedulerConfig {
        max_batch: 2,
        ..cfg()
    });
    for id in 1..=4 {
        h.submit(id, 5, 10);
    }
    for _ in 0..8 {
        h.tick();
        assert!(h.s.active_streams() <= 2);
        assert!(h.e.decode_calls.last().map_or(0, |c| c.len()) <= 2);
    }
    h.run_until_idle(100);
    h.assert_all_ended(&[1, 2, 3, 4]);
}

#[test]
fn done_reports_usage_and_timings() {
    let mut h = Harness::new(cfg());
    h.submit(1, 300, 3);
    h.run_until_idle(10);
    match h.of(1).last().unwrap() {
        Event::Done {
            finish_reason,
            usage,
            timings,
        } => {
            assert_eq!(*finish_reason, FinishReason::Length);
            assert_eq!((usage.prompt, usage.completion, usage.cached), (300, 3, 0));
            assert!(timings.ttft_ms >= timings.queue_ms && timings.total_ms >= timings.ttft_ms);
            assert!(timings.total_ms > 0.0);
        }
        e => panic!("{e:?}"),
    }
}

#[test]
fn static_batching_admits_a_new_batch_only_when_the_last_one_finished() {
    let mut h = Harness::new(SchedulerConfig {
        continuous: false,
        ..cfg()
    });
    h.submit(1, 5, 10);
    h.tick();
    h.submit(2, 5, 10);
    for _ in 0..8 {
        h.tick();
        assert!(
            h.of(2).iter().all(|e| matches!(e, Event::Queued { .. })),
            "2 waits for 1's batch"
        );
    }
    h.run_until_idle(100);
    h.assert_all_ended(&[1, 2]);
}

#[test]
fn a_stopping_worker_takes_back_only_what_has_not_started() {
    let mut h = Harness::new(SchedulerConfig {
        max_batch: 2,
        ..cfg()
    });
    for id in 1..=5 {
        h.submit(id, 5, 10);
    }
    h.tick();
    assert_eq!(h.s.active_streams() + h.s.queued_requests(), 5);
    h.s.cancel(5);
    // 1 and 2 run; 3 and 4 have had only `Queued`: they go back; 5 ends with its cancel.
    assert_eq!(h.s.take_waiting(), vec![3, 4]);
    assert!(h
        .of(3)
        .into_iter()
        .chain(h.of(4))
        .all(|e| matches!(e, Event::Queued { .. })));
    let before = (h.of(3).len(), h.of(4).len());
    h.run_until_idle(100);
    h.assert_all_ended(&[1, 2, 5]);
    assert_eq!(
        (h.of(3).len(), h.of(4).len()),
        before,
        "nothing more for the requests taken back"
    );
    assert_eq!(h.s.held_kv_bytes(), 0);
}

/// Samples of one prompt: the others wait for the first one's prompt (its KV is then cached)
/// without holding up a request behind them, and go back to the jobs stream only with it.
#[test]
fn samples_wait_for_their_first_sample_s_prompt() {
    let mut h = Harness::new(SchedulerConfig {
        prefill_chunk: 4,
        idle_prefill_chunk: 4,
        ..cfg()
    });
    h.submit(1, 12, 5);
    h.submit_after(2, 12, 5, Some(1));
    h.submit_after(3, 12, 5, Some(1));
    h.submit(4, 3, 5);
    let mut first_token_of_1 = None;
    let mut admitted = std::collections::HashMap::new();
    for tick in 0..40 {
        h.tick();
        if first_token_of_1.is_none() && h.of(1).iter().any(|e| matches!(e, Event::Tokens { .. })) {
            first_token_of_1 = Some(tick);
        }
        for id in [2, 3, 4] {
            if !admitted.contains_key(&id)
                && h.of(id)
                    .iter()
                    .any(|e| matches!(e, Event::PrefillProgress { .. } | Event::Tokens { .. }))
            {
                admitted.insert(id, tick);
            }
        }
        if h.s.is_idle() {
            break;
        }
    }
    let first = first_token_of_1.expect("1 decoded");
    assert!(admitted[&2] >= first && admitted[&3] >= first, "samples started before the first one's prompt was complete: {admitted:?}, first token at {first}");
    assert!(
        admitted[&4] < first,
        "the request behind the samples was held up: {admitted:?}"
    );
    h.assert_all_ended(&[1, 2, 3, 4]);

    // Handed back: samples waiting on a running first sample stay; with it waiting, all go.
    let mut h = Harness::new(SchedulerConfig {
        max_batch: 1,
        ..cfg()
    });
    h.submit(1, 5, 10);
    h.submit_after(2, 5, 10, Some(1));
    h.submit(3, 5, 10);
    h.submit_after(4, 5, 10, Some(3));
    h.tick();
    assert_eq!(
        h.s.take_waiting(),
        vec![3, 4],
        "1 runs: its sample 2 stays with it"
    );
    h.run_until_idle(100);
    h.assert_all_ended(&[1, 2]);
}
