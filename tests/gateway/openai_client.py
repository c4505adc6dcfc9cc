"""The official `openai` package against llmq's gateway (run by services/cli/tests/gateway.rs).

Usage: openai_client.py BASE_URL MODEL
Prints `CLOSED_EARLY=<request id>` for the stream it closes early, so that the harness can check
that the gateway cancelled that request on NATS. Exits non-zero on the first failed check.
"""
import json
import sys

import jsonschema
import openai
from openai import OpenAI

base, model = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=f"{base}/v1", api_key="not-needed", max_retries=0, timeout=120)

# A streamed chat completion: the answer mentions Paris; usage comes last when asked for.
stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "What is the capital of France?"}],
    max_tokens=24,
    stream=True,
    stream_options={"include_usage": True},
)
text, usage, finish = "", None, None
for chunk in stream:
    if chunk.usage is not None:
        usage = chunk.usage
    for choice in chunk.choices:
        text += choice.delta.content or ""
        finish = choice.finish_reason or finish
assert "Paris" in text, text
assert finish in ("stop", "length"), finish
assert usage is not None and usage.completion_tokens > 0 and usage.prompt_tokens > 0, usage
print("streamed chat:", repr(text), usage.completion_tokens, "tokens")

# A non-streamed completion.
done = client.completions.create(model=model, prompt="The capital of France is", max_tokens=6, temperature=0)
assert done.object == "text_completion" and len(done.choices) == 1, done
assert done.choices[0].text.strip(), done
assert done.usage.completion_tokens <= 6 and done.choices[0].finish_reason in ("stop", "length"), done
print("completion:", repr(done.choices[0].text))

# A non-streamed chat with logprobs: one entry per output token.
chat = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Say hello."}],
    max_tokens=5,
    logprobs=True,
    top_logprobs=2,
)
lp = chat.choices[0].logprobs.content
assert len(lp) == chat.usage.completion_tokens, (len(lp), chat.usage)
assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in lp), lp
print("chat with logprobs:", repr(chat.choices[0].message.content))

# An unknown model: a 404 with OpenAI's error body.
try:
    client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    raise AssertionError("unknown model accepted")
except openai.NotFoundError as e:
    assert e.status_code == 404 and e.body["code"] == "model_not_found", e.body
print("unknown model: 404")

# Structured output: each schema's answer, streamed and not, is JSON that validates (checked
# with the jsonschema package).
SCHEMAS = [
    ("person", "Describe a fictional person.", {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"], "additionalProperties": False},
        },
        "required": ["name", "age", "address"],
        "additionalProperties": False,
    }),
    ("fruits", "List three fruits.", {
        "type": "object",
        "properties": {"fruits": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 3, "maxItems": 3}},
        "required": ["fruits"],
        "additionalProperties": False,
    }),
    ("weather", "What is the weather like in Paris?", {
        "type": "object",
        "properties": {"sky": {"enum": ["sunny", "cloudy", "rainy"]}, "celsius": {"type": "number", "minimum": -40, "maximum": 50}},
        "required": ["sky", "celsius"],
        "additionalProperties": False,
    }),
]
for name, question, schema in SCHEMAS:
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": question + " Answer in JSON."}]
    whole = client.chat.completions.create(model=model, messages=messages, max_tokens=120, temperature=0, response_format=fmt)
    assert whole.choices[0].finish_reason == "stop", whole
    doc = json.loads(whole.choices[0].message.content)
    jsonschema.validate(doc, schema)
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(model=model, messages=messages, max_tokens=120, temperature=0, response_format=fmt, stream=True)
        if c.choices
    )
    assert json.loads(streamed) == doc, (streamed, doc)
    print(f"json_schema {name}:", json.dumps(doc))
obj = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Give me a short JSON object with a dog's name and age."}],
    max_tokens=200, temperature=0, response_format={"type": "json_object"},
)
assert obj.choices[0].finish_reason == "stop", obj
assert isinstance(json.loads(obj.choices[0].message.content), dict), obj
print("json_object:", obj.choices[0].message.content)
try:
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}}}
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], response_format=bad)
    raise AssertionError("an invalid schema was accepted")
except openai.BadRequestError as e:
    assert e.status_code == 400 and "schema" in e.body["message"], e.body
print("invalid schema: 400")

# Parallel samples: n=3 gives three choices, each ending on its own; streamed, each choice's
# deltas carry its index.
many = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Name an animal."}], max_tokens=8, temperature=1.0, seed=7, n=3,
)
assert sorted(c.index for c in many.choices) == [0, 1, 2], many
assert all(c.finish_reason in ("stop", "length") and c.message.content for c in many.choices), many
assert many.usage.completion_tokens <= 24, many.usage
print("n=3:", [c.message.content for c in many.choices])
parts, finished = {}, set()
for c in client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=6, temperature=1.0, seed=3, n=2, stream=True,
):
    for ch in c.choices:
        parts[ch.index] = parts.get(ch.index, "") + (ch.delta.content or "")
        if ch.finish_reason:
            finished.add(ch.index)
assert finished == {0, 1} and all(parts[i] for i in (0, 1)), (parts, finished)
print("n=2 streamed:", parts)

# A client that closes its stream early: the gateway must cancel the request.
stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Write a long story about the sea, with many details."}],
    max_tokens=400,
    stream=True,
)
seen = 0
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        seen += 1
        if seen == 3:
            break
stream.close()
print(f"CLOSED_EARLY={chunk.id.removeprefix('chatcmpl-')}", flush=True)
