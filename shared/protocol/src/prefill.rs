//! Prefill as a service: what a decode worker and a prefill worker exchange.
//!
//! The decode worker's scheduler stays the clock: it grants one chunk of a prompt at a time
//! ([`PrefillOrder::Grant`], on the prefill worker's `subjects::prefill_orders`), and the prefill
//! worker answers on the decode worker's `subjects::prefill_kv` with the chunk's KV, every
//! layer's keys and values for the chunk's positions, in pieces ([`KvPiece`]) small enough for
//! NATS, with a checksum of the whole chunk. Its first piece also says the chunk is computed,
//! so the next grant can go out while the rest of its KV is still on the way.
//!
//! Where the grant offers it ([`PrefillGrant::direct`]), the prefill worker sends the chunk's KV on
//! a TCP connection to the decode worker instead, with NATS still carrying the grants, drops,
//! failures and heartbeats: NATS relays every byte through its server, a few hundred MB/s,
//! where a prompt of 8,192 tokens at the 8b shape is a gigabyte of KV. On that connection each
//! chunk is a [`KvFrame`] (its length, then the frame in MessagePack) followed by the chunk's
//! bytes; the frame's arrival says the chunk is computed, and it carries the decoder's token,
//! known only from its grants.
//!
//! Invariants: a grant names the whole prompt and the chunk `[start, start + n)`; the prefill
//! worker holds a session per (decoder, key) and brings it to `start` first (from its prefix
//! cache, or by computing the missing positions), so any grant can be served, in any state. A
//! chunk's bytes are, layer after layer, that layer's keys then values, each
//! `[kv_heads, n, head_dim]` row-major in the model's dtype, or for a recurrent layer (a hybrid
//! model's) its state after the chunk, whole (`kv_layout` names its shapes). A session is
//! dropped on
//! [`PrefillOrder::Drop`], and when its decoder goes silent.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::WireError;

/// From a decode worker to a prefill worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum PrefillOrder {
    /// Compute a chunk of a prompt.
    Grant(PrefillGrant),
    /// The request is over (ended, cancelled, or prefilled elsewhere): forget its session.
    Drop {
        /// The decode worker that granted it.
        decoder: String,
        /// Its key for the request.
        key: u64,
    },
}

/// Compute positions `[start, start + n)` of `prompt` and send their KV to `decoder`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct PrefillGrant {
    /// The decode worker's id: the KV goes to `subjects::prefill_kv(decoder)`.
    pub decoder: String,
    /// The decode worker's key for the request (unique while it runs there).
    pub key: u64,
    /// Prefixes are shared only between requests of the same salt.
    pub salt: Option<String>,
    /// The whole prompt (so that the prefill worker can compute any positions before the chunk).
    pub prompt: Vec<u32>,
    /// The chunk's first position.
    pub start: u32,
    /// The chunk's tokens.
    pub n: u32,
    /// The decoder's KV layout (layers, KV heads, head size, dtype): a prefill worker whose
    /// model's differs refuses the grant.
    pub kv_layout: String,
    /// Where the decoder also takes the KV directly; absent: NATS pieces only (a prefill worker
    /// that cannot reach it sends those too).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub direct: Option<DirectKv>,
}

/// A decode worker's direct KV connection: where it listens (`host:port`) and the token its
/// frames must carry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct DirectKv {
    /// `host:port` the decode worker listens on.
    pub addr: String,
    /// The token each frame must carry (from this decode worker's grants).
    pub token: u64,
}

/// A chunk's KV on a direct connection: this frame, then `total_bytes` bytes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct KvFrame {
    /// The decode worker's token ([`DirectKv::token`]).
    pub token: u64,
    /// The request's key ([`PrefillGrant::key`]).
    pub key: u64,
    /// The chunk's first position.
    pub start: u32,
    /// The chunk's tokens.
    pub n: u32,
    /// Bytes that follow the frame.
    pub total_bytes: u64,
    /// Their [`kv_checksum`].
    pub checksum: u64,
    /// As [`KvPiece::sent_at_us`].
    pub sent_at_us: u64,
}

/// The longest encoded [`KvFrame`] a reader accepts.
pub const MAX_KV_FRAME: usize = 1024;

impl KvFrame {
    /// The frame as it goes on the connection: its length (4 bytes, little-endian), then its
    /// MessagePack.
    pub fn encode(&self) -> Result<Vec<u8>, crate::ProtocolError> {
        let body = crate::encode(self)?;
        let mut out = (body.len() as u32).to_le_bytes().to_vec();
        out.extend(body);
        Ok(out)
    }

    /// A frame's length from its 4 leading bytes, if a reader should accept it.
    pub fn length(prefix: [u8; 4]) -> Option<usize> {
        let n = u32::from_le_bytes(prefix) as usize;
        (n > 0 && n <= MAX_KV_FRAME).then_some(n)
    }
}

/// From a prefill worker to a decode worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum PrefillReply {
    /// A piece of a computed chunk's KV.
    Kv(KvPiece),
    /// The grant could not be served; the decode worker prefills the request itself.
    Failed {
        /// The request's key.
        key: u64,
        /// The chunk's first position.
        start: u32,
        /// Why.
        error: WireError,
    },
}

/// One piece of a chunk's KV.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct KvPiece {
    /// The request's key ([`PrefillGrant::key`]).
    pub key: u64,
    /// The chunk's first position.
    pub start: u32,
    /// The chunk's tokens.
    pub n: u32,
    /// This piece's index (0: the chunk is computed).
    pub piece: u32,
    /// Pieces of the chunk.
    pub pieces: u32,
    /// The whole chunk's bytes, and their `kv_checksum`.
    pub total_bytes: u64,
    /// The chunk's [`kv_checksum`].
    pub checksum: u64,
    /// When the prefill worker started sending the chunk (UNIX microseconds): the decoder's
    /// receipt of the last piece less this is the chunk's transfer time.
    pub sent_at_us: u64,
    /// This piece's bytes.
    pub data: Bytes,
}

/// Bytes as MessagePack's binary type (a `Vec<u8>` would be an array of integers).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Bytes(pub Vec<u8>);

impl JsonSchema for Bytes {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "Bytes".into()
    }

    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "description": "Raw bytes: MessagePack's bin type (no JSON type holds them).",
            "x-msgpack": "bin"
        })
    }
}

impl Serialize for Bytes {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.0)
    }
}

impl<'de> Deserialize<'de> for Bytes {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = Bytes;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("bytes")
            }
            fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Bytes, E> {
                Ok(Bytes(v.to_vec()))
            }
            fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Bytes, E> {
                Ok(Bytes(v))
            }
        }
        d.deserialize_byte_buf(Visitor)
    }
}

/// Data bytes per piece: with the header, well under `MAX_MESSAGE_BYTES`.
pub const KV_PIECE_BYTES: usize = 384 << 10;

/// The checksum a chunk's KV travels with: 64-bit words mixed by multiply and rotate (a
/// transport check against truncation and mix-ups, not a cryptographic hash).
pub fn kv_checksum(bytes: &[u8]) -> u64 {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut h = (bytes.len() as u64).wrapping_mul(K);
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        let x = u64::from_le_bytes(w.try_into().expect("8 bytes"));
        h = (h ^ x).wrapping_mul(K).rotate_left(29);
    }
    for &b in words.remainder() {
        h = (h ^ b as u64).wrapping_mul(K).rotate_left(29);
    }
    h ^ (h >> 32)
}

/// A chunk's KV cut into pieces.
pub fn kv_pieces(
    key: u64,
    start: u32,
    n: u32,
    sent_at_us: u64,
    bytes: &[u8],
) -> impl Iterator<Item = KvPiece> + '_ {
    let checksum = kv_checksum(bytes);
    let pieces = bytes.len().div_ceil(KV_PIECE_BYTES).max(1) as u32;
    (0..pieces).map(move |i| {
        let lo = (i as usize * KV_PIECE_BYTES).min(bytes.len());
        let hi = (lo + KV_PIECE_BYTES).min(bytes.len());
        KvPiece {
            key,
            start,
            n,
            piece: i,
            pieces,
            total_bytes: bytes.len() as u64,
            checksum,
            sent_at_us,
            data: Bytes(bytes[lo..hi].to_vec()),
        }
    })
}

/// Puts a chunk's pieces back together, in any order; checks sizes and the checksum.
#[derive(Debug, Default)]
pub struct KvAssembly {
    got: Vec<Option<Vec<u8>>>,
    total: u64,
    checksum: u64,
}

/// Why a chunk's pieces do not make its KV.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KvError {
    #[error("a piece does not belong with the others (piece {piece} of {pieces}, {total} bytes)")]
    /// A piece of another chunk, or out of range.
    Mismatch {
        /// Its index.
        piece: u32,
        /// Pieces it says the chunk has.
        pieces: u32,
        /// Bytes it says the chunk has.
        total: u64,
    },
    #[error("the chunk's KV is {got} bytes, its pieces said {want}")]
    /// The pieces' bytes do not add up.
    Size {
        /// Bytes received.
        got: u64,
        /// Bytes announced.
        want: u64,
    },
    /// The bytes do not match the checksum.
    #[error("the chunk's KV does not match its checksum")]
    Checksum,
}

impl KvAssembly {
    /// Adds a piece; the whole chunk once every piece is in.
    pub fn add(&mut self, p: KvPiece) -> Result<Option<Vec<u8>>, KvError> {
        if self.got.is_empty() {
            self.got = vec![None; p.pieces.max(1) as usize];
            self.total = p.total_bytes;
            self.checksum = p.checksum;
        }
        let bad = KvError::Mismatch {
            piece: p.piece,
            pieces: p.pieces,
            total: p.total_bytes,
        };
        if p.pieces as usize != self.got.len()
            || p.total_bytes != self.total
            || p.checksum != self.checksum
        {
            return Err(bad);
        }
        let slot = self.got.get_mut(p.piece as usize).ok_or(bad)?;
        *slot = Some(p.data.0);
        if self.got.iter().any(|g| g.is_none()) {
            return Ok(None);
        }
        let bytes: Vec<u8> = self.got.drain(..).flatten().flatten().collect();
        check_kv(&bytes, self.total, self.checksum)?;
        Ok(Some(bytes))
    }
}

/// Whether a chunk's bytes are the `total` bytes of `checksum` its sender announced.
pub fn check_kv(bytes: &[u8], total: u64, checksum: u64) -> Result<(), KvError> {
    if bytes.len() as u64 != total {
        return Err(KvError::Size {
            got: bytes.len() as u64,
            want: total,
        });
    }
    if kv_checksum(bytes) != checksum {
        return Err(KvError::Checksum);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_goes_on_the_connection_with_its_length_and_a_grant_may_lack_the_direct_offer() {
        let f = KvFrame {
            token: 7,
            key: 3,
            start: 256,
            n: 256,
            total_bytes: 1 << 27,
            checksum: 99,
            sent_at_us: 5,
        };
        let wire = f.encode().unwrap();
        let n = KvFrame::length(wire[..4].try_into().unwrap()).unwrap();
        assert_eq!(n, wire.len() - 4);
        assert_eq!(crate::decode::<KvFrame>(&wire[4..]).unwrap(), f);
        assert_eq!(
            KvFrame::length((MAX_KV_FRAME as u32 + 1).to_le_bytes()),
            None,
            "a reader refuses a long frame"
        );
        assert_eq!(KvFrame::length([0; 4]), None);
        // A grant from a decoder without the offer (an older one, or one that listens nowhere).
        #[derive(Serialize)]
        struct Older {
            decoder: String,
            key: u64,
            salt: Option<String>,
            prompt: Vec<u32>,
            start: u32,
            n: u32,
            kv_layout: String,
        }
        let old = Older {
            decoder: "d".into(),
            key: 1,
            salt: None,
            prompt: vec![1, 2],
            start: 0,
            n: 1,
            kv_layout: "l".into(),
        };
        let g: PrefillGrant = crate::decode(&crate::encode(&old).unwrap()).unwrap();
        assert_eq!(g.direct, None);
    }

    #[test]
    fn pieces_round_trip_in_any_order_and_through_messagepack() {
        let bytes: Vec<u8> = (0..(KV_PIECE_BYTES * 2 + 1000))
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        let mut pieces: Vec<KvPiece> = kv_pieces(3, 16, 8, 0, &bytes).collect();
        assert_eq!(pieces.len(), 3);
        pieces.reverse();
        let mut a = KvAssembly::default();
        let mut out = None;
        for p in pieces {
            let wire = crate::encode(&PrefillReply::Kv(p)).unwrap();
            assert!(wire.len() < crate::MAX_MESSAGE_BYTES);
            let PrefillReply::Kv(p) = crate::decode(&wire).unwrap() else {
                panic!("a piece")
            };
            out = a.add(p).unwrap();
        }
        assert_eq!(out.unwrap(), bytes);
    }

    #[test]
    fn a_corrupted_or_foreign_piece_is_refused() {
        let bytes = vec![5u8; KV_PIECE_BYTES + 10];
        let mut pieces: Vec<KvPiece> = kv_pieces(1, 0, 4, 0, &bytes).collect();
        pieces[1].data.0[3] ^= 1;
        let mut a = KvAssembly::default();
        assert_eq!(a.add(pieces[0].clone()).unwrap(), None);
        assert_eq!(a.add(pieces[1].clone()), Err(KvError::Checksum));
        let other: Vec<KvPiece> = kv_pieces(1, 0, 4, 0, &[1, 2, 3]).collect();
        let mut a = KvAssembly::default();
        a.add(pieces[0].clone()).unwrap();
        assert!(matches!(
            a.add(other[0].clone()),
            Err(KvError::Mismatch { .. })
        ));
    }
}
