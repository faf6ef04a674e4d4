//! The tc path as the agent owns it (attaching `tc_ingress`/`tc_egress` to
//! the external devices is `devices`' and `clsact`'s): the settings
//! in `LB_TC_CONFIG`, `loadBalancerSourceRanges` in `LB_SOURCE_RANGES`, and
//! the conntrack map: periodic expiry and UDP flows of backends that stopped
//! serving.
use std::{
    collections::{BTreeMap, BTreeSet},
    ffi::CStr,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::Path,
    time::Duration,
};

use anyhow::Context as _;
use aya::{
    maps::{
        lpm_trie::{Key, LpmTrie},
        Array, HashMap, Map, MapData,
    },
    Ebpf,
};
use lb_common::{
    conntrack, ct_flags, ct_state, map_names, proto, source_range, CtEntry, CtKey, PortBits,
    ServiceRange, ServiceRanges, SourceRangeData, TcConfig,
};

use crate::{
    base::addr::addr_bytes,
    base::addr::ip_from_bytes,
    base::clock::monotonic_now_ns,
    datapath::sweep::Table,
    semantics::model::{BackendAddr, Cidr, DesiredState, Frontend, FrontendState, Scope},
};

pub const INGRESS: &str = "tc_ingress";
pub const EGRESS: &str = "tc_egress";

/// Conntrack lifetimes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    /// An established TCP flow, idle.
    pub tcp: Duration,
    /// A TCP flow from its first SYN until the client acknowledges the
    /// backend's answer (SYN_SENT and SYN_RECV).
    pub tcp_syn: Duration,
    /// A TCP flow once both ends sent a FIN, or after a valid RST.
    pub tcp_close: Duration,
    /// At least, a closed TCP flow whose backend sent the first FIN (its
    /// TIME_WAIT); zero: `tcp_close` alone.
    pub tcp_time_wait: Duration,
    pub udp: Duration,
}

/// Outlier detection's settings (`--outlier-*`), as both paths' programs
/// read them from `LB_TC_CONFIG`. Whether a frontend detects and avoids
/// is its own (`service_flags::OUTLIER_DETECT`, `OUTLIER_AVOID`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutlierSettings {
    /// Failed connects in a row that quarantine a backend.
    pub consecutive_failures: u32,
    /// The first quarantine's length; the nth in a row lasts n times it.
    pub base_ejection: Duration,
    /// The longest quarantine.
    pub max_ejection: Duration,
    /// The most of a frontend's backends quarantined at once, in percent.
    pub max_ejection_percent: u32,
}

impl OutlierSettings {
    /// Fills the outlier fields of `cfg`: durations in ms, saturating.
    pub fn apply(&self, cfg: &mut TcConfig) {
        let ms = |d: Duration| d.as_millis().min(u32::MAX as u128) as u32;
        cfg.outlier_failures = self.consecutive_failures;
        cfg.outlier_base_ms = ms(self.base_ejection);
        cfg.outlier_max_ms = ms(self.max_ejection);
        cfg.outlier_max_percent = self.max_ejection_percent.min(100);
    }
}

/// The lowest SNAT source port: below it are the well-known ports.
const SNAT_PORT_FLOOR: u16 = 1024;
/// The default NodePort range starts here; a masqueraded flow's port stays
/// below it so that a late reply of an expired flow can never be taken for
/// a new NodePort connection.
const NODE_PORT_RANGE_START: u16 = 30_000;

/// SNAT source ports for masqueraded flows, given the node's
/// `ip_local_port_range`: the larger of the blocks the node's own
/// connections never use, so that a masqueraded flow and a local socket
/// (a kubelet probe to the same pod, say) cannot share a 5-tuple. With the
/// default range (32768-60999) that is 1024-29999: ~29 000 ports per
/// backend, where 61000-65535 gave 4 536 and ran out at a few hundred new
/// connections per second and backend.
pub fn snat_ports(local: (u16, u16)) -> (u16, u16) {
    let (lo, hi) = (local.0.min(local.1), local.0.max(local.1));
    let below = (
        SNAT_PORT_FLOOR,
        lo.saturating_sub(1).min(NODE_PORT_RANGE_START - 1),
    );
    let above = (hi.saturating_add(1).max(SNAT_PORT_FLOOR), u16::MAX);
    let size = |(a, b): (u16, u16)| if b >= a { (b - a) as u32 + 1 } else { 0 };
    let above_size = if hi == u16::MAX { 0 } else { size(above) };
    let best = if size(below) >= above_size {
        below
    } else {
        above
    };
    // A local range that leaves almost nothing (1024-65535 is a common
    // tuning): a block below the NodePort range, which the node's own
    // connections then skip because the agent reserves it
    // (`ip_local_reserved_ports`, see `reserve_ports`).
    if size(best) < 4096 {
        SHARED_SNAT_PORTS
    } else {
        best
    }
}

/// The SNAT block when the node's ephemeral range leaves no room.
const SHARED_SNAT_PORTS: (u16, u16) = (20_000, 29_999);

const RESERVED_PORTS: &str = "/proc/sys/net/ipv4/ip_local_reserved_ports";

/// Adds the SNAT range to `net.ipv4.ip_local_reserved_ports` (of the
/// agent's network namespace, the node's; IPv6 follows the same list), so
/// that the node's own connections never pick a port a masqueraded flow
/// holds, whatever its `ip_local_port_range`. Entries already there stay.
pub fn reserve_ports(range: (u16, u16)) -> anyhow::Result<()> {
    let current = std::fs::read_to_string(RESERVED_PORTS)
        .with_context(|| format!("reading {RESERVED_PORTS}"))?;
    if let Some(wanted) = with_reserved(&current, range) {
        std::fs::write(RESERVED_PORTS, &wanted)
            .with_context(|| format!("writing {wanted:?} to {RESERVED_PORTS}"))?;
    }
    Ok(())
}

/// `list` (the sysctl's comma-separated ports and ranges) with `range`
/// added, or None if it already covers the range.
fn with_reserved(list: &str, (lo, hi): (u16, u16)) -> Option<String> {
    let entries: Vec<&str> = list
        .trim()
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .collect();
    let covers = |e: &&str| {
        let mut it = e.splitn(2, '-').map(|p| p.trim().parse::<u16>());
        match (it.next(), it.next()) {
            (Some(Ok(a)), None) => a <= lo && hi <= a,
            (Some(Ok(a)), Some(Ok(b))) => a <= lo && hi <= b,
            _ => false,
        }
    };
    if entries.iter().any(covers) {
        return None;
    }
    let mut out: Vec<String> = entries.iter().map(|e| e.to_string()).collect();
    out.push(format!("{lo}-{hi}"));
    Some(out.join(","))
}

/// The node's `ip_local_port_range` (of the agent's network namespace).
fn local_port_range() -> anyhow::Result<(u16, u16)> {
    const PATH: &str = "/proc/sys/net/ipv4/ip_local_port_range";
    let text = std::fs::read_to_string(PATH).with_context(|| format!("reading {PATH}"))?;
    let mut it = text.split_whitespace().map(str::parse::<u16>);
    match (it.next(), it.next()) {
        (Some(Ok(lo)), Some(Ok(hi))) => Ok((lo, hi)),
        _ => anyhow::bail!("{PATH}: expected two ports, found {text:?}"),
    }
}

/// The IPv4 and IPv6 addresses of each network device, from getifaddrs.
pub fn interface_addresses() -> anyhow::Result<BTreeMap<String, Vec<IpAddr>>> {
    let mut out: BTreeMap<String, Vec<IpAddr>> = BTreeMap::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we free below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(std::io::Error::last_os_error()).context("getifaddrs");
    }
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: a valid element of the list getifaddrs returned.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: NUL-terminated name; the address is of the family it says.
        let name = unsafe { CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        let family = unsafe { (*ifa.ifa_addr).sa_family } as i32;
        let addr = match family {
            libc::AF_INET => {
                let sa = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                IpAddr::V4(Ipv4Addr::from(u32::from_be(sa.sin_addr.s_addr)))
            }
            libc::AF_INET6 => {
                let sa = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                IpAddr::V6(Ipv6Addr::from(sa.sin6_addr.s6_addr))
            }
            _ => continue,
        };
        out.entry(name).or_default().push(addr);
    }
    // SAFETY: the list from getifaddrs, freed once.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

/// Typed handles on the tc maps, opened from their pins.
pub struct TcMaps {
    /// Established TCP and UDP flows.
    pub conntrack: HashMap<MapData, CtKey, CtEntry>,
    /// TCP flows whose handshake is not complete.
    pub conntrack_syn: HashMap<MapData, CtKey, CtEntry>,
    pub ranges: SourceRangeWriter,
    config: Array<MapData, TcConfig>,
    last_config: Option<TcConfig>,
    snat_ports: (u16, u16),
    ports_reserved: bool,
    pub local_ports: PortMarks,
    pub frontend_ports: PortMarks,
}

/// `LB_LOCAL_PORTS` or `LB_FRONTEND_PORTS`: the ports local backends
/// serve on, which `tc_egress` checks before its conntrack lookup, or
/// those the tc path's frontends listen on, which `tc_ingress` checks
/// before its lookups. Ports are marked, never cleared, while the pins
/// last: a flow may outlive its backend's place in every Service, or its
/// frontend (an established connection keeps its conntrack entries), and
/// its packets must still be translated. So the marks are at most every
/// port a local backend ever served on, or a frontend listened on.
pub struct PortMarks {
    map: Array<MapData, PortBits>,
    name: &'static str,
    /// What this process read or wrote of the map, by element.
    known: BTreeMap<u32, PortBits>,
}

impl PortMarks {
    fn open(dir: &Path, name: &'static str) -> anyhow::Result<Self> {
        Ok(Self {
            map: Array::try_from(open(dir, name)?)?,
            name,
            known: BTreeMap::new(),
        })
    }

    /// Marks each (port, protocol) not marked yet, keeping what the map
    /// holds (an earlier process's marks). The errors, for the log: a port
    /// that could not be marked is tried again next time. A protocol the
    /// map does not hold (SCTP, which the tc path does not rewrite) is
    /// passed over.
    pub fn mark(&mut self, ports: impl IntoIterator<Item = (u16, u8)>) -> Vec<String> {
        let mut errors = Vec::new();
        for (port, proto) in ports {
            let Some(index) = PortBits::index(proto, port) else {
                continue;
            };
            let now = match self.known.get(&index) {
                Some(e) => *e,
                None => match self.map.get(&index, 0) {
                    Ok(e) => e,
                    Err(e) => {
                        errors.push(format!("reading {}[{index}]: {e}", self.name));
                        continue;
                    }
                },
            };
            if now.has(port) {
                self.known.insert(index, now);
                continue;
            }
            let marked = now.with(port);
            match self.map.set(index, marked, 0) {
                Ok(()) => {
                    self.known.insert(index, marked);
                }
                Err(e) => errors.push(format!(
                    "marking port {port}/{proto} in {}[{index}]: {e}",
                    self.name
                )),
            }
        }
        errors
    }
}

/// The (port, protocol) of every local backend of a frontend the tc path
/// serves (`Scope::External`): what [`LocalPorts`] must hold before those
/// frontends are published. With `touched`, of those frontends only (an
/// incremental sync: the others' ports were marked when they were last
/// written, and marks stay).
pub fn local_backend_ports(
    desired: &DesiredState,
    touched: Option<&BTreeSet<Frontend>>,
) -> BTreeSet<(u16, u8)> {
    let states: Box<dyn Iterator<Item = (&Frontend, &FrontendState)>> = match touched {
        Some(t) => Box::new(
            t.iter()
                .filter_map(|f| Some((f, &**desired.frontends.get(f)?))),
        ),
        None => Box::new(desired.frontends.iter().map(|(f, s)| (f, &**s))),
    };
    states
        .filter(|(f, _)| f.scope == Scope::External)
        .flat_map(|(_, s)| s.active.iter().chain(&s.terminating))
        .filter(|b| b.local)
        .map(|b| (b.backend.port, b.backend.protocol.number()))
        .collect()
}

/// The (port, protocol) of every frontend the tc path serves
/// (`Scope::External`): what `LB_FRONTEND_PORTS` must hold before those
/// frontends are published. With `touched`, of those frontends only (marks
/// stay, as in [`local_backend_ports`]).
pub fn frontend_ports(
    desired: &DesiredState,
    touched: Option<&BTreeSet<Frontend>>,
) -> BTreeSet<(u16, u8)> {
    let frontends: Box<dyn Iterator<Item = &Frontend>> = match touched {
        Some(t) => Box::new(t.iter().filter(|f| desired.frontends.contains_key(*f))),
        None => Box::new(desired.frontends.keys()),
    };
    frontends
        .filter(|f| f.scope == Scope::External)
        .map(|f| (f.port, f.protocol.number()))
        .collect()
}

/// The ports the flows of `entries` already use: the source (port,
/// protocol) of every reply entry, where flows translated at egress come
/// from (local backends), and the destination of every forward entry,
/// where flows translated at ingress go to (frontends).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct FlowPorts {
    pub reply: BTreeSet<(u16, u8)>,
    pub forward: BTreeSet<(u16, u8)>,
}

/// [`FlowPorts`] in one pass over `entries` (a conntrack table read entry
/// by entry: a full one holds ~100 MB, never held at once here).
pub fn flow_ports(entries: impl IntoIterator<Item = (CtKey, CtEntry)>) -> FlowPorts {
    let mut ports = FlowPorts::default();
    for (k, e) in entries {
        if e.flags & ct_flags::REPLY != 0 {
            ports.reply.insert((k.sport, k.proto));
        } else {
            ports.forward.insert((k.dport, k.proto));
        }
    }
    ports
}

/// `LB_SOURCE_RANGES` and what it holds.
pub struct SourceRangeWriter {
    map: LpmTrie<MapData, SourceRangeData, u32>,
    /// What the map holds: read from the map when it is opened (a pinned
    /// map keeps what an earlier process wrote), then kept by every write
    /// that succeeded.
    programmed: RangeEntries,
}

/// Entries of `LB_SOURCE_RANGES`: (prefix length, data) → value.
type RangeEntries = BTreeMap<(u32, SourceRangeData), u32>;

pub fn open(dir: &Path, name: &str) -> anyhow::Result<Map> {
    let path = dir.join(name);
    let data = MapData::from_pin(&path)
        .with_context(|| format!("opening pinned map {}", path.display()))?;
    Map::from_map_data(data).with_context(|| format!("map {}", path.display()))
}

impl Timeouts {
    /// The timeouts as the kernel reads them (`LB_TC_CONFIG`), in whole
    /// seconds, at least one; the other fields zero (the outlier settings
    /// too: [`OutlierSettings::apply`]).
    pub fn config(&self) -> TcConfig {
        let secs = |d: Duration| d.as_secs().clamp(1, u32::MAX as u64) as u32;
        TcConfig {
            snat_v4: [0; 16],
            snat_v6: [0; 16],
            tcp_timeout_s: secs(self.tcp),
            tcp_close_timeout_s: secs(self.tcp_close),
            udp_timeout_s: secs(self.udp),
            snat_port_min: 0,
            snat_port_max: 0,
            tcp_syn_timeout_s: secs(self.tcp_syn),
            l4_csum_v6_flags: 0,
            tcp_time_wait_timeout_s: self.tcp_time_wait.as_secs().min(u32::MAX as u64) as u32,
            source_ranges: 0,
            outlier_failures: 0,
            outlier_base_ms: 0,
            outlier_max_ms: 0,
            outlier_max_percent: 0,
            service_ranges: ServiceRanges::default(),
        }
    }
}

/// `ranges` as the programs compare with them (`TcConfig::service_ranges`):
/// the first `lb_common::SERVICE_RANGES` (the caller cuts the list to
/// that, reporting the rest).
pub fn kernel_service_ranges(ranges: &[Cidr]) -> ServiceRanges {
    let mut out = ServiceRanges::default();
    for (slot, c) in out.ranges.iter_mut().zip(ranges) {
        let bits = match c.addr {
            IpAddr::V4(_) => 96 + c.prefix as u32,
            IpAddr::V6(_) => c.prefix as u32,
        };
        *slot = ServiceRange::prefix(addr_bytes(c.addr), bits);
        out.len += 1;
    }
    out
}

/// The prefixes of `ranges`, as the agent wrote them.
pub fn service_ranges_of(ranges: &ServiceRanges) -> Vec<Cidr> {
    ranges
        .ranges
        .iter()
        .take(ranges.len as usize)
        .map(|r| {
            let (addr, bits) = r.addr_and_bits();
            // `ip_from_bytes` gives an IPv4-mapped prefix back as IPv4.
            let addr = ip_from_bytes(&addr);
            let prefix = if addr.is_ipv4() {
                bits.saturating_sub(96)
            } else {
                bits
            };
            Cidr {
                addr,
                prefix: prefix as u8,
            }
        })
        .collect()
}

/// Whether a conntrack entry is still live at `now`, by the kernel's own
/// rule (`lb_common::conntrack`). `partner` is the flow's other entry, if
/// known: an entry whose two directions both sent a FIN is closing even if
/// the kernel missed it (two FINs crossing on two CPUs).
pub fn entry_live(
    key: &CtKey,
    e: &CtEntry,
    partner: Option<&CtEntry>,
    now: u64,
    cfg: &TcConfig,
) -> bool {
    let mut e = *e;
    if partner.is_some_and(|p| p.state[ct_state::FIN] != 0) && e.state[ct_state::FIN] != 0 {
        e.state[ct_state::CLOSING] = 1;
    }
    conntrack::live(&e, key.proto, now, cfg)
}

/// The backend an entry is about: the destination of a forward entry, the
/// source of a reply entry.
pub fn entry_backend(key: &CtKey, e: &CtEntry) -> (IpAddr, u16) {
    if e.flags & ct_flags::REPLY != 0 {
        (ip_from_bytes(&key.src), key.sport)
    } else {
        (ip_from_bytes(&e.nat_dst), e.nat_dport)
    }
}

impl TcMaps {
    pub fn open(dir: &Path) -> anyhow::Result<Self> {
        let conntrack: HashMap<MapData, CtKey, CtEntry> =
            HashMap::try_from(open(dir, map_names::CONNTRACK)?)?;
        let conntrack_syn: HashMap<MapData, CtKey, CtEntry> =
            HashMap::try_from(open(dir, map_names::CONNTRACK_SYN)?)?;
        // Flows of an earlier process (the maps may be new to this version)
        // keep their packets translated once this version's tc programs
        // replace the earlier ones.
        let mut local_ports = PortMarks::open(dir, map_names::LOCAL_PORTS)?;
        let mut frontend_ports = PortMarks::open(dir, map_names::FRONTEND_PORTS)?;
        let flows = flow_ports(
            conntrack
                .iter()
                .chain(conntrack_syn.iter())
                .filter_map(Result::ok),
        );
        let errors = local_ports
            .mark(flows.reply)
            .into_iter()
            .chain(frontend_ports.mark(flows.forward));
        for e in errors {
            tracing::error!("{e}");
        }
        Ok(Self {
            conntrack,
            conntrack_syn,
            local_ports,
            frontend_ports,
            ranges: SourceRangeWriter::adopt(LpmTrie::try_from(open(
                dir,
                map_names::SOURCE_RANGES,
            )?)?)?,
            config: Array::try_from(open(dir, map_names::TC_CONFIG)?)?,
            // Needs no reading back: one element, written whole by the
            // first sync of every process whatever it holds.
            last_config: None,
            snat_ports: snat_ports(local_port_range().unwrap_or_else(|e| {
                tracing::warn!("{e:#}; assuming the default 32768-60999");
                (32_768, 60_999)
            })),
            ports_reserved: false,
        })
    }

    /// Reserves the SNAT range from the node's own connections
    /// ([`reserve_ports`]), once; called when the tc programs are attached
    /// to devices, the only case in which the node masquerades.
    pub fn reserve_snat_ports(&mut self) {
        if self.ports_reserved {
            return;
        }
        self.ports_reserved = true;
        let (lo, hi) = self.snat_ports;
        match reserve_ports(self.snat_ports) {
            Ok(()) => tracing::info!("SNAT ports {lo}-{hi} reserved in {RESERVED_PORTS}"),
            Err(e) => {
                tracing::warn!("{e:#}: the node's own connections may pick SNAT ports {lo}-{hi}")
            }
        }
    }

    /// Writes the masquerade addresses, the timeouts, the outlier
    /// detection settings, whether any frontend has source ranges
    /// (`TcConfig::source_ranges`) and the guarded Service CIDRs, when
    /// they changed.
    pub fn write_config(
        &mut self,
        snat_v4: Option<Ipv4Addr>,
        snat_v6: Option<Ipv6Addr>,
        t: &Timeouts,
        outlier: &OutlierSettings,
        source_ranges: bool,
        service_ranges: &[Cidr],
    ) -> anyhow::Result<()> {
        let mut cfg = t.config();
        outlier.apply(&mut cfg);
        cfg.source_ranges = source_ranges.into();
        cfg.service_ranges = kernel_service_ranges(service_ranges);
        cfg.snat_v4 = snat_v4.map_or([0; 16], |a| addr_bytes(IpAddr::V4(a)));
        cfg.snat_v6 = snat_v6.map_or([0; 16], |a| addr_bytes(IpAddr::V6(a)));
        cfg.snat_port_min = self.snat_ports.0;
        cfg.snat_port_max = self.snat_ports.1;
        cfg.l4_csum_v6_flags = l4_csum_v6_flags();
        if self.last_config != Some(cfg) {
            self.config.set(0, cfg, 0).context("writing LB_TC_CONFIG")?;
            self.last_config = Some(cfg);
        }
        Ok(())
    }

    /// The guarded Service CIDRs as last written (`inspect` reads them
    /// from the map: [`service_ranges_of`]).
    pub fn service_ranges(&self) -> Vec<Cidr> {
        self.last_config
            .as_ref()
            .map(|c| service_ranges_of(&c.service_ranges))
            .unwrap_or_default()
    }

    /// Deletes expired entries of both tables: (entries left, entries
    /// deleted).
    /// Adds the counted flows left (`ct_flags::COUNTED`) of each backend
    /// to `counted`, for `BackendStates::correct_flows`.
    pub fn sweep(
        &mut self,
        t: &Timeouts,
        counted: &mut std::collections::HashMap<u32, i32>,
    ) -> (usize, usize) {
        let (left, deleted) = sweep_table(&mut self.conntrack, t, counted);
        let (syn_left, syn_deleted) = sweep_table(&mut self.conntrack_syn, t, counted);
        (left + syn_left, deleted + syn_deleted)
    }

    /// Deletes the UDP flows (both directions) of `(service id, backend)`:
    /// backends that stopped serving their frontend (`stale_udp`), so that
    /// the client's next datagram picks a serving one.
    pub fn purge_udp(&mut self, stale: &BTreeSet<(u32, BackendAddr)>) -> usize {
        let gone: BTreeSet<(u32, IpAddr, u16)> =
            stale.iter().map(|(id, b)| (*id, b.addr, b.port)).collect();
        let doomed: Vec<CtKey> = self
            .conntrack
            .iter()
            .filter_map(Result::ok)
            .filter(|(k, e)| {
                let (addr, port) = entry_backend(k, e);
                let addr = match addr {
                    IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(addr, IpAddr::V4),
                    v4 => v4,
                };
                k.proto == proto::UDP && gone.contains(&(e.service_id, addr, port))
            })
            .map(|(k, _)| k)
            .collect();
        doomed
            .iter()
            .filter(|k| self.conntrack.remove(k).is_ok())
            .count()
    }
}

/// Deletes the expired entries of one table, as `sweep` does (each
/// candidate read again, against a clock read after that, so an entry
/// refreshed since the snapshot is kept); an entry's liveness depends on
/// its partner too, which is why this is not `sweep::sweep`.
///
/// Adds the live counted flows (`ct_flags::COUNTED`) of each backend to
/// `counted`: the forward entries not expired at the snapshot.
fn sweep_table(
    map: &mut HashMap<MapData, CtKey, CtEntry>,
    t: &Timeouts,
    counted: &mut std::collections::HashMap<u32, i32>,
) -> (usize, usize) {
    let snapshot: BTreeMap<CtKey, CtEntry> = map.entries().into_iter().collect();
    let cfg = t.config();
    let candidates = expired(&snapshot, monotonic_now_ns(), &cfg);
    let deleted = delete_if_still_expired(map, &candidates, monotonic_now_ns, &cfg);
    count_flows(&snapshot, &candidates, counted);
    (snapshot.len() - deleted, deleted)
}

/// Adds to `counted` each backend's counted forward entries of
/// `snapshot`, but for those in `expired` (sorted, as `expired` returns
/// them).
fn count_flows(
    snapshot: &BTreeMap<CtKey, CtEntry>,
    expired: &[CtKey],
    counted: &mut std::collections::HashMap<u32, i32>,
) {
    for (k, e) in snapshot {
        if e.flags & (ct_flags::COUNTED | ct_flags::REPLY) == ct_flags::COUNTED
            && expired.binary_search(k).is_err()
        {
            *counted.entry(e.backend_id).or_default() += 1;
        }
    }
}

/// The keys of `snapshot` whose entries are expired at `now`.
fn expired(snapshot: &BTreeMap<CtKey, CtEntry>, now: u64, cfg: &TcConfig) -> Vec<CtKey> {
    let partner = |k: &CtKey, e: &CtEntry| snapshot.get(&CtKey::partner(e, k.proto)).copied();
    snapshot
        .iter()
        .filter(|(k, e)| !entry_live(k, e, partner(k, e).as_ref(), now, cfg))
        .map(|(k, _)| *k)
        .collect()
}

/// Deletes each of `candidates` that is still expired when read again,
/// against a clock read after that read. Returns how many went.
fn delete_if_still_expired(
    map: &mut impl Table<CtKey, CtEntry>,
    candidates: &[CtKey],
    clock: impl Fn() -> u64,
    cfg: &TcConfig,
) -> usize {
    let mut deleted = 0;
    for key in candidates {
        let Some(fresh) = map.entry(key) else {
            continue;
        };
        let other = map.entry(&CtKey::partner(&fresh, key.proto));
        if !entry_live(key, &fresh, other.as_ref(), clock(), cfg) && map.delete(key) {
            deleted += 1;
        }
    }
    deleted
}

/// `BPF_F_IPV6` for `bpf_l4_csum_replace` where the kernel knows it (Linux
/// 6.16; older kernels refuse unknown flags, which would fail every IPv6
/// rewrite).
fn l4_csum_v6_flags() -> u32 {
    const BPF_F_IPV6: u32 = 1 << 7;
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut parts = release
        .trim()
        .split(['.', '-'])
        .map(|p| p.parse::<u32>().ok());
    match (parts.next().flatten(), parts.next().flatten()) {
        (Some(major), Some(minor)) if (major, minor) >= (6, 16) => BPF_F_IPV6,
        _ => 0,
    }
}

impl SourceRangeWriter {
    /// The map of a loaded object (tests).
    pub fn from_ebpf(ebpf: &mut Ebpf) -> Self {
        let map = ebpf
            .take_map(map_names::SOURCE_RANGES)
            .expect("LB_SOURCE_RANGES in the object");
        Self::adopt(LpmTrie::try_from(map).expect("an LPM trie")).expect("LB_SOURCE_RANGES read")
    }

    /// Takes the map over as it is: a pinned map holds what an earlier
    /// process wrote (its objects may have changed while no agent ran), so
    /// the first [`sync`](Self::sync) compares against that, never against
    /// an empty map.
    pub fn adopt(map: LpmTrie<MapData, SourceRangeData, u32>) -> anyhow::Result<Self> {
        let programmed = map
            .iter()
            .map(|entry| {
                let (key, value) = entry.context("reading LB_SOURCE_RANGES")?;
                Ok(((key.prefix_len(), key.data()), value))
            })
            .collect::<anyhow::Result<RangeEntries>>()?;
        Ok(Self { map, programmed })
    }

    /// Programs `loadBalancerSourceRanges`: per frontend a DENY marker and
    /// one ALLOW entry per range; removes what is no longer wanted. Only
    /// writes that succeeded change the record, so a failed one is tried
    /// again by the next sync.
    pub fn sync(&mut self, wanted: &BTreeMap<Frontend, Vec<Cidr>>) -> Vec<String> {
        let want = range_entries(wanted);
        let (inserts, removes) = range_changes(&self.programmed, &want);
        let mut errors = Vec::new();
        for ((bits, data), value) in inserts {
            match self.map.insert(&Key::new(bits, data), value, 0) {
                Ok(()) => {
                    self.programmed.insert((bits, data), value);
                }
                Err(e) => errors.push(format!("LB_SOURCE_RANGES insert: {e}")),
            }
        }
        for (bits, data) in removes {
            match self.map.remove(&Key::new(bits, data)) {
                // Removed, or already gone: either way not there now.
                Ok(()) => {
                    self.programmed.remove(&(bits, data));
                }
                Err(aya::maps::MapError::SyscallError(e))
                    if e.io_error.raw_os_error() == Some(libc::ENOENT) =>
                {
                    self.programmed.remove(&(bits, data));
                }
                Err(e) => errors.push(format!("LB_SOURCE_RANGES remove: {e}")),
            }
        }
        errors
    }
}

/// What `LB_SOURCE_RANGES` must hold for `wanted`: per frontend a DENY
/// marker (the frontend's 160 bits) and an ALLOW entry per range of its
/// family, host bits zeroed. Ranges bind per family, as kube-proxy's
/// `serviceport.go` splits them: a frontend without a range of its own
/// family is open (an IPv4 LoadBalancer IP of a Service whose ranges are
/// all IPv6 serves everyone), so it gets no marker.
fn range_entries(wanted: &BTreeMap<Frontend, Vec<Cidr>>) -> RangeEntries {
    let mut want = RangeEntries::new();
    for (f, ranges) in wanted {
        if !ranges.iter().any(|c| c.addr.is_ipv4() == f.addr.is_ipv4()) {
            continue;
        }
        let base = SourceRangeData {
            addr: addr_bytes(f.addr),
            port: f.port,
            proto: f.protocol.number(),
            _pad: 0,
            src: [0; 16],
        };
        want.insert((source_range::FRONTEND_BITS, base), source_range::DENY);
        for c in ranges {
            // A range of the other family never matches this frontend.
            if c.addr.is_ipv4() != f.addr.is_ipv4() {
                continue;
            }
            let bits = if c.addr.is_ipv4() {
                96 + c.prefix as u32
            } else {
                c.prefix as u32
            };
            let mut src = addr_bytes(c.addr);
            // Zero the host bits, as the trie expects.
            for (i, b) in src.iter_mut().enumerate() {
                let keep = bits.saturating_sub(i as u32 * 8).min(8);
                *b &= if keep == 0 { 0 } else { 0xffu8 << (8 - keep) };
            }
            want.insert(
                (
                    source_range::FRONTEND_BITS + bits,
                    SourceRangeData { src, ..base },
                ),
                source_range::ALLOW,
            );
        }
    }
    want
}

/// The writes that turn `held` into `want`: entries to insert (missing, or
/// with another value) and keys to remove, in an order that never refuses
/// an allowed source meanwhile: ALLOW entries go in before DENY markers,
/// and markers come out before ALLOW entries. (A frontend newly restricted
/// denies only once its ranges are in; one no longer restricted stops
/// denying before its ranges go.)
#[allow(clippy::type_complexity)]
fn range_changes(
    held: &RangeEntries,
    want: &RangeEntries,
) -> (
    Vec<((u32, SourceRangeData), u32)>,
    Vec<(u32, SourceRangeData)>,
) {
    let is_marker = |k: &(u32, SourceRangeData)| k.0 == source_range::FRONTEND_BITS;
    let mut inserts: Vec<_> = want
        .iter()
        .filter(|(k, v)| held.get(k) != Some(v))
        .map(|(k, v)| (*k, *v))
        .collect();
    inserts.sort_by_key(|(k, _)| is_marker(k));
    let mut removes: Vec<_> = held
        .keys()
        .filter(|k| !want.contains_key(k))
        .copied()
        .collect();
    removes.sort_by_key(|k| !is_marker(k));
    (inserts, removes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_ports_are_those_of_local_backends_of_external_frontends() {
        use crate::semantics::model::{Algorithm, BackendRef, FrontendKind, Protocol, ServiceName};
        let b = |port, protocol, local| BackendRef {
            backend: BackendAddr {
                addr: "10.244.1.10".parse().unwrap(),
                port,
                protocol,
            },
            local,
        };
        let state = |active: Vec<BackendRef>, terminating: Vec<BackendRef>| FrontendState {
            service: ServiceName {
                namespace: "demo".into(),
                name: "web".into(),
            },
            port_name: String::new(),
            kind: FrontendKind::NodePort,
            active,
            terminating,
            serving: vec![],
            affinity_timeout: None,
            selection: Default::default(),
            algorithm: Algorithm::Random,
            reject: false,
            source_ranges: false,
            outlier: Default::default(),
        };
        let f = |port, protocol, scope| Frontend {
            addr: "192.168.77.1".parse().unwrap(),
            port,
            protocol,
            scope,
        };
        let (tcp, udp) = (Protocol::Tcp, Protocol::Udp);
        let mut desired = DesiredState::default();
        for (frontend, st) in [
            // Local and remote backends of a NodePort: the local one's port.
            (
                f(30080, tcp, Scope::External),
                state(vec![b(8080, tcp, true), b(8081, tcp, false)], vec![]),
            ),
            // A terminating local backend still sends replies.
            (
                f(30053, udp, Scope::External),
                state(vec![], vec![b(5353, udp, true)]),
            ),
            // The socket path's copy: not the tc path's.
            (
                f(30081, tcp, Scope::Internal),
                state(vec![b(9090, tcp, true)], vec![]),
            ),
        ] {
            desired.frontends.insert(frontend, st.into());
        }
        assert_eq!(
            local_backend_ports(&desired, None),
            BTreeSet::from([(5353, proto::UDP), (8080, proto::TCP)])
        );
        // An incremental sync: only the touched frontends (one removed
        // since, which has none).
        let touched = BTreeSet::from([
            f(30053, udp, Scope::External),
            f(30099, tcp, Scope::External),
        ]);
        assert_eq!(
            local_backend_ports(&desired, Some(&touched)),
            BTreeSet::from([(5353, proto::UDP)])
        );
        // Frontend ports: those the tc path serves, whatever their backends.
        assert_eq!(
            frontend_ports(&desired, None),
            BTreeSet::from([(30053, proto::UDP), (30080, proto::TCP)])
        );
        assert_eq!(
            frontend_ports(&desired, Some(&touched)),
            BTreeSet::from([(30053, proto::UDP)])
        );
    }

    /// Flows of an earlier process keep their packets translated: their
    /// forward entries' destination ports are frontend ports, their reply
    /// entries' source ports local backend ports.
    #[test]
    fn ports_of_existing_flows() {
        let fwd = (key(proto::TCP), entry(0, 0));
        let rev = (
            CtKey::partner(&fwd.1, proto::UDP),
            entry(ct_flags::REPLY, 0),
        );
        let ports = flow_ports([fwd, rev]);
        assert_eq!(ports.forward, BTreeSet::from([(fwd.0.dport, proto::TCP)]));
        assert_eq!(ports.reply, BTreeSet::from([(rev.0.sport, proto::UDP)]));
    }

    #[test]
    fn snat_ports_avoid_the_local_range_and_node_ports() {
        for (local, want) in [
            // Linux's default: everything below, up to the NodePort range.
            ((32_768, 60_999), (1024, 29_999)),
            // A wide local range leaves the top.
            ((1024, 50_000), (50_001, 65_535)),
            // A low local range: above it is larger.
            ((2000, 10_000), (10_001, 65_535)),
            // Written high-low: the same range.
            ((60_999, 32_768), (1024, 29_999)),
            // (Almost) everything local: a block below the NodePort range,
            // reserved from the node's own connections.
            ((1, 65_535), (20_000, 29_999)),
            ((1024, 65_535), (20_000, 29_999)),
            ((1500, 65_000), (20_000, 29_999)),
        ] {
            assert_eq!(snat_ports(local), want, "ip_local_port_range {local:?}");
        }
    }

    #[test]
    fn the_snat_range_is_added_to_the_reserved_ports_once() {
        assert_eq!(
            with_reserved("\n", (1024, 29_999)).as_deref(),
            Some("1024-29999")
        );
        assert_eq!(
            with_reserved("8080,9000-9100\n", (1024, 29_999)).as_deref(),
            Some("8080,9000-9100,1024-29999")
        );
        assert_eq!(with_reserved("1024-29999\n", (1024, 29_999)), None);
        assert_eq!(with_reserved("80,1000-30000", (1024, 29_999)), None);
    }

    fn entry(flags: u8, last_seen_ns: u64) -> CtEntry {
        CtEntry {
            nat_src: [0; 16],
            nat_dst: lb_common::ipv4_mapped([10, 244, 2, 10]),
            nat_sport: 61_234,
            nat_dport: 8080,
            backend_id: 3,
            service_id: 7,
            flags,
            state: [0; ct_state::COUNT],
            last_seen_ns,
            ack_seq: 0,
            backend_time_wait: 0,
            answered: 0,
            syn_timed_out: 0,
            syn_seq: 0,
            hop: Default::default(),
        }
    }

    fn with_state(mut e: CtEntry, states: &[usize]) -> CtEntry {
        for &i in states {
            e.state[i] = 1;
        }
        e
    }

    fn key(proto: u8) -> CtKey {
        CtKey {
            src: lb_common::ipv4_mapped([192, 168, 77, 100]),
            dst: lb_common::ipv4_mapped([192, 168, 77, 1]),
            sport: 40_000,
            dport: 30_080,
            proto,
            _pad: [0; 3],
        }
    }

    #[test]
    fn lifetimes_by_protocol_and_state() {
        let t = Timeouts {
            tcp: Duration::from_secs(100),
            tcp_syn: Duration::from_secs(60),
            tcp_close: Duration::from_secs(10),
            tcp_time_wait: Duration::from_secs(60),
            udp: Duration::from_secs(30),
        };
        let s = 1_000_000_000u64 as i64;
        use ct_state::{CLOSING, FIN, SEEN_REPLY};
        let cases: [(u8, &[usize], i64, bool); 12] = [
            (proto::TCP, &[SEEN_REPLY], 99 * s, true),
            (proto::TCP, &[SEEN_REPLY], 101 * s, false),
            // Not answered yet: the SYN timeout.
            (proto::TCP, &[], 59 * s, true),
            (proto::TCP, &[], 61 * s, false),
            // Half-closed: still established.
            (proto::TCP, &[SEEN_REPLY, FIN], 99 * s, true),
            (proto::TCP, &[SEEN_REPLY, CLOSING], 9 * s, true),
            (proto::TCP, &[SEEN_REPLY, CLOSING], 11 * s, false),
            (proto::UDP, &[], 29 * s, true),
            (proto::UDP, &[], 31 * s, false),
            // Refreshed on another CPU after this reader took its clock.
            (proto::TCP, &[SEEN_REPLY], -s, true),
            (proto::TCP, &[], -5 * s, true),
            (proto::UDP, &[], -1, true),
        ];
        for (p, states, age, want) in cases {
            let e = with_state(entry(0, 1000 * s as u64), states);
            let now = (1000 * s + age) as u64;
            assert_eq!(
                entry_live(&key(p), &e, None, now, &t.config()),
                want,
                "{p} {states:?} {age}"
            );
        }
        // Both ends sent a FIN, the kernel did not mark it (two CPUs):
        // closing all the same.
        let fin = with_state(entry(0, 1000 * s as u64), &[SEEN_REPLY, FIN]);
        let now = (1011 * s) as u64;
        assert!(entry_live(&key(proto::TCP), &fin, None, now, &t.config()));
        assert!(!entry_live(
            &key(proto::TCP),
            &fin,
            Some(&fin),
            now,
            &t.config()
        ));
        // Closed by the backend first: its TIME_WAIT (60 s here), unless
        // that is off (0 s).
        let mut by_backend = with_state(entry(0, 1000 * s as u64), &[SEEN_REPLY, CLOSING]);
        by_backend.backend_time_wait = 1;
        let live_at = |age: i64, t: &Timeouts| {
            let now = (1000 * s + age) as u64;
            entry_live(&key(proto::TCP), &by_backend, None, now, &t.config())
        };
        assert!(live_at(59 * s, &t));
        assert!(!live_at(61 * s, &t));
        let off = Timeouts {
            tcp_time_wait: Duration::ZERO,
            ..t
        };
        assert!(live_at(9 * s, &off));
        assert!(!live_at(11 * s, &off));
    }

    #[test]
    fn service_ranges_round_trip_through_the_kernel_form() {
        let cidrs: Vec<Cidr> = ["10.96.0.0/16", "fd00:10:96::/112", "192.168.0.0/24"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        let k = kernel_service_ranges(&cidrs);
        assert_eq!(k.len, 3);
        assert_eq!(service_ranges_of(&k), cidrs);
        assert!(k.contains(&addr_bytes("10.96.1.2".parse().unwrap())));
        assert!(!k.contains(&addr_bytes("10.97.1.2".parse().unwrap())));
        assert!(k.contains(&addr_bytes("fd00:10:96::5".parse().unwrap())));
        assert_eq!(service_ranges_of(&kernel_service_ranges(&[])), vec![]);
    }

    #[test]
    fn outlier_settings_in_ms_saturating() {
        let mut cfg = Timeouts {
            tcp: Duration::from_secs(100),
            tcp_syn: Duration::from_secs(60),
            tcp_close: Duration::from_secs(10),
            tcp_time_wait: Duration::from_secs(60),
            udp: Duration::from_secs(30),
        }
        .config();
        let before = cfg;
        OutlierSettings {
            consecutive_failures: 3,
            base_ejection: Duration::from_millis(10_500),
            max_ejection: Duration::from_secs(300),
            max_ejection_percent: 50,
        }
        .apply(&mut cfg);
        assert_eq!(
            (
                cfg.outlier_failures,
                cfg.outlier_base_ms,
                cfg.outlier_max_ms,
                cfg.outlier_max_percent
            ),
            (3, 10_500, 300_000, 50)
        );
        // The rest is the timeouts'.
        assert_eq!(
            TcConfig {
                outlier_failures: 0,
                outlier_base_ms: 0,
                outlier_max_ms: 0,
                outlier_max_percent: 0,
                ..cfg
            },
            before
        );
        OutlierSettings {
            consecutive_failures: 1,
            base_ejection: Duration::from_secs(u64::MAX),
            max_ejection: Duration::from_secs(50 * 24 * 3600),
            max_ejection_percent: 100,
        }
        .apply(&mut cfg);
        assert_eq!(
            (cfg.outlier_base_ms, cfg.outlier_max_ms),
            (u32::MAX, u32::MAX)
        );
    }

    /// The sweep's walk is a snapshot; the kernel refreshes entries
    /// meanwhile. One refreshed after the snapshot must stay.
    #[test]
    fn the_sweep_keeps_entries_refreshed_after_its_snapshot() {
        let t = Timeouts {
            tcp: Duration::from_secs(100),
            tcp_syn: Duration::from_secs(60),
            tcp_close: Duration::from_secs(10),
            tcp_time_wait: Duration::from_secs(60),
            udp: Duration::from_secs(30),
        };
        let s = 1_000_000_000u64;
        let mut table = BTreeMap::new();
        let busy = key(proto::UDP);
        let idle = CtKey {
            sport: 40_001,
            ..busy
        };
        table.insert(busy, entry(0, 10 * s));
        table.insert(idle, entry(0, 10 * s));
        let now = 50 * s;
        let candidates = expired(&table, now, &t.config());
        assert_eq!(candidates, vec![busy, idle]);
        // A packet of the busy flow, on another CPU, after the snapshot.
        table.get_mut(&busy).unwrap().last_seen_ns = now + 1;
        let deleted = delete_if_still_expired(&mut table, &candidates, || now, &t.config());
        assert_eq!(deleted, 1);
        assert!(table.contains_key(&busy), "refreshed entry deleted");
        assert!(!table.contains_key(&idle));
    }

    #[test]
    fn backend_of_each_direction() {
        let k = key(proto::UDP);
        assert_eq!(
            entry_backend(&k, &entry(0, 0)),
            ("10.244.2.10".parse().unwrap(), 8080)
        );
        let reply_key = CtKey::partner(&entry(0, 0), proto::UDP);
        // A reply entry rewrites towards the client: only its key names the
        // backend.
        let reply = CtEntry {
            nat_dst: k.src,
            nat_dport: k.sport,
            ..entry(ct_flags::REPLY, 0)
        };
        assert_eq!(
            entry_backend(&reply_key, &reply),
            ("10.244.2.10".parse().unwrap(), 8080)
        );
    }

    fn ranged(addr: &str, ranges: &[&str]) -> BTreeMap<Frontend, Vec<Cidr>> {
        let f = Frontend {
            addr: addr.parse().unwrap(),
            port: 80,
            protocol: crate::semantics::model::Protocol::Tcp,
            scope: crate::semantics::model::Scope::External,
        };
        BTreeMap::from([(f, ranges.iter().map(|r| r.parse().unwrap()).collect())])
    }

    /// (prefix length, source, value) of each entry, in key order.
    fn shown(entries: &RangeEntries) -> Vec<(u32, IpAddr, u32)> {
        entries
            .iter()
            .map(|((bits, d), v)| (*bits, ip_from_bytes(&d.src), *v))
            .collect()
    }

    /// kube-proxy splits the ranges by family: an IPv4 frontend whose
    /// ranges are all IPv6 is open, not closed to everyone.
    #[test]
    fn a_frontend_without_ranges_of_its_family_is_open() {
        assert!(range_entries(&ranged("203.0.113.30", &["fd00::/8"])).is_empty());
        assert!(range_entries(&ranged("fd00:96::30", &["10.0.0.0/8"])).is_empty());
        assert_eq!(
            range_entries(&ranged("fd00:96::30", &["10.0.0.0/8", "fd00::/8"])).len(),
            2
        );
    }

    #[test]
    fn range_entries_are_a_marker_and_one_allow_per_range_of_the_family() {
        let want = range_entries(&ranged(
            "203.0.113.30",
            &["10.1.2.3/8", "192.168.77.100/32", "fd00::/8"],
        ));
        let zero: IpAddr = "::".parse().unwrap();
        assert_eq!(
            shown(&want),
            vec![
                (160, zero, source_range::DENY),
                // Host bits zeroed; the IPv6 range skipped.
                (
                    160 + 96 + 8,
                    "10.0.0.0".parse().unwrap(),
                    source_range::ALLOW
                ),
                (
                    160 + 96 + 32,
                    "192.168.77.100".parse().unwrap(),
                    source_range::ALLOW
                ),
            ]
        );
        let want = range_entries(&ranged("fd00:203::30", &["fd00:77::1/64", "10.0.0.0/8"]));
        assert_eq!(
            shown(&want),
            vec![
                (160, zero, source_range::DENY),
                (160 + 64, "fd00:77::".parse().unwrap(), source_range::ALLOW),
            ]
        );
        // `::/0` has the marker's key: it allows everyone (the marker's
        // DENY once won, refusing every source).
        let want = range_entries(&ranged("fd00:203::30", &["::/0"]));
        assert_eq!(shown(&want), vec![(160, zero, source_range::ALLOW)]);
    }

    /// What a restarted agent finds pinned is compared with what is
    /// wanted: ranges that changed while no agent ran are replaced, and a
    /// frontend no longer restricted loses its marker and its ranges.
    #[test]
    fn range_changes_diff_against_what_the_map_holds() {
        let lb = "203.0.113.30";
        let held = range_entries(&ranged(lb, &["192.168.77.100/32"]));
        let want = range_entries(&ranged(lb, &["192.168.77.101/32"]));
        let (inserts, removes) = range_changes(&held, &want);
        let a: IpAddr = "192.168.77.100".parse().unwrap();
        let b: IpAddr = "192.168.77.101".parse().unwrap();
        let src = |k: &(u32, SourceRangeData)| ip_from_bytes(&k.1.src);
        assert_eq!(
            inserts
                .iter()
                .map(|(k, v)| (src(k), *v))
                .collect::<Vec<_>>(),
            vec![(b, source_range::ALLOW)],
            "the marker is there already"
        );
        assert_eq!(removes.iter().map(src).collect::<Vec<_>>(), vec![a]);

        // Unchanged: nothing to write.
        assert_eq!(range_changes(&held, &held), (vec![], vec![]));

        // No longer restricted: the marker goes first, then the range.
        let (inserts, removes) = range_changes(&held, &RangeEntries::new());
        assert!(inserts.is_empty());
        assert_eq!(
            removes.iter().map(|k| k.0).collect::<Vec<_>>(),
            vec![160, 160 + 96 + 32]
        );

        // Newly restricted: the ranges go in before the marker.
        let want = range_entries(&ranged(lb, &["10.0.0.0/8", "192.168.77.100/32"]));
        let (inserts, removes) = range_changes(&RangeEntries::new(), &want);
        assert!(removes.is_empty());
        assert_eq!(
            inserts.iter().map(|(k, _)| k.0).collect::<Vec<_>>(),
            vec![160 + 96 + 8, 160 + 96 + 32, 160]
        );

        // An entry held with another value is written again.
        let mut odd = held.clone();
        let marker = *odd.keys().next().unwrap();
        odd.insert(marker, source_range::ALLOW);
        assert_eq!(
            range_changes(&odd, &held),
            (vec![(marker, source_range::DENY)], vec![])
        );
    }
}
