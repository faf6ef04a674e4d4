//! sessionAffinity ClientIP: the agent's half. The kernel creates and
//! refreshes entries and honours the timeout itself; the agent deletes
//! entries that can no longer bind (expired, Service gone or without
//! affinity, backend no longer active in the Service), so the map stays
//! bounded under churn and a client whose backend left moves on at once.
//!
//! Entries are keyed by `affinity_id`, which every frontend of one Service
//! port and endpoint selection shares (`semantics::model::AffinityGroup`):
//! the policies here are per affinity id, not per frontend.
use std::collections::{BTreeMap, BTreeSet};

use lb_common::{select, AffinityEntry, AffinityKey};

use crate::datapath::sweep::Stale;

/// What the frontends of one `affinity_id` allow: their timeout and the
/// backends a client may be bound to (see [`selectable_backends`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AffinityPolicy {
    pub timeout_s: u32,
    pub active_backends: BTreeSet<u32>,
}

/// The backends the kernel chooses from for a frontend whose slots are
/// `slots` (active, then terminating, then any Maglev table): the active
/// ones, or, while there is none, the serving-terminating ones (KEP-1669).
/// An entry bound to one of them is not stale: a client sticks to a
/// terminating endpoint as to a ready one while the fallback lasts.
pub fn selectable_backends(slots: &[u32], active: u16, terminating: u16) -> BTreeSet<u32> {
    let (start, len) = if active > 0 {
        (0, active as usize)
    } else {
        (active as usize, terminating as usize)
    };
    let end = (start + len).min(slots.len());
    slots[start.min(end)..end].iter().copied().collect()
}

/// Whether the entry of `key` can no longer bind, given the live policies
/// by affinity id.
pub fn stale(
    key: &AffinityKey,
    e: &AffinityEntry,
    policies: &BTreeMap<u32, AffinityPolicy>,
    now_ns: u64,
) -> Option<Stale> {
    match policies.get(&key.affinity_id) {
        None => Some(Stale::NoPolicy),
        Some(p) if !p.active_backends.contains(&e.backend_id) => Some(Stale::BackendLeft),
        Some(p) if !select::affinity_live(e, now_ns, p.timeout_s) => Some(Stale::Expired),
        Some(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(client: u64, affinity_id: u32) -> AffinityKey {
        AffinityKey::for_netns(client, affinity_id)
    }

    fn entry(backend_id: u32, last_used_s: u64) -> AffinityEntry {
        AffinityEntry {
            backend_id,
            _pad: 0,
            last_used_ns: last_used_s * 1_000_000_000,
        }
    }

    #[test]
    fn selectable_follows_the_kernels_fallback() {
        // Slots: 2 active, 1 terminating, then a Maglev table.
        let slots = [1, 2, 3, 1, 2, 2, 1];
        assert_eq!(selectable_backends(&slots, 2, 1), BTreeSet::from([1, 2]));
        // KEP-1669: no active backend, the terminating ones are chosen.
        assert_eq!(selectable_backends(&[3, 4], 0, 2), BTreeSet::from([3, 4]));
        assert!(selectable_backends(&[], 0, 0).is_empty());
        // Counts larger than the slots (a broken adopted entry) clamp.
        assert_eq!(selectable_backends(&[5], 0, 3), BTreeSet::from([5]));
        assert!(selectable_backends(&[], 2, 0).is_empty());
    }

    #[test]
    fn table() {
        let policies = BTreeMap::from([(
            1,
            AffinityPolicy {
                timeout_s: 10,
                active_backends: BTreeSet::from([7, 8]),
            },
        )]);
        let now = 100 * 1_000_000_000;
        let cases = [
            ("fresh entry stays", key(1, 1), entry(7, 95), None),
            (
                "exactly at the timeout stays",
                key(2, 1),
                entry(8, 90),
                None,
            ),
            (
                "past the timeout goes",
                key(3, 1),
                entry(7, 89),
                Some(Stale::Expired),
            ),
            (
                "backend left the Service",
                key(4, 1),
                entry(9, 99),
                Some(Stale::BackendLeft),
            ),
            (
                "Service without affinity",
                key(5, 2),
                entry(7, 99),
                Some(Stale::NoPolicy),
            ),
        ];
        for (name, k, e, want) in cases {
            assert_eq!(stale(&k, &e, &policies, now), want, "{name}");
        }
    }
}
