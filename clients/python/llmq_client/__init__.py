"""llmq's Python client: generation jobs over NATS (protocol v1, docs/protocol.md)."""

from .client import (
    ADDED_AFTER_V1,
    REQUEST_FIELDS,
    Client,
    Done,
    Job,
    JobFailed,
    LlmqError,
    PrefillProgress,
    Queued,
    Rejected,
    Tokens,
)

__all__ = [
    "ADDED_AFTER_V1",
    "REQUEST_FIELDS",
    "Client",
    "Done",
    "Job",
    "JobFailed",
    "LlmqError",
    "PrefillProgress",
    "Queued",
    "Rejected",
    "Tokens",
]
