"""llmq's NATS protocol v1 from Python: submit a generation job, read its events, cancel it.

Every message is MessagePack with named fields; enums are tagged by `type` (docs/protocol.md,
and the JSON Schemas in docs/protocol/v1). A job's events come on an inbox of the client's own,
subscribed before the job is submitted (core NATS does not replay). The events of a job are
numbered (`seq`): a gap means some were lost, and the job ends with `worker_lost`; a stream
silent for `silence_s` is asked about on `llm.v1.job.state`, kept waiting while intake answers
`pending`, and ended with `worker_lost` when intake answers `gone` (its terminal event was
lost) or when nothing has shown it alive for `bound_s`. A job the client stops following is
cancelled, so that no worker goes on with it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ssl
import time
from typing import Any, AsyncIterator, Optional, Sequence, Union

import msgpack
import nats
from nats.errors import TimeoutError as NatsTimeout

GENERATE = "llm.v1.generate"
CANCEL = "llm.v1.cancel"
JOB_STATE = "llm.v1.job.state"

#: A job handed back by a stopping worker and run by another: its events continue the stream
#: (llmq_protocol::SEQ_FROM_ANOTHER_WORKER).
SEQ_FROM_ANOTHER_WORKER = 2**64 - 1

#: The request fields a job may set (every GenerateRequest field but `stream_subject`, which the
#: client sets, and `requires`, which it fills in).
REQUEST_FIELDS = (
    "prompt",
    "messages",
    "prompt_ids",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
    "top_logprobs",
    "cache_salt",
    "require_worker",
    "constraint",
    "n",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
)

#: Fields added after v1's first ones: a request that sets one names it in `requires`, so that
#: an intake from before it refuses the request rather than generate without it.
ADDED_AFTER_V1 = ("constraint", "n", "tools", "tool_choice", "parallel_tool_calls")


class LlmqError(Exception):
    """A refused request or a job that ended with an error; `error_class` is one of protocol
    v1's classes (invalid_request, unknown_model, prompt_too_long, queue_full, no_worker,
    never_fits, cancelled, worker_lost, constraint_failed, internal)."""

    def __init__(self, error_class: str, message: str, request_id: Optional[str] = None):
        super().__init__(f"{error_class}: {message}")
        self.error_class = error_class
        self.message = message
        self.request_id = request_id


class Rejected(LlmqError):
    """Intake refused the request: nothing was queued and no event will come."""


class JobFailed(LlmqError):
    """The job (or one of its samples, `choice`) ended with an error event."""

    def __init__(self, error_class: str, message: str, request_id: str, choice: int = 0):
        super().__init__(error_class, message, request_id)
        self.choice = choice


@dataclasses.dataclass
class Queued:
    """Waiting for admission in a worker's queue; `position` 0 is next."""

    position: int
    choice: int = 0


@dataclasses.dataclass
class PrefillProgress:
    """Prompt tokens prefilled so far (the last one has done == total)."""

    done: int
    total: int
    choice: int = 0


@dataclasses.dataclass
class Tokens:
    """The tokens of one tick, with the text they complete (and logprobs when asked for)."""

    ids: list
    text: str
    logprobs: list
    choice: int = 0


@dataclasses.dataclass
class Done:
    """A sample ended normally: why, its token counts and where its time went."""

    finish_reason: str
    usage: dict
    timings: dict
    choice: int = 0


Event = Union[Queued, PrefillProgress, Tokens, Done]


def _event(raw: dict, choice: int) -> Union[Event, dict]:
    kind = raw.get("type")
    if kind == "queued":
        return Queued(raw["position"], choice)
    if kind == "prefill_progress":
        return PrefillProgress(raw["done"], raw["total"], choice)
    if kind == "tokens":
        return Tokens(list(raw["ids"]), raw["text"], list(raw.get("logprobs") or []), choice)
    if kind == "done":
        return Done(raw["finish_reason"], raw["usage"], raw["timings"], choice)
    return raw  # "error", handled by the caller; an unknown kind is passed on as it came


def encode(message: dict) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def decode(payload: bytes) -> Any:
    return msgpack.unpackb(payload, raw=False)


class Job:
    """One accepted request: iterate over it for its events (`Queued`, `PrefillProgress`,
    `Tokens`, `Done`, with their sample's `choice`); a sample that ends with an error raises
    `JobFailed`. Iteration ends once every sample has ended."""

    def __init__(self, client: "Client", sub, accepted: dict, samples: int, on_message=None):
        self._client = client
        self._sub = sub
        self.request_id: str = accepted["request_id"]
        self.stream_subject: str = accepted["stream_subject"]
        self.tool_syntax: Optional[str] = accepted.get("tool_syntax")
        self.job_seq: Optional[int] = accepted.get("job_seq")
        self.samples = samples
        self._on_message = on_message
        self._next_seq = 0
        self._open = set(range(samples))
        self._finished = False

    async def cancel(self) -> None:
        """Asks every worker to drop the job; its stream then ends with `cancelled`."""
        await self._client.cancel(self.request_id)

    async def text(self) -> str:
        """The first sample's whole text (every event read until the job ends)."""
        parts = []
        async for ev in self:
            if isinstance(ev, Tokens) and ev.choice == 0:
                parts.append(ev.text)
        return "".join(parts)

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._events()

    async def _events(self) -> AsyncIterator[Event]:
        try:
            while self._open:
                raw = await self._next_message()
                if self._on_message is not None:
                    self._on_message("StreamEvent", raw)
                seq = raw["seq"]
                if seq != SEQ_FROM_ANOTHER_WORKER:
                    if seq != self._next_seq:
                        await self._lost(
                            f"events {self._next_seq} to {seq - 1} of this stream were lost on "
                            "the way (a NATS reconnect?)"
                        )
                    self._next_seq += 1
                choice = raw.get("choice") or 0
                ev = _event(raw["event"], choice)
                if isinstance(ev, dict) and ev.get("type") == "error":
                    self._open.discard(choice)
                    err = ev["error"]
                    if self._open:
                        # The other samples would run on for nobody.
                        await self.cancel()
                    self._end()
                    raise JobFailed(err["class"], err["message"], self.request_id, choice)
                if isinstance(ev, Done):
                    self._open.discard(choice)
                if isinstance(ev, dict):
                    continue  # an event kind newer than this client
                yield ev
        finally:
            if self._open and not self._finished:
                # Abandoned mid-stream: no worker should go on with it.
                await self.cancel()
            self._end()

    async def _next_message(self) -> dict:
        last_alive = time.monotonic()
        while True:
            try:
                msg = await self._sub.next_msg(timeout=self._client.silence_s)
                return decode(msg.data)
            except NatsTimeout:
                pass
            state = await self._client.job_state(self.request_id, self.job_seq)
            now = time.monotonic()
            if state == "pending":
                last_alive = now
            elif state == "gone":
                await self._lost(
                    "the job ended or was lost, and its terminal event never reached this client"
                )
            elif now - last_alive > self._client.bound_s:
                await self._lost(
                    f"nothing showed this request alive for {self._client.bound_s:.0f} s"
                )

    async def _lost(self, why: str) -> None:
        await self.cancel()
        self._end()
        raise JobFailed("worker_lost", why, self.request_id)

    def _end(self) -> None:
        if not self._finished:
            self._finished = True
            self._open.clear()
            asyncio.ensure_future(self._sub.unsubscribe())


class Client:
    """A connection to llmq's NATS. `connect` with the server's URL and, for a stack whose NATS
    requires it (the compose stack), a user and password, TLS (a CA file or an `ssl.SSLContext`)
    and the inbox prefix that user may read (`_INBOX.<user>`)."""

    def __init__(self, nc, silence_s: float, bound_s: float, on_message=None):
        self.nc = nc
        self.silence_s = silence_s
        self.bound_s = bound_s
        self._on_message = on_message

    @classmethod
    async def connect(
        cls,
        servers: Union[str, Sequence[str]] = "nats://127.0.0.1:4222",
        *,
        user: Optional[str] = None,
        password: Optional[str] = None,
        tls_ca: Optional[str] = None,
        tls: Optional[ssl.SSLContext] = None,
        tls_hostname: Optional[str] = None,
        inbox_prefix: Optional[str] = None,
        name: str = "llmq-python",
        silence_s: float = 5.0,
        bound_s: float = 120.0,
        on_message=None,
    ) -> "Client":
        """`on_message(kind, message)`, when given, sees every message received, decoded (kind:
        `GenerateReply`, `StreamEvent`, `JobState`): tests validate them against the schemas."""
        if tls is None and tls_ca is not None:
            tls = ssl.create_default_context(cafile=tls_ca)
        options: dict = {"name": name, "allow_reconnect": True, "max_reconnect_attempts": -1}
        if user is not None:
            options.update(user=user, password=password)
        if tls is not None:
            options["tls"] = tls
            if tls_hostname is not None:
                options["tls_hostname"] = tls_hostname
        if inbox_prefix is not None:
            options["inbox_prefix"] = inbox_prefix
        nc = await nats.connect(servers, **options)
        return cls(nc, silence_s, bound_s, on_message)

    async def close(self) -> None:
        await self.nc.drain()

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def submit(self, model: str, *, timeout_s: float = 10.0, **fields) -> Job:
        """Submits a job for `model` with any of REQUEST_FIELDS (one of `prompt`, `messages`
        or `prompt_ids`); `messages` are `{"role", "content"}` maps. Returns the accepted
        `Job`, subscribed to its events; raises `Rejected` when intake refuses it."""
        unknown = sorted(set(fields) - set(REQUEST_FIELDS))
        if unknown:
            raise TypeError(f"unknown request fields {unknown} (known: {list(REQUEST_FIELDS)})")
        request = {k: v for k, v in fields.items() if v is not None}
        request["model"] = model
        requires = [f for f in ADDED_AFTER_V1 if f in request]
        if requires:
            request["requires"] = requires
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        request["stream_subject"] = inbox
        try:
            msg = await self.nc.request(GENERATE, encode(request), timeout=timeout_s)
        except BaseException:
            await sub.unsubscribe()
            raise
        reply = decode(msg.data)
        if self._on_message is not None:
            self._on_message("GenerateReply", reply)
        if reply.get("type") != "accepted":
            await sub.unsubscribe()
            err = reply.get("error") or {"class": "internal", "message": repr(reply)}
            raise Rejected(err["class"], err["message"])
        return Job(self, sub, reply, max(int(request.get("n") or 1), 1), self._on_message)

    async def generate(self, model: str, **fields) -> str:
        """Submits a job and returns its (first sample's) text."""
        job = await self.submit(model, **fields)
        return await job.text()

    async def cancel(self, request_id: str) -> None:
        await self.nc.publish(CANCEL, encode({"request_id": request_id}))
        await self.nc.flush()

    async def job_state(self, request_id: str, job_seq: Optional[int]) -> Optional[str]:
        """Whether intake still has the job in the jobs stream (`pending`) or not (`gone`);
        None when it did not answer in time or cannot be asked (no `job_seq`)."""
        if job_seq is None:
            return None
        query = encode({"request_id": request_id, "job_seq": job_seq})
        try:
            msg = await self.nc.request(JOB_STATE, query, timeout=2.0)
        except (NatsTimeout, nats.errors.NoRespondersError):
            return None
        state = decode(msg.data)
        if self._on_message is not None:
            self._on_message("JobState", state)
        return state
