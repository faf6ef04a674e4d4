//! Diffs the desired state against what is programmed and writes only the
//! difference, through `MapOps` so that the logic is tested without a kernel.
//!
//! Write order is what makes every change safe for a concurrent connect:
//! 1. backends a frontend will use are written before any slot points at them;
//! 2. a changed backend set is written under a fresh `backend_set` id into a
//!    range of `LB_SLOTS` that no published value names (`slot_ranges`),
//!    and a Maglev frontend's table made whole and put in `LB_MAGLEV` under
//!    that id; then both are published by one update of the frontend's
//!    `ServiceValue`;
//! 3. the old set's slots (cleared, their range given back) and table, and
//!    backends nothing points at any more, are deleted only in `retire`,
//!    which the caller runs a little later, so a program that read the old
//!    `ServiceValue` still finds them.
//!
//! Each frontend is all or nothing. When one of its writes fails (a map is
//! full, a table cannot be made), what was written for it is named by
//! nothing and retired, and its previous state, if it had one, stays
//! programmed; a new one gets no entry, and its VIP no marker while no
//! frontend of that VIP is programmed. The failure is kept in
//! [`Reconciler::unprogrammed`] (for the log, `/metrics` and `inspect`)
//! until an apply programs the frontend; every apply after a failure
//! compares everything, and [`Reconciler::room_made`] says when a retire
//! freed entries that a retry may now use.
//!
//! Bulk writes go through the batch methods of `MapOps` (one
//! `BPF_MAP_UPDATE_BATCH` per map over the real maps, see `batch`): every
//! backend, then every slot of every new set, then every Maglev table,
//! then every `ServiceValue`, each step finished before the next starts, so
//! the order above holds across all frontends of a sync. A batch that stops
//! part-way is finished element by element, so each failure is still
//! reported against its object.
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    fmt,
    net::IpAddr,
    sync::Arc,
};

use rustc_hash::FxHashMap;

use lb_common::{
    backend_flags, service_flags, unprogrammed_map, Backend, BackendId, BackendSlot, ServiceKey,
    ServiceValue,
};

use crate::{
    base::addr::addr_bytes,
    datapath::slot_ranges::SlotRanges,
    semantics::model::{
        AffinityGroup, BackendAddr, DesiredState, Frontend, FrontendKind, FrontendState, Protocol,
        Scope, ServiceName,
    },
    semantics::stale_udp::{self, StaleUdp},
};

/// A map operation failed; `what` names the object it was for.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {source}")]
pub struct MapWriteError {
    pub what: String,
    #[source]
    pub source: std::io::Error,
}

/// Which step of [`MapOps::put_maglev`] failed.
#[derive(Debug)]
pub enum MaglevWriteError {
    /// Creating or filling the table (`LB_MAGLEV_TABLE`).
    Table(std::io::Error),
    /// Putting it in `LB_MAGLEV`.
    Insert(std::io::Error),
}

/// The writes the reconciler needs; implemented over the pinned BPF maps and,
/// in tests, over plain collections.
pub trait MapOps {
    fn put_service(&mut self, key: ServiceKey, value: ServiceValue) -> std::io::Result<()>;
    fn del_service(&mut self, key: ServiceKey) -> std::io::Result<()>;
    /// Writes `LB_SLOTS` element `index` (the value carries its check).
    fn put_slot(&mut self, index: u32, value: BackendSlot) -> std::io::Result<()>;
    /// Clears `LB_SLOTS` element `index` (zeros: a free element).
    fn del_slot(&mut self, index: u32) -> std::io::Result<()>;
    fn put_backend(&mut self, id: BackendId, backend: Backend) -> std::io::Result<()>;
    fn del_backend(&mut self, id: BackendId) -> std::io::Result<()>;
    /// Zeroes this node's state of backend `id` (`LB_BACKEND_STATE`: its
    /// open connections) before a backend takes the free id: what the
    /// connections of the backend that held it before left counted there
    /// is not the new one's.
    fn reset_backend_state(&mut self, _id: BackendId) -> std::io::Result<()> {
        Ok(())
    }
    /// Whether connections counted for backend `id` are still open
    /// (`BackendState::open`): its id is not given to another backend
    /// until they close, and the backend keeps it if it comes back.
    fn backend_busy(&mut self, _id: BackendId) -> bool {
        false
    }
    /// Makes a Maglev table holding `table` (position -> backend id) and
    /// puts it in `LB_MAGLEV` under `set`, which nothing names yet: the
    /// frontend's value publishes it afterwards. On failure nothing of the
    /// table is left.
    fn put_maglev(&mut self, set: u32, table: &[u32]) -> Result<(), MaglevWriteError>;
    /// Takes the table under `set` out of `LB_MAGLEV`; the kernel frees it
    /// once no program holds it.
    fn del_maglev(&mut self, set: u32) -> std::io::Result<()>;
    /// The table under `set`, of `size` positions (adopted tables are
    /// checked): an error if it is not a table of that size.
    fn get_maglev(&mut self, set: u32, size: u16) -> std::io::Result<Vec<u32>>;

    /// [`put_maglev`](Self::put_maglev) for each of `tables` (set, table),
    /// with each one's result, in order. Over the real maps it is one
    /// write to `LB_MAGLEV` for all: the kernel makes every write to a map
    /// of maps wait until no program can still hold what it replaced (an
    /// RCU grace period, ~10 ms), once per call. The default is the
    /// per-table loop, which the unit tests observe write by write.
    fn put_maglevs(&mut self, tables: &[(u32, Vec<u32>)]) -> Vec<Result<(), MaglevWriteError>> {
        tables
            .iter()
            .map(|(set, table)| self.put_maglev(*set, table))
            .collect()
    }
    /// [`del_maglev`](Self::del_maglev) for each of `sets` (one write over
    /// the real maps, as [`put_maglevs`](Self::put_maglevs)); a table
    /// already gone is what we want. The sets that could not be deleted.
    fn del_maglevs(&mut self, sets: &[u32]) -> Vec<(u32, std::io::Error)> {
        sets.iter()
            .filter_map(|set| match self.del_maglev(*set) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Some((*set, e)),
                _ => None,
            })
            .collect()
    }

    /// Writes `items` in order (one `BPF_MAP_UPDATE_BATCH` over the real
    /// maps); on failure, how many were written before the one that failed.
    /// The default is the per-element loop, which the unit tests observe
    /// write by write.
    fn put_backends(&mut self, items: &[(BackendId, Backend)]) -> BatchResult {
        each(items, |k, v| self.put_backend(k, v))
    }
    /// Like [`put_backends`](Self::put_backends), for backend slots.
    fn put_slots(&mut self, items: &[(u32, BackendSlot)]) -> BatchResult {
        each(items, |k, v| self.put_slot(k, v))
    }
    /// Like [`put_backends`](Self::put_backends), for frontends.
    fn put_services(&mut self, items: &[(ServiceKey, ServiceValue)]) -> BatchResult {
        each(items, |k, v| self.put_service(k, v))
    }
    /// Clears every slot in `indexes`. Best effort: an element left
    /// behind belongs to no published set, so no program takes it, and the
    /// next set given its range overwrites it.
    fn del_slots(&mut self, indexes: &[u32]) {
        for i in indexes {
            let _ = self.del_slot(*i);
        }
    }
}

/// A batch write: `Err((written, error))` when the element at `written` failed.
pub type BatchResult = Result<(), (usize, std::io::Error)>;

/// `write` for each item in order, stopping at the first failure.
fn each<K: Copy, V: Copy>(
    items: &[(K, V)],
    mut write: impl FnMut(K, V) -> std::io::Result<()>,
) -> BatchResult {
    for (i, &(k, v)) in items.iter().enumerate() {
        write(k, v).map_err(|e| (i, e))?;
    }
    Ok(())
}

/// Writes `items` with one `batch` call, then each item the batch did not
/// write with `one` of its own, so that every failure names its element.
/// Returns each item's result, in order.
fn batch_then_each<O: MapOps, K: Copy, V: Copy>(
    ops: &mut O,
    items: &[(K, V)],
    batch: fn(&mut O, &[(K, V)]) -> BatchResult,
    one: fn(&mut O, K, V) -> std::io::Result<()>,
) -> Vec<std::io::Result<()>> {
    let batched = match batch(ops, items) {
        Ok(()) => items.len(),
        Err((written, _)) => written,
    };
    items
        .iter()
        .enumerate()
        .map(|(i, &(k, v))| if i < batched { Ok(()) } else { one(ops, k, v) })
        .collect()
}

pub fn service_key(f: &Frontend) -> ServiceKey {
    ServiceKey {
        addr: addr_bytes(f.addr),
        port: f.port,
        proto: f.protocol.number(),
        scope: f.scope.number(),
    }
}

fn vip_key(addr: IpAddr, scope: Scope) -> ServiceKey {
    ServiceKey::wildcard(addr_bytes(addr), scope.number())
}

/// What a failure is about: a frontend, or the VIP marker of an address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Target {
    Frontend(Frontend),
    Vip(IpAddr, Scope),
}

impl Target {
    /// Its key in `LB_SERVICES` (and `LB_UNPROGRAMMED`).
    pub fn key(&self) -> ServiceKey {
        match self {
            Target::Frontend(f) => service_key(f),
            Target::Vip(addr, scope) => vip_key(*addr, *scope),
        }
    }
}

/// A frontend (or a VIP marker) that is not programmed as desired, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unprogrammed {
    pub target: Target,
    pub service: ServiceName,
    /// The Service port's name ("" when unnamed, and for a VIP marker).
    pub port_name: String,
    /// `lb_common::unprogrammed_map::*`: the write that failed.
    pub map: u32,
    pub errno: i32,
    /// Its previous state is still programmed (a change failed); otherwise
    /// nothing of it is.
    pub kept: bool,
}

impl Unprogrammed {
    /// The `reason` label of `/metrics`: see [`reason_label`].
    pub fn reason(&self) -> String {
        reason_label(self.map, self.errno)
    }
}

/// `<map>_full` when the write failed because the map is full (`E2BIG`),
/// else `<map>_error`; `<map>` is `services`, `slots`, `backends`,
/// `maglev` (`LB_MAGLEV`) or `maglev_table` (the table itself).
/// `not_served` for a frontend no datapath serves (SCTP).
pub fn reason_label(map: u32, errno: i32) -> String {
    if map == unprogrammed_map::NOT_SERVED {
        return "not_served".to_owned();
    }
    let name = match map {
        unprogrammed_map::SERVICES => "services",
        unprogrammed_map::SLOTS => "slots",
        unprogrammed_map::BACKENDS => "backends",
        unprogrammed_map::MAGLEV => "maglev",
        unprogrammed_map::MAGLEV_TABLE => "maglev_table",
        _ => "unknown",
    };
    let how = if errno == libc::E2BIG {
        "full"
    } else {
        "error"
    };
    format!("{name}_{how}")
}

/// Why an SCTP frontend is not served, as `inspect` says it.
pub const NOT_SERVED_TEXT: &str = "SCTP is not served: Linux runs no connect or sendmsg hook \
     for SCTP sockets, and the tc path does not rewrite SCTP (its CRC32c)";

/// What failed, as the log and `inspect` say it: `LB_SLOTS is full
/// (Argument list too long (os error 7))`.
pub fn failure_text(map: u32, errno: i32) -> String {
    if map == unprogrammed_map::NOT_SERVED {
        return NOT_SERVED_TEXT.to_owned();
    }
    let name = unprogrammed_map::NAMES
        .get(map as usize)
        .copied()
        .unwrap_or("a map");
    let error = std::io::Error::from_raw_os_error(errno);
    if errno == libc::E2BIG && map != unprogrammed_map::MAGLEV_TABLE {
        format!("{name} is full ({error})")
    } else {
        format!("writing {name} failed ({error})")
    }
}

impl fmt::Display for Unprogrammed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Service {}", self.service)?;
        if !self.port_name.is_empty() {
            write!(f, " port {}", self.port_name)?;
        }
        let (what, scope) = match self.target {
            Target::Frontend(fe) => (format!("frontend {fe}"), fe.scope),
            Target::Vip(addr, scope) => (format!("VIP marker of {addr}"), scope),
        };
        let scope = match scope {
            Scope::Internal => "internal",
            Scope::External => "external",
        };
        write!(
            f,
            ", {what} ({scope}): not programmed: {}; {}",
            failure_text(self.map, self.errno),
            if self.kept {
                "its previous state stays programmed"
            } else {
                "nothing of it is programmed"
            }
        )
    }
}

/// A frontend as it is in the maps.
#[derive(Debug, Clone)]
struct Programmed {
    id: u32,
    backend_set: u32,
    /// What it was programmed from; `None` when adopted from pinned maps
    /// after a restart, until a desired state is found to match it.
    state: Option<Arc<FrontendState>>,
    value: ServiceValue,
    /// Backend ids in slot order: the active ones, then the terminating.
    slots: Vec<u32>,
    /// UDP backends that stopped serving while nothing served this
    /// frontend: their sockets are stale once something does
    /// (`stale_udp::frontend_change`).
    stopped: Vec<BackendAddr>,
    /// How many `LB_SLOTS` elements from `value.slot_base` its set holds
    /// in `slot_ranges`: `slots.len()`, or 0 for an adopted set whose range
    /// could not be held (then it is rewritten).
    slot_span: u32,
    /// `LB_MAGLEV` holds a table under its set.
    has_table: bool,
}

/// How one frontend is to be written by `apply`.
struct Plan {
    frontend: Frontend,
    state: Arc<FrontendState>,
    id: u32,
    /// The id was reserved for this plan (a new frontend).
    fresh_id: bool,
    set: u32,
    /// The set is new: its slots (and table) must be written before the value.
    fresh_set: bool,
    /// Where its slots are in `LB_SLOTS` (held in `slot_ranges` for a new set).
    slot_base: u32,
    slots: Vec<u32>,
    /// Its `maglev_size` says whether it has a table, and how long.
    value: ServiceValue,
    previous: Option<Programmed>,
    /// Adopted from pinned maps exactly as wanted: nothing to write.
    adopt_only: bool,
}

impl Plan {
    fn slot_items(&self) -> impl Iterator<Item = (u32, BackendSlot)> + '_ {
        self.slots
            .iter()
            .enumerate()
            .map(|(slot, id)| slot_item(self.set, self.slot_base, slot as u32, *id))
    }

    fn has_table(&self) -> bool {
        self.value.maglev_size > 0
    }

    /// Its Maglev table (built on demand: one is 4 bytes a position, and a
    /// sync may plan thousands).
    fn table(&self) -> Vec<u32> {
        maglev_table(&self.state, &self.slots, self.value.maglev_size)
    }

    /// The failure of one of its writes.
    fn failure(&self, map: u32, error: &std::io::Error) -> Unprogrammed {
        unprogrammed(
            &self.frontend,
            &self.state,
            map,
            error,
            self.previous.is_some(),
        )
    }
}

fn unprogrammed(
    frontend: &Frontend,
    state: &FrontendState,
    map: u32,
    error: &std::io::Error,
    kept: bool,
) -> Unprogrammed {
    Unprogrammed {
        target: Target::Frontend(*frontend),
        service: state.service.clone(),
        port_name: state.port_name.clone(),
        map,
        errno: error.raw_os_error().unwrap_or(libc::EIO),
        kept,
    }
}

/// The Maglev table of a frontend in `state` whose slots hold `slots`
/// (the active backends first): for each of `size` positions, the id of
/// its backend (see `lb_common::ServiceValue`); it covers the active
/// backends only.
fn maglev_table(state: &FrontendState, slots: &[u32], size: u16) -> Vec<u32> {
    let names: Vec<String> = state.active.iter().map(|r| r.backend.to_string()).collect();
    crate::semantics::maglev::build(&names, size)
        .into_iter()
        .map(|i| slots[i as usize])
        .collect()
}

/// `LB_SLOTS` element and value of `slot` of `set` placed at `base`. The
/// check is written here, not by the map layer as for the hash maps'
/// values: it digests the set and slot, not the array index.
fn slot_item(set: u32, base: u32, slot: u32, backend_id: u32) -> (u32, BackendSlot) {
    (
        // Wraps only for a value written by hand, whose check then fails.
        base.wrapping_add(slot),
        BackendSlot::new(set, slot, backend_id),
    )
}

/// A backend as it is in `LB_BACKENDS`: the rest of its value follows
/// from its address (`backend_value`).
#[derive(Debug, Clone, Copy)]
struct ProgrammedBackend {
    id: u32,
    flags: u8,
}

/// Backends written with one batch call at a time: what is built for a
/// write (ids, values, results) is held for one chunk, not for every
/// backend of a first sync.
const BACKEND_CHUNK: usize = 4096;

/// Maglev tables built and written at a time (see `MapOps::put_maglevs`):
/// bounds the memory of tables being written and the files they hold open.
const MAGLEV_CHUNK: usize = 256;

/// Frontends planned and written at a time (see `Reconciler::write_plans`).
/// A few in unit tests, so that their applies cross chunk boundaries.
const FRONTEND_CHUNK: usize = if cfg!(test) { 3 } else { 1024 };

/// What a failed plan left of its new set (see `Reconciler::undo`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Written {
    Nothing,
    Slots,
    /// Its slots and its table (`put_maglev` leaves nothing when it fails).
    SlotsAndTable,
}

/// A set to delete in `retire`.
#[derive(Debug, Clone)]
struct Retired {
    set: u32,
    /// `LB_SLOTS` elements `slot_base..slot_base + slots`, held in
    /// `slot_ranges` until the retire.
    slot_base: u32,
    slots: u32,
    /// A table under the set in `LB_MAGLEV`.
    table: bool,
    /// A frontend's value named it (it was replaced or removed), as
    /// opposed to what a failed write left: deleting it makes room that a
    /// frontend which did not fit may now use.
    published: bool,
    /// The backend ids its slots name while it was published: a program
    /// that read its value may still look them up, so they stay with it.
    backends: Vec<u32>,
    /// Queued before the last `schedule_retire`: the next `retire` deletes it.
    due: bool,
}

/// Counts of one sync, for logs and metrics.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SyncReport {
    pub frontends_written: usize,
    /// Adopted from the pinned maps as they were: nothing written.
    pub frontends_adopted: usize,
    pub frontends_removed: usize,
    pub backends_written: usize,
    /// The connected UDP flows the written frontends made stale, by
    /// kube-proxy's rule (see `stale_udp`); `orphaned` is left for the
    /// caller to find.
    pub stale_udp: StaleUdp,
    pub errors: Vec<String>,
}

/// Entries in use, per map.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub frontends: usize,
    pub vips: usize,
    pub backends: usize,
    /// Live and retiring.
    pub slots: usize,
    /// Live and retiring (`LB_MAGLEV` entries).
    pub maglev_tables: usize,
}

/// A backend outlier detection watches (`Reconciler::outlier_backends`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutlierBackend {
    pub addr: BackendAddr,
    /// `namespace/name` of each Service it serves through a watched
    /// frontend.
    pub services: BTreeSet<String>,
    /// Some frontend avoids it while quarantined (else dry-run only).
    pub avoided: bool,
}

/// What is programmed, and the ids in use.
#[derive(Debug)]
pub struct Reconciler {
    /// Length of every Maglev table (one of `maglev::TABLE_SIZES`).
    maglev_size: u16,
    frontends: BTreeMap<Frontend, Programmed>,
    vips: BTreeSet<(IpAddr, Scope)>,
    backends: Backends,
    used_service_ids: IdSet,
    used_backend_ids: IdSet,
    /// Backends deleted while connections counted for them were open
    /// (`MapOps::backend_busy`), with the id they keep: it stays in use
    /// until those close, so that their releases take back their own
    /// counts, and a backend that comes back meanwhile takes it again with
    /// its counts.
    draining: BTreeMap<BackendAddr, u32>,
    used_sets: BTreeSet<u32>,
    next_set: u32,
    /// Which `LB_SLOTS` elements the sets of `frontends` and `retiring` hold.
    slot_ranges: SlotRanges,
    /// The `affinity_id` of each sessionAffinity group (see
    /// `AffinityGroup`) that a programmed or planned frontend belongs to:
    /// one per group, kept while any programmed frontend carries it, so an
    /// endpoint change never resets the clients' decisions.
    affinity_ids: BTreeMap<AffinityGroup, u32>,
    /// The reverse of `affinity_ids`.
    affinity_groups: BTreeMap<u32, AffinityGroup>,
    /// How many programmed frontends carry each `affinity_id`, adopted ones
    /// (whose group is not known yet) included.
    affinity_refs: BTreeMap<u32, u32>,
    /// Affinity ids are handed out in turn, not lowest-free: a new group
    /// never inherits an id that entries of a group gone a moment ago may
    /// still carry in `LB_AFFINITY` (until the sweep deletes them).
    next_affinity: u32,
    /// Sets replaced, removed or left over, for `retire`.
    retiring: Vec<Retired>,
    /// The maps may differ from the last desired state (a write failed, or
    /// entries were adopted): `apply_touched` must look at everything.
    needs_full: bool,
    /// Backends may be left that no slot points at (adopted maps, a failed
    /// write) besides those of `retiring`'s sets: `retire` looks for them.
    stray_backends: bool,
    /// Desired frontends and VIP markers not programmed as desired.
    unprogrammed: BTreeMap<Target, Unprogrammed>,
    /// A retire deleted published sets since the last apply.
    room_made: bool,
    /// `LB_SERVICES`' size, when known (`with_service_capacity`).
    service_capacity: Option<usize>,
}

/// How many frontends use a backend, as local and as terminating.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct BackendUse {
    frontends: u32,
    local: u32,
    terminating: u32,
}

impl BackendUse {
    fn flags(&self) -> u8 {
        let mut flags = 0;
        if self.local > 0 {
            flags |= backend_flags::LOCAL;
        }
        if self.terminating > 0 {
            flags |= backend_flags::TERMINATING;
        }
        flags
    }
}

/// The `LB_BACKENDS` value of the backend at `addr`.
fn backend_value(addr: &BackendAddr, flags: u8) -> Backend {
    Backend {
        addr: addr_bytes(addr.addr),
        port: addr.port,
        proto: addr.protocol.number(),
        flags,
        // Written by the map layer (`loader::stamp`).
        key_check: 0,
    }
}

/// Every backend address the reconciler knows of: how the desired
/// frontends of the last `apply` use it (which decides its flags without
/// looking at every frontend), and its `LB_BACKENDS` entry once written.
/// One table for both, as the two hold nearly the same addresses: at
/// 10 000 x 10, 100 000 entries of 40 bytes where two tables took 60.
///
/// Hashed: a tree built in address order, as a first sync builds it,
/// leaves its nodes half empty, and this is the largest map here.
#[derive(Debug, Default)]
struct Backends {
    entries: FxHashMap<BackendAddr, BackendEntry>,
    /// How many entries are written (`id != 0`).
    programmed: usize,
}

#[derive(Debug, Default, Clone, Copy)]
struct BackendEntry {
    uses: BackendUse,
    /// Its `LB_BACKENDS` id; 0 while it is not written (ids start at 1).
    id: u32,
    flags: u8,
}

impl BackendEntry {
    fn programmed(&self) -> Option<ProgrammedBackend> {
        (self.id != 0).then_some(ProgrammedBackend {
            id: self.id,
            flags: self.flags,
        })
    }
}

impl Backends {
    /// Its `LB_BACKENDS` entry, if written.
    fn programmed(&self, addr: &BackendAddr) -> Option<ProgrammedBackend> {
        self.entries.get(addr)?.programmed()
    }

    fn programmed_iter(&self) -> impl Iterator<Item = (&BackendAddr, ProgrammedBackend)> {
        self.entries
            .iter()
            .filter_map(|(a, e)| Some((a, e.programmed()?)))
    }

    fn programmed_count(&self) -> usize {
        self.programmed
    }

    fn set_programmed(&mut self, addr: BackendAddr, b: ProgrammedBackend) {
        debug_assert_ne!(b.id, 0);
        let e = self.entries.entry(addr).or_default();
        if e.id == 0 {
            self.programmed += 1;
        }
        e.id = b.id;
        e.flags = b.flags;
    }

    fn unprogram(&mut self, addr: &BackendAddr) {
        let Some(e) = self.entries.get_mut(addr) else {
            return;
        };
        if e.id != 0 {
            self.programmed -= 1;
        }
        if e.uses.frontends == 0 {
            self.entries.remove(addr);
        } else {
            e.id = 0;
            e.flags = 0;
        }
    }

    /// How the desired frontends use it; `None` when none does.
    fn uses(&self, addr: &BackendAddr) -> Option<BackendUse> {
        self.entries
            .get(addr)
            .map(|e| e.uses)
            .filter(|u| u.frontends > 0)
    }

    fn used_iter(&self) -> impl Iterator<Item = (&BackendAddr, BackendUse)> {
        self.entries
            .iter()
            .filter(|(_, e)| e.uses.frontends > 0)
            .map(|(a, e)| (a, e.uses))
    }

    /// Forgets every use, for a full count.
    fn clear_uses(&mut self) {
        self.entries.retain(|_, e| {
            e.uses = BackendUse::default();
            e.id != 0
        });
    }

    /// Adds (`add`) or takes away the backend uses of one frontend, noting
    /// the backends whose use changed in `affected` (a full count needs no
    /// note: every backend used is affected).
    fn count_uses(
        &mut self,
        state: &FrontendState,
        add: bool,
        mut affected: Option<&mut BTreeSet<BackendAddr>>,
    ) {
        let lists = [(&state.active, false), (&state.terminating, true)];
        for (list, terminating) in lists {
            for r in list {
                if let Some(affected) = affected.as_deref_mut() {
                    affected.insert(r.backend);
                }
                let entry = self.entries.entry(r.backend).or_default();
                let uses = &mut entry.uses;
                let step = |n: &mut u32, on: bool| {
                    if on {
                        *n = if add { *n + 1 } else { n.saturating_sub(1) };
                    }
                };
                step(&mut uses.frontends, true);
                step(&mut uses.local, r.local);
                step(&mut uses.terminating, terminating);
                if uses.frontends == 0 {
                    *uses = BackendUse::default();
                    if entry.id == 0 {
                        self.entries.remove(&r.backend);
                    }
                }
            }
        }
    }
}

/// Ids in use, handing out the lowest free one. Ids start at 1 so that 0
/// never names a live object in a dump.
///
/// A bit per id below [`DENSE_IDS`]: the ids handed out are dense, and
/// 100 000 backends take 12 KiB here where a tree of them took ~1.3 MiB.
/// An id above it can only come from maps written by something else
/// (adopted), and is kept aside.
#[derive(Debug, Default)]
struct IdSet {
    words: Vec<u64>,
    sparse: BTreeSet<u32>,
    /// No id below this one is free: the search starts here.
    floor: u32,
}

const DENSE_IDS: u32 = 1 << 24;

impl IdSet {
    fn insert(&mut self, id: u32) {
        if id >= DENSE_IDS {
            self.sparse.insert(id);
            return;
        }
        let word = (id / 64) as usize;
        if word >= self.words.len() {
            self.words.resize(word + 1, 0);
        }
        self.words[word] |= 1 << (id % 64);
    }

    fn contains(&self, id: u32) -> bool {
        if id >= DENSE_IDS {
            return self.sparse.contains(&id);
        }
        self.words
            .get((id / 64) as usize)
            .is_some_and(|w| w & (1 << (id % 64)) != 0)
    }

    fn remove(&mut self, id: &u32) {
        let id = *id;
        if id >= DENSE_IDS {
            self.sparse.remove(&id);
        } else if let Some(w) = self.words.get_mut((id / 64) as usize) {
            *w &= !(1 << (id % 64));
        }
        self.floor = self.floor.min(id);
    }

    fn lowest_free(&mut self) -> u32 {
        let mut candidate = self.floor.max(1);
        while let Some(&word) = self.words.get((candidate / 64) as usize) {
            let free = !word & (u64::MAX << (candidate % 64));
            if free != 0 {
                candidate = candidate / 64 * 64 + free.trailing_zeros();
                break;
            }
            candidate = (candidate / 64 + 1) * 64;
        }
        while self.sparse.contains(&candidate) {
            candidate += 1;
        }
        self.floor = candidate;
        candidate
    }
}

fn service_value(
    frontend: &Frontend,
    id: u32,
    (backend_set, slot_base): (u32, u32),
    state: &FrontendState,
    maglev_size: u16,
    affinity_id: u32,
) -> ServiceValue {
    let mut flags = 0;
    if state.affinity_timeout.is_some() {
        flags |= service_flags::AFFINITY;
    }
    if maglev_size > 0 {
        flags |= service_flags::MAGLEV;
    }
    flags |= lb_common::algorithm::flags(state.algorithm.code());
    if state.reject {
        flags |= service_flags::REJECT;
    }
    if state.kind == FrontendKind::NodePort && frontend.scope == Scope::External {
        flags |= service_flags::NODE_ADDRESS;
    }
    if state.source_ranges {
        flags |= service_flags::SOURCE_RANGES;
    }
    if state.outlier.detects() {
        flags |= service_flags::OUTLIER_DETECT;
    }
    if state.outlier.avoids() {
        flags |= service_flags::OUTLIER_AVOID;
    }
    ServiceValue {
        id,
        backend_set,
        active: state.active.len() as u16,
        terminating: state.terminating.len() as u16,
        flags,
        maglev_size,
        affinity_timeout: state.affinity_timeout.unwrap_or(0),
        affinity_id,
        // Written by the map layer (`loader::stamp`).
        key_check: 0,
        slot_base,
    }
}

/// The entries of `map` whose frontend is on `addr` in `scope`.
fn frontends_at<V>(
    map: &BTreeMap<Frontend, V>,
    addr: IpAddr,
    scope: Scope,
) -> impl Iterator<Item = (&Frontend, &V)> {
    let at = |port, protocol, scope| Frontend {
        addr,
        port,
        protocol,
        scope,
    };
    map.range(at(0, Protocol::Tcp, Scope::Internal)..=at(u16::MAX, Protocol::Udp, Scope::External))
        .filter(move |(f, _)| f.scope == scope)
}

impl Reconciler {
    /// `max_slots`: the backend slots that may be in use at once
    /// (`LB_SLOTS` is twice as long, see `slot_ranges`).
    pub fn new(maglev_size: u16, max_slots: u32) -> Self {
        Self {
            maglev_size,
            slot_ranges: SlotRanges::for_max_slots(max_slots),
            frontends: BTreeMap::new(),
            vips: BTreeSet::new(),
            backends: Backends::default(),
            used_service_ids: IdSet::default(),
            used_backend_ids: IdSet::default(),
            draining: BTreeMap::new(),
            used_sets: BTreeSet::new(),
            next_set: 1,
            affinity_ids: BTreeMap::new(),
            affinity_groups: BTreeMap::new(),
            affinity_refs: BTreeMap::new(),
            next_affinity: 1,
            retiring: Vec::new(),
            needs_full: true,
            stray_backends: false,
            unprogrammed: BTreeMap::new(),
            room_made: false,
            service_capacity: None,
        }
    }

    /// `LB_SERVICES` holds `entries`: a new frontend is programmed only
    /// while room is left for every desired VIP's marker, so that a map
    /// filled by frontends still has a marker to refuse each Service
    /// address that did not fit (fail closed) rather than let its connects
    /// leave the node unrewritten. A marker is one entry per address, a
    /// frontend one per port: the reserve is at most half the map. When
    /// the map cannot hold a marker for every address, nothing fails
    /// closed whatever is kept, and frontends come first again (each one
    /// that fits is served; the markers that do not fit are reported).
    pub fn with_service_capacity(mut self, entries: u32) -> Self {
        self.service_capacity = Some(entries as usize);
        self
    }

    /// Rebuilds what is programmed from the pinned maps of an earlier run,
    /// so that the first `apply` writes only what differs. Entries that do
    /// not hold together (a slot or backend missing, a range of `LB_SLOTS`
    /// another frontend's set overlaps) are adopted with no slots, and
    /// those whose Maglev table is missing or where none belongs as they
    /// are: either way the first apply rewrites them. Tables no frontend
    /// names are retired. `slots`: the elements of `LB_SLOTS` that are not
    /// zeros, by index; `maglev_sets`: the keys of `LB_MAGLEV` (an adopted
    /// table's content is checked when a desired state is first compared
    /// with it).
    pub fn adopt(
        maglev_size: u16,
        max_slots: u32,
        services: impl IntoIterator<Item = (ServiceKey, ServiceValue)>,
        slots: impl IntoIterator<Item = (u32, BackendSlot)>,
        backends: impl IntoIterator<Item = (BackendId, Backend)>,
        maglev_sets: impl IntoIterator<Item = u32>,
    ) -> Self {
        let mut r = Self::new(maglev_size, max_slots);
        // Backends of an earlier run that nothing points at any more.
        r.stray_backends = true;
        let slots: HashMap<u32, BackendSlot> = slots.into_iter().collect();
        let tables: BTreeSet<u32> = maglev_sets.into_iter().collect();
        for (id, value) in backends {
            let Some(protocol) = Protocol::from_number(value.proto) else {
                continue;
            };
            let addr = BackendAddr {
                addr: crate::base::addr::ip_from_bytes(&value.addr),
                port: value.port,
                protocol,
            };
            r.used_backend_ids.insert(id.id);
            r.backends.set_programmed(
                addr,
                ProgrammedBackend {
                    id: id.id,
                    flags: value.flags,
                },
            );
        }
        for (key, value) in services {
            let addr = crate::base::addr::ip_from_bytes(&key.addr);
            let Some(scope) = Scope::from_number(key.scope) else {
                continue;
            };
            if value.flags & service_flags::WILDCARD != 0 {
                r.vips.insert((addr, scope));
                continue;
            }
            let Some(protocol) = Protocol::from_number(key.proto) else {
                continue;
            };
            let len = value.active as u32 + value.terminating as u32;
            let found: Option<Vec<u32>> = (0..len)
                .map(|slot| {
                    slots
                        .get(&value.slot_base.wrapping_add(slot))
                        .and_then(|s| s.backend_of(value.backend_set, slot))
                        .filter(|id| r.used_backend_ids.contains(*id))
                })
                .collect();
            // Held only if whole and not another set's.
            let held = found.filter(|_| r.slot_ranges.reserve(value.slot_base, len));
            let slot_span = if held.is_some() { len } else { 0 };
            // A table missing where the value has one, or one where it has
            // none, is never reused (see `plan_frontend`): the frontend is
            // rewritten.
            let has_table = tables.contains(&value.backend_set);
            let frontend = Frontend {
                addr,
                port: key.port,
                protocol,
                scope,
            };
            r.used_service_ids.insert(value.id);
            r.used_sets.insert(value.backend_set);
            r.count_affinity(value.affinity_id, true);
            r.next_affinity = r
                .next_affinity
                .max(value.affinity_id.wrapping_add(1).max(1));
            r.frontends.insert(
                frontend,
                Programmed {
                    id: value.id,
                    backend_set: value.backend_set,
                    state: None,
                    value,
                    // Empty never equals a desired set, so a broken entry is rewritten.
                    slots: held.unwrap_or_default(),
                    stopped: Vec::new(),
                    slot_span,
                    has_table,
                },
            );
        }
        // Slots no adopted frontend holds: left by a crash between write
        // and retire, or of a frontend that did not hold together. Held
        // until the first retire clears them, so that no new set is
        // written there before.
        let mut stray: Vec<u32> = slots
            .keys()
            .copied()
            .filter(|i| r.slot_ranges.reserve(*i, 1))
            .collect();
        stray.sort_unstable();
        for run in stray.chunk_by(|a, b| a + 1 == *b) {
            r.retiring.push(Retired {
                // No set: set ids start at 1.
                set: 0,
                slot_base: run[0],
                slots: run.len() as u32,
                table: false,
                published: false,
                backends: Vec::new(),
                due: false,
            });
        }
        // Tables nothing points at: left by a crash between write and
        // retire.
        let orphans: Vec<u32> = tables
            .iter()
            .filter(|set| !r.used_sets.contains(set))
            .copied()
            .collect();
        r.retiring.extend(orphans.into_iter().map(|set| Retired {
            set,
            slot_base: 0,
            slots: 0,
            table: true,
            published: false,
            backends: Vec::new(),
            due: false,
        }));
        r.next_set = r
            .used_sets
            .iter()
            .chain(r.retiring.iter().map(|x| &x.set))
            .max()
            .map_or(1, |s| s.wrapping_add(1).max(1));
        r
    }

    /// Entries in use, per map.
    pub fn usage(&self) -> Usage {
        let tables = self.frontends.values().filter(|p| p.has_table).count()
            + self.retiring.iter().filter(|r| r.table).count();
        Usage {
            frontends: self.frontends.len(),
            vips: self.vips.len(),
            backends: self.backends.programmed_count(),
            slots: self.slot_ranges.used() as usize,
            maglev_tables: tables,
        }
    }

    pub fn frontend_count(&self) -> usize {
        self.frontends.len()
    }

    pub fn backend_count(&self) -> usize {
        self.backends.programmed_count()
    }

    /// Desired frontends and VIP markers that the last apply could not
    /// program as desired.
    pub fn unprogrammed(&self) -> impl Iterator<Item = &Unprogrammed> {
        self.unprogrammed.values()
    }

    /// Whether a retire freed entries of published sets while frontends
    /// wait for room: a sync now may program them. Reading it resets it.
    pub fn room_made(&mut self) -> bool {
        std::mem::take(&mut self.room_made) && !self.unprogrammed.is_empty()
    }

    fn alloc_set(&mut self) -> u32 {
        loop {
            let id = self.next_set;
            self.next_set = self.next_set.wrapping_add(1).max(1);
            if !self.used_sets.contains(&id) {
                self.used_sets.insert(id);
                return id;
            }
        }
    }

    /// Brings the maps to `desired`, writing only what differs. Failures are
    /// reported per object and leave that object as it was; the rest goes on.
    pub fn apply(&mut self, desired: &DesiredState, ops: &mut impl MapOps) -> SyncReport {
        self.apply_scoped(desired, None, ops)
    }

    /// Like [`apply`](Self::apply) when only the frontends in `touched` can
    /// differ from the desired state of the last `apply`: only those are
    /// compared, so a change to one Service costs as much as that Service.
    /// Falls back to the full comparison while the maps may differ from
    /// that state (a failed write, adopted entries).
    pub fn apply_touched(
        &mut self,
        desired: &DesiredState,
        touched: &BTreeSet<Frontend>,
        ops: &mut impl MapOps,
    ) -> SyncReport {
        if self.needs_full {
            return self.apply(desired, ops);
        }
        self.apply_scoped(desired, Some(touched), ops)
    }

    fn apply_scoped(
        &mut self,
        desired: &DesiredState,
        touched: Option<&BTreeSet<Frontend>>,
        ops: &mut impl MapOps,
    ) -> SyncReport {
        let mut report = SyncReport::default();
        // Failures of what is no longer wanted are moot.
        self.unprogrammed.retain(|target, _| match target {
            Target::Frontend(f) => desired.frontends.contains_key(f),
            Target::Vip(addr, scope) => desired.vips.contains(&(*addr, *scope)),
        });

        // The flags each backend should carry, merged over every frontend
        // that uses it; with `touched`, only those whose use changed.
        let wanted: Vec<(BackendAddr, u8)> = match touched {
            None => {
                self.backends.clear_uses();
                for state in desired.frontends.values() {
                    self.backends.count_uses(state, true, None);
                }
                // In address order, as the touched path gives them (new
                // ids are handed out in this order).
                let mut all: Vec<(BackendAddr, u8)> = self
                    .backends
                    .used_iter()
                    .map(|(a, u)| (*a, u.flags()))
                    .collect();
                all.sort_unstable_by_key(|(a, _)| *a);
                all
            }
            Some(touched) => {
                let mut affected = BTreeSet::new();
                for f in touched {
                    // Without a failed write since, what is programmed is
                    // what the last desired state held.
                    if let Some(old) = self.frontends.get(f).and_then(|p| p.state.as_ref()) {
                        self.backends.count_uses(old, false, Some(&mut affected));
                    }
                    if let Some(new) = desired.frontends.get(f) {
                        self.backends.count_uses(new, true, Some(&mut affected));
                    }
                }
                affected
                    .iter()
                    .filter_map(|a| self.backends.uses(a).map(|u| (*a, u.flags())))
                    .collect()
            }
        };

        // 1. Frontends no longer wanted go first: their entries make room
        // for new ones within this apply (their sets retire later).
        let stale: Vec<Frontend> = match touched {
            None => self
                .frontends
                .keys()
                .filter(|f| !desired.frontends.contains_key(f))
                .copied()
                .collect(),
            Some(touched) => touched
                .iter()
                .filter(|f| self.frontends.contains_key(f) && !desired.frontends.contains_key(f))
                .copied()
                .collect(),
        };
        for frontend in stale {
            match ops.del_service(service_key(&frontend)) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    report.errors.push(
                        MapWriteError {
                            what: format!("removing frontend {frontend}"),
                            source: e,
                        }
                        .to_string(),
                    );
                }
                _ => {
                    // A frontend that goes makes no UDP flow stale:
                    // kube-proxy leaves a deleted Service's flows alone.
                    let p = self.frontends.remove(&frontend).expect("listed above");
                    self.used_service_ids.remove(&p.id);
                    self.count_affinity(p.value.affinity_id, false);
                    self.retire_set(&p);
                    report.frontends_removed += 1;
                }
            }
        }

        // 2. Backends, so that no slot ever points at a missing one.
        // New ids are reserved now and given back if their write fails.
        // Why each backend that could not be written failed, for the
        // frontends that need it.
        let mut backend_errors: HashMap<BackendAddr, i32> = HashMap::new();
        let mut wanted = wanted.into_iter().peekable();
        // Ids taken back from `draining`, whose counts stay.
        let mut kept_counts: BTreeSet<u32> = BTreeSet::new();
        let mut pending: Vec<(BackendAddr, u32, u8, bool)> =
            Vec::with_capacity(BACKEND_CHUNK.min(wanted.len()));
        while wanted.peek().is_some() {
            pending.clear();
            for (addr, flags) in wanted.by_ref() {
                match self.backends.programmed(&addr) {
                    Some(b) if b.flags == flags => continue,
                    Some(b) => pending.push((addr, b.id, flags, false)),
                    None => match self.draining.remove(&addr) {
                        // Back while its connections are open: its id, and
                        // their counts, are still its own.
                        Some(id) => {
                            kept_counts.insert(id);
                            pending.push((addr, id, flags, true));
                        }
                        None => {
                            let id = self.used_backend_ids.lowest_free();
                            self.used_backend_ids.insert(id);
                            pending.push((addr, id, flags, true));
                        }
                    },
                }
                if pending.len() == BACKEND_CHUNK {
                    break;
                }
            }
            for (_, id, _, fresh) in &pending {
                if *fresh && !kept_counts.contains(id) {
                    // Best effort: a count left over is corrected by the
                    // connections' own releases, never read below 0.
                    let _ = ops.reset_backend_state(BackendId { id: *id });
                }
            }
            let items: Vec<(BackendId, Backend)> = pending
                .iter()
                .map(|(addr, id, flags, _)| (BackendId { id: *id }, backend_value(addr, *flags)))
                .collect();
            let written = batch_then_each(ops, &items, MapOps::put_backends, MapOps::put_backend);
            for ((addr, id, flags, fresh), written) in pending.drain(..).zip(written) {
                match written {
                    Ok(()) => {
                        self.backends
                            .set_programmed(addr, ProgrammedBackend { id, flags });
                        report.backends_written += 1;
                    }
                    Err(source) => {
                        if kept_counts.contains(&id) {
                            self.draining.insert(addr, id);
                        } else if fresh {
                            self.used_backend_ids.remove(&id);
                        }
                        backend_errors.insert(addr, source.raw_os_error().unwrap_or(libc::EIO));
                        report.errors.push(
                            MapWriteError {
                                what: format!("backend {addr}"),
                                source,
                            }
                            .to_string(),
                        );
                    }
                }
            }
        }

        // 3. Frontends whose backends or options changed: first every slot
        // of every new backend set, then every new Maglev table, then the
        // ServiceValues that publish them, so that no ServiceValue ever
        // names a set or table not fully written.
        let candidates: Box<dyn Iterator<Item = (&Frontend, &Arc<FrontendState>)>> = match touched {
            None => Box::new(desired.frontends.iter()),
            Some(touched) => Box::new(
                touched
                    .iter()
                    .filter_map(|f| desired.frontends.get_key_value(f)),
            ),
        };
        let mut candidates = candidates.peekable();
        let mut plans = Vec::with_capacity(FRONTEND_CHUNK.min(desired.frontends.len()));
        // `LB_SERVICES` entries a new frontend may take: what is left once
        // every desired VIP has its marker (see `with_service_capacity`).
        let mut room_for_new = self
            .service_capacity
            .filter(|cap| desired.vips.len() <= *cap)
            .map(|cap| cap.saturating_sub(self.frontends.len() + desired.vips.len()));
        while candidates.peek().is_some() {
            for (frontend, state) in candidates.by_ref() {
                if let Some(p) = self.frontends.get(frontend) {
                    if p.state.as_ref() == Some(state) {
                        // Programmed as desired: a change that failed was
                        // taken back.
                        if !self.unprogrammed.is_empty() {
                            self.unprogrammed.remove(&Target::Frontend(*frontend));
                        }
                        continue;
                    }
                }
                let new = !self.frontends.contains_key(frontend);
                if new && room_for_new == Some(0) {
                    let full = std::io::Error::from_raw_os_error(libc::E2BIG);
                    let failure =
                        unprogrammed(frontend, state, unprogrammed_map::SERVICES, &full, false);
                    self.fail(failure, &mut report);
                    continue;
                }
                match self.plan_frontend(frontend, state, &backend_errors, ops) {
                    Ok(plan) => {
                        if new {
                            room_for_new = room_for_new.map(|n| n - 1);
                        }
                        plans.push(plan);
                    }
                    Err(failure) => self.fail(failure, &mut report),
                }
                if plans.len() == FRONTEND_CHUNK {
                    break;
                }
            }
            self.write_plans(&mut plans, ops, &mut report);
        }

        // 4. VIP markers, before stale ones go, so a VIP never flickers to
        // "unknown" while its ports change. Every Service address gets its
        // marker, also one none of whose frontends could be programmed:
        // the marker refuses its connects (`lb::lookup_frontend`'s
        // `PortNotServed`), where without it they would leave the node
        // unrewritten, to the Service address (fail closed). Room for the
        // markers is kept apart in step 3.
        let new_vips: Vec<(IpAddr, Scope)> = desired.vips.difference(&self.vips).copied().collect();
        let marker = ServiceValue {
            id: 0,
            backend_set: 0,
            active: 0,
            terminating: 0,
            flags: service_flags::WILDCARD,
            maglev_size: 0,
            affinity_timeout: 0,
            affinity_id: 0,
            key_check: 0,
            slot_base: 0,
        };
        let vip_items: Vec<(ServiceKey, ServiceValue)> = new_vips
            .iter()
            .map(|(addr, scope)| (vip_key(*addr, *scope), marker))
            .collect();
        let written = batch_then_each(ops, &vip_items, MapOps::put_services, MapOps::put_service);
        for ((addr, scope), written) in new_vips.into_iter().zip(written) {
            match written {
                Ok(()) => {
                    self.vips.insert((addr, scope));
                    self.unprogrammed.remove(&Target::Vip(addr, scope));
                }
                Err(source) => {
                    let service = frontends_at(&desired.frontends, addr, scope)
                        .next()
                        .map(|(_, s)| s.service.clone())
                        .unwrap_or_else(|| ServiceName {
                            namespace: "".into(),
                            name: "".into(),
                        });
                    let failure = Unprogrammed {
                        target: Target::Vip(addr, scope),
                        service,
                        port_name: String::new(),
                        map: unprogrammed_map::SERVICES,
                        errno: source.raw_os_error().unwrap_or(libc::EIO),
                        kept: false,
                    };
                    self.fail(failure, &mut report);
                }
            }
        }

        // 5. VIP markers no longer wanted.
        let stale_vips: Vec<(IpAddr, Scope)> =
            self.vips.difference(&desired.vips).copied().collect();
        for (addr, scope) in stale_vips {
            // A missing entry is already what we want.
            let _ = ops.del_service(vip_key(addr, scope));
            self.vips.remove(&(addr, scope));
        }
        self.release_affinity_groups();
        self.needs_full = !report.errors.is_empty() || !self.unprogrammed.is_empty();
        self.stray_backends |= self.needs_full;
        report
    }

    /// Writes a chunk of plans (emptying `plans`): every slot of their new
    /// backend sets, then their new Maglev tables, then the ServiceValues
    /// that publish them, so that no ServiceValue ever names a set or table
    /// not fully written. In chunks: the plans, their slots and values of a
    /// first sync at 10 000 frontends were its largest allocations.
    fn write_plans(
        &mut self,
        plans: &mut Vec<Plan>,
        ops: &mut impl MapOps,
        report: &mut SyncReport,
    ) {
        let slot_items: Vec<(u32, BackendSlot)> = plans
            .iter()
            .filter(|p| p.fresh_set)
            .flat_map(|p| p.slot_items())
            .collect();
        let batched = match ops.put_slots(&slot_items) {
            Ok(()) => slot_items.len(),
            Err((written, _)) => written,
        };
        let mut offset = 0;
        let mut with_slots = Vec::with_capacity(plans.len());
        for plan in plans.drain(..) {
            if plan.fresh_set {
                let end = offset + plan.slots.len();
                offset = end;
                if end > batched {
                    // Not all written by the batch: slot by slot.
                    if let Err(e) = Self::write_slots(&plan, ops) {
                        self.undo(&plan, Written::Nothing);
                        self.fail(plan.failure(unprogrammed_map::SLOTS, &e), report);
                        continue;
                    }
                }
            }
            with_slots.push(plan);
        }
        // In place: a second vector of every plan would be this sync's
        // largest allocation at 10 000 frontends.
        let tabled: Vec<Plan> = with_slots
            .extract_if(.., |p| p.fresh_set && p.has_table())
            .collect();
        let mut ready = with_slots;
        // Built and written a chunk at a time: a table is 4 bytes a
        // position here too, and each is an open file until it is in.
        let mut tabled = tabled.into_iter().peekable();
        while tabled.peek().is_some() {
            let chunk: Vec<Plan> = tabled.by_ref().take(MAGLEV_CHUNK).collect();
            let tables: Vec<(u32, Vec<u32>)> = chunk.iter().map(|p| (p.set, p.table())).collect();
            let written = ops.put_maglevs(&tables);
            drop(tables);
            for (plan, written) in chunk.into_iter().zip(written) {
                match written {
                    Ok(()) => ready.push(plan),
                    Err(e) => {
                        let (map, e) = match e {
                            MaglevWriteError::Table(e) => (unprogrammed_map::MAGLEV_TABLE, e),
                            MaglevWriteError::Insert(e) => (unprogrammed_map::MAGLEV, e),
                        };
                        self.undo(&plan, Written::Slots);
                        self.fail(plan.failure(map, &e), report);
                    }
                }
            }
        }
        let service_items: Vec<(ServiceKey, ServiceValue)> = ready
            .iter()
            .filter(|p| !p.adopt_only)
            .map(|p| (service_key(&p.frontend), p.value))
            .collect();
        let mut written = batch_then_each(
            ops,
            &service_items,
            MapOps::put_services,
            MapOps::put_service,
        )
        .into_iter();
        for plan in ready {
            if plan.adopt_only {
                let mut adopted = plan.previous.clone().expect("adoption reuses an entry");
                adopted.stopped =
                    self.note_udp_change(&plan.frontend, Some(&adopted), &plan.state, report);
                adopted.state = Some(plan.state.clone());
                self.frontends.insert(plan.frontend, adopted);
                report.frontends_adopted += 1;
                continue;
            }
            let written = written.next().expect("one result per written plan");
            if let Err(e) = written {
                let left = if plan.has_table() {
                    Written::SlotsAndTable
                } else {
                    Written::Slots
                };
                self.undo(&plan, left);
                self.fail(plan.failure(unprogrammed_map::SERVICES, &e), report);
                continue;
            }
            self.commit(plan, report);
        }
    }

    /// Records a failure: in the report, and as unprogrammed until an apply
    /// programs its frontend.
    fn fail(&mut self, failure: Unprogrammed, report: &mut SyncReport) {
        report.errors.push(failure.to_string());
        self.unprogrammed.insert(failure.target, failure);
    }

    /// One more (`add`) or one fewer programmed frontend carries `id`.
    fn count_affinity(&mut self, id: u32, add: bool) {
        if id == 0 {
            return;
        }
        let n = self.affinity_refs.entry(id).or_default();
        if add {
            *n += 1;
        } else {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.affinity_refs.remove(&id);
            }
        }
    }

    /// The `affinity_id` of `group`: the one it has; else the one the
    /// frontend carried before (`previous`, adopted after a restart) unless
    /// another group has it; else a new one.
    fn affinity_id_for(&mut self, group: AffinityGroup, previous: u32) -> u32 {
        if let Some(&id) = self.affinity_ids.get(&group) {
            return id;
        }
        let id = if previous != 0 && !self.affinity_groups.contains_key(&previous) {
            previous
        } else {
            loop {
                let id = self.next_affinity;
                self.next_affinity = id.wrapping_add(1).max(1);
                if !self.affinity_groups.contains_key(&id) && !self.affinity_refs.contains_key(&id)
                {
                    break id;
                }
            }
        };
        self.affinity_ids.insert(group.clone(), id);
        self.affinity_groups.insert(id, group);
        id
    }

    /// Forgets the groups no programmed frontend carries any more.
    fn release_affinity_groups(&mut self) {
        let gone: Vec<u32> = self
            .affinity_groups
            .keys()
            .filter(|id| !self.affinity_refs.contains_key(id))
            .copied()
            .collect();
        for id in gone {
            if let Some(group) = self.affinity_groups.remove(&id) {
                self.affinity_ids.remove(&group);
            }
        }
    }

    /// Records in `report` the UDP flows that programming `state` for
    /// `frontend`, which had been programmed as `previous`, makes stale;
    /// returns what the frontend is to remember (`Programmed::stopped`).
    fn note_udp_change(
        &self,
        frontend: &Frontend,
        previous: Option<&Programmed>,
        state: &FrontendState,
        report: &mut SyncReport,
    ) -> Vec<BackendAddr> {
        if frontend.protocol != Protocol::Udp {
            return Vec::new();
        }
        let before: Option<Vec<BackendAddr>> = previous.map(|p| match &p.state {
            Some(s) => s.serving.clone(),
            // Adopted from an earlier run: what it served is not known,
            // what it selected is (a part of it).
            None => self.selected_backends(p),
        });
        let stopped = previous.map_or(&[][..], |p| &p.stopped[..]);
        let change = stale_udp::frontend_change(before.as_deref(), stopped, &state.serving);
        report.stale_udp.add(*frontend, &change);
        change.stopped
    }

    /// The backends an adopted frontend selects from, as its slots say.
    fn selected_backends(&self, p: &Programmed) -> Vec<BackendAddr> {
        let selectable =
            (p.value.active as usize + p.value.terminating as usize).min(p.slots.len());
        let ids: BTreeSet<u32> = p.slots[..selectable].iter().copied().collect();
        let mut found: Vec<BackendAddr> = self
            .backends
            .programmed_iter()
            .filter(|(_, b)| ids.contains(&b.id))
            .map(|(addr, _)| *addr)
            .collect();
        found.sort();
        found
    }

    /// The service id `frontend` is programmed with.
    pub fn service_id(&self, frontend: &Frontend) -> Option<u32> {
        self.frontends.get(frontend).map(|p| p.id)
    }

    /// Works out how `frontend` is to be programmed, reserving a service id
    /// and a backend set when it needs new ones; nothing is written (an
    /// adopted Maglev table is read, to check it). `backend_errors`: why
    /// the backends that could not be written failed.
    fn plan_frontend(
        &mut self,
        frontend: &Frontend,
        state: &Arc<FrontendState>,
        backend_errors: &HashMap<BackendAddr, i32>,
        ops: &mut impl MapOps,
    ) -> Result<Plan, Unprogrammed> {
        let previous = self.frontends.get(frontend).cloned();
        let mut slots = Vec::with_capacity(state.active.len() + state.terminating.len());
        for r in state.active.iter().chain(&state.terminating) {
            match self.backends.programmed(&r.backend) {
                Some(b) => slots.push(b.id),
                None => {
                    let errno = backend_errors.get(&r.backend).copied().unwrap_or(libc::EIO);
                    return Err(unprogrammed(
                        frontend,
                        state,
                        unprogrammed_map::BACKENDS,
                        &std::io::Error::from_raw_os_error(errno),
                        previous.is_some(),
                    ));
                }
            }
        }
        // A Maglev frontend's table covers its active backends (see
        // `lb_common::ServiceValue`).
        let maglev_size = if state.algorithm.uses_table() && !state.active.is_empty() {
            self.maglev_size
        } else {
            0
        };
        // Options alone changed: the set (and table) can stay. A table is
        // a function of the active backends and its size, so one this
        // process wrote is known; an adopted one is read and compared.
        let reuse = previous.as_ref().filter(|p| {
            p.slots == slots
                && p.value.maglev_size == maglev_size
                && p.has_table == (maglev_size > 0)
                && (maglev_size == 0
                    || p.value.active as usize == state.active.len()
                        && (p.state.is_some()
                            || ops
                                .get_maglev(p.backend_set, maglev_size)
                                .is_ok_and(|table| {
                                    table == maglev_table(state, &slots, maglev_size)
                                })))
        });
        // A new set needs a range of `LB_SLOTS` no published value names.
        let slot_base = match reuse {
            Some(p) => p.value.slot_base,
            None => self.slot_ranges.alloc(slots.len() as u32).ok_or_else(|| {
                unprogrammed(
                    frontend,
                    state,
                    unprogrammed_map::SLOTS,
                    &std::io::Error::from_raw_os_error(libc::E2BIG),
                    previous.is_some(),
                )
            })?,
        };
        let (id, fresh_id, set, fresh_set) = match (reuse, &previous) {
            (Some(p), _) => (p.id, false, p.backend_set, false),
            (None, Some(prev)) => (prev.id, false, self.alloc_set(), true),
            (None, None) => {
                let id = self.used_service_ids.lowest_free();
                self.used_service_ids.insert(id);
                (id, true, self.alloc_set(), true)
            }
        };
        let affinity_id = match state.affinity_group(frontend) {
            Some(group) => {
                let before = previous.as_ref().map_or(0, |p| p.value.affinity_id);
                self.affinity_id_for(group, before)
            }
            None => 0,
        };
        let value = service_value(
            frontend,
            id,
            (set, slot_base),
            state,
            maglev_size,
            affinity_id,
        );
        let adopt_only = reuse.is_some_and(|p| p.state.is_none() && p.value == value);
        Ok(Plan {
            frontend: *frontend,
            state: state.clone(),
            id,
            fresh_id,
            set,
            fresh_set,
            slot_base,
            slots,
            value,
            previous,
            adopt_only,
        })
    }

    /// The per-element path for one plan's slots, undoing them on failure.
    fn write_slots(plan: &Plan, ops: &mut impl MapOps) -> std::io::Result<()> {
        let items: Vec<(u32, BackendSlot)> = plan.slot_items().collect();
        for (slot, (index, value)) in items.iter().enumerate() {
            if let Err(e) = ops.put_slot(*index, *value) {
                for (undo, _) in &items[..slot] {
                    let _ = ops.del_slot(*undo);
                }
                return Err(e);
            }
        }
        Ok(())
    }

    /// Gives back what `plan_frontend` reserved for a plan whose value was
    /// not written; what was written for its new set is retired, since
    /// nothing names it.
    fn undo(&mut self, plan: &Plan, written: Written) {
        if plan.fresh_set {
            match written {
                Written::Nothing => {
                    self.used_sets.remove(&plan.set);
                    self.slot_ranges
                        .release(plan.slot_base, plan.slots.len() as u32);
                }
                Written::Slots | Written::SlotsAndTable => self.retiring.push(Retired {
                    set: plan.set,
                    slot_base: plan.slot_base,
                    slots: plan.slots.len() as u32,
                    table: written == Written::SlotsAndTable,
                    published: false,
                    backends: Vec::new(),
                    due: false,
                }),
            }
        }
        if plan.fresh_id {
            self.used_service_ids.remove(&plan.id);
        }
    }

    /// Queues the set of a frontend that was replaced or removed for retire.
    fn retire_set(&mut self, p: &Programmed) {
        self.retiring.push(Retired {
            set: p.backend_set,
            slot_base: p.value.slot_base,
            slots: p.slot_span,
            table: p.has_table,
            published: true,
            backends: p.slots.clone(),
            due: false,
        });
    }

    /// Records a plan whose ServiceValue was written.
    fn commit(&mut self, plan: Plan, report: &mut SyncReport) {
        if let Some(p) = &plan.previous {
            if p.backend_set != plan.set {
                self.retire_set(p);
            }
        }
        self.used_service_ids.insert(plan.id);
        if let Some(p) = &plan.previous {
            self.count_affinity(p.value.affinity_id, false);
        }
        self.count_affinity(plan.value.affinity_id, true);
        let stopped =
            self.note_udp_change(&plan.frontend, plan.previous.as_ref(), &plan.state, report);
        self.unprogrammed.remove(&Target::Frontend(plan.frontend));
        let has_table = plan.has_table();
        let slot_span = match &plan.previous {
            // The set stayed: as many keys as it had.
            Some(p) if p.backend_set == plan.set => p.slot_span,
            _ => plan.slots.len() as u32,
        };
        self.frontends.insert(
            plan.frontend,
            Programmed {
                id: plan.id,
                backend_set: plan.set,
                state: Some(plan.state),
                value: plan.value,
                slots: plan.slots,
                stopped,
                slot_span,
                has_table,
            },
        );
        report.frontends_written += 1;
    }

    /// The backends outlier detection watches (those of programmed
    /// frontends with `service_flags::OUTLIER_DETECT`), by id: the
    /// backend, the Services it serves, and whether some frontend avoids
    /// it when quarantined (`OUTLIER_AVOID`; else dry-run only).
    pub fn outlier_backends(&self) -> BTreeMap<u32, OutlierBackend> {
        let addrs: std::collections::HashMap<u32, BackendAddr> = self
            .backends
            .programmed_iter()
            .map(|(a, b)| (b.id, *a))
            .collect();
        let mut out: BTreeMap<u32, OutlierBackend> = BTreeMap::new();
        for p in self.frontends.values() {
            if p.value.flags & service_flags::OUTLIER_DETECT == 0 {
                continue;
            }
            let avoided = p.value.flags & service_flags::OUTLIER_AVOID != 0;
            for id in &p.slots {
                let Some(addr) = addrs.get(id) else { continue };
                let entry = out.entry(*id).or_insert_with(|| OutlierBackend {
                    addr: *addr,
                    services: BTreeSet::new(),
                    avoided: false,
                });
                entry.avoided |= avoided;
                if let Some(state) = &p.state {
                    entry.services.insert(state.service.to_string());
                }
            }
        }
        out
    }

    /// The affinity policy of every `affinity_id` of a programmed frontend
    /// with affinity, for the affinity sweeper. The frontends of one id
    /// have the same backends and timeout by construction; should they
    /// differ for a moment (a write failed), an entry is kept only if its
    /// backend is selectable through each of them, and until the longest
    /// timeout.
    pub fn affinity_policies(&self) -> BTreeMap<u32, crate::datapath::affinity::AffinityPolicy> {
        let mut out: BTreeMap<u32, crate::datapath::affinity::AffinityPolicy> = BTreeMap::new();
        for p in self.frontends.values() {
            if p.value.flags & service_flags::AFFINITY == 0 || p.value.affinity_id == 0 {
                continue;
            }
            let timeout_s = p.value.affinity_timeout;
            let active_backends = crate::datapath::affinity::selectable_backends(
                &p.slots,
                p.value.active,
                p.value.terminating,
            );
            match out.entry(p.value.affinity_id) {
                std::collections::btree_map::Entry::Vacant(e) => {
                    e.insert(crate::datapath::affinity::AffinityPolicy {
                        timeout_s,
                        active_backends,
                    });
                }
                std::collections::btree_map::Entry::Occupied(mut e) => {
                    let policy = e.get_mut();
                    policy.timeout_s = policy.timeout_s.max(timeout_s);
                    policy
                        .active_backends
                        .retain(|b| active_backends.contains(b));
                }
            }
        }
        out
    }

    /// The policy of every programmed frontend whose UDP flows the kernel
    /// keeps in `LB_DGRAM_FLOWS` (the socket path's UDP frontends without
    /// sessionAffinity), for the datagram flow sweeper.
    pub fn datagram_flow_policies(
        &self,
    ) -> BTreeMap<
        crate::datapath::datagram_flows::FlowFrontend,
        crate::datapath::datagram_flows::DatagramPolicy,
    > {
        self.frontends
            .iter()
            .filter(|(f, p)| {
                f.scope == Scope::Internal
                    && f.protocol == crate::semantics::model::Protocol::Udp
                    && p.value.flags & service_flags::AFFINITY == 0
            })
            .map(|(f, p)| {
                let key = service_key(f);
                let policy = crate::datapath::datagram_flows::DatagramPolicy {
                    service_id: p.id,
                    serving: crate::datapath::datagram_flows::serving_backends(
                        &p.slots,
                        p.value.active,
                        p.value.terminating,
                    ),
                    counts: lb_common::algorithm::counts(p.value.algorithm()),
                };
                ((key.addr, key.port, key.proto), policy)
            })
            .collect()
    }

    /// Whether `apply` left sets or backends for `retire` to delete.
    ///
    /// A backend only loses its last slot when a set is replaced or
    /// removed (then retiring) or a write failed (then noted): this does not
    /// walk every slot, as it runs on every turn of the agent's loop.
    pub fn has_retiring(&self) -> bool {
        !self.retiring.is_empty() || self.stray_backends
    }

    /// Backends a programmed frontend names, or a set that was published
    /// and is not deleted yet.
    fn referenced_backends(&self) -> std::collections::HashSet<u32> {
        self.frontends
            .values()
            .flat_map(|p| p.slots.iter().copied())
            .chain(
                self.retiring
                    .iter()
                    .flat_map(|r| r.backends.iter().copied()),
            )
            .collect()
    }

    /// The sets queued so far go at the next `retire`; sets queued after
    /// this wait for the one after. The caller runs that retire a delay
    /// after this call, so every set stays readable for at least the delay
    /// after the value that named it was replaced, however soon after a
    /// scheduled retire that happened.
    pub fn schedule_retire(&mut self) {
        for r in &mut self.retiring {
            r.due = true;
        }
    }

    /// Deletes the replaced sets due (their slots and tables, see
    /// `schedule_retire`) and backends nothing names any more. Run it a
    /// moment after `schedule_retire`, once no program can still hold a
    /// `ServiceValue` that named them.
    /// Backend `addr`'s id `id` after its deletion: free, or kept while
    /// connections counted for it are open (`draining`).
    fn free_backend_id(&mut self, addr: BackendAddr, id: u32, ops: &mut impl MapOps) {
        if ops.backend_busy(BackendId { id }) {
            self.draining.insert(addr, id);
        } else {
            self.used_backend_ids.remove(&id);
        }
    }

    pub fn retire(&mut self, ops: &mut impl MapOps) -> Vec<String> {
        let mut errors = Vec::new();
        let (retiring, waiting): (Vec<Retired>, Vec<Retired>) = std::mem::take(&mut self.retiring)
            .into_iter()
            .partition(|r| r.due);
        self.retiring = waiting;
        let indexes: Vec<u32> = retiring
            .iter()
            .flat_map(|r| r.slot_base..r.slot_base + r.slots)
            .collect();
        ops.del_slots(&indexes);
        let tables: Vec<u32> = retiring.iter().filter(|r| r.table).map(|r| r.set).collect();
        for (set, source) in ops.del_maglevs(&tables) {
            errors.push(
                MapWriteError {
                    what: format!("Maglev table of backend set {set}"),
                    source,
                }
                .to_string(),
            );
        }
        for r in &retiring {
            self.used_sets.remove(&r.set);
            self.slot_ranges.release(r.slot_base, r.slots);
        }
        self.room_made |= retiring.iter().any(|r| r.published);
        let referenced = self.referenced_backends();
        let mut unused: Vec<(BackendAddr, u32)> = self
            .backends
            .programmed_iter()
            .filter(|(_, b)| !referenced.contains(&b.id))
            .map(|(a, b)| (*a, b.id))
            .collect();
        unused.sort_unstable();
        // Ids of backends whose counted connections have all closed are
        // free again.
        let drained: Vec<(BackendAddr, u32)> = self
            .draining
            .iter()
            .filter(|(_, id)| !ops.backend_busy(BackendId { id: **id }))
            .map(|(a, id)| (*a, *id))
            .collect();
        for (addr, id) in drained {
            self.draining.remove(&addr);
            self.used_backend_ids.remove(&id);
        }
        for (addr, id) in unused {
            match ops.del_backend(BackendId { id }) {
                Ok(()) => {
                    self.backends.unprogram(&addr);
                    self.free_backend_id(addr, id, ops);
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    self.backends.unprogram(&addr);
                    self.free_backend_id(addr, id, ops);
                }
                Err(source) => errors.push(
                    MapWriteError {
                        what: format!("backend {addr}"),
                        source,
                    }
                    .to_string(),
                ),
            }
        }
        // A backend that could not be deleted is still there to retire.
        self.stray_backends = !errors.is_empty();
        errors
    }
}

#[cfg(test)]
pub(super) mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::semantics::model::{
        Algorithm, BackendRef, FrontendKind, OutlierMode, Protocol, ServiceName,
    };

    /// Maps as plain collections. After every single write it checks what a
    /// concurrent connect could observe: each frontend's slots (their
    /// checks naming its set, no element shared with another frontend),
    /// and its Maglev table, all resolve to backends. The capacities make a
    /// map "full" to test failures (`LB_SLOTS`: a write of an element that
    /// is zeros fails once that many are not, as `slot_ranges` would
    /// refuse); a table is never written in place.
    #[derive(Default)]
    pub(in crate::datapath) struct FakeMaps {
        pub(in crate::datapath) services: HashMap<ServiceKey, ServiceValue>,
        /// `LB_SLOTS` elements that are not zeros, by index.
        pub(in crate::datapath) slots: HashMap<u32, BackendSlot>,
        pub(in crate::datapath) backends: HashMap<BackendId, Backend>,
        pub(in crate::datapath) maglev: HashMap<u32, Vec<u32>>,
        service_capacity: Option<usize>,
        slot_capacity: Option<usize>,
        backend_capacity: Option<usize>,
        maglev_capacity: Option<usize>,
        /// `put_maglev` cannot make a table (as ENOMEM would).
        no_table_memory: bool,
        pub(in crate::datapath) writes: usize,
        /// Keys of `LB_SERVICES` written while they held a value (updates
        /// in place), in order.
        pub(in crate::datapath) services_replaced: Vec<ServiceKey>,
        /// For states that are broken on purpose, and for sizes the check
        /// after every write would make quadratic.
        unchecked: bool,
        /// Maps of a version that kept Maglev tables in `LB_SLOTS`: a
        /// Maglev frontend may have no table (the programs then choose at
        /// random); one it has must be whole.
        tables_may_be_missing: bool,
    }

    fn full(len: usize, cap: Option<usize>, present: bool) -> std::io::Result<()> {
        match cap {
            Some(cap) if len >= cap && !present => {
                Err(std::io::Error::from_raw_os_error(libc::E2BIG))
            }
            _ => Ok(()),
        }
    }

    impl FakeMaps {
        /// One map write: counted, then the maps checked as a datapath
        /// reader would see them.
        fn write<T>(&mut self, change: impl FnOnce(&mut Self) -> T) -> std::io::Result<()> {
            self.writes += 1;
            change(self);
            self.check();
            Ok(())
        }

        fn check(&self) {
            if self.unchecked {
                return;
            }
            let mut held = std::collections::HashSet::new();
            for (k, v) in &self.services {
                if v.flags & service_flags::WILDCARD != 0 {
                    continue;
                }
                for slot in 0..(v.active + v.terminating) as u32 {
                    let s = self.slot_of(v, slot);
                    assert!(
                        held.insert(v.slot_base + slot),
                        "{k:?}: slot {slot} is another frontend's element"
                    );
                    assert!(
                        self.backends.contains_key(&BackendId { id: s.backend_id }),
                        "{k:?}: backend {} missing",
                        s.backend_id
                    );
                }
                if lb_common::select::uses_maglev(v) {
                    let table = match self.maglev.get(&v.backend_set) {
                        Some(table) => table,
                        None if self.tables_may_be_missing => continue,
                        None => panic!("{k:?}: Maglev table missing"),
                    };
                    assert_eq!(table.len(), v.maglev_size as usize, "{k:?}");
                    for id in table {
                        assert!(
                            self.backends.contains_key(&BackendId { id: *id }),
                            "{k:?}: table backend {id} missing"
                        );
                    }
                }
            }
        }

        /// `slot` of the set `v` names, as a program takes it; panics if
        /// it is missing or another set's.
        fn slot_of(&self, v: &ServiceValue, slot: u32) -> BackendSlot {
            let (index, want) = slot_item(v.backend_set, v.slot_base, slot, 0);
            let s = *self
                .slots
                .get(&index)
                .unwrap_or_else(|| panic!("{v:?}: slot {slot} missing"));
            assert_eq!(
                s.key_check, want.key_check,
                "{v:?}: slot {slot} is another set's"
            );
            s
        }

        /// Whether `slot` of the set `v` names is in `LB_SLOTS`.
        fn holds(&self, v: &ServiceValue, slot: u32) -> bool {
            let (index, want) = slot_item(v.backend_set, v.slot_base, slot, 0);
            self.slots
                .get(&index)
                .is_some_and(|s| s.key_check == want.key_check)
        }

        /// The backend in `slot` of the set `v` names; panics if either is
        /// missing.
        fn backend_in(&self, v: &ServiceValue, slot: u32) -> Backend {
            let id = self.slot_of(v, slot).backend_id;
            self.backends[&BackendId { id }]
        }

        fn backends_of(&self, f: &Frontend) -> Vec<BackendAddr> {
            let v = self.services[&service_key(f)];
            (0..(v.active + v.terminating) as u32)
                .map(|slot| addr_of(&self.backend_in(&v, slot)))
                .collect()
        }

        /// The backend of each position of `f`'s Maglev table.
        fn table_of(&self, f: &Frontend) -> Vec<BackendAddr> {
            let v = self.services[&service_key(f)];
            self.maglev[&v.backend_set]
                .iter()
                .map(|id| addr_of(&self.backends[&BackendId { id: *id }]))
                .collect()
        }
    }

    fn addr_of(b: &Backend) -> BackendAddr {
        let addr = if lb_common::is_ipv4_mapped(&b.addr) {
            IpAddr::from([b.addr[12], b.addr[13], b.addr[14], b.addr[15]])
        } else {
            IpAddr::from(b.addr)
        };
        BackendAddr {
            addr,
            port: b.port,
            protocol: Protocol::from_number(b.proto).unwrap(),
        }
    }

    impl MapOps for FakeMaps {
        fn put_service(&mut self, key: ServiceKey, value: ServiceValue) -> std::io::Result<()> {
            let present = self.services.contains_key(&key);
            full(self.services.len(), self.service_capacity, present)?;
            if present {
                self.services_replaced.push(key);
            }
            self.write(|m| m.services.insert(key, value))
        }
        fn del_service(&mut self, key: ServiceKey) -> std::io::Result<()> {
            self.write(|m| m.services.remove(&key))
        }
        fn put_slot(&mut self, index: u32, value: BackendSlot) -> std::io::Result<()> {
            let present = self.slots.contains_key(&index);
            full(self.slots.len(), self.slot_capacity, present)?;
            self.write(|m| m.slots.insert(index, value))
        }
        fn del_slot(&mut self, index: u32) -> std::io::Result<()> {
            self.write(|m| m.slots.remove(&index))
        }
        fn put_backend(&mut self, id: BackendId, backend: Backend) -> std::io::Result<()> {
            let present = self.backends.contains_key(&id);
            full(self.backends.len(), self.backend_capacity, present)?;
            self.write(|m| m.backends.insert(id, backend))
        }
        fn del_backend(&mut self, id: BackendId) -> std::io::Result<()> {
            self.write(|m| m.backends.remove(&id))
        }
        fn put_maglev(&mut self, set: u32, table: &[u32]) -> Result<(), MaglevWriteError> {
            assert!(
                !self.maglev.contains_key(&set),
                "table {set} written in place"
            );
            if self.no_table_memory {
                let e = std::io::Error::from_raw_os_error(libc::ENOMEM);
                return Err(MaglevWriteError::Table(e));
            }
            full(self.maglev.len(), self.maglev_capacity, false)
                .map_err(MaglevWriteError::Insert)?;
            let table = table.to_vec();
            self.write(|m| m.maglev.insert(set, table))
                .map_err(MaglevWriteError::Insert)
        }
        fn del_maglev(&mut self, set: u32) -> std::io::Result<()> {
            if !self.maglev.contains_key(&set) {
                return Err(std::io::ErrorKind::NotFound.into());
            }
            self.write(|m| m.maglev.remove(&set))
        }
        fn get_maglev(&mut self, set: u32, _size: u16) -> std::io::Result<Vec<u32>> {
            self.maglev
                .get(&set)
                .cloned()
                .ok_or_else(|| std::io::ErrorKind::NotFound.into())
        }
    }

    fn fe(ip: &str, port: u16) -> Frontend {
        Frontend {
            addr: ip.parse().unwrap(),
            port,
            protocol: Protocol::Tcp,
            scope: Scope::Internal,
        }
    }

    fn be(ip: &str, port: u16) -> BackendAddr {
        BackendAddr {
            addr: ip.parse().unwrap(),
            port,
            protocol: Protocol::Tcp,
        }
    }

    fn state(name: &str, active: &[BackendAddr]) -> FrontendState {
        FrontendState {
            service: ServiceName {
                namespace: "default".into(),
                name: name.into(),
            },
            port_name: String::new(),
            kind: FrontendKind::ClusterIp,
            active: active
                .iter()
                .map(|b| BackendRef {
                    backend: *b,
                    local: false,
                })
                .collect(),
            terminating: vec![],
            serving: active.to_vec(),
            affinity_timeout: None,
            selection: Default::default(),
            algorithm: Algorithm::Random,
            reject: false,
            source_ranges: false,
            // Off, so that the flags the other tests expect are theirs alone.
            outlier: OutlierMode::Off,
        }
    }

    fn desired(entries: &[(Frontend, FrontendState)]) -> DesiredState {
        let mut d = DesiredState::default();
        for (f, s) in entries {
            d.frontends.insert(*f, s.clone().into());
            d.vips.insert((f.addr, f.scope));
        }
        d
    }

    impl Reconciler {
        fn test() -> Self {
            Self::new(251, lb_common::capacity::SLOTS)
        }
    }

    fn sync(r: &mut Reconciler, d: &DesiredState, m: &mut FakeMaps) -> SyncReport {
        let report = r.apply(d, m);
        assert!(retire_all(r, m).is_empty());
        report
    }

    /// A retire scheduled after everything queued so far, as the agent's
    /// loop runs it when no change comes in between.
    pub(in crate::datapath) fn retire_all(r: &mut Reconciler, m: &mut FakeMaps) -> Vec<String> {
        r.schedule_retire();
        r.retire(m)
    }

    #[test]
    fn writes_frontends_backends_and_vips() {
        let mut r = Reconciler::test();
        let mut m = FakeMaps::default();
        let web = fe("10.96.0.10", 80);
        let d = desired(&[(
            web,
            state("web", &[be("10.244.1.1", 8080), be("10.244.1.2", 8080)]),
        )]);
        let report = sync(&mut r, &d, &mut m);
        assert_eq!(report.frontends_written, 1);
        assert_eq!(report.backends_written, 2);
        assert_eq!(
            m.backends_of(&web),
            vec![be("10.244.1.1", 8080), be("10.244.1.2", 8080)]
        );
        let vip = ServiceKey::wildcard(addr_bytes("10.96.0.10".parse().unwrap()), 0);
        assert_eq!(m.services[&vip].flags, service_flags::WILDCARD);
        assert_eq!(m.services.len(), 2);
    }

    /// The programs trust a VIP marker's miss (`lb::lookup_frontend`
    /// looks a frontend up again only while its marker is there), which
    /// holds because a marker is never replaced: written once when its
    /// address gains a frontend, whatever happens to the frontends after.
    #[test]
    fn a_vip_marker_is_written_once_and_never_replaced() {
        let mut r = Reconciler::test();
        let mut m = FakeMaps::default();
        let (web, dns) = (fe("10.96.0.10", 80), fe("10.96.0.10", 53));
        let one = [be("10.244.1.1", 8080)];
        let two = [be("10.244.1.1", 8080), be("10.244.1.2", 8080)];
        let steps = [
            desired(&[(web, state("web", &one))]),
            desired(&[(web, state("web", &two))]),
            desired(&[(web, state("web", &two)), (dns, state("web", &one))]),
            desired(&[(dns, state("web", &two))]),
            desired(&[(web, state("web", &[])), (dns, state("web", &one))]),
        ];
        for d in &steps {
            sync(&mut r, d, &mut m);
        }
        let vip = ServiceKey::wildcard(addr_bytes("10.96.0.10".parse().unwrap()), 0);
        assert_eq!(m.services[&vip].flags, service_flags::WILDCARD);
        assert!(
            m.services_replaced.contains(&service_key(&web))
                && m.services_replaced.contains(&service_key(&dns)),
            "the frontends were replaced in place: {:?}",
            m.services_replaced
        );
        assert!(!m.services_replaced.contains(&vip));
    }

    /// Only the tc path's NodePort frontends are flagged NODE_ADDRESS: the
    /// socket path's frontend of the same address and port, and the tc
    /// path's LoadBalancer IPs, are not.
    #[test]
    fn external_node_ports_are_flagged_node_address() {
        let mut r = Reconciler::test();
        let mut m = FakeMaps::default();
        let ext = |ip: &str, port| Frontend {
            scope: Scope::External,
            ..fe(ip, port)
        };
        let kind = |kind| FrontendState {
            kind,
            ..state("web", &[be("10.244.1.1", 8080)])
        };
        let d = desired(&[
            (ext("192.168.77.1", 30080), kind(FrontendKind::NodePort)),
            (fe("192.168.77.1", 30080), kind(FrontendKind::NodePort)),
            (ext("203.0.113.10", 80), kind(FrontendKind::LoadBalancer)),
        ]);
        sync(&mut r, &d, &mut m);
        let flagged: Vec<bool> = d
            .frontends
            .keys()
            .map(|f| m.services[&service_key(f)].flags & service_flags::NODE_ADDRESS != 0)
            .collect();
        let want: Vec<bool> = d
            .frontends
            .keys()
            .map(|f| f.scope == Scope::External && f.port == 30080)
            .collect();
        assert_eq!(flagged, want);
        assert!(flagged.contains(&true));
    }

    #[test]
    fn unchanged_state_writes_nothing() {
        let mut r = Reconciler::test();
        let mut m = FakeMaps::default();
        let d = desired(&[(
            fe("10.96.0.10", 80),
            state("web", &[be("10.244.1.1", 8080)]),
        )]);
        sync(&mut r, &d, &mut m);
        let writes = m.writes;
        let report = sync(&mut r, &d, &mut m);
        assert_eq!(report, SyncReport::default());
        assert_eq!(m.writes, writes);
    }

    #[test]
    fn changing_one_service_leaves_the_other_untouched() {
        let mut r = Reconciler::test();
        let mut m = FakeMaps::default();
        let (a, b) = (fe("10.96.0.10", 80), fe("10.96.0.11", 80));
        let d1 = desired(&[
            (a, state("a", &[be("10.244.1.1", 80)])),
            (b, state("b", &[be("10.244.1.2", 80)])),
        ]);
        sync(&mut r, &d1, &mut m);
        let b_value = m.services[&service_key(&b)];
        let d2 = desired(&[
            (a, state("a", &[be("10.244.1.1", 80), be("10.244.1.3", 80)])),
            (b, state("b", &[be("10.244.1.2", 80)])),
        ]);
        let report = sync(&mut r, &d2, &mut m);
        assert_eq!(report.frontends_written, 1);
        assert_eq!(m.services[&service_key(&b)], b_value);
        assert_eq!(m.backends_of(&a).len(), 2);
    }

    #[test]
    fn replaced_set_is_kept_until_retire_and_then_deleted() {
        let mut r = Reconciler::test();
        let mut m = FakeMaps::default();
        let web = fe("10.96.0.10", 80);
        sync(
            &mut r,
            &desired(&[(web, state("web", &[be("10.244.1.1", 80)]))]),
            &mut m,
        );
        let old = m.services[&service_key(&web)];
        r.apply(
            &desired(&[(web, state("web", &[be("10.244.1.2", 80)]))]),
            &mut m,
        );
        // A connect that read the old value still resolves its slot.
        assert!(m.holds(&old, 0));
        assert_eq!(m.backends.len(), 2);
        assert!(r.has_retiring());
        assert!(retire_all(&mut r, &mut m).is_empty());
        assert_eq!(m.slots.len(), 1);
        assert_eq!(m.backends.len(), 1);
        assert_eq!(m.backends_of(&web), vec![be("10.244.1.2", 80)]);
        assert!(!r.has_retiring());
    }

    /// The agent schedules a retire when it first has sets to retire and
    /// runs it a delay later. A set replaced in between, even just before
    /// that retire, must not go with it: a program that read its value a
    /// moment before the switch still looks up its slots and backends, and
    /// a backend id freed at once could name another address at the next
    /// sync.
    #[test]
    fn a_set_replaced_after_the_retire_was_scheduled_waits_for_the_next() {
        let mut r = Reconciler::test();
        let mut m = FakeMaps::default();
        let web = fe("10.96.0.10", 80);
        let set_of = |m: &FakeMaps| m.services[&service_key(&web)];
        sync(
            &mut r,
            &desired(&[(web, state("web", &[be("10.244.1.1", 80)]))]),
            &mut m,
        );
        let first = set_of(&m);
        r.apply(
            &desired(&[(web, state("web", &[be("10.244.1.2", 80)]))]),
            &mut m,
        );
        let second = set_of(&m);
        r.schedule_retire();
        // Replaced after the retire was scheduled.
        r.apply(
            &desired(&[(web, state("web", &[be("10.244.1.3", 80)]))]),
            &mut m,
        );
        assert!(r.retire(&mut m).is_empty());
        assert!(!m.holds(&first, 0));
        assert!(
            m.holds(&second, 0),
            "the set replaced after the retire was scheduled was deleted with it"
        );
        let second_backend = m.slot_of(&second, 0).backend_id;
        assert!(m.backends.contains_key(&BackendId { id: second_backend }));
        assert_eq!(m.backends.len(), 2, "10.244.1.2 and 10.244.1.3");
        // A backend that arrives now cannot take the id of one still named.
        r.apply(
            &desired(&[(
                web,
                state("web", &[be("10.244.1.3", 80), be("10.244.1.4", 80)]),
            )]),
            &mut m,
        );
        assert_eq!(m.backends_of(&web).len(), 2);
        assert_eq!(
            addr_of(&m.backends[&BackendId { id: second_backend }]),
            be("10.244.1.2", 80)
        );
        assert!(r.has_retiring());
        assert!(retire_all(&mut r, &mut m).is_empty());
        assert!(!m.holds(&second, 0));
        assert_eq!(m.backends.len(), 2);
        assert!(!r.has_retiring());
    }

    #[test]
    fn removed_services_leave_no_entries() {
        let mut r = Reconciler::test();
        let mut m = FakeMaps::default();
        let d = desired(&[
            (fe("10.96.0.10", 80), state("a", &[be("10.244.1.1", 80)])),
            (fe("fd00:96::10", 80), state("b", &[be("fd00:244::1", 80)])),
        ]);
        sync(&mut r, &d, &mut m);
        let report = sync(&mut r, &DesiredState::default(), &mut m);
        assert_eq!(report.frontends_removed, 2);
        assert!(m.services.is_empty() && m.slots.is_empty() && m.backends.is_empty());
        assert_eq!((r.frontend_count(), r.backend_count()), (0, 0));
    }

    #[test]
    fn shared_backend_gets_one_id_and_survives_one_user_leaving() {
        let mut r = Reconciler::test();
        let mut m = FakeMaps::default();
        let shared = be("10.244.1.1", 80);
        let (a, b) = (fe("10.96.0.10", 80), fe("10.96.0.11", 80));
        sync(
            &mut r,
            &desired(&[(a, state("a", &[shared])), (b, state("b", &[shared]))]),
            &mut m,
        );
        assert_eq!(m.backends.len(), 1);
        sync(&mut r, &desired(&[(b, state("b", &[shared]))]), &mut m);
        assert_eq!(m.backends_of(&b), vec![shared]);
    }

    #[test]
    fn options_change_keeps_the_set() {
        let mut r = Reconciler::test();
        let mut m = FakeMaps::default();
        let web = fe("10.96.0.10", 80);
        let s = state("web", &[be("10.244.1.1", 80)]);
        sync(&mut r, &desired(&[(web, s.clone())]), &mut m);
        let before = m.services[&service_key(&web)];
        let mut sticky = s;
        sticky.affinity_timeout = Some(30);
        sync(&mut r, &desired(&[(web, sticky)]), &mut m);
        let after = m.services[&service_key(&web)];
        assert_eq!(after.backend_set, before.backend_set);
        assert_eq!(after.flags, service_flags::AFFINITY);
        assert_eq!(after.affinity_timeout, 30);
    }

    /// Outlier detection is an option of the frontend: `dry-run` detects,
    /// `on` detects and avoids. A change of the mode alone rewrites the
    /// value (the set stays), also after a restart that adopted the maps;
    /// an adopted value already right is left alone.
    #[test]
    fn outlier_mode_sets_its_flags_and_its_change_rewrites_the_value() {
        use service_flags::{OUTLIER_AVOID, OUTLIER_DETECT};
        let mut r = Reconciler::test();
        let mut m = FakeMaps::default();
        let web = fe("10.96.0.10", 80);
        let s = state("web", &[be("10.244.1.1", 80)]);
        let with = |outlier| {
            desired(&[(
                web,
                FrontendState {
                    outlier,
                    ..s.clone()
                },
            )])
        };
        let both = OUTLIER_DETECT | OUTLIER_AVOID;
        sync(&mut r, &with(OutlierMode::Off), &mut m);
        let first = m.services[&service_key(&web)];
        assert_eq!(first.flags & both, 0);
        for (mode, want) in [
            (OutlierMode::On, both),
            (OutlierMode::DryRun, OUTLIER_DETECT),
            (OutlierMode::Off, 0),
            (OutlierMode::DryRun, OUTLIER_DETECT),
            (OutlierMode::On, both),
        ] {
            let report = sync(&mut r, &with(mode), &mut m);
            assert_eq!(report.frontends_written, 1, "{mode:?}");
            let v = m.services[&service_key(&web)];
            assert_eq!(v.flags & both, want, "{mode:?}");
            assert_eq!(v.flags & !both, first.flags, "{mode:?}");
            assert_eq!((v.id, v.backend_set), (first.id, first.backend_set));
        }
        // Only what changed is written, through the touched path too.
        let report = r.apply_touched(&with(OutlierMode::On), &BTreeSet::from([web]), &mut m);
        assert_eq!(report.frontends_written, 0);
        let report = r.apply_touched(&with(OutlierMode::DryRun), &BTreeSet::from([web]), &mut m);
        assert_eq!(report.frontends_written, 1);
        assert_eq!(m.services[&service_key(&web)].flags & both, OUTLIER_DETECT);
        assert!(retire_all(&mut r, &mut m).is_empty());
        // Restarted with another mode: rewritten; with the same: adopted.
        let mut r = adopt_from(&m);
        let report = sync(&mut r, &with(OutlierMode::Off), &mut m);
        assert_eq!(report.frontends_written, 1);
        assert_eq!(m.services[&service_key(&web)].flags & both, 0);
        let mut r = adopt_from(&m);
        let writes = m.writes;
        let report = sync(&mut r, &with(OutlierMode::Off), &mut m);
        assert_eq!(report.frontends_written, 0);
        assert_eq!(m.writes, writes);
    }

    #[test]
    fn maglev_table_follows_the_backends_and_moves_little() {
        let mut r = Reconciler::test();
        let mut m = FakeMaps::default();
        let web = fe("10.96.0.10", 80);
        let backends: Vec<BackendAddr> =
            (1..=5).map(|i| be(&format!("10.244.1.{i}"), 80)).collect();
        let mut s = state("web", &backends);
        s.algorithm = Algorithm::Maglev;
        sync(&mut r, &desired(&[(web, s.clone())]), &mut m);
        let table = |m: &FakeMaps| -> Vec<BackendAddr> {
            let v = m.services[&service_key(&web)];
            assert_eq!(v.flags & service_flags::MAGLEV, service_flags::MAGLEV);
            assert_eq!(v.maglev_size, 251);
            m.table_of(&web)
        };
        let before = table(&m);
        assert_eq!(before.len(), 251);
        s.active.remove(2);
        sync(&mut r, &desired(&[(web, s)]), &mut m);
        let after = table(&m);
        let moved = before.iter().zip(&after).filter(|(a, b)| a != b).count();
        assert!(moved < 251 * 2 / 5, "{moved} of 251 positions moved");
        // The table lives apart: the slots hold the backends alone, and
        // the replaced table is gone with its set.
        assert_eq!(m.slots.len(), 4);
        assert_eq!(m.maglev.len(), 1);
    }

    fn adopt_from(m: &FakeMaps) -> Reconciler {
        Reconciler::adopt(
            251,
            lb_common::capacity::SLOTS,
            m.services.iter().map(|(k, v)| (*k, *v)),
            m.slots.iter().map(|(k, v)| (*k, *v)),
            m.backends.iter().map(|(k, v)| (*k, *v)),
            m.maglev.keys().copied(),
        )
    }

    #[test]
    fn a_restarted_agent_adopts_the_maps_and_writes_only_changes() {
        let mut m = FakeMaps::default();
        let (a, b) = (fe("10.96.0.10", 80), fe("10.96.0.11", 53));
        let mut sb = state("b", &[be("10.244.1.2", 53)]);
        sb.algorithm = Algorithm::Maglev;
        sb.affinity_timeout = Some(10);
        let d1 = desired(&[(a, state("a", &[be("10.244.1.1", 80)])), (b, sb.clone())]);
        sync(&mut Reconciler::test(), &d1, &mut m);
        let before = m.services.clone();

        // Restart with nothing changed: not a single write.
        let mut r = adopt_from(&m);
        let writes = m.writes;
        let report = sync(&mut r, &d1, &mut m);
        assert_eq!(report.frontends_adopted, 2, "{report:?}");
        assert_eq!(report.frontends_written, 0);
        assert_eq!(m.writes, writes);
        assert_eq!(r.affinity_policies().len(), 1);

        // Restart while `a` changed and a third Service went away.
        let d2 = desired(&[(a, state("a", &[be("10.244.1.3", 80)]))]);
        let mut r = adopt_from(&m);
        let report = sync(&mut r, &d2, &mut m);
        assert_eq!((report.frontends_written, report.frontends_removed), (1, 1));
        assert_eq!(m.services[&service_key(&a)].id, before[&service_key(&a)].id);
        assert_eq!(m.backends_of(&a), vec![be("10.244.1.3", 80)]);
        assert_eq!(m.backends.len(), 1);
        assert_eq!(m.slots.len(), 1);
        // `b`'s VIP marker, adopted as a VIP, went with it: `a` and its
        // marker are all that is left.
        assert_eq!(m.services.len(), 2, "{:?}", m.services);
        assert!(m.services.contains_key(&vip_key(a.addr, a.scope)));
    }

    /// sessionAffinity ids: one per group (Service port and selection),
    /// shared by its frontends, kept across endpoint changes and restarts,
    /// never shared with another group; the sweeper's policies by id.
    #[test]
    fn affinity_ids_are_shared_per_group_and_stable() {
        let mut m = FakeMaps::default();
        let all = [be("10.244.1.1", 80), be("10.244.1.2", 80)];
        let sticky = |name: &str, kind, active: &[BackendAddr]| {
            let mut s = state(name, active);
            s.kind = kind;
            s.affinity_timeout = Some(60);
            s
        };
        let cip = fe("10.96.0.10", 80);
        let ext_ip = fe("203.0.113.5", 80);
        let node_port = Frontend {
            scope: Scope::External,
            ..fe("192.168.1.10", 30080)
        };
        let other = fe("10.96.0.11", 80);
        let mut local = sticky("web", FrontendKind::LoadBalancer, &all[..1]);
        local.selection = crate::semantics::model::Selection::NodeLocal;
        let lb_ext = Frontend {
            scope: Scope::External,
            ..fe("198.51.100.1", 80)
        };
        let d = |active: &[BackendAddr]| {
            desired(&[
                (cip, sticky("web", FrontendKind::ClusterIp, active)),
                (ext_ip, sticky("web", FrontendKind::ExternalIp, active)),
                (node_port, sticky("web", FrontendKind::NodePort, active)),
                (lb_ext, local.clone()),
                (other, sticky("other", FrontendKind::ClusterIp, active)),
            ])
        };
        let mut r = Reconciler::test();
        sync(&mut r, &d(&all), &mut m);
        let id = |m: &FakeMaps, f: &Frontend| m.services[&service_key(f)].affinity_id;
        let web = id(&m, &cip);
        assert_ne!(web, 0);
        assert_eq!(id(&m, &ext_ip), web);
        assert_eq!(id(&m, &node_port), web);
        let ids = BTreeSet::from([web, id(&m, &lb_ext), id(&m, &other)]);
        assert_eq!(ids.len(), 3, "groups share no id: {ids:?}");
        // The frontend ids stay one per frontend.
        let frontend_ids: BTreeSet<u32> = m
            .services
            .values()
            .filter(|v| v.flags & service_flags::WILDCARD == 0)
            .map(|v| v.id)
            .collect();
        assert_eq!(frontend_ids.len(), 5);
        let policies = r.affinity_policies();
        assert_eq!(policies.len(), 3);
        assert_eq!(policies[&web].active_backends.len(), 2);
        assert_eq!(policies[&id(&m, &lb_ext)].active_backends.len(), 1);

        // An endpoint change keeps every id (no client loses its backend
        // because another endpoint came or went).
        let ids = |m: &FakeMaps| -> Vec<u32> {
            [cip, ext_ip, node_port, lb_ext, other]
                .iter()
                .map(|f| id(m, f))
                .collect()
        };
        let before = ids(&m);
        sync(&mut r, &d(&all[1..]), &mut m);
        assert_eq!(before, ids(&m));

        // A restart adopts them without a write.
        let mut r = adopt_from(&m);
        let writes = m.writes;
        let report = sync(&mut r, &d(&all[1..]), &mut m);
        assert_eq!(report.frontends_adopted, 5, "{report:?}");
        assert_eq!(m.writes, writes);
        // ... and keeps them through the next change.
        sync(&mut r, &d(&all), &mut m);
        assert_eq!(before, ids(&m));

        // Without affinity: no id; a group that comes back gets a new one.
        let mut plain = d(&all);
        for st in plain.frontends.values_mut() {
            Arc::make_mut(st).affinity_timeout = None;
        }
        sync(&mut r, &plain, &mut m);
        assert!(m.services.values().all(|v| v.affinity_id == 0));
        assert!(r.affinity_policies().is_empty());
        sync(&mut r, &d(&all), &mut m);
        assert!(
            !before.contains(&id(&m, &cip)),
            "ids are not reused at once"
        );
        assert_eq!(id(&m, &ext_ip), id(&m, &cip));
    }

    /// Frontends of one id that differ for a moment (a failed write): the
    /// sweeper keeps only entries selectable through all of them.
    #[test]
    fn affinity_policies_of_a_shared_id_intersect() {
        let mut r = Reconciler::test();
        let mut m = FakeMaps::default();
        let (a, b) = (fe("10.96.0.10", 80), fe("203.0.113.5", 80));
        let mut s = state("web", &[be("10.244.1.1", 80), be("10.244.1.2", 80)]);
        s.affinity_timeout = Some(30);
        sync(&mut r, &desired(&[(a, s.clone()), (b, s.clone())]), &mut m);
        let id = m.services[&service_key(&a)].affinity_id;
        // Pretend `b` holds one backend and a longer timeout.
        let p = r.frontends.get_mut(&b).unwrap();
        p.slots.truncate(1);
        p.value.active = 1;
        p.value.affinity_timeout = 90;
        let policies = r.affinity_policies();
        assert_eq!(policies.len(), 1);
        assert_eq!(policies[&id].active_backends.len(), 1);
        assert_eq!(policies[&id].timeout_s, 90);
    }

    /// The datagram flow sweeper's policies: the socket path's UDP
    /// frontends without affinity, by their key, with their service id and
    /// every serving backend (terminating ones too); the same after a
    /// restart.
    #[test]
    fn datagram_flow_policies_of_the_udp_frontends() {
        let udp = |f: Frontend| Frontend {
            protocol: Protocol::Udp,
            ..f
        };
        let udp_be = |ip| BackendAddr {
            protocol: Protocol::Udp,
            ..be(ip, 53)
        };
        let dns = udp(fe("10.96.0.10", 53));
        let sticky = udp(fe("10.96.0.11", 53));
        let tcp = fe("10.96.0.10", 80);
        let external = Frontend {
            scope: Scope::External,
            ..udp(fe("192.168.1.10", 30053))
        };
        let mut s = state("dns", &[udp_be("10.244.1.1")]);
        s.terminating = vec![BackendRef {
            backend: udp_be("10.244.1.2"),
            local: false,
        }];
        let mut with_affinity = state("sticky", &[udp_be("10.244.1.1")]);
        with_affinity.affinity_timeout = Some(30);
        let d = desired(&[
            (dns, s.clone()),
            (sticky, with_affinity),
            (tcp, state("web", &[be("10.244.1.1", 80)])),
            (external, s),
        ]);
        let mut r = Reconciler::test();
        let mut m = FakeMaps::default();
        sync(&mut r, &d, &mut m);
        let key = service_key(&dns);
        let policies = r.datagram_flow_policies();
        assert_eq!(
            policies.keys().collect::<Vec<_>>(),
            [&(key.addr, key.port, key.proto)]
        );
        let p = &policies[&(key.addr, key.port, key.proto)];
        assert_eq!(p.service_id, m.services[&key].id);
        let ids: BTreeSet<u32> = ["10.244.1.1", "10.244.1.2"]
            .iter()
            .map(|ip| r.backends.programmed(&udp_be(ip)).unwrap().id)
            .collect();
        assert_eq!(p.serving, ids);
        assert_eq!(adopt_from(&m).datagram_flow_policies(), policies);
    }

    #[test]
    fn adoption_repairs_broken_entries_and_retires_orphans() {
        let mut m = FakeMaps::default();
        let a = fe("10.96.0.10", 80);
        let d = desired(&[(a, state("a", &[be("10.244.1.1", 80)]))]);
        sync(&mut Reconciler::test(), &d, &mut m);
        // A crash left an orphan set, and the live set lost its slot.
        let (index, orphan) = slot_item(99, 99, 0, 1);
        m.slots.insert(index, orphan);
        m.unchecked = true;
        let live = m.services[&service_key(&a)];
        m.slots.remove(&live.slot_base);
        let mut r = adopt_from(&m);
        let report = r.apply(&d, &mut m);
        assert_eq!(report.frontends_written, 1);
        retire_all(&mut r, &mut m);
        assert_eq!(m.slots.len(), 1);
        assert_eq!(m.backends_of(&a), vec![be("10.244.1.1", 80)]);
    }

    #[test]
    fn udp_backends_that_stop_serving_are_reported_with_their_frontend() {
        let mut r = Reconciler::test();
        let mut m = FakeMaps::default();
        let dns = Frontend {
            protocol: Protocol::Udp,
            ..fe("10.96.0.10", 53)
        };
        let udp = |ip: &str| BackendAddr {
            protocol: Protocol::Udp,
            ..be(ip, 53)
        };
        let (b1, b2, b3) = (udp("10.244.1.1"), udp("10.244.1.2"), udp("10.244.1.3"));
        let web = fe("10.96.0.10", 80);
        let report = sync(
            &mut r,
            &desired(&[
                (dns, state("dns", &[b1, b2])),
                (web, state("web", &[be("10.244.1.1", 80)])),
            ]),
            &mut m,
        );
        // New, with serving endpoints: sockets connected to the VIP itself
        // went around the hook.
        assert_eq!(report.stale_udp.newly_serving, BTreeSet::from([dns]));
        assert!(report.stale_udp.stale.is_empty());
        let report = sync(
            &mut r,
            &desired(&[(dns, state("dns", &[b2])), (web, state("web", &[]))]),
            &mut m,
        );
        // TCP departures are not reported: TCP connections end on their own.
        assert_eq!(report.stale_udp.stale, BTreeSet::from([(dns, b1)]));
        assert!(report.stale_udp.newly_serving.is_empty());
        // A traffic policy narrows the selection; b3 still serves: nothing.
        let narrowed = FrontendState {
            serving: vec![b2, b3],
            ..state("dns", &[b2])
        };
        let wide = state("dns", &[b2, b3]);
        sync(&mut r, &desired(&[(dns, wide)]), &mut m);
        let report = sync(&mut r, &desired(&[(dns, narrowed)]), &mut m);
        assert_eq!(report.frontends_written, 1);
        assert!(report.stale_udp.is_empty(), "{report:?}");
        // The last ones stop serving: nothing yet; once one serves again,
        // they are stale.
        let none = state("dns", &[]);
        let report = sync(&mut r, &desired(&[(dns, none)]), &mut m);
        assert!(report.stale_udp.is_empty(), "{report:?}");
        let report = sync(&mut r, &desired(&[(dns, state("dns", &[b1]))]), &mut m);
        assert_eq!(
            report.stale_udp.stale,
            BTreeSet::from([(dns, b2), (dns, b3)])
        );
        assert_eq!(report.stale_udp.newly_serving, BTreeSet::from([dns]));
        // The Service goes: kube-proxy leaves its flows alone.
        let report = sync(&mut r, &DesiredState::default(), &mut m);
        assert_eq!(report.frontends_removed, 1);
        assert!(report.stale_udp.is_empty(), "{report:?}");
    }

    #[test]
    fn adopted_udp_frontends_compare_against_their_slots() {
        let udp = |ip: &str| BackendAddr {
            protocol: Protocol::Udp,
            ..be(ip, 53)
        };
        let dns = Frontend {
            protocol: Protocol::Udp,
            ..fe("10.96.0.10", 53)
        };
        let (b1, b2) = (udp("10.244.1.1"), udp("10.244.1.2"));
        let mut m = FakeMaps::default();
        sync(
            &mut Reconciler::test(),
            &desired(&[(dns, state("dns", &[b1, b2]))]),
            &mut m,
        );
        // Adopted as it was: nothing stale, and the VIP served before.
        let report = adopt_from(&m).apply(&desired(&[(dns, state("dns", &[b1, b2]))]), &mut m);
        assert_eq!(report.frontends_adopted, 1);
        assert!(report.stale_udp.is_empty(), "{report:?}");
        // b1 left while no agent ran.
        let mut r = adopt_from(&m);
        let report = r.apply(&desired(&[(dns, state("dns", &[b2]))]), &mut m);
        assert_eq!(report.stale_udp.stale, BTreeSet::from([(dns, b1)]));
        assert!(report.stale_udp.newly_serving.is_empty());
        assert_eq!(r.service_id(&dns), Some(m.services[&service_key(&dns)].id));
    }

    #[test]
    fn terminating_backends_follow_the_active_ones() {
        let mut r = Reconciler::test();
        let mut m = FakeMaps::default();
        let web = fe("10.96.0.10", 80);
        let mut s = state("web", &[be("10.244.1.1", 80)]);
        s.terminating = vec![BackendRef {
            backend: be("10.244.1.9", 80),
            local: true,
        }];
        sync(&mut r, &desired(&[(web, s)]), &mut m);
        let v = m.services[&service_key(&web)];
        assert_eq!((v.active, v.terminating), (1, 1));
        assert_eq!(m.backends_of(&web)[1], be("10.244.1.9", 80));
        let flags: Vec<u8> = m.backends.values().map(|b| b.flags).collect();
        assert!(flags.contains(&(backend_flags::TERMINATING | backend_flags::LOCAL)));
    }

    #[test]
    fn a_full_slot_map_fails_one_frontend_and_keeps_its_old_set() {
        let mut r = Reconciler::test();
        let mut m = FakeMaps::default();
        let (a, b) = (fe("10.96.0.10", 80), fe("10.96.0.11", 80));
        sync(
            &mut r,
            &desired(&[(a, state("a", &[be("10.244.1.1", 80)]))]),
            &mut m,
        );
        m.slot_capacity = Some(2);
        let many: Vec<BackendAddr> = (1..=3).map(|i| be(&format!("10.244.2.{i}"), 80)).collect();
        let report = r.apply(
            &desired(&[
                (a, state("a", &[be("10.244.1.1", 80)])),
                (b, state("b", &many)),
            ]),
            &mut m,
        );
        assert_eq!(report.errors.len(), 1, "{:?}", report.errors);
        assert!(
            report.errors[0].contains("10.96.0.11:80/TCP"),
            "{}",
            report.errors[0]
        );
        assert_eq!(m.backends_of(&a), vec![be("10.244.1.1", 80)]);
        assert!(!m.services.contains_key(&service_key(&b)));
        retire_all(&mut r, &mut m);
        // The next sync, with room, succeeds.
        m.slot_capacity = None;
        let report = r.apply(
            &desired(&[
                (a, state("a", &[be("10.244.1.1", 80)])),
                (b, state("b", &many)),
            ]),
            &mut m,
        );
        assert!(report.errors.is_empty());
        assert_eq!(m.backends_of(&b), many);
    }

    /// `LB_SLOTS` is an array (of twice `--max-slots`): each new set takes
    /// a free range of it, the replaced set's range is given back at the
    /// retire and used again, and a set that would put more than
    /// `--max-slots` in use fails its frontend alone ("LB_SLOTS is full"),
    /// which keeps its previous set, as with the hash map it was.
    #[test]
    fn sets_take_free_ranges_of_the_slot_array_and_give_them_back() {
        let mut r = Reconciler::new(251, 8);
        let mut m = FakeMaps::default();
        let (a, b) = (fe("10.96.0.10", 80), fe("10.96.0.11", 80));
        let pods = |n: u8, i: u8| -> Vec<BackendAddr> {
            (1..=i)
                .map(|j| be(&format!("10.244.{n}.{j}"), 80))
                .collect()
        };
        let base = |m: &FakeMaps, f: &Frontend| m.services[&service_key(f)].slot_base;
        sync(
            &mut r,
            &desired(&[(a, state("a", &pods(1, 1))), (b, state("b", &pods(2, 3)))]),
            &mut m,
        );
        assert_eq!((base(&m, &a), base(&m, &b)), (0, 1));
        // b grows to 4: its new set goes after the old one, which it
        // replaces only once written.
        sync(
            &mut r,
            &desired(&[(a, state("a", &pods(1, 1))), (b, state("b", &pods(2, 4)))]),
            &mut m,
        );
        assert_eq!(base(&m, &b), 4);
        // a grows to 2: into the range b's old set gave back.
        sync(
            &mut r,
            &desired(&[(a, state("a", &pods(1, 2))), (b, state("b", &pods(2, 4)))]),
            &mut m,
        );
        assert_eq!(base(&m, &a), 1);
        assert_eq!(r.usage().slots, 6);
        // b grows to 5: 6 of the 8 are in use.
        let report = r.apply(
            &desired(&[(a, state("a", &pods(1, 2))), (b, state("b", &pods(2, 5)))]),
            &mut m,
        );
        assert_eq!(report.errors.len(), 1, "{report:?}");
        assert!(
            report.errors[0].contains("10.96.0.11:80/TCP")
                && report.errors[0].contains("LB_SLOTS is full")
                && report.errors[0].contains("its previous state stays programmed"),
            "{}",
            report.errors[0]
        );
        assert_eq!(m.backends_of(&b), pods(2, 4));
        assert_eq!(m.backends_of(&a), pods(1, 2));
        assert!(retire_all(&mut r, &mut m).is_empty());
        assert!(m.slots.keys().all(|i| *i < 16), "{:?}", m.slots.keys());
        assert_eq!(m.slots.len(), 6);
        // a leaves: b's 4 and its new 5 would still be 9 at once; 3 fit,
        // in the first free range.
        let report = r.apply(&desired(&[(b, state("b", &pods(2, 5)))]), &mut m);
        assert_eq!(report.errors.len(), 1, "{report:?}");
        assert!(retire_all(&mut r, &mut m).is_empty());
        let report = r.apply(&desired(&[(b, state("b", &pods(2, 3)))]), &mut m);
        assert!(report.errors.is_empty(), "{report:?}");
        assert_eq!(base(&m, &b), 0);
        assert!(retire_all(&mut r, &mut m).is_empty());
        assert_eq!(r.usage().slots, 3);
        assert_eq!(m.slots.len(), 3);
    }

    /// Batches that stop part-way, as `BPF_MAP_UPDATE_BATCH` does at a
    /// failing element: the reconciler must finish the rest one by one,
    /// still in order (the inner maps check after every write).
    struct PartialBatches {
        inner: FakeMaps,
        /// Each batch writes this many elements, then fails.
        stop_after: usize,
        batches: usize,
    }

    impl PartialBatches {
        fn batch<K: Copy, V: Copy>(
            &mut self,
            items: &[(K, V)],
            put: fn(&mut FakeMaps, K, V) -> std::io::Result<()>,
        ) -> BatchResult {
            self.batches += 1;
            for (i, (k, v)) in items.iter().enumerate() {
                if i == self.stop_after {
                    return Err((i, std::io::Error::from_raw_os_error(libc::EIO)));
                }
                put(&mut self.inner, *k, *v).map_err(|e| (i, e))?;
            }
            Ok(())
        }
    }

    impl MapOps for PartialBatches {
        fn put_service(&mut self, key: ServiceKey, value: ServiceValue) -> std::io::Result<()> {
            self.inner.put_service(key, value)
        }
        fn del_service(&mut self, key: ServiceKey) -> std::io::Result<()> {
            self.inner.del_service(key)
        }
        fn put_slot(&mut self, index: u32, value: BackendSlot) -> std::io::Result<()> {
            self.inner.put_slot(index, value)
        }
        fn del_slot(&mut self, index: u32) -> std::io::Result<()> {
            self.inner.del_slot(index)
        }
        fn put_backend(&mut self, id: BackendId, backend: Backend) -> std::io::Result<()> {
            self.inner.put_backend(id, backend)
        }
        fn del_backend(&mut self, id: BackendId) -> std::io::Result<()> {
            self.inner.del_backend(id)
        }
        fn put_maglev(&mut self, set: u32, table: &[u32]) -> Result<(), MaglevWriteError> {
            self.inner.put_maglev(set, table)
        }
        fn del_maglev(&mut self, set: u32) -> std::io::Result<()> {
            self.inner.del_maglev(set)
        }
        fn get_maglev(&mut self, set: u32, size: u16) -> std::io::Result<Vec<u32>> {
            self.inner.get_maglev(set, size)
        }
        fn put_backends(&mut self, items: &[(BackendId, Backend)]) -> BatchResult {
            self.batch(items, FakeMaps::put_backend)
        }
        fn put_slots(&mut self, items: &[(u32, BackendSlot)]) -> BatchResult {
            self.batch(items, FakeMaps::put_slot)
        }
        fn put_services(&mut self, items: &[(ServiceKey, ServiceValue)]) -> BatchResult {
            self.batch(items, FakeMaps::put_service)
        }
    }

    #[test]
    fn id_sets_hand_out_the_lowest_free_id() {
        let mut ids = IdSet::default();
        let handed: Vec<u32> = (0..130)
            .map(|_| {
                let id = ids.lowest_free();
                ids.insert(id);
                id
            })
            .collect();
        assert_eq!(handed, (1..=130).collect::<Vec<u32>>());
        for id in [127, 64, 3] {
            ids.remove(&id);
            assert!(!ids.contains(id));
        }
        for want in [3, 64, 127, 131] {
            let id = ids.lowest_free();
            assert_eq!(id, want);
            ids.insert(id);
        }
        // One an earlier writer left far above the dense range.
        ids.insert(u32::MAX - 1);
        assert!(ids.contains(u32::MAX - 1) && !ids.contains(u32::MAX));
        assert_eq!(ids.lowest_free(), 132);
        ids.remove(&(u32::MAX - 1));
        assert!(!ids.contains(u32::MAX - 1));
        assert_eq!(ids.words.len(), 3, "no bit for the far id");
    }

    #[test]
    fn batches_that_stop_part_way_are_finished_one_by_one() {
        let frontends: Vec<(Frontend, FrontendState)> = (0..5u8)
            .map(|i| {
                let backends: Vec<BackendAddr> = (1..=3u8)
                    .map(|j| be(&format!("10.244.{i}.{j}"), 8080))
                    .collect();
                (
                    fe(&format!("10.96.0.{}", 10 + i), 80),
                    state(&format!("s{i}"), &backends),
                )
            })
            .collect();
        let d = desired(&frontends);
        for stop_after in [0, 1, 4, 7, 100] {
            let mut r = Reconciler::test();
            let mut m = PartialBatches {
                inner: FakeMaps::default(),
                stop_after,
                batches: 0,
            };
            let report = r.apply(&d, &mut m);
            assert!(report.errors.is_empty(), "{:?}", report.errors);
            let chunks = frontends.len().div_ceil(FRONTEND_CHUNK);
            assert_eq!(
                m.batches,
                2 + 2 * chunks,
                "backends and VIP markers: one batch each; slots and services: one per chunk"
            );
            assert_eq!((report.frontends_written, report.backends_written), (5, 15));
            for (f, s) in &frontends {
                let want: Vec<BackendAddr> = s.active.iter().map(|b| b.backend).collect();
                assert_eq!(m.inner.backends_of(f), want, "stop_after {stop_after}");
            }
            // And a second apply writes nothing.
            let before = m.inner.writes;
            let report = r.apply(&d, &mut m);
            assert_eq!(report.frontends_written, 0);
            assert_eq!(m.inner.writes, before);
        }
    }

    /// The maps as a connect sees them, without ids: per frontend key its
    /// value's counts and flags and the backends its slots resolve to.
    fn observed(m: &FakeMaps) -> Vec<String> {
        let show = |b: &Backend| format!("{:?}:{}:{}", &b.addr[12..], b.port, b.flags);
        let mut out: Vec<String> = m
            .services
            .iter()
            .map(|(k, v)| {
                let mut backends: Vec<String> = (0..(v.active + v.terminating) as u32)
                    .map(|slot| show(&m.backend_in(v, slot)))
                    .collect();
                if lb_common::select::uses_maglev(v) {
                    backends.extend(
                        m.maglev[&v.backend_set]
                            .iter()
                            .map(|id| show(&m.backends[&BackendId { id: *id }])),
                    );
                }
                format!(
                    "{:?}:{} {}/{} f{} a{} {}",
                    &k.addr[12..],
                    k.port,
                    v.active,
                    v.terminating,
                    v.flags,
                    v.affinity_timeout,
                    backends.join(",")
                )
            })
            .collect();
        out.sort();
        out.push(format!("backends {}", m.backends.len()));
        out.push(format!("slots {}", m.slots.len()));
        out.push(format!("tables {}", m.maglev.len()));
        out
    }

    /// Random changes to a few frontends at a time: looking only at the
    /// touched ones programs exactly what the full comparison does.
    #[test]
    fn apply_touched_equals_apply() {
        let frontends: Vec<Frontend> = (1..=4)
            .flat_map(|i| {
                [
                    fe(&format!("10.96.0.{i}"), 80),
                    fe(&format!("10.96.0.{i}"), 81),
                ]
            })
            .collect();
        let backends: Vec<BackendAddr> =
            (1..=5).map(|i| be(&format!("10.1.0.{i}"), 8080)).collect();
        for seed in 1..=30u64 {
            let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            let mut below = |n: usize| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % n as u64) as usize
            };
            let (mut full, mut partial) = (Reconciler::test(), Reconciler::test());
            let (mut mf, mut mp) = (FakeMaps::default(), FakeMaps::default());
            let mut d = DesiredState::default();
            for step in 0..40 {
                let mut touched = BTreeSet::new();
                for _ in 0..=below(2) {
                    let f = frontends[below(frontends.len())];
                    touched.insert(f);
                    if below(4) == 0 {
                        d.frontends.remove(&f);
                        continue;
                    }
                    let mut st = state("svc", &[]);
                    for b in &backends {
                        let r = BackendRef {
                            backend: *b,
                            local: below(2) == 0,
                        };
                        match below(4) {
                            0 | 1 => st.active.push(r),
                            2 => st.terminating.push(r),
                            _ => {}
                        }
                    }
                    if below(3) == 0 {
                        st.algorithm = Algorithm::Maglev;
                    }
                    if below(3) == 0 {
                        st.affinity_timeout = Some(60);
                    }
                    d.frontends.insert(f, st.into());
                }
                d.vips = d.frontends.keys().map(|f| (f.addr, f.scope)).collect();
                let a = full.apply(&d, &mut mf);
                let b = partial.apply_touched(&d, &touched, &mut mp);
                assert!(a.errors.is_empty() && b.errors.is_empty());
                assert_eq!(
                    (a.frontends_written, a.frontends_removed, a.backends_written),
                    (b.frontends_written, b.frontends_removed, b.backends_written),
                    "seed {seed} step {step}: report"
                );
                assert_eq!(a.stale_udp, b.stale_udp);
                assert!(retire_all(&mut full, &mut mf).is_empty());
                assert!(retire_all(&mut partial, &mut mp).is_empty());
                assert_eq!(observed(&mf), observed(&mp), "seed {seed} step {step}");
            }
        }
    }

    #[test]
    fn apply_touched_after_a_failure_compares_everything() {
        let (f1, f2) = (fe("10.96.0.1", 80), fe("10.96.0.2", 80));
        let mut r = Reconciler::test();
        let mut m = FakeMaps {
            slot_capacity: Some(1),
            ..Default::default()
        };
        let d = desired(&[
            (f1, state("a", &[be("10.1.0.1", 80)])),
            (f2, state("b", &[be("10.1.0.2", 80)])),
        ]);
        let report = r.apply_touched(&d, &BTreeSet::new(), &mut m);
        assert_eq!(report.errors.len(), 1, "{report:?}");
        // Room again; nothing reported as touched, yet the failed one is
        // written because the last apply failed.
        m.slot_capacity = None;
        let report = r.apply_touched(&d, &BTreeSet::new(), &mut m);
        assert!(report.errors.is_empty(), "{report:?}");
        assert_eq!(report.frontends_written, 1);
        assert_eq!(m.services.len(), 4);
        // Now in step: an empty touched set writes nothing.
        let report = r.apply_touched(&d, &BTreeSet::new(), &mut m);
        assert_eq!(report, SyncReport::default());
    }

    fn maglev(mut s: FrontendState) -> FrontendState {
        s.algorithm = Algorithm::Maglev;
        s
    }

    fn unprogrammed_of(r: &Reconciler) -> Vec<(Target, u32, i32, bool, String)> {
        r.unprogrammed()
            .map(|u| (u.target, u.map, u.errno, u.kept, u.service.to_string()))
            .collect()
    }

    /// Each way one frontend's writes can fail, for a changed frontend and
    /// a new one: the changed one keeps its previous state whole, nothing
    /// of the new one is written but its VIP marker, nothing is left
    /// behind once retired, the other frontends are untouched, the failure
    /// is recorded with its Service; once there is room, the next apply
    /// programs both.
    #[test]
    fn a_frontend_that_cannot_be_written_is_left_as_it_was() {
        use lb_common::unprogrammed_map::*;
        type Squeeze = fn(&mut FakeMaps);
        let cases: [(&str, Squeeze, u32, i32); 5] = [
            (
                "LB_SERVICES full",
                |m| m.service_capacity = Some(m.services.len()),
                SERVICES,
                libc::E2BIG,
            ),
            (
                "LB_SLOTS full",
                |m| m.slot_capacity = Some(m.slots.len()),
                SLOTS,
                libc::E2BIG,
            ),
            (
                "LB_BACKENDS full",
                |m| m.backend_capacity = Some(m.backends.len()),
                BACKENDS,
                libc::E2BIG,
            ),
            (
                "LB_MAGLEV full",
                |m| m.maglev_capacity = Some(m.maglev.len()),
                MAGLEV,
                libc::E2BIG,
            ),
            (
                "no memory for a table",
                |m| m.no_table_memory = true,
                MAGLEV_TABLE,
                libc::ENOMEM,
            ),
        ];
        let (changed, other, new) = (
            fe("10.96.0.10", 80),
            fe("10.96.0.11", 80),
            fe("10.96.0.12", 80),
        );
        let old = [be("10.244.1.1", 80), be("10.244.1.2", 80)];
        let grown = [old[0], old[1], be("10.244.1.3", 80)];
        let theirs = [be("10.244.2.1", 80), be("10.244.2.2", 80)];
        let d1 = desired(&[
            (changed, maglev(state("changed", &old))),
            (other, state("other", &[be("10.244.9.9", 80)])),
        ]);
        let d2 = desired(&[
            (changed, maglev(state("changed", &grown))),
            (other, state("other", &[be("10.244.9.9", 80)])),
            (new, maglev(state("new", &theirs))),
        ]);
        for (what, squeeze, map, errno) in cases {
            let mut r = Reconciler::test();
            let mut m = FakeMaps::default();
            sync(&mut r, &d1, &mut m);
            let before = observed(&m);
            let table_before = m.table_of(&changed);
            squeeze(&mut m);
            let report = r.apply(&d2, &mut m);
            assert!(retire_all(&mut r, &mut m).is_empty(), "{what}");
            // A full LB_SERVICES still takes the changed value: it
            // replaces an entry in place.
            let changed_fails = map != SERVICES;
            let mut want = vec![(
                Target::Frontend(new),
                map,
                errno,
                false,
                "default/new".into(),
            )];
            if changed_fails {
                want.insert(
                    0,
                    (
                        Target::Frontend(changed),
                        map,
                        errno,
                        true,
                        "default/changed".into(),
                    ),
                );
                // Everything as before but the new VIP's marker (below).
                let now: Vec<String> = observed(&m)
                    .into_iter()
                    .filter(|l| !l.starts_with("[10, 96, 0, 12]:0 "))
                    .collect();
                assert_eq!(now, before, "{what}: something was left");
                assert_eq!(m.table_of(&changed), table_before, "{what}");
            } else {
                assert_eq!(m.backends_of(&changed), grown, "{what}");
                // The new Service's VIP marker did not fit either.
                want.push((
                    Target::Vip(new.addr, new.scope),
                    map,
                    errno,
                    false,
                    "default/new".into(),
                ));
            }
            assert_eq!(unprogrammed_of(&r), want, "{what}");
            let about_services = report.errors.iter().filter(|e| e.starts_with("Service "));
            assert_eq!(
                about_services.count(),
                want.len(),
                "{what}: {:?}",
                report.errors
            );
            assert!(
                report
                    .errors
                    .iter()
                    .any(|e| e.contains("Service default/new")
                        && e.contains("10.96.0.12:80/TCP")
                        && e.contains(NAMES[map as usize])),
                "{what}: {:?}",
                report.errors
            );
            assert!(!m.services.contains_key(&service_key(&new)), "{what}");
            // The VIP marker of a Service with nothing programmed: written
            // where it fits, so that its connects are refused.
            assert_eq!(
                m.services.contains_key(&vip_key(new.addr, new.scope)),
                changed_fails,
                "{what}: the VIP marker of a Service with nothing programmed"
            );
            assert_eq!(m.backends_of(&other), [be("10.244.9.9", 80)], "{what}");
            // Room again: the next apply (everything compared, as after
            // any failure) programs both.
            m.service_capacity = None;
            m.slot_capacity = None;
            m.backend_capacity = None;
            m.maglev_capacity = None;
            m.no_table_memory = false;
            let report = r.apply_touched(&d2, &BTreeSet::new(), &mut m);
            assert!(report.errors.is_empty(), "{what}: {:?}", report.errors);
            assert!(retire_all(&mut r, &mut m).is_empty());
            assert_eq!(m.backends_of(&changed), grown, "{what}");
            assert_eq!(m.backends_of(&new), theirs, "{what}");
            assert_eq!(m.table_of(&new).len(), 251);
            assert!(m.services.contains_key(&vip_key(new.addr, new.scope)));
            assert!(unprogrammed_of(&r).is_empty(), "{what}");
            assert_eq!(m.maglev.len(), 2, "{what}");
        }
    }

    /// Fail closed: a Service none of whose ports fits still gets its VIP
    /// marker, which refuses its connects instead of letting them leave
    /// unrewritten; the marker is written once and stays when a port of
    /// it fits later.
    #[test]
    fn a_service_that_does_not_fit_gets_its_vip_marker() {
        let mut r = Reconciler::test();
        let mut m = FakeMaps {
            slot_capacity: Some(1),
            ..Default::default()
        };
        let big = fe("10.96.0.20", 80);
        let many = [be("10.244.1.1", 80), be("10.244.1.2", 80)];
        let vip = vip_key(big.addr, big.scope);
        let report = sync(&mut r, &desired(&[(big, state("big", &many))]), &mut m);
        assert_eq!(report.errors.len(), 1, "{report:?}");
        assert_eq!(m.services.len(), 1, "{:?}", m.services);
        assert_eq!(m.services[&vip].flags, service_flags::WILDCARD);
        // A second port, without endpoints: it fits beside the marker.
        let empty = fe("10.96.0.20", 81);
        let d = desired(&[(big, state("big", &many)), (empty, state("big", &[]))]);
        sync(&mut r, &d, &mut m);
        assert!(m.services.contains_key(&service_key(&empty)));
        assert_eq!(m.services[&vip].flags, service_flags::WILDCARD);
        assert_eq!(unprogrammed_of(&r).len(), 1);
        // Gone from the desired state: no longer reported.
        sync(&mut r, &desired(&[(empty, state("big", &[]))]), &mut m);
        assert!(unprogrammed_of(&r).is_empty());
        assert!(m.services.contains_key(&vip));
    }

    /// `LB_SERVICES` filled by frontends keeps room for every VIP's
    /// marker: of five one-port Services in a map of 8 entries, three are
    /// programmed (3 frontends + 5 markers), the other two are refused by
    /// their markers and reported full; room made programs them.
    #[test]
    fn frontends_leave_room_for_every_vip_marker() {
        let mut r = Reconciler::test().with_service_capacity(8);
        let mut m = FakeMaps {
            service_capacity: Some(8),
            ..Default::default()
        };
        let fes: Vec<Frontend> = (0..5)
            .map(|i| fe(&format!("10.96.0.{}", 10 + i), 80))
            .collect();
        let names: Vec<String> = (0..5).map(|i| format!("s{i}")).collect();
        let d = desired(
            &fes.iter()
                .zip(&names)
                .map(|(f, n)| (*f, state(n, &[be("10.244.1.1", 80)])))
                .collect::<Vec<_>>(),
        );
        let report = sync(&mut r, &d, &mut m);
        assert_eq!(report.errors.len(), 2, "{report:?}");
        for f in &fes {
            assert!(m.services.contains_key(&vip_key(f.addr, f.scope)), "{f:?}");
        }
        let programmed = fes
            .iter()
            .filter(|f| m.services.contains_key(&service_key(f)))
            .count();
        assert_eq!((programmed, m.services.len()), (3, 8));
        let failed = unprogrammed_of(&r);
        assert_eq!(failed.len(), 2, "{failed:?}");
        for (target, map, errno, kept, _) in &failed {
            assert!(matches!(target, Target::Frontend(_)), "{target:?}");
            assert_eq!(
                (*map, *errno, *kept),
                (unprogrammed_map::SERVICES, libc::E2BIG, false)
            );
        }
        // Two programmed Services go: the two left out fit.
        let (out, mut keep): (Vec<_>, Vec<_>) = d
            .frontends
            .iter()
            .map(|(f, s)| (*f, (**s).clone()))
            .partition(|(f, _)| !m.services.contains_key(&service_key(f)));
        keep.truncate(1);
        let d2 = desired(&[out, keep].concat());
        let report = sync(&mut r, &d2, &mut m);
        assert!(report.errors.is_empty(), "{report:?}");
        assert!(unprogrammed_of(&r).is_empty());
        assert_eq!(m.services.len(), 6);
    }

    /// A change that did not fit, then taken back: programmed as desired
    /// again, so no longer reported.
    #[test]
    fn a_failed_change_taken_back_is_no_longer_reported() {
        let mut r = Reconciler::test();
        let mut m = FakeMaps {
            slot_capacity: Some(2),
            ..Default::default()
        };
        let a = fe("10.96.0.10", 80);
        let one = desired(&[(a, state("a", &[be("10.244.1.1", 80)]))]);
        sync(&mut r, &one, &mut m);
        let three: Vec<BackendAddr> = (1..=3).map(|i| be(&format!("10.244.1.{i}"), 80)).collect();
        sync(&mut r, &desired(&[(a, state("a", &three))]), &mut m);
        assert_eq!(unprogrammed_of(&r).len(), 1);
        let report = sync(&mut r, &one, &mut m);
        assert_eq!(report, SyncReport::default());
        assert!(unprogrammed_of(&r).is_empty());
    }

    /// Frontends that go make room for those that come within one apply.
    #[test]
    fn removed_frontends_make_room_in_the_same_apply() {
        let mut r = Reconciler::test();
        // One frontend and its VIP marker.
        let mut m = FakeMaps {
            service_capacity: Some(2),
            ..Default::default()
        };
        let (a, b) = (fe("10.96.0.10", 80), fe("10.96.0.10", 81));
        sync(
            &mut r,
            &desired(&[(a, state("a", &[be("10.244.1.1", 80)]))]),
            &mut m,
        );
        let report = sync(
            &mut r,
            &desired(&[(b, state("a", &[be("10.244.1.1", 80)]))]),
            &mut m,
        );
        assert!(report.errors.is_empty(), "{report:?}");
        assert_eq!(m.backends_of(&b), [be("10.244.1.1", 80)]);
    }

    /// Slots and tables are freed only by `retire`: then, and only when
    /// what it deleted belonged to a replaced or removed frontend, it says
    /// that a retry may fit.
    #[test]
    fn a_retire_that_makes_room_calls_for_a_retry() {
        let mut r = Reconciler::test();
        let mut m = FakeMaps {
            slot_capacity: Some(3),
            ..Default::default()
        };
        let (a, b) = (fe("10.96.0.10", 80), fe("10.96.0.11", 80));
        let two = |n: u8| {
            [
                be(&format!("10.244.{n}.1"), 80),
                be(&format!("10.244.{n}.2"), 80),
            ]
        };
        sync(&mut r, &desired(&[(a, state("a", &two(1)))]), &mut m);
        let both = desired(&[(a, state("a", &two(1))), (b, state("b", &two(2)))]);
        let report = r.apply(&both, &mut m);
        assert_eq!(report.errors.len(), 1, "{report:?}");
        // Only the failed attempt's leftovers: nothing to retry for.
        assert!(retire_all(&mut r, &mut m).is_empty());
        assert!(!r.room_made());
        let report = r.apply(&desired(&[(b, state("b", &two(2)))]), &mut m);
        assert_eq!(report.frontends_removed, 1);
        assert_eq!(report.errors.len(), 1, "a's slots are not free yet");
        assert!(retire_all(&mut r, &mut m).is_empty());
        assert!(r.room_made());
        assert!(!r.room_made(), "said once");
        let report = r.apply_touched(
            &desired(&[(b, state("b", &two(2)))]),
            &BTreeSet::new(),
            &mut m,
        );
        assert!(report.errors.is_empty(), "{report:?}");
        assert_eq!(m.backends_of(&b), two(2));
    }

    /// A restarted agent adopts the pinned Maglev tables after reading
    /// each back: unchanged ones cost no write, a table that differs from
    /// the one wanted (another table size, an older algorithm, a damaged
    /// map) is replaced.
    #[test]
    fn adopted_maglev_tables_are_checked() {
        let mut m = FakeMaps::default();
        let (a, b) = (fe("10.96.0.10", 80), fe("10.96.0.11", 80));
        let d = desired(&[
            (
                a,
                maglev(state("a", &[be("10.244.1.1", 80), be("10.244.1.2", 80)])),
            ),
            (
                b,
                maglev(state("b", &[be("10.244.2.1", 80), be("10.244.2.2", 80)])),
            ),
        ]);
        sync(&mut Reconciler::test(), &d, &mut m);
        let want = observed(&m);
        let mut r = adopt_from(&m);
        let writes = m.writes;
        let report = sync(&mut r, &d, &mut m);
        assert_eq!((report.frontends_adopted, report.frontends_written), (2, 0));
        assert_eq!(m.writes, writes);
        // Damage `b`'s table: two positions swapped.
        let set = m.services[&service_key(&b)].backend_set;
        let table = m.maglev.get_mut(&set).unwrap();
        let i = table.iter().position(|id| *id != table[0]).unwrap();
        table.swap(0, i);
        let mut r = adopt_from(&m);
        let report = sync(&mut r, &d, &mut m);
        assert_eq!((report.frontends_adopted, report.frontends_written), (1, 1));
        assert_eq!(observed(&m), want);
    }

    /// Pinned maps where a Maglev frontend's table is missing (taken out
    /// by hand) and `LB_SLOTS` holds elements no frontend names (a crash
    /// between a set's write and its publication): the first apply writes
    /// the frontend afresh with its table, and the retire clears every
    /// stray element; the other frontends are adopted as they are.
    #[test]
    fn a_missing_table_and_stray_slots_are_repaired_at_adoption() {
        let mut m = FakeMaps::default();
        let (a, b) = (fe("10.96.0.10", 80), fe("10.96.0.11", 80));
        let d = desired(&[
            (
                a,
                maglev(state("a", &[be("10.244.1.1", 80), be("10.244.1.2", 80)])),
            ),
            (b, state("b", &[be("10.244.2.1", 80)])),
        ]);
        sync(&mut Reconciler::test(), &d, &mut m);
        let want = observed(&m);
        m.unchecked = true;
        let v = m.services[&service_key(&a)];
        for (i, id) in m
            .maglev
            .remove(&v.backend_set)
            .unwrap()
            .into_iter()
            .enumerate()
        {
            let (index, slot) = slot_item(v.backend_set + 100, 1000, i as u32, id);
            m.slots.insert(index, slot);
        }
        assert_eq!(m.slots.len(), 3 + 251);
        m.unchecked = false;
        m.tables_may_be_missing = true;
        let mut r = adopt_from(&m);
        let report = sync(&mut r, &d, &mut m);
        assert_eq!((report.frontends_adopted, report.frontends_written), (1, 1));
        assert_eq!(observed(&m), want);
        assert_eq!(m.slots.len(), 3);
        m.tables_may_be_missing = false;
        m.check();
    }

    /// 10 000 Maglev Services (one port, three endpoints each) fit the
    /// default capacities, and so does replacing every one of their
    /// tables in one sync (old and new coexist until the retire). The
    /// table size does not change how many entries any map needs, so a
    /// small one keeps the test quick; at the default 16 381 positions the
    /// tables take 10 000 × 16 381 × 4 B ≈ 625 MiB of kernel memory.
    #[test]
    fn ten_thousand_maglev_services_fit_at_default_capacities() {
        use lb_common::capacity;
        let mut m = FakeMaps {
            service_capacity: Some(capacity::SERVICES as usize),
            slot_capacity: Some(capacity::SLOTS as usize),
            backend_capacity: Some(capacity::BACKENDS as usize),
            maglev_capacity: Some(capacity::MAGLEV as usize),
            // The check after every write would be quadratic here.
            unchecked: true,
            ..Default::default()
        };
        let services = |generation: u16| -> DesiredState {
            let entries: Vec<(Frontend, FrontendState)> = (0..10_000u32)
                .map(|i| {
                    let vip = format!("10.96.{}.{}", i / 250, i % 250 + 1);
                    let pods: Vec<BackendAddr> = (0..3u32)
                        .map(|j| {
                            let n = i * 3 + j;
                            let pod =
                                format!("10.{}.{}.{}", 100 + n / 65_536, n / 256 % 256, n % 256);
                            be(&pod, 8080 + generation)
                        })
                        .collect();
                    (fe(&vip, 80), maglev(state(&format!("s{i}"), &pods)))
                })
                .collect();
            desired(&entries)
        };
        let mut r = Reconciler::test();
        let report = r.apply(&services(0), &mut m);
        assert!(
            report.errors.is_empty(),
            "{:?}",
            &report.errors[..3.min(report.errors.len())]
        );
        assert_eq!(report.frontends_written, 10_000);
        assert!(retire_all(&mut r, &mut m).is_empty());
        // Every endpoint changes at once.
        let report = r.apply(&services(1), &mut m);
        assert!(
            report.errors.is_empty(),
            "{:?}",
            &report.errors[..3.min(report.errors.len())]
        );
        assert_eq!(
            m.maglev.len(),
            20_000,
            "old and new tables, until the retire"
        );
        let usage = r.usage();
        assert_eq!((usage.maglev_tables, usage.slots), (20_000, 60_000));
        assert!(retire_all(&mut r, &mut m).is_empty());
        assert_eq!(
            (m.maglev.len(), m.slots.len(), m.backends.len()),
            (10_000, 30_000, 30_000)
        );
        assert_eq!(m.services.len(), 20_000, "frontends and VIP markers");
        m.unchecked = false;
        m.check();
        assert!(unprogrammed_of(&r).is_empty());
    }
}
