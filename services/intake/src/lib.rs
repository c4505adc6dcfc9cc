//! Intake: the front door. Stateless; run as many as you like (they share the queue group).
//!
//! For each `GenerateRequest` on `llm.v1.generate` it decodes, validates, applies the chat
//! template, tokenizes, checks the context limit, assigns the request id, puts the `Job` on the
//! JetStream jobs stream (durable: a job accepted while no worker runs waits for one) and
//! replies `Accepted` at once, or `Rejected` with a typed error. Bad input disturbs nothing.

pub mod validate;

use std::collections::HashMap;
use std::sync::Arc;

use actix::prelude::*;
use async_nats::jetstream;
use futures::StreamExt;
use llmq_config::Settings;
use llmq_protocol::{subjects, ErrorClass, GenerateReply, WireError};

pub use validate::{ModelInfo, Validator};

#[derive(Debug, thiserror::Error)]
pub enum IntakeError {
    #[error("model {0}: {1}")]
    Model(String, String),
    #[error("NATS: {0}")]
    Nats(String),
}

pub struct IntakeActor {
    validator: Arc<Validator>,
    client: async_nats::Client,
    js: jetstream::Context,
}

impl Actor for IntakeActor {
    type Context = Context<Self>;
}

#[derive(Message)]
#[rtype(result = "()")]
struct Incoming(async_nats::Message);

async fn reply(client: &async_nats::Client, to: async_nats::Subject, r: &GenerateReply) {
    match llmq_protocol::encode(r) {
        Ok(b) => {
            if let Err(e) = client.publish(to, b.into()).await {
                tracing::warn!(error = %e, "replying");
            }
        }
        Err(e) => tracing::error!(error = %e, "encoding a reply"),
    }
}

impl Handler<Incoming> for IntakeActor {
    type Result = ();
    fn handle(&mut self, Incoming(msg): Incoming, ctx: &mut Context<Self>) {
        let Some(reply_to) = msg.reply.clone() else {
            tracing::debug!("generate request without a reply subject: dropped");
            return;
        };
        let client = self.client.clone();
        let verdict = self.validator.accept(&msg.payload);
        let js = self.js.clone();
        ctx.spawn(
            async move {
                let answer = match verdict {
                    Err(error) => GenerateReply::Rejected { error },
                    Ok(job) => {
                        let subject = subjects::jobs(&job.model);
                        let stored = match llmq_protocol::encode(&job) {
                            Ok(bytes) => match js.publish(subject, bytes.into()).await {
                                Ok(ack) => ack.await.map(|_| ()).map_err(|e| e.to_string()),
                                Err(e) => Err(e.to_string()),
                            },
                            Err(e) => Err(e.to_string()),
                        };
                        match stored {
                            Ok(()) => GenerateReply::Accepted { request_id: job.request_id, stream_subject: job.stream_subject },
                            Err(e) => GenerateReply::Rejected {
                                error: WireError::new(ErrorClass::Internal, format!("storing the job: {e}")),
                            },
                        }
                    }
                };
                reply(&client, reply_to, &answer).await;
            }
            .into_actor(self),
        );
    }
}

/// Loads the configured models' tokenizers and serves until the process stops.
/// Must be called inside an actix System.
pub async fn run(settings: Settings) -> Result<(), IntakeError> {
    let mut models = HashMap::new();
    for name in &settings.intake.models {
        let info = ModelInfo::load(name).map_err(|e| IntakeError::Model(name.clone(), e.to_string()))?;
        models.insert(name.clone(), info);
    }
    let validator = Arc::new(Validator::new(models, settings.intake.default_max_tokens));
    let nats = |e: &dyn std::fmt::Display| IntakeError::Nats(e.to_string());
    let client = async_nats::connect(&settings.nats.url).await.map_err(|e| nats(&e))?;
    let js = jetstream::new(client.clone());
    subjects::jobs_stream(&js).await.map_err(|e| nats(&e))?;
    let mut sub = client
        .queue_subscribe(subjects::GENERATE, subjects::INTAKE_QUEUE.into())
        .await
        .map_err(|e| nats(&e))?;
    let addr = IntakeActor { validator, client: client.clone(), js }.start();
    tracing::info!(models = ?settings.intake.models, "intake ready");
    while let Some(msg) = sub.next().await {
        addr.do_send(Incoming(msg));
    }
    Ok(())
}
