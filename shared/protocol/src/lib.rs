//! llmq's wire protocol, version 1: every NATS subject and every message, in one place.
//!
//! Invariants: payloads are MessagePack maps with named fields (`encode` uses
//! `rmp_serde::to_vec_named`, so adding or moving a field never shifts another); `decode`
//! refuses payloads over `MAX_MESSAGE_BYTES` before parsing; the version is in the subject, so
//! a v2 can run beside v1. Raw client requests ([`GenerateRequest`]) and validated jobs ([`Job`])
//! are different types: only intake turns one into the other. `workers` keeps the live
//! workers a service has heard from (their heartbeats), for intake and the gateway. `connect`
//! (feature `nats`) is how every llmq program connects: credentials, its own inboxes, TLS.
//! `watch` is how a client makes sure every request it follows ends, events lost or not.
//! [`schema`] is the protocol as JSON Schema, generated from these types.

#![deny(missing_docs)]

#[cfg(feature = "nats")]
pub mod connect;
pub mod messages;
pub mod prefill;
pub mod schema;
pub mod subjects;
#[cfg(feature = "nats")]
pub mod watch;
pub mod workers;

#[cfg(feature = "nats")]
pub use connect::connect;
pub use messages::*;

use serde::{de::DeserializeOwned, Serialize};

/// Largest payload any llmq message may have (a 32k-token prompt as text fits comfortably).
/// Below nats-server's default max_payload (1 MiB), so that an oversized request still reaches
/// intake and gets a typed error instead of being dropped by the server.
pub const MAX_MESSAGE_BYTES: usize = 512 << 10;

/// Why a payload could not be encoded or decoded.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    /// Larger than [`MAX_MESSAGE_BYTES`] (its size).
    #[error("message of {0} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")]
    TooLarge(usize),
    /// Not a MessagePack message of the expected type.
    #[error("undecodable message: {0}")]
    Decode(#[from] rmp_serde::decode::Error),
    /// A value MessagePack cannot hold.
    #[error("unencodable message: {0}")]
    Encode(#[from] rmp_serde::encode::Error),
}

/// Serialises a message as a MessagePack map with named fields.
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, ProtocolError> {
    let bytes = rmp_serde::to_vec_named(msg)?;
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(ProtocolError::TooLarge(bytes.len()));
    }
    Ok(bytes)
}

/// Parses a message, refusing oversized payloads before reading them.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ProtocolError> {
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(ProtocolError::TooLarge(bytes.len()));
    }
    Ok(rmp_serde::from_slice(bytes)?)
}
