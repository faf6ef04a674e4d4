//! The tc path as the agent owns it: attaching `tc_ingress`/`tc_egress` to
//! the external devices (TCX links pinned in `<bpffs>/links`), the settings
//! in `LB_TC_CONFIG`, `loadBalancerSourceRanges` in `LB_SOURCE_RANGES`, and
//! the conntrack map: periodic expiry and UDP flows of departed backends.
use std::{
    collections::{BTreeMap, BTreeSet},
    ffi::CStr,
    fs,
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
    programs::{
        links::{FdLink, LinkOrder, PinnedLink},
        tc::TcAttachOptions,
        SchedClassifier, TcAttachType,
    },
    Ebpf,
};
use lb_common::{
    ct_flags, map_names, proto, source_range, CtEntry, CtKey, SourceRangeData, TcConfig,
};

use crate::{
    base::addr::addr_bytes,
    base::addr::ip_from_bytes,
    datapath::loader::pin_replacing,
    semantics::model::{BackendAddr, Frontend},
    semantics::northsouth::Cidr,
};

pub const INGRESS: &str = "tc_ingress";
pub const EGRESS: &str = "tc_egress";
/// Prefix of the pinned tc links in `<bpffs>/links`.
const PIN_PREFIX: &str = "tc_";

/// Conntrack lifetimes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    /// An established TCP flow, idle.
    pub tcp: Duration,
    /// A TCP flow from its first SYN until the backend answers.
    pub tcp_syn: Duration,
    /// A TCP flow once both ends sent a FIN, or after a valid RST.
    pub tcp_close: Duration,
    pub udp: Duration,
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
    // A local range that leaves almost nothing: share the top of it rather
    // than masquerade through a handful of ports.
    if size(best) < 1024 {
        (61_000, u16::MAX)
    } else {
        best
    }
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

fn pin_name(direction: &str, device: &str) -> String {
    // bpffs refuses dots in names.
    format!("{direction}_{}", device.replace('.', "_"))
}

/// Attaches both programs to every device through TCX links pinned in
/// `links_dir`, replacing the links of an earlier run after the new ones
/// are attached, and detaching those of devices no longer listed. Returns
/// how many earlier links were replaced or removed.
pub fn attach(ebpf: &mut Ebpf, links_dir: &Path, devices: &[String]) -> anyhow::Result<usize> {
    let mut keep = BTreeSet::new();
    let mut replaced = 0;
    for (name, direction) in [
        (INGRESS, TcAttachType::Ingress),
        (EGRESS, TcAttachType::Egress),
    ] {
        let program: &mut SchedClassifier = ebpf
            .program_mut(name)
            .with_context(|| format!("program {name} missing from the object"))?
            .try_into()
            .with_context(|| format!("program {name} is not a classifier"))?;
        if devices.is_empty() {
            continue;
        }
        if program.fd().is_err() {
            program
                .load()
                .with_context(|| format!("verifying program {name}"))?;
        }
        for dev in devices {
            let id = program
                .attach_with_options(
                    dev,
                    direction,
                    TcAttachOptions::TcxOrder(LinkOrder::default()),
                )
                .with_context(|| format!("attaching {name} to device {dev}"))?;
            let link = FdLink::try_from(program.take_link(id)?)
                .with_context(|| format!("link of {name} on {dev}"))?;
            let pin_base = pin_name(name, dev);
            let what = format!("{name} on {dev}");
            replaced += usize::from(pin_replacing(link, links_dir, &pin_base, &what)?);
            keep.insert(pin_base);
        }
    }
    // Devices of an earlier run that are no longer listed.
    if let Ok(entries) = fs::read_dir(links_dir) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(PIN_PREFIX) && !keep.contains(&name) {
                if let Ok(link) = PinnedLink::from_pin(entry.path()) {
                    drop(link.unpin());
                } else {
                    let _ = fs::remove_file(entry.path());
                }
                replaced += 1;
            }
        }
    }
    Ok(replaced)
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
    pub conntrack: HashMap<MapData, CtKey, CtEntry>,
    pub ranges: SourceRangeWriter,
    config: Array<MapData, TcConfig>,
    last_config: Option<TcConfig>,
    snat_ports: (u16, u16),
}

/// `LB_SOURCE_RANGES` and what this agent wrote into it.
pub struct SourceRangeWriter {
    map: LpmTrie<MapData, SourceRangeData, u32>,
    programmed: BTreeSet<(u32, SourceRangeData)>,
}

pub fn open(dir: &Path, name: &str) -> anyhow::Result<Map> {
    let path = dir.join(name);
    let data = MapData::from_pin(&path)
        .with_context(|| format!("opening pinned map {}", path.display()))?;
    Map::from_map_data(data).with_context(|| format!("map {}", path.display()))
}

/// Whether a conntrack entry is still live at `now`.
pub fn entry_live(key: &CtKey, e: &CtEntry, now: u64, t: &Timeouts) -> bool {
    let timeout = if key.proto == proto::TCP {
        if e.flags & ct_flags::CLOSING != 0 {
            t.tcp_close
        } else {
            t.tcp
        }
    } else {
        t.udp
    };
    now.wrapping_sub(e.last_seen_ns) <= timeout.as_nanos() as u64
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
        Ok(Self {
            conntrack: HashMap::try_from(open(dir, map_names::CONNTRACK)?)?,
            ranges: SourceRangeWriter {
                map: LpmTrie::try_from(open(dir, map_names::SOURCE_RANGES)?)?,
                programmed: BTreeSet::new(),
            },
            config: Array::try_from(open(dir, map_names::TC_CONFIG)?)?,
            last_config: None,
            snat_ports: snat_ports(local_port_range().unwrap_or_else(|e| {
                tracing::warn!("{e:#}; assuming the default 32768-60999");
                (32_768, 60_999)
            })),
        })
    }

    /// Writes the masquerade addresses and timeouts when they changed.
    pub fn write_config(
        &mut self,
        snat_v4: Option<Ipv4Addr>,
        snat_v6: Option<Ipv6Addr>,
        t: &Timeouts,
    ) -> anyhow::Result<()> {
        let secs = |d: Duration| d.as_secs().clamp(1, u32::MAX as u64) as u32;
        let cfg = TcConfig {
            snat_v4: snat_v4.map_or([0; 16], |a| addr_bytes(IpAddr::V4(a))),
            snat_v6: snat_v6.map_or([0; 16], |a| addr_bytes(IpAddr::V6(a))),
            tcp_timeout_s: secs(t.tcp),
            tcp_close_timeout_s: secs(t.tcp_close),
            udp_timeout_s: secs(t.udp),
            snat_port_min: self.snat_ports.0,
            snat_port_max: self.snat_ports.1,
            tcp_syn_timeout_s: secs(t.tcp_syn),
        };
        if self.last_config != Some(cfg) {
            self.config.set(0, cfg, 0).context("writing LB_TC_CONFIG")?;
            self.last_config = Some(cfg);
        }
        Ok(())
    }

    /// Deletes expired entries: (entries left, entries deleted).
    pub fn sweep(&mut self, t: &Timeouts) -> (usize, usize) {
        let now = crate::base::clock::monotonic_now_ns();
        let all: Vec<(CtKey, CtEntry)> = self.conntrack.iter().filter_map(Result::ok).collect();
        let deleted = all
            .iter()
            .filter(|(k, e)| !entry_live(k, e, now, t))
            .filter(|(k, _)| self.conntrack.remove(k).is_ok())
            .count();
        (all.len() - deleted, deleted)
    }

    /// Deletes the UDP flows (both directions) to backends that left their
    /// frontend, so that the client's next datagram picks a live one.
    pub fn purge_udp(&mut self, departed: &BTreeSet<(u32, BackendAddr)>) -> usize {
        let gone: BTreeSet<(u32, IpAddr, u16)> = departed
            .iter()
            .map(|(id, b)| (*id, b.addr, b.port))
            .collect();
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

impl SourceRangeWriter {
    /// The map of a loaded object (tests).
    pub fn from_ebpf(ebpf: &mut Ebpf) -> Self {
        let map = ebpf
            .take_map(map_names::SOURCE_RANGES)
            .expect("LB_SOURCE_RANGES in the object");
        Self {
            map: LpmTrie::try_from(map).expect("an LPM trie"),
            programmed: BTreeSet::new(),
        }
    }

    /// Programs `loadBalancerSourceRanges`: per frontend a DENY marker and
    /// one ALLOW entry per range; removes what is no longer wanted.
    pub fn sync(&mut self, wanted: &BTreeMap<Frontend, Vec<Cidr>>) -> Vec<String> {
        let mut want = BTreeSet::new();
        for (f, ranges) in wanted {
            let base = SourceRangeData {
                addr: addr_bytes(f.addr),
                port: f.port,
                proto: f.protocol.number(),
                _pad: 0,
                src: [0; 16],
            };
            want.insert((source_range::FRONTEND_BITS, base));
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
                want.insert((
                    source_range::FRONTEND_BITS + bits,
                    SourceRangeData { src, ..base },
                ));
            }
        }
        let mut errors = Vec::new();
        for (bits, data) in want.difference(&self.programmed) {
            let value = if *bits == source_range::FRONTEND_BITS {
                source_range::DENY
            } else {
                source_range::ALLOW
            };
            if let Err(e) = self.map.insert(&Key::new(*bits, *data), value, 0) {
                errors.push(format!("LB_SOURCE_RANGES insert: {e}"));
            }
        }
        for (bits, data) in self.programmed.difference(&want) {
            if let Err(e) = self.map.remove(&Key::new(*bits, *data)) {
                errors.push(format!("LB_SOURCE_RANGES remove: {e}"));
            }
        }
        self.programmed = want;
        errors
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            // (Almost) everything local: the old fixed block rather than nothing.
            ((1, 65_535), (61_000, 65_535)),
            ((1500, 65_000), (61_000, 65_535)),
        ] {
            assert_eq!(snat_ports(local), want, "ip_local_port_range {local:?}");
        }
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
            _pad: [0; 3],
            last_seen_ns,
        }
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
            udp: Duration::from_secs(30),
        };
        let s = 1_000_000_000u64;
        let cases = [
            (proto::TCP, 0, 99 * s, true),
            (proto::TCP, 0, 101 * s, false),
            (proto::TCP, ct_flags::CLOSING, 9 * s, true),
            (proto::TCP, ct_flags::CLOSING, 11 * s, false),
            (proto::UDP, 0, 29 * s, true),
            (proto::UDP, 0, 31 * s, false),
        ];
        for (p, flags, age, want) in cases {
            let e = entry(flags, 1000 * s);
            assert_eq!(
                entry_live(&key(p), &e, 1000 * s + age, &t),
                want,
                "{p} {flags} {age}"
            );
        }
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

    #[test]
    fn pin_names_have_no_dots() {
        assert_eq!(pin_name(INGRESS, "eth0.100"), "tc_ingress_eth0_100");
    }
}
