//! The Python client (clients/python, on nats-py and msgpack in set-up's .cache/pyclient)
//! against a real stack: nats-server, intake and a SmolLM2 worker. Its script
//! (clients/python/tests/stack_test.py) streams, asks for two samples and for a JSON schema,
//! cancels mid-stream, meets typed errors, and follows a job whose worker is killed mid-stream
//! to its `worker_lost`; it validates every message it receives against the JSON Schemas of
//! docs/protocol/v1. The compose stack's NATS users and TLS are exercised in compose.rs.

mod common;

use common::python::run_python_client;
use common::*;
use llmq_protocol::Event;

#[test]
fn the_python_client_streams_samples_constrains_cancels_and_types_errors() {
    let mut stack = Stack::nats_for("smollm2");
    stack.spawn("intake", &[]);
    let fast_ack = [("LLMQ__WORKER__ACK_WAIT_MS", "1500")];
    let first = stack.spawn("worker", &fast_ack);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let url = stack.url.clone();
    // Intake and the worker are up once one request has run through them.
    rt.block_on(async {
        let hi = llmq_protocol::GenerateRequest {
            model: "smollm2".into(),
            ..client::req("Hi", 1)
        };
        let ready = client::Client::connect(&url).await.run(hi).await;
        assert!(
            matches!(ready.last(), Event::Done { .. }),
            "{:?}",
            ready.last()
        );
    });
    let out = rt.block_on(run_python_client(&[&url, "smollm2"], || {}));
    for scenario in ["streaming", "samples", "constraint", "cancel", "errors"] {
        assert!(out.contains(&format!("{scenario}:")), "{out}");
    }
    // A job whose worker dies mid-stream: another worker takes it back and ends it.
    let mut killed = false;
    let out = rt.block_on(run_python_client(
        &[&url, "smollm2", "--only", "worker_lost"],
        || {
            stack.kill(first);
            stack.spawn("worker", &fast_ack);
            killed = true;
        },
    ));
    assert!(killed, "{out}");
    assert!(out.contains("worker_lost: ended with worker_lost"), "{out}");
}
