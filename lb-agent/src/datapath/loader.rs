//! The kernel side as the agent owns it: loading the embedded object, pinning
//! its maps, attaching the socket programs to a cgroup, and `MapOps` over the
//! pinned maps.
use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context as _};
use aya::{
    maps::{
        Array, HashMap, HashOfMaps, IterableMap as _, Map, MapData, MapError, MapInfo, PerCpuArray,
        PerCpuValues,
    },
    programs::{
        links::{FdLink, PinnedLink},
        CgroupAttachMode, CgroupSkb, CgroupSkbAttachType, CgroupSock, CgroupSockAddr, Program,
        SockOps,
    },
    Ebpf, EbpfLoader,
};
use lb_common::{
    map_names, AffinityEntry, AffinityKey, Backend, BackendHealth, BackendId, BackendSlot,
    BackendState, DatagramFlow, DatagramFlowKey, FrontendState, KeyCheck, MaglevEntry, ServiceKey,
    ServiceValue, SockDraw, Unprogrammed, MAGLEV_POSITIONS,
};

use crate::{
    base::clock::monotonic_now_ns,
    datapath::affinity::{self, AffinityPolicy},
    datapath::datagram_flows::{self, DatagramPolicy, FlowFrontend},
    datapath::features::KernelFeatures,
    datapath::mapped::MappedArray,
    datapath::reconcile::{MaglevWriteError, MapOps},
    datapath::sweep::{self, SweepReport},
};

/// Map sizes; the defaults are `lb_common::capacity`.
#[derive(Debug, Clone, clap::Args)]
pub struct Capacity {
    #[arg(long, default_value_t = lb_common::capacity::SERVICES)]
    pub max_services: u32,
    #[arg(long, default_value_t = lb_common::capacity::BACKENDS)]
    pub max_backends: u32,
    /// Backend slots in use at once over all Services; twice the backends
    /// leaves room for a set and its replacement. (`LB_SLOTS` is an array
    /// of twice this, so that a set finds a range: see `slot_ranges`.)
    #[arg(long, default_value_t = lb_common::capacity::SLOTS)]
    pub max_slots: u32,
    /// Maglev tables over all Services (`LB_MAGLEV` entries): one per
    /// Maglev frontend, each an array of `--maglev-table-size` positions
    /// of its own; a table and its replacement coexist briefly.
    #[arg(long, default_value_t = lb_common::capacity::MAGLEV)]
    pub max_maglev_tables: u32,
    #[arg(long, default_value_t = lb_common::capacity::REV_SOCK)]
    pub max_reverse_sockets: u32,
    /// Slots for TCP sockets open through a frontend at once
    /// (`LB_SOCK_PEER`, the frontend `getpeername` shows). A socket takes
    /// one of the 4 its cookie names; when all 4 are held, its connect
    /// still works but `getpeername` shows the backend (`sock_peer_lost`).
    #[arg(long, default_value_t = lb_common::capacity::SOCK_PEERS,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub max_sock_peers: u32,
    #[arg(long, default_value_t = lb_common::capacity::AFFINITY)]
    pub max_affinity: u32,
    /// Flows of UDP sockets to frontends (one per socket and frontend):
    /// what keeps an unconnected socket's datagrams on one backend.
    #[arg(long, default_value_t = lb_common::capacity::DGRAM_FLOWS)]
    pub max_datagram_flows: u32,
    /// Established TCP and UDP flows of the tc path (two entries each:
    /// forward and reply).
    #[arg(long, default_value_t = lb_common::capacity::CONNTRACK)]
    pub max_conntrack: u32,
    /// TCP flows of the tc path whose handshake is not complete (two
    /// entries each): what a SYN flood can fill, apart from the others.
    #[arg(long, default_value_t = lb_common::capacity::CONNTRACK_SYN)]
    pub max_conntrack_syn: u32,
    /// Whether the programs check a destination no Service holds against
    /// the guarded Service CIDRs (`SERVICE_RANGE_GUARD`): the agent turns
    /// it off when nothing can configure them (no
    /// `--service-cluster-ip-range`, manifests mode), and the check is then
    /// not in the programs at all. Not a size, but fixed at load as they
    /// are.
    #[arg(skip = true)]
    pub service_range_guard: bool,
}

impl Default for Capacity {
    fn default() -> Self {
        Self {
            max_services: lb_common::capacity::SERVICES,
            max_backends: lb_common::capacity::BACKENDS,
            max_slots: lb_common::capacity::SLOTS,
            max_maglev_tables: lb_common::capacity::MAGLEV,
            max_reverse_sockets: lb_common::capacity::REV_SOCK,
            max_sock_peers: lb_common::capacity::SOCK_PEERS,
            max_affinity: lb_common::capacity::AFFINITY,
            max_datagram_flows: lb_common::capacity::DGRAM_FLOWS,
            max_conntrack: lb_common::capacity::CONNTRACK,
            max_conntrack_syn: lb_common::capacity::CONNTRACK_SYN,
            service_range_guard: true,
        }
    }
}

impl Capacity {
    /// A few entries of each map: enough to load and verify the programs
    /// (`verify_programs`, tests) without the default sizes' memory.
    pub fn small() -> Self {
        Self {
            max_services: 64,
            max_backends: 64,
            max_slots: 128,
            max_maglev_tables: 16,
            max_reverse_sockets: 64,
            max_sock_peers: 64,
            max_affinity: 64,
            max_datagram_flows: 64,
            max_conntrack: 64,
            max_conntrack_syn: 64,
            service_range_guard: true,
        }
    }
}

/// The compiled kernel programs (`lb-ebpf`), embedded by build.rs.
pub static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lb"));

/// The socket programs' hooks. Each gets one program, linked under the
/// hook's name: the hook's own program, or for the hooks that refuse,
/// the one of the refusal (`Refusal::program`).
pub const SOCK_PROGRAMS: [&str; 8] = [
    "connect4",
    "connect6",
    "sendmsg4",
    "sendmsg6",
    "recvmsg4",
    "recvmsg6",
    "getpeername4",
    "getpeername6",
];

/// The hooks whose programs refuse connects and datagrams to a frontend
/// without endpoints, in one of two ways (`lb-ebpf/src/main.rs`).
const REFUSING_HOOKS: [&str; 4] = ["connect4", "connect6", "sendmsg4", "sendmsg6"];

/// How a connect or sendmsg to a Service without endpoints (or to a port
/// its IP does not serve) fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Refusal {
    /// `ECONNREFUSED`, as under kube-proxy: the programs call
    /// `bpf_set_retval`, which sock_addr hooks have since Linux 6.1.
    Econnrefused,
    /// `EPERM`, the hook's own rejection: for older kernels.
    Eperm,
}

impl Refusal {
    /// The best this kernel allows.
    pub fn for_kernel(features: &KernelFeatures) -> Self {
        if features.set_retval_sock_addr {
            Self::Econnrefused
        } else {
            Self::Eperm
        }
    }

    pub fn errno(self) -> i32 {
        match self {
            Self::Econnrefused => libc::ECONNREFUSED,
            Self::Eperm => libc::EPERM,
        }
    }

    /// The object's program for `hook` (one of `SOCK_PROGRAMS`).
    pub fn program(self, hook: &str) -> String {
        match self {
            Self::Eperm if REFUSING_HOOKS.contains(&hook) => format!("{hook}_eperm"),
            _ => hook.to_owned(),
        }
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Econnrefused => "ECONNREFUSED",
            Self::Eperm => "EPERM",
        })
    }
}

/// The cgroup skb egress program that applies `loadBalancerSourceRanges` to
/// the sockets the socket programs marked (see `lb-ebpf/src/egress.rs`).
pub const EGRESS_PROGRAM: &str = "cgroup_egress";

/// The program that forgets a closed TCP socket's peer (`LB_SOCK_PEER`).
pub const RELEASE_PROGRAM: &str = "sock_release";

/// The `sock_ops` program of outlier detection: the outcome of the TCP
/// connects the socket programs sent to a backend (`LB_BACKEND_HEALTH`).
pub const SOCK_OPS_PROGRAM: &str = "lb_sock_ops";

/// `BPF_F_LOCK`: a whole element of a map whose value has a
/// `bpf_spin_lock` is read or written under that lock.
const BPF_F_LOCK: u64 = 4;

/// The mount point whose filesystem type is `fstype`, from /proc/mounts.
pub fn find_mount(fstype: &str) -> anyhow::Result<Option<PathBuf>> {
    let mounts = fs::read_to_string("/proc/mounts").context("reading /proc/mounts")?;
    Ok(mounts.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let (_dev, path, fs) = (fields.next()?, fields.next()?, fields.next()?);
        (fs == fstype).then(|| PathBuf::from(path))
    }))
}

/// The cgroup v2 root; on hybrid hosts it is `/sys/fs/cgroup/unified`.
pub fn cgroup2_root() -> anyhow::Result<PathBuf> {
    find_mount("cgroup2")?.context("no cgroup v2 filesystem is mounted (see /proc/mounts)")
}

/// Makes sure `dir` is on a bpffs, mounting one at /sys/fs/bpf if none is.
pub fn ensure_bpffs(dir: &Path) -> anyhow::Result<()> {
    let mounts = fs::read_to_string("/proc/mounts").context("reading /proc/mounts")?;
    let bpf_mounts: Vec<&str> = mounts
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.get(2) == Some(&"bpf")).then(|| f[1])
        })
        .collect();
    if bpf_mounts.iter().any(|m| dir.starts_with(m)) {
        return Ok(());
    }
    let default = Path::new("/sys/fs/bpf");
    if !dir.starts_with(default) {
        bail!(
            "{} is not on a bpffs; mount one (mount -t bpf bpf <dir>) or use --bpffs under /sys/fs/bpf",
            dir.display()
        );
    }
    let c = |s: &str| std::ffi::CString::new(s).expect("no NUL");
    let (src, target, fstype) = (c("bpf"), c("/sys/fs/bpf"), c("bpf"));
    // SAFETY: valid NUL-terminated strings; no data argument.
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error()).context("mounting bpffs at /sys/fs/bpf");
    }
    tracing::info!("mounted bpffs at /sys/fs/bpf");
    Ok(())
}

/// The loaded programs and the maps the agent writes.
pub struct Datapath {
    /// Owns the programs and their cgroup links: dropping it detaches them.
    _ebpf: Ebpf,
    pin_dir: PathBuf,
    maps: PinnedMaps,
    refusal: Refusal,
    /// The cgroup the socket programs are attached to, once they are.
    cgroup: Option<PathBuf>,
    /// `cgroup_egress` wanted: some frontend has source ranges.
    source_check: bool,
    /// `cgroup_egress` attached (its link pinned).
    egress_attached: bool,
}

/// Typed handles on the pinned maps.
pub struct PinnedMaps {
    pub services: HashMap<MapData, ServiceKey, ServiceValue>,
    /// Backend sets, each a range from its `ServiceValue::slot_base`.
    pub slots: MappedArray<BackendSlot>,
    /// By `BackendId`; read through [`PinnedMaps::backend`] and
    /// [`PinnedMaps::backend_entries`], which skip free ids.
    pub backends: MappedArray<Backend>,
    /// Maglev tables by backend set (see `new_maglev_table`).
    pub maglev: HashOfMaps<MapData, u32>,
    /// `maglev` again, for the batch writes aya's `HashOfMaps` does not
    /// offer.
    maglev_batch: MapData,
    pub unprogrammed: HashMap<MapData, ServiceKey, Unprogrammed>,
    pub affinity: HashMap<MapData, AffinityKey, AffinityEntry>,
    pub rev_sock: HashMap<MapData, lb_common::ReverseSockKey, lb_common::ReverseSockValue>,
    pub datagram_flows: HashMap<MapData, DatagramFlowKey, DatagramFlow>,
    /// This node's state of each backend (open connections), by
    /// `BackendId`; `None` in a pin directory of an agent before it.
    pub backend_state: Option<Array<MapData, BackendState>>,
    /// Outlier detection's state of each backend, by `BackendId`; `None`
    /// in a pin directory of an agent before it.
    pub backend_health: Option<Array<MapData, BackendHealth>>,
}

impl PinnedMaps {
    /// Opens the maps pinned in `dir`, as `inspect` does without an agent.
    pub fn open(dir: &Path) -> anyhow::Result<Self> {
        let open = |name: &str| -> anyhow::Result<Map> {
            let path = dir.join(name);
            let data = MapData::from_pin(&path)
                .with_context(|| format!("opening pinned map {}", path.display()))?;
            Map::from_map_data(data).with_context(|| format!("map {}", path.display()))
        };
        Ok(Self {
            services: HashMap::try_from(open(map_names::SERVICES)?)?,
            slots: MappedArray::new(Array::try_from(open(map_names::SLOTS)?)?)
                .context("reading the map info of LB_SLOTS")?,
            backends: MappedArray::new(Array::try_from(open(map_names::BACKENDS)?)?)
                .context("reading the map info of LB_BACKENDS")?,
            maglev: HashOfMaps::try_from(open(map_names::MAGLEV)?)?,
            maglev_batch: MapData::from_pin(dir.join(map_names::MAGLEV))?,
            unprogrammed: HashMap::try_from(open(map_names::UNPROGRAMMED)?)?,
            affinity: HashMap::try_from(open(map_names::AFFINITY)?)?,
            rev_sock: HashMap::try_from(open(map_names::REV_SOCK)?)?,
            datagram_flows: HashMap::try_from(open(map_names::DGRAM_FLOWS)?)?,
            backend_state: open(map_names::BACKEND_STATE)
                .ok()
                .and_then(|m| Array::try_from(m).ok()),
            backend_health: open(map_names::BACKEND_HEALTH)
                .ok()
                .and_then(|m| Array::try_from(m).ok()),
        })
    }

    /// Backend `id`'s open connections from this node, `None` where the
    /// maps have no such state.
    pub fn open_connections(&self, id: u32) -> Option<u32> {
        Some(self.backend_state.as_ref()?.get(&id, 0).ok()?.open())
    }

    /// Backend `id`'s outlier detection state, read whole under its lock;
    /// `None` where the maps have no such state.
    pub fn backend_health(&self, id: u32) -> Option<BackendHealth> {
        self.backend_health.as_ref()?.get(&id, BPF_F_LOCK).ok()
    }

    /// Zeroes backend `id`'s outlier detection state (under its lock): a
    /// backend that leaves its Services leaves quarantine, and an id
    /// handed to another backend starts clean.
    fn reset_backend_health(&mut self, id: u32) -> std::io::Result<()> {
        match &mut self.backend_health {
            Some(health) => health
                .set(id, BackendHealth::default(), BPF_F_LOCK)
                .map_err(io),
            None => Ok(()),
        }
    }

    /// The Maglev table of backend set `set`, read whole: its `size`
    /// positions. An error if it is not a table of that size (another
    /// length, or padding that is not zero).
    pub fn maglev_table(&self, set: u32, size: u16) -> std::io::Result<Vec<u32>> {
        use std::os::fd::AsFd as _;
        let table: MapData = self.maglev.get(&set, 0).map_err(io)?;
        let len = table.info().map_err(io)?.max_entries();
        let entries: Vec<MaglevEntry> =
            crate::datapath::batch::lookup_array(table.fd().as_fd(), len)?;
        let mut positions: Vec<u32> = entries.iter().flat_map(|e| e.backend_ids).collect();
        let size = size as usize;
        if entries.len() != size.div_ceil(MAGLEV_POSITIONS)
            || positions[size..].iter().any(|id| *id != 0)
        {
            return Err(std::io::Error::other(format!(
                "the Maglev table of backend set {set} has {len} entries, not a table of {size} positions"
            )));
        }
        positions.truncate(size);
        Ok(positions)
    }

    /// Makes `LB_UNPROGRAMMED` hold exactly `want`, writing only what
    /// differs from what it holds; the errors, naming the frontend.
    pub fn sync_unprogrammed(
        &mut self,
        want: &std::collections::BTreeMap<ServiceKey, Unprogrammed>,
    ) -> Vec<String> {
        let have: std::collections::BTreeMap<ServiceKey, Unprogrammed> =
            self.unprogrammed.iter().filter_map(Result::ok).collect();
        let mut errors = Vec::new();
        let name = |k: &ServiceKey| {
            let addr = crate::base::addr::ip_from_bytes(&k.addr);
            format!(
                "{} of {addr}:{}/{}",
                map_names::UNPROGRAMMED,
                k.port,
                k.proto
            )
        };
        for key in have.keys().filter(|k| !want.contains_key(k)) {
            if let Err(e) = self.unprogrammed.remove(key) {
                errors.push(format!("removing {}: {e}", name(key)));
            }
        }
        for (key, value) in want {
            if have.get(key) != Some(value) {
                if let Err(e) = self.unprogrammed.insert(key, value, 0) {
                    errors.push(format!("writing {}: {e}", name(key)));
                }
            }
        }
        errors
    }

    /// The service id a socket addressed when it was sent to `dst`.
    pub fn service_of_socket(&self, cookie: u64, dst: std::net::SocketAddr) -> Option<u32> {
        let key = lb_common::ReverseSockKey {
            cookie,
            addr: crate::base::addr::addr_bytes(dst.ip()),
            port: dst.port(),
            _pad: [0; 6],
        };
        self.rev_sock.get(&key, 0).ok().map(|v| v.service_id)
    }

    /// Deletes affinity entries that can no longer bind (see `affinity`).
    pub fn sweep_affinity(&mut self, policies: &BTreeMap<u32, AffinityPolicy>) -> SweepReport {
        sweep::sweep(
            &mut self.affinity,
            |k, e, now| affinity::stale(k, e, policies, now),
            monotonic_now_ns,
        )
    }

    /// Deletes datagram flows that can no longer bind (see
    /// `datagram_flows`); `udp_timeout_s` as the kernel reads it.
    /// Adds to `counted` each backend's live flows of `LB_DGRAM_FLOWS`
    /// whose frontend's scheduler counts them (`DatagramPolicy::counts`).
    pub fn count_datagram_flows(
        &self,
        policies: &BTreeMap<FlowFrontend, DatagramPolicy>,
        udp_timeout_s: u32,
        counted: &mut std::collections::HashMap<u32, i32>,
    ) {
        if !policies.values().any(|p| p.counts) {
            return;
        }
        let now = monotonic_now_ns();
        for (k, f) in self.datagram_flows.iter().filter_map(Result::ok) {
            let counts = policies
                .get(&(k.addr, k.port, k.proto))
                .is_some_and(|p| p.counts && p.service_id == f.service_id);
            if counts && f.live(now, udp_timeout_s) {
                *counted.entry(f.backend_id).or_default() += 1;
            }
        }
    }

    pub fn sweep_datagram_flows(
        &mut self,
        policies: &BTreeMap<FlowFrontend, DatagramPolicy>,
        udp_timeout_s: u32,
    ) -> SweepReport {
        sweep::sweep(
            &mut self.datagram_flows,
            |k, f, now| datagram_flows::stale(k, f, policies, udp_timeout_s, now),
            monotonic_now_ns,
        )
    }
}

/// `bpf_map_type` numbers of the maps the object declares.
mod map_type {
    pub const HASH: u32 = 1;
    pub const ARRAY: u32 = 2;
    pub const PERCPU_ARRAY: u32 = 6;
    pub const LRU_HASH: u32 = 9;
    pub const LPM_TRIE: u32 = 11;
    pub const HASH_OF_MAPS: u32 = 13;
    pub const SK_STORAGE: u32 = 24;
}

/// `BPF_F_INNER_MAP`: an inner map of this flag may have a length of its
/// own, whatever its outer map's template has (Linux 5.10).
const BPF_F_INNER_MAP: u32 = 1 << 12;

/// A new Maglev table holding `table`: an array of its own, of
/// `table.len()` positions, flagged like `LB_MAGLEV`'s template
/// (`lb-ebpf`'s `MaglevTable`) so that the kernel takes it as an inner map.
/// Not pinned: `LB_MAGLEV` holds it, and it is freed once taken out and no
/// program holds it any more.
pub fn new_maglev_table(table: &[u32]) -> std::io::Result<MapData> {
    use std::os::fd::AsFd as _;
    let entries: Vec<MaglevEntry> = table
        .chunks(MAGLEV_POSITIONS)
        .map(|chunk| {
            let mut e = MaglevEntry::default();
            e.backend_ids[..chunk.len()].copy_from_slice(chunk);
            e
        })
        .collect();
    let def = aya_obj::Map::new_from_params(
        map_type::ARRAY,
        std::mem::size_of::<u32>() as u32,
        std::mem::size_of::<MaglevEntry>() as u32,
        entries.len() as u32,
        BPF_F_INNER_MAP,
    );
    let map = MapData::create(def, map_names::MAGLEV_TABLE, None).map_err(io)?;
    let keys: Vec<u32> = (0..entries.len() as u32).collect();
    crate::datapath::batch::update(map.fd().as_fd(), &keys, &entries).map_err(|e| e.error)?;
    Ok(map)
}

/// What a pinned map must look like to be adopted.
struct Layout {
    name: &'static str,
    map_type: u32,
    key: usize,
    value: usize,
    max_entries: u32,
}

fn layout<K, V>(name: &'static str, map_type: u32, max_entries: u32) -> Layout {
    Layout {
        name,
        map_type,
        key: std::mem::size_of::<K>(),
        value: std::mem::size_of::<V>(),
        max_entries,
    }
}

fn expected_layouts(capacity: &Capacity) -> [Layout; 24] {
    use lb_common::{CtEntry, CtKey, ReverseSockKey, ReverseSockValue, SockPeerEntry, TcConfig};
    use map_type::*;
    let c = capacity;
    let source_ranges = layout::<lb_common::SourceRangeData, u32>(
        map_names::SOURCE_RANGES,
        LPM_TRIE,
        lb_common::capacity::SOURCE_RANGES,
    );
    [
        layout::<ServiceKey, ServiceValue>(map_names::SERVICES, HASH, c.max_services),
        layout::<u32, BackendSlot>(
            map_names::SLOTS,
            ARRAY,
            crate::datapath::slot_ranges::array_len(c.max_slots),
        ),
        layout::<u32, Backend>(map_names::BACKENDS, ARRAY, c.max_backends),
        // The value of a map of maps is the inner map's id (u32).
        layout::<u32, u32>(map_names::MAGLEV, HASH_OF_MAPS, c.max_maglev_tables),
        layout::<ServiceKey, Unprogrammed>(
            map_names::UNPROGRAMMED,
            HASH,
            lb_common::capacity::UNPROGRAMMED,
        ),
        layout::<ReverseSockKey, ReverseSockValue>(
            map_names::REV_SOCK,
            LRU_HASH,
            c.max_reverse_sockets,
        ),
        layout::<u32, SockPeerEntry>(map_names::SOCK_PEER, ARRAY, c.max_sock_peers),
        layout::<i32, lb_common::SockSourceCheck>(map_names::SOCK_CHECK, SK_STORAGE, 0),
        layout::<AffinityKey, AffinityEntry>(map_names::AFFINITY, LRU_HASH, c.max_affinity),
        layout::<u32, u64>(map_names::STATS, PERCPU_ARRAY, lb_common::stat::COUNT),
        layout::<CtKey, CtEntry>(map_names::CONNTRACK, LRU_HASH, c.max_conntrack),
        layout::<CtKey, CtEntry>(map_names::CONNTRACK_SYN, LRU_HASH, c.max_conntrack_syn),
        // An LPM key is the prefix length (u32) and the data.
        Layout {
            key: 4 + source_ranges.key,
            ..source_ranges
        },
        layout::<u32, TcConfig>(map_names::TC_CONFIG, ARRAY, 1),
        layout::<lb_common::FragKey, lb_common::FragEntry>(
            map_names::FRAGMENTS,
            LRU_HASH,
            lb_common::capacity::FRAGMENTS,
        ),
        layout::<DatagramFlowKey, DatagramFlow>(
            map_names::DGRAM_FLOWS,
            LRU_HASH,
            c.max_datagram_flows,
        ),
        layout::<u32, lb_common::PortBits>(
            map_names::LOCAL_PORTS,
            ARRAY,
            lb_common::capacity::LOCAL_PORTS,
        ),
        layout::<u32, lb_common::PortBits>(
            map_names::FRONTEND_PORTS,
            ARRAY,
            lb_common::capacity::FRONTEND_PORTS,
        ),
        layout::<u32, u32>(map_names::ROUTE_EPOCH, ARRAY, 1),
        layout::<u32, BackendState>(map_names::BACKEND_STATE, ARRAY, c.max_backends),
        layout::<u32, FrontendState>(map_names::FRONTEND_STATE, ARRAY, c.max_services),
        layout::<u32, SockDraw>(map_names::SOCK_DRAW, PERCPU_ARRAY, 1),
        layout::<u32, u32>(map_names::SOCK_BACKEND, ARRAY, c.max_sock_peers),
        layout::<u32, BackendHealth>(map_names::BACKEND_HEALTH, ARRAY, c.max_backends),
    ]
}

/// Removes pinned maps whose layout or size differs from this version's, so
/// the loader recreates them. The four service maps refer to each other by
/// id and go together, and `LB_AFFINITY`, `LB_DGRAM_FLOWS`,
/// `LB_BACKEND_STATE` and `LB_SOCK_BACKEND` with them:
/// their entries name affinity, service and backend ids of the maps being
/// replaced, which the new ones hand out afresh. Returns what was
/// recreated, for the log.
fn drop_incompatible_pins(pin_dir: &Path, capacity: &Capacity) -> anyhow::Result<Vec<String>> {
    const CORE: [&str; 4] = [
        map_names::SERVICES,
        map_names::SLOTS,
        map_names::BACKENDS,
        map_names::MAGLEV,
    ];
    let mut recreated = Vec::new();
    let mut core_changed = false;
    for Layout {
        name,
        map_type,
        key,
        value,
        max_entries: max,
    } in expected_layouts(capacity)
    {
        let path = pin_dir.join(name);
        if !path.exists() {
            continue;
        }
        let why = match MapInfo::from_pin(&path) {
            Err(e) => Some(format!("unreadable ({e})")),
            Ok(info) => {
                let got = (
                    info.map_type().map(|t| t as u32).unwrap_or(u32::MAX),
                    info.key_size() as usize,
                    info.value_size() as usize,
                    info.max_entries(),
                );
                let want = (map_type, key, value, max);
                if got != want {
                    Some(format!(
                        "type/key/value/entries {got:?}, this version needs {want:?}"
                    ))
                } else if name == map_names::MAGLEV {
                    maglev_tables_incompatible(&path)
                        .unwrap_or_else(|e| Some(format!("unreadable ({e:#})")))
                } else {
                    None
                }
            }
        };
        if let Some(why) = why {
            if CARRIED.contains(&name) && carried_layout(&path).is_some() {
                // Set aside, read into its replacement once that exists.
                let aside = carried_path(&path);
                fs::rename(&path, &aside)
                    .with_context(|| format!("moving {} to {}", path.display(), aside.display()))?;
                recreated.push(format!("{name}: {why}; its entries are carried over"));
                continue;
            }
            fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
            recreated.push(format!("{name}: {why}"));
            core_changed |= CORE.contains(&name);
        }
    }
    if core_changed {
        // Also the backends' open connections and the sockets' record of
        // what they counted, which name backend ids too: counts start
        // afresh with the new ids.
        for name in CORE.into_iter().chain([
            map_names::AFFINITY,
            map_names::DGRAM_FLOWS,
            map_names::BACKEND_STATE,
            map_names::SOCK_BACKEND,
            map_names::BACKEND_HEALTH,
        ]) {
            let path = pin_dir.join(name);
            if path.exists() {
                fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
                recreated.push(format!("{name}: recreated with the other service maps"));
            }
        }
    }
    Ok(recreated)
}

/// The conntrack tables, whose entries an agent of another layout carries
/// over instead of dropping them (each one an open connection through a
/// NodePort, LoadBalancer IP or externalIP, broken if its entry went).
const CARRIED: [&str; 2] = [map_names::CONNTRACK, map_names::CONNTRACK_SYN];

/// The size of an entry of an earlier version's conntrack table that
/// [`carry_over`] reads: 64, before `CtEntry::hop` (which starts empty).
/// Any other layout is recreated empty.
const CARRIED_VALUE: usize = 64;

/// Where a table to carry over waits (bpffs takes no dot in a name).
fn carried_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_owned();
    name.push("_CARRIED");
    path.with_file_name(name)
}

/// Whether the pinned map at `path` is a conntrack table [`carry_over`]
/// reads: of this version's type and key, entries of [`CARRIED_VALUE`].
fn carried_layout(path: &Path) -> Option<()> {
    use lb_common::CtKey;
    let info = MapInfo::from_pin(path).ok()?;
    let t = info.map_type().ok()? as u32;
    (t == map_type::LRU_HASH
        && info.key_size() as usize == std::mem::size_of::<CtKey>()
        && info.value_size() as usize == CARRIED_VALUE)
        .then_some(())
}

/// Copies the entries of the conntrack table set aside for `name` (see
/// `drop_incompatible_pins`) into the new one, each zero-extended (no next
/// hop), and removes it. Returns how many were carried over; entries the
/// new table has no room for are counted as lost. Flows the earlier
/// programs open between this copy and their replacement's attachment are
/// not carried.
fn carry_over(pin_dir: &Path, name: &str) -> anyhow::Result<Option<(usize, usize)>> {
    use lb_common::{CtEntry, CtKey};
    let aside = carried_path(&pin_dir.join(name));
    if !aside.exists() {
        return Ok(None);
    }
    let open = |path: &Path| -> anyhow::Result<Map> {
        let data =
            MapData::from_pin(path).with_context(|| format!("opening {}", path.display()))?;
        Ok(Map::LruHashMap(data))
    };
    let old: HashMap<MapData, CtKey, [u8; CARRIED_VALUE]> = HashMap::try_from(open(&aside)?)?;
    let mut new: HashMap<MapData, CtKey, CtEntry> = HashMap::try_from(open(&pin_dir.join(name))?)?;
    let (mut carried, mut lost) = (0, 0);
    for item in old.iter() {
        let Ok((key, bytes)) = item else {
            // The earlier programs may remove an entry during the walk.
            continue;
        };
        let mut raw = [0u8; std::mem::size_of::<CtEntry>()];
        raw[..CARRIED_VALUE].copy_from_slice(&bytes);
        // SAFETY: `CtEntry` is plain data (any bytes are a value); its
        // first CARRIED_VALUE bytes are laid out as the earlier version's
        // whole entry (the table in lb-common), the rest zero: no hop.
        let entry: CtEntry = unsafe { std::ptr::read_unaligned(raw.as_ptr().cast()) };
        // BPF_NOEXIST: never over an entry the new programs wrote.
        match new.insert(key, entry, 1) {
            Ok(()) => carried += 1,
            Err(_) => lost += 1,
        }
    }
    drop(old);
    fs::remove_file(&aside).with_context(|| format!("removing {}", aside.display()))?;
    Ok(Some((carried, lost)))
}

/// Whether the tables of the pinned `LB_MAGLEV` at `path` are of another
/// kind than this version's (an array of `MaglevEntry`, `BPF_F_INNER_MAP`):
/// a map of maps takes only inner maps like its template, which is fixed
/// when it is created and which no map info shows. One with tables is
/// judged by its first table; an empty one is removed (nothing is lost)
/// and made anew with this version's template, without being reported.
fn maglev_tables_incompatible(path: &Path) -> anyhow::Result<Option<String>> {
    let outer = MapData::from_pin(path).with_context(|| format!("opening {}", path.display()))?;
    let outer: HashOfMaps<MapData, u32> = HashOfMaps::try_from(Map::HashOfMaps(outer))?;
    let Some(first) = outer.keys().next() else {
        drop(outer);
        fs::remove_file(path).with_context(|| format!("removing {}", path.display()))?;
        tracing::debug!("{}: empty, made anew", map_names::MAGLEV);
        return Ok(None);
    };
    let table: MapData = first
        .and_then(|set| outer.get(&set, 0))
        .with_context(|| format!("reading a table of {}", path.display()))?;
    let info = table.info()?;
    let got = (
        info.map_type().map(|t| t as u32).unwrap_or(u32::MAX),
        info.value_size() as usize,
        info.map_flags(),
    );
    let want = (
        map_type::ARRAY,
        std::mem::size_of::<MaglevEntry>(),
        BPF_F_INNER_MAP,
    );
    Ok((got != want)
        .then(|| format!("tables of type/value/flags {got:?}, this version needs {want:?}")))
}

/// What was found pinned by an earlier run.
///
/// A restarted agent never assumes a map empty: whatever keeps a record of
/// what it wrote starts from what is pinned. Per map:
/// - `LB_SERVICES` (frontends and VIP markers), `LB_SLOTS`, `LB_BACKENDS`,
///   the keys of `LB_MAGLEV`: read here, rebuilt into the reconciler's
///   record (`Reconciler::adopt`); a Maglev table itself is read when the
///   reconciler first compares it with the one wanted;
/// - `LB_UNPROGRAMMED`: rewritten whole by every process's first sync, from
///   what that sync could not program (read back to delete the rest);
/// - `LB_SOURCE_RANGES`: read back when the tc maps are opened
///   (`tc::SourceRangeWriter::adopt`);
/// - `LB_TC_CONFIG`: one element, written whole by every process's first
///   sync, so nothing to read;
/// - `LB_AFFINITY`, `LB_DGRAM_FLOWS`, `LB_CONNTRACK`, `LB_CT_SYN`: written
///   by the kernel; the agent keeps no record, its sweeps and purges read
///   the whole map each time;
/// - `LB_REV_SOCK`, `LB_SOCK_PEER`, `LB_STATS`, `LB_FRAGMENTS`: the kernel's
///   alone.
#[derive(Default)]
pub struct Adopted {
    pub services: Vec<(ServiceKey, ServiceValue)>,
    /// `LB_SLOTS` elements that are not zeros, by index.
    pub slots: Vec<(u32, BackendSlot)>,
    pub backends: Vec<(BackendId, Backend)>,
    /// The backend sets that have a Maglev table.
    pub maglev: Vec<u32>,
    /// Maps recreated because their layout changed.
    pub recreated: Vec<String>,
    /// Program links of the earlier run that were replaced.
    pub replaced_links: usize,
    /// Kernel-side log records (aya-log), for `forward_kernel_logs`.
    pub logger: Option<KernelLogger>,
}

pub type KernelLogger = aya_log::EbpfLogger<&'static dyn log::Log>;

fn sock_program<'a>(ebpf: &'a mut Ebpf, name: &str) -> anyhow::Result<&'a mut CgroupSockAddr> {
    ebpf.program_mut(name)
        .with_context(|| format!("program {name} missing from the object"))?
        .try_into()
        .with_context(|| format!("program {name} is not a cgroup sock_addr program"))
}

fn release_program(ebpf: &mut Ebpf) -> anyhow::Result<&mut CgroupSock> {
    ebpf.program_mut(RELEASE_PROGRAM)
        .with_context(|| format!("program {RELEASE_PROGRAM} missing from the object"))?
        .try_into()
        .with_context(|| format!("program {RELEASE_PROGRAM} is not a cgroup sock program"))
}

fn sock_ops_program(ebpf: &mut Ebpf) -> anyhow::Result<&mut SockOps> {
    ebpf.program_mut(SOCK_OPS_PROGRAM)
        .with_context(|| format!("program {SOCK_OPS_PROGRAM} missing from the object"))?
        .try_into()
        .with_context(|| format!("program {SOCK_OPS_PROGRAM} is not a sock_ops program"))
}

fn egress_program(ebpf: &mut Ebpf) -> anyhow::Result<&mut CgroupSkb> {
    ebpf.program_mut(EGRESS_PROGRAM)
        .with_context(|| format!("program {EGRESS_PROGRAM} missing from the object"))?
        .try_into()
        .with_context(|| format!("program {EGRESS_PROGRAM} is not a cgroup skb program"))
}

/// Forwards the programs' aya-log records to the agent's log (they arrive
/// at debug level and rarely: only on paths that indicate a problem).
pub fn forward_kernel_logs(logger: KernelLogger) -> anyhow::Result<()> {
    // SAFETY: the logger owns its ring buffer fd and keeps it open, unchanged,
    // for as long as the AsyncFd (and so the registration) lives.
    let mut fd = unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(logger, tokio::io::Interest::READABLE)
    }
    .context("watching the kernel log ring buffer")?;
    tokio::spawn(async move {
        loop {
            let Ok(mut guard) = fd.readable_mut().await else {
                return;
            };
            guard.get_inner_mut().flush();
            guard.clear_ready();
        }
    });
    Ok(())
}

impl Datapath {
    /// Loads the programs with maps pinned in `pin_dir` (adopting maps an
    /// earlier run pinned, when their layout matches) and attaches the socket
    /// programs to `cgroup` through links pinned in `pin_dir/links`, so that
    /// the datapath outlives the agent. A restart attaches the new programs
    /// before it unpins the old links: connects are served throughout.
    pub fn load(
        pin_dir: &Path,
        cgroup: &Path,
        capacity: &Capacity,
        refusal: Refusal,
    ) -> anyhow::Result<(Self, Adopted)> {
        let (mut datapath, mut adopted) = Self::load_detached(pin_dir, capacity, refusal)?;
        adopted.replaced_links = datapath.attach(cgroup)?;
        Ok((datapath, adopted))
    }

    /// [`load`](Self::load) without attaching: the programs are verified
    /// and the maps pinned, and an earlier run's programs keep serving from
    /// their own maps until [`attach`](Self::attach) replaces them. The
    /// agent attaches after its first sync when maps were recreated (they
    /// start empty), so that a layout change costs no failed connect.
    pub fn load_detached(
        pin_dir: &Path,
        capacity: &Capacity,
        refusal: Refusal,
    ) -> anyhow::Result<(Self, Adopted)> {
        ensure_bpffs(pin_dir)?;
        let links_dir = pin_dir.join("links");
        fs::create_dir_all(&links_dir)
            .with_context(|| format!("creating pin directory {}", links_dir.display()))?;
        let mut adopted = Adopted {
            recreated: drop_incompatible_pins(pin_dir, capacity)?,
            ..Default::default()
        };

        let paths: Vec<(&str, PathBuf)> = map_names::ALL
            .iter()
            .map(|name| (*name, pin_dir.join(name)))
            .collect();
        // A map created now is empty: reading `LB_SLOTS` and `LB_BACKENDS`
        // whole (786 432 elements at the default sizes) is ~0.2 s of
        // start-up for nothing.
        let pinned_before = |name: &str| pin_dir.join(name).exists();
        let (adopt_slots, adopt_backends) = (
            pinned_before(map_names::SLOTS),
            pinned_before(map_names::BACKENDS),
        );
        let seeded_before = pinned_before(map_names::SOCK_DRAW);
        let cursors_before = pinned_before(map_names::FRONTEND_STATE);
        let mut loader = sized_loader(capacity);
        for (name, path) in &paths {
            loader.map_pin_path(name, path.as_path());
        }
        let mut ebpf = loader
            .load(EBPF_OBJECT)
            .context("loading the kernel programs")?;
        // Before any program is attached: the first connect already draws
        // from this node's own sequence.
        if !seeded_before {
            seed_sock_draw(&mut ebpf).context("seeding LB_SOCK_DRAW")?;
        }
        if !cursors_before {
            seed_rr_cursors(&mut ebpf).context("seeding LB_FRONTEND_STATE")?;
        }
        for name in CARRIED {
            match carry_over(pin_dir, name) {
                Ok(Some((carried, lost))) => tracing::info!(
                    map = name,
                    carried,
                    lost,
                    "flows carried over from the earlier layout"
                ),
                Ok(None) => {}
                Err(e) => tracing::error!("carrying {name} over: {e:#}; its flows are lost"),
            }
        }
        match aya_log::EbpfLogger::init(&mut ebpf) {
            Ok(logger) => adopted.logger = Some(logger),
            Err(e) => tracing::warn!(error = %e, "kernel-side logs unavailable"),
        }

        for hook in SOCK_PROGRAMS {
            let name = refusal.program(hook);
            let program = sock_program(&mut ebpf, &name)?;
            verify(|| program.load()).with_context(|| format!("verifying program {name}"))?;
        }
        let egress = egress_program(&mut ebpf)?;
        verify(|| egress.load()).with_context(|| format!("verifying program {EGRESS_PROGRAM}"))?;
        let release = release_program(&mut ebpf)?;
        verify(|| release.load())
            .with_context(|| format!("verifying program {RELEASE_PROGRAM}"))?;
        let sock_ops = sock_ops_program(&mut ebpf)?;
        verify(|| sock_ops.load())
            .with_context(|| format!("verifying program {SOCK_OPS_PROGRAM}"))?;

        let take = |ebpf: &mut Ebpf, name: &str| {
            ebpf.take_map(name)
                .with_context(|| format!("map {name} missing from the object"))
        };
        let maps = PinnedMaps {
            services: HashMap::try_from(take(&mut ebpf, map_names::SERVICES)?)?,
            slots: MappedArray::new(Array::try_from(take(&mut ebpf, map_names::SLOTS)?)?)
                .context("reading the map info of LB_SLOTS")?,
            backends: MappedArray::new(Array::try_from(take(&mut ebpf, map_names::BACKENDS)?)?)
                .context("reading the map info of LB_BACKENDS")?,
            maglev: HashOfMaps::try_from(take(&mut ebpf, map_names::MAGLEV)?)?,
            maglev_batch: MapData::from_pin(pin_dir.join(map_names::MAGLEV))?,
            unprogrammed: HashMap::try_from(take(&mut ebpf, map_names::UNPROGRAMMED)?)?,
            affinity: HashMap::try_from(take(&mut ebpf, map_names::AFFINITY)?)?,
            rev_sock: HashMap::try_from(take(&mut ebpf, map_names::REV_SOCK)?)?,
            datagram_flows: HashMap::try_from(take(&mut ebpf, map_names::DGRAM_FLOWS)?)?,
            backend_state: Some(Array::try_from(take(&mut ebpf, map_names::BACKEND_STATE)?)?),
            backend_health: Some(Array::try_from(take(
                &mut ebpf,
                map_names::BACKEND_HEALTH,
            )?)?),
        };
        for (name, mapped) in [
            (map_names::SLOTS, maps.slots.is_mapped()),
            (map_names::BACKENDS, maps.backends.is_mapped()),
        ] {
            if !mapped {
                tracing::info!(
                    map = name,
                    "pinned by an earlier version without BPF_F_MMAPABLE: kept, and written with system calls"
                );
            }
        }
        adopted.services = unstamped_entries(&maps.services);
        if adopt_slots {
            adopted.slots = maps.slot_entries().context("reading LB_SLOTS")?;
        }
        if adopt_backends {
            adopted.backends = maps
                .backend_entries()
                .context("reading LB_BACKENDS")?
                .into_iter()
                .map(|(id, b)| (id, unstamp(&id, b)))
                .collect();
        }
        adopted.maglev = maps.maglev.keys().filter_map(Result::ok).collect();
        Ok((
            Self {
                _ebpf: ebpf,
                pin_dir: pin_dir.to_owned(),
                maps,
                refusal,
                cgroup: None,
                source_check: false,
                egress_attached: false,
            },
            adopted,
        ))
    }

    /// Attaches the socket programs to `cgroup` through links pinned in
    /// `pin_dir/links`; an earlier run's link is unpinned (detached) only
    /// once its replacement is attached. Returns how many were replaced.
    /// `cgroup_egress` only while it is wanted (`set_source_check`), or
    /// when an earlier run left it attached: the first sync then says
    /// whether it stays, and the check goes on meanwhile.
    pub fn attach(&mut self, cgroup: &Path) -> anyhow::Result<usize> {
        let links_dir = self.pin_dir.join("links");
        let cgroup_dir = fs::File::open(cgroup)
            .with_context(|| format!("opening cgroup {}", cgroup.display()))?;
        // Before connect: no socket's peer is recorded that no program
        // would forget.
        let release = release_program(&mut self._ebpf)?;
        let link_id = release
            .attach(&cgroup_dir, CgroupAttachMode::Single)
            .with_context(|| format!("attaching {RELEASE_PROGRAM} to {}", cgroup.display()))?;
        let link = FdLink::try_from(release.take_link(link_id)?)
            .with_context(|| format!("link of {RELEASE_PROGRAM}"))?;
        let mut replaced = usize::from(pin_replacing(
            link,
            &links_dir,
            RELEASE_PROGRAM,
            RELEASE_PROGRAM,
        )?);
        // Before connect too: every socket the hooks mark for outlier
        // detection has its connect watched.
        let sock_ops = sock_ops_program(&mut self._ebpf)?;
        let link_id = sock_ops
            .attach(&cgroup_dir, CgroupAttachMode::Single)
            .with_context(|| format!("attaching {SOCK_OPS_PROGRAM} to {}", cgroup.display()))?;
        let link = FdLink::try_from(sock_ops.take_link(link_id)?)
            .with_context(|| format!("link of {SOCK_OPS_PROGRAM}"))?;
        replaced += usize::from(pin_replacing(
            link,
            &links_dir,
            SOCK_OPS_PROGRAM,
            SOCK_OPS_PROGRAM,
        )?);
        for hook in SOCK_PROGRAMS {
            let name = self.refusal.program(hook);
            let program = sock_program(&mut self._ebpf, &name)?;
            // bpf_link attachments coexist with other programs of the cgroup
            // whatever the mode; `Single` is the one that passes no flags,
            // which is all BPF_LINK_CREATE accepts.
            let link_id = program
                .attach(&cgroup_dir, CgroupAttachMode::Single)
                .with_context(|| format!("attaching {name} to {}", cgroup.display()))?;
            let link = FdLink::try_from(program.take_link(link_id)?)
                .with_context(|| format!("link of {name}"))?;
            replaced += usize::from(pin_replacing(link, &links_dir, hook, &name)?);
        }
        self.cgroup = Some(cgroup.to_owned());
        if self.source_check || links_dir.join(EGRESS_PROGRAM).exists() {
            replaced += usize::from(self.attach_egress()?);
        }
        Ok(replaced)
    }

    /// Whether `cgroup_egress` is to run: only while some frontend has
    /// `loadBalancerSourceRanges`. It runs on every packet every socket
    /// of the cgroup sends, and a cgroup skb hook costs its dispatch even
    /// for a program that returns at once (`TcConfig::source_ranges`), so
    /// a node whose Services have no ranges (most) is better without it.
    /// Called before the frontends of each sync are written, after the
    /// ranges and `LB_TC_CONFIG`: a socket marked for the check meets the
    /// program. Before `attach`, only remembered.
    pub fn set_source_check(&mut self, wanted: bool) -> anyhow::Result<()> {
        self.source_check = wanted;
        if self.cgroup.is_none() || wanted == self.egress_attached {
            return Ok(());
        }
        if wanted {
            self.attach_egress()?;
        } else {
            let pin = self.pin_dir.join("links").join(EGRESS_PROGRAM);
            // The pin holds the link's last reference: unpinned, detached.
            // Already gone (removed by hand): detached too, not an error
            // at every later sync.
            match fs::remove_file(&pin) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(e).with_context(|| format!("unpinning {}", pin.display()));
                }
                _ => self.egress_attached = false,
            }
        }
        Ok(())
    }

    /// Attaches `cgroup_egress` in place of an earlier link, if any; true
    /// when it replaced one.
    fn attach_egress(&mut self) -> anyhow::Result<bool> {
        let cgroup = self
            .cgroup
            .clone()
            .context("the socket programs are not attached yet")?;
        let cgroup_dir = fs::File::open(&cgroup)
            .with_context(|| format!("opening cgroup {}", cgroup.display()))?;
        let egress = egress_program(&mut self._ebpf)?;
        let link_id = egress
            .attach(
                &cgroup_dir,
                CgroupSkbAttachType::Egress,
                CgroupAttachMode::Single,
            )
            .with_context(|| format!("attaching {EGRESS_PROGRAM} to {}", cgroup.display()))?;
        let link = FdLink::try_from(egress.take_link(link_id)?)
            .with_context(|| format!("link of {EGRESS_PROGRAM}"))?;
        let links_dir = self.pin_dir.join("links");
        let replaced = pin_replacing(link, &links_dir, EGRESS_PROGRAM, EGRESS_PROGRAM)?;
        self.egress_attached = true;
        Ok(replaced)
    }

    pub fn maps(&mut self) -> &mut PinnedMaps {
        &mut self.maps
    }

    /// The loaded object, for the tc programs (`devices::attach`).
    pub fn ebpf_mut(&mut self) -> &mut Ebpf {
        &mut self._ebpf
    }

    pub fn pin_dir(&self) -> &Path {
        &self.pin_dir
    }

    /// Detaches the programs and removes the pins.
    pub fn unload(self) -> anyhow::Result<()> {
        let Self {
            _ebpf,
            pin_dir,
            maps,
            refusal: _,
            ..
        } = self;
        drop(maps);
        drop(_ebpf);
        remove_pins(&pin_dir)
    }
}

/// A loader of the object with the map sizes of `capacity`.
fn sized_loader(capacity: &Capacity) -> EbpfLoader<'_> {
    let mut loader = EbpfLoader::new();
    loader
        // The programs index `LB_SOCK_PEER` by its length.
        .override_global("SOCK_PEER_SLOTS", &capacity.max_sock_peers, true)
        .override_global(
            "SERVICE_RANGE_GUARD",
            if capacity.service_range_guard {
                &1u32
            } else {
                &0u32
            },
            true,
        )
        .map_max_entries(map_names::SERVICES, capacity.max_services)
        .map_max_entries(
            map_names::SLOTS,
            crate::datapath::slot_ranges::array_len(capacity.max_slots),
        )
        .map_max_entries(map_names::MAGLEV, capacity.max_maglev_tables)
        .map_max_entries(map_names::BACKENDS, capacity.max_backends)
        .map_max_entries(map_names::REV_SOCK, capacity.max_reverse_sockets)
        .map_max_entries(map_names::SOCK_PEER, capacity.max_sock_peers)
        .map_max_entries(map_names::SOCK_BACKEND, capacity.max_sock_peers)
        .map_max_entries(map_names::BACKEND_STATE, capacity.max_backends)
        .map_max_entries(map_names::BACKEND_HEALTH, capacity.max_backends)
        .map_max_entries(map_names::FRONTEND_STATE, capacity.max_services)
        .map_max_entries(map_names::AFFINITY, capacity.max_affinity)
        .map_max_entries(map_names::DGRAM_FLOWS, capacity.max_datagram_flows)
        .map_max_entries(map_names::CONNTRACK, capacity.max_conntrack)
        .map_max_entries(map_names::CONNTRACK_SYN, capacity.max_conntrack_syn);
    loader
}

/// One program as this kernel's verifier took it (`verify_programs`).
pub struct ProgramCheck {
    pub name: String,
    /// Whether the agent cannot start without it.
    pub required: bool,
    /// The verifier's refusal: the error and the end of its log.
    pub rejected: Option<String>,
    /// The verifier's whole log of a refusal.
    pub log: String,
}

/// Fills `LB_SOCK_DRAW` from the OS's random source: each CPU's draw
/// state its own, and one secret for every CPU (`lb_common::SockDraw`).
/// Only when the map is created: it is pinned, so a restart keeps both
/// (a socket-path hash, sh's among them, stays what it was).
fn seed_sock_draw(ebpf: &mut Ebpf) -> anyhow::Result<()> {
    let map = ebpf
        .map_mut(map_names::SOCK_DRAW)
        .context("map LB_SOCK_DRAW missing from the object")?;
    let mut draw: PerCpuArray<_, SockDraw> = PerCpuArray::try_from(map)?;
    let secret = random_u64()?;
    let cpus = aya::util::nr_cpus().map_err(|(_, e)| e)?;
    let values = (0..cpus)
        .map(|_| {
            Ok(SockDraw {
                state: random_u64()?,
                secret,
            })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    draw.set(0, PerCpuValues::try_from(values)?, 0)?;
    Ok(())
}

/// Starts every round-robin cursor of `LB_FRONTEND_STATE` at a random
/// turn, so that nodes do not all start their frontends at one backend.
fn seed_rr_cursors(ebpf: &mut Ebpf) -> anyhow::Result<()> {
    let map = ebpf
        .map_mut(map_names::FRONTEND_STATE)
        .context("map LB_FRONTEND_STATE missing from the object")?;
    let mut state: Array<_, FrontendState> = Array::try_from(map)?;
    let mut seed = random_u64()?;
    for id in 0..state.len() {
        seed = seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = seed;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        let value = FrontendState {
            rr_cursor: (z >> 32) as u32,
            lock: Default::default(),
        };
        state.set(id, value, 0)?;
    }
    Ok(())
}

fn random_u64() -> anyhow::Result<u64> {
    getrandom::u64().map_err(|e| anyhow::anyhow!("the OS's random source: {e}"))
}

/// Loads the object into this kernel with small unpinned maps and runs
/// the verifier on every program `run` would load with `refusal`, and on
/// the `optional` ones (the tc programs), without attaching or pinning
/// anything: all of it goes when this returns. `Err` when the object
/// itself (its maps) does not load.
pub fn verify_programs(refusal: Refusal, optional: &[&str]) -> anyhow::Result<Vec<ProgramCheck>> {
    let small = Capacity::small();
    let mut ebpf = sized_loader(&small)
        .load(EBPF_OBJECT)
        .context("loading the object's maps")?;
    let required = SOCK_PROGRAMS
        .iter()
        .map(|hook| refusal.program(hook))
        .chain([
            EGRESS_PROGRAM.to_owned(),
            RELEASE_PROGRAM.to_owned(),
            SOCK_OPS_PROGRAM.to_owned(),
        ])
        .map(|name| (name, true));
    let optional = optional.iter().map(|name| ((*name).to_owned(), false));
    let mut checks = Vec::new();
    for (name, required) in required.chain(optional) {
        let program = ebpf
            .program_mut(&name)
            .with_context(|| format!("program {name} missing from the object"))?;
        let loaded = match program {
            Program::CgroupSockAddr(p) => verify(|| p.load()),
            Program::CgroupSkb(p) => verify(|| p.load()),
            Program::CgroupSock(p) => verify(|| p.load()),
            Program::SockOps(p) => verify(|| p.load()),
            Program::SchedClassifier(p) => verify(|| p.load()),
            Program::Xdp(p) => verify(|| p.load()),
            _ => bail!("program {name} is of a type the agent does not load"),
        };
        let (rejected, log) = match loaded {
            Ok(()) => (None, String::new()),
            Err(e) => (Some(verifier_refusal(&e)), verifier_log(&e)),
        };
        checks.push(ProgramCheck {
            name,
            required,
            rejected,
            log,
        });
    }
    Ok(checks)
}

fn verifier_log(e: &aya::programs::ProgramError) -> String {
    match e {
        aya::programs::ProgramError::LoadError { verifier_log, .. } => verifier_log.to_string(),
        _ => String::new(),
    }
}

/// The error and the verifier's reason: its last lines before the
/// statistics it ends with.
fn verifier_refusal(e: &aya::programs::ProgramError) -> String {
    match e {
        aya::programs::ProgramError::LoadError { io_error, .. } => {
            let log = verifier_log(e);
            let stats = ["verification time", "stack depth", "processed "];
            let lines: Vec<&str> = log
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !stats.iter().any(|s| l.starts_with(s)))
                .collect();
            let tail = lines[lines.len().saturating_sub(2)..].join(" / ");
            format!("{io_error}: {tail}")
        }
        other => other.to_string(),
    }
}

/// Runs `load` (a program's load, which runs the verifier) with this
/// thread's signals blocked, and again if the verifier gave up all the
/// same (`EAGAIN`), as libbpf retries. The verifier stops at once when a
/// signal is pending for the loading thread; in a process whose other
/// threads start and reap children (SIGCHLD), five immediate retries
/// were not enough (CI: tc_ingress, "processed 1 insns"). Blocked here,
/// a process-directed signal goes to another thread.
pub fn verify(
    mut load: impl FnMut() -> Result<(), aya::programs::ProgramError>,
) -> Result<(), aya::programs::ProgramError> {
    let mut tries = 5;
    loop {
        let result = with_signals_blocked(&mut load);
        match result {
            Err(aya::programs::ProgramError::LoadError { io_error, .. })
                if io_error.raw_os_error() == Some(libc::EAGAIN) && tries > 1 =>
            {
                tries -= 1;
            }
            result => return result,
        }
    }
}

/// `f` with every blockable signal blocked in this thread, the mask
/// restored after.
fn with_signals_blocked<T>(f: impl FnOnce() -> T) -> T {
    // SAFETY: sigset_t is plain data filled by sigfillset; the old mask is
    // written by the kernel and restored unchanged.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        let blocked = libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old) == 0;
        let result = f();
        if blocked {
            libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
        }
        result
    }
}

/// The kernel's `LB_STATS` counters under `dir`, summed over CPUs, by
/// `lb_common::stat` index.
pub fn read_stats(dir: &Path) -> anyhow::Result<Vec<u64>> {
    let path = dir.join(map_names::STATS);
    let data = MapData::from_pin(&path).with_context(|| format!("opening {}", path.display()))?;
    let stats: aya::maps::PerCpuArray<MapData, u64> =
        aya::maps::PerCpuArray::try_from(Map::PerCpuArray(data))?;
    (0..lb_common::stat::COUNT)
        .map(|i| {
            let per_cpu = stats
                .get(&i, 0)
                .with_context(|| format!("reading {} [{i}]", path.display()))?;
            Ok(per_cpu.iter().sum())
        })
        .collect()
}

/// Pins `link` as `links_dir/pin_name`, then lets go of the link pinned
/// there before (detaching its program) only now that the new one is
/// attached. Returns whether one was replaced; `what` names the link in
/// errors.
pub fn pin_replacing(
    link: FdLink,
    links_dir: &Path,
    pin_name: &str,
    what: &str,
) -> anyhow::Result<bool> {
    let pin = links_dir.join(pin_name);
    // bpffs refuses names with a dot.
    let fresh = links_dir.join(format!("{pin_name}_new"));
    let _ = fs::remove_file(&fresh);
    link.pin(&fresh)
        .with_context(|| format!("pinning the link of {what}"))?;
    let replaced = pin.exists();
    if replaced {
        fs::remove_file(&pin).with_context(|| format!("unpinning {}", pin.display()))?;
    }
    fs::rename(&fresh, &pin).with_context(|| format!("renaming {}", fresh.display()))?;
    Ok(replaced)
}

/// Detaches pinned program links in `dir/links`, as `lb-agent cleanup` does.
pub fn detach_pinned_links(dir: &Path) -> anyhow::Result<usize> {
    let links = dir.join("links");
    let Ok(entries) = fs::read_dir(&links) else {
        return Ok(0);
    };
    let mut n = 0;
    for entry in entries {
        let path = entry?.path();
        let link = PinnedLink::from_pin(&path)
            .with_context(|| format!("opening pinned link {}", path.display()))?;
        // Unpinning drops the last reference once `FdLink` goes: detached.
        drop(
            link.unpin()
                .with_context(|| format!("unpinning {}", path.display()))?,
        );
        n += 1;
    }
    Ok(n)
}

/// Removes every pin in `dir` and the directory itself.
pub fn remove_pins(dir: &Path) -> anyhow::Result<()> {
    match fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e).with_context(|| format!("removing pins in {}", dir.display())),
    }
}

fn io(e: MapError) -> std::io::Error {
    match e {
        MapError::SyscallError(s) => s.io_error,
        MapError::IoError(e) => e,
        MapError::CreateError { io_error, .. } => io_error,
        MapError::KeyNotFound | MapError::ElementNotFound => {
            std::io::Error::from(std::io::ErrorKind::NotFound)
        }
        // An id past `LB_BACKENDS`' length: full, as the kernel says of it.
        MapError::OutOfBounds { .. } => std::io::Error::from_raw_os_error(libc::E2BIG),
        other => std::io::Error::other(other.to_string()),
    }
}

/// A value of `LB_SERVICES` or `LB_BACKENDS`, whose `key_check` this layer
/// writes (`stamp`) and clears when it reads one back (`unstamp`): the
/// reconciler deals in values without it. (An `LB_SLOTS` element's check
/// digests its set and slot, not its index: the reconciler writes it.)
trait Stamped<K: KeyCheck>: Copy {
    fn check_mut(&mut self) -> &mut u32;
    /// The check this value carries under `key`.
    fn check(&self, key: &K) -> u32 {
        key.key_check()
    }
}

impl Stamped<ServiceKey> for ServiceValue {
    fn check_mut(&mut self) -> &mut u32 {
        &mut self.key_check
    }
    fn check(&self, key: &ServiceKey) -> u32 {
        self.check_for(key)
    }
}

impl Stamped<BackendId> for Backend {
    fn check_mut(&mut self) -> &mut u32 {
        &mut self.key_check
    }
}

fn stamp<K: KeyCheck, V: Stamped<K>>(key: &K, mut value: V) -> V {
    *value.check_mut() = value.check(key);
    value
}

/// A value read back without its check; one whose check is not its key's
/// (written by someone else) keeps it, so that it differs from every
/// value the reconciler wants and is rewritten.
fn unstamp<K: KeyCheck, V: Stamped<K>>(key: &K, mut value: V) -> V {
    if *value.check_mut() == value.check(key) {
        *value.check_mut() = 0;
    }
    value
}

/// Every entry of `map` in the reconciler's form: without the key check
/// this layer adds.
fn unstamped_entries<K: aya::Pod + KeyCheck, V: aya::Pod + Stamped<K>>(
    map: &HashMap<MapData, K, V>,
) -> Vec<(K, V)> {
    map.iter()
        .filter_map(Result::ok)
        .map(|(k, v)| (k, unstamp(&k, v)))
        .collect()
}

/// Whether `LB_BACKENDS` element `b` is backend `id`, as the programs
/// take it: a free element is zeros, one written for another id is not.
pub fn backend_in_use(id: BackendId, b: &Backend) -> bool {
    b.key_check == id.key_check()
}

impl PinnedMaps {
    /// Backend `id` as the programs see it: `None` for a free id.
    pub fn backend(&self, id: u32) -> Option<Backend> {
        let b = self.backends.get(id).ok()?;
        backend_in_use(BackendId { id }, &b).then_some(b)
    }

    /// Every `LB_BACKENDS` element that is not free (zeros), with its
    /// check as found, in id order.
    pub fn backend_entries(&self) -> std::io::Result<Vec<(BackendId, Backend)>> {
        let mut entries = Vec::new();
        self.backends.visit(|id, b| {
            if b != Backend::default() {
                entries.push((BackendId { id }, b));
            }
        })?;
        Ok(entries)
    }

    /// Every `LB_SLOTS` element that is not free (zeros), by index.
    pub fn slot_entries(&self) -> std::io::Result<Vec<(u32, BackendSlot)>> {
        let mut entries = Vec::new();
        self.slots.visit(|i, s| {
            if s != BackendSlot::default() {
                entries.push((i, s));
            }
        })?;
        Ok(entries)
    }
}

impl MapOps for PinnedMaps {
    fn backend_busy(&mut self, id: BackendId) -> bool {
        self.open_connections(id.id).is_some_and(|n| n > 0)
    }

    fn reset_backend_state(&mut self, id: BackendId) -> std::io::Result<()> {
        self.reset_backend_health(id.id)?;
        match &mut self.backend_state {
            Some(state) => state.set(id.id, BackendState::default(), 0).map_err(io),
            None => Ok(()),
        }
    }

    fn put_service(&mut self, key: ServiceKey, value: ServiceValue) -> std::io::Result<()> {
        self.services.insert(key, stamp(&key, value), 0).map_err(io)
    }
    fn del_service(&mut self, key: ServiceKey) -> std::io::Result<()> {
        self.services.remove(&key).map_err(io)
    }
    fn put_slot(&mut self, index: u32, value: BackendSlot) -> std::io::Result<()> {
        self.slots.set(index, value)
    }
    fn del_slot(&mut self, index: u32) -> std::io::Result<()> {
        self.slots.set(index, BackendSlot::default())
    }
    fn put_backend(&mut self, id: BackendId, backend: Backend) -> std::io::Result<()> {
        self.backends.set(id.id, stamp(&id, backend))
    }
    /// An array element is not deleted: zeros free it (their check fails).
    fn del_backend(&mut self, id: BackendId) -> std::io::Result<()> {
        self.backends.set(id.id, Backend::default())?;
        // Kubernetes wins: a backend gone from its Services leaves
        // quarantine (best effort; a failure is only a stale record).
        let _ = self.reset_backend_health(id.id);
        Ok(())
    }
    fn put_maglev(&mut self, set: u32, table: &[u32]) -> Result<(), MaglevWriteError> {
        let table = new_maglev_table(table).map_err(MaglevWriteError::Table)?;
        self.maglev
            .insert(set, &table, 0)
            .map_err(|e| MaglevWriteError::Insert(io(e)))
    }
    fn del_maglev(&mut self, set: u32) -> std::io::Result<()> {
        self.maglev.remove(&set).map_err(io)
    }
    fn get_maglev(&mut self, set: u32, size: u16) -> std::io::Result<Vec<u32>> {
        self.maglev_table(set, size)
    }
    fn put_maglevs(&mut self, tables: &[(u32, Vec<u32>)]) -> Vec<Result<(), MaglevWriteError>> {
        use std::os::fd::{AsFd as _, AsRawFd as _};
        let mut results: Vec<Result<(), MaglevWriteError>> = Vec::with_capacity(tables.len());
        // Each table made, then all put in with one batch; each kept open
        // until then.
        let mut made: Vec<(usize, u32, MapData)> = Vec::new();
        for (i, (set, table)) in tables.iter().enumerate() {
            match new_maglev_table(table) {
                Ok(map) => {
                    made.push((i, *set, map));
                    results.push(Ok(()));
                }
                Err(e) => results.push(Err(MaglevWriteError::Table(e))),
            }
        }
        let outer = self.maglev_batch.fd().as_fd();
        let mut rest = &made[..];
        while !rest.is_empty() {
            let sets: Vec<u32> = rest.iter().map(|(_, set, _)| *set).collect();
            let fds: Vec<u32> = rest
                .iter()
                .map(|(_, _, map)| map.fd().as_fd().as_raw_fd() as u32)
                .collect();
            let Err(e) = crate::datapath::batch::update(outer, &sets, &fds) else {
                break;
            };
            let full = e.error.raw_os_error() == Some(libc::E2BIG);
            // Full: so is it for the rest; else the rest go on.
            let failed = if full {
                &rest[e.done..]
            } else {
                &rest[e.done..=e.done]
            };
            for (i, _, _) in failed {
                let error =
                    std::io::Error::from_raw_os_error(e.error.raw_os_error().unwrap_or(libc::EIO));
                results[*i] = Err(MaglevWriteError::Insert(error));
            }
            rest = &rest[e.done + failed.len()..];
        }
        results
    }
    fn del_maglevs(&mut self, sets: &[u32]) -> Vec<(u32, std::io::Error)> {
        use std::os::fd::AsFd as _;
        let fd = self.maglev_batch.fd().as_fd();
        let mut failed = Vec::new();
        let mut rest = sets;
        // A missing table stops a batch: skip it and go on with the rest.
        while let Err(e) = crate::datapath::batch::delete(fd, rest) {
            if e.error.raw_os_error() != Some(libc::ENOENT) {
                failed.push((rest[e.done], e.error));
            }
            rest = &rest[(e.done + 1).min(rest.len())..];
        }
        failed
    }
    // Bulk writes: one bpf(2) call per few thousand elements (see `batch`).
    fn put_backends(
        &mut self,
        items: &[(BackendId, Backend)],
    ) -> crate::datapath::reconcile::BatchResult {
        let stamped: Vec<(u32, Backend)> =
            items.iter().map(|(id, b)| (id.id, stamp(id, *b))).collect();
        self.backends.set_all(&stamped)
    }
    fn put_slots(
        &mut self,
        items: &[(u32, BackendSlot)],
    ) -> crate::datapath::reconcile::BatchResult {
        self.slots.set_all(items)
    }
    fn put_services(
        &mut self,
        items: &[(ServiceKey, ServiceValue)],
    ) -> crate::datapath::reconcile::BatchResult {
        batch_put(self.services.map(), items)
    }
    fn del_slots(&mut self, indexes: &[u32]) {
        let zeros: Vec<(u32, BackendSlot)> = indexes
            .iter()
            .map(|&i| (i, BackendSlot::default()))
            .collect();
        let mut at = 0;
        // Best effort (see `MapOps::del_slots`): past an element that
        // fails, go on with the rest.
        while let Err((done, _)) = self.slots.set_all(&zeros[at..]) {
            at = (at + done + 1).min(zeros.len());
        }
    }
}

/// `items` into `map` through `batch::update` (keys and values as the
/// kernel wants them: two arrays).
fn batch_put<K: Copy + KeyCheck, V: Stamped<K>>(
    map: &MapData,
    items: &[(K, V)],
) -> crate::datapath::reconcile::BatchResult {
    use std::os::fd::AsFd as _;
    let keys: Vec<K> = items.iter().map(|(k, _)| *k).collect();
    let values: Vec<V> = items.iter().map(|(k, v)| stamp(k, *v)).collect();
    crate::datapath::batch::update(map.fd().as_fd(), &keys, &values).map_err(|e| (e.done, e.error))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::testing::lacks_root;

    /// A child cgroup and pin directory that are removed however the test ends.
    struct Scratch {
        cgroup: PathBuf,
        pins: PathBuf,
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = remove_pins(&self.pins);
            let _ = fs::remove_dir(&self.cgroup);
        }
    }

    /// An agent whose conntrack entries are larger than the pinned
    /// tables' (64 bytes, before `CtEntry::hop`) carries every flow over
    /// into its new tables, zero-extended, instead of dropping them: each
    /// is an open NodePort connection.
    #[test]
    fn conntrack_entries_of_the_earlier_layout_are_carried_over() {
        if lacks_root("load BPF programs") {
            return;
        }
        use lb_common::{CtEntry, CtKey};
        let id = std::process::id();
        let scratch = Scratch {
            cgroup: cgroup2_root().unwrap().join(format!("lb-unit-carry-{id}")),
            pins: PathBuf::from(format!("/sys/fs/bpf/lb-unit-carry-{id}")),
        };
        fs::create_dir_all(&scratch.pins).unwrap();
        let small = Capacity::small();
        let key = |port: u16| CtKey {
            src: lb_common::ipv4_mapped([192, 168, 77, 100]),
            dst: lb_common::ipv4_mapped([192, 168, 77, 1]),
            sport: port,
            dport: 30080,
            proto: lb_common::proto::TCP,
            _pad: [0; 3],
        };
        // Old entries: every byte set, so a byte lost or moved shows.
        let old_entry = |port: u16| -> [u8; 64] { std::array::from_fn(|i| (i as u8) ^ port as u8) };
        for (name, ports) in [
            (map_names::CONNTRACK, 40_000..40_010),
            (map_names::CONNTRACK_SYN, 41_000..41_003),
        ] {
            let def = aya_obj::Map::new_from_params(
                map_type::LRU_HASH,
                std::mem::size_of::<CtKey>() as u32,
                64,
                64,
                0,
            );
            let data = MapData::create(def, name, None).unwrap();
            data.pin(scratch.pins.join(name)).unwrap();
            let mut old: HashMap<MapData, CtKey, [u8; 64]> =
                HashMap::try_from(Map::LruHashMap(data)).unwrap();
            for port in ports {
                old.insert(key(port), old_entry(port), 0).unwrap();
            }
        }
        // The port sets of that version: an element of 4 bytes per port.
        for name in [map_names::LOCAL_PORTS, map_names::FRONTEND_PORTS] {
            let def = aya_obj::Map::new_from_params(map_type::ARRAY, 4, 4, 65_536, 0);
            let data = MapData::create(def, name, None).unwrap();
            data.pin(scratch.pins.join(name)).unwrap();
        }
        let refusal = Refusal::for_kernel(&KernelFeatures::probe());
        let (dp, adopted) = Datapath::load_detached(&scratch.pins, &small, refusal).unwrap();
        // Recreated as sets of bits, which the tc maps' opening marks
        // again from the conntrack tables (`TcMaps::open`).
        for name in [map_names::LOCAL_PORTS, map_names::FRONTEND_PORTS] {
            assert!(
                adopted.recreated.iter().any(|r| r.starts_with(name)),
                "{name}: {:?}",
                adopted.recreated
            );
            let info = MapInfo::from_pin(scratch.pins.join(name)).unwrap();
            assert_eq!(
                (info.value_size(), info.max_entries()),
                (8, lb_common::PortBits::ELEMENTS),
                "{name}"
            );
        }
        let carried: Vec<_> = adopted
            .recreated
            .iter()
            .filter(|r| r.contains("carried over"))
            .collect();
        assert_eq!(carried.len(), 2, "{:?}", adopted.recreated);
        for (name, ports) in [
            (map_names::CONNTRACK, 40_000..40_010),
            (map_names::CONNTRACK_SYN, 41_000..41_003),
        ] {
            let path = scratch.pins.join(name);
            assert!(
                !carried_path(&path).exists(),
                "{name}: the old table stays pinned"
            );
            let new: HashMap<MapData, CtKey, CtEntry> =
                HashMap::try_from(Map::LruHashMap(MapData::from_pin(&path).unwrap())).unwrap();
            assert_eq!(new.keys().count(), ports.len(), "{name}");
            for port in ports {
                let e = new.get(&key(port), 0).unwrap();
                // SAFETY: plain data, read as bytes.
                let bytes: [u8; 88] = unsafe { std::mem::transmute(e) };
                assert_eq!(bytes[..64], old_entry(port), "{name} {port}");
                assert_eq!(e.hop, Default::default(), "{name} {port}: no next hop yet");
            }
        }
        drop(dp);
    }

    #[test]
    fn programs_pass_the_verifier_attach_and_pin_named_maps() {
        if lacks_root("load BPF programs") {
            return;
        }
        let id = std::process::id();
        let scratch = Scratch {
            cgroup: cgroup2_root().unwrap().join(format!("lb-unit-{id}")),
            pins: PathBuf::from(format!("/sys/fs/bpf/lb-unit-{id}")),
        };
        fs::create_dir_all(&scratch.cgroup).unwrap();
        let refusal = Refusal::for_kernel(&KernelFeatures::probe());
        let small = Capacity::small();
        let (mut dp, adopted) =
            Datapath::load(&scratch.pins, &scratch.cgroup, &small, refusal).unwrap();
        assert!(adopted.services.is_empty() && adopted.recreated.is_empty());
        for name in map_names::ALL {
            assert!(scratch.pins.join(name).exists(), "{name} not pinned");
        }
        // cgroup_egress only while some frontend has source ranges.
        let egress_link = scratch.pins.join("links").join(EGRESS_PROGRAM);
        assert!(!egress_link.exists());
        dp.set_source_check(true).unwrap();
        assert!(egress_link.exists());
        dp.set_source_check(false).unwrap();
        assert!(!egress_link.exists());
        // A link unpinned by hand is detached: no error, attached again
        // when wanted.
        dp.set_source_check(true).unwrap();
        fs::remove_file(&egress_link).unwrap();
        dp.set_source_check(false).unwrap();
        dp.set_source_check(true).unwrap();
        assert!(egress_link.exists());
        let key = ServiceKey::wildcard(lb_common::ipv4_mapped([10, 96, 0, 1]), 0);
        let value = ServiceValue {
            id: 0,
            backend_set: 0,
            active: 0,
            terminating: 0,
            flags: lb_common::service_flags::WILDCARD,
            maglev_size: 0,
            affinity_timeout: 0,
            affinity_id: 0,
            key_check: 0,
            slot_base: 0,
        };
        dp.maps().put_service(key, value).unwrap();
        // Written with its key's check, read back without it.
        let pinned = dp.maps().services.get(&key, 0).unwrap();
        assert_eq!(pinned.key_check, value.check_for(&key));
        // A Maglev table: made, put in LB_MAGLEV, read back whole.
        let table: Vec<u32> = (0..251).map(|p| p % 3 + 1).collect();
        dp.maps().put_maglev(7, &table).unwrap();
        assert_eq!(dp.maps().get_maglev(7, 251).unwrap(), table);
        assert!(dp.maps().get_maglev(7, 509).is_err(), "not a table of 509");
        let info = dp.maps().maglev.get(&7, 0).unwrap().info().unwrap();
        assert_eq!(info.name_as_str(), Some(map_names::MAGLEV_TABLE));
        assert_eq!(info.max_entries(), 4, "251 positions, 64 an entry");
        // Many at once, one batch: LB_MAGLEV holds 16, one is in.
        let many: Vec<(u32, Vec<u32>)> = (100..120).map(|set| (set, table.clone())).collect();
        let results = dp.maps().put_maglevs(&many);
        let full = |r: &Result<(), MaglevWriteError>| matches!(r, Err(MaglevWriteError::Insert(e)) if e.raw_os_error() == Some(libc::E2BIG));
        assert!(results[..15].iter().all(Result::is_ok), "{results:?}");
        assert!(results[15..].iter().all(full), "{results:?}");
        assert_eq!(dp.maps().get_maglev(114, 251).unwrap(), table);
        // Deleting them, the 5 that are not in included.
        let sets: Vec<u32> = (100..120).collect();
        assert!(dp.maps().del_maglevs(&sets).is_empty());
        assert_eq!(dp.maps().maglev.keys().count(), 1);
        // A second reader through the pins sees the writes.
        let reader = PinnedMaps::open(&scratch.pins).unwrap();
        assert_eq!(unstamp(&key, reader.services.get(&key, 0).unwrap()), value);
        assert_eq!(reader.maglev_table(7, 251).unwrap(), table);
        drop(reader);
        // LB_BACKENDS is an array: a backend is its id's element, freed by
        // zeros; an id past its length does not fit.
        let backend = Backend {
            addr: [1; 16],
            port: 8080,
            proto: 6,
            flags: 0,
            key_check: 0,
        };
        dp.maps().put_backend(BackendId { id: 7 }, backend).unwrap();
        let reader = PinnedMaps::open(&scratch.pins).unwrap();
        assert_eq!(
            reader.backend(7).map(|b| unstamp(&BackendId { id: 7 }, b)),
            Some(backend)
        );
        assert_eq!(reader.backend(6), None);
        dp.maps().del_backend(BackendId { id: 7 }).unwrap();
        assert_eq!(reader.backend(7), None);
        assert_eq!(reader.backend_entries().unwrap(), vec![]);
        let past = BackendId {
            id: small.max_backends,
        };
        assert_eq!(
            dp.maps()
                .put_backend(past, backend)
                .unwrap_err()
                .raw_os_error(),
            Some(libc::E2BIG)
        );
        drop(reader);
        drop(dp);
        // A second load adopts the pinned maps and replaces the links.
        let (mut dp, adopted) =
            Datapath::load(&scratch.pins, &scratch.cgroup, &small, refusal).unwrap();
        assert_eq!(adopted.services, vec![(key, value)]);
        assert_eq!(adopted.maglev, vec![7]);
        assert!(adopted.recreated.is_empty(), "{:?}", adopted.recreated);
        // The socket programs, sock_release, lb_sock_ops and cgroup_egress
        // (attached again as the earlier run left it).
        assert_eq!(adopted.replaced_links, SOCK_PROGRAMS.len() + 3);
        assert!(egress_link.exists());
        assert_eq!(dp.maps().get_maglev(7, 251).unwrap(), table);
        drop(dp);
        // Other capacities: the service maps are recreated, and reported.
        let bigger = Capacity {
            max_services: 128,
            ..small
        };
        let (dp, adopted) =
            Datapath::load(&scratch.pins, &scratch.cgroup, &bigger, refusal).unwrap();
        assert!(adopted.services.is_empty());
        // The four service maps, the affinity and datagram flow maps, the
        // backends' state and health and the sockets' counted backends,
        // whose entries name their ids; and the frontends' state, sized by
        // the services.
        assert_eq!(adopted.recreated.len(), 10, "{:?}", adopted.recreated);
        drop(dp);
        // An upgrade from the 20-byte ServiceValue (before `affinity_id`):
        // recreated cleanly, affinity entries of the old ids with it.
        let services = scratch.pins.join(map_names::SERVICES);
        fs::remove_file(&services).unwrap();
        let created = std::process::Command::new("bpftool")
            .args(["map", "create"])
            .arg(&services)
            .args(["type", "hash", "key", "20", "value", "20", "entries", "128"])
            .args(["name", map_names::SERVICES])
            .status();
        if created.is_ok_and(|s| s.success()) {
            let (dp, adopted) =
                Datapath::load(&scratch.pins, &scratch.cgroup, &bigger, refusal).unwrap();
            let r = &adopted.recreated;
            assert!(
                r.iter()
                    .any(|m| m.starts_with("LB_SERVICES: type/key/value/entries (1, 20, 20, 128)")),
                "{r:?}"
            );
            assert!(r.iter().any(|m| m.starts_with("LB_AFFINITY")), "{r:?}");
            assert!(r.iter().any(|m| m.starts_with("LB_DGRAM_FLOWS")), "{r:?}");
            let info = MapInfo::from_pin(&services).unwrap();
            assert_eq!(
                info.value_size() as usize,
                std::mem::size_of::<ServiceValue>()
            );
            drop(dp);
        }
        // An LB_MAGLEV whose tables are of another kind (arrays of u32, as
        // a template of another version would take): recreated with the
        // service maps.
        let maglev = scratch.pins.join(map_names::MAGLEV);
        let inner = scratch.pins.join("inner");
        fs::remove_file(&maglev).unwrap();
        let bpftool = |args: String| {
            std::process::Command::new("bpftool")
                .args(args.split_whitespace())
                .status()
                .is_ok_and(|s| s.success())
        };
        let (i, m) = (inner.display(), maglev.display());
        if bpftool(format!(
            "map create {i} type array key 4 value 4 entries 4 name old_table flags 4096"
        )) && bpftool(format!(
            "map create {m} type hash_of_maps key 4 value 4 entries 16 name {} inner_map pinned {i}",
            map_names::MAGLEV
        )) && bpftool(format!(
            "map update pinned {m} key 1 0 0 0 value pinned {i}"
        )) {
            let (dp, adopted) = Datapath::load(&scratch.pins, &scratch.cgroup, &bigger, refusal).unwrap();
            let r = &adopted.recreated;
            assert!(
                r.iter()
                    .any(|m| m.starts_with("LB_MAGLEV: tables of type/value/flags (2, 4, 4096)")),
                "{r:?}"
            );
            assert!(r.iter().any(|m| m.starts_with("LB_SERVICES")), "{r:?}");
            drop(dp);
        } else {
            eprintln!("bpftool could not make an LB_MAGLEV of another kind: not checked");
        }
        let _ = fs::remove_file(&inner);
        let (dp, _) = Datapath::load(&scratch.pins, &scratch.cgroup, &bigger, refusal).unwrap();
        dp.unload().unwrap();
        assert!(!scratch.pins.exists());
    }
}
