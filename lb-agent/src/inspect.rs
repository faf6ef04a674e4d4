//! `lb-agent inspect`: what the datapath does, read from the pinned maps
//! alone, so it works with or without a running agent. Each subject
//! (`Services`, `Affinity`, `DatagramFlows`, `Conntrack`, `Tc`, `Ports`)
//! reads its views and renders them as a table; [`show`] prints either
//! that table or the views as JSON.
use std::{
    collections::BTreeMap,
    fmt::{Display, Write as _},
    net::{IpAddr, SocketAddr},
    path::Path,
};

use anyhow::Context as _;
use aya::maps::{HashMap, MapData};
use lb_common::{
    affinity_client, backend_flags, clock, ct_flags, ct_state, map_names, proto, service_flags,
    CtEntry, CtKey, PortBits, ServiceKey,
};
use serde::Serialize;

use crate::{
    base::addr::ip_from_bytes,
    base::clock::monotonic_now_ns,
    cli::{InspectArgs, InspectWhat},
    datapath::{devices, loader::PinnedMaps, tc},
    semantics::model::{Protocol, Scope},
};

/// One thing `lb-agent inspect` shows.
pub trait Subject {
    type View: Serialize;
    fn read(dir: &Path) -> anyhow::Result<Vec<Self::View>>;
    fn render(views: &[Self::View]) -> String;
}

/// Every frontend with its backends.
pub struct Services;
/// sessionAffinity entries.
pub struct Affinity;
/// UDP sockets' flows to frontends.
pub struct DatagramFlows;
/// Flows of the tc path.
pub struct Conntrack;
/// Where the tc programs are attached, or why not.
pub struct Tc;
/// The ports marked in `LB_LOCAL_PORTS` and `LB_FRONTEND_PORTS`.
pub struct Ports;
/// The guarded Service CIDRs, as `LB_TC_CONFIG` holds them.
pub struct ServiceCidrs;

/// `S` read from the pins under `dir`, as a table or as pretty JSON.
pub fn show<S: Subject>(dir: &Path, json: bool) -> anyhow::Result<String> {
    let views = S::read(dir)?;
    Ok(if json {
        serde_json::to_string_pretty(&views)? + "\n"
    } else {
        S::render(&views)
    })
}

/// What `lb-agent inspect <what>` prints.
pub fn show_what(what: &InspectWhat) -> anyhow::Result<String> {
    match what {
        InspectWhat::Services(a) => show_args::<Services>(a),
        InspectWhat::Affinity(a) => show_args::<Affinity>(a),
        InspectWhat::DatagramFlows(a) => show_args::<DatagramFlows>(a),
        InspectWhat::Conntrack(a) => show_args::<Conntrack>(a),
        InspectWhat::Tc(a) => show_args::<Tc>(a),
        InspectWhat::Ports(a) => show_args::<Ports>(a),
        InspectWhat::ServiceCidrs(a) => show_args::<ServiceCidrs>(a),
    }
}

fn show_args<S: Subject>(args: &InspectArgs) -> anyhow::Result<String> {
    show::<S>(&args.bpffs, args.json)
}

#[derive(Debug, Serialize)]
pub struct BackendView {
    pub id: u32,
    pub addr: IpAddr,
    pub port: u16,
    /// "active" or "terminating" (used only while no backend is active).
    pub state: &'static str,
    pub local: bool,
    /// Its open connections from this node (`LB_BACKEND_STATE`), shown
    /// for the frontends whose scheduler counts them (lc, sed, nq).
    pub open: Option<u32>,
    /// Outlier detection's quarantine of the backend on this node, while
    /// it lasts (`LB_BACKEND_HEALTH`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub quarantine: Option<QuarantineView>,
    /// Failed connects in a row from this node, not yet a quarantine.
    #[serde(skip_serializing_if = "is_zero")]
    pub failures: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

#[derive(Debug, Serialize)]
pub struct QuarantineView {
    /// Milliseconds until new flows may choose the backend again.
    pub left_ms: u64,
    /// `lb_common::outlier::NAMES`: "refused" or "timeout".
    pub reason: &'static str,
    /// Quarantines in a row (this one included).
    pub ejections: u32,
    /// Whether new flows avoid it: false under `--outlier-detection
    /// dry-run` (or a Service's annotation saying so), which only reports.
    pub avoided: bool,
}

impl QuarantineView {
    /// The quarantine `health` records at `now` (monotonic ns), if any.
    pub fn of(health: &lb_common::BackendHealth, now: u64, avoided: bool) -> Option<Self> {
        health.quarantined(now).then(|| Self {
            left_ms: (health.until_ns - now) / 1_000_000,
            reason: lb_common::outlier::NAMES
                .get(health.reason as usize)
                .copied()
                .unwrap_or("unknown"),
            ejections: health.ejections,
            avoided,
        })
    }
}

#[derive(Debug, Serialize)]
pub struct FrontendView {
    pub addr: IpAddr,
    /// 0 for a VIP marker: other ports of the VIP are refused.
    pub port: u16,
    pub protocol: Option<Protocol>,
    pub scope: Option<Scope>,
    pub service_id: u32,
    pub backend_set: u32,
    /// Its flags, and its scheduler unless random (`lb_common::algorithm::NAMES`).
    pub flags: Vec<&'static str>,
    /// Its scheduler (`lb_common::algorithm::NAMES`).
    pub algorithm: &'static str,
    /// Outlier detection for its connects: "on", "dry-run" or "off"
    /// (`service_flags::OUTLIER_DETECT` and `OUTLIER_AVOID`).
    pub outlier_detection: &'static str,
    pub affinity_timeout: Option<u32>,
    /// The sessionAffinity decision this frontend shares with the other
    /// frontends of its Service port and endpoint selection.
    pub affinity_id: Option<u32>,
    pub backends: Vec<BackendView>,
    /// Slots that point nowhere; non-empty only if something is broken.
    pub missing_slots: Vec<u32>,
    /// A Maglev frontend's table (`LB_MAGLEV`).
    pub maglev: Option<MaglevView>,
    /// The agent's last sync could not program this frontend as desired
    /// (`LB_UNPROGRAMMED`). With `service_id` 0 and no backends nothing of
    /// it is in the datapath; otherwise what is shown is its previous
    /// state, kept. Reason `not_served`: a frontend no datapath serves
    /// (SCTP), never programmed.
    pub unprogrammed: Option<UnprogrammedView>,
}

#[derive(Debug, Serialize)]
pub struct MaglevView {
    /// Positions in the table (0: the table is missing, or not of the
    /// frontend's `maglev_size`).
    pub size: u32,
    /// How many positions each backend holds, by backend id.
    pub positions: BTreeMap<u32, u32>,
    /// Positions whose backend id names no backend; non-empty only if
    /// something is broken.
    pub unknown_positions: u32,
}

#[derive(Debug, Serialize)]
pub struct UnprogrammedView {
    /// `namespace/name`.
    pub service: String,
    pub port_name: String,
    /// As `/metrics` labels it: `slots_full`, `maglev_table_error`, ...
    pub reason: String,
    /// The map whose write failed and the error.
    pub error: String,
}

impl UnprogrammedView {
    fn of(u: &lb_common::Unprogrammed) -> Self {
        let text = |b: &[u8]| {
            let end = b.iter().position(|c| *c == 0).unwrap_or(b.len());
            String::from_utf8_lossy(&b[..end]).into_owned()
        };
        Self {
            service: text(&u.service),
            port_name: text(&u.port_name),
            reason: crate::datapath::reconcile::reason_label(u.map, u.errno),
            error: crate::datapath::reconcile::failure_text(u.map, u.errno),
        }
    }
}

impl Subject for Services {
    type View = FrontendView;

    fn read(dir: &Path) -> anyhow::Result<Vec<FrontendView>> {
        let maps = PinnedMaps::open(dir)?;
        let mut unprogrammed: BTreeMap<ServiceKey, lb_common::Unprogrammed> = BTreeMap::new();
        for entry in maps.unprogrammed.iter() {
            let (key, value) = entry.context("reading LB_UNPROGRAMMED")?;
            unprogrammed.insert(key, value);
        }
        let known: std::collections::BTreeSet<u32> = maps
            .backend_entries()
            .context("reading LB_BACKENDS")?
            .into_iter()
            .filter(|(id, b)| crate::datapath::loader::backend_in_use(*id, b))
            .map(|(id, _)| id.id)
            .collect();
        let mut out = BTreeMap::new();
        for entry in maps.services.iter() {
            let (key, value) = entry.context("reading LB_SERVICES")?;
            let mut flags = flag_names(
                value.flags,
                &[
                    (service_flags::WILDCARD, "vip"),
                    (service_flags::AFFINITY, "affinity"),
                    (service_flags::REJECT, "reject"),
                    (service_flags::NODE_ADDRESS, "node_address"),
                ],
            );
            let algorithm = lb_common::algorithm::NAMES
                .get(value.algorithm() as usize)
                .copied()
                .unwrap_or("unknown");
            if algorithm != "random" && value.flags & service_flags::WILDCARD == 0 {
                flags.push(algorithm);
            }
            let counts = lb_common::algorithm::counts(value.algorithm());
            let detects = value.flags & service_flags::OUTLIER_DETECT != 0;
            let avoids = value.flags & service_flags::OUTLIER_AVOID != 0;
            let now = crate::base::clock::monotonic_now_ns();
            let mut backends = Vec::new();
            let mut missing_slots = Vec::new();
            for slot in 0..(value.active as u32 + value.terminating as u32) {
                let Some(backend_id) = maps
                    .slots
                    .get(value.slot_base.wrapping_add(slot))
                    .ok()
                    .and_then(|s| s.backend_of(value.backend_set, slot))
                else {
                    missing_slots.push(slot);
                    continue;
                };
                let Some(b) = maps.backend(backend_id) else {
                    missing_slots.push(slot);
                    continue;
                };
                let health = maps.backend_health(backend_id);
                backends.push(BackendView {
                    id: backend_id,
                    addr: ip_from_bytes(&b.addr),
                    port: b.port,
                    state: if slot < value.active as u32 {
                        "active"
                    } else {
                        "terminating"
                    },
                    local: b.flags & backend_flags::LOCAL != 0,
                    open: counts.then(|| maps.open_connections(backend_id)).flatten(),
                    quarantine: health
                        .as_ref()
                        .filter(|_| detects)
                        .and_then(|h| QuarantineView::of(h, now, avoids)),
                    failures: health.filter(|_| detects).map_or(0, |h| h.failures),
                });
            }
            let maglev = (value.flags & service_flags::MAGLEV != 0 && value.maglev_size > 0)
                .then(|| maglev_view(&maps, value.backend_set, value.maglev_size, &known));
            let view = FrontendView {
                addr: ip_from_bytes(&key.addr),
                port: key.port,
                protocol: Protocol::from_number(key.proto),
                scope: Scope::from_number(key.scope),
                service_id: value.id,
                backend_set: value.backend_set,
                flags,
                algorithm,
                outlier_detection: match (detects, avoids) {
                    (true, true) => "on",
                    (true, false) => "dry-run",
                    _ => "off",
                },
                affinity_timeout: (value.flags & service_flags::AFFINITY != 0)
                    .then_some(value.affinity_timeout),
                affinity_id: (value.flags & service_flags::AFFINITY != 0)
                    .then_some(value.affinity_id),
                backends,
                missing_slots,
                maglev,
                unprogrammed: unprogrammed.remove(&key).as_ref().map(UnprogrammedView::of),
            };
            out.insert((key.scope, key.addr, key.port, key.proto), view);
        }
        // Not in the datapath at all: new frontends that did not fit.
        for (key, u) in unprogrammed {
            let view = FrontendView {
                addr: ip_from_bytes(&key.addr),
                port: key.port,
                protocol: Protocol::from_number(key.proto),
                scope: Scope::from_number(key.scope),
                service_id: 0,
                backend_set: 0,
                flags: if key.port == 0 && key.proto == 0 {
                    vec!["vip"]
                } else {
                    Vec::new()
                },
                algorithm: "random",
                outlier_detection: "off",
                affinity_timeout: None,
                affinity_id: None,
                backends: Vec::new(),
                missing_slots: Vec::new(),
                maglev: None,
                unprogrammed: Some(UnprogrammedView::of(&u)),
            };
            out.insert((key.scope, key.addr, key.port, key.proto), view);
        }
        Ok(out.into_values().collect())
    }

    /// A table in the spirit of `ipvsadm -Ln`.
    fn render(views: &[FrontendView]) -> String {
        const COLUMNS: Columns = Columns(&[(8, Left), (40, Left), (6, Left), (8, Left), (0, Left)]);
        let mut s = COLUMNS.header(&["SCOPE", "FRONTEND", "ID", "FLAGS", "BACKENDS"]);
        for v in views {
            let frontend = match (v.addr, v.protocol) {
                (IpAddr::V4(a), Some(p)) => format!("{a}:{}/{p}", v.port),
                (IpAddr::V6(a), Some(p)) => format!("[{a}]:{}/{p}", v.port),
                (a, None) => format!("{a} (other ports refused)"),
            };
            let scope = match v.scope {
                Some(Scope::Internal) => "internal",
                Some(Scope::External) => "external",
                None => "?",
            };
            let flags = flags_column(&v.flags);
            COLUMNS.row(&mut s, &[&scope, &frontend, &v.service_id, &flags]);
            if let Some(u) = &v.unprogrammed {
                let port = if u.port_name.is_empty() {
                    String::new()
                } else {
                    format!(" port {}", u.port_name)
                };
                let held = if v.service_id == 0 {
                    "nothing of it is in the datapath"
                } else {
                    "its previous state, below, still serves"
                };
                let _ = if u.reason == "not_served" {
                    writeln!(
                        s,
                        "{:>66}NOT SERVED for Service {}{port}: {}",
                        "! ", u.service, u.error
                    )
                } else {
                    writeln!(
                        s,
                        "{:>66}NOT PROGRAMMED for Service {}{port}: {} [{}]; {held}",
                        "! ", u.service, u.error, u.reason
                    )
                };
                if v.service_id == 0 {
                    continue;
                }
            }
            if v.backends.is_empty() && !v.flags.contains(&"vip") {
                let _ = writeln!(s, "{:>66}", "(no backends: connects are refused)");
            }
            if let Some(m) = &v.maglev {
                if m.size == 0 {
                    let _ = writeln!(s, "{:>66}maglev table MISSING (chosen at random)", "");
                } else {
                    let shares: Vec<String> = m
                        .positions
                        .iter()
                        .map(|(id, n)| format!("#{id} {n}"))
                        .collect();
                    let _ = writeln!(
                        s,
                        "{:>66}maglev table: {} positions ({})",
                        "",
                        m.size,
                        shares.join(", ")
                    );
                }
            }
            for b in &v.backends {
                let addr = SocketAddr::new(b.addr, b.port);
                let local = if b.local { " local" } else { "" };
                let open = b.open.map(|n| format!(", {n} open")).unwrap_or_default();
                let failures = match b.failures {
                    0 => String::new(),
                    n => format!(", {n} failed connects"),
                };
                let quarantine = match &b.quarantine {
                    Some(q) => format!(
                        ", QUARANTINED{} {:.1}s more ({}, {} in a row)",
                        if q.avoided {
                            ""
                        } else {
                            " (dry-run: still chosen)"
                        },
                        q.left_ms as f64 / 1000.0,
                        q.reason,
                        q.ejections
                    ),
                    None => String::new(),
                };
                let _ = writeln!(
                    s,
                    "{:>66}{addr} ({}{local}{open}{failures}{quarantine})",
                    "-> ", b.state
                );
            }
            for slot in &v.missing_slots {
                let _ = writeln!(s, "{:>66}slot {slot} MISSING", "-> ");
            }
        }
        s
    }
}

/// The table of a Maglev frontend whose set is `set`, summed by backend;
/// `known`: the ids in `LB_BACKENDS`.
fn maglev_view(
    maps: &PinnedMaps,
    set: u32,
    size: u16,
    known: &std::collections::BTreeSet<u32>,
) -> MaglevView {
    let table = maps.maglev_table(set, size).unwrap_or_default();
    let mut positions = BTreeMap::new();
    let mut unknown_positions = 0;
    for id in &table {
        if known.contains(id) {
            *positions.entry(*id).or_default() += 1;
        } else {
            unknown_positions += 1;
        }
    }
    MaglevView {
        size: table.len() as u32,
        positions,
        unknown_positions,
    }
}

#[derive(Debug, Serialize)]
pub struct AffinityView {
    /// "netns:<cookie>" on the socket path, "ip:<addr>" on the tc path.
    pub client: String,
    /// The `affinity_id` of the decision (see `inspect services`).
    pub affinity_id: u32,
    /// The frontends that share it, as `scope addr:port/proto`.
    pub frontends: Vec<String>,
    pub backend_id: u32,
    /// The backend's address, if it still exists.
    pub backend: Option<String>,
    pub age_ms: u64,
}

impl Subject for Affinity {
    type View = AffinityView;

    fn read(dir: &Path) -> anyhow::Result<Vec<AffinityView>> {
        let maps = PinnedMaps::open(dir)?;
        let now = monotonic_now_ns();
        let mut frontends: BTreeMap<u32, Vec<String>> = BTreeMap::new();
        for entry in maps.services.iter() {
            let (key, value) = entry.context("reading LB_SERVICES")?;
            if value.flags & service_flags::AFFINITY == 0 {
                continue;
            }
            let scope = match Scope::from_number(key.scope) {
                Some(Scope::Internal) => "internal",
                Some(Scope::External) => "external",
                None => "?",
            };
            let proto = Protocol::from_number(key.proto)
                .map_or_else(|| key.proto.to_string(), |p| p.to_string());
            frontends
                .entry(value.affinity_id)
                .or_default()
                .push(format!("{scope} {}/{proto}", sockaddr(&key.addr, key.port)));
        }
        for list in frontends.values_mut() {
            list.sort();
        }
        let mut out = Vec::new();
        for entry in maps.affinity.iter() {
            let (key, value) = entry.context("reading LB_AFFINITY")?;
            let client = if key.kind == affinity_client::NETNS_COOKIE {
                let mut cookie = [0u8; 8];
                cookie.copy_from_slice(&key.client[..8]);
                format!("netns:{}", u64::from_le_bytes(cookie))
            } else {
                format!("ip:{}", ip_from_bytes(&key.client))
            };
            let backend = backend_addr(&maps, value.backend_id);
            out.push(AffinityView {
                client,
                affinity_id: key.affinity_id,
                frontends: frontends.get(&key.affinity_id).cloned().unwrap_or_default(),
                backend_id: value.backend_id,
                backend,
                age_ms: clock::age_ns(now, value.last_used_ns) / 1_000_000,
            });
        }
        out.sort_by(|a, b| (a.affinity_id, &a.client).cmp(&(b.affinity_id, &b.client)));
        Ok(out)
    }

    fn render(views: &[AffinityView]) -> String {
        const COLUMNS: Columns =
            Columns(&[(28, Left), (10, Left), (28, Left), (10, Right), (0, Left)]);
        let mut s = COLUMNS.header(&["CLIENT", "AFFINITY", "BACKEND", "AGE", "  FRONTENDS"]);
        for v in views {
            let backend = v
                .backend
                .clone()
                .unwrap_or_else(|| format!("#{} (gone)", v.backend_id));
            let age = format!("{:.1}s", v.age_ms as f64 / 1000.0);
            let frontends = format!("  {}", v.frontends.join(", "));
            COLUMNS.row(
                &mut s,
                &[&v.client, &v.affinity_id, &backend, &age, &frontends],
            );
        }
        let _ = writeln!(s, "{} entries", views.len());
        s
    }
}

/// One flow of `LB_DGRAM_FLOWS` for `inspect datagram-flows`.
#[derive(Debug, Serialize)]
pub struct DatagramFlowView {
    /// The sending socket's cookie (`ss -e` shows it as `sk:<hex>`).
    pub socket_cookie: u64,
    /// The frontend it sends to, `addr:port`.
    pub frontend: String,
    pub protocol: Option<Protocol>,
    pub service_id: u32,
    pub backend_id: u32,
    /// The backend's address, if it still exists.
    pub backend: Option<String>,
    pub idle_ms: u64,
}

impl Subject for DatagramFlows {
    type View = DatagramFlowView;

    fn read(dir: &Path) -> anyhow::Result<Vec<DatagramFlowView>> {
        let maps = PinnedMaps::open(dir)?;
        let now = monotonic_now_ns();
        let mut out = Vec::new();
        for entry in maps.datagram_flows.iter() {
            let (key, flow) = entry.context("reading LB_DGRAM_FLOWS")?;
            out.push(DatagramFlowView {
                socket_cookie: key.cookie,
                frontend: sockaddr(&key.addr, key.port),
                protocol: Protocol::from_number(key.proto),
                service_id: flow.service_id,
                backend_id: flow.backend_id,
                backend: backend_addr(&maps, flow.backend_id),
                idle_ms: clock::age_ns(now, flow.last_used_ns) / 1_000_000,
            });
        }
        out.sort_by(|a, b| (&a.frontend, a.socket_cookie).cmp(&(&b.frontend, b.socket_cookie)));
        Ok(out)
    }

    fn render(views: &[DatagramFlowView]) -> String {
        const COLUMNS: Columns =
            Columns(&[(20, Left), (46, Left), (6, Right), (46, Left), (9, Right)]);
        let mut s = COLUMNS.header(&["SOCKET", "FRONTEND", "SVC", "BACKEND", "IDLE ms"]);
        for v in views {
            let backend = v
                .backend
                .clone()
                .unwrap_or_else(|| format!("#{} (gone)", v.backend_id));
            COLUMNS.row(
                &mut s,
                &[
                    &v.socket_cookie,
                    &v.frontend,
                    &v.service_id,
                    &backend,
                    &v.idle_ms,
                ],
            );
        }
        let _ = writeln!(s, "{} flows", views.len());
        s
    }
}

/// `addr:port` of backend `id`, if it exists.
fn backend_addr(maps: &PinnedMaps, id: u32) -> Option<String> {
    maps.backend(id).map(|b| sockaddr(&b.addr, b.port))
}

/// One conntrack entry for `inspect conntrack`.
#[derive(Debug, serde::Serialize)]
pub struct CtView {
    pub direction: &'static str,
    pub proto: &'static str,
    pub src: String,
    pub dst: String,
    pub nat_src: String,
    pub nat_dst: String,
    pub service_id: u32,
    pub backend_id: u32,
    pub flags: Vec<&'static str>,
    /// TCP: "syn" (the backend has not answered), "syn-recv" (answered, not
    /// yet acknowledged by the client), "established", "fin"
    /// (this direction sent a FIN, the other has not), "closing" (both did,
    /// or an RST that belongs to the flow). UDP: "-".
    pub state: &'static str,
    pub idle_ms: u64,
    /// The next hop tc_ingress last found for this direction's packets
    /// (JSON only): whether it still holds depends on the route epoch and
    /// the second, which the kernel checks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_hop: Option<NextHopView>,
}

/// A flow direction's cached next hop (`CtEntry::hop`).
#[derive(Debug, serde::Serialize)]
pub struct NextHopView {
    pub ifindex: u32,
    pub dmac: String,
    pub smac: String,
    /// Packets up to this IP length take it without a lookup.
    pub max_len: u16,
}

fn mac(m: &[u8; 6]) -> String {
    m.map(|b| format!("{b:02x}")).join(":")
}

/// What `inspect conntrack` says of an entry's TCP state.
fn ct_state_name(proto_number: u8, e: &CtEntry) -> &'static str {
    if proto_number != proto::TCP {
        "-"
    } else if e.state[ct_state::CLOSING] != 0 {
        "closing"
    } else if e.state[ct_state::FIN] != 0 {
        "fin"
    } else if e.state[ct_state::SEEN_REPLY] != 0 {
        "established"
    } else if e.answered != 0 || e.ack_seq != 0 {
        // Either entry of a flow in LB_CT_SYN: the backend's SYN-ACK
        // wrote both (the ACK it sent; the ACK that completes the
        // handshake, which may be 0, and `answered`).
        "syn-recv"
    } else {
        "syn"
    }
}

fn sockaddr(a: &[u8; 16], port: u16) -> String {
    SocketAddr::new(ip_from_bytes(a), port).to_string()
}

impl Subject for Conntrack {
    type View = CtView;

    fn read(dir: &Path) -> anyhow::Result<Vec<CtView>> {
        let mut entries = Vec::new();
        for name in [map_names::CONNTRACK, map_names::CONNTRACK_SYN] {
            let map: HashMap<MapData, CtKey, CtEntry> = HashMap::try_from(tc::open(dir, name)?)?;
            entries.extend(map.iter().filter_map(Result::ok));
        }
        let now = monotonic_now_ns();
        let mut views: Vec<CtView> = entries
            .into_iter()
            .map(|(k, e)| {
                let flags = flag_names(
                    e.flags,
                    &[
                        (ct_flags::SNAT, "snat"),
                        (ct_flags::LOCAL, "local"),
                        // Counts for its backend (lc, sed, nq).
                        (ct_flags::COUNTED, "counted"),
                        (ct_flags::WATCHED, "watched"),
                    ],
                );
                CtView {
                    direction: if e.flags & ct_flags::REPLY != 0 {
                        "reply"
                    } else {
                        "forward"
                    },
                    proto: if k.proto == proto::TCP { "TCP" } else { "UDP" },
                    src: sockaddr(&k.src, k.sport),
                    dst: sockaddr(&k.dst, k.dport),
                    nat_src: sockaddr(&e.nat_src, e.nat_sport),
                    nat_dst: sockaddr(&e.nat_dst, e.nat_dport),
                    service_id: e.service_id,
                    backend_id: e.backend_id,
                    flags,
                    state: ct_state_name(k.proto, &e),
                    idle_ms: clock::age_ns(now, e.last_seen_ns) / 1_000_000,
                    next_hop: (e.hop.len > 0).then(|| NextHopView {
                        ifindex: e.hop.ifindex,
                        dmac: mac(&e.hop.dmac),
                        smac: mac(&e.hop.smac),
                        max_len: e.hop.len,
                    }),
                }
            })
            .collect();
        views.sort_by(|a, b| (a.direction, &a.src, &a.dst).cmp(&(b.direction, &b.src, &b.dst)));
        Ok(views)
    }

    fn render(views: &[CtView]) -> String {
        const COLUMNS: Columns = Columns(&[
            (8, Left),
            (5, Left),
            (46, Left),
            (46, Left),
            (46, Left),
            (46, Left),
            (4, Right),
            (11, Left),
            (14, Left),
            (9, Right),
        ]);
        let mut out = COLUMNS.header(&[
            "DIR", "PROTO", "SRC", "DST", "NAT SRC", "NAT DST", "SVC", "STATE", "FLAGS", "IDLE ms",
        ]);
        for v in views {
            let flags = flags_column(&v.flags);
            COLUMNS.row(
                &mut out,
                &[
                    &v.direction,
                    &v.proto,
                    &v.src,
                    &v.dst,
                    &v.nat_src,
                    &v.nat_dst,
                    &v.service_id,
                    &v.state,
                    &flags,
                    &v.idle_ms,
                ],
            );
        }
        out
    }
}

/// A hook of a device: our program attached there (TCX links as the
/// kernel lists them on every device, clsact filters the agent recorded
/// that the kernel still has), or a hook of a device the agent is asked
/// for that lacks it, and why.
#[derive(Debug, Serialize)]
pub struct TcView {
    pub device: String,
    /// `None`: no such device in this network namespace.
    pub ifindex: Option<u32>,
    /// The hook, named by its program: "tc_ingress", "tc_egress".
    pub hook: &'static str,
    pub direction: &'static str,
    /// "tcx" or "netlink" (a clsact filter).
    pub mode: String,
    pub program_id: Option<u32>,
    pub attached: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl Subject for Tc {
    type View = TcView;

    /// In this network namespace: what the kernel has, then what the
    /// devices the agent is asked for lack, with the reason it recorded.
    fn read(dir: &Path) -> anyhow::Result<Vec<TcView>> {
        let mut views: Vec<TcView> = devices::attachments(dir)
            .into_iter()
            .map(|a| TcView {
                device: a.device,
                ifindex: a.ifindex,
                hook: a.hook.name(),
                direction: a.hook.direction(),
                mode: a.mode.to_owned(),
                program_id: a.program_id,
                attached: true,
                reason: None,
            })
            .collect();
        for wanted in devices::recorded_status(dir) {
            let ifindex = devices::ifindex(&wanted.device);
            let xdp = wanted.xdp.then_some(devices::Hook::Xdp);
            for hook in devices::Hook::TC.into_iter().chain(xdp) {
                let mode = match hook {
                    devices::Hook::Xdp => "native",
                    _ => wanted.mode.as_str(),
                };
                let there = views.iter().any(|v| {
                    v.attached
                        && v.device == wanted.device
                        && v.hook == hook.name()
                        && v.mode == mode
                });
                if there {
                    continue;
                }
                let reason = match (ifindex, wanted.lacking.get(hook.name())) {
                    (None, _) => "device absent".to_owned(),
                    (Some(_), Some(why)) => why.clone(),
                    (Some(_), None) => {
                        "missing (the agent re-attaches it at its next sweep)".to_owned()
                    }
                };
                views.push(TcView {
                    device: wanted.device.clone(),
                    ifindex,
                    hook: hook.name(),
                    direction: hook.direction(),
                    mode: mode.to_owned(),
                    program_id: None,
                    attached: false,
                    reason: Some(reason),
                });
            }
        }
        views.sort_by(|a, b| (&a.device, a.hook, &a.mode).cmp(&(&b.device, b.hook, &b.mode)));
        Ok(views)
    }

    fn render(views: &[TcView]) -> String {
        const COLUMNS: Columns = Columns(&[
            (16, Left),
            (8, Right),
            (11, Left),
            (8, Left),
            (8, Right),
            (0, Left),
        ]);
        let mut out = COLUMNS.header(&["DEVICE", "IFINDEX", "HOOK", "MODE", "ID", "STATE"]);
        for v in views {
            let ifindex = v.ifindex.map_or("-".to_string(), |i| i.to_string());
            let id = v.program_id.map_or("-".to_string(), |i| i.to_string());
            let state = match &v.reason {
                None => "attached".to_owned(),
                Some(why) => format!("NOT ATTACHED: {why}"),
            };
            COLUMNS.row(
                &mut out,
                &[&v.device, &ifindex, &v.hook, &v.mode, &id, &state],
            );
        }
        out
    }
}

/// One marked port.
#[derive(Debug, Serialize, PartialEq, Eq)]
pub struct PortView {
    /// "local backend" (`LB_LOCAL_PORTS`) or "frontend" (`LB_FRONTEND_PORTS`).
    pub set: &'static str,
    pub proto: String,
    pub port: u16,
}

/// The ports `elements` (a map of `PortBits`, by index) mark, as `set`.
fn port_views(set: &'static str, elements: &[(u32, PortBits)]) -> Vec<PortView> {
    elements
        .iter()
        .flat_map(|(i, e)| e.marked(*i))
        .map(|(p, port)| PortView {
            set,
            proto: Protocol::from_number(p).map_or(p.to_string(), |p| p.to_string()),
            port,
        })
        .collect()
}

impl Subject for Ports {
    type View = PortView;

    fn read(dir: &Path) -> anyhow::Result<Vec<PortView>> {
        let mut views = Vec::new();
        for (name, set) in [
            (map_names::LOCAL_PORTS, "local backend"),
            (map_names::FRONTEND_PORTS, "frontend"),
        ] {
            let map: aya::maps::Array<MapData, PortBits> =
                aya::maps::Array::try_from(tc::open(dir, name)?)
                    .with_context(|| format!("{name}: not a map of PortBits"))?;
            let mut elements = Vec::new();
            for i in 0..map.len() {
                let e = map
                    .get(&i, 0)
                    .with_context(|| format!("reading {name}[{i}]"))?;
                if e.ports != 0 {
                    elements.push((i, e));
                }
            }
            views.extend(port_views(set, &elements));
        }
        Ok(views)
    }

    fn render(views: &[PortView]) -> String {
        const COLUMNS: Columns = Columns(&[(14, Left), (6, Left), (0, Left)]);
        let mut out = COLUMNS.header(&["SET", "PROTO", "PORTS"]);
        let mut rows: BTreeMap<(&str, &str), Vec<String>> = BTreeMap::new();
        for v in views {
            rows.entry((v.set, &v.proto))
                .or_default()
                .push(v.port.to_string());
        }
        for ((set, proto), ports) in rows {
            COLUMNS.row(&mut out, &[&set, &proto, &ports.join(", ")]);
        }
        out
    }
}

#[derive(Debug, Serialize)]
pub struct ServiceCidrView {
    pub cidr: String,
}

impl Subject for ServiceCidrs {
    type View = ServiceCidrView;

    fn read(dir: &Path) -> anyhow::Result<Vec<ServiceCidrView>> {
        let name = map_names::TC_CONFIG;
        let map: aya::maps::Array<MapData, lb_common::TcConfig> =
            aya::maps::Array::try_from(tc::open(dir, name)?)
                .with_context(|| format!("{name}: not a map of TcConfig"))?;
        let cfg = map
            .get(&0, 0)
            .with_context(|| format!("reading {name}[0]"))?;
        Ok(tc::service_ranges_of(&cfg.service_ranges)
            .into_iter()
            .map(|c| ServiceCidrView {
                cidr: c.to_string(),
            })
            .collect())
    }

    fn render(views: &[ServiceCidrView]) -> String {
        if views.is_empty() {
            return "no guarded Service CIDRs\n".into();
        }
        let mut out = String::from("GUARDED SERVICE CIDRS\n");
        for v in views {
            out.push_str(&v.cidr);
            out.push('\n');
        }
        out
    }
}

/// The columns of a text table: each a width and an alignment.
struct Columns(&'static [(usize, Align)]);

enum Align {
    Left,
    Right,
}
use Align::{Left, Right};

impl Columns {
    /// A table's first line: the column names.
    fn header(&self, names: &[&str]) -> String {
        let cells: Vec<&dyn Display> = names.iter().map(|n| n as &dyn Display).collect();
        let mut out = String::new();
        self.row(&mut out, &cells);
        out
    }

    /// Appends one line: each cell padded to its column's width, one space
    /// between cells. A line may have fewer cells than there are columns.
    fn row(&self, out: &mut String, cells: &[&dyn Display]) {
        for (i, (cell, (width, align))) in cells.iter().zip(self.0).enumerate() {
            if i > 0 {
                out.push(' ');
            }
            let _ = match align {
                Left => write!(out, "{cell:<width$}"),
                Right => write!(out, "{cell:>width$}"),
            };
        }
        out.push('\n');
    }
}

/// The names of the bits of `flags` that are set, in `table`'s order.
fn flag_names<T>(flags: T, table: &[(T, &'static str)]) -> Vec<&'static str>
where
    T: Copy + Default + PartialEq + std::ops::BitAnd<Output = T>,
{
    table
        .iter()
        .filter(|&&(bit, _)| flags & bit != T::default())
        .map(|&(_, name)| name)
        .collect()
}

fn flags_column(flags: &[&str]) -> String {
    if flags.is_empty() {
        "-".to_owned()
    } else {
        flags.join(",")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each marked bit is one row, named by its set, protocol and port,
    /// and the table groups a set's ports by protocol.
    #[test]
    fn ports_are_listed_by_set_and_protocol() {
        let at = |p: u8, port: u16| PortBits::index(p, port).unwrap();
        let local = [(
            at(proto::TCP, 8080),
            PortBits::default().with(8080).with(8081),
        )];
        let frontend = [
            (at(proto::TCP, 30080), PortBits::default().with(30080)),
            (at(proto::UDP, 53), PortBits::default().with(53)),
        ];
        let mut views = port_views("local backend", &local);
        views.extend(port_views("frontend", &frontend));
        let rows: Vec<(&str, &str, u16)> = views
            .iter()
            .map(|v| (v.set, v.proto.as_str(), v.port))
            .collect();
        assert_eq!(
            rows,
            [
                ("local backend", "TCP", 8080),
                ("local backend", "TCP", 8081),
                ("frontend", "TCP", 30080),
                ("frontend", "UDP", 53),
            ]
        );
        let table = Ports::render(&views);
        assert!(
            table.contains("local backend  TCP    8080, 8081"),
            "{table}"
        );
        assert!(table.contains("frontend       UDP    53"), "{table}");
    }

    /// A TCP flow's states as `inspect conntrack` names them, through its
    /// handshake to its close.
    #[test]
    fn conntrack_states_follow_the_handshake() {
        // SAFETY: plain integers and arrays of them (`Pod`): all zeros is
        // an entry of a SYN just recorded.
        let mut e: CtEntry = unsafe { std::mem::zeroed() };
        type Step = (&'static str, fn(&mut CtEntry));
        let steps: [Step; 5] = [
            ("syn", |_| {}),
            ("syn-recv", |e| e.ack_seq = 7001),
            ("established", |e| e.state[ct_state::SEEN_REPLY] = 1),
            ("fin", |e| e.state[ct_state::FIN] = 1),
            ("closing", |e| e.state[ct_state::CLOSING] = 1),
        ];
        for (name, step) in steps {
            step(&mut e);
            assert_eq!(ct_state_name(proto::TCP, &e), name);
        }
        assert_eq!(ct_state_name(proto::UDP, &e), "-");
        // A backend whose initial sequence number is 2^32 - 1: the ACK
        // that completes the handshake is 0.
        let mut e: CtEntry = unsafe { std::mem::zeroed() };
        e.answered = 1;
        assert_eq!(ct_state_name(proto::TCP, &e), "syn-recv");
    }
}
