//! Prefill on a fake executor with a fake clock: the decode batch steps every tick while one
//! chunk advances, the order of prompts, chunks in flight, on the grid and sized to the tick
//! budget.

use std::collections::HashSet;
use std::time::Duration;

use llmq_protocol::{ErrorClass, Event};
use llmq_scheduler::*;

mod common;

use common::*;

#[test]
fn decode_steps_every_tick_while_a_competing_prefill_advances_one_chunk_per_tick() {
    let mut h = Harness::new(cfg());
    h.submit(1, 10, 1000);
    h.tick(); // idle: prompt 1 prefilled whole, first token
    h.submit(2, 5000, 4);
    for i in 0..19 {
        let rep = h.tick_streaming(1, i);
        assert_eq!(rep.prefill_request, Some(2));
        assert_eq!(rep.prefill_tokens, 256, "tick {i}: one chunk of 256");
    }
    let progress: Vec<(u32, u32)> = h
        .of(2)
        .iter()
        .filter_map(|e| {
            if let Event::PrefillProgress { done, total } = e {
                Some((*done, *total))
            } else {
                None
            }
        })
        .collect();
    assert_eq!(progress.len(), 19);
    assert_eq!(progress[0], (256, 5000));
}

#[test]
fn idle_engine_prefills_in_large_steps() {
    let mut h = Harness::new(cfg());
    h.submit(1, 10000, 2);
    let (_, rep) = h.tick();
    assert_eq!(rep.prefill_tokens, 4096);
    let (_, rep) = h.tick();
    assert_eq!(rep.prefill_tokens, 4096);
    let (_, rep) = h.tick();
    assert_eq!(rep.prefill_tokens, 10000 - 8192);
    h.run_until_idle(10);
    h.assert_all_ended(&[1]);
}

#[test]
fn three_prompts_arriving_together_prefill_one_at_a_time() {
    let mut h = Harness::new(cfg());
    h.submit(9, 4, 500); // a decoding stream, so chunks are small
    h.tick();
    for id in 1..=3 {
        h.submit(id, 1000, 3);
    }
    while !h.s.is_idle() && h.reports.len() < 500 {
        let (ev, rep) = h.tick();
        let prefilling: HashSet<ReqId> = ev
            .iter()
            .filter(|e| matches!(e.event, Event::PrefillProgress { .. }))
            .map(|e| e.id)
            .collect();
        assert!(
            prefilling.len() <= 1,
            "two prefills advanced in one tick: {prefilling:?}"
        );
        assert!(rep.prefill_tokens <= 256);
        if (1..=3).all(|id| h.of(id).iter().any(|e| e.is_terminal())) {
            h.s.cancel(9);
        }
    }
    // One prompt is finished before the next starts: no interleaving between prefills.
    let order: Vec<ReqId> =
        h.e.prefill_calls
            .iter()
            .map(|c| c.0)
            .filter(|&id| id != 9)
            .collect();
    let mut firsts: Vec<ReqId> = order.clone();
    firsts.dedup();
    assert_eq!(firsts.len(), 3, "prefills interleaved: {order:?}");
    h.assert_all_ended(&[1, 2, 3, 9]);
}

#[test]
fn progress_is_monotonic_and_ends_at_the_total() {
    let mut h = Harness::new(cfg());
    h.submit(1, 3, 100);
    h.tick();
    h.submit(2, 1234, 2);
    h.run_until_idle_or(|h| h.of(2).iter().any(|e| e.is_terminal()), 100);
    let mut last = 0;
    let mut seen = vec![];
    for e in h.of(2) {
        if let Event::PrefillProgress { done, total } = e {
            assert!(*done > last && *total == 1234);
            last = *done;
            seen.push(*done);
        }
    }
    assert_eq!(last, 1234);
    assert_eq!(seen.len(), 5); // 4 x 256 + 210
}

#[test]
fn joins_the_decode_batch_at_the_next_tick() {
    let mut h = Harness::new(cfg());
    h.submit(1, 5, 100);
    h.tick();
    h.submit(2, 100, 100);
    h.tick(); // decodes [1], prefills 2 completely (100 < 256), first token of 2
    assert_eq!(h.e.decode_calls.last().unwrap(), &vec![1]);
    h.tick();
    assert_eq!(h.e.decode_calls.last().unwrap(), &vec![1, 2]);
}

#[test]
fn short_prompts_do_not_wait_behind_a_long_one_and_the_long_one_is_not_starved() {
    let mut h = Harness::new(SchedulerConfig {
        aging_tokens_per_s: 1000.0,
        ..cfg()
    });
    h.submit(100, 4, 10_000); // a decoding stream
    h.tick();
    h.submit(1, 8192, 2);
    for id in 2..=5 {
        h.submit(id, 200, 2);
    }
    let first_token_tick = |h: &Harness, id: ReqId| {
        let mut tick = 0;
        let mut n = 0;
        for e in &h.events {
            if let (true, Event::PrefillProgress { done, total }) = (e.id == id, &e.event) {
                n += 1;
                if done == total {
                    tick = n;
                }
            }
        }
        tick
    };
    h.run_until_idle_or(|h| h.of(1).iter().any(|e| e.is_terminal()), 1000);
    for id in 2..=5 {
        assert_eq!(
            first_token_tick(&h, id),
            1,
            "short prompt {id} prefilled in one tick"
        );
        assert!(h.of(id).iter().any(|e| e.is_terminal()));
    }
    // The shorts went first: the long prompt's first chunk came after all four.
    let first_long = h.e.prefill_calls.iter().position(|c| c.0 == 1).unwrap();
    let last_short =
        h.e.prefill_calls
            .iter()
            .rposition(|c| (2..=5).contains(&c.0))
            .unwrap();
    assert!(first_long > last_short, "{:?}", h.e.prefill_calls);

    // Aging: while the long prompt is mid-way, a stream of new short prompts does not stop it.
    let mut h = Harness::new(SchedulerConfig {
        aging_tokens_per_s: 1000.0,
        ..cfg()
    });
    h.submit(100, 4, 100_000);
    h.tick();
    h.submit(1, 8192, 2);
    for next in 2..402 {
        h.submit(next, 300, 1);
        h.tick();
        if h.of(1).iter().any(|e| e.is_terminal()) {
            break;
        }
    }
    assert!(
        h.of(1).iter().any(|e| e.is_terminal()),
        "the long prompt starved"
    );
}

#[test]
fn synchronous_baseline_prefills_whole_prompts() {
    let mut h = Harness::new(SchedulerConfig {
        interleave: false,
        ..cfg()
    });
    h.submit(1, 4, 100);
    h.tick();
    h.submit(2, 9000, 2);
    let (_, rep) = h.tick();
    assert_eq!(rep.prefill_tokens, 9000);
}

#[test]
fn a_first_token_deferred_to_the_next_decode_step() {
    let mut h = Harness::new(cfg());
    h.e.defer_first = true;
    h.submit(1, 5, 100);
    h.tick(); // idle: prompt 1 complete, no token yet
    assert!(!h.of(1).iter().any(|e| matches!(e, Event::Tokens { .. })));
    h.tick(); // its first decode step gives its first token
    assert_eq!(h.e.decode_calls.last().unwrap(), &vec![1]);
    assert!(matches!(h.of(1).last().unwrap(), Event::Tokens { ids, .. } if ids == &vec![1]));
    // Two more: one that needs a single token, one cancelled between its prompt's completion
    // and its first token.
    h.submit(2, 300, 1);
    h.submit(3, 20, 50);
    let until_complete = |h: &mut Harness, id: ReqId| {
        for _ in 0..10 {
            h.tick();
            if h.of(id)
                .iter()
                .any(|e| matches!(e, Event::PrefillProgress { done, total } if done == total))
            {
                return;
            }
        }
        panic!("prompt {id} not complete");
    };
    until_complete(&mut h, 3);
    h.s.cancel(3);
    until_complete(&mut h, 2);
    h.run_until_idle(200);
    h.assert_all_ended(&[1, 2, 3]);
    assert!(
        !h.of(3).iter().any(|e| matches!(e, Event::Tokens { .. })),
        "cancelled before its first token"
    );
    assert!(
        matches!(h.of(3).last().unwrap(), Event::Error { error } if error.class == ErrorClass::Cancelled)
    );
    match h.of(2)[..] {
        [.., Event::Tokens { ids, .. }, Event::Done { usage, timings, .. }] => {
            assert_eq!((ids.clone(), usage.completion), (vec![1], 1));
            assert!(
                timings.ttft_ms > 0.0,
                "the first token came a tick after the prompt"
            );
        }
        ref ev => panic!("{ev:?}"),
    }
    for id in [1, 2] {
        match h.of(id).last().unwrap() {
            Event::Done { usage, .. } => assert_eq!(usage.completion as usize, h.e.max_tokens[&id]),
            e => panic!("{e:?}"),
        }
    }
}

/// An executor that spreads each chunk's layers over two ticks: the stream decodes every tick,
/// the chunk in flight is granted again until it is done (a shorter prompt arriving meanwhile
/// waits for it), progress comes once per chunk, and the results match whole chunks.
#[test]
fn a_chunk_in_flight_is_granted_again_until_done() {
    let mut h = Harness::new(cfg());
    h.e.stages = 2;
    h.submit(1, 10, 40);
    h.tick(); // idle: prompt 1 prefilled whole, first token
    h.submit(2, 1000, 4);
    for i in 0..3 {
        h.tick_streaming(1, i);
    }
    // Mid-chunk (its first stage ran), a short prompt arrives: shortest-first would pick it,
    // but the chunk in flight finishes first.
    h.submit(3, 20, 2);
    h.run_until_idle(200);
    let g = &h.e.grants;
    for w in g.windows(2) {
        if w[0].2 {
            assert_eq!(
                (w[1].0, w[1].1),
                (w[0].0, w[0].1),
                "a pending chunk is granted again, unchanged: {g:?}"
            );
        }
    }
    let first_3 = g
        .iter()
        .position(|x| x.0 == 3)
        .expect("3 prefilled beside the stream");
    assert!(
        !g[first_3 - 1].2,
        "3's chunk starts only after 2's in-flight chunk is done: {g:?}"
    );
    let progress: Vec<u32> = h
        .of(2)
        .iter()
        .filter_map(|e| {
            if let Event::PrefillProgress { done, .. } = e {
                Some(*done)
            } else {
                None
            }
        })
        .collect();
    assert_eq!(
        progress,
        vec![256, 512, 768, 1000],
        "one progress event per chunk, when done"
    );
    h.assert_all_ended(&[1, 2, 3]);
}

/// A prompt whose prefix was cached off the chunk grid gets a shorter first chunk beside a
/// decoding stream, which brings it back onto the grid; every later chunk is whole and ends on
/// it. The idle fast path takes no such detour.
#[test]
fn a_prefix_hit_off_the_chunk_grid_is_brought_back_onto_it() {
    let mut h = Harness::new(cfg());
    h.submit(1, 10, 40);
    h.tick(); // idle: prompt 1 prefilled whole
    h.e.cached.insert(2, 100);
    h.submit(2, 1000, 4);
    h.run_until_idle(200);
    let chunks: Vec<usize> =
        h.e.prefill_calls
            .iter()
            .filter(|c| c.0 == 2)
            .map(|c| c.1)
            .collect();
    assert_eq!(
        chunks,
        vec![156, 256, 256, 232],
        "100 cached: 156 to reach 256, then the grid"
    );
    h.assert_all_ended(&[1, 2]);

    let mut h = Harness::new(cfg());
    h.e.cached.insert(1, 100);
    h.submit(1, 1000, 4);
    h.tick();
    assert_eq!(
        h.e.prefill_calls,
        vec![(1, 900)],
        "idle: the rest of the prompt at once"
    );
}

/// With `last_token_apart` (a hybrid model's executor keeps its states one token before a
/// prompt's end), the chunk that would end a prompt ends one token short and the last token
/// comes alone, whether the prompt is prefilled idle, beside a decoding stream, after a prefix
/// hit or not interleaved; a one-token prompt (or rest) is still one chunk.
#[test]
fn a_prompt_s_last_token_comes_in_a_chunk_of_its_own() {
    let apart = || SchedulerConfig {
        last_token_apart: true,
        ..cfg()
    };
    let chunks = |h: &Harness, id: ReqId| -> Vec<usize> {
        h.e.prefill_calls
            .iter()
            .filter(|c| c.0 == id)
            .map(|c| c.1)
            .collect()
    };
    let mut h = Harness::new(apart());
    h.submit(1, 10, 40);
    h.tick();
    h.tick();
    assert_eq!(chunks(&h, 1), vec![9, 1], "idle");
    h.submit(2, 600, 4);
    h.e.cached.insert(3, 599);
    h.submit(3, 600, 4);
    h.submit(4, 1, 4);
    h.run_until_idle(200);
    assert_eq!(chunks(&h, 2), vec![256, 256, 87, 1], "beside a stream");
    assert_eq!(chunks(&h, 3), vec![1], "all but the last token cached");
    assert_eq!(chunks(&h, 4), vec![1], "a one-token prompt");
    h.assert_all_ended(&[1, 2, 3, 4]);

    let mut h = Harness::new(SchedulerConfig {
        interleave: false,
        ..apart()
    });
    h.submit(1, 5000, 4);
    h.run_until_idle(20);
    assert_eq!(chunks(&h, 1), vec![4999, 1], "not interleaved");
    h.assert_all_ended(&[1]);
}

/// With a tick budget, chunks beside a decoding stream are sized to keep a tick within the
/// budget times a decode-only tick, from measured times: the first chunk (nothing measured yet)
/// is the smallest, and every tick stays within the budget; when chunks get cheaper they grow
/// back, each size starting on its own grid; the prompt still completes, one chunk per tick.
#[test]
fn chunks_are_sized_to_the_tick_budget() {
    let mut h = Harness::new(SchedulerConfig {
        tick_budget: 2.0,
        min_prefill_chunk: 64,
        ..cfg()
    });
    h.submit(1, 10, 10_000);
    h.tick(); // idle: prompt 1 prefilled whole
    for i in 0..5 {
        h.tick_streaming(1, i); // decode-only ticks: 10 ms
    }
    h.submit(2, 6000, 4);
    let mut grants = vec![];
    for i in 0..30 {
        let rep = h.tick_streaming(1, i);
        assert_eq!(rep.prefill_request, Some(2));
        grants.push(rep.prefill_tokens);
    }
    // 0.1 ms a token: 256 tokens take 25.6 ms beyond the 10 ms step; 10 ms of room fits 64.
    assert_eq!(grants[0], 64, "nothing measured yet: {grants:?}");
    assert!(grants.iter().all(|&n| n == 64), "{grants:?}");
    let last = h.ticks.len();
    assert!(
        h.ticks[last - 30..]
            .iter()
            .all(|t| *t <= Duration::from_millis(20)),
        "{:?}",
        &h.ticks[last - 30..]
    );

    // Cheaper chunks (0.02 ms a token): they grow back to 256, each size on its own grid.
    h.per_token = Duration::from_micros(20);
    let mut prefilled = 30 * 64;
    let mut sizes = vec![];
    while h.s.active_streams() == 1 && sizes.len() < 100 {
        let rep = h.tick_streaming(1, 0);
        if rep.prefill_tokens == 0 {
            break;
        }
        let n = rep.prefill_tokens;
        assert!(
            n == 6000 - prefilled || prefilled % n == 0,
            "a {n}-token chunk at {prefilled}: {sizes:?}"
        );
        prefilled += n;
        sizes.push(n);
    }
    assert_eq!(prefilled, 6000, "{sizes:?}");
    assert!(
        sizes.windows(2).any(|w| w == [256, 256]),
        "back to whole chunks: {sizes:?}"
    );
    h.run_until_idle(20_000);
    h.s.cancel(1);
    h.run_until_idle(10);
    assert_eq!(h.s.held_kv_bytes(), 0);
}
