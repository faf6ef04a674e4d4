//! Frontend lookup and backend selection shared by every hook, as Cilium's
//! `lb.h` is: the socket programs and the tc programs differ only in how
//! they hash a flow and who the client is.
use aya_ebpf::{bindings::BPF_ANY, helpers::bpf_get_prandom_u32};
use lb_common::{
    select, stat, AffinityEntry, AffinityKey, Backend, BackendId, BackendSlotKey, ServiceKey,
    ServiceValue,
};

use crate::maps::{count, LB_AFFINITY, LB_BACKENDS, LB_MAGLEV, LB_SERVICES, LB_SLOTS};

#[inline(always)]
pub fn lookup_service(key: &ServiceKey) -> Option<ServiceValue> {
    // SAFETY: the value is copied out at once; the agent replaces values
    // whole, so a copy is either the old or the new one.
    LB_SERVICES
        .get_ptr(key)
        .map(|p| unsafe { core::ptr::read(p) })
}

#[inline(always)]
pub fn backend_by_id(id: u32) -> Option<Backend> {
    // SAFETY: copied out at once, as in `lookup_service`.
    LB_BACKENDS
        .get_ptr(&BackendId { id })
        .map(|p| unsafe { core::ptr::read(p) })
}

/// The backend id in `slot` of the frontend's set.
#[inline(always)]
fn slot_backend(svc: &ServiceValue, slot: u32) -> Option<u32> {
    let key = BackendSlotKey {
        backend_set: svc.backend_set,
        slot,
    };
    // SAFETY: copied out at once, as in `lookup_service`.
    Some(unsafe { core::ptr::read(LB_SLOTS.get_ptr(&key)?) }.backend_id)
}

/// The backend id at `position` of the frontend's Maglev table.
#[inline(always)]
fn table_backend(svc: &ServiceValue, position: u32) -> Option<u32> {
    let set = svc.backend_set;
    let (entry, index) = select::maglev_entry(position);
    // SAFETY: read at once; a published table is never written again (a
    // new one replaces it), and one taken out of `LB_MAGLEV` is freed only
    // once no program can hold it.
    let entry = unsafe { LB_MAGLEV.get_value(&set, &entry) }?;
    Some(entry.backend_ids[index])
}

/// A backend for a new flow: through the Maglev table (with the flow hash
/// the hook computes, only when it is needed) or uniformly at random.
#[inline(always)]
pub fn choose(svc: &ServiceValue, flow_hash: impl FnOnce() -> u32) -> Option<(u32, Backend)> {
    let from_table = if select::uses_maglev(svc) {
        table_backend(svc, select::maglev_position(svc, flow_hash()))
    } else {
        None
    };
    let id = match from_table {
        Some(id) => id,
        // Not Maglev, or no table: maps of an agent version that kept the
        // tables in `LB_SLOTS`, until its first sync rewrites them; the
        // active backends are all there to choose from.
        // SAFETY: plain helper call.
        None => slot_backend(svc, select::slot(svc, unsafe { bpf_get_prandom_u32() })?)?,
    };
    Some((id, backend_by_id(id)?))
}

/// sessionAffinity ClientIP: the client under `key` keeps its backend while
/// it keeps using it within the Service's timeout (the kernel checks the time
/// itself); otherwise `fresh` chooses and the choice is recorded. The agent
/// deletes entries whose backend left the Service, so a live entry is always
/// a valid choice.
#[inline(always)]
pub fn with_affinity(
    key: &AffinityKey,
    svc: &ServiceValue,
    now: u64,
    fresh: impl FnOnce() -> Option<(u32, Backend)>,
) -> Option<(u32, Backend)> {
    if let Some(entry) = LB_AFFINITY.get_ptr_mut(key) {
        // SAFETY: the pointer is valid for this program run; a concurrent
        // update of the same 8-byte timestamp is harmless.
        let e = unsafe { core::ptr::read(entry) };
        if select::affinity_live(&e, now, svc.affinity_timeout) {
            if let Some(b) = backend_by_id(e.backend_id) {
                unsafe { (*entry).last_used_ns = now };
                count(stat::AFFINITY_HIT);
                return Some((e.backend_id, b));
            }
        }
    }
    let (id, backend) = fresh()?;
    let entry = AffinityEntry {
        backend_id: id,
        _pad: 0,
        last_used_ns: now,
    };
    // A full LRU map evicts its oldest entry; failing to record only costs
    // this client its stickiness for one connection.
    let _ = LB_AFFINITY.insert(key, &entry, BPF_ANY as u64);
    Some((id, backend))
}
