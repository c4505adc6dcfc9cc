//! The KV block pool on a fake executor and a fake clock: admission by what a prompt needs,
//! tables that grow a block at a time, preemption of the youngest request when the pool runs
//! out, and resumption with the same tokens; and the pool's books under random interleavings of
//! submits, cancels and ticks.

use llmq_protocol::{Event, FinishReason};
use llmq_scheduler::blocks::BlockPool;
use llmq_scheduler::*;

mod common;

use common::*;

/// 16-position blocks, `blocks` of them.
fn pool_of(blocks: u64) -> SchedulerConfig {
    SchedulerConfig {
        kv_budget_bytes: blocks * 16,
        ..cfg()
    }
}

/// The token ids `id` received, in order.
fn tokens(h: &Harness, id: ReqId) -> Vec<u32> {
    h.of(id)
        .iter()
        .filter_map(|e| match e {
            Event::Tokens { ids, .. } => Some(ids.clone()),
            _ => None,
        })
        .flatten()
        .collect()
}

/// Every request got each of its tokens once, in order (the fake numbers them 1, 2, ...), and
/// the events of its stream after its first token are tokens and its end only.
fn assert_streams_whole(h: &Harness, ids: &[ReqId], max_tokens: usize) {
    for &id in ids {
        let got = tokens(h, id);
        assert_eq!(got, (1..=max_tokens as u32).collect::<Vec<_>>(), "{id}");
        let ev = h.of(id);
        let first = ev
            .iter()
            .position(|e| matches!(e, Event::Tokens { .. }))
            .unwrap();
        assert!(
            ev[first..]
                .iter()
                .all(|e| matches!(e, Event::Tokens { .. } | Event::Done { .. })),
            "{id}: {ev:?}"
        );
    }
}

#[test]
fn requests_are_admitted_for_their_prompt_not_their_max_tokens() {
    // 20 blocks: 8 prompts of 16 tokens take 2 blocks each with the lookahead and their first
    // tokens; reserving their max_tokens would admit none.
    let mut h = Harness::new(pool_of(20));
    for id in 1..=8 {
        h.submit(id, 16, 4096);
    }
    let mut peak = 0;
    for _ in 0..12 {
        h.tick();
        peak = peak.max(h.s.active_streams());
        h.s.pool().check().unwrap();
    }
    assert_eq!(peak, 8, "every request decodes at once");
    assert_eq!(h.s.pool().used(), 16);
    // As they grow, the youngest give way and the pool is never overdrawn.
    for _ in 0..200 {
        h.tick();
        assert!(h.s.pool().used() <= 20);
    }
    assert!(!h.e.preempted.is_empty());
}

#[test]
fn recurrent_states_hold_blocks_beside_the_tokens() {
    // 20 blocks; a sequence's recurrent state counts as 30 positions: each prompt of 16 then
    // takes 16 + 2 + 30 positions (3 blocks), so 6 run at once, not 8 as without states.
    let mut h = Harness::new(SchedulerConfig {
        state_tokens: 30,
        ..pool_of(20)
    });
    for id in 1..=8 {
        h.submit(id, 16, 4);
    }
    h.tick();
    assert_eq!(h.s.pool().used(), 18);
    assert_eq!(h.s.pool().holders().count(), 6);
    for _ in 0..40 {
        h.tick();
        h.s.pool().check().unwrap();
    }
    assert!(h.s.is_idle());
    assert_eq!(h.s.pool().used(), 0, "every state's blocks came back");
    // A prompt whose tokens fit the pool (320 positions) but not with its state is refused at
    // once.
    let mut h = Harness::new(SchedulerConfig {
        state_tokens: 310,
        ..pool_of(20)
    });
    h.submit(1, 16, 4);
    h.tick();
    assert!(
        matches!(h.of(1).last(), Some(Event::Error { .. })),
        "{:?}",
        h.of(1)
    );
}

#[test]
fn a_pool_too_small_for_all_finishes_them_all_in_arrival_order() {
    // 12 blocks; each request alone needs 20 + 60 + 2 positions (6 blocks) at its end.
    let mut h = Harness::new(pool_of(12));
    let ids: Vec<ReqId> = (1..=6).collect();
    for &id in &ids {
        h.submit(id, 20, 60);
    }
    for _ in 0..5000 {
        if h.s.is_idle() {
            break;
        }
        h.tick();
        h.s.pool().check().unwrap();
        assert!(h.s.pool().used() <= 12);
    }
    h.assert_all_ended(&ids);
    assert!(!h.e.preempted.is_empty(), "the pool ran out");
    assert_streams_whole(&h, &ids, 60);
    let done: Vec<ReqId> = h
        .events
        .iter()
        .filter(|e| matches!(e.event, Event::Done { .. }))
        .map(|e| e.id)
        .collect();
    assert_eq!(done, ids, "finished in arrival order");
    for &id in &ids {
        assert!(matches!(
            h.of(id).last(),
            Some(Event::Done {
                finish_reason: FinishReason::Length,
                usage,
                ..
            }) if usage.prompt == 20 && usage.completion == 60
        ));
    }
}

#[test]
fn a_preempted_request_resumes_from_its_prompt_and_tokens() {
    let mut h = Harness::new(pool_of(8));
    h.submit(1, 40, 60); // at its end: 102 positions, 7 blocks
    h.tick();
    h.submit(2, 30, 60); // at most 92 positions, 6 blocks: both cannot grow to their ends
    h.run_until_idle(2000);
    h.assert_all_ended(&[1, 2]);
    assert_eq!(h.e.preempted, vec![2], "the younger one gives way");
    // Request 2 is prefilled again over its prompt and the tokens it had when preempted.
    let resumed = h.e.resume[&2];
    assert!(resumed > 30, "{resumed}");
    let prefilled: usize =
        h.e.prefill_calls
            .iter()
            .filter(|(id, _)| *id == 2)
            .map(|(_, n)| n)
            .sum();
    assert_eq!(prefilled, 30 + resumed);
    assert_streams_whole(&h, &[1], 60);
    assert_streams_whole(&h, &[2], 60);
}

#[test]
fn a_request_alone_that_outgrows_the_pool_ends_with_length() {
    let mut h = Harness::new(pool_of(4)); // 64 positions
    h.submit(1, 10, 1000);
    h.run_until_idle(200);
    h.assert_all_ended(&[1]);
    let got = tokens(&h, 1);
    // The step writes its token's KV at position 10 + n - 1; the lookahead holds two more.
    assert_eq!(got.len(), 64 - 10 - 2 + 1);
    assert!(matches!(
        h.of(1).last(),
        Some(Event::Done {
            finish_reason: FinishReason::Length,
            ..
        })
    ));
}

/// A tiny deterministic generator, so that a failing interleaving can be replayed by its seed.
struct Lcg(u64);
impl Lcg {
    fn next(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n.max(1)
    }
}

#[test]
fn random_interleavings_keep_the_books_and_end_every_request_once() {
    let mut preemptions = 0;
    for seed in 0..200u64 {
        let mut r = Lcg(seed);
        let blocks = 6 + r.next(30);
        let mut h = Harness::new(SchedulerConfig {
            max_batch: 1 + r.next(8) as usize,
            prefill_chunk: 8 + r.next(40) as usize,
            ..pool_of(blocks)
        });
        let mut ids = vec![];
        let mut wants = vec![];
        for step in 0..300 {
            match r.next(10) {
                0..=2 if ids.len() < 40 => {
                    let id = ids.len() as ReqId + 1;
                    let (prompt, max) = (1 + r.next(80) as usize, 1 + r.next(120) as usize);
                    h.submit(id, prompt, max);
                    ids.push(id);
                    wants.push(max);
                }
                3 if !ids.is_empty() => {
                    let id = ids[r.next(ids.len() as u64) as usize];
                    h.s.cancel(id);
                }
                _ => {
                    h.tick();
                }
            }
            h.s.pool()
                .check()
                .unwrap_or_else(|e| panic!("seed {seed}, step {step}: {e}"));
            assert!(h.s.pool().used() as u64 <= blocks);
        }
        h.run_until_idle(20_000);
        h.assert_all_ended(&ids);
        for (&id, &max) in ids.iter().zip(&wants) {
            // Whatever the preemptions, a stream's tokens never repeat and never skip.
            let got = tokens(&h, id);
            assert!(got.len() <= max, "seed {seed}: {id}");
            assert_eq!(
                got,
                (1..=got.len() as u32).collect::<Vec<_>>(),
                "seed {seed}: {id}"
            );
        }
        preemptions += h.e.preempted.len();
    }
    assert!(
        preemptions > 100,
        "the pools were small enough to preempt: {preemptions}"
    );
}

#[test]
fn the_pool_s_books_hold_under_random_operations() {
    for seed in 0..500u64 {
        let mut r = Lcg(seed);
        let total = 1 + r.next(40) as usize;
        let mut p = BlockPool::new(total, 1 + r.next(32) as usize);
        for _ in 0..200 {
            let id = r.next(8);
            if r.next(3) == 0 {
                let before = p.free();
                let held = p.table(id).len();
                assert_eq!(p.release(id), held);
                assert_eq!(p.free(), before + held);
            } else {
                let tokens = r.next(20 * p.block_tokens() as u64) as usize;
                let (free, held) = (p.free(), p.table(id).len());
                match p.reserve(id, tokens) {
                    Ok(added) => {
                        let added = added.len();
                        assert_eq!(p.free(), free - added);
                        assert!(p.capacity(id) >= tokens);
                        assert_eq!(p.table(id).len(), held + added);
                    }
                    Err(short) => {
                        assert!(short.needed > short.free);
                        assert_eq!(p.free(), free, "nothing taken");
                    }
                }
            }
            p.check().unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        }
        let ids: Vec<_> = p.holders().collect();
        for id in ids {
            p.release(id);
        }
        assert_eq!(p.free(), total, "seed {seed}: every block back");
        p.check().unwrap();
    }
}
