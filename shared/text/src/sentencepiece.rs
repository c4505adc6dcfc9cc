//! SentencePiece's `tokenizer.model` (a protobuf `ModelProto`), for Hugging Face directories
//! that ship it instead of `tokenizer.json` (Llama 2, Mistral). It carries what GGUF's
//! `tokenizer.ggml.*` metadata carries, so it is turned into that metadata and rebuilt by the
//! same code as a GGUF vocabulary. Only BPE models are served (Unigram ones are refused).

use std::collections::HashMap;
use std::path::Path;

use crate::error::{Error, Result};
use crate::gguf::Value;

/// A piece's type, numbered as SentencePiece and GGUF's `token_type` both number it.
pub const NORMAL: i32 = 1;

#[derive(Debug, Clone, PartialEq)]
pub struct Piece {
    pub text: String,
    pub score: f32,
    pub kind: i32,
}

/// The parts of a `ModelProto` a tokenizer needs.
#[derive(Debug, Clone)]
pub struct SentencePieceModel {
    pub pieces: Vec<Piece>,
    /// `TrainerSpec.model_type`: 1 Unigram, 2 BPE, 3 word, 4 char.
    pub model_type: i32,
    pub unk_id: i32,
    pub bos_id: i32,
    pub eos_id: i32,
}

const BPE: i32 = 2;

impl SentencePieceModel {
    pub fn read(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| Error::io(path, e))?;
        Self::parse(&bytes)
            .map_err(|m| Error::format(path, format!("not a SentencePiece model: {m}")))
    }

    pub fn parse(bytes: &[u8]) -> std::result::Result<Self, String> {
        // TrainerSpec's defaults, for fields the file leaves out.
        let mut m = SentencePieceModel {
            pieces: vec![],
            model_type: 1,
            unk_id: 0,
            bos_id: 1,
            eos_id: 2,
        };
        let mut r = Reader(bytes);
        while let Some((field, v)) = r.field()? {
            match (field, v) {
                (1, Wire::Bytes(b)) => m.pieces.push(parse_piece(b)?),
                (2, Wire::Bytes(b)) => {
                    let mut t = Reader(b);
                    while let Some((f, v)) = t.field()? {
                        match (f, v) {
                            (3, Wire::Varint(x)) => m.model_type = x as i32,
                            (40, Wire::Varint(x)) => m.unk_id = x as i32,
                            (41, Wire::Varint(x)) => m.bos_id = x as i32,
                            (42, Wire::Varint(x)) => m.eos_id = x as i32,
                            _ => {}
                        }
                    }
                }
                _ => {}
            }
        }
        if m.pieces.is_empty() {
            return Err("no pieces".into());
        }
        Ok(m)
    }

    /// The `tokenizer.ggml.*` metadata llama.cpp's converter writes for this model.
    pub fn to_gguf_metadata(&self, path: &Path) -> Result<HashMap<String, Value>> {
        if self.model_type != BPE {
            return Err(Error::Tokenizer {
                path: path.into(),
                message: format!(
                    "SentencePiece model type {} is not supported (only BPE, type 2)",
                    self.model_type
                ),
            });
        }
        let key = |k: &str| format!("tokenizer.ggml.{k}");
        let mut md = HashMap::new();
        md.insert(key("model"), Value::Str("llama".into()));
        md.insert(
            key("tokens"),
            Value::Array(
                self.pieces
                    .iter()
                    .map(|p| Value::Str(p.text.clone()))
                    .collect(),
            ),
        );
        md.insert(
            key("scores"),
            Value::Array(self.pieces.iter().map(|p| Value::F32(p.score)).collect()),
        );
        md.insert(
            key("token_type"),
            Value::Array(self.pieces.iter().map(|p| Value::I32(p.kind)).collect()),
        );
        let ids = [
            ("unknown_token_id", self.unk_id),
            ("bos_token_id", self.bos_id),
            ("eos_token_id", self.eos_id),
        ];
        for (k, id) in ids {
            if (0..self.pieces.len() as i32).contains(&id) {
                md.insert(key(k), Value::U32(id as u32));
            }
        }
        Ok(md)
    }
}

fn parse_piece(bytes: &[u8]) -> std::result::Result<Piece, String> {
    let mut p = Piece {
        text: String::new(),
        score: 0.0,
        kind: NORMAL,
    };
    let mut r = Reader(bytes);
    while let Some((field, v)) = r.field()? {
        match (field, v) {
            (1, Wire::Bytes(b)) => {
                p.text = String::from_utf8(b.to_vec()).map_err(|_| "a piece is not UTF-8")?
            }
            (2, Wire::Fixed32(x)) => p.score = f32::from_bits(x),
            (3, Wire::Varint(x)) => p.kind = x as i32,
            _ => {}
        }
    }
    Ok(p)
}

/// One field's value in protobuf's wire format.
enum Wire<'a> {
    Varint(u64),
    Fixed64,
    Bytes(&'a [u8]),
    Fixed32(u32),
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], String> {
        if self.0.len() < n {
            return Err("truncated".into());
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn varint(&mut self) -> std::result::Result<u64, String> {
        let mut v = 0u64;
        for shift in (0..70).step_by(7) {
            let b = self.take(1)?[0];
            v |= u64::from(b & 0x7f).checked_shl(shift).unwrap_or(0);
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err("varint longer than 10 bytes".into())
    }

    /// The next field number and value, or None at the end.
    fn field(&mut self) -> std::result::Result<Option<(u64, Wire<'a>)>, String> {
        if self.0.is_empty() {
            return Ok(None);
        }
        let tag = self.varint()?;
        let value = match tag & 7 {
            0 => Wire::Varint(self.varint()?),
            1 => {
                self.take(8)?;
                Wire::Fixed64
            }
            2 => {
                let n = usize::try_from(self.varint()?).map_err(|_| "length out of range")?;
                Wire::Bytes(self.take(n)?)
            }
            5 => Wire::Fixed32(u32::from_le_bytes(
                self.take(4)?.try_into().expect("4 bytes"),
            )),
            w => return Err(format!("wire type {w} not supported")),
        };
        Ok(Some((tag >> 3, value)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn varint(mut v: u64, out: &mut Vec<u8>) {
        loop {
            let b = (v & 0x7f) as u8;
            v >>= 7;
            if v == 0 {
                out.push(b);
                return;
            }
            out.push(b | 0x80);
        }
    }

    fn bytes_field(field: u64, b: &[u8], out: &mut Vec<u8>) {
        varint(field << 3 | 2, out);
        varint(b.len() as u64, out);
        out.extend_from_slice(b);
    }

    fn piece(text: &str, score: f32, kind: Option<u64>) -> Vec<u8> {
        let mut p = vec![];
        bytes_field(1, text.as_bytes(), &mut p);
        varint(2 << 3 | 5, &mut p);
        p.extend_from_slice(&score.to_le_bytes());
        if let Some(k) = kind {
            varint(3 << 3, &mut p);
            varint(k, &mut p);
        }
        p
    }

    #[test]
    fn reads_pieces_and_trainer_ids() {
        let mut m = vec![];
        bytes_field(1, &piece("<unk>", 0.0, Some(2)), &mut m);
        bytes_field(1, &piece("\u{2581}a", -1.5, None), &mut m);
        let mut spec = vec![];
        varint(3 << 3, &mut spec);
        varint(2, &mut spec);
        varint(41 << 3, &mut spec);
        varint(u64::MAX, &mut spec); // bos_id = -1: absent
        bytes_field(2, &spec, &mut m);
        let sp = SentencePieceModel::parse(&m).unwrap();
        assert_eq!(
            sp.pieces[0],
            Piece {
                text: "<unk>".into(),
                score: 0.0,
                kind: 2
            }
        );
        assert_eq!(
            sp.pieces[1],
            Piece {
                text: "\u{2581}a".into(),
                score: -1.5,
                kind: NORMAL
            }
        );
        assert_eq!(
            (sp.model_type, sp.unk_id, sp.bos_id, sp.eos_id),
            (2, 0, -1, 2)
        );
        let md = sp.to_gguf_metadata(Path::new("t")).unwrap();
        assert!(md.contains_key("tokenizer.ggml.unknown_token_id"));
        assert!(!md.contains_key("tokenizer.ggml.bos_token_id"));
        assert!(
            !md.contains_key("tokenizer.ggml.eos_token_id"),
            "eos 2 is past the two pieces"
        );
    }

    #[test]
    fn truncated_and_unigram_models_are_errors() {
        let mut m = vec![];
        bytes_field(1, &piece("a", 0.0, None), &mut m);
        assert!(SentencePieceModel::parse(&m[..m.len() - 2])
            .unwrap_err()
            .contains("truncated"));
        let sp = SentencePieceModel::parse(&m).unwrap();
        let err = sp.to_gguf_metadata(Path::new("t")).unwrap_err().to_string();
        assert!(err.contains("model type 1"), "{err}");
    }
}
