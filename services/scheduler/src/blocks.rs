//! The KV block pool's books: a worker's KV memory as a fixed number of blocks of
//! `block_tokens` positions each, and each running request's block table.
//!
//! The scheduler keeps these books (it is the only one deciding who may use the device's
//! memory); the executor keeps the blocks' contents. A request holds the blocks its table
//! lists; a block is either free or held, and its reference count is the number of tables
//! listing it (several tables list one block when requests share a prefix).
//!
//! Invariants (checked by [`BlockPool::check`], which the property tests run after every
//! operation): no block is both free and held; a block's reference count equals the number of
//! tables listing it; free blocks plus distinct held blocks make the whole pool; a table with no
//! blocks is not kept.

use std::collections::HashMap;

use crate::executor::ReqId;

/// One block of the pool.
pub type BlockId = u32;

/// The free blocks fell short of a request's need: nothing was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Short {
    /// Blocks the request needed beyond what its table holds.
    pub needed: usize,
    /// Blocks free at the time.
    pub free: usize,
}

#[derive(Debug, Default)]
pub struct BlockPool {
    block_tokens: usize,
    /// Tables listing each block.
    refs: Vec<u32>,
    /// Blocks no table lists; taken from the end.
    free: Vec<BlockId>,
    tables: HashMap<ReqId, Vec<BlockId>>,
}

impl BlockPool {
    /// A pool of `blocks` blocks of `block_tokens` positions, all free.
    pub fn new(blocks: usize, block_tokens: usize) -> Self {
        assert!(block_tokens > 0, "a block holds at least one position");
        BlockPool {
            block_tokens,
            refs: vec![0; blocks],
            // Reversed so that blocks are handed out from 0 up (tables read in order).
            free: (0..blocks as BlockId).rev().collect(),
            tables: HashMap::new(),
        }
    }

    /// Positions per block.
    pub fn block_tokens(&self) -> usize {
        self.block_tokens
    }

    /// Blocks that hold `tokens` positions.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_tokens)
    }

    /// Blocks in the pool.
    pub fn total(&self) -> usize {
        self.refs.len()
    }

    /// Blocks no table lists.
    pub fn free(&self) -> usize {
        self.free.len()
    }

    /// Blocks some table lists.
    pub fn used(&self) -> usize {
        self.total() - self.free()
    }

    /// `id`'s block table (empty when it holds none).
    pub fn table(&self, id: ReqId) -> &[BlockId] {
        self.tables.get(&id).map_or(&[], |t| t.as_slice())
    }

    /// Positions `id`'s table covers.
    pub fn capacity(&self, id: ReqId) -> usize {
        self.table(id).len() * self.block_tokens
    }

    /// Grows `id`'s table to cover `tokens` positions, from the free blocks. On success returns
    /// the blocks added (none when the table already covers them); when the free blocks do not
    /// suffice, takes nothing.
    pub fn reserve(&mut self, id: ReqId, tokens: usize) -> Result<&[BlockId], Short> {
        let have = self.table(id).len();
        let needed = self.blocks_for(tokens).saturating_sub(have);
        if needed > self.free.len() {
            return Err(Short {
                needed,
                free: self.free.len(),
            });
        }
        if needed == 0 {
            return Ok(&[]);
        }
        let taken = self.free.split_off(self.free.len() - needed);
        let table = self.tables.entry(id).or_default();
        for &b in taken.iter().rev() {
            self.refs[b as usize] += 1;
            table.push(b);
        }
        Ok(&table[have..])
    }

    /// Drops `id`'s table; returns how many blocks became free (a block another table also
    /// lists stays held).
    pub fn release(&mut self, id: ReqId) -> usize {
        let Some(table) = self.tables.remove(&id) else {
            return 0;
        };
        let mut freed = 0;
        for b in table {
            let r = &mut self.refs[b as usize];
            *r -= 1;
            if *r == 0 {
                self.free.push(b);
                freed += 1;
            }
        }
        freed
    }

    /// Requests holding blocks.
    pub fn holders(&self) -> impl Iterator<Item = ReqId> + '_ {
        self.tables.keys().copied()
    }

    /// Checks the invariants of the module's comment; the first one broken, if any.
    pub fn check(&self) -> Result<(), String> {
        let mut listed = vec![0u32; self.refs.len()];
        for (id, table) in &self.tables {
            if table.is_empty() {
                return Err(format!("request {id} keeps an empty table"));
            }
            for &b in table {
                listed[b as usize] += 1;
            }
        }
        let mut is_free = vec![false; self.refs.len()];
        for &b in &self.free {
            if std::mem::replace(&mut is_free[b as usize], true) {
                return Err(format!("block {b} is free twice"));
            }
        }
        for (b, (&refs, &n)) in self.refs.iter().zip(&listed).enumerate() {
            if refs != n {
                return Err(format!("block {b}: {refs} references, {n} tables list it"));
            }
            if (refs == 0) != is_free[b] {
                return Err(format!(
                    "block {b}: {refs} references and {} free",
                    if is_free[b] { "" } else { "not" }
                ));
            }
        }
        Ok(())
    }
}
