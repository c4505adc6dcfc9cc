//! A NATS client of llmq for the end-to-end tests: submits jobs as a user would (its own inbox
//! first), collects their events, checks that nothing follows the terminal one.

use std::time::{Duration, Instant};

use futures::StreamExt;
use llmq_protocol::*;

use super::fixture;

pub struct Client {
    pub nc: async_nats::Client,
}

pub struct Run {
    pub id: String,
    pub events: Vec<StreamEvent>,
}

impl Run {
    pub fn tokens(&self) -> Vec<u32> {
        self.events
            .iter()
            .flat_map(|e| {
                if let Event::Tokens { ids, .. } = &e.event {
                    ids.clone()
                } else {
                    vec![]
                }
            })
            .collect()
    }
    pub fn last(&self) -> &Event {
        &self.events.last().unwrap().event
    }
    pub fn text(&self) -> String {
        self.events
            .iter()
            .filter_map(|e| {
                if let Event::Tokens { text, .. } = &e.event {
                    Some(text.as_str())
                } else {
                    None
                }
            })
            .collect()
    }
}

impl Client {
    pub async fn connect(url: &str) -> Client {
        let t = Instant::now();
        loop {
            if let Ok(nc) = llmq_protocol::connect(url, None, "llmq-test").await {
                return Client { nc };
            }
            assert!(t.elapsed() < Duration::from_secs(10));
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Submits (retrying until an intake answers); returns the reply and the event subscription.
    pub async fn submit_raw(&self, payload: Vec<u8>) -> GenerateReply {
        let t = Instant::now();
        loop {
            match tokio::time::timeout(
                Duration::from_secs(5),
                self.nc.request(subjects::GENERATE, payload.clone().into()),
            )
            .await
            {
                Ok(Ok(m)) => return decode(&m.payload).unwrap(),
                _ if t.elapsed() < Duration::from_secs(60) => {
                    tokio::time::sleep(Duration::from_millis(100)).await
                }
                other => panic!("no reply from intake: {:?}", other.err()),
            }
        }
    }

    pub async fn start(&self, mut req: GenerateRequest) -> (String, async_nats::Subscriber) {
        let inbox = self.nc.new_inbox();
        let sub = self.nc.subscribe(inbox.clone()).await.unwrap();
        req.stream_subject = Some(inbox);
        match self.submit_raw(encode(&req).unwrap()).await {
            GenerateReply::Accepted { request_id, .. } => (request_id, sub),
            GenerateReply::Rejected { error } => panic!("rejected: {error}"),
        }
    }

    pub async fn finish(
        id: String,
        sub: async_nats::Subscriber,
        on: impl FnMut(&StreamEvent),
    ) -> Run {
        Self::finish_choices(id, sub, 1, on).await
    }

    /// Reads a request's events until each of its `n` choices has ended.
    pub async fn finish_choices(
        id: String,
        mut sub: async_nats::Subscriber,
        n: u32,
        mut on: impl FnMut(&StreamEvent),
    ) -> Run {
        let mut events = vec![];
        let mut ended = 0;
        while ended < n {
            let m = tokio::time::timeout(Duration::from_secs(60), sub.next())
                .await
                .expect("event within 60 s")
                .unwrap();
            let ev: StreamEvent = decode(&m.payload).unwrap();
            on(&ev);
            ended += ev.event.is_terminal() as u32;
            events.push(ev);
        }
        // Nothing may follow the terminal event.
        if let Ok(Some(m)) = tokio::time::timeout(Duration::from_millis(300), sub.next()).await {
            let after: Result<StreamEvent, _> = decode(&m.payload);
            let ends: Vec<_> = events
                .iter()
                .filter(|e| e.event.is_terminal())
                .map(|e| (e.seq, &e.event))
                .collect();
            panic!(
                "{id}: event after the terminal one(s) {ends:?} ({} events): {after:?}",
                events.len()
            );
        }
        Run { id, events }
    }

    /// Reads a started stream's events up to its first tokens; returns their ids. Waiting more
    /// than 120 s for an event fails with the events that did come (queued? prefilled?).
    pub async fn first_tokens(sub: &mut async_nats::Subscriber) -> Vec<u32> {
        Self::first_tokens_within(sub, Duration::from_secs(120))
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// As [`Client::first_tokens`], waiting at most `wait` for each event: on a timeout, says
    /// how long it waited in all and which events came.
    pub async fn first_tokens_within(
        sub: &mut async_nats::Subscriber,
        wait: Duration,
    ) -> Result<Vec<u32>, String> {
        let began = Instant::now();
        let mut seen = vec![];
        loop {
            let Ok(m) = tokio::time::timeout(wait, sub.next()).await else {
                return Err(format!(
                    "no tokens {:?} after the start; events so far: {seen:?}",
                    began.elapsed()
                ));
            };
            let ev = decode::<StreamEvent>(&m.unwrap().payload).unwrap();
            match ev.event {
                Event::Tokens { ids, .. } => return Ok(ids),
                e => {
                    assert!(!e.is_terminal(), "ended before its first tokens: {e:?}");
                    seen.push((began.elapsed(), ev.request_id, e));
                }
            }
        }
    }

    pub async fn run(&self, req: GenerateRequest) -> Run {
        let (id, sub) = self.start(req).await;
        Self::finish(id, sub, |_| {}).await
    }

    pub async fn status(&self) -> WorkerStatus {
        let mut sub = self
            .nc
            .subscribe(subjects::WORKER_STATUS_ALL)
            .await
            .unwrap();
        let m = tokio::time::timeout(Duration::from_secs(10), sub.next())
            .await
            .unwrap()
            .unwrap();
        decode(&m.payload).unwrap()
    }
}

pub fn req(prompt: &str, max_tokens: i64) -> GenerateRequest {
    GenerateRequest {
        model: fixture(),
        prompt: Some(prompt.into()),
        max_tokens: Some(max_tokens),
        ..Default::default()
    }
}

/// A stream's event handler that publishes a cancel of `id` once `trigger` (given each event
/// and a counter of its own) says so, and only once.
pub fn cancel_when(
    id: String,
    nc: async_nats::Client,
    mut trigger: impl FnMut(&Event, &mut u32) -> bool,
) -> impl FnMut(&StreamEvent) {
    let mut n = 0u32;
    let mut sent = false;
    move |e: &StreamEvent| {
        if !sent && trigger(&e.event, &mut n) {
            sent = true;
            let (nc, id) = (nc.clone(), id.clone());
            tokio::spawn(async move {
                nc.publish(
                    subjects::CANCEL,
                    encode(&Cancel { request_id: id }).unwrap().into(),
                )
                .await
                .unwrap()
            });
        }
    }
}

pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

pub fn local_greedy(prompt: &str, max_tokens: usize) -> Vec<u32> {
    local_greedy_of(&fixture(), prompt, max_tokens)
}

/// Greedy tokens of `model` (a known name or a path) for a raw prompt, in this process.
pub fn local_greedy_of(model: &str, prompt: &str, max_tokens: usize) -> Vec<u32> {
    let m = llmq_engine::load_named(model, mlx_rs::Dtype::Float32).unwrap();
    let tok = m.tokenizer.as_ref().unwrap();
    let r = llmq_engine::generate::LocalRequest {
        prompt_ids: tok.encode(prompt, true).unwrap(),
        sampling: Default::default(),
        stop: llmq_text::sampling::StopConditions {
            max_tokens: max_tokens as u32,
            ..Default::default()
        },
        prefill_chunk: 4096,
    };
    llmq_engine::generate::generate(&m.model, Some(tok), &r, |_, _| {})
        .unwrap()
        .token_ids
}
