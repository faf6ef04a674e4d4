//! Frontend lookup and backend selection shared by every hook, as Cilium's
//! `lb.h` is: the socket programs and the tc programs differ only in how
//! they hash a flow and who the client is.
use aya_ebpf::{
    bindings::{BPF_ANY, BPF_NOEXIST},
    helpers::generated::{bpf_get_prandom_u32, bpf_ktime_get_ns, bpf_spin_lock, bpf_spin_unlock},
};
use core::intrinsics::{atomic_xadd, AtomicOrdering::Relaxed};

use lb_common::{
    algorithm, capacity, outlier, select, service_flags, stat, AffinityEntry, AffinityKey, Backend,
    BackendId, DatagramFlow, DatagramFlowKey, KeyCheck, ServiceKey, ServiceValue,
};

use crate::maps::{
    count, LB_AFFINITY, LB_BACKENDS, LB_BACKEND_HEALTH, LB_BACKEND_STATE, LB_DGRAM_FLOWS,
    LB_FRONTEND_STATE, LB_MAGLEV, LB_SERVICES, LB_SLOTS, LB_TC_CONFIG,
};

/// The round-robin turn of frontend `id` (`None` for an id past
/// `LB_FRONTEND_STATE`), taken under the frontend's lock so that every
/// turn goes to exactly one connection, from any CPU (see
/// `lb_common::bpf_spin_lock` for why not an atomic fetch-and-add).
#[inline(always)]
fn rr_turn(id: u32) -> Option<u32> {
    let state = LB_FRONTEND_STATE.get_ptr_mut(id)?;
    // SAFETY: a valid element for this run. The verifier allows nothing
    // but this value's own loads and stores between lock and unlock.
    unsafe {
        let lock = (&raw mut (*state).lock).cast();
        bpf_spin_lock(lock);
        let turn = (*state).rr_cursor;
        (*state).rr_cursor = turn.wrapping_add(1);
        bpf_spin_unlock(lock);
        Some(turn)
    }
}

/// Backend `id`'s open connections from this node (0 if unknown).
#[inline(always)]
fn open_of(id: u32) -> u32 {
    match LB_BACKEND_STATE.get_ptr(id) {
        // SAFETY: a valid element; one word read.
        Some(state) => unsafe { core::ptr::read_volatile(state) }.open(),
        None => 0,
    }
}

/// Adds `delta` to backend `id`'s counted sockets (`BackendState::sockets`).
#[inline(always)]
fn add_sockets(id: u32, delta: i32) {
    if let Some(state) = LB_BACKEND_STATE.get_ptr_mut(id) {
        // SAFETY: a valid element, which the kernel writes only with
        // atomic adds (the agent only resets a free id's).
        unsafe { atomic_xadd::<i32, i32, { Relaxed }>(&raw mut (*state).sockets, delta) };
    }
}

/// One more open socket to backend `id`, the socket's until its release
/// (`close_counted`).
#[inline(always)]
pub fn open_counted(id: u32) {
    add_sockets(id, 1);
}

/// A counted socket to backend `id` was released.
#[inline(always)]
pub fn close_counted(id: u32) {
    add_sockets(id, -1);
}

/// One more flow to backend `id`, of the tc path or a UDP socket's
/// (`LB_DGRAM_FLOWS`); the agent's sweep takes it back once the flow is
/// gone (`BackendState::flows`).
#[inline(always)]
pub fn flow_counted(id: u32) {
    if let Some(state) = LB_BACKEND_STATE.get_ptr_mut(id) {
        // SAFETY: as `add_sockets`; the agent's corrections are atomic adds.
        unsafe { atomic_xadd::<i32, i32, { Relaxed }>(&raw mut (*state).flows, 1) };
    }
}

/// What a destination is to the load balancer (`lookup_frontend`).
pub enum Frontend {
    /// A frontend: its value, written whole for its key.
    Served(ServiceValue),
    /// A live VIP (its marker is there) on a port it does not serve.
    PortNotServed,
    /// No VIP: nothing of ours.
    NotOurs,
}

/// How many times a frontend is looked up while its VIP's marker says it
/// may exist: a value copied torn or another key's (`check_for`), or a
/// miss while the agent replaces the key's value, is looked up again.
const FRONTEND_LOOKUPS: usize = 3;

/// The frontend under `key`. A miss is only believed once the VIP's
/// marker is looked up too (with `vip_check`; else a miss is `NotOurs`):
/// an update of an existing key of a preallocated hash (`LB_SERVICES`)
/// links the new element at the head of its bucket and unlinks the old
/// one, which the next update on that CPU reuses at once, so a lookup
/// that was passing the old element as it was unlinked or reused can end
/// its walk without the key (see "Recycled elements" in docs/maps.md).
/// The agent writes a VIP's marker once and never replaces it, so the
/// marker's own lookup cannot miss that way; a lookup made again after
/// a miss starts from the new head.
#[inline(always)]
pub fn lookup_frontend(key: &ServiceKey, vip_check: bool) -> Frontend {
    let mut missed = false;
    for _ in 0..FRONTEND_LOOKUPS {
        match LB_SERVICES.get_ptr(key) {
            Some(v) => {
                // SAFETY: the value is copied out at once and kept only if
                // it was written whole for this key (`check_for`); the
                // agent replaces values whole.
                let v = unsafe { core::ptr::read(v) };
                if v.key_check == v.check_for(key) {
                    if missed {
                        count(stat::FRONTEND_LOOKED_UP_AGAIN);
                    }
                    return Frontend::Served(v);
                }
            }
            // The marker once: it cannot be missed (see above).
            None if !missed => {
                if !vip_check
                    || LB_SERVICES
                        .get_ptr(&ServiceKey::wildcard(key.addr, key.scope))
                        .is_none()
                {
                    return Frontend::NotOurs;
                }
                missed = true;
            }
            None => {}
        }
    }
    if !missed {
        count(stat::FOREIGN_VALUE);
    }
    if vip_check {
        Frontend::PortNotServed
    } else {
        Frontend::NotOurs
    }
}

/// Backend `id`, if the id is in use: a free id's element is zeros, whose
/// `key_check` fails; one written for another id (by hand) is counted.
#[inline(always)]
pub fn backend_by_id(id: u32) -> Option<Backend> {
    // SAFETY: copied out at once. The agent writes an element in place
    // only to change its flags (its address stays), to free it once no
    // published set names it, or to reuse a freed id later.
    let b = unsafe { core::ptr::read(LB_BACKENDS.get_ptr(id)?) };
    if b.key_check == (BackendId { id }).key_check() {
        return Some(b);
    }
    if b.key_check != 0 {
        count(stat::FOREIGN_VALUE);
    }
    None
}

/// Whether id `id` is backend `addr:port`, or free (its last backend's,
/// kept while connections counted for it are open); false if another
/// backend has it.
#[inline(always)]
pub fn backend_is_or_was(id: u32, addr: &[u8; 16], port: u16) -> bool {
    let Some(b) = LB_BACKENDS.get_ptr(id) else {
        return false;
    };
    // SAFETY: copied out at once.
    let b = unsafe { core::ptr::read(b) };
    if b.key_check == 0 {
        return true;
    }
    b.key_check == (BackendId { id }).key_check() && b.addr == *addr && b.port == port
}

/// Whether backend `id` is in use (`backend_by_id` without the copy).
#[inline(always)]
pub fn backend_exists(id: u32) -> Option<()> {
    let b = LB_BACKENDS.get_ptr(id)?;
    // SAFETY: a valid element; one word read.
    let check = unsafe { core::ptr::read_volatile(&(*b).key_check) };
    (check == BackendId { id }.key_check()).then_some(())
}

/// The backend id in `slot` of the frontend's set.
#[inline(always)]
fn slot_backend(svc: &ServiceValue, slot: u32) -> Option<u32> {
    // SAFETY: copied out at once. A published range is never written: a
    // new set takes a range no value names, and an old one is given back
    // only after a delay (see `ServiceValue`).
    let s = unsafe { core::ptr::read(LB_SLOTS.get_ptr(svc.slot_base.wrapping_add(slot))?) };
    let id = s.backend_of(svc.backend_set, slot);
    if id.is_none() {
        count(stat::FOREIGN_VALUE);
    }
    id
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

/// What a hook hashes for a scheduler that hashes: the flow (Maglev),
/// the client (sh) or the destination (dh).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum HashOf {
    Flow,
    Client,
    Destination,
}

/// A hook's hashes of a new flow, computed only when a scheduler asks.
/// A trait with an always-inlined method, not a closure: LLVM outlined
/// the closure into a subprogram of its own, whose frame took the
/// connect hooks' chain of calls past the 512 bytes of stack.
pub trait FlowHashes: Copy {
    fn hash(&self, of: HashOf) -> u32;
}

/// A backend for a new flow, by the frontend's scheduler
/// (`ServiceValue::algorithm`; `OUTLINE_IPVS`: whether rr, lc, sed and nq
/// choose in a function of their own, see `ipvs_slot_outlined`): through its Maglev table with the hash
/// the hook computes of what the scheduler hashes (only when needed), in
/// turn, by fewest open connections, or uniformly at random (with the
/// hook's random number, only when needed).
#[inline(always)]
pub fn choose<const OUTLINE_IPVS: bool>(
    svc: &ServiceValue,
    hashes: impl FlowHashes,
    random: impl FnOnce() -> u32,
) -> Option<(u32, Backend)> {
    let id = choose_id::<OUTLINE_IPVS>(svc, hashes, random)?;
    Some((id, backend_by_id(id)?))
}

/// `choose`, the backend's id only (a caller that copies the backend
/// elsewhere itself). A frontend that avoids quarantined backends
/// (`service_flags::OUTLIER_AVOID`) chooses again when its scheduler's
/// pick is quarantined (`avoid_quarantined`: the quarantine is checked
/// only for the pick, not per backend of lc's first scan, which would
/// cost every connect a clock read).
#[inline(always)]
pub fn choose_id<const OUTLINE_IPVS: bool>(
    svc: &ServiceValue,
    hashes: impl FlowHashes,
    random: impl FnOnce() -> u32,
) -> Option<u32> {
    let algorithm = svc.algorithm();
    count(stat::CHOSEN + (algorithm & 7) as u32);
    // The pick, and the hash a table scheduler draws again from (0: the
    // others draw at random).
    let (id, hash) = match algorithm {
        // Not a table (a frontend programmed by hand, or no active
        // backend: the terminating fallback is random): at random below.
        a if algorithm::uses_table(a) && select::uses_maglev(svc) => {
            let of = match a {
                algorithm::SH => HashOf::Client,
                algorithm::DH => HashOf::Destination,
                _ => HashOf::Flow,
            };
            let hash = hashes.hash(of);
            match table_backend(svc, select::maglev_position(svc, hash)) {
                Some(id) => (id, hash | 1),
                None => (slot_backend(svc, select::slot(svc, random())?)?, 0),
            }
        }
        algorithm::RR | algorithm::LC | algorithm::SED | algorithm::NQ => {
            let r = random();
            let slot = if OUTLINE_IPVS {
                ipvs_slot_outlined(svc, r)
            } else {
                ipvs_slot(svc, r)
            };
            let slot = match slot {
                NO_SLOT => return None,
                slot => slot,
            };
            (slot_backend(svc, slot)?, 0)
        }
        _ => (slot_backend(svc, select::slot(svc, random())?)?, 0),
    };
    // One path on from here whatever the quarantine says (the function
    // returns `id` itself unless it must avoid it): a branch here would
    // have the verifier walk the caller's rest once per outcome.
    unquarantined(svc, id, hash)
}

/// `first` or its substitute (`avoid_quarantined`), with the frontend
/// packed into the scalars a global function takes.
#[inline(always)]
fn unquarantined(svc: &ServiceValue, first: u32, hash: u32) -> Option<u32> {
    let id = avoid_quarantined(svc.slot_base, svc.backend_set, shape(svc), first, hash);
    // The verifier knows nothing of a global function's result. No
    // backend has a larger id (`LB_BACKENDS` ends there): none, as its
    // lookup would give.
    (id < capacity::BACKENDS).then_some(id)
}

/// Whether new flows to `svc` avoid quarantined backends (read where
/// needed rather than kept: the tc path's frame has no room to spare).
#[inline(always)]
fn avoids(svc: &ServiceValue) -> bool {
    svc.flags & service_flags::OUTLIER_AVOID != 0
}

/// Whether new flows avoid backend `id` now (`BackendHealth::until_ns`
/// ahead of the clock). The clock is read only for a backend that was
/// ever quarantined.
#[inline(always)]
pub fn quarantined(id: u32) -> bool {
    let Some(health) = LB_BACKEND_HEALTH.get_ptr(id) else {
        return false;
    };
    // SAFETY: a valid element; one aligned word, written whole under the
    // element's lock.
    let until = unsafe { core::ptr::read_volatile(&(*health).until_ns) };
    // SAFETY: plain helper call.
    until != 0 && until > unsafe { bpf_ktime_get_ns() }
}

/// The frontend's `active`, `terminating`, `flags` and `maglev_size`, as
/// they lie in `ServiceValue`: one word, which the hook may hold already.
#[inline(always)]
fn shape(svc: &ServiceValue) -> u64 {
    svc.active as u64
        | (svc.terminating as u64) << 16
        | (svc.flags as u64) << 32
        | (svc.maglev_size as u64) << 48
}

/// `first`, the scheduler's pick, unless its frontend avoids quarantine
/// and it is quarantined; then another. lc, sed and nq scan again with
/// every quarantined backend counted as fuller than any other
/// (`least_loaded_answering`): their pick is quarantined mostly because a
/// refusing backend holds no connection, and a random substitute would
/// leave the others unbalanced for as long as the quarantine lasts. The
/// others: `outlier::REDRAWS` draws (table schedulers: positions of the
/// flow's `hash` drawn again, so that a client keeps its substitute; rr
/// and random: random slots), then the first unquarantined of up to
/// `CAP_SCAN` slots in a row; `first` if all are quarantined (lc, sed
/// and nq: the least loaded; never none).
///
/// A global function, which the verifier checks once per program that
/// calls it: as a static function it was verified once per calling
/// context, and with lc's second scan in it that took the agent's
/// verification of its programs from ~10 s to ~17 s; as a global, with
/// it, ~5 s (against ~9.5 s for the static function without it, on one
/// busy machine). So it takes
/// scalars only, what it reads of the frontend among them (`shape`), and
/// rebuilds the frontend from them.
#[no_mangle]
#[inline(never)]
pub extern "C" fn avoid_quarantined(
    slot_base: u32,
    backend_set: u32,
    shape: u64,
    first: u32,
    hash: u32,
) -> u32 {
    let svc = ServiceValue {
        id: 0,
        backend_set,
        active: shape as u16,
        terminating: (shape >> 16) as u16,
        flags: (shape >> 32) as u16,
        maglev_size: (shape >> 48) as u16,
        affinity_timeout: 0,
        affinity_id: 0,
        key_check: 0,
        slot_base,
    };
    substitute(&svc, first, hash)
}

/// `avoid_quarantined`'s body.
#[inline(always)]
fn substitute(svc: &ServiceValue, first: u32, hash: u32) -> u32 {
    if !avoids(svc) || !quarantined(first) {
        return first;
    }
    if algorithm::counts(svc.algorithm()) {
        return least_loaded_answering(svc).unwrap_or(first);
    }
    let by_table = hash != 0;
    let mut i = 1;
    while i <= outlier::REDRAWS {
        let id = if by_table {
            table_backend(svc, select::maglev_position(svc, outlier::redraw(hash, i)))
        } else {
            // SAFETY: plain helper call.
            select::slot(svc, unsafe { bpf_get_prandom_u32() }).and_then(|s| slot_backend(svc, s))
        };
        if let Some(id) = id {
            if !quarantined(id) {
                count(stat::QUARANTINE_AVOIDED);
                return id;
            }
        }
        i += 1;
    }
    let Some((base, n)) = select::candidates(svc) else {
        return first;
    };
    let draw = if by_table {
        outlier::redraw(hash, 0)
    } else {
        // SAFETY: plain helper call.
        unsafe { bpf_get_prandom_u32() }
    };
    // `candidates` has n > 0; `checked_rem` keeps a panic path out of the
    // program (the verifier rejects a function that ends in one).
    let start = draw.checked_rem(n).unwrap_or(0);
    let mut j = 0;
    while j < outlier::CAP_SCAN && j < n {
        let mut at = start + j;
        if at >= n {
            at -= n;
        }
        if let Some(id) = slot_backend(svc, base + at) {
            if !quarantined(id) {
                count(stat::QUARANTINE_AVOIDED);
                return id;
            }
        }
        j += 1;
    }
    first
}

/// lc's pick (`select::least_loaded`) with a quarantined backend's open
/// connections given the top bit, so that it is taken only when every
/// scanned backend is quarantined. Without a branch on the quarantine
/// (as `ejection_allowed`): a branch per scanned backend gives the
/// verifier a path per combination of them. `open` is below 2^31
/// (`BackendState::open` clamps an i32), so the bit orders alone.
#[inline(always)]
fn least_loaded_answering(svc: &ServiceValue) -> Option<u32> {
    // SAFETY: plain helper calls.
    let (now, random) = unsafe { (bpf_ktime_get_ns(), bpf_get_prandom_u32()) };
    let slot = select::least_loaded(svc, random, |slot| {
        let id = slot_backend(svc, slot)?;
        let until = match LB_BACKEND_HEALTH.get_ptr(id) {
            // SAFETY: a valid element; one aligned word.
            Some(health) => unsafe { core::ptr::read_volatile(&(*health).until_ns) },
            None => 0,
        };
        // 1 while quarantined (until ahead of now; both < 2^63).
        let ahead = (now.wrapping_sub(until) >> 63) as u32;
        Some(open_of(id) | ahead << 31)
    })?;
    let id = slot_backend(svc, slot)?;
    if !quarantined(id) {
        count(stat::QUARANTINE_AVOIDED);
    }
    Some(id)
}

/// Whether one more of `svc`'s backends may be quarantined at `now`,
/// `id` being the one due (`outlier::ejection_allowed` over its first
/// `CAP_SCAN` selectable backends). The count is kept without a branch on
/// each backend's state: a branch per backend gives the verifier a path
/// per combination of them to walk (2^64), where sums of unknown bits
/// give it one.
#[inline(never)]
pub fn ejection_allowed(svc: &ServiceValue, id: u32, now: u64, max_percent: u32) -> bool {
    let Some((base, n)) = select::candidates(svc) else {
        return false;
    };
    let scanned = if n < outlier::CAP_SCAN {
        n
    } else {
        outlier::CAP_SCAN
    };
    let mut quarantined_now = 0u32;
    let mut j = 0;
    while j < scanned {
        // The slot's backend id unchecked (`slot_backend` checks it): a
        // slot rewritten meanwhile only skews this estimate.
        let slot = svc.slot_base.wrapping_add(base + j);
        if let Some(slot) = LB_SLOTS.get_ptr(slot) {
            // SAFETY: a valid element; one word.
            let other = unsafe { core::ptr::read_volatile(&(*slot).backend_id) };
            if let Some(health) = LB_BACKEND_HEALTH.get_ptr(other) {
                // SAFETY: a valid element; one aligned word.
                let until = unsafe { core::ptr::read_volatile(&(*health).until_ns) };
                // 1 while quarantined (until ahead of now; both < 2^63).
                let ahead = (now.wrapping_sub(until) >> 63) as u32;
                // 1 unless `other` is `id`.
                let differs = other ^ id;
                let differs = (differs | differs.wrapping_neg()) >> 31;
                quarantined_now += ahead & differs;
            }
        }
        j += 1;
    }
    outlier::ejection_allowed(quarantined_now, scanned, n, max_percent)
}

/// `ipvs_slot`'s answer when the frontend has no backend to offer.
const NO_SLOT: u32 = u32::MAX;

/// The slot rr, lc, sed or nq choose (`NO_SLOT` if none). A function of
/// its own (not inlined) for the socket hooks: its loop and lookups spill
/// on its own small frame, beside the hooks' deepest chain of calls, which
/// they would push past 512 bytes of stack inlined into each caller.
#[inline(never)]
fn ipvs_slot_outlined(svc: &ServiceValue, random: u32) -> u32 {
    ipvs_slot(svc, random)
}

/// `ipvs_slot_outlined`'s body, inlined where that takes less stack (the
/// tc path's new flow, whose frame holds the values it reads already).
/// A quarantined pick is replaced by the caller (`avoid_quarantined`).
#[inline(always)]
fn ipvs_slot(svc: &ServiceValue, random: u32) -> u32 {
    let slot = if svc.algorithm() == algorithm::RR {
        match rr_turn(svc.id) {
            Some(turn) => select::rr_slot(svc, turn),
            None => select::slot(svc, random),
        }
    } else {
        // A quarantined pick is replaced by `avoid_quarantined`: a check
        // here, per backend, costs each socket program seconds of
        // verification. Each slot's backend is checked (`slot_backend`):
        // read unchecked (as `ejection_allowed` does), the scan took
        // connect4 past the verifier's million instructions.
        select::least_loaded(svc, random, |slot| slot_backend(svc, slot).map(open_of))
    };
    slot.unwrap_or(NO_SLOT)
}

/// sessionAffinity ClientIP: the client under `key` keeps its backend while
/// it keeps using it within the Service's timeout (the kernel checks the time
/// itself); otherwise `fresh` chooses and the choice is recorded. The agent
/// deletes entries whose backend left the Service, so a live entry is always
/// a valid choice. `backend` is what the caller takes of a backend by id
/// (`backend_by_id`), None if there is none.
#[inline(always)]
pub fn with_affinity<T>(
    key: &AffinityKey,
    svc: &ServiceValue,
    now: u64,
    backend: impl FnOnce(u32) -> Option<T>,
    fresh: impl FnOnce() -> Option<(u32, T)>,
) -> Option<(u32, T)> {
    if let Some(entry) = LB_AFFINITY.get_ptr_mut(key) {
        // SAFETY: the pointer is valid for this program run; a concurrent
        // update of the same 8-byte timestamp is harmless.
        let e = unsafe { core::ptr::read(entry) };
        if select::affinity_live(&e, now, svc.affinity_timeout) {
            if let Some(b) = backend(e.backend_id) {
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

/// A UDP socket's datagrams to one frontend (the flow under `key`) keep
/// the backend of the first while the flow is live (a datagram within
/// `--conntrack-udp-timeout`), it names this frontend's current service id
/// (a frontend removed and created again is another one) and its backend
/// exists; otherwise `fresh` chooses and the choice is recorded.
///
/// Whether the backend is still in the frontend's set is not checked here:
/// that is a walk of the set per datagram. The agent deletes flows whose
/// backend left the frontend's serving set right after publishing the new
/// set, so a live flow is a valid choice; in between (the rest of that
/// sync, milliseconds) its datagrams still reach the departing backend, as
/// under kube-proxy until it clears the conntrack entry. A set that only
/// changes otherwise (a backend joins) moves no flow.
#[inline(always)]
pub fn with_datagram_flow(
    key: &DatagramFlowKey,
    svc: &ServiceValue,
    now: u64,
    fresh: impl FnOnce() -> Option<(u32, Backend)>,
) -> Option<(u32, Backend)> {
    // The element always exists; 0 until the agent's first sync writes it.
    let timeout_s = LB_TC_CONFIG.get(0).map_or(0, |c| c.udp_timeout_s);
    let recorded = LB_DGRAM_FLOWS.get_ptr_mut(key);
    if let Some(entry) = recorded {
        // SAFETY: valid for this program run; a concurrent refresh of the
        // same 8-byte timestamp is harmless.
        let flow = unsafe { core::ptr::read(entry) };
        if let Some(b) = flow_backend(&flow, svc, now, timeout_s) {
            unsafe { (*entry).last_used_ns = now };
            return Some((flow.backend_id, b));
        }
    }
    let (id, backend) = fresh()?;
    let flow = DatagramFlow {
        backend_id: id,
        service_id: svc.id,
        last_used_ns: now,
    };
    if recorded.is_some() {
        // Replaces a flow that no longer binds. A full LRU map evicts its
        // oldest entry; a failure to record only lets the next datagram
        // choose again.
        let _ = LB_DGRAM_FLOWS.insert(key, &flow, BPF_ANY as u64);
    } else if LB_DGRAM_FLOWS
        .insert(key, &flow, BPF_NOEXIST as u64)
        .is_err()
    {
        // Another CPU recorded this socket's flow since the lookup (two
        // threads sending their first datagrams at once): follow it, so
        // that both go to one backend.
        if let Some(entry) = LB_DGRAM_FLOWS.get_ptr(key) {
            // SAFETY: copied out at once.
            let other = unsafe { core::ptr::read(entry) };
            if let Some(b) = flow_backend(&other, svc, now, timeout_s) {
                return Some((other.backend_id, b));
            }
        }
    }
    // A new flow counts for lc, sed and nq while its record lives (the
    // agent's sweep takes back what expired, was replaced or evicted).
    if algorithm::counts(svc.algorithm()) {
        flow_counted(id);
    }
    Some((id, backend))
}

/// The backend `flow` binds its socket to at `now`, if it still does.
#[inline(always)]
fn flow_backend(
    flow: &DatagramFlow,
    svc: &ServiceValue,
    now: u64,
    timeout_s: u32,
) -> Option<Backend> {
    if flow.service_id == svc.id && flow.live(now, timeout_s) {
        backend_by_id(flow.backend_id)
    } else {
        None
    }
}
