//! `llmq generate` through NATS: subscribes to its own inbox first (so no event is missed),
//! submits the job naming that inbox, streams the text; Ctrl-C sends a cancel. On a terminal,
//! prefill progress shows as a bar on stderr. A [`Watch`] makes sure it ends: events lost on the
//! way, or a job gone without its terminal event, end it with `worker_lost` (and a cancel).

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use llmq_protocol::watch::Watch;
use llmq_protocol::{
    subjects, Cancel, ChatMessage, Event, GenerateReply, GenerateRequest, StreamEvent,
};

use crate::generate::Args;

/// A stream silent this long is asked about ([`Watch::silent`]).
const SILENCE: Duration = Duration::from_secs(5);
/// A stream that nothing showed alive for this long ends (the gateway's default).
const SILENT_STREAM_TIMEOUT: Duration = Duration::from_secs(30);

pub fn generate(a: &Args) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(run(a))
}

fn request(a: &Args, inbox: String) -> GenerateRequest {
    let (prompt, messages) = if a.chat {
        (None, Some(vec![ChatMessage::new("user", &a.prompt)]))
    } else {
        (Some(a.prompt.clone()), None)
    };
    GenerateRequest {
        model: a.model.clone(),
        prompt,
        messages,
        max_tokens: Some(a.max_tokens as i64),
        temperature: Some(a.temperature as f64),
        top_p: Some(a.top_p as f64),
        top_k: Some(a.top_k as i64),
        min_p: Some(a.min_p as f64),
        repetition_penalty: Some(a.repetition_penalty as f64),
        seed: a.seed,
        stop: a.stop.clone(),
        logprobs: a.top_logprobs > 0,
        top_logprobs: a.top_logprobs,
        stream_subject: Some(inbox),
        ..Default::default()
    }
}

async fn run(a: &Args) -> Result<()> {
    let client = llmq_protocol::connect(&a.nats, None, "llmq-client")
        .await
        .with_context(|| format!("connecting to NATS at {}", a.nats))?;
    let inbox = client.new_inbox();
    let mut events = client.subscribe(inbox.clone()).await?;
    let payload = llmq_protocol::encode(&request(a, inbox))?;
    let started = Instant::now();
    let reply = tokio::time::timeout(
        Duration::from_secs(30),
        client.request(subjects::GENERATE, payload.into()),
    )
    .await
    .context("no reply from intake within 30 s")?
    .context("submitting (is `llmq up` or an intake running?)")?;
    let (request_id, mut watch) = match llmq_protocol::decode::<GenerateReply>(&reply.payload)? {
        GenerateReply::Accepted {
            request_id,
            job_seq,
            ..
        } => {
            let watch = Watch::new(&request_id, job_seq, SILENT_STREAM_TIMEOUT);
            (request_id, watch)
        }
        GenerateReply::Rejected { error } => bail!("rejected: {error}"),
    };
    let bar = std::io::stderr().is_terminal() && !a.json;
    let mut stdout = std::io::stdout().lock();
    let (mut text, mut ids, mut first_at) = (String::new(), Vec::<u32>::new(), None);
    let mut cancel_sent = false;
    let cancel = || async {
        client
            .publish(
                subjects::CANCEL,
                llmq_protocol::encode(&Cancel {
                    request_id: request_id.clone(),
                })?
                .into(),
            )
            .await
            .map_err(anyhow::Error::from)
    };
    loop {
        let ev = tokio::select! {
            m = events.next() => match m {
                Some(m) => llmq_protocol::decode::<StreamEvent>(&m.payload)?,
                None => bail!("the event stream closed before the request ended"),
            },
            _ = tokio::signal::ctrl_c(), if !cancel_sent => {
                cancel_sent = true;
                cancel().await?;
                continue;
            }
            _ = tokio::time::sleep(SILENCE) => match watch.silent(&client).await {
                Ok(_) => continue,
                Err(error) => {
                    cancel().await?;
                    bail!("request {request_id} ended: {error}");
                }
            },
        };
        if let Err(error) = watch.event(&ev) {
            cancel().await?;
            bail!("request {request_id} ended: {error}");
        }
        match ev.event {
            Event::Queued { position } if bar => eprint!("\r\x1b[Kqueued (position {position})"),
            Event::PrefillProgress { done, total } if bar => {
                let w = 30 * done as usize / total.max(1) as usize;
                eprint!(
                    "\r\x1b[Kprefill [{}{}] {done}/{total}",
                    "#".repeat(w),
                    " ".repeat(30 - w)
                );
                if done == total {
                    eprint!("\r\x1b[K");
                }
            }
            Event::Tokens {
                ids: new,
                text: piece,
                ..
            } => {
                first_at.get_or_insert_with(Instant::now);
                ids.extend(new);
                text.push_str(&piece);
                if !a.json {
                    stdout.write_all(piece.as_bytes())?;
                    stdout.flush()?;
                }
            }
            Event::Done {
                finish_reason,
                usage,
                timings,
            } => {
                if a.json {
                    let v = serde_json::json!({
                        "request_id": request_id, "text": text, "token_ids": ids,
                        "finish_reason": finish_reason, "usage": usage, "timings": timings,
                        "ttft_ms": timings.ttft_ms,
                        "ms_per_token": first_at.map(|f| f.elapsed().as_secs_f64() * 1000.0 / (ids.len().max(2) - 1) as f64),
                        "wall_ms": started.elapsed().as_secs_f64() * 1000.0,
                    });
                    writeln!(stdout, "{v}")?;
                } else {
                    writeln!(stdout)?;
                }
                return Ok(());
            }
            Event::Error { error } => {
                if !a.json {
                    writeln!(stdout)?;
                }
                bail!("request {request_id} ended: {error}");
            }
            _ => {}
        }
    }
}
