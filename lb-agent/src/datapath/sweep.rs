//! Deleting the entries of kernel-written maps that no longer bind
//! (sessionAffinity decisions, datagram flows, conntrack), without deleting
//! one the kernel refreshed meanwhile. The walk over a map is a snapshot
//! that the kernel keeps refreshing, so each candidate is read again just
//! before it goes and judged against a clock read after that read. (What is
//! left is the few microseconds between that read and the delete: an entry
//! idle for its whole timeout would have to be used in exactly that window,
//! and the kernel then only chooses again.)
use aya::{
    maps::{HashMap, MapData},
    Pod,
};

/// Why an entry is deleted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stale {
    Expired,
    /// What it was decided for is gone (the Service, its affinity, the
    /// frontend).
    NoPolicy,
    /// The backend left the Service's selectable (affinity) or serving
    /// (datagram flows) backends.
    BackendLeft,
}

/// Counts of one sweep.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SweepReport {
    /// Entries left in the map.
    pub entries: usize,
    pub expired: usize,
    pub no_policy: usize,
    pub backend_left: usize,
}

impl SweepReport {
    /// Entries deleted because their Service or backend left.
    pub fn swept(&self) -> usize {
        self.no_policy + self.backend_left
    }
}

/// A map as a sweep reads and deletes it.
pub trait Table<K, V> {
    fn entries(&self) -> Vec<(K, V)>;
    fn entry(&self, key: &K) -> Option<V>;
    fn delete(&mut self, key: &K) -> bool;
}

impl<K: Pod, V: Pod> Table<K, V> for HashMap<MapData, K, V> {
    fn entries(&self) -> Vec<(K, V)> {
        // Entries the kernel adds meanwhile are simply seen next time.
        self.iter().filter_map(Result::ok).collect()
    }
    fn entry(&self, key: &K) -> Option<V> {
        self.get(key, 0).ok()
    }
    fn delete(&mut self, key: &K) -> bool {
        self.remove(key).is_ok()
    }
}

/// The tests' stand-in for a map.
#[cfg(test)]
impl<K: Ord + Copy, V: Copy> Table<K, V> for std::collections::BTreeMap<K, V> {
    fn entries(&self) -> Vec<(K, V)> {
        self.iter().map(|(k, v)| (*k, *v)).collect()
    }
    fn entry(&self, key: &K) -> Option<V> {
        self.get(key).copied()
    }
    fn delete(&mut self, key: &K) -> bool {
        self.remove(key).is_some()
    }
}

/// Deletes the entries of `table` that `judge` (key, entry, now) finds
/// stale, in the snapshot and again when read back just before the delete.
pub fn sweep<K, V>(
    table: &mut impl Table<K, V>,
    judge: impl Fn(&K, &V, u64) -> Option<Stale>,
    clock: impl Fn() -> u64,
) -> SweepReport {
    let snapshot = table.entries();
    let now = clock();
    let mut report = SweepReport {
        entries: snapshot.len(),
        ..Default::default()
    };
    for (key, e) in &snapshot {
        if judge(key, e, now).is_none() {
            continue;
        }
        let Some(fresh) = table.entry(key) else {
            continue;
        };
        let Some(why) = judge(key, &fresh, clock()) else {
            continue;
        };
        if table.delete(key) {
            report.entries -= 1;
            match why {
                Stale::Expired => report.expired += 1,
                Stale::NoPolicy => report.no_policy += 1,
                Stale::BackendLeft => report.backend_left += 1,
            }
        }
    }
    report
}

#[cfg(test)]
mod tests {
    use std::{cell::RefCell, collections::BTreeMap};

    use super::*;

    /// Entries are (backend, last used); stale when idle over 10 or on
    /// backend 9.
    fn judge(_: &u32, e: &(u32, u64), now: u64) -> Option<Stale> {
        if e.0 == 9 {
            Some(Stale::BackendLeft)
        } else if now.saturating_sub(e.1) > 10 {
            Some(Stale::Expired)
        } else {
            None
        }
    }

    /// A table that the "kernel" refreshes between the sweep's snapshot and
    /// its second read.
    struct Racing {
        map: BTreeMap<u32, (u32, u64)>,
        refresh: RefCell<Option<(u32, (u32, u64))>>,
    }

    impl Table<u32, (u32, u64)> for Racing {
        fn entries(&self) -> Vec<(u32, (u32, u64))> {
            self.map.entries()
        }
        fn entry(&self, key: &u32) -> Option<(u32, u64)> {
            if let Some((k, e)) = self.refresh.borrow_mut().take() {
                if k == *key {
                    return Some(e);
                }
            }
            self.map.entry(key)
        }
        fn delete(&mut self, key: &u32) -> bool {
            self.map.delete(key)
        }
    }

    #[test]
    fn deletes_only_what_is_still_stale_when_read_again() {
        let mut t = Racing {
            map: BTreeMap::from([(1, (7, 0)), (2, (7, 0)), (3, (9, 100)), (4, (7, 95))]),
            // Entry 1 is used again (stamped after the sweep's clock) on
            // another CPU after the snapshot.
            refresh: RefCell::new(Some((1, (7, 101)))),
        };
        let r = sweep(&mut t, judge, || 100);
        assert_eq!(
            r,
            SweepReport {
                entries: 2,
                expired: 1,
                no_policy: 0,
                backend_left: 1,
            }
        );
        assert_eq!(t.map.keys().copied().collect::<Vec<_>>(), [1, 4]);
    }
}
