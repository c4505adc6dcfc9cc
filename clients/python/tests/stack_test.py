"""The Python client against a running llmq stack (started by the Rust test that runs this
script: services/cli/tests/python_client.rs). Every message the client receives is validated
against the protocol's JSON Schema (docs/protocol/v1).

Usage: stack_test.py NATS_URL MODEL [--user U --password P] [--tls-ca FILE] [--inbox-prefix X]
                     [--only streaming,samples,constraint,cancel,errors,worker_lost]

For `worker_lost` the script prints `KILL` once its job has streamed tokens and waits: the
harness then kills the job's worker and starts another, which ends the job with `worker_lost`.
"""

import argparse
import asyncio
import json
import pathlib
import sys

import jsonschema

ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "clients" / "python"))

from llmq_client import (  # noqa: E402
    REQUEST_FIELDS,
    Client,
    Done,
    JobFailed,
    PrefillProgress,
    Rejected,
    Tokens,
)

SCHEMAS = ROOT / "docs" / "protocol" / "v1"
VALIDATORS = {}
CHECKED = {}


def validate(kind, message):
    if kind not in VALIDATORS:
        schema = json.loads((SCHEMAS / f"{kind}.schema.json").read_text())
        VALIDATORS[kind] = jsonschema.Draft202012Validator(schema)
    VALIDATORS[kind].validate(message)
    CHECKED[kind] = CHECKED.get(kind, 0) + 1


def ask(question):
    return [{"role": "user", "content": question}]


async def fields_match_the_schema(_c, _model):
    schema = json.loads((SCHEMAS / "GenerateRequest.schema.json").read_text())
    declared = set(schema["properties"]) - {"model", "stream_subject", "requires"}
    assert declared == set(REQUEST_FIELDS), sorted(declared ^ set(REQUEST_FIELDS))


async def streaming(c, model):
    job = await c.submit(model, messages=ask("What is the capital of France?"), max_tokens=24)
    kinds, text, done = [], [], None
    async for ev in job:
        kinds.append(type(ev).__name__)
        if isinstance(ev, Tokens):
            text.append(ev.text)
        if isinstance(ev, Done):
            done = ev
    assert "PrefillProgress" in kinds and kinds[-1] == "Done", kinds
    assert kinds.index("PrefillProgress") < kinds.index("Tokens"), kinds
    assert done.usage["completion"] >= 1 and done.usage["prompt"] > 0, done
    assert "".join(text).strip(), text
    print("streaming:", repr("".join(text)))


async def samples(c, model):
    job = await c.submit(
        model, prompt="Once upon a time", max_tokens=8, n=2, temperature=0.9, seed=5
    )
    ends = {}
    async for ev in job:
        if isinstance(ev, Done):
            ends[ev.choice] = ev
    assert sorted(ends) == [0, 1], ends
    print("samples: two samples ended")


async def constraint(c, model):
    schema = {
        "type": "object",
        "properties": {"capital": {"enum": ["Paris", "London", "Berlin"]}, "river": {"type": "boolean"}},
        "required": ["capital", "river"],
        "additionalProperties": False,
    }
    text = await c.generate(
        model,
        messages=ask("What is the capital of France, and does a river cross it? Answer in JSON."),
        max_tokens=64,
        constraint={"type": "json_schema", "schema": json.dumps(schema)},
    )
    value = json.loads(text)
    jsonschema.validate(value, schema)
    print("constraint:", text)


async def cancel(c, model):
    job = await c.submit(model, prompt="Count: one, two,", max_tokens=2000, ignore_eos=True)
    tokens = 0
    try:
        async for ev in job:
            if isinstance(ev, Tokens):
                tokens += len(ev.ids)
                if tokens >= 3:
                    await job.cancel()
        raise AssertionError("a cancelled job ended without an error")
    except JobFailed as e:
        assert e.error_class == "cancelled", e
        assert e.request_id == job.request_id
    assert 3 <= tokens < 2000, tokens
    print("cancel: cancelled after", tokens, "tokens")


async def errors(c, model):
    for fields, cls in [
        ({"model": "no-such-model", "prompt": "hi"}, "unknown_model"),
        ({"model": model, "prompt": "hi", "temperature": -1.0}, "invalid_request"),
        ({"model": model, "prompt": "hi", "max_tokens": 0}, "invalid_request"),
        ({"model": model, "prompt": "hi", "constraint": {"type": "regex", "pattern": "("}}, "invalid_request"),
    ]:
        m = fields.pop("model")
        try:
            await c.submit(m, **fields)
            raise AssertionError(f"accepted {fields}")
        except Rejected as e:
            assert e.error_class == cls, (fields, e)
    try:
        await c.submit(model, prompt="hi", temprature=0.5)
        raise AssertionError("an unknown field was sent")
    except TypeError as e:
        assert "temprature" in str(e)
    print("errors: typed")


async def worker_lost(c, model):
    job = await c.submit(model, prompt="A long story:", max_tokens=400, ignore_eos=True)
    try:
        async for ev in job:
            if isinstance(ev, Tokens) and not getattr(job, "_kill_sent", False):
                job._kill_sent = True
                print("KILL", flush=True)
        raise AssertionError("the job ended normally")
    except JobFailed as e:
        assert e.error_class == "worker_lost", e
    print("worker_lost: ended with worker_lost")


SCENARIOS = {
    "fields": fields_match_the_schema,
    "streaming": streaming,
    "samples": samples,
    "constraint": constraint,
    "cancel": cancel,
    "errors": errors,
    "worker_lost": worker_lost,
}


async def main():
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("model")
    p.add_argument("--user")
    p.add_argument("--password")
    p.add_argument("--tls-ca")
    p.add_argument("--inbox-prefix")
    p.add_argument("--only", default=",".join(k for k in SCENARIOS if k != "worker_lost"))
    a = p.parse_args()
    c = await Client.connect(
        a.url,
        user=a.user,
        password=a.password,
        tls_ca=a.tls_ca,
        inbox_prefix=a.inbox_prefix,
        on_message=validate,
    )
    async with c:
        for name in a.only.split(","):
            await SCENARIOS[name](c, a.model)
    assert CHECKED.get("StreamEvent", 0) > 0 and CHECKED.get("GenerateReply", 0) > 0, CHECKED
    print("validated against the schemas:", CHECKED, flush=True)


asyncio.run(main())
