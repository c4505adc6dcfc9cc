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

# Tool calling: with tool_choice "required" (or a named function) the answer is calls whose
# arguments validate against their function's schema, streamed and not; the call and the
# tool's result go back as the next turn, and the model answers in text. (With parallel calls
# a model this small repeats its calls until max_tokens: one call per answer here.)
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]},
        }, "required": ["city", "unit"], "additionalProperties": False},
    }},
    {"type": "function", "function": {
        "name": "get_population", "description": "How many people live in a country.",
        "parameters": {"type": "object", "properties": {"country": {"type": "string", "maxLength": 30}}, "required": ["country"], "additionalProperties": False},
    }},
]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ask = [{"role": "user", "content": "What is the weather in Paris?"}]
for choice in ["required", {"type": "function", "function": {"name": "get_population"}}]:
    called = client.chat.completions.create(model=model, messages=ask, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, max_tokens=120, temperature=0)
    c = called.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1 and not c.message.content, called
    for call in c.message.tool_calls:
        assert call.type == "function" and call.id, call
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])
    if isinstance(choice, dict):
        assert [t.function.name for t in c.message.tool_calls] == ["get_population"], c.message.tool_calls
    streamed_calls, finish = {}, None
    for chunk in client.chat.completions.create(model=model, messages=ask, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, max_tokens=120, temperature=0, stream=True):
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                entry = streamed_calls.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
            finish = ch.finish_reason or finish
    assert finish == "tool_calls", finish
    assert [(v["name"], json.loads(v["arguments"])) for _, v in sorted(streamed_calls.items())] == \
        [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls], (streamed_calls, c.message.tool_calls)
    print(f"tool_choice {choice}:", [(t.function.name, t.function.arguments) for t in c.message.tool_calls])
first = c.message.tool_calls[0]
second_turn = ask + [
    {"role": "assistant", "content": None, "tool_calls": [{"id": first.id, "type": "function", "function": {"name": first.function.name, "arguments": first.function.arguments}}]},
    {"role": "tool", "tool_call_id": first.id, "content": json.dumps({"population": 68000000})},
]
answer = client.chat.completions.create(model=model, messages=second_turn, tools=TOOLS, tool_choice="none", max_tokens=30, temperature=0)
assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls, answer
assert answer.choices[0].finish_reason in ("stop", "length"), answer
print("second turn:", repr(answer.choices[0].message.content))
for bad_choice in [{"type": "function", "function": {"name": "no_such_tool"}}, "sometimes"]:
    try:
        client.chat.completions.create(model=model, messages=ask, tools=TOOLS, tool_choice=bad_choice, max_tokens=5)
        raise AssertionError(f"tool_choice {bad_choice} accepted")
    except openai.BadRequestError as e:
        assert e.status_code == 400, e.body
print("bad tool_choice: 400")

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
