//! The map keys and values that the kernel programs (`lb-ebpf`) and the agent
//! (`lb-agent`) share: one definition of each, the way Cilium's `bpf/lib/lb.h`
//! is one header for every hook.
//!
//! Conventions, chosen so that `bpftool map dump` is readable as it is:
//! - addresses are `[u8; 16]` in network order; IPv4 is stored IPv4-mapped
//!   (`::ffff:a.b.c.d`), so one map serves both families and an IPv6 socket
//!   that connects to `::ffff:10.96.0.10` finds the IPv4 Service as it is;
//! - ports are in host order (`80` dumps as `80`), the kernel side swaps once;
//! - every struct is `#[repr(C)]` with explicit padding and a size asserted at
//!   compile time, so that both sides and the BTF agree byte for byte.
//!
//! The map design is described in `docs/maps.md`.
#![no_std]

/// IP protocol numbers as they appear in `ServiceKey::proto` and `Backend::proto`.
pub mod proto {
    pub const TCP: u8 = 6;
    pub const UDP: u8 = 17;
    /// Only in `LB_UNPROGRAMMED` keys: no program serves SCTP (the kernel
    /// runs no connect or sendmsg hook for SCTP sockets, and the tc path
    /// does not rewrite SCTP), so `LB_SERVICES` never holds it.
    pub const SCTP: u8 = 132;
}

/// Which clients a `ServiceKey` entry serves (Cilium's `LB_LOOKUP_SCOPE_*`).
/// The socket hooks see only in-cluster clients and look up `INTERNAL`; the tc
/// path sees traffic from outside the node and looks up `EXTERNAL`. A Service
/// whose traffic policies differ gets different backend sets in the two scopes.
pub mod scope {
    pub const INTERNAL: u8 = 0;
    pub const EXTERNAL: u8 = 1;
}

/// `ServiceValue::flags`.
pub mod service_flags {
    /// The entry only marks its address as a live Service VIP (port 0,
    /// protocol 0): a connect to a port the Service does not have is refused,
    /// as kube-proxy's REJECT rule does, instead of leaking towards the VIP.
    pub const WILDCARD: u16 = 1 << 0;
    /// `sessionAffinity: ClientIP`; the timeout is `affinity_timeout`.
    pub const AFFINITY: u16 = 1 << 1;
    /// Select through the Service's Maglev table instead of uniformly at random.
    pub const MAGLEV: u16 = 1 << 2;
    /// Set by the agent on an `EXTERNAL` frontend without backends because
    /// its Service has no usable endpoint anywhere (not merely none on this
    /// node): the tc path answers a TCP SYN with an RST and UDP with an ICMP
    /// port unreachable, as kube-proxy's REJECT rules do. Without it, an
    /// empty frontend (`externalTrafficPolicy: Local`, endpoints on other
    /// nodes only) drops.
    pub const REJECT: u16 = 1 << 3;
    /// Set by the agent on an `EXTERNAL` frontend on one of the node's own
    /// addresses (a NodePort). A TCP packet without SYN and without a flow
    /// to it is passed to the node's stack rather than dropped, as
    /// kube-proxy leaves it: netfilter's conntrack may hold its flow (one
    /// kube-proxy's rules NATed before the agent attached, while a node
    /// migrates), else the node answers with an RST. To other addresses
    /// (LoadBalancer IPs, externalIPs) it would be forwarded, so there it
    /// drops, as kube-proxy's `KUBE-FORWARD` drops INVALID.
    pub const NODE_ADDRESS: u16 = 1 << 4;
    /// Set by the agent on a LoadBalancer frontend (either scope) whose
    /// Service has `loadBalancerSourceRanges` of the frontend's family:
    /// `LB_SOURCE_RANGES` decides who may use it. The socket path needs to
    /// know before it can see the source (the kernel picks it after
    /// connect), so it marks the socket for `cgroup_egress` (see
    /// `SockSourceCheck`); the tc path looks the trie up for every new flow.
    pub const SOURCE_RANGES: u16 = 1 << 5;
    /// Outlier detection watches this frontend's TCP connects from the
    /// socket path (`sock_ops`) and its forwarded SYNs on the tc path:
    /// their failures count toward quarantining the backend
    /// (`BackendHealth`). Set under `--outlier-detection on` and
    /// `dry-run`, unless the Service's annotation turns it off.
    pub const OUTLIER_DETECT: u16 = 1 << 6;
    /// New flows to this frontend avoid quarantined backends. Set under
    /// `--outlier-detection on` only (dry-run detects and reports).
    pub const OUTLIER_AVOID: u16 = 1 << 7;
    /// Bits 8..12: the frontend's scheduler, one of `algorithm::*`
    /// (`ServiceValue::algorithm`). 0 is random, what every value an
    /// earlier agent wrote says (its Maglev frontends carry `MAGLEV`).
    pub const ALGORITHM: u16 = 0xf << 8;
}

/// How a frontend chooses a backend for a new flow: the value of
/// `service_flags::ALGORITHM` (`ServiceValue::algorithm`). `rr`, `lc`,
/// `dh`, `sh`, `sed` and `nq` are the ipvs mode's schedulers (the
/// kernel's `net/netfilter/ipvs/ip_vs_*.c`), every weight 1.
pub mod algorithm {
    /// Uniformly at random (kube-proxy's iptables and nftables modes).
    pub const RANDOM: u8 = 0;
    /// Through the frontend's Maglev table, by the flow's hash.
    pub const MAGLEV: u8 = 1;
    /// Round-robin: one cursor per frontend (`FrontendState::rr_cursor`),
    /// stepped under its lock by every CPU, so each turn is taken once.
    pub const RR: u8 = 2;
    /// Least connection: the backend with the fewest open connections
    /// from this node (`BackendState::open`), ties at random.
    pub const LC: u8 = 3;
    /// Destination hashing: the frontend's address and port through its
    /// Maglev table, so one frontend's connections go to one backend.
    pub const DH: u8 = 4;
    /// Source hashing: the client through the frontend's Maglev table
    /// (the pod's network namespace on the socket path, the source
    /// address on the tc path).
    pub const SH: u8 = 5;
    /// Shortest expected delay: fewest `open + 1` (IPVS's
    /// `ip_vs_sed_dest_overhead`); with every weight 1 it chooses as
    /// `LC` does.
    pub const SED: u8 = 6;
    /// Never queue: an idle backend if any, else as `SED`; with every
    /// weight 1 it chooses as `LC` does.
    pub const NQ: u8 = 7;
    /// Names by value, as `--algorithm` and the annotation spell them.
    pub const NAMES: [&str; 8] = ["random", "maglev", "rr", "lc", "dh", "sh", "sed", "nq"];

    /// The flags bits of `algorithm`.
    #[inline(always)]
    pub const fn flags(algorithm: u8) -> u16 {
        ((algorithm as u16) << 8) & super::service_flags::ALGORITHM
    }

    /// Whether `algorithm` selects through a Maglev table.
    #[inline(always)]
    pub const fn uses_table(algorithm: u8) -> bool {
        matches!(algorithm, MAGLEV | DH | SH)
    }

    /// Whether `algorithm` chooses by the backends' open connections.
    #[inline(always)]
    pub const fn counts(algorithm: u8) -> bool {
        matches!(algorithm, LC | SED | NQ)
    }

    /// `counts` as 1 or 0, without a branch: the kernel programs mark a
    /// flow with it, and a branch there has the verifier walk what follows
    /// once per outcome.
    #[inline(always)]
    pub const fn counts_bit(algorithm: u8) -> u32 {
        const COUNTING: u32 = 1 << LC | 1 << SED | 1 << NQ;
        (COUNTING >> (algorithm & 7)) & 1
    }
}

#[cfg(test)]
#[test]
fn counts_bit_is_counts() {
    for a in 0..8 {
        assert_eq!(algorithm::counts_bit(a) == 1, algorithm::counts(a), "{a}");
    }
}

/// `Backend::flags`.
pub mod backend_flags {
    /// The backend runs on this node (traffic policy `Local`, hairpin, health checks).
    pub const LOCAL: u8 = 1 << 0;
    /// The endpoint is serving but terminating (KEP-1669).
    pub const TERMINATING: u8 = 1 << 1;
}

/// An IPv4 address as it is stored in the 16-byte address fields.
pub const fn ipv4_mapped(octets: [u8; 4]) -> [u8; 16] {
    [
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, octets[0], octets[1], octets[2], octets[3],
    ]
}

/// Whether a 16-byte address is an IPv4-mapped one (`::ffff:a.b.c.d`).
pub fn is_ipv4_mapped(addr: &[u8; 16]) -> bool {
    addr[..10].iter().all(|b| *b == 0) && addr[10] == 0xff && addr[11] == 0xff
}

/// A Service frontend: what a client addresses. Key of `LB_SERVICES`.
///
/// | offset | field   | meaning                                            |
/// |--------|---------|----------------------------------------------------|
/// | 0      | `addr`  | VIP, node address or ingress IP; IPv4 is mapped    |
/// | 16     | `port`  | host order; 0 in a `WILDCARD` entry                 |
/// | 18     | `proto` | `proto::TCP` or `proto::UDP`; 0 in a `WILDCARD` entry; `proto::SCTP` in `LB_UNPROGRAMMED` only |
/// | 19     | `scope` | `scope::INTERNAL` or `scope::EXTERNAL`              |
///
/// Aligned to 4 bytes (its size is unchanged), so that `key_check` reads
/// the address as four 32-bit words (`addr_words`), not sixteen bytes.
#[repr(C, align(4))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceKey {
    pub addr: [u8; 16],
    pub port: u16,
    pub proto: u8,
    pub scope: u8,
}

impl ServiceKey {
    /// The entry that marks `addr` as a live VIP in `scope`.
    pub const fn wildcard(addr: [u8; 16], scope: u8) -> Self {
        Self {
            addr,
            port: 0,
            proto: 0,
            scope,
        }
    }
}

/// What a frontend resolves to. Value of `LB_SERVICES`.
///
/// The backends of a frontend are a range of `LB_SLOTS`, an array: elements
/// `slot_base..slot_base + active` hold the active backends,
/// `slot_base + active..slot_base + active + terminating` the
/// serving-but-terminating ones, chosen only while `active` is 0. Each
/// element carries the `KeyCheck` of its `BackendSlotKey` (`backend_set`,
/// position in the set), so a program never takes an element written for
/// another set. A Maglev frontend's lookup table is an array of its own,
/// `LB_MAGLEV[backend_set]`: `maglev_size` positions, each holding the
/// backend id for that position. A new backend set (and table) is written
/// under a fresh `backend_set` id in a range no published value names, and
/// published by rewriting this one value, so no lookup ever sees a
/// half-written set or table; the old range is given back only after a
/// delay (the agent's retire), so a program that read the old value still
/// finds its set.
///
/// | offset | field              | meaning                                     |
/// |--------|--------------------|---------------------------------------------|
/// | 0      | `id`               | `ServiceId`: stable per frontend            |
/// | 4      | `backend_set`      | `BackendSetId`: names the set, its slots' checks and its Maglev table |
/// | 8      | `active`           | number of active slots                      |
/// | 10     | `terminating`      | number of terminating slots after them      |
/// | 12     | `flags`            | `service_flags::*`                          |
/// | 14     | `maglev_size`      | length M of `LB_MAGLEV[backend_set]`, with `MAGLEV` |
/// | 16     | `affinity_timeout` | seconds, with `service_flags::AFFINITY`     |
/// | 20     | `affinity_id`      | `AffinityKey::affinity_id`, with `AFFINITY`; 0 without |
/// | 24     | `key_check`        | `check_for` the frontend's `ServiceKey`     |
/// | 28     | `slot_base`        | index in `LB_SLOTS` of the set's first slot |
///
/// `affinity_id` is shared by every frontend of one Service port whose
/// backends come from the same selection of its endpoints (the ClusterIP,
/// externalIPs, LoadBalancer IPs and NodePorts under the same traffic
/// policy), so a client keeps one sessionAffinity decision whichever of
/// them it uses, as with kube-proxy. Frontends sharing it always hold the
/// same backends, which is what lets the kernel trust a live entry.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ServiceValue {
    pub id: u32,
    pub backend_set: u32,
    pub active: u16,
    pub terminating: u16,
    pub flags: u16,
    pub maglev_size: u16,
    pub affinity_timeout: u32,
    pub affinity_id: u32,
    /// `check_for` the frontend's `ServiceKey`: its `KeyCheck` mixed with
    /// the other fields.
    pub key_check: u32,
    pub slot_base: u32,
}

impl ServiceValue {
    /// The `key_check` this value carries under `key`: a digest of the key
    /// and of every other field, so that a copy made of two values (one
    /// overwritten while the program copied it, see `KeyCheck`) fails it
    /// as a value written for another key does.
    #[inline(always)]
    pub fn check_for(&self, key: &ServiceKey) -> u32 {
        let mut h = key.key_check();
        h = mix(h, self.id);
        h = mix(h, self.backend_set);
        h = mix(h, self.active as u32 | (self.terminating as u32) << 16);
        h = mix(h, self.flags as u32 | (self.maglev_size as u32) << 16);
        h = mix(h, self.affinity_timeout);
        h = mix(h, self.affinity_id);
        mix(h, self.slot_base)
    }

    /// The frontend's scheduler (`algorithm::*`). A value an earlier agent
    /// wrote has no algorithm bits: Maglev if flagged so, else random.
    #[inline(always)]
    pub fn algorithm(&self) -> u8 {
        let a = ((self.flags & service_flags::ALGORITHM) >> 8) as u8;
        if a == algorithm::RANDOM && self.flags & service_flags::MAGLEV != 0 {
            algorithm::MAGLEV
        } else {
            a
        }
    }
}

/// One slot of a backend set: what an `LB_SLOTS` element's `key_check`
/// digests (the element's index is `ServiceValue::slot_base + slot`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendSlotKey {
    pub backend_set: u32,
    pub slot: u32,
}

/// The backend a slot points at. Element of `LB_SLOTS`, an array (Katran's
/// `ch_rings`): a lookup is the few instructions the verifier inlines. A
/// free element is zeros, whose check names no slot.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct BackendSlot {
    pub backend_id: u32,
    /// `KeyCheck` of the slot's `BackendSlotKey`.
    pub key_check: u32,
}

impl BackendSlot {
    /// Slot `slot` of set `backend_set`, pointing at `backend_id`.
    #[inline(always)]
    pub fn new(backend_set: u32, slot: u32, backend_id: u32) -> Self {
        Self {
            backend_id,
            key_check: BackendSlotKey { backend_set, slot }.key_check(),
        }
    }

    /// The backend this element points at, if it is slot `slot` of set
    /// `backend_set` (not a free element, nor another set's), as the
    /// programs take it.
    #[inline(always)]
    pub fn backend_of(&self, backend_set: u32, slot: u32) -> Option<u32> {
        (self.key_check == BackendSlotKey { backend_set, slot }.key_check())
            .then_some(self.backend_id)
    }
}

/// A digest of a map key that its value carries (`key_check`), so that a
/// program can tell a copied value was written for another key.
/// `LB_SERVICES` is a preallocated hash map: an update links a fresh
/// element and keeps the replaced one as the writing CPU's spare, which the
/// next update on that CPU overwrites with another key's value without
/// waiting for readers (docs/maps.md, "Recycled elements"). A program
/// interrupted between its lookup and its copy can thus copy a foreign
/// value; it checks this digest and looks up again. In the arrays
/// (`LB_SLOTS`, `LB_BACKENDS`) it tells a free element, or one of another
/// set or id, from the one the program asked for.
pub trait KeyCheck {
    fn key_check(&self) -> u32;
}

/// The 16 bytes at `addr` as four 32-bit words, each as
/// `u32::from_le_bytes` takes it, loaded a word at a time: the BPF target
/// has no unaligned loads, so a word assembled from `[u8; 16]` costs four
/// byte loads and six shifts and ors. `addr` must be 4-aligned, which the
/// `align(4)` types whose first fields are addresses guarantee.
///
/// # Safety
/// `addr` is 4-aligned.
#[inline(always)]
unsafe fn addr_words(addr: &[u8; 16]) -> [u32; 4] {
    debug_assert!((addr.as_ptr() as usize).is_multiple_of(4));
    // SAFETY: 16 readable bytes, 4-aligned (the caller's promise).
    let w = unsafe { core::ptr::read(addr.as_ptr() as *const [u32; 4]) };
    [
        u32::from_le(w[0]),
        u32::from_le(w[1]),
        u32::from_le(w[2]),
        u32::from_le(w[3]),
    ]
}

/// One step of the digest: cheap, and every bit of `word` reaches the
/// result.
#[inline(always)]
const fn mix(h: u32, word: u32) -> u32 {
    (h ^ word).wrapping_mul(0x9E37_79B1).rotate_left(15)
}

/// Not 0, so that a zeroed value never passes for a key's.
const KEY_CHECK_SEED: u32 = 0x5bd1_e995;

impl KeyCheck for ServiceKey {
    #[inline(always)]
    fn key_check(&self) -> u32 {
        // SAFETY: `addr` is the first field of this 4-aligned type.
        let w = unsafe { addr_words(&self.addr) };
        let mut h = KEY_CHECK_SEED;
        h = mix(h, w[0]);
        h = mix(h, w[1]);
        h = mix(h, w[2]);
        h = mix(h, w[3]);
        mix(
            h,
            self.port as u32 | (self.proto as u32) << 16 | (self.scope as u32) << 24,
        )
    }
}

impl KeyCheck for BackendSlotKey {
    #[inline(always)]
    fn key_check(&self) -> u32 {
        mix(mix(KEY_CHECK_SEED, self.backend_set), self.slot)
    }
}

impl KeyCheck for BackendId {
    #[inline(always)]
    fn key_check(&self) -> u32 {
        mix(KEY_CHECK_SEED, self.id)
    }
}

/// Positions of a Maglev table per array element (`MaglevEntry`).
pub const MAGLEV_POSITIONS: usize = 64;

/// One element of a Maglev table: the backend ids of `MAGLEV_POSITIONS`
/// consecutive positions, position `p` being `backend_ids[p % 64]` of
/// element `p / 64`. Value of each table in `LB_MAGLEV` (an array; the last
/// element is padded with 0, which names no backend). The kernel rounds an
/// array element up to 8 bytes: 64 positions an element keep a table at 4
/// bytes a position, and 64 times fewer elements to write.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MaglevEntry {
    pub backend_ids: [u32; MAGLEV_POSITIONS],
}

impl Default for MaglevEntry {
    fn default() -> Self {
        Self {
            backend_ids: [0; MAGLEV_POSITIONS],
        }
    }
}

/// A frontend the agent could not program as desired at its last sync
/// (a map full, a table that could not be made): value of
/// `LB_UNPROGRAMMED`, keyed by the frontend's `ServiceKey` (a VIP marker's
/// for a marker). Written by the agent alone, for `lb-agent inspect`; no
/// program reads it. Whether the frontend's previous state is still
/// programmed shows in `LB_SERVICES`: a frontend that was never programmed
/// has no entry there, nor a VIP marker of its own.
///
/// | offset | field       | meaning                                          |
/// |--------|-------------|--------------------------------------------------|
/// | 0      | `service`   | `namespace/name` of the Service, NUL-padded       |
/// | 128    | `port_name` | the Service port's name, NUL-padded ("" unnamed) |
/// | 144    | `errno`     | the error of the write that failed               |
/// | 148    | `map`       | `unprogrammed_map::*`: where it failed, or `NOT_SERVED` |
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Unprogrammed {
    pub service: [u8; 128],
    pub port_name: [u8; 16],
    pub errno: i32,
    pub map: u32,
}

/// `Unprogrammed::map`: which write failed.
pub mod unprogrammed_map {
    pub const SERVICES: u32 = 0;
    pub const SLOTS: u32 = 1;
    pub const BACKENDS: u32 = 2;
    /// The table's entry in `LB_MAGLEV`.
    pub const MAGLEV: u32 = 3;
    /// Creating or filling the table itself (an array of its own).
    pub const MAGLEV_TABLE: u32 = 4;
    /// No write failed: no datapath serves the frontend's protocol (SCTP),
    /// so it is never programmed; `errno` is `EPROTONOSUPPORT`.
    pub const NOT_SERVED: u32 = 5;
    /// Each one's name, as logs, `/metrics` and `inspect` show it.
    pub const NAMES: [&str; 5] = [
        "LB_SERVICES",
        "LB_SLOTS",
        "LB_BACKENDS",
        "LB_MAGLEV",
        "LB_MAGLEV_TABLE",
    ];
}

/// Index of `LB_BACKENDS`: one id per distinct (address, port, protocol),
/// the lowest free from 1 up, so the array stays dense.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BackendId {
    pub id: u32,
}

/// An endpoint a connection can be sent to. Element `id` of the array
/// `LB_BACKENDS`; a free id's element is all zeros, so its `key_check`
/// fails.
///
/// | offset | field   | meaning                          |
/// |--------|---------|----------------------------------|
/// | 0      | `addr`  | pod address; IPv4 is mapped      |
/// | 16     | `port`  | host order                       |
/// | 18     | `proto` | `proto::TCP` or `proto::UDP`     |
/// | 19     | `flags` | `backend_flags::*`               |
/// | 20     | `key_check` | `KeyCheck` of its `BackendId` |
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Backend {
    pub addr: [u8; 16],
    pub port: u16,
    pub proto: u8,
    pub flags: u8,
    pub key_check: u32,
}

/// Key of `LB_REV_SOCK`: a socket (by its cookie) and the backend it was sent to.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ReverseSockKey {
    pub cookie: u64,
    pub addr: [u8; 16],
    pub port: u16,
    pub _pad: [u8; 6],
}

/// The frontend a socket addressed, so that `recvmsg` and `getpeername`
/// report the VIP instead of the backend. Value of `LB_REV_SOCK`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ReverseSockValue {
    pub addr: [u8; 16],
    pub port: u16,
    pub _pad: u16,
    pub service_id: u32,
}

/// What a TCP socket's connect was rewritten to, kept for its
/// `getpeername` (and for `cgroup_egress`) in the socket's
/// `SockPeerEntry`.
///
/// | offset | field           | meaning                              |
/// |--------|-----------------|--------------------------------------|
/// | 0      | `backend_addr`  | the address connect went to; mapped  |
/// | 16     | `frontend_addr` | the address the socket asked for     |
/// | 32     | `backend_port`  | host order                           |
/// | 34     | `frontend_port` | host order                           |
///
/// Aligned to 4 bytes (its size is unchanged), so that the digest reads
/// the addresses as 32-bit words (`addr_words`).
#[repr(C, align(4))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SockPeer {
    pub backend_addr: [u8; 16],
    pub frontend_addr: [u8; 16],
    pub backend_port: u16,
    pub frontend_port: u16,
}

/// Slots of `LB_SOCK_PEER` a socket may take: the one its cookie names
/// (`cookie % slots`) and the ones after it, so that two open sockets whose
/// cookies name one slot both fit.
pub const SOCK_PEER_PROBES: u32 = 4;

/// One element of `LB_SOCK_PEER`, an array of TCP sockets connected
/// through a frontend: connect writes the socket's entry into the first of
/// its `SOCK_PEER_PROBES` slots that is free (or already its own), and
/// the `sock_release` program frees it when the socket is closed, so the
/// array holds the sockets open now and never evicts one. An array element
/// is written in place by plain stores: no helper call, no lock, no
/// allocation (a preallocated hash's insert cost ~0.85 µs a connect here,
/// and the socket-local storage before it ~0.4 µs for its allocation).
///
/// | offset | field    | meaning                                          |
/// |--------|----------|--------------------------------------------------|
/// | 0      | `cookie` | the socket's `bpf_get_socket_cookie`; 0: free    |
/// | 8      | `peer`   | `SockPeer`                                       |
/// | 44     | `check`  | `SockPeerEntry::digest` of `cookie` and `peer`   |
///
/// Two sockets whose connects take one free slot at the same moment on
/// two CPUs can leave it holding one's cookie and parts of the other's
/// peer; `check` then fails and the entry counts as absent, as when all
/// its slots are taken (`stat::SOCK_PEER_LOST`): that socket's
/// `getpeername` shows the backend, and its connection is unaffected.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SockPeerEntry {
    pub cookie: u64,
    pub peer: SockPeer,
    pub check: u32,
}

impl SockPeerEntry {
    #[inline(always)]
    pub fn new(cookie: u64, peer: SockPeer) -> Self {
        Self {
            cookie,
            peer,
            check: Self::digest(cookie, &peer),
        }
    }

    /// Every bit of `cookie` and `peer`, folded (see `KeyCheck`).
    #[inline(always)]
    pub fn digest(cookie: u64, peer: &SockPeer) -> u32 {
        // SAFETY: both addresses are at offsets 0 and 16 of the 4-aligned
        // `SockPeer`.
        let (b, f) = unsafe {
            (
                addr_words(&peer.backend_addr),
                addr_words(&peer.frontend_addr),
            )
        };
        let mut h = mix(KEY_CHECK_SEED, cookie as u32);
        h = mix(h, (cookie >> 32) as u32);
        let mut i = 0;
        while i < 4 {
            h = mix(h, b[i]);
            h = mix(h, f[i]);
            i += 1;
        }
        mix(
            h,
            peer.backend_port as u32 | (peer.frontend_port as u32) << 16,
        )
    }

    /// The socket's peer, if this entry is the socket's and whole.
    #[inline(always)]
    pub fn peer_of(&self, cookie: u64) -> Option<SockPeer> {
        (self.cookie == cookie && self.check == Self::digest(cookie, &self.peer))
            .then_some(self.peer)
    }
}

/// This node's state of one backend, shared by every frontend that has
/// it and by both paths: element `BackendId` of the array
/// `LB_BACKEND_STATE`, which the kernel writes with atomic adds (no lock,
/// no helper call) and the agent resets when it gives a freed id to
/// another backend.
///
/// | offset | field       | meaning                                            |
/// |--------|-------------|----------------------------------------------------|
/// | 0      | `sockets`   | socket-path TCP connections open to it             |
/// | 4      | `flows`     | tc-path and UDP socket flows to it that live       |
/// | 8      | `_reserved` | zero                                               |
///
/// Both count only connections through a frontend whose scheduler counts
/// (`algorithm::counts`), whichever frontend of the Service that is
/// (ClusterIP, NodePort, LoadBalancer IP, externalIP); `open()` is their
/// sum, the backend's open connections from this node.
///
/// - `sockets`: a TCP socket counts from the connect that chose the
///   backend to the socket's release, added and taken back by the socket
///   programs. A decrement that meets an instant of the agent's reset can
///   leave it at -1; `open()` reads the sum as 0 at least.
/// - `flows`: `tc_ingress` adds one for each new flow it sends to the
///   backend (marking its forward entry `ct_flags::COUNTED`), and the
///   socket programs one for each new UDP socket's flow (`LB_DGRAM_FLOWS`,
///   connected or not); each sweep of the agent sets it to the counted
///   flows it found live in both, with an atomic add of the difference, so
///   a flow that ended, was evicted or expired stops counting within a
///   sweep.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendState {
    pub sockets: i32,
    pub flows: i32,
    pub _reserved: [u32; 2],
}

impl BackendState {
    /// Open connections from this node, never below zero.
    #[inline(always)]
    pub fn open(&self) -> u32 {
        let n = self.sockets.saturating_add(self.flows);
        if n < 0 {
            0
        } else {
            n as u32
        }
    }
}

/// This node's state of one frontend: element `ServiceId` of the array
/// `LB_FRONTEND_STATE`.
///
/// | offset | field       | meaning                                            |
/// |--------|-------------|----------------------------------------------------|
/// | 0      | `rr_cursor` | round-robin: the next turn, stepped by every CPU   |
/// | 4      | `lock`      | the kernel's lock of `rr_cursor` (`bpf_spin_lock`) |
///
/// The agent starts every cursor at a random value when it creates the
/// map, so two nodes start their turns at different backends (the ipvs
/// mode started every node at the first, kubernetes#121591); an id given
/// to another frontend keeps the cursor it had, which is as good a start.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FrontendState {
    pub rr_cursor: u32,
    pub lock: bpf_spin_lock,
}

/// The kernel's `struct bpf_spin_lock`, under that name: the verifier
/// finds the lock of a map value by this type name in the value's BTF.
/// Only the kernel's `bpf_spin_lock` and `bpf_spin_unlock` helpers touch
/// it; map reads and writes from user space skip it.
///
/// A lock rather than an atomic add that returns the old value: that
/// instruction (`BPF_FETCH`) is Linux 5.12's, 5.10's verifier rejects it,
/// and LLVM emits it only for the `alu32` CPU, which an object built for
/// every kernel cannot assume.
#[allow(non_camel_case_types)]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct bpf_spin_lock {
    pub val: u32,
}

/// Outlier detection's state of one backend on this node: element
/// `BackendId` of `LB_BACKEND_HEALTH`, shared by the socket and tc paths.
///
/// | offset | field        | meaning                                                 |
/// |--------|--------------|---------------------------------------------------------|
/// | 0      | `lock`       | the kernel's lock of the rest (`bpf_spin_lock`)          |
/// | 4      | `failures`   | failed connects in a row since a success or an ejection |
/// | 8      | `ejections`  | quarantines in a row (the series a success ends)        |
/// | 12     | `reason`     | the last quarantine's cause, `outlier::REFUSED` or `TIMEOUT` |
/// | 16     | `until_ns`   | end of the quarantine (`bpf_ktime_get_ns`), 0: never quarantined |
///
/// Every change happens under `lock` (the kernel) or whole with
/// `BPF_F_LOCK` (the agent resets an id it frees or hands out); selection
/// reads `until_ns` alone, one aligned word. A map of its own rather than
/// more fields of `BackendState`: that array is mapped into the agent's
/// memory, which the kernel refuses for a value with a lock.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendHealth {
    pub lock: bpf_spin_lock,
    pub failures: u32,
    pub ejections: u32,
    pub reason: u32,
    pub until_ns: u64,
}

impl BackendHealth {
    /// Whether new flows avoid the backend at `now`.
    #[inline(always)]
    pub fn quarantined(&self, now: u64) -> bool {
        self.until_ns > now
    }

    /// A connect to the backend failed at `now`: whether the backend is
    /// now due for quarantine. `threshold` failures in a row make it due;
    /// once quarantined in this series, the first failure after release
    /// does. A failure while quarantined is a connect chosen before it,
    /// and is not counted.
    #[inline(always)]
    pub fn count_failure(&mut self, now: u64, threshold: u32) -> bool {
        if self.quarantined(now) {
            return false;
        }
        self.failures = self.failures.saturating_add(1);
        // Once quarantined in this series (or a threshold of 0): one.
        let needed = if self.ejections > 0 || threshold == 0 {
            1
        } else {
            threshold
        };
        self.failures >= needed
    }

    /// Quarantines the backend from `now` for `base_ns` times its
    /// quarantines in a row, at most `max_ns`; false if it is quarantined
    /// already (another CPU decided first).
    #[inline(always)]
    pub fn eject(&mut self, now: u64, reason: u32, base_ns: u64, max_ns: u64) -> bool {
        if self.quarantined(now) {
            return false;
        }
        self.ejections = self.ejections.saturating_add(1);
        // base × ejections, at most max, without a 128-bit product (which
        // BPF has no instruction for): a multiple past max / base is max.
        let n = self.ejections as u64;
        let span = if base_ns == 0 {
            0
        } else if n > max_ns / base_ns {
            max_ns
        } else {
            let span = base_ns * n;
            if span > max_ns {
                max_ns
            } else {
                span
            }
        };
        self.until_ns = now.wrapping_add(span);
        self.failures = 0;
        self.reason = reason;
        true
    }

    /// A connect to the backend succeeded: the series ends (a quarantine
    /// under way runs its time).
    #[inline(always)]
    pub fn succeeded(&mut self) {
        self.failures = 0;
        self.ejections = 0;
    }

    /// Whether `succeeded` would change anything (read without the lock,
    /// so that a healthy backend's connects take no lock).
    #[inline(always)]
    pub fn in_series(&self) -> bool {
        self.failures != 0 || self.ejections != 0
    }
}

/// Outlier detection: why a backend was quarantined
/// (`BackendHealth::reason`), and the policy's pure parts.
pub mod outlier {
    /// Connects answered with an RST (nothing listens: the pod's process
    /// died, its namespace lives).
    pub const REFUSED: u32 = 1;
    /// Connects not answered within a second (the SYN retransmitted: the
    /// node or the pod's link is gone).
    pub const TIMEOUT: u32 = 2;
    /// Connects failed by an ICMP error before any answer (the local
    /// stack's own: the backend's address does not resolve on its link).
    pub const UNREACHABLE: u32 = 3;
    /// Names by value (index 0: none), as logs and `/metrics` show them.
    pub const NAMES: [&str; 4] = ["none", "refused", "timeout", "unreachable"];

    /// How many slots of a frontend the cap looks at (`ejection_allowed`):
    /// a frontend with more is judged by its first `CAP_SCAN`. 32 keeps
    /// `sock_ops` within the verifier's budget of a million instructions
    /// (64 passed it: the count's range grows with each slot).
    pub const CAP_SCAN: u32 = 32;

    /// Whether one more of a frontend's backends may be quarantined when
    /// `quarantined` of the `scanned` first of its `count` selectable
    /// backends are: never the last, and never more than `max_percent`.
    #[inline(always)]
    pub fn ejection_allowed(quarantined: u32, scanned: u32, count: u32, max_percent: u32) -> bool {
        let after = quarantined + 1;
        after < count && (after as u64) * 100 <= (max_percent as u64) * (scanned as u64)
    }

    /// Another draw of the pick `draw` (attempt `i` > 0) for a new flow
    /// whose first pick is quarantined: a hash's table position or a
    /// random slot, spread anew (murmur3's finalizer of the pair).
    #[inline(always)]
    pub fn redraw(draw: u32, i: u32) -> u32 {
        let mut h = draw ^ i.wrapping_mul(0x9e37_79b9);
        h ^= h >> 16;
        h = h.wrapping_mul(0x85eb_ca6b);
        h ^= h >> 13;
        h = h.wrapping_mul(0xc2b2_ae35);
        h ^ (h >> 16)
    }

    /// Redraws before a linear scan for an unquarantined backend.
    pub const REDRAWS: u32 = 3;
}

/// `LB_SOCK_BACKEND`'s element beside a TCP socket's `LB_SOCK_PEER` slot:
/// the backend id its connect chose and what to do with it.
pub mod sock_backend {
    /// The socket counts as an open connection of the backend (lc, sed,
    /// nq) until `sock_release` or its next connect.
    pub const COUNTED: u32 = 1 << 31;
    /// Outlier detection watches the socket's connect (`sock_ops`).
    pub const WATCHED: u32 = 1 << 30;
    /// The backend id's bits.
    pub const ID: u32 = !(COUNTED | WATCHED);
}

/// One CPU's element of `LB_SOCK_DRAW`: the socket path's random draw and
/// this node's secret.
///
/// | offset | field    | meaning                                               |
/// |--------|----------|-------------------------------------------------------|
/// | 0      | `state`  | this CPU's SplitMix64 state (`select::draw`)          |
/// | 8      | `secret` | this node's secret, the same on every CPU (`select::salted`) |
///
/// The agent fills both from the OS's random source when it creates the
/// map, which is pinned, so a restart keeps them: two nodes draw apart,
/// and the socket path's hashes of cookies (counters that run alike on
/// every node) do not correlate across nodes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockDraw {
    pub state: u64,
    pub secret: u64,
}

/// A socket connected or sending to a frontend with
/// `service_flags::SOURCE_RANGES`. Value of the socket storage map
/// `LB_SOCK_CHECK`: its presence makes `cgroup_egress` check the source
/// of the socket's packets against `LB_SOURCE_RANGES` (kube-proxy checks
/// the ranges on OUTPUT as on PREROUTING). Sockets of other frontends have
/// none, so their packets cost one failed storage lookup.
///
/// | offset | field     | meaning                         |
/// |--------|-----------|---------------------------------|
/// | 0      | `verdict` | a `source_check` value          |
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SockSourceCheck {
    pub verdict: u32,
}

/// `SockSourceCheck::verdict`.
pub mod source_check {
    /// Every packet is checked (a TCP socket before its first packet, and
    /// every UDP socket: its datagrams may leave from any address).
    pub const PENDING: u32 = 0;
    /// A TCP socket whose first packet was allowed: its source cannot
    /// change, so later packets pass unchecked.
    pub const ALLOWED: u32 = 1;
}

/// `AffinityKey::kind`: what identifies the client.
pub mod affinity_client {
    /// Socket path: the client's network namespace cookie in `client[..8]`
    /// (little-endian u64), which stands for the pod.
    pub const NETNS_COOKIE: u8 = 0;
    /// tc path: the packet's source address.
    pub const SOURCE_IP: u8 = 1;
}

/// Key of `LB_AFFINITY` (sessionAffinity: ClientIP): one decision per
/// client and `ServiceValue::affinity_id` (a Service port and endpoint
/// selection, not a frontend).
///
/// | offset | field         | meaning                                   |
/// |--------|---------------|-------------------------------------------|
/// | 0      | `client`      | see `affinity_client`                     |
/// | 16     | `affinity_id` | the frontend's `ServiceValue::affinity_id` |
/// | 20     | `kind`        | `affinity_client::*`                      |
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AffinityKey {
    pub client: [u8; 16],
    pub affinity_id: u32,
    pub kind: u8,
    pub _pad: [u8; 3],
}

impl AffinityKey {
    /// The socket path's key: the client's network namespace cookie.
    pub fn for_netns(cookie: u64, affinity_id: u32) -> Self {
        let mut client = [0u8; 16];
        let bytes = cookie.to_le_bytes();
        let mut i = 0;
        while i < 8 {
            client[i] = bytes[i];
            i += 1;
        }
        Self {
            client,
            affinity_id,
            kind: affinity_client::NETNS_COOKIE,
            _pad: [0; 3],
        }
    }
}

/// Value of `LB_AFFINITY`: the backend a client sticks to and when it last
/// used it (`bpf_ktime_get_ns`, CLOCK_MONOTONIC).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AffinityEntry {
    pub backend_id: u32,
    pub _pad: u32,
    pub last_used_ns: u64,
}

/// A UDP socket's flow to one frontend: key of `LB_DGRAM_FLOWS`. An
/// unconnected socket passes the sendmsg hook with every datagram; this
/// keeps them on one backend, as netfilter's conntrack keeps the flow of
/// one source port under kube-proxy (QUIC, DTLS, SIP and game protocols
/// need it). The socket is its cookie: one socket has one source port and
/// protocol, so this is kube-proxy's 5-tuple for the socket path.
///
/// | offset | field    | meaning                                        |
/// |--------|----------|------------------------------------------------|
/// | 0      | `cookie` | `bpf_get_socket_cookie` of the sending socket  |
/// | 8      | `addr`   | the frontend the socket addressed; IPv4 is mapped |
/// | 24     | `port`   | host order                                     |
/// | 26     | `proto`  | `proto::UDP`                                   |
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DatagramFlowKey {
    pub cookie: u64,
    pub addr: [u8; 16],
    pub port: u16,
    pub proto: u8,
    pub _pad: [u8; 5],
}

/// Where a socket's datagrams to a frontend go: value of `LB_DGRAM_FLOWS`.
/// The kernel reuses it while it is live (see [`DatagramFlow::live`]),
/// names the frontend's current `ServiceValue::id` and its backend still
/// exists; the agent deletes it once the backend left the frontend's
/// serving backends, so that the next datagram chooses a live one.
///
/// | offset | field          | meaning                                    |
/// |--------|----------------|--------------------------------------------|
/// | 0      | `backend_id`   | the backend the flow was sent to           |
/// | 4      | `service_id`   | the frontend's `ServiceValue::id` then     |
/// | 8      | `last_used_ns` | `bpf_ktime_get_ns` of the last datagram    |
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DatagramFlow {
    pub backend_id: u32,
    pub service_id: u32,
    pub last_used_ns: u64,
}

impl DatagramFlow {
    /// Whether the flow still binds its socket at `now_ns`: a datagram
    /// within `timeout_s` seconds (`TcConfig::udp_timeout_s`, inclusive;
    /// clock-safe, as every timestamp here).
    #[inline(always)]
    pub fn live(&self, now_ns: u64, timeout_s: u32) -> bool {
        clock::within(now_ns, self.last_used_ns, timeout_s)
    }
}

/// `CtEntry::flags`: what a flow is, fixed when its entries are written.
/// What happens to it later is in `CtEntry::state`.
pub mod ct_flags {
    /// The entry is the reply direction of a flow (backend to client).
    pub const REPLY: u8 = 1 << 0;
    /// The flow is masqueraded: the backend sees the node's address.
    pub const SNAT: u8 = 1 << 1;
    /// The backend runs on this node.
    pub const LOCAL: u8 = 1 << 2;
    /// The flow counts among its backend's flows (`BackendState::flows`):
    /// its frontend's scheduler counts connections. Set in the forward
    /// entry only.
    pub const COUNTED: u8 = 1 << 3;
    /// Its frontend detects outliers (`service_flags::OUTLIER_DETECT`
    /// when the flow began): the handshake's outcome counts for its
    /// backend. Set in both entries.
    pub const WATCHED: u8 = 1 << 4;
}

/// `CtEntry::state`: one byte per event of a TCP flow, so that CPUs that
/// record different events of one flow at once never undo each other's
/// write (a read-modify-write of one flags byte could; BPF has atomic OR
/// only from Linux 5.12). A byte is 0 until its event, then 1.
///
/// | index | event | set on |
/// |---|---|---|
/// | `SEEN_REPLY` | TCP: the client acknowledged the backend's answer, the flow is established (in `LB_CONNTRACK`); UDP: the backend answered | both entries |
/// | `FIN` | this direction sent a FIN | this entry |
/// | `CLOSING` | both directions sent a FIN, or a valid RST: the close timeout runs | both entries |
pub mod ct_state {
    pub const SEEN_REPLY: usize = 0;
    pub const FIN: usize = 1;
    pub const CLOSING: usize = 2;
    pub const COUNT: usize = 3;
}

/// A flow as one packet carries it: key of `LB_CONNTRACK`. Both directions
/// of a translated flow have an entry: the forward one keyed by what the
/// client sends (client -> frontend), the reply one keyed by what the
/// backend sends (backend -> client, or backend -> node address and SNAT
/// port when masqueraded).
///
/// | offset | field   | meaning                                  |
/// |--------|---------|------------------------------------------|
/// | 0      | `src`   | source address; IPv4 is mapped           |
/// | 16     | `dst`   | destination address; IPv4 is mapped      |
/// | 32     | `sport` | host order                               |
/// | 34     | `dport` | host order                               |
/// | 36     | `proto` | `proto::TCP` or `proto::UDP`             |
///
/// Aligned to 4 bytes (its size is unchanged), so that a key is built and
/// copied a word at a time, not a byte at a time.
#[repr(C, align(4))]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CtKey {
    pub src: [u8; 16],
    pub dst: [u8; 16],
    pub sport: u16,
    pub dport: u16,
    pub proto: u8,
    pub _pad: [u8; 3],
}

/// What to do with the packets of one direction of a flow: rewrite the
/// source to `nat_src:nat_sport` and the destination to `nat_dst:nat_dport`.
/// The key of the other direction is this tuple reversed. Value of
/// `LB_CONNTRACK`.
///
/// | offset | field          | meaning                                     |
/// |--------|----------------|---------------------------------------------|
/// | 0      | `nat_src`      | new source address                          |
/// | 16     | `nat_dst`      | new destination address                     |
/// | 32     | `nat_sport`    | new source port, host order                 |
/// | 34     | `nat_dport`    | new destination port, host order            |
/// | 36     | `backend_id`   | the backend the flow was sent to            |
/// | 40     | `service_id`   | the frontend it addressed                   |
/// | 44     | `flags`        | `ct_flags::*`, fixed                        |
/// | 45     | `state`        | `ct_state::*`, one byte per event           |
/// | 48     | `last_seen_ns` | `bpf_ktime_get_ns` of the last packet       |
/// | 56     | `ack_seq`      | TCP: the last ACK number this direction sent (host order); a forward entry in `LB_CT_SYN`: the one that completes the handshake, once the backend answered |
/// | 60     | `backend_time_wait` | TCP: 1 once the backend sent the flow's first FIN |
/// | 61     | `answered`     | TCP, a forward entry in `LB_CT_SYN`: 1 once the backend answered (`ack_seq` then holds the ACK number that completes the handshake, which may be 0) |
/// | 62     | `syn_timed_out` | a forward entry in `LB_CT_SYN`: the client sent its SYN again unanswered, counted once as the backend's failure (outlier detection) |
/// | 63     | `syn_seq`      | TCP, a forward entry: [`CtEntry::syn_seq_mark`] of the client's first SYN (0: not known) |
/// | 64     | `hop`          | [`NextHop`]: the FIB's answer for this direction's translated packets |
///
/// An entry lives `TcConfig::tcp_syn_timeout_s` until the client
/// acknowledges the backend's answer, then `tcp_timeout_s`, and `tcp_close_timeout_s` once `CLOSING`, at
/// least `tcp_time_wait_timeout_s` when the backend closed first; UDP
/// flows `udp_timeout_s` ([`conntrack::timeout_s`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CtEntry {
    pub nat_src: [u8; 16],
    pub nat_dst: [u8; 16],
    pub nat_sport: u16,
    pub nat_dport: u16,
    pub backend_id: u32,
    pub service_id: u32,
    pub flags: u8,
    pub state: [u8; ct_state::COUNT],
    pub last_seen_ns: u64,
    pub ack_seq: u32,
    /// The backend closed first (its FIN before the client's), so its
    /// stack holds the flow's tuple in TIME_WAIT after the close. Set in
    /// both entries of the flow; was padding (0) before, so entries of an
    /// older agent read as "not known".
    pub backend_time_wait: u8,
    /// The backend answered this flow's SYN (a forward entry in
    /// `LB_CT_SYN`). A byte of its own because the ACK number it expects,
    /// the backend's initial sequence number + 1, is 0 once in 2^32 flows;
    /// was padding (0) before, so an entry an older agent wrote says so by
    /// a non-zero `ack_seq` alone.
    pub answered: u8,
    /// The client sent its SYN again a second after the first with no
    /// answer: counted once, as its backend's timed-out connect (a forward
    /// entry in `LB_CT_SYN`). Was padding (0) before.
    pub syn_timed_out: u8,
    /// [`CtEntry::syn_seq_mark`] of the client's first SYN (a forward
    /// entry). A SYN with another mark is a new connect on the same tuple,
    /// its earlier attempt given up (a client port taken again within the
    /// SYN timeout): it gets a fresh choice, so that a port's next connect
    /// does not follow an unanswered one to its dead backend. Was padding:
    /// 0, an older agent's entry, is not known and compares with nothing.
    pub syn_seq: u8,
    pub hop: NextHop,
}

impl CtEntry {
    /// A SYN's sequence number in a byte that is never 0: its low bits
    /// with bit 0 set. A retransmitted SYN carries the same number; a new
    /// connect's differs in these bits 127 times in 128.
    #[inline(always)]
    pub const fn syn_seq_mark(seq: u32) -> u8 {
        seq as u8 | 1
    }

    /// Whether client SYN `seq` on this forward entry opens a new connect
    /// on the tuple rather than sending the first one's again.
    #[inline(always)]
    pub const fn another_syn(&self, seq: u32) -> bool {
        self.syn_seq != 0 && self.syn_seq != Self::syn_seq_mark(seq)
    }
}

#[cfg(test)]
#[test]
fn another_syn_tells_a_new_connect_from_the_first_sent_again() {
    let mut e: CtEntry = unsafe { core::mem::zeroed() };
    // An older agent's entry: not known, never another.
    assert!(!e.another_syn(0x1234_5678));
    e.syn_seq = CtEntry::syn_seq_mark(0x1234_5678);
    assert_ne!(e.syn_seq, 0);
    assert_ne!(CtEntry::syn_seq_mark(0), 0);
    assert!(!e.another_syn(0x1234_5678), "the same SYN again");
    assert!(e.another_syn(0x1234_5690), "a new ISN");
    // Only bit 0 is lost: 127 in 128 new numbers are told apart.
    let told = (0u32..256).filter(|s| e.another_syn(*s)).count();
    assert_eq!(told, 254);
}

/// A flow direction's next hop, cached in its `CtEntry` so that its
/// translated packets skip the FIB lookup (~0.25 µs a packet): written by
/// tc_ingress after a lookup that resolved the neighbour, used while
/// `check` is [`NextHop::digest`] of the hop, the entry's translated tuple,
/// the device the packet arrived on, the route epoch (`LB_ROUTE_EPOCH`,
/// moved by the agent at every route, rule, neighbour, link or address
/// change) and the second (`ktime >> 30`, so that a cached hop outlives a
/// change by at most ~1 s even with no agent running). A digest, not a
/// version number: two CPUs may write one entry's hop at once, and an
/// entry's memory may be reused by another flow while a CPU still writes
/// to it; either way the digest fails and the packet takes the lookup
/// again. All zeros: none.
///
/// | offset | field     | meaning                                        |
/// |--------|-----------|------------------------------------------------|
/// | 0      | `ifindex` | the device the packets leave by                |
/// | 4      | `dmac`    | the next hop's MAC                             |
/// | 10     | `smac`    | the device's MAC                               |
/// | 16     | `len`     | the largest IP length the route took (its MTU check) |
/// | 18     | `_pad`    |                                                |
/// | 20     | `check`   | see above                                      |
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct NextHop {
    pub ifindex: u32,
    pub dmac: [u8; 6],
    pub smac: [u8; 6],
    pub len: u16,
    pub _pad: u16,
    pub check: u32,
}

impl NextHop {
    /// The check of this hop for the translated tuple of `e` (its own
    /// `hop` is not read): `stamp` is the route epoch and the second,
    /// `ifindex` the device the packet arrived on, `proto` its protocol.
    #[inline(always)]
    pub fn digest(&self, e: &CtEntry, stamp: [u32; 2], ifindex: u32, proto: u8) -> u32 {
        // SAFETY: `nat_src` and `nat_dst` are at offsets 0 and 16 of the
        // 8-aligned `CtEntry`.
        let (s, d) = unsafe { (addr_words(&e.nat_src), addr_words(&e.nat_dst)) };
        let mut h = mix(mix(KEY_CHECK_SEED, stamp[0]), stamp[1]);
        h = mix(h, ifindex);
        let mut i = 0;
        while i < 4 {
            h = mix(h, s[i]);
            h = mix(h, d[i]);
            i += 1;
        }
        h = mix(h, e.nat_sport as u32 | (e.nat_dport as u32) << 16);
        h = mix(h, proto as u32 | (self.len as u32) << 16);
        h = mix(h, self.ifindex);
        let (m, n) = (&self.dmac, &self.smac);
        h = mix(h, u32::from_le_bytes([m[0], m[1], m[2], m[3]]));
        h = mix(h, u32::from_le_bytes([m[4], m[5], n[0], n[1]]));
        mix(h, u32::from_le_bytes([n[2], n[3], n[4], n[5]]))
    }
}

/// Conntrack lifetimes, the same in the kernel and in the agent's sweep.
pub mod conntrack {
    use crate::{clock, ct_state, proto, CtEntry, TcConfig};

    /// How long `e` lives after its last packet, in seconds.
    #[inline(always)]
    pub fn timeout_s(e: &CtEntry, l4proto: u8, cfg: &TcConfig) -> u32 {
        if l4proto != proto::TCP {
            cfg.udp_timeout_s
        } else if e.state[ct_state::CLOSING] != 0 {
            if e.backend_time_wait != 0 {
                cfg.tcp_close_timeout_s.max(cfg.tcp_time_wait_timeout_s)
            } else {
                cfg.tcp_close_timeout_s
            }
        } else if e.state[ct_state::SEEN_REPLY] == 0 {
            cfg.tcp_syn_timeout_s
        } else {
            cfg.tcp_timeout_s
        }
    }

    /// Whether `e` is still live at `now_ns` (clock-safe: an entry
    /// refreshed on another CPU after `now_ns` was read is live).
    #[inline(always)]
    pub fn live(e: &CtEntry, l4proto: u8, now_ns: u64, cfg: &TcConfig) -> bool {
        clock::within(now_ns, e.last_seen_ns, timeout_s(e, l4proto, cfg))
    }
}

impl CtKey {
    /// The key of the other direction of the flow that `entry` (found
    /// under some key) translates to.
    pub fn partner(entry: &CtEntry, proto: u8) -> CtKey {
        CtKey {
            src: entry.nat_dst,
            dst: entry.nat_src,
            sport: entry.nat_dport,
            dport: entry.nat_sport,
            proto,
            _pad: [0; 3],
        }
    }
}

/// A fragmented datagram as its fragments carry it: key of `LB_FRAGMENTS`.
/// Only the first fragment has the ports, so the first one's translation is
/// recorded under what every fragment has.
///
/// | offset | field   | meaning                                        |
/// |--------|---------|------------------------------------------------|
/// | 0      | `src`   | source address; IPv4 is mapped                 |
/// | 16     | `dst`   | destination address; IPv4 is mapped            |
/// | 32     | `id`    | IPv4 identification or IPv6 fragment id, host order |
/// | 36     | `proto` | `proto::TCP` or `proto::UDP`                   |
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FragKey {
    pub src: [u8; 16],
    pub dst: [u8; 16],
    pub id: u32,
    pub proto: u8,
    pub _pad: [u8; 3],
}

/// `FragEntry::flags`.
pub mod frag_flags {
    /// The first fragment was not translated (not ours): later ones pass
    /// untouched. Without any entry a later fragment is dropped.
    pub const PASS: u8 = 1 << 0;
    /// Later fragments are sent with a FIB lookup and `bpf_redirect_neigh`
    /// (masqueraded, or replies of remote backends), as the first was.
    pub const REDIRECT: u8 = 1 << 1;
}

/// What the later fragments of a datagram are rewritten to: the addresses
/// of the first fragment's translation (ports are only in the first).
/// Value of `LB_FRAGMENTS`.
///
/// | offset | field       | meaning                                      |
/// |--------|-------------|----------------------------------------------|
/// | 0      | `nat_src`   | new source address                           |
/// | 16     | `nat_dst`   | new destination address                      |
/// | 32     | `nat_sport` | the first fragment's new ports (FIB lookup)  |
/// | 34     | `nat_dport` |                                              |
/// | 36     | `flags`     | `frag_flags::*`                              |
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FragEntry {
    pub nat_src: [u8; 16],
    pub nat_dst: [u8; 16],
    pub nat_sport: u16,
    pub nat_dport: u16,
    pub flags: u8,
    pub _pad: [u8; 3],
}

/// Value of `LB_LOCAL_PORTS` and `LB_FRONTEND_PORTS`: 64 ports of one
/// protocol as bits, which of them a backend on this node serves on
/// (`LB_LOCAL_PORTS`) or a frontend the tc path serves listens on
/// (`LB_FRONTEND_PORTS`: `scope::EXTERNAL`, a NodePort or a LoadBalancer
/// IP's or an externalIP's port). Element [`PortBits::index`] holds the
/// port, bit `port % 64` says whether it is used: elements 0..1024 are
/// TCP's ports, 1024..2048 UDP's.
///
/// A packet leaving a device can be the reply of a translated flow only if
/// it comes from a local backend's port (the tc path's other packets are
/// translated at ingress), so `tc_egress` passes every other packet after
/// one array read, before its conntrack lookup. A packet arriving can be
/// ours only if it goes to a frontend's port (a new flow, or a packet of
/// one) or to a SNAT port (a reply of a masqueraded flow), so `tc_ingress`
/// passes the node's own traffic the same way, before its conntrack and
/// frontend lookups. Bits, not an element per port: that read is on every
/// packet of the node, and a protocol's 65 536 ports fit in 8 KiB (128
/// cache lines, 512 ports each) that stay in the CPU's caches, where an
/// element per port spread them over 256 KiB and most reads missed. The
/// agent marks a port before it publishes a backend or frontend on it and
/// never clears one while its pins last: a flow may outlive its backend's
/// place in every Service, or its frontend.
///
/// | offset | field   | meaning                                        |
/// |--------|---------|------------------------------------------------|
/// | 0      | `ports` | bit `port % 64` set: the protocol uses the port |
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PortBits {
    pub ports: u64,
}

impl PortBits {
    /// Elements of a map of `PortBits`: every TCP and UDP port.
    pub const ELEMENTS: u32 = 2 * 65_536 / 64;

    /// The element holding `proto`'s `port`; `None` for a protocol other
    /// than TCP and UDP, which the maps do not hold.
    #[inline(always)]
    pub fn index(proto: u8, port: u16) -> Option<u32> {
        let first = match proto {
            proto::TCP => 0,
            proto::UDP => Self::ELEMENTS / 2,
            _ => return None,
        };
        Some(first + u32::from(port) / 64)
    }

    #[inline(always)]
    fn bit(port: u16) -> u64 {
        1 << (port % 64)
    }

    /// Whether `port` (of this element's protocol and range) is used.
    #[inline(always)]
    pub fn has(&self, port: u16) -> bool {
        self.ports & Self::bit(port) != 0
    }

    /// This element with `port` marked too.
    pub fn with(self, port: u16) -> Self {
        Self {
            ports: self.ports | Self::bit(port),
        }
    }

    /// The (protocol, port) this element marks, read as element `index`
    /// of its map (`index`'s inverse), in ascending port order.
    pub fn marked(self, index: u32) -> impl Iterator<Item = (u8, u16)> {
        let half = Self::ELEMENTS / 2;
        let (proto, first) = if index < half {
            (proto::TCP, index)
        } else {
            (proto::UDP, index - half)
        };
        let in_map = index < Self::ELEMENTS;
        (0..64u32)
            .filter(move |bit| in_map && self.ports & (1 << bit) != 0)
            .map(move |bit| (proto, (first * 64 + bit) as u16))
    }
}

/// Settings of the tc path, and the UDP timeout the socket path's
/// datagram flows (`LB_DGRAM_FLOWS`) share with it. The single element of
/// `LB_TC_CONFIG`.
///
/// | offset | field               | meaning                                  |
/// |--------|---------------------|------------------------------------------|
/// | 0      | `snat_v4`           | masquerade address for IPv4 (mapped), or zero |
/// | 16     | `snat_v6`           | masquerade address for IPv6, or zero     |
/// | 32     | `tcp_timeout_s`     | idle lifetime of a TCP flow              |
/// | 36     | `tcp_close_timeout_s` | lifetime after FIN or RST              |
/// | 40     | `udp_timeout_s`     | idle lifetime of a UDP flow (both paths) |
/// | 44     | `snat_port_min`     | SNAT source ports, inclusive range       |
/// | 46     | `snat_port_max`     |                                          |
/// | 48     | `tcp_syn_timeout_s` | lifetime of a TCP flow whose handshake is not complete |
/// | 52     | `l4_csum_v6_flags`  | `BPF_F_IPV6` where the kernel has it, else 0 |
/// | 56     | `tcp_time_wait_timeout_s` | least lifetime after the close of a flow whose backend closed first |
/// | 60     | `source_ranges`     | 1 while some frontend has `loadBalancerSourceRanges`, else 0 |
/// | 64     | `outlier_failures`  | failed connects in a row that quarantine a backend |
/// | 68     | `outlier_base_ms`   | first quarantine's length; the nth in a row is n times it |
/// | 72     | `outlier_max_ms`    | longest quarantine                       |
/// | 76     | `outlier_max_percent` | most of a frontend's backends quarantined at once |
/// | 80     | `service_ranges`    | the guarded Service CIDRs (`ServiceRanges`, 264 bytes) |
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TcConfig {
    pub snat_v4: [u8; 16],
    pub snat_v6: [u8; 16],
    pub tcp_timeout_s: u32,
    pub tcp_close_timeout_s: u32,
    pub udp_timeout_s: u32,
    pub snat_port_min: u16,
    pub snat_port_max: u16,
    pub tcp_syn_timeout_s: u32,
    pub l4_csum_v6_flags: u32,
    /// A backend that closes a TCP connection first holds its tuple in
    /// TIME_WAIT (60 s on Linux, `TCP_TIMEWAIT_LEN`); the flow's entries
    /// live at least this long after the close then (`CtEntry::
    /// backend_time_wait`), so that the port its tuple names toward the
    /// backend (a SNAT port, a remapped client port) is not given to
    /// another client meanwhile: that client's SYN would meet the old
    /// connection's TIME_WAIT, which drops a SYN whose timestamp is older
    /// than the old connection's (another client's clock: half the time)
    /// and answers with an ACK, so the connection waits for a SYN
    /// retransmission. netfilter keeps such a tuple for its TIME_WAIT
    /// timeout (120 s).
    pub tcp_time_wait_timeout_s: u32,
    /// 1 while some frontend of the node has `loadBalancerSourceRanges`
    /// (`service_flags::SOURCE_RANGES`), else 0. `cgroup_egress` runs on
    /// every packet of every socket of the cgroup and looks for the mark
    /// `sock::forward` leaves on a socket to such a frontend (two helper
    /// calls); with no ranges anywhere it returns at once. The agent sets
    /// it before it publishes a frontend with ranges, and clears it only
    /// once none is wanted.
    pub source_ranges: u32,
    /// Outlier detection: failed connects in a row that quarantine a
    /// backend (`--outlier-consecutive-failures`).
    pub outlier_failures: u32,
    /// The first quarantine's length, in ms; the nth in a row lasts n
    /// times as long (`--outlier-base-ejection`).
    pub outlier_base_ms: u32,
    /// The longest quarantine, in ms (`--outlier-max-ejection`).
    pub outlier_max_ms: u32,
    /// The most of a frontend's backends quarantined at once, in percent
    /// (`--outlier-max-ejection-percent`); never the last one.
    pub outlier_max_percent: u32,
    /// The Service CIDRs guarded (`--service-cluster-ip-range` and the
    /// `ServiceCIDR` objects): an address in them that no Service holds is
    /// refused on the socket path and dropped on the tc path, as
    /// kube-proxy's `cluster-ips-check` does. Empty: nothing is guarded.
    pub service_ranges: ServiceRanges,
}

/// How many Service CIDRs (both families together) `ServiceRanges` holds:
/// a fixed array compared in the program, cheaper than an LPM trie's helper
/// call, and enough for a cluster's few `ServiceCIDR`s (one or two, a
/// prefix per family each).
pub const SERVICE_RANGES: usize = 8;

/// One guarded prefix, in the 16-byte form of addresses (IPv4 mapped),
/// each half a native-endian view of the address's bytes: an address
/// `a` is in it when `a & mask == net`, two words at a time.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ServiceRange {
    pub net: [u64; 2],
    pub mask: [u64; 2],
}

impl ServiceRange {
    /// The prefix of `addr` (16-byte form) of `bits` bits (of 128; an IPv4
    /// prefix of length n is `96 + n`), `addr`'s host bits cleared.
    pub fn prefix(addr: [u8; 16], bits: u32) -> Self {
        let bits = bits.min(128);
        let mask = if bits == 0 {
            0u128
        } else {
            u128::MAX << (128 - bits)
        };
        let mask = mask.to_be_bytes();
        let mut net = addr;
        let mut i = 0;
        while i < 16 {
            net[i] &= mask[i];
            i += 1;
        }
        Self {
            net: halves(&net),
            mask: halves(&mask),
        }
    }

    /// The prefix's address (16-byte form) and its length in bits (of 128).
    pub fn addr_and_bits(&self) -> ([u8; 16], u32) {
        let mut net = [0u8; 16];
        net[..8].copy_from_slice(&self.net[0].to_ne_bytes());
        net[8..].copy_from_slice(&self.net[1].to_ne_bytes());
        let mut mask = [0u8; 16];
        mask[..8].copy_from_slice(&self.mask[0].to_ne_bytes());
        mask[8..].copy_from_slice(&self.mask[1].to_ne_bytes());
        (net, u128::from_be_bytes(mask).count_ones())
    }
}

/// `addr` as two native-endian words, as `ServiceRange` holds its halves.
#[inline(always)]
pub fn halves(a: &[u8; 16]) -> [u64; 2] {
    [
        u64::from_ne_bytes([a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]]),
        u64::from_ne_bytes([a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15]]),
    ]
}

/// The guarded Service CIDRs: the first `len` of `ranges` (at most
/// `SERVICE_RANGES`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ServiceRanges {
    pub len: u32,
    pub _pad: u32,
    pub ranges: [ServiceRange; SERVICE_RANGES],
}

impl ServiceRanges {
    /// Whether `addr` (16-byte form) is in one of the ranges. A bounded
    /// loop over at most `SERVICE_RANGES` prefixes, two masked compares
    /// each; an empty set answers at its first compare.
    #[inline(always)]
    pub fn contains(&self, addr: &[u8; 16]) -> bool {
        let a = halves(addr);
        let mut i = 0;
        while i < SERVICE_RANGES {
            if i as u32 >= self.len {
                return false;
            }
            let r = &self.ranges[i];
            if a[0] & r.mask[0] == r.net[0] && a[1] & r.mask[1] == r.net[1] {
                return true;
            }
            i += 1;
        }
        false
    }
}

/// The data of an `LB_SOURCE_RANGES` key (an LPM trie; the prefix length in
/// bits precedes it). The frontend is matched exactly (its 160 bits), the
/// client source by prefix: prefix length `160 + 128` for a full lookup.
/// Per frontend with `loadBalancerSourceRanges`, the agent writes a marker
/// with prefix length 160 and value `source_range::DENY`, and one entry per
/// range with value `source_range::ALLOW`; the longest match decides.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SourceRangeData {
    pub addr: [u8; 16],
    pub port: u16,
    pub proto: u8,
    pub _pad: u8,
    pub src: [u8; 16],
}

/// Values of `LB_SOURCE_RANGES`.
pub mod source_range {
    pub const DENY: u32 = 0;
    pub const ALLOW: u32 = 1;
    /// Bits of `SourceRangeData` before `src`.
    pub const FRONTEND_BITS: u32 = 160;
}

/// Ageing of timestamped entries (`bpf_ktime_get_ns`, CLOCK_MONOTONIC),
/// the same on every CPU and in the agent. Entries are refreshed by many
/// CPUs at once: one refreshed after this reader took its `now` carries a
/// stamp later than `now`. It is as fresh as an entry can be, so its age
/// is 0 (never `now - stamp` wrapped around to centuries).
pub mod clock {
    /// How long ago `stamp_ns` was, at `now_ns`; 0 if it is later.
    #[inline(always)]
    pub fn age_ns(now_ns: u64, stamp_ns: u64) -> u64 {
        now_ns.saturating_sub(stamp_ns)
    }

    /// Whether an entry stamped `stamp_ns` is still live at `now_ns` with
    /// a lifetime of `timeout_s` seconds (inclusive).
    #[inline(always)]
    pub fn within(now_ns: u64, stamp_ns: u64, timeout_s: u32) -> bool {
        age_ns(now_ns, stamp_ns) <= timeout_s as u64 * 1_000_000_000
    }
}

/// Indexes into the per-CPU `LB_STATS` array. Every packet the tc path
/// drops is counted under exactly one `TC_DROP_*` reason.
pub mod stat {
    /// connect/sendmsg rewritten to a backend.
    pub const TRANSLATED: u32 = 0;
    /// Refused: frontend without backends, a port the VIP does not serve,
    /// or an unallocated address of the guarded Service CIDRs.
    pub const REFUSED: u32 = 1;
    /// recvmsg/getpeername answers rewritten back to the frontend.
    pub const REVERSED: u32 = 2;
    /// Affinity entry reused.
    pub const AFFINITY_HIT: u32 = 3;
    /// tc path: packets translated (forward or reply).
    pub const TC_TRANSLATED: u32 = 4;
    /// tc path, dropped: the frontend has no backend this node may send to
    /// (`externalTrafficPolicy: Local` with endpoints on other nodes only).
    pub const TC_DROP_NO_BACKEND: u32 = 5;
    /// tc path, dropped: every SNAT port tried was taken.
    pub const TC_DROP_SNAT_EXHAUSTED: u32 = 6;
    /// tc path, dropped: masquerade needed but the node has no address of
    /// the packet's family.
    pub const TC_DROP_SNAT_NO_ADDRESS: u32 = 7;
    /// tc path, dropped: the source is outside `loadBalancerSourceRanges`.
    pub const TC_DROP_SOURCE_RANGE: u32 = 8;
    /// tc path, dropped: addressed to a loopback address (CVE-2020-8558).
    pub const TC_DROP_LOOPBACK: u32 = 9;
    /// tc path, dropped: the backend chosen is of the other IP family.
    pub const TC_DROP_FAMILY: u32 = 10;
    /// tc path, dropped: a header rewrite (store or checksum helper) failed.
    pub const TC_DROP_REWRITE: u32 = 11;
    /// tc path, dropped: a new flow's conntrack entries could not be written.
    pub const TC_DROP_CT_FULL: u32 = 12;
    /// tc path, dropped: a TCP packet without SYN and without a flow, or a
    /// client's packet during the handshake that is no SYN and does not
    /// acknowledge the backend's answer (netfilter's INVALID, which
    /// kube-proxy drops).
    pub const TC_DROP_INVALID: u32 = 13;
    /// tc path, dropped: an RST that does not belong to its flow (outside
    /// the window the other end acknowledged).
    pub const TC_DROP_BAD_RST: u32 = 14;
    /// tc path: a SNAT port candidate was taken and the next one tried (not
    /// a drop).
    pub const TC_SNAT_RETRY: u32 = 15;
    /// tc path: answered with a TCP RST or an ICMP port unreachable, for a
    /// Service without endpoints (kube-proxy's REJECT).
    pub const TC_REJECTED: u32 = 16;
    /// tc path, dropped: no route to the backend or client (FIB lookup
    /// failed other than for the MTU).
    pub const TC_DROP_NO_ROUTE: u32 = 17;
    /// tc path: too big for the next hop; answered with ICMP fragmentation
    /// needed / packet too big (the packet itself is dropped).
    pub const TC_FRAG_NEEDED: u32 = 18;
    /// tc path, dropped: a later fragment whose first fragment was not seen.
    pub const TC_DROP_FRAGMENT: u32 = 19;
    /// tc path, passed to the node's stack: a TCP packet without SYN and
    /// without a flow, to a NodePort (`service_flags::NODE_ADDRESS`).
    pub const TC_PASS_NO_FLOW: u32 = 20;
    /// Socket path, dropped at `cgroup_egress`: a pod's or host process's
    /// packet to a LoadBalancer frontend from outside its
    /// `loadBalancerSourceRanges` (kube-proxy drops it on OUTPUT).
    pub const SOCK_DROP_SOURCE_RANGE: u32 = 21;
    /// Socket path: a TCP connect rewritten whose reverse view could not
    /// be recorded (its `SOCK_PEER_PROBES` slots of `LB_SOCK_PEER` all held
    /// by open sockets): its `getpeername` shows the backend, not the
    /// frontend.
    pub const SOCK_PEER_LOST: u32 = 22;
    /// Every value copied out of `LB_SERVICES` for a key (three in a row)
    /// failed its `key_check` (torn, or an element the kernel reused for
    /// another key while the program read it), or an `LB_SLOTS` or `LB_BACKENDS`
    /// element was written for another set or id (by hand: the agent never
    /// publishes a set before its slots): the lookup counts as a miss.
    pub const FOREIGN_VALUE: u32 = 23;
    /// tc path: a new flow to a node-local backend whose reply tuple a live
    /// flow through another frontend holds (one client port to two
    /// frontends of one backend) was given another source port toward the
    /// backend, as netfilter's NAT remaps a clashing connection (not a drop).
    pub const TC_SOURCE_PORT_REMAPPED: u32 = 24;
    /// A frontend's lookup missed while its VIP's marker was there, and a
    /// lookup made again found it: the agent was replacing the frontend's
    /// value (a miss then would have refused a connect or passed a SYN to
    /// the node; see "Recycled elements" in docs/maps.md).
    pub const FRONTEND_LOOKED_UP_AGAIN: u32 = 25;
    /// tc path: a new flow that found no free SNAT port in its tries took
    /// the port of an unfinished handshake idle for a few seconds (mostly
    /// a spoofed SYN's), whose entries went (not a drop).
    pub const TC_SNAT_RECLAIMED: u32 = 26;
    /// A backend chosen for a new flow by a scheduler (not by
    /// sessionAffinity or a flow's record): `CHOSEN + algorithm`, one
    /// counter per `algorithm::NAMES` (`chosen_random` .. `chosen_nq`).
    pub const CHOSEN: u32 = 27;
    /// Outlier detection: a watched TCP connect answered with an RST.
    pub const CONNECT_REFUSED: u32 = 35;
    /// Outlier detection: a watched TCP connect's SYN retransmitted
    /// (unanswered for a second).
    pub const CONNECT_TIMED_OUT: u32 = 36;
    /// A backend quarantined after refused connects.
    pub const EJECTED_REFUSED: u32 = 37;
    /// A backend quarantined after connects that timed out.
    pub const EJECTED_TIMEOUT: u32 = 38;
    /// A quarantine due but not made: it would have passed
    /// `--outlier-max-ejection-percent` or left the frontend no backend.
    pub const EJECTION_CAPPED: u32 = 39;
    /// A new flow whose first pick was quarantined, sent to another.
    pub const QUARANTINE_AVOIDED: u32 = 40;
    /// Outlier detection: a watched TCP connect failed by an ICMP error
    /// (host or network unreachable) before any answer.
    pub const CONNECT_UNREACHABLE: u32 = 41;
    /// A backend quarantined after connects failed unreachable.
    pub const EJECTED_UNREACHABLE: u32 = 42;
    /// Socket path, refused at once: a connect or sendmsg to an address
    /// of the guarded Service CIDRs (`TcConfig::service_ranges`) that no
    /// Service holds (kube-proxy's `cluster-ips-check` drops it); counted
    /// in `REFUSED` too.
    pub const SOCK_REFUSED_UNALLOCATED: u32 = 43;
    /// tc path, dropped: a packet from outside to an address of the
    /// guarded Service CIDRs that no Service holds.
    pub const TC_DROP_UNALLOCATED: u32 = 44;
    /// tc path's XDP stage (`--acceleration`): packets of established
    /// flows translated and sent out in the driver (not counted in
    /// `TC_TRANSLATED`).
    pub const XDP_TRANSLATED: u32 = 45;
    pub const COUNT: u32 = 46;
    /// Each counter's name, as `/metrics` and `inspect` show it.
    pub const NAMES: [&str; COUNT as usize] = [
        "translated",
        "refused",
        "reversed",
        "affinity_hit",
        "tc_translated",
        "tc_drop_no_backend",
        "tc_drop_snat_exhausted",
        "tc_drop_snat_no_address",
        "tc_drop_source_range",
        "tc_drop_loopback",
        "tc_drop_family",
        "tc_drop_rewrite",
        "tc_drop_ct_full",
        "tc_drop_invalid",
        "tc_drop_bad_rst",
        "tc_snat_retry",
        "tc_rejected",
        "tc_drop_no_route",
        "tc_frag_needed",
        "tc_drop_fragment",
        "tc_pass_no_flow",
        "sock_drop_source_range",
        "sock_peer_lost",
        "foreign_value",
        "tc_source_port_remapped",
        "frontend_looked_up_again",
        "tc_snat_reclaimed",
        "chosen_random",
        "chosen_maglev",
        "chosen_rr",
        "chosen_lc",
        "chosen_dh",
        "chosen_sh",
        "chosen_sed",
        "chosen_nq",
        "connect_refused",
        "connect_timed_out",
        "ejected_refused",
        "ejected_timeout",
        "ejection_capped",
        "quarantine_avoided",
        "connect_unreachable",
        "ejected_unreachable",
        "sock_refused_unallocated",
        "tc_drop_unallocated",
        "xdp_translated",
    ];
}

/// The names under which the maps are pinned and show in `bpftool map list`.
pub mod map_names {
    pub const SERVICES: &str = "LB_SERVICES";
    pub const SLOTS: &str = "LB_SLOTS";
    pub const BACKENDS: &str = "LB_BACKENDS";
    pub const REV_SOCK: &str = "LB_REV_SOCK";
    pub const SOCK_PEER: &str = "LB_SOCK_PEER";
    pub const AFFINITY: &str = "LB_AFFINITY";
    pub const STATS: &str = "LB_STATS";
    pub const CONNTRACK: &str = "LB_CONNTRACK";
    pub const CONNTRACK_SYN: &str = "LB_CT_SYN";
    pub const SOURCE_RANGES: &str = "LB_SOURCE_RANGES";
    pub const TC_CONFIG: &str = "LB_TC_CONFIG";
    pub const FRAGMENTS: &str = "LB_FRAGMENTS";
    pub const SOCK_CHECK: &str = "LB_SOCK_CHECK";
    pub const DGRAM_FLOWS: &str = "LB_DGRAM_FLOWS";
    pub const MAGLEV: &str = "LB_MAGLEV";
    pub const UNPROGRAMMED: &str = "LB_UNPROGRAMMED";
    pub const LOCAL_PORTS: &str = "LB_LOCAL_PORTS";
    pub const FRONTEND_PORTS: &str = "LB_FRONTEND_PORTS";
    pub const ROUTE_EPOCH: &str = "LB_ROUTE_EPOCH";
    pub const BACKEND_STATE: &str = "LB_BACKEND_STATE";
    pub const FRONTEND_STATE: &str = "LB_FRONTEND_STATE";
    pub const SOCK_DRAW: &str = "LB_SOCK_DRAW";
    pub const SOCK_BACKEND: &str = "LB_SOCK_BACKEND";
    pub const BACKEND_HEALTH: &str = "LB_BACKEND_HEALTH";
    /// The name each Maglev table (an inner map of `LB_MAGLEV`) is created
    /// under; not pinned, reached through `LB_MAGLEV`.
    pub const MAGLEV_TABLE: &str = "LB_MAGLEV_TABLE";
    pub const ALL: [&str; 24] = [
        SERVICES,
        SLOTS,
        BACKENDS,
        REV_SOCK,
        SOCK_PEER,
        AFFINITY,
        STATS,
        CONNTRACK,
        CONNTRACK_SYN,
        SOURCE_RANGES,
        TC_CONFIG,
        FRAGMENTS,
        SOCK_CHECK,
        DGRAM_FLOWS,
        MAGLEV,
        UNPROGRAMMED,
        LOCAL_PORTS,
        FRONTEND_PORTS,
        ROUTE_EPOCH,
        BACKEND_STATE,
        FRONTEND_STATE,
        SOCK_DRAW,
        SOCK_BACKEND,
        BACKEND_HEALTH,
    ];
}

/// Default capacities; the agent can override each at load time.
pub mod capacity {
    pub const SERVICES: u32 = 65_536;
    /// Two slots per backend: a replaced set and its successor coexist briefly.
    pub const SLOTS: u32 = 524_288;
    pub const BACKENDS: u32 = 262_144;
    pub const REV_SOCK: u32 = 262_144;
    /// Slots for TCP sockets open through a frontend at once
    /// (`LB_SOCK_PEER`, one `SockPeerEntry` each).
    pub const SOCK_PEERS: u32 = 262_144;
    pub const AFFINITY: u32 = 262_144;
    /// Flows of UDP sockets to frontends (one per socket and frontend), as
    /// many as `LB_REV_SOCK` has reverse entries.
    pub const DGRAM_FLOWS: u32 = 262_144;
    /// Entries (two per flow) of established and UDP flows: at least
    /// Cilium's defaults (512k TCP + 256k other).
    pub const CONNTRACK: u32 = 786_432;
    /// Entries (two per flow) of TCP flows whose handshake is not complete:
    /// what a SYN flood fills, apart from the established flows.
    pub const CONNTRACK_SYN: u32 = 262_144;
    pub const SOURCE_RANGES: u32 = 16_384;
    /// Fragmented datagrams in flight (Cilium's default is 8 192).
    pub const FRAGMENTS: u32 = 8_192;
    /// Maglev tables, one per Maglev frontend (each an array of its own, so
    /// kernel memory follows the frontends present: 4 bytes a position); as
    /// many as `SERVICES`, since a table and its replacement coexist briefly.
    pub const MAGLEV: u32 = 65_536;
    /// Frontends `LB_UNPROGRAMMED` can list; allocated per entry.
    pub const UNPROGRAMMED: u32 = 65_536;
    /// `LB_LOCAL_PORTS`: every TCP and UDP port, a bit each.
    pub const LOCAL_PORTS: u32 = super::PortBits::ELEMENTS;
    /// `LB_FRONTEND_PORTS`: every TCP and UDP port, a bit each.
    pub const FRONTEND_PORTS: u32 = super::PortBits::ELEMENTS;
}

const _: () = {
    assert!(core::mem::size_of::<ServiceKey>() == 20);
    assert!(core::mem::align_of::<ServiceKey>() == 4);
    assert!(core::mem::align_of::<SockPeer>() == 4);
    assert!(core::mem::align_of::<CtKey>() == 4);
    assert!(core::mem::size_of::<ServiceValue>() == 32);
    assert!(core::mem::offset_of!(ServiceValue, slot_base) == 28);
    assert!(core::mem::offset_of!(ServiceValue, key_check) == 24);
    assert!(core::mem::offset_of!(ServiceValue, affinity_timeout) == 16);
    assert!(core::mem::offset_of!(ServiceValue, affinity_id) == 20);
    assert!(core::mem::offset_of!(AffinityKey, affinity_id) == 16);
    assert!(core::mem::offset_of!(AffinityKey, kind) == 20);
    assert!(core::mem::size_of::<BackendSlotKey>() == 8);
    assert!(core::mem::size_of::<BackendSlot>() == 8);
    assert!(core::mem::size_of::<BackendId>() == 4);
    assert!(core::mem::size_of::<Backend>() == 24);
    assert!(core::mem::offset_of!(Backend, key_check) == 20);
    assert!(core::mem::size_of::<ReverseSockKey>() == 32);
    assert!(core::mem::size_of::<ReverseSockValue>() == 24);
    assert!(core::mem::size_of::<SockPeer>() == 36);
    assert!(core::mem::size_of::<SockPeerEntry>() == 48);
    assert!(core::mem::offset_of!(SockPeerEntry, check) == 44);
    assert!(SOCK_PEER_PROBES > 0);
    assert!(core::mem::size_of::<PortBits>() == 8);
    assert!(core::mem::size_of::<SockSourceCheck>() == 4);
    assert!(core::mem::size_of::<AffinityKey>() == 24);
    assert!(core::mem::size_of::<AffinityEntry>() == 16);
    assert!(core::mem::size_of::<DatagramFlowKey>() == 32);
    assert!(core::mem::offset_of!(DatagramFlowKey, port) == 24);
    assert!(core::mem::offset_of!(DatagramFlowKey, proto) == 26);
    assert!(core::mem::size_of::<DatagramFlow>() == 16);
    assert!(core::mem::size_of::<CtKey>() == 40);
    assert!(core::mem::size_of::<CtEntry>() == 88);
    assert!(core::mem::offset_of!(CtEntry, hop) == 64);
    assert!(core::mem::size_of::<NextHop>() == 24);
    assert!(core::mem::offset_of!(NextHop, len) == 16);
    assert!(core::mem::offset_of!(NextHop, check) == 20);
    assert!(core::mem::size_of::<TcConfig>() == 344);
    assert!(core::mem::offset_of!(TcConfig, service_ranges) == 80);
    assert!(core::mem::size_of::<ServiceRanges>() == 8 + 32 * SERVICE_RANGES);
    assert!(core::mem::size_of::<SourceRangeData>() == 36);
    assert!(core::mem::size_of::<FragKey>() == 40);
    assert!(core::mem::size_of::<FragEntry>() == 40);
    assert!(core::mem::size_of::<Unprogrammed>() == 152);
    assert!(core::mem::size_of::<MaglevEntry>() == 256);
    assert!(MAGLEV_POSITIONS.is_power_of_two());
    assert!(core::mem::size_of::<BackendState>() == 16);
    assert!(core::mem::size_of::<FrontendState>() == 8);
    assert!(core::mem::size_of::<SockDraw>() == 16);
    assert!(core::mem::size_of::<BackendHealth>() == 24);
    assert!(core::mem::offset_of!(BackendHealth, until_ns) == 16);
};

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // SAFETY: every type is #[repr(C)], Copy, made only of integers and byte
    // arrays with explicit padding fields, so any bit pattern is valid.
    unsafe impl aya::Pod for ServiceKey {}
    unsafe impl aya::Pod for BackendHealth {}
    unsafe impl aya::Pod for ServiceValue {}
    unsafe impl aya::Pod for BackendSlotKey {}
    unsafe impl aya::Pod for BackendSlot {}
    unsafe impl aya::Pod for BackendId {}
    unsafe impl aya::Pod for Backend {}
    unsafe impl aya::Pod for ReverseSockKey {}
    unsafe impl aya::Pod for ReverseSockValue {}
    unsafe impl aya::Pod for SockPeer {}
    unsafe impl aya::Pod for SockPeerEntry {}
    unsafe impl aya::Pod for PortBits {}
    unsafe impl aya::Pod for SockSourceCheck {}
    unsafe impl aya::Pod for AffinityKey {}
    unsafe impl aya::Pod for AffinityEntry {}
    unsafe impl aya::Pod for DatagramFlowKey {}
    unsafe impl aya::Pod for DatagramFlow {}
    unsafe impl aya::Pod for CtKey {}
    unsafe impl aya::Pod for CtEntry {}
    unsafe impl aya::Pod for NextHop {}
    unsafe impl aya::Pod for TcConfig {}
    unsafe impl aya::Pod for SourceRangeData {}
    unsafe impl aya::Pod for FragKey {}
    unsafe impl aya::Pod for FragEntry {}
    unsafe impl aya::Pod for Unprogrammed {}
    unsafe impl aya::Pod for MaglevEntry {}
    unsafe impl aya::Pod for BackendState {}
    unsafe impl aya::Pod for FrontendState {}
    unsafe impl aya::Pod for SockDraw {}
}

/// Backend selection shared by every hook, kept free of helpers so that host
/// tests cover it.
pub mod select {
    use super::{service_flags, AffinityEntry, ServiceValue};

    /// Whether the frontend selects through its Maglev table now: it has one
    /// and has active backends (the terminating fallback is always random).
    #[inline(always)]
    pub fn uses_maglev(svc: &ServiceValue) -> bool {
        svc.flags & service_flags::MAGLEV != 0 && svc.maglev_size > 0 && svc.active > 0
    }

    /// The position in the frontend's Maglev table for a flow hash (see
    /// `uses_maglev`).
    #[inline(always)]
    pub fn maglev_position(svc: &ServiceValue, flow_hash: u32) -> u32 {
        // No panic path for a size of 0 (the verifier rejects a program
        // that ends in one); `uses_maglev` is checked first anyway.
        flow_hash.checked_rem(svc.maglev_size as u32).unwrap_or(0)
    }

    /// Where a table position lives: its `MaglevEntry` and the index in it.
    #[inline(always)]
    pub fn maglev_entry(position: u32) -> (u32, usize) {
        let per = crate::MAGLEV_POSITIONS as u32;
        (position / per, (position & (per - 1)) as usize)
    }

    /// Whether an affinity entry still binds its client at `now_ns`: used
    /// within `timeout_s` seconds (inclusive, as kube-proxy's `--seconds`).
    #[inline(always)]
    pub fn affinity_live(entry: &AffinityEntry, now_ns: u64, timeout_s: u32) -> bool {
        crate::clock::within(now_ns, entry.last_used_ns, timeout_s)
    }

    /// A 32-bit mix of the socket-path flow identity (murmur3's finalizer on
    /// a combination of the words, this node's secret among them); cheap
    /// and well spread for Maglev.
    #[inline(always)]
    pub fn flow_hash(socket_cookie: u64, netns_cookie: u64, service_id: u32, secret: u64) -> u32 {
        let mut h =
            socket_cookie ^ netns_cookie.rotate_left(32) ^ (service_id as u64) << 17 ^ secret;
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
        h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        h ^= h >> 33;
        h as u32
    }

    /// A uniformly random draw for the socket path (a backend for a new
    /// connection when neither Maglev nor affinity decides): one step of
    /// this CPU's SplitMix64 sequence `state`, mixed with the CPU's number
    /// so that CPUs whose sequences start alike draw apart. It takes no
    /// helper call where `bpf_get_prandom_u32` does (60-130 ns of a
    /// connect on a kernel that returns from every call through the SRSO
    /// thunk). A socket connecting again (after ECONNREFUSED from a backend
    /// gone stale) draws afresh, since the sequence has moved on.
    #[inline(always)]
    pub fn draw(state: &mut u64, cpu: u32) -> u32 {
        *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = *state ^ (cpu as u64).wrapping_mul(0xd6e8_feb8_6659_fd93);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 32) as u32
    }

    /// A 32-bit hash of a packet's 5-tuple, for Maglev on the tc path: the
    /// same flow always lands on the same table position.
    #[inline(always)]
    pub fn tuple_hash(src: &[u8; 16], dst: &[u8; 16], sport: u16, dport: u16, proto: u8) -> u32 {
        let word = |a: &[u8; 16], i: usize| {
            u64::from_le_bytes([
                a[i],
                a[i + 1],
                a[i + 2],
                a[i + 3],
                a[i + 4],
                a[i + 5],
                a[i + 6],
                a[i + 7],
            ])
        };
        let mut h = word(src, 0)
            ^ word(src, 8).rotate_left(13)
            ^ word(dst, 0).rotate_left(29)
            ^ word(dst, 8).rotate_left(41)
            ^ ((sport as u64) << 32 | (dport as u64) << 8 | proto as u64);
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
        h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        h ^= h >> 33;
        h as u32
    }

    /// The slots a new flow chooses among, as `(first, count)`: the active
    /// ones, or the terminating ones while none is active (KEP-1669).
    /// `None` when there is neither.
    #[inline(always)]
    pub fn candidates(svc: &ServiceValue) -> Option<(u32, u32)> {
        let (base, count) = if svc.active > 0 {
            (0u32, svc.active as u32)
        } else {
            (svc.active as u32, svc.terminating as u32)
        };
        (count > 0).then_some((base, count))
    }

    /// Round-robin: the slot of turn `turn` (a frontend's cursor, stepped
    /// once per new flow).
    #[inline(always)]
    pub fn rr_slot(svc: &ServiceValue, turn: u32) -> Option<u32> {
        let (base, count) = candidates(svc)?;
        Some(base + turn % count)
    }

    /// How many backends lc, sed and nq compare at most per new flow: a
    /// frontend with more is sampled, `LEAST_SCAN` backends in a row from
    /// a random one. 64 keeps a connect's scan within the verifier's and
    /// the latency budget and covers most Services whole.
    pub const LEAST_SCAN: u32 = 64;

    /// lc (and sed and nq, which choose alike with every weight 1): the
    /// slot whose backend has the fewest open connections (`open(slot)`,
    /// `None` for a slot that does not resolve, which is skipped), of at
    /// most `LEAST_SCAN` candidates from the one `random` names. The scan
    /// starts there, so that ties go to a random backend, not to the first
    /// (IPVS takes the first, and every node then sends its next
    /// connection to one backend, kubernetes#79213). A backend with no
    /// open connection ends the scan: nothing beats it (nq's idle server).
    #[inline(always)]
    pub fn least_loaded(
        svc: &ServiceValue,
        random: u32,
        mut open: impl FnMut(u32) -> Option<u32>,
    ) -> Option<u32> {
        let (base, count) = candidates(svc)?;
        let start = random % count;
        // Plain integers, not an `Option` of a pair: LLVM leaves a `None`'s
        // payload undefined and may read it from a register never
        // written, which the verifier rejects.
        let (mut best, mut fewest) = (u32::MAX, u32::MAX);
        let mut i = 0;
        while i < LEAST_SCAN && i < count {
            let mut at = start + i;
            if at >= count {
                at -= count;
            }
            let slot = base + at;
            if let Some(n) = open(slot) {
                if n == 0 {
                    return Some(slot);
                }
                if n < fewest {
                    (best, fewest) = (slot, n);
                }
            }
            i += 1;
        }
        (best != u32::MAX).then_some(best)
    }

    /// A socket-path hash made node-specific: `h` mixed with this node's
    /// secret (`SockDraw::secret`), so that cookies, which count alike
    /// on every node, hash apart on each.
    #[inline(always)]
    pub fn salted(h: u64, secret: u64) -> u64 {
        let mut z = h ^ secret;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// sh on the socket path: the client (the socket's network namespace)
    /// hashed with this node's secret, the same for every socket of a pod.
    #[inline(always)]
    pub fn netns_hash(netns_cookie: u64, secret: u64) -> u32 {
        (salted(netns_cookie, secret) >> 32) as u32
    }

    /// sh on the tc path: the client's address, unsalted, so that a client
    /// reaches the same backend through any node (the tables are built
    /// alike on every node).
    #[inline(always)]
    pub fn address_hash(addr: &[u8; 16]) -> u32 {
        let w = |i: usize| {
            u64::from_le_bytes([
                addr[i],
                addr[i + 1],
                addr[i + 2],
                addr[i + 3],
                addr[i + 4],
                addr[i + 5],
                addr[i + 6],
                addr[i + 7],
            ])
        };
        (salted(w(0) ^ w(8).rotate_left(23), 0x5348_5f63_6c69_656e) >> 32) as u32
    }

    /// dh: the frontend's address and port, unsalted, so that every node
    /// sends one frontend's connections to the same backend.
    #[inline(always)]
    pub fn destination_hash(addr: &[u8; 16], port: u16) -> u32 {
        address_hash(addr) ^ (salted(port as u64, 0x4448_5f70_6f72_7400) >> 32) as u32
    }

    /// The slot a new flow goes to, given a random number: uniformly among
    /// the active slots, or among the terminating ones when no backend is
    /// active (KEP-1669). `None` means the Service has no backend to offer
    /// and the connection is refused.
    #[inline(always)]
    pub fn slot(svc: &ServiceValue, random: u32) -> Option<u32> {
        let (base, count) = if svc.active > 0 {
            (0u32, svc.active as u32)
        } else {
            (svc.active as u32, svc.terminating as u32)
        };
        if count == 0 {
            None
        } else {
            Some(base + random % count)
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        fn svc(active: u16, terminating: u16) -> ServiceValue {
            ServiceValue {
                id: 1,
                backend_set: 1,
                active,
                terminating,
                flags: 0,
                maglev_size: 0,
                affinity_timeout: 0,
                affinity_id: 0,
                key_check: 0,
                slot_base: 0,
            }
        }

        #[test]
        fn picks_only_active_slots_when_any_is_active() {
            for r in 0..100 {
                assert!(slot(&svc(3, 2), r).unwrap() < 3);
            }
        }

        #[test]
        fn falls_back_to_terminating_slots() {
            for r in 0..100 {
                let s = slot(&svc(0, 2), r).unwrap();
                assert!(s < 2, "{s}");
            }
        }

        #[test]
        fn no_backend_means_none() {
            assert_eq!(slot(&svc(0, 0), 7), None);
        }

        #[test]
        fn maglev_positions_cover_the_table() {
            let mut s = svc(3, 1);
            s.flags = service_flags::MAGLEV;
            s.maglev_size = 7;
            assert!(uses_maglev(&s));
            let mut seen = [false; 7];
            for h in 0..50 {
                seen[maglev_position(&s, h) as usize] = true;
            }
            assert_eq!(seen, [true; 7]);
            // No active backend: the terminating fallback is random.
            assert!(!uses_maglev(&svc(0, 1)));
        }

        #[test]
        fn affinity_expires_after_the_timeout() {
            let e = AffinityEntry {
                backend_id: 1,
                _pad: 0,
                last_used_ns: 5_000_000_000,
            };
            assert!(affinity_live(&e, 7_000_000_000, 2));
            assert!(!affinity_live(&e, 7_000_000_001, 2));
            // Refreshed by another CPU after this one read the clock.
            assert!(affinity_live(&e, 4_999_999_999, 2));
            assert!(affinity_live(&e, 0, 0));
        }

        #[test]
        fn a_datagram_flow_expires_after_the_udp_timeout() {
            let f = crate::DatagramFlow {
                backend_id: 1,
                service_id: 2,
                last_used_ns: 5_000_000_000,
            };
            assert!(f.live(65_000_000_000, 60));
            assert!(!f.live(65_000_000_001, 60));
            // Used on another CPU after this one read the clock.
            assert!(f.live(4_000_000_000, 1));
        }

        #[test]
        fn draw_is_uniform_and_cpus_draw_apart() {
            // One CPU's sequence over 3 and 8 backends.
            for n in [3u32, 8] {
                let mut state = 0u64;
                let mut buckets = [0u32; 8];
                for _ in 0..8000 {
                    buckets[(draw(&mut state, 0) % n) as usize] += 1;
                }
                let expect = 8000 / n;
                for b in &buckets[..n as usize] {
                    assert!(b.abs_diff(expect) < expect / 8, "{n}: {buckets:?}");
                }
            }
            // Two CPUs whose sequences are at the same step (both start at
            // 0): their draws are not correlated.
            for (c1, c2) in [(0, 1), (1, 2), (0, 63)] {
                let (mut a, mut b) = (0u64, 0u64);
                let same = (0..8000)
                    .filter(|_| draw(&mut a, c1) % 8 == draw(&mut b, c2) % 8)
                    .count();
                assert!((800..1200).contains(&same), "cpus {c1} {c2}: {same}");
            }
        }

        #[test]
        fn flow_hash_spreads_sockets() {
            let mut buckets = [0u32; 8];
            for cookie in 0..8000u64 {
                buckets[(flow_hash(cookie, 4096, 3, 0x1234) % 8) as usize] += 1;
            }
            for b in buckets {
                assert!((800..1200).contains(&b), "{buckets:?}");
            }
        }

        #[test]
        fn rr_takes_the_candidates_in_turn() {
            let s = svc(3, 2);
            let order: [u32; 7] = core::array::from_fn(|t| rr_slot(&s, 10 + t as u32).unwrap());
            assert_eq!(order, [1, 2, 0, 1, 2, 0, 1]);
            // The cursor wraps at 2^32 onto some slot, never past the set.
            assert!(rr_slot(&s, u32::MAX).unwrap() < 3);
            // Only terminating backends: their turns.
            let t = svc(0, 2);
            assert_eq!([rr_slot(&t, 0), rr_slot(&t, 1)], [Some(0), Some(1)]);
            assert_eq!(rr_slot(&svc(0, 0), 5), None);
        }

        #[test]
        fn least_loaded_takes_the_fewest_and_breaks_ties_at_random() {
            let s = svc(4, 0);
            let open = [3u32, 1, 2, 1];
            let mut seen = [0u32; 4];
            for r in 0..400 {
                let slot = least_loaded(&s, r, |i| Some(open[i as usize])).unwrap();
                seen[slot as usize] += 1;
            }
            // Slots 1 and 3 tie; each is taken, the others never.
            assert_eq!(seen[0] + seen[2], 0, "{seen:?}");
            assert!(seen[1] >= 100 && seen[3] >= 100, "{seen:?}");
            // An idle backend ends the scan; a slot that does not resolve
            // is skipped.
            let open = [Some(5), None, Some(0), Some(7)];
            for r in 0..8 {
                assert_eq!(least_loaded(&s, r, |i| open[i as usize]), Some(2));
            }
            assert_eq!(least_loaded(&s, 0, |_| None), None);
            assert_eq!(least_loaded(&svc(0, 0), 0, |_| Some(0)), None);
            // Only terminating backends: chosen among them.
            assert_eq!(
                least_loaded(&svc(0, 2), 1, |i| Some([4, 3][i as usize])),
                Some(1)
            );
        }

        #[test]
        fn least_loaded_samples_large_sets() {
            let s = svc(1000, 0);
            let mut looked = 0;
            let chosen = least_loaded(&s, 990, |i| {
                looked += 1;
                Some(if i == 5 { 1 } else { 2 })
            })
            .unwrap();
            assert_eq!(looked, LEAST_SCAN);
            // 990..999 and 0..53 were compared: slot 5 among them.
            assert_eq!(chosen, 5);
        }

        #[test]
        fn salted_hashes_differ_per_node() {
            // Two nodes' secrets: their netns hashes of the same cookies
            // agree no more often than chance would.
            let same = (1..4001u64)
                .filter(|c| netns_hash(*c, 0x1111) % 4 == netns_hash(*c, 0x2222) % 4)
                .count();
            assert!((800..1200).contains(&same), "{same}");
            assert_ne!(flow_hash(7, 8, 9, 1), flow_hash(7, 8, 9, 2));
            // The tc path's client hash is the same everywhere.
            let a = crate::ipv4_mapped([192, 0, 2, 7]);
            assert_eq!(address_hash(&a), address_hash(&a));
            assert_ne!(destination_hash(&a, 80), destination_hash(&a, 81));
        }

        #[test]
        fn a_value_of_an_earlier_agent_keeps_its_algorithm() {
            let mut s = svc(2, 0);
            assert_eq!(s.algorithm(), crate::algorithm::RANDOM);
            s.flags = service_flags::MAGLEV;
            assert_eq!(s.algorithm(), crate::algorithm::MAGLEV);
            for a in 0..crate::algorithm::NAMES.len() as u8 {
                s.flags = service_flags::AFFINITY | crate::algorithm::flags(a);
                assert_eq!(s.algorithm(), a, "{}", crate::algorithm::NAMES[a as usize]);
            }
        }

        #[test]
        fn spreads_evenly() {
            let mut hits = [0u32; 4];
            for r in 0..4000 {
                hits[slot(&svc(4, 0), r).unwrap() as usize] += 1;
            }
            assert_eq!(hits, [1000; 4]);
        }
    }
}

#[cfg(test)]
mod sock_peer_tests {
    use super::*;

    fn peer(backend: u8, frontend: u8) -> SockPeer {
        SockPeer {
            backend_addr: ipv4_mapped([10, 244, 0, backend]),
            frontend_addr: ipv4_mapped([10, 96, 0, frontend]),
            backend_port: 8080,
            frontend_port: 80,
        }
    }

    #[test]
    fn an_entry_answers_only_its_own_socket() {
        let e = SockPeerEntry::new(7, peer(1, 10));
        assert_eq!(e.peer_of(7), Some(peer(1, 10)));
        assert_eq!(e.peer_of(8), None);
        assert_eq!(e.peer_of(7 + (1 << 32)), None);
        // A free slot is no socket's.
        let free = SockPeerEntry {
            cookie: 0,
            peer: peer(0, 0),
            check: 0,
        };
        assert_eq!(free.peer_of(0), None);
    }

    /// Two sockets writing one slot at once can leave one's cookie with
    /// any mix of both peers' fields: none of them passes.
    #[test]
    fn a_torn_entry_answers_nobody() {
        let (a, b) = (
            SockPeerEntry::new(7, peer(1, 10)),
            SockPeerEntry::new(9, peer(2, 11)),
        );
        let torn = [
            SockPeerEntry {
                cookie: a.cookie,
                ..b
            },
            SockPeerEntry { peer: b.peer, ..a },
            SockPeerEntry {
                check: b.check,
                ..a
            },
            SockPeerEntry {
                peer: SockPeer {
                    backend_addr: b.peer.backend_addr,
                    ..a.peer
                },
                ..a
            },
            SockPeerEntry {
                peer: SockPeer {
                    frontend_addr: b.peer.frontend_addr,
                    ..a.peer
                },
                ..a
            },
            SockPeerEntry {
                peer: SockPeer {
                    frontend_port: 443,
                    ..a.peer
                },
                ..a
            },
        ];
        for (i, e) in torn.iter().enumerate() {
            assert_eq!(e.peer_of(7), None, "torn entry {i}");
            assert_eq!(e.peer_of(9), None, "torn entry {i}");
        }
    }
}

#[cfg(test)]
mod service_check_tests {
    use super::*;

    /// A copy made of two values, each written whole for its key, fails
    /// the check whichever 8-byte word comes from the other value: the
    /// program then looks the value up again instead of using it.
    #[test]
    fn a_value_torn_between_two_passes_no_check() {
        let key = ServiceKey::wildcard(ipv4_mapped([10, 96, 0, 10]), scope::INTERNAL);
        let key = ServiceKey {
            port: 80,
            proto: proto::TCP,
            ..key
        };
        let other_key = ServiceKey { port: 443, ..key };
        let stamp = |mut v: ServiceValue, k: &ServiceKey| {
            v.key_check = v.check_for(k);
            v
        };
        // SAFETY: every field is an integer, for which zeros are valid.
        let zeros: ServiceValue = unsafe { core::mem::zeroed() };
        let ours = stamp(
            ServiceValue {
                id: 1,
                backend_set: 10,
                active: 2,
                ..zeros
            },
            &key,
        );
        let theirs = stamp(
            ServiceValue {
                id: 2,
                backend_set: 11,
                active: 3,
                slot_base: 2,
                ..ours
            },
            &other_key,
        );
        assert_eq!(ours.key_check, ours.check_for(&key));
        assert_ne!(
            theirs.key_check,
            theirs.check_for(&key),
            "another key's value"
        );
        let words = |v: &ServiceValue| -> [u64; 4] { unsafe { core::mem::transmute(*v) } };
        for mixed in 1..15u32 {
            let (a, b) = (words(&ours), words(&theirs));
            let torn: [u64; 4] =
                core::array::from_fn(|i| if mixed & (1 << i) != 0 { b[i] } else { a[i] });
            if torn == a || torn == b {
                // The words that differ all come from one value.
                continue;
            }
            let torn: ServiceValue = unsafe { core::mem::transmute(torn) };
            assert_ne!(
                torn.key_check,
                torn.check_for(&key),
                "words {mixed:04b} from the other value"
            );
        }
    }

    /// The checks pinned entries carry stay what an agent before the
    /// word-at-a-time reads (`addr_words`) wrote: fixed values, computed by
    /// that version, for an IPv4 and an IPv6 frontend and a socket's peer.
    #[test]
    fn checks_keep_their_values_across_versions() {
        let v4 = ServiceKey {
            addr: ipv4_mapped([10, 96, 0, 10]),
            port: 53,
            proto: proto::UDP,
            scope: scope::INTERNAL,
        };
        let mut v6_addr = [0u8; 16];
        for (i, b) in v6_addr.iter_mut().enumerate() {
            *b = 0xf0 ^ (i as u8 * 17);
        }
        let v6 = ServiceKey {
            addr: v6_addr,
            port: 443,
            proto: proto::TCP,
            scope: scope::EXTERNAL,
        };
        let peer = SockPeer {
            backend_addr: v6_addr,
            frontend_addr: ipv4_mapped([10, 96, 0, 10]),
            backend_port: 8443,
            frontend_port: 443,
        };
        assert_eq!(
            [
                v4.key_check(),
                v6.key_check(),
                SockPeerEntry::digest(0x0123_4567_89ab_cdef, &peer)
            ],
            [70_350_467, 3_148_182_503, 137_108_164]
        );
    }

    /// An `LB_SLOTS` element gives its backend only for its own set and
    /// position; a free (zeroed) element for none.
    #[test]
    fn a_slot_names_only_its_set_and_position() {
        let s = BackendSlot::new(7, 3, 42);
        assert_eq!(s.backend_of(7, 3), Some(42));
        assert_eq!(s.backend_of(7, 2), None);
        assert_eq!(s.backend_of(8, 3), None);
        assert_eq!(BackendSlot::default().backend_of(0, 0), None);
    }
}

#[cfg(test)]
mod port_bits_tests {
    use super::*;

    /// Every (protocol, port) has an element and a bit of its own: no two
    /// share both, and every element is within the map.
    #[test]
    fn each_port_of_each_protocol_has_its_own_bit() {
        let mut seen = [[false; 64]; PortBits::ELEMENTS as usize];
        for p in [proto::TCP, proto::UDP] {
            for port in 0..=u16::MAX {
                let i = PortBits::index(p, port).unwrap();
                assert!(i < PortBits::ELEMENTS, "{p} {port}: {i}");
                let only = PortBits::default().with(port);
                assert_eq!(only.ports.count_ones(), 1);
                let bit = &mut seen[i as usize][only.ports.trailing_zeros() as usize];
                assert!(!*bit, "{p} {port}");
                *bit = true;
            }
        }
        assert_eq!(PortBits::index(proto::SCTP, 80), None);
    }

    /// `marked` gives back exactly what `index` and `with` put in.
    #[test]
    fn marked_ports_read_back_as_written() {
        for (p, port) in [
            (proto::TCP, 0),
            (proto::TCP, 8080),
            (proto::TCP, 65_535),
            (proto::UDP, 0),
            (proto::UDP, 53),
            (proto::UDP, 65_535),
        ] {
            let i = PortBits::index(p, port).unwrap();
            let e = PortBits::default().with(port);
            let mut it = e.marked(i);
            assert_eq!(it.next(), Some((p, port)));
            assert_eq!(it.next(), None);
        }
        let i = PortBits::index(proto::TCP, 30_080).unwrap();
        let e = PortBits::default().with(30_081).with(30_080);
        let mut it = e.marked(i);
        assert_eq!(it.next(), Some((proto::TCP, 30_080)));
        assert_eq!(it.next(), Some((proto::TCP, 30_081)));
        assert_eq!(it.next(), None);
        assert_eq!(e.marked(PortBits::ELEMENTS).next(), None, "past the map");
    }

    #[test]
    fn a_marked_port_leaves_its_neighbours_unmarked() {
        for (port, next) in [(0, 1), (63, 62), (64, 65), (8080, 8081), (65_535, 65_534)] {
            let e = PortBits::default().with(port);
            assert!(e.has(port), "{port}");
            assert!(!e.has(next), "{port}: {next}");
            assert_eq!(
                PortBits::index(proto::TCP, port),
                PortBits::index(proto::TCP, next)
            );
            assert_ne!(
                PortBits::index(proto::TCP, port),
                PortBits::index(proto::UDP, port)
            );
        }
    }
}

#[cfg(test)]
mod service_range_tests {
    extern crate std;
    use super::{ipv4_mapped, ServiceRange, ServiceRanges, SERVICE_RANGES};
    use std::vec::Vec;

    fn v6(s: &str) -> [u8; 16] {
        s.parse::<std::net::Ipv6Addr>().unwrap().octets()
    }

    fn v4(a: [u8; 4]) -> [u8; 16] {
        ipv4_mapped(a)
    }

    fn ranges(list: &[ServiceRange]) -> ServiceRanges {
        let mut r = ServiceRanges::default();
        r.ranges[..list.len()].copy_from_slice(list);
        r.len = list.len() as u32;
        r
    }

    #[test]
    fn an_address_is_guarded_only_inside_a_range_of_its_family() {
        let set = ranges(&[
            ServiceRange::prefix(v4([10, 96, 0, 0]), 96 + 16),
            ServiceRange::prefix(v6("fd00:10:96::"), 112),
        ]);
        let cases: &[([u8; 16], bool)] = &[
            (v4([10, 96, 0, 0]), true),
            (v4([10, 96, 0, 10]), true),
            (v4([10, 96, 255, 255]), true),
            (v4([10, 97, 0, 1]), false),
            (v4([10, 95, 255, 255]), false),
            (v4([192, 168, 1, 1]), false),
            (v6("fd00:10:96::1"), true),
            (v6("fd00:10:96::ffff"), true),
            (v6("fd00:10:96::1:0"), false),
            (v6("fd00:10:97::1"), false),
            // The IPv4 range's bits, not IPv4-mapped: another address.
            (v6("::a60:1"), false),
        ];
        for (addr, guarded) in cases {
            assert_eq!(set.contains(addr), *guarded, "{addr:?}");
        }
    }

    #[test]
    fn only_the_first_len_ranges_count() {
        let mut set = ranges(&[ServiceRange::prefix(v4([10, 96, 0, 0]), 112)]);
        set.ranges[1] = ServiceRange::prefix(v4([10, 200, 0, 0]), 112);
        assert!(!set.contains(&v4([10, 200, 0, 1])), "past len");
        assert!(!ServiceRanges::default().contains(&[0; 16]), "empty");
        let full: Vec<ServiceRange> = (0..SERVICE_RANGES as u8)
            .map(|i| ServiceRange::prefix(v4([10, i, 0, 0]), 112))
            .collect();
        let set = ranges(&full);
        for i in 0..SERVICE_RANGES as u8 {
            assert!(set.contains(&v4([10, i, 1, 2])));
        }
        assert!(!set.contains(&v4([10, SERVICE_RANGES as u8, 1, 2])));
    }

    #[test]
    fn a_prefix_clears_host_bits_and_gives_them_back() {
        let r = ServiceRange::prefix(v4([10, 96, 7, 9]), 96 + 12);
        assert_eq!(r.addr_and_bits(), (v4([10, 96, 0, 0]), 108));
        assert_eq!(
            ServiceRange::prefix(v6("fd00::1"), 128).addr_and_bits().1,
            128
        );
        // /0 matches everything (the agent never writes one: it rejects
        // a prefix that would cover the other family).
        let all = ranges(&[ServiceRange::prefix([0; 16], 0)]);
        assert!(all.contains(&v6("2001:db8::1")) && all.contains(&v4([1, 2, 3, 4])));
    }
}
