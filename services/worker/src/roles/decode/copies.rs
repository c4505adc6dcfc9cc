//! A completed prompt's KV copied for the prefix cache a few layers a step, on a CPU. There a
//! copy is the cores' own time, and all of a long prompt's at once was most of a tick, several
//! times a decode tick. The rows' later writes are past the prompt, so each layer's prompt positions are
//! the same whenever they are copied; a copy is evaluated at once, so no view of a row's
//! buffers outlives its step (a write to a buffer with another reader would copy it whole).
//!
//! Invariants: a prompt is remembered once its every layer is copied; one whose sequence left
//! (released: the release remembers its whole history) or whose copy failed is dropped.

use std::collections::VecDeque;

use llmq_engine::prefix::KvPrefix;
use llmq_scheduler::ReqId;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

/// Layers copied per step: a few, so that a step's copies stay small beside its decode.
const LAYERS_PER_STEP: usize = 4;

struct Copy {
    id: ReqId,
    salt: Option<String>,
    tokens: Vec<u32>,
    done: Vec<(Array, Array)>,
}

/// Prompts waiting to be remembered, oldest first.
#[derive(Default)]
pub struct Copies {
    queue: VecDeque<Copy>,
}

/// A prompt's KV, copied whole: what the cache actor is sent.
pub struct Copied {
    pub salt: Option<String>,
    pub tokens: Vec<u32>,
    pub kv: KvPrefix,
}

impl Copies {
    /// Remember `tokens`, the prompt of `id`, once copied.
    pub fn push(&mut self, id: ReqId, salt: Option<String>, tokens: Vec<u32>) {
        self.queue.push_back(Copy {
            id,
            salt,
            tokens,
            done: vec![],
        });
    }

    /// `id` left: its prompt is not copied further.
    pub fn forget(&mut self, id: ReqId) {
        self.queue.retain(|c| c.id != id);
    }

    pub fn clear(&mut self) {
        self.queue.clear();
    }

    /// Prompts waiting.
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Copies the oldest prompt's next layers from its row (`contents`: a row's per-layer
    /// views); the prompt, once every layer is copied.
    pub fn advance(
        &mut self,
        contents: impl Fn(ReqId) -> Option<Vec<(Array, Array)>>,
    ) -> Option<Copied> {
        let c = self.queue.front_mut()?;
        let Some(layers) = contents(c.id) else {
            self.queue.pop_front();
            return None;
        };
        let p = c.tokens.len() as i32;
        let next = c.done.len();
        let copied: Result<Vec<(Array, Array)>, mlx_rs::error::Exception> = layers
            .iter()
            .skip(next)
            .take(LAYERS_PER_STEP)
            .map(|(k, v)| {
                Ok((
                    k.index((.., .., ..p, ..)).contiguous()?,
                    v.index((.., .., ..p, ..)).contiguous()?,
                ))
            })
            .collect();
        let evaluated = copied.and_then(|kv| {
            mlx_rs::transforms::eval(kv.iter().flat_map(|(k, v)| [k, v])).map(|()| kv)
        });
        match evaluated {
            Ok(kv) => c.done.extend(kv),
            Err(e) => {
                tracing::warn!(error = %e, "could not copy a prompt for the prefix cache");
                self.queue.pop_front();
                return None;
            }
        }
        if c.done.len() < layers.len() {
            return None;
        }
        let c = self.queue.pop_front()?;
        Some(Copied {
            salt: c.salt,
            tokens: c.tokens,
            kv: KvPrefix {
                layers: c.done,
                states: false,
            },
        })
    }
}
