"""Agent frameworks as their users call them, against llmq's gateway (run by
services/cli/tests/gateway.rs, in set-up's .cache/pyagents venv).

Usage: agent_frameworks.py BASE_URL MODEL

Each asks for one pydantic model, with an enum, a bounded list and a nested object, in every
way the framework has of asking: instructor's tool, strict tool, JSON-schema and JSON modes;
langchain-openai's `with_structured_output` by JSON schema, function calling and JSON mode;
the `openai` client's own `parse` and strict function tools. Every answer must parse and
validate (the frameworks validate with pydantic and raise otherwise). Then a multi-turn tool
round trip through `bind_tools`, named and `required` tool choices streamed and not, and a
call cut by `max_tokens`, which must end with finish_reason "length", the complete calls only,
and no call syntax in the content. Exits non-zero on the first failed check.
"""
import enum
import json
import sys
from typing import Annotated, List

import instructor
import openai
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from openai import OpenAI
from pydantic import BaseModel, Field

base, model = sys.argv[1], sys.argv[2]
client = OpenAI(base_url=f"{base}/v1", api_key="not-needed", max_retries=0, timeout=300)


class Priority(str, enum.Enum):
    low = "low"
    medium = "medium"
    high = "high"


class Contact(BaseModel):
    name: str = Field(max_length=40)
    email: str = Field(max_length=60)


class Ticket(BaseModel):
    """A support ticket."""

    summary: str = Field(max_length=80, description="one line")
    priority: Priority
    tags: List[Annotated[str, Field(max_length=20)]] = Field(min_length=1, max_length=3)
    contact: Contact


ASK = "File a support ticket: Ada Lovelace (ada@example.com) cannot log in since this morning; it is urgent."
# JSON mode carries no schema: the request says what the object looks like, as OpenAI's own
# JSON mode asks of its users.
ASK_JSON = (
    "Ada Lovelace (ada@example.com) cannot log in since this morning; it is urgent. Write the support ticket as "
    'JSON in this form: {"summary": "Cannot log in", "priority": "high", "tags": ["login"], '
    '"contact": {"name": "Ada Lovelace", "email": "ada@example.com"}}'
)


def check(name, ticket):
    assert isinstance(ticket, Ticket), (name, ticket)
    Ticket.model_validate(ticket.model_dump())
    print(f"{name}: {ticket.model_dump_json()}", flush=True)


# instructor: each mode that sends the schema (tools, strict tools, JSON schema), and JSON mode.
for mode, ask in [
    (instructor.Mode.TOOLS, ASK),
    (instructor.Mode.TOOLS_STRICT, ASK),
    (instructor.Mode.JSON_SCHEMA, ASK),
    (instructor.Mode.JSON, ASK_JSON),
]:
    ic = instructor.from_openai(client, mode=mode)
    got = ic.chat.completions.create(model=model, response_model=Ticket, messages=[{"role": "user", "content": ask}], max_tokens=300, max_retries=0)
    check(f"instructor {mode.name}", got)

# langchain-openai: with_structured_output in each of its methods.
llm = ChatOpenAI(base_url=f"{base}/v1", api_key="not-needed", model=model, max_tokens=300, temperature=0, max_retries=0)
for method, ask in [("json_schema", ASK), ("function_calling", ASK), ("json_mode", ASK_JSON)]:
    check(f"langchain {method}", llm.with_structured_output(Ticket, method=method).invoke(ask))

# The openai client's own structured outputs: parse() with a pydantic model (a strict JSON
# schema) and a strict function tool.
parsed = client.chat.completions.parse(model=model, messages=[{"role": "user", "content": ASK}], response_format=Ticket, max_tokens=300)
check("openai parse", parsed.choices[0].message.parsed)
parsed = client.chat.completions.parse(
    model=model,
    messages=[{"role": "user", "content": ASK}],
    tools=[openai.pydantic_function_tool(Ticket)],
    tool_choice={"type": "function", "function": {"name": "Ticket"}},
    max_tokens=300,
)
calls = parsed.choices[0].message.tool_calls
assert len(calls) == 1 and parsed.choices[0].finish_reason == "tool_calls", parsed
check("openai strict tool", calls[0].function.parsed_arguments)


# A multi-turn tool round trip with langchain: the call, its result, then the answer.
@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny, 21 C in {city}"


messages = [HumanMessage("What is the weather in Paris?")]
ai = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(messages)
assert len(ai.tool_calls) == 1 and ai.tool_calls[0]["name"] == "get_weather", ai
assert isinstance(ai.tool_calls[0]["args"].get("city"), str), ai.tool_calls
assert ai.response_metadata["finish_reason"] == "tool_calls", ai.response_metadata
messages += [ai, ToolMessage(get_weather.invoke(ai.tool_calls[0]["args"]), tool_call_id=ai.tool_calls[0]["id"])]
final = llm.bind_tools([get_weather]).invoke(messages)
assert final.response_metadata["finish_reason"] in ("stop", "length", "tool_calls"), final.response_metadata
assert isinstance(final.content, str) and (final.content or final.tool_calls), final
print(f"langchain tool round trip: {ai.tool_calls[0]['args']} -> {final.content!r}", flush=True)

# Named and required choices make exactly one call and end, streamed or not; with parallel
# calls allowed, `required` may end after any complete call.
weather_tool = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]},
    },
}
ask = [{"role": "user", "content": "What is the weather in Paris and in Rome?"}]


def streamed(**kw):
    """A streamed chat's content, whole calls and finish reason."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=model, messages=ask, tools=[weather_tool], stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"name": "", "arguments": ""})
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    return content, list(calls.values()), finish


for choice, parallel in [({"type": "function", "function": {"name": "get_weather"}}, None), ("required", False), ("required", True)]:
    kw = {"tool_choice": choice, "max_tokens": 200}
    if parallel is not None:
        kw["parallel_tool_calls"] = parallel
    # A model that goes on calling past max_tokens ends with "length" and its complete calls.
    ends = ("tool_calls",) if not parallel else ("tool_calls", "length")
    whole = client.chat.completions.create(model=model, messages=ask, tools=[weather_tool], **kw)
    m = whole.choices[0]
    assert m.finish_reason in ends, (choice, parallel, whole)
    assert len(m.message.tool_calls) >= 1 and (parallel or len(m.message.tool_calls) == 1), (choice, parallel, whole)
    assert not m.message.content, (choice, parallel, whole)
    for call in m.message.tool_calls:
        assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}, call
    content, calls, finish = streamed(**kw)
    assert finish in ends and content == "" and (parallel or len(calls) == 1), (choice, parallel, content, calls, finish)
    assert [c["name"] for c in calls] == [c.function.name for c in m.message.tool_calls], (calls, m.message.tool_calls)
    print(f"tool_choice {choice} parallel {parallel}: {len(calls)} call(s), streamed and not", flush=True)

# A call cut by max_tokens: finish_reason "length", no call syntax in the content, streamed or
# not; the calls that were complete (none here) come back.
for stream in (False, True):
    kw = {"tool_choice": "required", "max_tokens": 6}
    if stream:
        content, calls, finish = streamed(**kw)
    else:
        r = client.chat.completions.create(model=model, messages=ask, tools=[weather_tool], **kw).choices[0]
        content, calls, finish = r.message.content or "", r.message.tool_calls or [], r.finish_reason
    assert finish == "length" and content == "" and calls == [], (stream, content, calls, finish)
    print(f"a cut call (stream {stream}): finish length, no content, no call", flush=True)

print("AGENT FRAMEWORKS OK")
