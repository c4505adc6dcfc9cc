//! The committed JSON Schemas of the protocol (`docs/protocol/v1/`) are the ones the message
//! types generate. `LLMQ_WRITE_SCHEMAS=1 cargo test -p llmq-protocol --test schema` rewrites
//! them after a change to the types.

use std::path::PathBuf;

/// The document with every object's keys sorted: serde_json keeps insertion order when another
/// crate of the build turns on its `preserve_order` (llguidance does, in the workspace), and
/// sorted order otherwise; the committed copies must not depend on which crates are built.
fn canonical(v: serde_json::Value) -> serde_json::Value {
    match v {
        serde_json::Value::Object(m) => {
            let mut entries: Vec<_> = m.into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            serde_json::Value::Object(
                entries
                    .into_iter()
                    .map(|(k, v)| (k, canonical(v)))
                    .collect(),
            )
        }
        serde_json::Value::Array(a) => {
            serde_json::Value::Array(a.into_iter().map(canonical).collect())
        }
        other => other,
    }
}

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/protocol")
}

#[test]
fn the_committed_schemas_are_the_types_schemas() {
    let write = std::env::var_os("LLMQ_WRITE_SCHEMAS").is_some();
    let mut stale = vec![];
    let mut documents: Vec<(String, serde_json::Value)> = llmq_protocol::schema::messages()
        .into_iter()
        .map(|(name, s)| (format!("v1/{name}.schema.json"), s.to_value()))
        .collect();
    documents.push(("asyncapi.json".into(), llmq_protocol::schema::asyncapi()));
    for (name, document) in documents {
        let text = serde_json::to_string_pretty(&canonical(document)).unwrap() + "\n";
        let path = dir().join(&name);
        if write {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, &text).unwrap();
        } else if std::fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
            stale.push(path.display().to_string());
        }
    }
    assert!(
        stale.is_empty(),
        "these schemas differ from the types' (rewrite them with LLMQ_WRITE_SCHEMAS=1 cargo \
         test -p llmq-protocol --test schema): {stale:?}"
    );
}

/// Each schema takes a message the protocol really sends (encoded as the wire does, then read
/// as JSON), and refuses one with a field of the wrong type.
#[test]
fn the_schemas_describe_real_messages() {
    use llmq_protocol::{Event, FinishReason, GenerateRequest, StreamEvent, Timings, Usage};
    let schemas: std::collections::HashMap<_, _> = llmq_protocol::schema::messages()
        .into_iter()
        .map(|(n, s)| (n, s.to_value()))
        .collect();
    let req = GenerateRequest {
        model: "smollm2".into(),
        prompt: Some("Hi".into()),
        max_tokens: Some(8),
        ..Default::default()
    };
    let done = StreamEvent {
        request_id: "r".into(),
        seq: 3,
        event: Event::Done {
            finish_reason: FinishReason::Stop,
            usage: Usage::default(),
            timings: Timings::default(),
        },
        choice: 0,
    };
    let as_json = |bytes: Vec<u8>| -> serde_json::Value { rmp_serde::from_slice(&bytes).unwrap() };
    for (name, value) in [
        (
            "GenerateRequest",
            as_json(llmq_protocol::encode(&req).unwrap()),
        ),
        (
            "StreamEvent",
            as_json(llmq_protocol::encode(&done).unwrap()),
        ),
    ] {
        let v = jsonschema::validator_for(&schemas[name]).unwrap();
        assert!(v.is_valid(&value), "{name}: {value}");
        let mut wrong = value.clone();
        wrong["request_id"] = serde_json::json!(5);
        wrong["model"] = serde_json::json!(5);
        assert!(!v.is_valid(&wrong), "{name} took {wrong}");
    }
}

/// The compose stack's NATS server grants each role what the AsyncAPI document says it needs,
/// no more, no less.
#[test]
fn nats_conf_grants_each_role_its_documented_subjects() {
    let conf = std::fs::read_to_string(
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../deploy/nats/nats.conf"),
    )
    .unwrap();
    let allow = |block: &str, kind: &str| -> Vec<String> {
        let at = block
            .find(&format!("{kind}: {{ allow: ["))
            .unwrap_or_else(|| panic!("{kind} in {block}"));
        let rest = &block[at..];
        let list = &rest[rest.find('[').unwrap() + 1..rest.find(']').unwrap()];
        list.split(',')
            .map(|s| s.trim().trim_matches('"').to_string())
            .filter(|s| !s.is_empty())
            .collect()
    };
    for role in llmq_protocol::schema::ROLES {
        let block = if role.name == "client" {
            let at = conf.find("user: client1").expect("a client user");
            &conf[at..]
        } else {
            let at = conf
                .find(&format!("{} = {{", role.name.to_uppercase()))
                .expect("the role");
            &conf[at..]
        };
        let publish = allow(block, "publish");
        let subscribe: Vec<String> = allow(block, "subscribe")
            .into_iter()
            .map(|s| s.replace("_INBOX.client1.", "_INBOX.<user>."))
            .collect();
        assert_eq!(publish, role.publish, "{}: publish", role.name);
        assert_eq!(subscribe, role.subscribe, "{}: subscribe", role.name);
    }
}
