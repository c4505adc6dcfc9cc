//! The protocol as documents a machine reads, generated from the types and subjects
//! themselves (so they cannot drift from them): a JSON Schema per message a subject carries,
//! and an AsyncAPI 3 document naming the subjects, who sends and who receives on each, and the
//! NATS permissions each role needs. The committed copies are in `docs/protocol/`; a test
//! regenerates them and fails where they differ.

use schemars::{schema_for, Schema};
use serde_json::{json, Map, Value};

use crate::subjects;

use crate::messages::{
    CacheCleared, Cancel, ClearCache, GenerateReply, GenerateRequest, Job, JobQuery, JobState,
    StreamEvent, WorkerStatus,
};
use crate::prefill::{KvFrame, PrefillOrder, PrefillReply};

/// Every message of protocol v1, by the name of its type, with its schema.
pub fn messages() -> Vec<(&'static str, Schema)> {
    vec![
        ("GenerateRequest", schema_for!(GenerateRequest)),
        ("GenerateReply", schema_for!(GenerateReply)),
        ("JobQuery", schema_for!(JobQuery)),
        ("JobState", schema_for!(JobState)),
        ("StreamEvent", schema_for!(StreamEvent)),
        ("Cancel", schema_for!(Cancel)),
        ("Job", schema_for!(Job)),
        ("WorkerStatus", schema_for!(WorkerStatus)),
        ("ClearCache", schema_for!(ClearCache)),
        ("CacheCleared", schema_for!(CacheCleared)),
        ("PrefillOrder", schema_for!(PrefillOrder)),
        ("PrefillReply", schema_for!(PrefillReply)),
        ("KvFrame", schema_for!(KvFrame)),
    ]
}

/// A NATS user's role in the compose stack, and the subjects it may publish and subscribe to
/// (`deploy/nats/nats.conf` grants exactly these; a test checks it).
pub struct Role {
    /// The role (each has its own NATS user; clients one each).
    pub name: &'static str,
    /// Subjects it may publish to.
    pub publish: &'static [&'static str],
    /// Subjects it may subscribe to.
    pub subscribe: &'static [&'static str],
}

/// The roles of the compose stack's NATS users. A client's inbox is `_INBOX.<user>`.
pub const ROLES: &[Role] = &[
    Role {
        name: "intake",
        publish: &["llm.v1.jobs.>", "$JS.API.>", "_INBOX.intake.>"],
        subscribe: &[
            "llm.v1.generate",
            "llm.v1.job.state",
            "llm.v1.worker.*.status",
            "_INBOX.intake.>",
        ],
    },
    Role {
        name: "worker",
        publish: &[
            "$JS.API.>",
            "$JS.ACK.>",
            "llm.v1.handed_back.>",
            "llm.v1.worker.*.status",
            "_INBOX.>",
            "llm.v1.stream.>",
            "llm.v1.prefill.>",
        ],
        subscribe: &[
            "llm.v1.cancel",
            "llm.v1.cache.clear",
            "llm.v1.worker.*.status",
            "_INBOX.worker.>",
            "llm.v1.prefill.>",
        ],
    },
    Role {
        name: "gateway",
        publish: &["llm.v1.generate", "llm.v1.cancel", "llm.v1.job.state"],
        subscribe: &["llm.v1.worker.*.status", "_INBOX.gateway.>"],
    },
    Role {
        name: "client",
        publish: &["llm.v1.generate", "llm.v1.cancel", "llm.v1.job.state"],
        subscribe: &["_INBOX.<user>.>"],
    },
];

/// One channel of the AsyncAPI document: a subject, what it carries, who sends and receives.
struct Channel {
    id: &'static str,
    address: &'static str,
    messages: &'static [&'static str],
    description: &'static str,
    senders: &'static [&'static str],
    receivers: &'static [&'static str],
    /// The channel whose message answers this one's (request/reply on the sender's inbox).
    reply: Option<&'static str>,
}

const CHANNELS: &[Channel] = &[
    Channel {
        id: "generate",
        address: subjects::GENERATE,
        messages: &["GenerateRequest"],
        description: "Submit a job (request/reply; intake in the queue group `intake`). \
            Subscribe to the inbox named in `stream_subject` first: core NATS does not replay.",
        senders: &["client", "gateway"],
        receivers: &["intake"],
        reply: Some("generateReply"),
    },
    Channel {
        id: "generateReply",
        address: "_INBOX.<user>.<reply>",
        messages: &["GenerateReply"],
        description: "Intake's answer: `accepted` (the job is in the jobs stream) or `rejected`.",
        senders: &["intake"],
        receivers: &["client", "gateway"],
        reply: None,
    },
    Channel {
        id: "jobState",
        address: subjects::JOB_STATE,
        messages: &["JobQuery"],
        description: "Ask whether an accepted job is still in the jobs stream (request/reply).",
        senders: &["client", "gateway"],
        receivers: &["intake"],
        reply: Some("jobStateReply"),
    },
    Channel {
        id: "jobStateReply",
        address: "_INBOX.<user>.<reply>",
        messages: &["JobState"],
        description: "`pending` (waiting, or held by a worker that has not finished it) or `gone`.",
        senders: &["intake"],
        receivers: &["client", "gateway"],
        reply: None,
    },
    Channel {
        id: "stream",
        address: "<stream_subject>",
        messages: &["StreamEvent"],
        description: "A request's events on the client's inbox (default `llm.v1.stream.<request \
            id>`): progress, tokens, then exactly one terminal event per sample, with \
            consecutive `seq`s.",
        senders: &["worker"],
        receivers: &["client", "gateway"],
        reply: None,
    },
    Channel {
        id: "cancel",
        address: subjects::CANCEL,
        messages: &["Cancel"],
        description: "Broadcast: whichever worker holds the request drops it within a tick.",
        senders: &["client", "gateway"],
        receivers: &["worker"],
        reply: None,
    },
    Channel {
        id: "jobs",
        address: "llm.v1.jobs.{model}",
        messages: &["Job"],
        description: "Validated, tokenized jobs in the JetStream stream `LLMQ_JOBS_V1`; one \
            durable pull consumer per model, shared by its workers.",
        senders: &["intake"],
        receivers: &["worker"],
        reply: None,
    },
    Channel {
        id: "workerStatus",
        address: "llm.v1.worker.{worker_id}.status",
        messages: &["WorkerStatus"],
        description: "A worker's heartbeat.",
        senders: &["worker"],
        receivers: &["intake", "gateway", "worker"],
        reply: None,
    },
    Channel {
        id: "cacheClear",
        address: subjects::CACHE_CLEAR,
        messages: &["ClearCache"],
        description: "Broadcast: workers drop their cached prefixes; with a reply subject each \
            answers `CacheCleared`.",
        senders: &["client"],
        receivers: &["worker"],
        reply: Some("cacheCleared"),
    },
    Channel {
        id: "cacheCleared",
        address: "<reply>",
        messages: &["CacheCleared"],
        description: "A worker's answer to a cache clear.",
        senders: &["worker"],
        receivers: &["client"],
        reply: None,
    },
    Channel {
        id: "prefillOrders",
        address: "llm.v1.prefill.{worker_id}.orders",
        messages: &["PrefillOrder"],
        description: "A decode worker's grants of prompt chunks to a prefill worker.",
        senders: &["worker"],
        receivers: &["worker"],
        reply: None,
    },
    Channel {
        id: "prefillKv",
        address: "llm.v1.prefill.{worker_id}.kv",
        messages: &["PrefillReply"],
        description: "A prefill worker's chunks of prompt KV, in pieces (or over a direct TCP \
            connection, each chunk a length-prefixed `KvFrame` then its bytes).",
        senders: &["worker"],
        receivers: &["worker"],
        reply: None,
    },
    Channel {
        id: "handedBack",
        address: "llm.v1.handed_back.{request}",
        messages: &[],
        description: "The `seq` (decimal text) a job handed back unstarted goes on from, in the \
            JetStream stream `LLMQ_HANDED_BACK_V1`.",
        senders: &["worker"],
        receivers: &["worker"],
        reply: None,
    },
];

/// The AsyncAPI 3 document of protocol v1: channels (subjects), operations by role, messages
/// (their payloads the JSON Schemas of `docs/protocol/v1/`), and each role's NATS permissions.
pub fn asyncapi() -> Value {
    let mut channels = Map::new();
    let mut operations = Map::new();
    let mut messages = Map::new();
    for c in CHANNELS {
        let mut ms = Map::new();
        for m in c.messages {
            ms.insert(
                (*m).into(),
                json!({ "$ref": format!("#/components/messages/{m}") }),
            );
            messages.insert(
                (*m).into(),
                json!({
                    "name": m,
                    "contentType": "application/msgpack",
                    "payload": {
                        "schemaFormat": "application/schema+json;version=draft-2020-12",
                        "schema": { "$ref": format!("v1/{m}.schema.json") }
                    }
                }),
            );
        }
        // An inbox's address is the client's own: AsyncAPI writes such a channel's as null.
        let dynamic = c.address.starts_with('<') || c.address.starts_with("_INBOX");
        let mut channel = json!({
            "address": if dynamic { Value::Null } else { json!(c.address) },
            "description": c.description,
            "messages": ms,
        });
        if dynamic {
            channel["x-llmq-address"] = json!(c.address);
        }
        let params: Vec<&str> = c.address.split(['{', '}']).skip(1).step_by(2).collect();
        if !params.is_empty() {
            let p: Map<String, Value> = params
                .iter()
                .map(|p| ((*p).to_string(), json!({})))
                .collect();
            channel["parameters"] = Value::Object(p);
        }
        channels.insert(c.id.into(), channel);
        for (action, roles) in [("send", c.senders), ("receive", c.receivers)] {
            let mut op = json!({
                "action": action,
                "channel": { "$ref": format!("#/channels/{}", c.id) },
                "x-llmq-roles": roles,
            });
            if let (Some(reply), "send") = (c.reply, action) {
                op["reply"] = json!({ "channel": { "$ref": format!("#/channels/{reply}") } });
            }
            operations.insert(format!("{}.{action}", c.id), op);
        }
    }
    let roles: Map<String, Value> = ROLES
        .iter()
        .map(|r| {
            (
                r.name.to_string(),
                json!({ "publish": r.publish, "subscribe": r.subscribe }),
            )
        })
        .collect();
    json!({
        "asyncapi": "3.0.0",
        "info": {
            "title": "llmq protocol",
            "version": "1",
            "description": "NATS subjects of llmq, protocol v1. Payloads are MessagePack maps with \
                named fields; enums are tagged by `type`. x-llmq-roles names who sends or \
                receives on a channel; x-nats-permissions, what each role's NATS user may \
                publish and subscribe to in the compose stack (deploy/nats/nats.conf).",
            "x-nats-permissions": roles,
        },
        "defaultContentType": "application/msgpack",
        "channels": channels,
        "operations": operations,
        "components": { "messages": messages },
    })
}
