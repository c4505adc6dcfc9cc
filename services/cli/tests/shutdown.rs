//! Graceful stops through a real nats-server and real processes: a worker sent SIGTERM takes no
//! more jobs, finishes the streams it holds and exits; past its grace period it ends what is
//! left with `worker_lost`, once, and no other worker runs those jobs again.

use std::time::Duration;

use futures::StreamExt;
use llmq_protocol::*;

mod common;

use common::client::*;
use common::*;

/// Reads `sub` until its first `Tokens` event.
async fn until_tokens(sub: &mut async_nats::Subscriber) -> Vec<StreamEvent> {
    let mut seen = vec![];
    loop {
        let m = tokio::time::timeout(Duration::from_secs(30), sub.next())
            .await
            .expect("an event within 30 s")
            .unwrap();
        let ev: StreamEvent = decode(&m.payload).unwrap();
        let tokens = matches!(ev.event, Event::Tokens { .. });
        seen.push(ev);
        if tokens {
            return seen;
        }
    }
}

#[test]
fn a_stopped_worker_finishes_its_streams_takes_no_new_jobs_and_exits() {
    let mut stack = Stack::nats_only();
    stack.spawn("intake", &[]);
    let first = stack.spawn("worker", &[]);
    rt().block_on(async {
        let c = Client::connect(&stack.url).await;
        let long = GenerateRequest {
            ignore_eos: true,
            ..req("a long one", 300)
        };
        let (id, mut sub) = c.start(long).await;
        let mut events = until_tokens(&mut sub).await;
        stack.terminate(first);
        // Past the fetch the worker may have had under way (0.1 s at most), a new job waits
        // in the stream for another worker.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let (id2, mut sub2) = c.start(req("Paris is", 6)).await;
        let rest = Client::finish(id, sub, |_| {}).await;
        events.extend(rest.events);
        let run = Run {
            id: rest.id,
            events,
        };
        assert!(
            matches!(run.last(), Event::Done { .. }),
            "the held stream completes: {:?}",
            run.last()
        );
        assert_eq!(run.tokens().len(), 300);
        let status = stack
            .wait_exit(first, Duration::from_secs(20))
            .expect("the worker exits once drained");
        assert!(status.success(), "{status:?}");
        // The job sent after the stop ran nowhere yet (a job no worker took has no events);
        // a new worker runs it, from its start.
        let early = tokio::time::timeout(Duration::from_millis(300), sub2.next()).await;
        assert!(
            early.is_err(),
            "the stopped worker took a new job: {early:?}"
        );
        stack.spawn("worker", &[]);
        let run2 = Client::finish(id2, sub2, |_| {}).await;
        assert!(
            matches!(run2.last(), Event::Done { .. }),
            "{:?}",
            run2.last()
        );
        assert_eq!(run2.tokens(), local_greedy("Paris is", 6));
    });
}

#[test]
fn past_its_grace_period_a_worker_ends_what_is_left_with_worker_lost_once() {
    let mut stack = Stack::nats_only();
    stack.spawn("intake", &[]);
    let fast_ack = ("LLMQ__WORKER__ACK_WAIT_MS", "1500");
    let first = stack.spawn(
        "worker",
        &[("LLMQ__WORKER__DRAIN_TIMEOUT_S", "0"), fast_ack],
    );
    rt().block_on(async {
        let c = Client::connect(&stack.url).await;
        let (id, mut sub) = c
            .start(GenerateRequest {
                ignore_eos: true,
                ..req("a long one", 500)
            })
            .await;
        until_tokens(&mut sub).await;
        stack.terminate(first);
        let run = Client::finish(id, sub, |_| {}).await;
        match run.last() {
            Event::Error { error } => assert_eq!(error.class, ErrorClass::WorkerLost, "{error}"),
            e => panic!("{e:?}"),
        }
        assert_eq!(
            run.events.iter().filter(|e| e.event.is_terminal()).count(),
            1
        );
        let status = stack
            .wait_exit(first, Duration::from_secs(20))
            .expect("the worker exits");
        assert!(status.success(), "{status:?}");
        // The job was acknowledged with its end: a worker started later, past the ack wait,
        // does not run it again, and serves new requests.
        // Every inbox's traffic (the client's streams go to its inboxes).
        let mut again = c.nc.subscribe("_INBOX.>").await.unwrap();
        stack.spawn("worker", &[fast_ack]);
        tokio::time::sleep(Duration::from_secs(3)).await;
        let next = c.run(req("Paris is", 4)).await;
        assert!(
            matches!(next.last(), Event::Done { .. }),
            "{:?}",
            next.last()
        );
        while let Ok(Some(m)) = tokio::time::timeout(Duration::from_millis(100), again.next()).await
        {
            if let Ok(ev) = decode::<StreamEvent>(&m.payload) {
                assert_ne!(
                    ev.request_id, run.id,
                    "the ended job ran again: {:?}",
                    ev.event
                );
            }
        }
    });
}
