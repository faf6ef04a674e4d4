//! Which elements of `LB_SLOTS` (an array) each backend set holds: a set is
//! one contiguous range, named by `ServiceValue::slot_base`, handed out
//! first-fit and given back when the set is retired.
//!
//! The array is twice as long as the slots that may be in use at once
//! (`--max-slots`, see [`array_len`]): `--max-slots` bounds the slots in
//! use, as it bounded the entries of the hash map `LB_SLOTS` once was, and
//! the room beyond keeps a set from finding no range long enough while
//! fewer slots are in use (fragmentation), short of pathological churn.
use std::collections::BTreeMap;

/// The length of `LB_SLOTS` for `max_slots` slots in use.
pub fn array_len(max_slots: u32) -> u32 {
    max_slots.saturating_mul(2)
}

/// The free ranges of `LB_SLOTS`.
#[derive(Debug, Clone)]
pub struct SlotRanges {
    capacity: u32,
    /// Free ranges: start -> length. Adjacent ranges are always merged.
    free: BTreeMap<u32, u32>,
    used: u32,
    /// At most this many elements in use at once.
    limit: u32,
}

impl SlotRanges {
    /// All of an array of `capacity` elements free, at most `limit` of
    /// them to be held at once.
    pub fn new(capacity: u32, limit: u32) -> Self {
        Self {
            capacity,
            free: (capacity > 0)
                .then_some((0, capacity))
                .into_iter()
                .collect(),
            used: 0,
            limit,
        }
    }

    /// An array of [`array_len`]`(max_slots)` elements, `max_slots` of
    /// them held at most.
    pub fn for_max_slots(max_slots: u32) -> Self {
        Self::new(array_len(max_slots), max_slots)
    }

    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Elements held by sets.
    pub fn used(&self) -> u32 {
        self.used
    }

    /// The start of a free range of `len` elements, now held; `None` when
    /// holding them would pass the limit or no free range is that long. An
    /// empty set holds nothing (start 0).
    pub fn alloc(&mut self, len: u32) -> Option<u32> {
        if len == 0 {
            return Some(0);
        }
        if self.used.saturating_add(len) > self.limit {
            return None;
        }
        let (&start, &free) = self.free.iter().find(|(_, free)| **free >= len)?;
        self.free.remove(&start);
        if free > len {
            self.free.insert(start + len, free - len);
        }
        self.used += len;
        Some(start)
    }

    /// Holds `start..start + len` if all of it is free (a set adopted from
    /// pinned maps, which the limit does not refuse: it was held before);
    /// false, holding nothing, if any of it is not.
    pub fn reserve(&mut self, start: u32, len: u32) -> bool {
        if len == 0 {
            return true;
        }
        let Some(end) = start.checked_add(len) else {
            return false;
        };
        let Some((&at, &free)) = self.free.range(..=start).next_back() else {
            return false;
        };
        if end > at + free {
            return false;
        }
        self.free.remove(&at);
        if start > at {
            self.free.insert(at, start - at);
        }
        if at + free > end {
            self.free.insert(end, at + free - end);
        }
        self.used += len;
        true
    }

    /// Gives back `start..start + len`, which `alloc` or `reserve` handed
    /// out.
    pub fn release(&mut self, start: u32, len: u32) {
        if len == 0 {
            return;
        }
        self.used -= len;
        let (mut start, mut len) = (start, len);
        if let Some((&before, &before_len)) = self.free.range(..start).next_back() {
            debug_assert!(
                before + before_len <= start,
                "released range overlaps a free one"
            );
            if before + before_len == start {
                self.free.remove(&before);
                start = before;
                len += before_len;
            }
        }
        if let Some(after_len) = self.free.remove(&(start + len)) {
            len += after_len;
        }
        debug_assert!(
            self.free.range(start..start + len).next().is_none(),
            "released range overlaps a free one"
        );
        self.free.insert(start, len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every free range, in order.
    fn free(r: &SlotRanges) -> Vec<(u32, u32)> {
        r.free.iter().map(|(s, l)| (*s, *l)).collect()
    }

    #[test]
    fn ranges_are_handed_out_first_fit_and_merge_when_given_back() {
        let mut r = SlotRanges::new(10, 10);
        assert_eq!(r.alloc(3), Some(0));
        assert_eq!(r.alloc(4), Some(3));
        assert_eq!(r.alloc(0), Some(0), "an empty set holds nothing");
        assert_eq!(r.used(), 7);
        assert_eq!(r.alloc(4), None, "3 left");
        r.release(0, 3);
        assert_eq!(free(&r), vec![(0, 3), (7, 3)]);
        assert_eq!(r.alloc(2), Some(0), "the first range that fits");
        assert_eq!(r.alloc(3), Some(7));
        r.release(3, 4);
        assert_eq!(
            free(&r),
            vec![(2, 5)],
            "merged with the free element before"
        );
        r.release(0, 2);
        r.release(7, 3);
        assert_eq!(free(&r), vec![(0, 10)]);
        assert_eq!(r.used(), 0);
    }

    #[test]
    fn reserving_takes_only_free_ranges() {
        let mut r = SlotRanges::new(10, 10);
        assert!(r.reserve(4, 2));
        assert_eq!(free(&r), vec![(0, 4), (6, 4)]);
        assert!(!r.reserve(5, 2), "overlaps a held range");
        assert!(!r.reserve(9, 2), "past the end");
        assert!(!r.reserve(u32::MAX, 2), "overflows");
        assert!(r.reserve(6, 4));
        assert!(r.reserve(0, 0));
        assert_eq!(free(&r), vec![(0, 4)]);
        assert_eq!(r.used(), 6);
        assert_eq!(r.alloc(5), None);
        assert_eq!(r.alloc(4), Some(0));
    }

    #[test]
    fn the_limit_refuses_as_a_full_hash_map_would() {
        let mut r = SlotRanges::for_max_slots(3);
        assert_eq!(r.capacity(), 6);
        assert_eq!(r.alloc(2), Some(0));
        assert_eq!(r.alloc(2), None, "3 in use at most");
        assert_eq!(r.alloc(1), Some(2));
        r.release(0, 2);
        assert_eq!(r.alloc(2), Some(0));
    }

    /// Sets replaced one after another, each taking its new range while
    /// the old one is still held (as until the retire), the others' ranges
    /// scattered: with twice the room, every change within the limit finds
    /// a range.
    #[test]
    fn twice_the_room_absorbs_the_churn_of_replacements() {
        let max = 64;
        let mut r = SlotRanges::for_max_slots(max);
        let mut sets: Vec<(u32, u32)> = (1..=7).map(|len| (r.alloc(len).unwrap(), len)).collect();
        let mut seed = 7u32;
        let mut changes = 0;
        for _ in 0..10_000 {
            seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            let i = (seed >> 16) as usize % sets.len();
            let (old, old_len) = sets[i];
            let len = if (seed >> 8) & 1 == 0 {
                old_len + 1
            } else {
                old_len - 1
            }
            .clamp(1, 12);
            if r.used() + len > max {
                continue;
            }
            let new = r
                .alloc(len)
                .unwrap_or_else(|| panic!("no range of {len}, {} used: {:?}", r.used(), r.free));
            r.release(old, old_len);
            sets[i] = (new, len);
            changes += 1;
        }
        assert!(changes > 5_000, "{changes}");
    }
}
