//! The maps every hook shares. Layouts live in `lb-common`; the capacities
//! here are defaults the agent overrides at load time.
use aya_ebpf::{
    bindings::{BPF_F_INNER_MAP, BPF_F_MMAPABLE, BPF_F_NO_PREALLOC},
    btf_maps::{Array, HashMap, HashOfMaps, LpmTrie, LruHashMap, PerCpuArray, SkStorage},
    macros::btf_map,
};
use lb_common::{
    capacity, stat, AffinityEntry, AffinityKey, Backend, BackendHealth, BackendSlot, BackendState,
    CtEntry, CtKey, DatagramFlow, DatagramFlowKey, FragEntry, FragKey, FrontendState, MaglevEntry,
    PortBits, ReverseSockKey, ReverseSockValue, ServiceKey, ServiceRanges, ServiceValue, SockDraw,
    SockPeerEntry, SockSourceCheck, SourceRangeData, TcConfig, Unprogrammed,
};

#[btf_map]
pub static LB_SERVICES: HashMap<ServiceKey, ServiceValue, { capacity::SERVICES as usize }> =
    HashMap::new();

/// Backend sets, each a range of slots from `ServiceValue::slot_base`: an
/// array, so that a lookup is inlined by the verifier, not a hash walk
/// (Katran's `ch_rings`). Mappable: the agent writes it as memory.
#[btf_map]
pub static LB_SLOTS: Array<BackendSlot, { capacity::SLOTS as usize }, { BPF_F_MMAPABLE as usize }> =
    Array::new();

/// One Maglev table: 64 positions an element (see `MaglevEntry`). The
/// agent creates one per Maglev frontend, as long as its `maglev_size`
/// needs; `BPF_F_INNER_MAP` lets each have its own length (this template's
/// is never used).
pub type MaglevTable = Array<MaglevEntry, 1, { BPF_F_INNER_MAP as usize }>;

/// The Maglev tables by `ServiceValue::backend_set`.
#[btf_map]
pub static LB_MAGLEV: HashOfMaps<u32, MaglevTable, { capacity::MAGLEV as usize }> =
    HashOfMaps::new();

/// Frontends the agent could not program, for `lb-agent inspect`; no
/// program reads it. Declared here so that it is created, sized and pinned
/// with the others, with BTF for `bpftool map dump`.
#[btf_map]
pub static LB_UNPROGRAMMED: HashMap<
    ServiceKey,
    Unprogrammed,
    { capacity::UNPROGRAMMED as usize },
    { BPF_F_NO_PREALLOC as usize },
> = HashMap::new();

/// Backends by `BackendId`: an array, so that a lookup is the few
/// instructions the verifier inlines, not a hash walk (Katran's `reals`).
/// Mappable: the agent writes it as memory.
#[btf_map]
pub static LB_BACKENDS: Array<
    Backend,
    { capacity::BACKENDS as usize },
    { BPF_F_MMAPABLE as usize },
> = Array::new();

#[btf_map]
pub static LB_REV_SOCK: LruHashMap<
    ReverseSockKey,
    ReverseSockValue,
    { capacity::REV_SOCK as usize },
> = LruHashMap::new();

/// Each CPU's state for `select::draw`, the sockets' random backend
/// choice, and this node's secret (`SockDraw`): seeded by the agent from
/// the OS's random source when it creates the map, pinned, so a restart
/// keeps both. Two connects preempting each other on one CPU may take one
/// step twice; their cookies still tell their draws apart.
#[btf_map]
pub static LB_SOCK_DRAW: PerCpuArray<SockDraw, 1> = PerCpuArray::new();

/// This node's state of each backend (`BackendState`: its open
/// connections), by `BackendId`, for both paths. Mappable: the agent
/// reads it as memory for `inspect`.
#[btf_map]
pub static LB_BACKEND_STATE: Array<
    BackendState,
    { capacity::BACKENDS as usize },
    { BPF_F_MMAPABLE as usize },
> = Array::new();

/// Outlier detection's state of each backend (`BackendHealth`), by
/// `BackendId`: failed connects in a row and the quarantine, written by
/// `sock_ops` (and the tc path) under the element's lock, read by every
/// selection.
#[btf_map]
pub static LB_BACKEND_HEALTH: Array<BackendHealth, { capacity::BACKENDS as usize }> = Array::new();

/// This node's state of each frontend (`FrontendState`: the round-robin
/// cursor), by `ServiceId`.
#[btf_map]
pub static LB_FRONTEND_STATE: Array<FrontendState, { capacity::SERVICES as usize }> = Array::new();

/// Beside `LB_SOCK_PEER`, element for element: the backend id a socket's
/// open connection is counted for in `LB_BACKEND_STATE` (0: none), so
/// that `sock_release` takes it back.
#[btf_map]
pub static LB_SOCK_BACKEND: Array<u32, { capacity::SOCK_PEERS as usize }> = Array::new();

/// The reverse view of connected TCP sockets: an array of
/// `SockPeerEntry` by socket cookie (see `sock::PeerSlots`), written at
/// connect, freed by `sock_release` when the socket is closed.
#[btf_map]
pub static LB_SOCK_PEER: Array<SockPeerEntry, { capacity::SOCK_PEERS as usize }> = Array::new();

/// `LB_SOCK_PEER`'s length, which the agent sets at load (`--max-sock-peers`)
/// with the map's; read-only, so the verifier knows it.
#[unsafe(no_mangle)]
static SOCK_PEER_SLOTS: u32 = capacity::SOCK_PEERS;

#[inline(always)]
pub fn sock_peer_slots() -> u32 {
    // SAFETY: a read of a constant the loader may have rewritten; volatile
    // so that the compiler does not fold in the default.
    unsafe { core::ptr::read_volatile(&SOCK_PEER_SLOTS) }
}

/// Sockets whose packets `cgroup_egress` checks against
/// `LB_SOURCE_RANGES`, stored with the socket.
#[btf_map]
pub static LB_SOCK_CHECK: SkStorage<SockSourceCheck> = SkStorage::new();

/// Socket path: the backend of each UDP socket's flow to a frontend, so
/// that every datagram of an unconnected socket goes where its first went.
#[btf_map]
pub static LB_DGRAM_FLOWS: LruHashMap<
    DatagramFlowKey,
    DatagramFlow,
    { capacity::DGRAM_FLOWS as usize },
> = LruHashMap::new();

#[btf_map]
pub static LB_AFFINITY: LruHashMap<AffinityKey, AffinityEntry, { capacity::AFFINITY as usize }> =
    LruHashMap::new();

/// A conntrack table. Both tables have this one type so that the code that
/// follows a flow serves either; the agent sets each one's size at load
/// (`LB_CT_SYN` defaults to `capacity::CONNTRACK_SYN`).
pub type CtMap = LruHashMap<CtKey, CtEntry, { capacity::CONNTRACK as usize }>;

/// tc path: both directions of every established TCP flow and every UDP
/// flow.
#[btf_map]
pub static LB_CONNTRACK: CtMap = LruHashMap::new();

/// tc path: both directions of the TCP flows whose backend has not
/// answered yet. Kept apart so that a SYN flood, however large, evicts
/// only entries of its own kind and never an established flow.
#[btf_map]
pub static LB_CT_SYN: CtMap = LruHashMap::new();

/// tc path: `loadBalancerSourceRanges` per frontend.
#[btf_map]
pub static LB_SOURCE_RANGES: LpmTrie<SourceRangeData, u32, { capacity::SOURCE_RANGES as usize }> =
    LpmTrie::new();

/// tc path: the translation of fragmented datagrams, for their later
/// fragments (see `tc::frag`).
#[btf_map]
pub static LB_FRAGMENTS: LruHashMap<FragKey, FragEntry, { capacity::FRAGMENTS as usize }> =
    LruHashMap::new();

/// A set of TCP and UDP ports, a bit each (see `PortBits`).
pub type PortMap = Array<PortBits, { PortBits::ELEMENTS as usize }>;

/// tc path: the ports local backends serve on, which `tc_egress` checks
/// before anything else.
#[btf_map]
pub static LB_LOCAL_PORTS: PortMap = Array::new();

/// tc path: the ports frontends of `scope::EXTERNAL` listen on, which
/// `tc_ingress` checks before anything else.
#[btf_map]
pub static LB_FRONTEND_PORTS: PortMap = Array::new();

/// Whether `ports` (`LB_LOCAL_PORTS` or `LB_FRONTEND_PORTS`) marks `proto`'s
/// `port`.
#[inline(always)]
pub fn port_marked(ports: &PortMap, proto: u8, port: u16) -> bool {
    PortBits::index(proto, port)
        .and_then(|i| ports.get(i))
        .is_some_and(|e| e.has(port))
}

/// tc path: masquerade addresses and timeouts, written by the agent; the
/// socket path reads its UDP timeout (`LB_DGRAM_FLOWS`), and
/// `cgroup_egress` whether any frontend has source ranges.
#[btf_map]
pub static LB_TC_CONFIG: Array<TcConfig, 1> = Array::new();

/// 1 when the agent may guard Service CIDRs (`TcConfig::service_ranges`:
/// `--service-cluster-ip-range` given, or cluster mode, where `ServiceCIDR`
/// objects may name them), set at load; read-only, so with 0 the verifier
/// knows the check is never taken and removes it: a connect to no Service
/// then pays nothing for it, not even the `LB_TC_CONFIG` lookup. The
/// default (1) is what `lb-agent check` and the tests verify.
#[unsafe(no_mangle)]
static SERVICE_RANGE_GUARD: u32 = 1;

/// The guarded Service CIDRs, `None` when there are none (or none can be).
#[inline(always)]
pub fn guarded_ranges() -> Option<&'static ServiceRanges> {
    // SAFETY: a read of a constant the loader may have rewritten; volatile
    // so that the compiler does not fold in the default.
    if unsafe { core::ptr::read_volatile(&SERVICE_RANGE_GUARD) } == 0 {
        return None;
    }
    let ranges = &LB_TC_CONFIG.get(0)?.service_ranges;
    (ranges.len != 0).then_some(ranges)
}

/// tc path: the route epoch, moved by the agent whenever the node's
/// routes, neighbours, links or addresses change; a flow's cached next hop
/// (`CtEntry::hop`) is only good within the epoch it was found in.
#[btf_map]
pub static LB_ROUTE_EPOCH: Array<u32, 1> = Array::new();

#[btf_map]
pub static LB_STATS: PerCpuArray<u64, { stat::COUNT as usize }> = PerCpuArray::new();

/// This CPU's element of a one-element per-CPU scratch array: room for
/// values too large for the 512-byte BPF stack. Programs do not nest on one
/// CPU here, so the run that takes it has it to itself.
#[inline(always)]
pub fn this_cpu<T>(scratch: &'static PerCpuArray<T, 1>) -> Option<&'static mut T> {
    // SAFETY: one user per CPU at a time, as said above.
    scratch.get_ptr_mut(0).map(|p| unsafe { &mut *p })
}

#[inline(always)]
pub fn count(index: u32) {
    if let Some(counter) = LB_STATS.get_ptr_mut(index) {
        // SAFETY: a per-CPU slot is only touched by the program running on
        // that CPU, and programs do not nest within one CPU here.
        unsafe { *counter += 1 };
    }
}
