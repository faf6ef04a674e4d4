//! The desired datapath state: what the translation layer (`translate`)
//! produces from Kubernetes objects and what the reconciler (`datapath`)
//! writes into the maps. Plain data, no I/O, ordered so that diffs and
//! outputs are deterministic.
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::IpAddr,
    str::FromStr,
    sync::Arc,
};

use lb_common::{proto, scope};

/// Transport protocol of a frontend or backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub enum Protocol {
    Tcp,
    Udp,
    /// Translated to be reported, never programmed: see [`NotServed`].
    Sctp,
}

impl Protocol {
    pub fn number(self) -> u8 {
        match self {
            Protocol::Tcp => proto::TCP,
            Protocol::Udp => proto::UDP,
            Protocol::Sctp => proto::SCTP,
        }
    }

    pub fn from_number(n: u8) -> Option<Self> {
        match n {
            proto::TCP => Some(Protocol::Tcp),
            proto::UDP => Some(Protocol::Udp),
            proto::SCTP => Some(Protocol::Sctp),
            _ => None,
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Protocol::Tcp => "TCP",
            Protocol::Udp => "UDP",
            Protocol::Sctp => "SCTP",
        })
    }
}

/// Which clients a frontend serves; see `lb_common::scope`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub enum Scope {
    /// In-cluster clients, seen by the socket hooks.
    Internal,
    /// Clients outside the node, seen by the tc path.
    External,
}

impl Scope {
    pub fn number(self) -> u8 {
        match self {
            Scope::Internal => scope::INTERNAL,
            Scope::External => scope::EXTERNAL,
        }
    }

    pub fn from_number(n: u8) -> Option<Self> {
        match n {
            scope::INTERNAL => Some(Scope::Internal),
            scope::EXTERNAL => Some(Scope::External),
            _ => None,
        }
    }
}

/// How a frontend came to be, for inspection and for the tc path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub enum FrontendKind {
    ClusterIp,
    NodePort,
    LoadBalancer,
    ExternalIp,
}

impl FrontendKind {
    /// As logs and `/metrics` name it.
    pub fn name(self) -> &'static str {
        match self {
            FrontendKind::ClusterIp => "ClusterIP",
            FrontendKind::NodePort => "NodePort",
            FrontendKind::LoadBalancer => "LoadBalancer IP",
            FrontendKind::ExternalIp => "externalIP",
        }
    }
}

/// `namespace/name` of a Service.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct ServiceName {
    /// Shared with the Service's `ObjectKey`.
    pub namespace: Arc<str>,
    pub name: Arc<str>,
}

impl fmt::Display for ServiceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// What a client addresses: the identity of one `LB_SERVICES` entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct Frontend {
    pub addr: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
    pub scope: Scope,
}

impl fmt::Display for Frontend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.addr {
            IpAddr::V4(a) => write!(f, "{a}:{}/{}", self.port, self.protocol),
            IpAddr::V6(a) => write!(f, "[{a}]:{}/{}", self.port, self.protocol),
        }
    }
}

/// One endpoint a frontend can send to: the identity of one `LB_BACKENDS` entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct BackendAddr {
    pub addr: IpAddr,
    pub port: u16,
    pub protocol: Protocol,
}

impl fmt::Display for BackendAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.addr {
            IpAddr::V4(a) => write!(f, "{a}:{}", self.port),
            IpAddr::V6(a) => write!(f, "[{a}]:{}", self.port),
        }
    }
}

/// A backend as one frontend uses it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct BackendRef {
    pub backend: BackendAddr,
    /// The endpoint runs on this node.
    pub local: bool,
}

/// The selection algorithm of a frontend (`--algorithm`, the annotation
/// `lb-agent.dev/lb-algorithm`): random and Maglev, and the ipvs mode's
/// schedulers (`lb_common::algorithm` says what each does).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub enum Algorithm {
    #[default]
    Random,
    Maglev,
    /// Round-robin.
    Rr,
    /// Least connection.
    Lc,
    /// Destination hashing.
    Dh,
    /// Source hashing.
    Sh,
    /// Shortest expected delay.
    Sed,
    /// Never queue.
    Nq,
}

impl Algorithm {
    pub const ALL: [Algorithm; 8] = [
        Self::Random,
        Self::Maglev,
        Self::Rr,
        Self::Lc,
        Self::Dh,
        Self::Sh,
        Self::Sed,
        Self::Nq,
    ];

    /// Its value in `ServiceValue::flags` (`lb_common::algorithm`).
    pub fn code(self) -> u8 {
        use lb_common::algorithm as a;
        match self {
            Self::Random => a::RANDOM,
            Self::Maglev => a::MAGLEV,
            Self::Rr => a::RR,
            Self::Lc => a::LC,
            Self::Dh => a::DH,
            Self::Sh => a::SH,
            Self::Sed => a::SED,
            Self::Nq => a::NQ,
        }
    }

    /// The name `--algorithm` and the annotation take.
    pub fn name(self) -> &'static str {
        lb_common::algorithm::NAMES[self.code() as usize]
    }

    /// The algorithm named `name`, as `--algorithm` and the annotation
    /// spell it.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.name() == name)
    }

    /// Whether it selects through a Maglev table (Maglev, sh, dh).
    pub fn uses_table(self) -> bool {
        lb_common::algorithm::uses_table(self.code())
    }
}

/// Outlier detection of a frontend (`--outlier-detection`, the annotation
/// `lb-agent.dev/outlier-detection`): whether the kernel programs count a
/// backend's failed TCP connects and quarantine it, and whether new flows
/// then avoid it. Ordered by how much it does: a Service's annotation can
/// lower the node's mode, never raise it (the lesser of the two applies).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub enum OutlierMode {
    /// Nothing is counted.
    Off,
    /// Failures are counted and backends quarantined (reported), but new
    /// flows still go to them.
    DryRun,
    /// Quarantined backends are avoided by new flows (`--outlier-detection`'s
    /// default).
    #[default]
    On,
}

impl OutlierMode {
    pub const ALL: [OutlierMode; 3] = [Self::Off, Self::DryRun, Self::On];

    /// The name `--outlier-detection` and the annotation take.
    pub fn name(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::DryRun => "dry-run",
            Self::On => "on",
        }
    }

    /// The mode named `name`, as `--outlier-detection` and the annotation
    /// spell it.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.name() == name)
    }

    /// Whether the kernel counts failures and quarantines
    /// (`service_flags::OUTLIER_DETECT`).
    pub fn detects(self) -> bool {
        self >= Self::DryRun
    }

    /// Whether new flows avoid quarantined backends
    /// (`service_flags::OUTLIER_AVOID`).
    pub fn avoids(self) -> bool {
        self == Self::On
    }
}

impl fmt::Display for OutlierMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which endpoints of its Service port a frontend's backends are selected
/// from (kube-proxy's `CategorizeEndpoints`): the traffic policy class of
/// the frontend, the node and the family doing the rest.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub enum Selection {
    /// Every endpoint of the family, narrowed by topology hints: policy
    /// `Cluster`, and the in-cluster copies of north-south frontends.
    #[default]
    Cluster,
    /// Only the endpoints on this node: policy `Local`
    /// (`internalTrafficPolicy` for a ClusterIP, `externalTrafficPolicy`
    /// for the `External` copies of north-south frontends).
    NodeLocal,
}

/// The identity of one sessionAffinity decision: a Service port (as
/// kube-proxy's `ServicePortName`: Service, port name, protocol) of one IP
/// family, and the selection its backends come from. Every frontend of the
/// group has the same backends by construction (the same candidates
/// through the same selection), which is what lets one decision serve all
/// of them: a client alternating between the ClusterIP, externalIPs,
/// LoadBalancer IPs and NodePorts of one port keeps its backend, as with
/// kube-proxy. Frontends of another selection (a `Local` policy) have
/// another set and decide apart; so do other ports and other Services.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct AffinityGroup {
    pub service: ServiceName,
    pub port_name: String,
    pub protocol: Protocol,
    pub ipv6: bool,
    pub selection: Selection,
}

/// Everything the datapath needs to know about one frontend.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct FrontendState {
    pub service: ServiceName,
    /// The Service port's name ("" when unnamed).
    pub port_name: String,
    pub kind: FrontendKind,
    /// Chosen uniformly (or by Maglev); sorted, no duplicates.
    pub active: Vec<BackendRef>,
    /// Serving but terminating, used only while `active` is empty (KEP-1669);
    /// sorted, no duplicates, disjoint from `active`.
    pub terminating: Vec<BackendRef>,
    /// UDP frontends only (empty for TCP, whose connections end on their
    /// own): every serving endpoint of the Service port in the frontend's
    /// family, whatever the traffic policy and topology hints select; sorted,
    /// no duplicates, a superset of `active` and `terminating`. A connected
    /// UDP socket is destroyed only once its backend leaves this set
    /// (`stale_udp`).
    pub serving: Vec<BackendAddr>,
    /// `sessionAffinity: ClientIP` timeout in seconds.
    pub affinity_timeout: Option<u32>,
    /// Which endpoints `active` and `terminating` were selected from.
    pub selection: Selection,
    pub algorithm: Algorithm,
    /// An `External` frontend without backends whose Service has no usable
    /// endpoint of its family anywhere: the tc path REJECTs (TCP RST, ICMP
    /// port unreachable) where an empty frontend otherwise drops
    /// (`externalTrafficPolicy: Local` with endpoints on other nodes only),
    /// as kube-proxy does. Always false for `Internal` frontends, whose
    /// emptiness the socket path already refuses.
    pub reject: bool,
    /// A LoadBalancer frontend whose Service lists `loadBalancerSourceRanges`
    /// of the frontend's family (kube-proxy splits them per family; a family
    /// without ranges is open). On both scopes: kube-proxy checks the ranges
    /// on OUTPUT too, so pods and host processes are bound by them.
    pub source_ranges: bool,
    /// Outlier detection: the lesser of the node's `--outlier-detection`
    /// and the Service's `lb-agent.dev/outlier-detection` annotation.
    pub outlier: OutlierMode,
}

/// A frontend a Service port asks for that no datapath of this agent
/// serves: SCTP. Linux runs no connect or sendmsg hook for SCTP sockets
/// (`sctp_inet_connect` and `sctp_sendmsg` call none; getpeername's runs,
/// with nothing to reverse), and the tc path would have to recompute
/// SCTP's CRC32c on every port rewrite. Reported (log, `lb-agent inspect
/// services`, `lb_frontends_not_served`), never programmed.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct NotServed {
    pub frontend: Frontend,
    pub service: ServiceName,
    /// The Service port's name ("" when unnamed).
    pub port_name: String,
    pub kind: FrontendKind,
    /// The Service's field the frontend comes from (`spec.clusterIPs[0]`,
    /// `spec.ports[1].nodePort`, ...).
    pub field: String,
}

impl FrontendState {
    /// The sessionAffinity decision `frontend` (of this state) shares with
    /// the other frontends of its group; `None` without affinity.
    pub fn affinity_group(&self, frontend: &Frontend) -> Option<AffinityGroup> {
        self.affinity_timeout?;
        Some(AffinityGroup {
            service: self.service.clone(),
            port_name: self.port_name.clone(),
            protocol: frontend.protocol,
            ipv6: frontend.addr.is_ipv6(),
            selection: self.selection,
        })
    }
}

/// The whole desired datapath.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct DesiredState {
    /// Shared with the reconciler's record of what it programmed, so that
    /// a frontend's state is held once however many layers look at it.
    pub frontends: BTreeMap<Frontend, Arc<FrontendState>>,
    /// Addresses that are live VIPs in a scope: a connect to one of them on a
    /// port without a frontend is refused instead of leaking out.
    pub vips: BTreeSet<(IpAddr, Scope)>,
}

/// An address prefix, `10.0.0.0/8` or `fd00::/8`; a bare address is a /32
/// or /128.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Cidr {
    pub addr: IpAddr,
    pub prefix: u8,
}

impl Cidr {
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(a)) => {
                let mask = u32::MAX.checked_shl(32 - self.prefix as u32).unwrap_or(0);
                u32::from(net) & mask == u32::from(a) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(a)) => {
                let mask = u128::MAX.checked_shl(128 - self.prefix as u32).unwrap_or(0);
                u128::from(net) & mask == u128::from(a) & mask
            }
            _ => false,
        }
    }

    /// The prefix with its address's host bits cleared.
    pub fn network(&self) -> Cidr {
        let addr = match self.addr {
            IpAddr::V4(a) => {
                let mask = u32::MAX.checked_shl(32 - self.prefix as u32).unwrap_or(0);
                IpAddr::V4((u32::from(a) & mask).into())
            }
            IpAddr::V6(a) => {
                let mask = u128::MAX.checked_shl(128 - self.prefix as u32).unwrap_or(0);
                IpAddr::V6((u128::from(a) & mask).into())
            }
        };
        Cidr { addr, ..*self }
    }

    /// Whether every address of `other` is in this prefix (of one family,
    /// IPv4-mapped IPv6 addresses taken as IPv6).
    pub fn contains_cidr(&self, other: &Cidr) -> bool {
        self.addr.is_ipv4() == other.addr.is_ipv4()
            && other.prefix >= self.prefix
            && Cidr {
                prefix: self.prefix,
                ..*other
            }
            .network()
                == self.network()
    }
}

impl FromStr for Cidr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let (addr, prefix) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr: IpAddr = addr
            .parse()
            .map_err(|_| format!("{s:?} is not an address prefix"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            None => max,
            Some(p) => p
                .parse::<u8>()
                .ok()
                .filter(|p| *p <= max)
                .ok_or_else(|| format!("{s:?}: prefix length must be 0..={max}"))?,
        };
        Ok(Cidr { addr, prefix })
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outlier_modes_by_name_and_order() {
        for m in OutlierMode::ALL {
            assert_eq!(OutlierMode::from_name(m.name()), Some(m));
        }
        assert_eq!(OutlierMode::from_name("dry-run"), Some(OutlierMode::DryRun));
        assert_eq!(OutlierMode::from_name("On"), None);
        assert_eq!(OutlierMode::from_name("dryrun"), None);
        assert!(OutlierMode::Off < OutlierMode::DryRun && OutlierMode::DryRun < OutlierMode::On);
        assert_eq!(OutlierMode::default(), OutlierMode::On);
        let detects: Vec<bool> = OutlierMode::ALL.iter().map(|m| m.detects()).collect();
        let avoids: Vec<bool> = OutlierMode::ALL.iter().map(|m| m.avoids()).collect();
        assert_eq!(detects, [false, true, true]);
        assert_eq!(avoids, [false, false, true]);
    }

    #[test]
    fn cidr_parse_and_contains() {
        let cases = [
            ("10.0.0.0/8", "10.1.2.3", true),
            ("10.0.0.0/8", "11.0.0.1", false),
            ("10.0.0.0/8", "::ffff:10.9.9.9", true),
            ("0.0.0.0/0", "192.168.1.1", true),
            ("0.0.0.0/0", "fd00::1", false),
            ("fd00::/8", "fd00:77::1", true),
            ("fd00::/8", "fe80::1", false),
            ("192.168.77.100", "192.168.77.100", true),
            ("192.168.77.100", "192.168.77.101", false),
        ];
        for (c, a, want) in cases {
            let c: Cidr = c.parse().unwrap();
            assert_eq!(c.contains(a.parse().unwrap()), want, "{c} contains {a}");
        }
        for bad in ["10.0.0.0/33", "x/8", "fd00::/129", ""] {
            assert!(bad.parse::<Cidr>().is_err(), "{bad}");
        }
    }
}
