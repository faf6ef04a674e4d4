//! The maps every hook shares. Layouts live in `lb-common`; the capacities
//! here are defaults the agent overrides at load time.
use aya_ebpf::{
    btf_maps::{HashMap, LruHashMap, PerCpuArray},
    macros::btf_map,
};
use lb_common::{
    capacity, stat, AffinityEntry, AffinityKey, Backend, BackendId, BackendSlot, BackendSlotKey,
    ReverseSockKey, ReverseSockValue, ServiceKey, ServiceValue,
};

#[btf_map]
pub static LB_SERVICES: HashMap<ServiceKey, ServiceValue, { capacity::SERVICES as usize }> =
    HashMap::new();

#[btf_map]
pub static LB_SLOTS: HashMap<BackendSlotKey, BackendSlot, { capacity::SLOTS as usize }> =
    HashMap::new();

#[btf_map]
pub static LB_BACKENDS: HashMap<BackendId, Backend, { capacity::BACKENDS as usize }> =
    HashMap::new();

#[btf_map]
pub static LB_REV_SOCK: LruHashMap<
    ReverseSockKey,
    ReverseSockValue,
    { capacity::REV_SOCK as usize },
> = LruHashMap::new();

#[btf_map]
pub static LB_AFFINITY: LruHashMap<AffinityKey, AffinityEntry, { capacity::AFFINITY as usize }> =
    LruHashMap::new();

#[btf_map]
pub static LB_STATS: PerCpuArray<u64, { stat::COUNT as usize }> = PerCpuArray::new();

#[inline(always)]
pub fn count(index: u32) {
    if let Some(counter) = LB_STATS.get_ptr_mut(index) {
        // SAFETY: a per-CPU slot is only touched by the program running on
        // that CPU, and programs do not nest within one CPU here.
        unsafe { *counter += 1 };
    }
}
