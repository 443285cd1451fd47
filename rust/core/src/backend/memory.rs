//! Caller memory registered with the ring (io_uring fixed buffers): a direct read into
//! it skips pinning its pages and marking them dirty per request, work the kernel does
//! once here, at registration. The entries sit after the slots' in the ring's one
//! sparse buffer table; a region longer than the kernel's 1 GiB per buffer takes one
//! entry per GiB. Requests find their entry by address: one lying wholly inside an
//! entry reads with READ_FIXED, any other as a plain read, so registering is only ever
//! a speed-up.

/// Entries kept for caller memory: up to 4 TiB registered at once.
pub const MEMORY_ENTRIES: usize = 4096;
/// The kernel's limit on one registered buffer.
pub const PIECE_BYTES: usize = 1 << 30;

/// One registered buffer: `[start, end)` of caller memory at table entry `index`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub index: u16,
    pub start: usize,
    pub end: usize,
}

/// The caller-memory part of the buffer table: which entries hold what.
#[derive(Debug)]
pub struct MemoryTable {
    free: Vec<u16>,
    /// Registered pieces by start address (regions may overlap: two callers may
    /// register the same memory).
    pieces: Vec<Piece>,
}

impl MemoryTable {
    /// Entries `[first, first + entries)` of the ring's buffer table.
    pub fn new(first: usize, entries: usize) -> Self {
        let free = (first..first + entries).rev().map(|i| i as u16).collect();
        MemoryTable {
            free,
            pieces: Vec::new(),
        }
    }

    /// The pieces `regions` ((address, length)) register as, each with a free entry;
    /// None when the table has too few free entries. Nothing is taken until `insert`.
    pub fn plan(&self, regions: &[(usize, usize)]) -> Option<Vec<Piece>> {
        let mut out = Vec::new();
        let mut free = self.free.iter().rev();
        for &(addr, len) in regions {
            let mut at = addr;
            while at < addr + len {
                let end = (at + PIECE_BYTES).min(addr + len);
                out.push(Piece {
                    index: *free.next()?,
                    start: at,
                    end,
                });
                at = end;
            }
        }
        Some(out)
    }

    /// Record `pieces` (from `plan`) as registered.
    pub fn insert(&mut self, pieces: &[Piece]) {
        for p in pieces {
            self.free.retain(|&i| i != p.index);
            let at = self.pieces.partition_point(|q| q.start <= p.start);
            self.pieces.insert(at, *p);
        }
    }

    /// Forget the pieces at `indices`; their entries are free again.
    pub fn remove(&mut self, indices: &[u16]) {
        let free = &mut self.free;
        self.pieces.retain(|p| {
            let gone = indices.contains(&p.index);
            if gone {
                free.push(p.index);
            }
            !gone
        });
    }

    /// The entry holding all of `[addr, addr + len)`, if one does.
    pub fn lookup(&self, addr: usize, len: usize) -> Option<u16> {
        let end = addr.checked_add(len)?;
        // A piece spans at most PIECE_BYTES, so one holding `addr` starts after
        // `addr - PIECE_BYTES`: look back from the last piece starting at or before it.
        let upto = self.pieces.partition_point(|p| p.start <= addr);
        self.pieces[..upto]
            .iter()
            .rev()
            .take_while(|p| p.start + PIECE_BYTES > addr)
            .find(|p| end <= p.end)
            .map(|p| p.index)
    }

    pub fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: usize = PIECE_BYTES;

    #[test]
    fn regions_split_at_the_kernel_limit_and_requests_find_their_piece() {
        let mut t = MemoryTable::new(8, 4);
        let base = 0x7f00_0000_0000;
        let pieces = t.plan(&[(base, 2 * G + 4096)]).unwrap();
        assert_eq!(pieces.len(), 3);
        assert_eq!(
            pieces.iter().map(|p| p.index).collect::<Vec<_>>(),
            [8, 9, 10]
        );
        assert_eq!(pieces[2].end - pieces[2].start, 4096);
        t.insert(&pieces);
        assert_eq!(t.lookup(base, 1 << 20), Some(8));
        assert_eq!(t.lookup(base + G - 4096, 4096), Some(8));
        // Across a piece boundary: no single buffer holds it, a plain read.
        assert_eq!(t.lookup(base + G - 4096, 8192), None);
        assert_eq!(t.lookup(base + 2 * G, 4096), Some(10));
        assert_eq!(t.lookup(base + 2 * G, 8192), None);
        assert_eq!(t.lookup(base - 4096, 4096), None);
        // One entry left: a region needing two does not fit, and nothing was taken.
        assert!(t.plan(&[(0x1000, G + 1)]).is_none());
        assert_eq!(t.plan(&[(0x1000, 4096)]).unwrap()[0].index, 11);
        t.remove(&[8, 9, 10]);
        assert!(t.is_empty());
        assert_eq!(t.lookup(base, 4096), None);
        assert_eq!(t.plan(&[(base, 3 * G)]).unwrap().len(), 3);
    }

    #[test]
    fn overlapping_registrations_each_answer_until_removed() {
        let mut t = MemoryTable::new(0, 8);
        let a = t.plan(&[(0x10000, 1 << 20)]).unwrap();
        t.insert(&a);
        let b = t.plan(&[(0x10000 + 4096, 1 << 20)]).unwrap();
        t.insert(&b);
        assert_eq!(t.lookup(0x10000, 4096), Some(a[0].index));
        assert!(t.lookup(0x10000 + 8192, 4096).is_some());
        assert_eq!(t.lookup(0x10000 + (1 << 20), 4096), Some(b[0].index));
        t.remove(&[a[0].index]);
        assert_eq!(t.lookup(0x10000, 4096), None);
        assert_eq!(t.lookup(0x10000 + 8192, 4096), Some(b[0].index));
        assert_eq!(t.lookup(usize::MAX - 10, 100), None);
    }
}
