//! GGUF (llama.cpp's model format) reader: header, metadata, tensor directory and tensor data.
//!
//! Invariants: everything is bounds-checked against the file's length before it is read, so a
//! truncated or corrupt file is an error naming the file and the problem, never a panic or
//! garbage. Tensor data is memory-mapped and decoded on demand; quantized blocks (Q8_0, Q4_0,
//! Q4_1) are dequantized to f32 here, in llama.cpp's block layouts.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;

use crate::error::{Error, Result};
use crate::quants;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;

/// A metadata value, as typed in the file.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    U64(u64),
    I64(i64),
    F64(f64),
    Array(Vec<Value>),
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) if v >= 0 => Some(v as u64),
            Value::I16(v) if v >= 0 => Some(v as u64),
            Value::I32(v) if v >= 0 => Some(v as u64),
            Value::I64(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// GGML tensor types this reader decodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
}

impl TensorType {
    fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => TensorType::F32,
            1 => TensorType::F16,
            2 => TensorType::Q4_0,
            3 => TensorType::Q4_1,
            6 => TensorType::Q5_0,
            7 => TensorType::Q5_1,
            8 => TensorType::Q8_0,
            10 => TensorType::Q2K,
            11 => TensorType::Q3K,
            12 => TensorType::Q4K,
            13 => TensorType::Q5K,
            14 => TensorType::Q6K,
            30 => TensorType::BF16,
            _ => return None,
        })
    }

    /// (elements per block, bytes per block)
    pub(crate) fn block(self) -> (u64, u64) {
        match self {
            TensorType::F32 => (1, 4),
            TensorType::F16 | TensorType::BF16 => (1, 2),
            TensorType::Q8_0 => (32, 34),
            TensorType::Q4_0 => (32, 18),
            TensorType::Q4_1 => (32, 20),
            TensorType::Q5_0 => (32, 22),
            TensorType::Q5_1 => (32, 24),
            TensorType::Q2K => (256, 84),
            TensorType::Q3K => (256, 110),
            TensorType::Q4K => (256, 144),
            TensorType::Q5K => (256, 176),
            TensorType::Q6K => (256, 210),
        }
    }

    /// ggml's name of the type.
    pub fn name(self) -> &'static str {
        match self {
            TensorType::F32 => "F32",
            TensorType::F16 => "F16",
            TensorType::BF16 => "BF16",
            TensorType::Q8_0 => "Q8_0",
            TensorType::Q4_0 => "Q4_0",
            TensorType::Q4_1 => "Q4_1",
            TensorType::Q5_0 => "Q5_0",
            TensorType::Q5_1 => "Q5_1",
            TensorType::Q2K => "Q2_K",
            TensorType::Q3K => "Q3_K",
            TensorType::Q4K => "Q4_K",
            TensorType::Q5K => "Q5_K",
            TensorType::Q6K => "Q6_K",
        }
    }

    /// Decodes whole blocks of this type to f32, appending to `out`.
    pub fn decode(self, bytes: &[u8], out: &mut Vec<f32>) {
        let per_block: fn(&[u8], &mut Vec<f32>) = match self {
            TensorType::F32 => {
                return out.extend(
                    bytes
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes(b.try_into().unwrap())),
                )
            }
            TensorType::F16 => {
                return out.extend(
                    bytes
                        .chunks_exact(2)
                        .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()),
                )
            }
            TensorType::BF16 => {
                return out.extend(
                    bytes
                        .chunks_exact(2)
                        .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()),
                )
            }
            TensorType::Q8_0 => quants::q8_0,
            TensorType::Q4_0 => quants::q4_0,
            TensorType::Q4_1 => quants::q4_1,
            TensorType::Q5_0 => quants::q5_0,
            TensorType::Q5_1 => quants::q5_1,
            TensorType::Q2K => quants::q2_k,
            TensorType::Q3K => quants::q3_k,
            TensorType::Q4K => quants::q4_k,
            TensorType::Q5K => quants::q5_k,
            TensorType::Q6K => quants::q6_k,
        };
        for blk in bytes.chunks_exact(self.block().1 as usize) {
            per_block(blk, out);
        }
    }
}

fn type_name(id: u32) -> String {
    let known = [
        (9, "Q8_1"),
        (15, "Q8_K"),
        (16, "IQ2_XXS"),
        (17, "IQ2_XS"),
        (18, "IQ3_XXS"),
        (19, "IQ1_S"),
        (20, "IQ4_NL"),
        (21, "IQ3_S"),
        (22, "IQ2_S"),
        (23, "IQ4_XS"),
        (24, "I8"),
        (25, "I16"),
        (26, "I32"),
        (27, "I64"),
        (28, "F64"),
        (29, "IQ1_M"),
        (34, "TQ1_0"),
        (35, "TQ2_0"),
    ];
    known
        .iter()
        .find(|(k, _)| *k == id)
        .map(|(_, n)| n.to_string())
        .unwrap_or(format!("#{id}"))
}

#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// Row-major shape, outermost first (GGUF stores it innermost first).
    pub shape: Vec<u64>,
    pub kind: TensorType,
    offset: u64,
    nbytes: u64,
}

impl TensorInfo {
    pub fn elements(&self) -> u64 {
        self.shape.iter().product()
    }
}

pub struct GgufFile {
    path: PathBuf,
    map: Mmap,
    pub metadata: HashMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    index: HashMap<String, usize>,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        if self.buf.len().saturating_sub(self.pos) < n {
            return Err(Error::format(
                self.path,
                format!(
                    "truncated GGUF: {what} at byte {} runs past the end of the file",
                    self.pos
                ),
            ));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.take(4, "a u32")?.try_into().unwrap(),
        ))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(
            self.take(8, "a u64")?.try_into().unwrap(),
        ))
    }
    fn string(&mut self) -> Result<String> {
        let n = self.u64()?;
        if n > (1 << 30) {
            return Err(Error::format(
                self.path,
                format!("corrupt GGUF: string of {n} bytes"),
            ));
        }
        let b = self.take(n as usize, "a string")?;
        String::from_utf8(b.to_vec())
            .map_err(|_| Error::format(self.path, "corrupt GGUF: a string is not UTF-8"))
    }
    fn value(&mut self, ty: u32, depth: u32) -> Result<Value> {
        Ok(match ty {
            0 => Value::U8(self.take(1, "a u8")?[0]),
            1 => Value::I8(self.take(1, "an i8")?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(
                self.take(2, "a u16")?.try_into().unwrap(),
            )),
            3 => Value::I16(i16::from_le_bytes(
                self.take(2, "an i16")?.try_into().unwrap(),
            )),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(self.u32()? as i32),
            6 => Value::F32(f32::from_bits(self.u32()?)),
            7 => Value::Bool(self.take(1, "a bool")?[0] != 0),
            8 => Value::Str(self.string()?),
            9 => {
                if depth > 2 {
                    return Err(Error::format(self.path, "corrupt GGUF: nested arrays"));
                }
                let inner = self.u32()?;
                let n = self.u64()?;
                // Each element takes at least one byte: a count beyond the file is corrupt.
                if n > self.buf.len() as u64 {
                    return Err(Error::format(
                        self.path,
                        format!("corrupt GGUF: array of {n} elements"),
                    ));
                }
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(inner, depth + 1)?);
                }
                Value::Array(v)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(self.u64()? as i64),
            12 => Value::F64(f64::from_bits(self.u64()?)),
            t => {
                return Err(Error::format(
                    self.path,
                    format!("corrupt GGUF: metadata type {t}"),
                ))
            }
        })
    }
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the file is opened read-only; llmq never writes model files while serving.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        let mut c = Cursor {
            buf: &map,
            pos: 0,
            path,
        };
        let magic = c.take(4, "the magic")?;
        if magic != MAGIC {
            return Err(Error::format(
                path,
                format!("not a GGUF file (magic {magic:?}, expected \"GGUF\")"),
            ));
        }
        let version = c.u32()?;
        if !(2..=3).contains(&version) {
            return Err(Error::format(
                path,
                format!("unsupported GGUF version {version}"),
            ));
        }
        let n_tensors = c.u64()?;
        let n_kv = c.u64()?;
        if n_tensors > 1 << 20 || n_kv > 1 << 20 {
            return Err(Error::format(
                path,
                "corrupt GGUF: implausible tensor or key count",
            ));
        }
        let mut metadata = HashMap::new();
        for _ in 0..n_kv {
            let key = c.string()?;
            let ty = c.u32()?;
            let v = c.value(ty, 0)?;
            metadata.insert(key, v);
        }
        let mut raw = Vec::with_capacity(n_tensors as usize);
        for _ in 0..n_tensors {
            let name = c.string()?;
            let nd = c.u32()?;
            if nd == 0 || nd > 4 {
                return Err(Error::format(
                    path,
                    format!("tensor {name:?}: {nd} dimensions"),
                ));
            }
            let mut dims = Vec::with_capacity(nd as usize);
            for _ in 0..nd {
                dims.push(c.u64()?);
            }
            let ty = c.u32()?;
            let off = c.u64()?;
            raw.push((name, dims, ty, off));
        }
        let alignment = metadata
            .get("general.alignment")
            .and_then(Value::as_u64)
            .unwrap_or(DEFAULT_ALIGNMENT);
        if alignment == 0 || !alignment.is_power_of_two() {
            return Err(Error::format(
                path,
                format!("corrupt GGUF: alignment {alignment}"),
            ));
        }
        let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
        let mut tensors = Vec::with_capacity(raw.len());
        let mut index = HashMap::new();
        for (name, dims, ty, off) in raw {
            let kind = TensorType::from_id(ty).ok_or_else(|| Error::UnsupportedTensorType {
                path: path.into(),
                tensor: name.clone(),
                kind: type_name(ty),
            })?;
            let elements = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d));
            let (per_block, block_bytes) = kind.block();
            let elements = elements
                .filter(|e| e % per_block == 0 && dims[0] % per_block == 0)
                .ok_or_else(|| {
                    Error::format(
                        path,
                        format!(
                            "tensor {name:?}: shape {dims:?} is not whole {} blocks",
                            kind.name()
                        ),
                    )
                })?;
            let nbytes = elements / per_block * block_bytes;
            let offset = data_start
                .checked_add(off)
                .filter(|o| o.checked_add(nbytes).is_some_and(|e| e <= map.len() as u64));
            let offset = offset.ok_or_else(|| {
                Error::format(path, format!("truncated GGUF: data of tensor {name:?} lies past the end of the file ({} bytes)", map.len()))
            })?;
            let shape = dims.iter().rev().copied().collect();
            index.insert(name.clone(), tensors.len());
            tensors.push(TensorInfo {
                name,
                shape,
                kind,
                offset,
                nbytes,
            });
        }
        Ok(GgufFile {
            path: path.to_path_buf(),
            map,
            metadata,
            tensors,
            index,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// A tensor's bytes as the file stores them (its blocks, for a quantized type).
    pub fn bytes(&self, info: &TensorInfo) -> &[u8] {
        &self.map[info.offset as usize..(info.offset + info.nbytes) as usize]
    }

    /// Decodes a tensor to f32, row-major.
    pub fn read_f32(&self, info: &TensorInfo) -> Vec<f32> {
        let mut out = Vec::with_capacity(info.elements() as usize);
        info.kind.decode(self.bytes(info), &mut out);
        out
    }
}
