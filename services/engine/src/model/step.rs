//! A decode step: every length group's rows and a prefill chunk's stage in one pass over the
//! weights, each row writing and attending at its own position.

use std::ops::Range;

use mlx_rs::fast::rms_norm;
use mlx_rs::ops::concatenate;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{Array, Dtype};

use super::attention::{GroupAttention, GroupStep, RowStep, RowTables};
use super::layer::Mixer;
use super::rope::{Layout, Rotation};
use super::{ChunkStage, Model};
use crate::batch::{DecodeBatch, BLOCK_TOKENS};
use crate::error::{EngineError, Result};

impl Model {
    pub(super) fn step_inner(
        &self,
        groups: &mut [(&[u32], &mut DecodeBatch)],
        device_tokens: Option<&Array>,
        chunk: Option<ChunkStage>,
    ) -> Result<(Array, Option<Array>)> {
        let StepRows {
            mut toks,
            mut active,
            mut steps,
            keys,
            groups: slot_groups,
            tables,
        } = self.group_rows(groups)?;
        let decode_slots = toks.len();
        let decode_rows = active.len();
        let rows_step = self
            .row_attention
            .as_ref()
            .filter(|_| decode_slots > 0)
            .map(|kernel| RowStep {
                kernel,
                plan: kernel.plan(&keys, &slot_groups, None),
                windowed: self
                    .config
                    .sliding_window
                    .filter(|_| self.config.any_sliding())
                    .map(|w| kernel.plan(&keys, &slot_groups, Some(w))),
                tables: step_tables(&tables),
                slots: decode_slots as i32,
            });
        let mut chunk = chunk;
        let n_layers = self.layers.len();
        let (range, mut hidden_in) = match chunk.as_mut() {
            Some(c) => (c.layers.clone(), c.hidden.take()),
            None => (0..0, None),
        };
        let last_stage = range.end == n_layers;
        let pad = match &chunk {
            Some(c) => {
                self.add_chunk_rows(c, hidden_in.is_none(), decode_slots, &mut toks, &mut active)?
            }
            None => 0,
        };
        let t = chunk.as_ref().map_or(0, |c| (c.tokens.len() + pad) as i32);
        let chunk_from = chunk
            .as_ref()
            .map(|c| c.cache.layers[range.start].offset() as i32);
        let (rotate_decode, rotate_all) =
            self.step_rotations(&keys, &range, chunk_from.map(|off| off..off + t))?;
        if active.is_empty() {
            return Err(EngineError::InvalidRequest("decode: no rows".into()));
        }
        let x0 = step_input(&toks, decode_slots, device_tokens, &active[..decode_rows])?;
        let eps = self.config.rms_norm_eps;
        // The rows: decode slots, then (in the stage's layers) the chunk's padded positions.
        let mut x = match (&hidden_in, decode_slots) {
            (Some(_), 0) => hidden_in.take().expect("matched"),
            _ => self.embed_tokens(&x0)?,
        };
        let mut hidden_out = None;
        for (li, layer) in self.layers.iter().enumerate() {
            let in_stage = chunk.is_some() && range.contains(&li);
            if !in_stage && decode_slots == 0 {
                continue; // only the chunk's stage has rows here
            }
            if let Some(h) = hidden_in.take_if(|_| li == range.start) {
                x = concatenate(&[x, h], 0)?;
            }
            let part = chunk
                .as_mut()
                .filter(|_| in_stage)
                .map(|c| (&mut *c.cache.layers[li], t));
            let rotation = if in_stage {
                &rotate_all
            } else {
                &rotate_decode
            }
            .get(layer.rope)
            .expect("built for these layers");
            let normed = rms_norm(&x, Some(&layer.input_norm), eps)?;
            let h = match &layer.mixer {
                Mixer::Attention(a) => a.forward_grouped(
                    &normed,
                    li,
                    self.config.window(li),
                    &mut steps,
                    rows_step.as_ref(),
                    rotation,
                    part,
                )?,
                Mixer::Conv(c) => c.forward_rows(&normed, li, &mut steps, part)?,
                Mixer::Delta(d) => d.forward_rows(&normed, li, &mut steps, part)?,
            };
            x = layer.add_attention(&x, h, eps)?;
            x = layer.add_mlp(&x, eps)?;
            if in_stage && li + 1 == range.end && !last_stage {
                hidden_out = Some(x.index(decode_slots as i32..));
                x = x.index(..decode_slots as i32);
            }
        }
        drop(steps);
        for (_, batch) in groups.iter_mut() {
            batch.advance();
        }
        // Only a padded chunk rewinds (a sliding window's or a state's cache cannot, and is
        // never padded: its model's chunk grid is 1).
        if let Some(c) = chunk.as_mut().filter(|_| pad > 0) {
            for li in range.clone() {
                c.cache.layers[li].rewind(pad)?;
            }
        }
        let logits = self.head(x, &active, decode_rows, decode_slots)?;
        Ok((logits, hidden_out))
    }

    /// Per rope ([`Model::ropes`]), where a step's rows are rotated: the decode rows alone (each
    /// slot at its length before this step's token, scratch slots 0), for the layers outside
    /// the chunk's stage (none when the stage is every layer); and the decode rows followed by
    /// the chunk's `positions`, for those within it (none without a chunk).
    fn step_rotations(
        &self,
        keys: &[usize],
        stage: &Range<usize>,
        positions: Option<Range<i32>>,
    ) -> Result<(Vec<Rotation>, Vec<Rotation>)> {
        let mut rotation: Vec<i32> = keys.iter().map(|&k| k.saturating_sub(1) as i32).collect();
        let at = |rotation: &[i32]| {
            self.ropes
                .iter()
                .map(|r| r.at(rotation, Layout::Rows))
                .collect::<Result<Vec<_>>>()
        };
        let decode = if *stage != (0..self.layers.len()) {
            at(&rotation)?
        } else {
            vec![]
        };
        let all = match positions {
            Some(p) => {
                rotation.extend(p);
                at(&rotation)?
            }
            None => vec![],
        };
        Ok((decode, all))
    }
}

/// The decode groups' rows of a step: their tokens (each group's slots, scratch ones 0), the
/// active rows' indices, each group's step inputs, and the keys each slot attends over.
struct StepRows<'a> {
    toks: Vec<i32>,
    active: Vec<i32>,
    steps: Vec<GroupStep<'a>>,
    /// Keys each decode slot attends over (its length after this step; scratch slots 0), for
    /// the row attention kernel.
    keys: Vec<usize>,
    /// Each decode slot's group.
    groups: Vec<i32>,
    /// With the row attention kernel, each group's slots' block tables ([slots, width] as a
    /// flat list) and their width.
    tables: Vec<(Vec<i32>, usize)>,
}

impl Model {
    /// Lays out every group's rows for a step: reserves room for one more token a row, and
    /// makes each row write and attend at its own position.
    fn group_rows<'a>(&self, groups: &'a mut [(&[u32], &mut DecodeBatch)]) -> Result<StepRows<'a>> {
        let mut r = StepRows {
            toks: vec![],
            active: vec![],
            steps: Vec::with_capacity(groups.len()),
            keys: vec![],
            groups: vec![],
            tables: vec![],
        };
        for (tokens, batch) in groups.iter_mut() {
            let n = batch.len();
            if tokens.len() != n {
                return Err(EngineError::InvalidRequest(format!(
                    "decode: {} tokens for {n} rows",
                    tokens.len()
                )));
            }
            if n == 0 {
                continue;
            }
            batch.reserve_step()?;
            let offset = r.toks.len() as i32;
            let slots = batch.slots();
            r.active.extend((0..n as i32).map(|i| offset + i));
            r.toks.extend(tokens.iter().map(|&t| t as i32));
            r.toks.resize(offset as usize + slots, 0);
            let write = batch.write_index()?;
            r.keys.extend(batch.lens().iter().map(|&l| l + 1));
            r.keys.resize(offset as usize + slots, 0);
            r.groups
                .resize(offset as usize + slots, r.steps.len() as i32);
            // Tables as wide as the longest row's after this step's token.
            let width = batch.table_width();
            let attend = if self.row_attention.is_some() {
                r.tables.push((batch.padded_tables(width), width));
                GroupAttention::Rows
            } else if batch.per_row_attention() || self.cpu_attention {
                GroupAttention::PerRow(RowTables {
                    lens: batch.lens().iter().map(|&l| l + 1).collect(),
                    tables: batch.padded_tables(width),
                    width,
                })
            } else {
                let n = (width * BLOCK_TOKENS) as i32;
                let keys =
                    mlx_rs::ops::arange::<i32, i32>(None, n, None)?.reshape(&[1, 1, 1, n])?;
                let ends = batch
                    .positions()
                    .reshape(&[slots as i32, 1, 1, 1])?
                    .add(Array::from_int(1))?;
                let mask = keys.lt(&ends)?;
                let windowed = match self
                    .config
                    .sliding_window
                    .filter(|_| self.config.any_sliding())
                {
                    Some(w) => Some(
                        mask.logical_and(&keys.ge(&ends.subtract(Array::from_int(w as i32))?)?)?,
                    ),
                    None => None,
                };
                GroupAttention::Masked {
                    mask,
                    windowed,
                    index: batch.gather_index(width),
                    keys: n,
                }
            };
            r.steps.push(GroupStep {
                kv: &mut batch.layers[..],
                offset,
                slots: slots as i32,
                write,
                attend,
            });
        }
        Ok(r)
    }

    /// Checks a chunk's stage and adds its rows: its tokens, padded to the chunk grid, when the
    /// stage starts from the embedding (layer 0), and its last position among the active rows
    /// when the stage ends the model. Returns the padding.
    fn add_chunk_rows(
        &self,
        chunk: &ChunkStage,
        from_embedding: bool,
        decode_slots: usize,
        toks: &mut Vec<i32>,
        active: &mut Vec<i32>,
    ) -> Result<usize> {
        let (range, n_layers, c) = (&chunk.layers, self.layers.len(), chunk.tokens);
        let (&last, _) = c
            .split_last()
            .ok_or_else(|| EngineError::InvalidRequest("step: an empty prefill chunk".into()))?;
        if range.start >= range.end || range.end > n_layers || (range.start == 0) != from_embedding
        {
            return Err(EngineError::InvalidRequest(format!(
                "step: chunk stage over layers {range:?} of {n_layers}"
            )));
        }
        let last_stage = range.end == n_layers;
        if !last_stage && decode_slots == 0 {
            return Err(EngineError::InvalidRequest(
                "step: a chunk stage short of the last layer needs decode rows".into(),
            ));
        }
        // Every layer of the stage holds the positions before the chunk.
        let pad = self.chunk_padding(chunk.cache.layers[range.start].offset(), c.len());
        if range.start == 0 {
            toks.extend(c.iter().map(|&x| x as i32));
            toks.extend(std::iter::repeat_n(last as i32, pad));
        }
        if last_stage {
            active.push((decode_slots + c.len()) as i32 - 1);
        }
        Ok(pad)
    }

    /// The output head over every decode slot (scratch ones too) and the chunk's last position,
    /// then the active rows picked: its shape follows the batch's slots, not how many of them
    /// are in use, so the warm-up's rounds cover it (a new shape costs tens of ms on a GPU the
    /// first time). Active decode slots keep their order; the chunk's last position is last.
    fn head(
        &self,
        x: Array,
        active: &[i32],
        decode_rows: usize,
        decode_slots: usize,
    ) -> Result<Array> {
        let chunk_last = (active.len() > decode_rows).then(|| active[decode_rows]);
        let keep: Vec<i32> = (0..decode_slots as i32).chain(chunk_last).collect();
        let rows = if keep.len() as i32 == x.shape()[0] {
            x
        } else {
            x.take_axis(Array::from_slice(&keep, &[keep.len() as i32]), 0)?
        };
        let logits = self.logits(&rms_norm(
            &rows,
            Some(&self.norm),
            self.config.rms_norm_eps,
        )?)?;
        let pick: Vec<i32> = active[..decode_rows]
            .iter()
            .copied()
            .chain(chunk_last.map(|_| decode_slots as i32))
            .collect();
        Ok(if pick.len() == keep.len() {
            logits
        } else {
            logits.take_axis(Array::from_slice(&pick, &[pick.len() as i32]), 0)?
        })
    }
}

/// The step's input tokens [rows, 1]: the host's `toks`, or, with `device`, the first
/// `decode_slots` taken from the device (slot i takes device token k when it is the k-th of
/// `active`; scratch slots take an appended 0) and the chunk's rows from the host.
fn step_input(
    toks: &[i32],
    decode_slots: usize,
    device: Option<&Array>,
    active: &[i32],
) -> Result<Array> {
    let Some(d) = device else {
        return Ok(Array::from_slice(toks, &[toks.len() as i32, 1]));
    };
    let zero = active.len() as i32;
    let mut src = vec![zero; decode_slots];
    for (k, &slot) in active.iter().enumerate() {
        src[slot as usize] = k as i32;
    }
    let padded = concatenate(
        &[
            d.as_dtype(Dtype::Int32)?.reshape(&[-1])?,
            Array::from_slice(&[0i32], &[1]),
        ],
        0,
    )?;
    let rows = padded.take_axis(Array::from_slice(&src, &[decode_slots as i32]), 0)?;
    let rows = if toks.len() > decode_slots {
        concatenate(
            &[
                rows,
                Array::from_slice(&toks[decode_slots..], &[(toks.len() - decode_slots) as i32]),
            ],
            0,
        )?
    } else {
        rows
    };
    Ok(rows.reshape(&[toks.len() as i32, 1])?)
}

/// Every group's block tables ([slots, width] each, flat) as one int32 array [slots, width]
/// of the widest group's width, the narrower padded with the scratch block. A group's rows
/// always have a block (their new token's), so every width is at least one.
fn step_tables(tables: &[(Vec<i32>, usize)]) -> Array {
    let width = tables.iter().map(|&(_, w)| w).max().unwrap_or(1).max(1);
    let mut out = vec![];
    for (t, w) in tables {
        for row in t.chunks((*w).max(1)) {
            out.extend_from_slice(row);
            out.extend(std::iter::repeat_n(0, width - row.len()));
        }
    }
    let rows = (out.len() / width) as i32;
    Array::from_slice(&out, &[rows, width as i32])
}
