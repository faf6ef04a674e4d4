//! `lb-agent inspect`: what the datapath does, read from the pinned maps
//! alone, so it works with or without a running agent.
use std::{
    collections::BTreeMap,
    fmt::Write as _,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    path::Path,
};

use anyhow::Context as _;
use lb_common::{
    affinity_client, backend_flags, is_ipv4_mapped, service_flags, BackendId, BackendSlotKey,
};
use serde::Serialize;

use crate::{
    datapath::PinnedMaps,
    model::{Protocol, Scope},
};

pub fn ip_from_bytes(b: &[u8; 16]) -> IpAddr {
    if is_ipv4_mapped(b) {
        IpAddr::V4(Ipv4Addr::new(b[12], b[13], b[14], b[15]))
    } else {
        IpAddr::V6(Ipv6Addr::from(*b))
    }
}

#[derive(Debug, Serialize)]
pub struct BackendView {
    pub id: u32,
    pub addr: IpAddr,
    pub port: u16,
    /// "active" or "terminating" (used only while no backend is active).
    pub state: &'static str,
    pub local: bool,
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
    pub flags: Vec<&'static str>,
    pub affinity_timeout: Option<u32>,
    pub backends: Vec<BackendView>,
    /// Slots that point nowhere; non-empty only if something is broken.
    pub missing_slots: Vec<u32>,
}

pub fn read_services(dir: &Path) -> anyhow::Result<Vec<FrontendView>> {
    let maps = PinnedMaps::open(dir)?;
    let mut out = BTreeMap::new();
    for entry in maps.services.iter() {
        let (key, value) = entry.context("reading LB_SERVICES")?;
        let mut flags = Vec::new();
        for (bit, name) in [
            (service_flags::WILDCARD, "vip"),
            (service_flags::AFFINITY, "affinity"),
            (service_flags::MAGLEV, "maglev"),
        ] {
            if value.flags & bit != 0 {
                flags.push(name);
            }
        }
        let mut backends = Vec::new();
        let mut missing_slots = Vec::new();
        for slot in 0..(value.active as u32 + value.terminating as u32) {
            let slot_key = BackendSlotKey {
                backend_set: value.backend_set,
                slot,
            };
            let Ok(s) = maps.slots.get(&slot_key, 0) else {
                missing_slots.push(slot);
                continue;
            };
            let Ok(b) = maps.backends.get(&BackendId { id: s.backend_id }, 0) else {
                missing_slots.push(slot);
                continue;
            };
            backends.push(BackendView {
                id: s.backend_id,
                addr: ip_from_bytes(&b.addr),
                port: b.port,
                state: if slot < value.active as u32 {
                    "active"
                } else {
                    "terminating"
                },
                local: b.flags & backend_flags::LOCAL != 0,
            });
        }
        let view = FrontendView {
            addr: ip_from_bytes(&key.addr),
            port: key.port,
            protocol: Protocol::from_number(key.proto),
            scope: Scope::from_number(key.scope),
            service_id: value.id,
            backend_set: value.backend_set,
            flags,
            affinity_timeout: (value.flags & service_flags::AFFINITY != 0)
                .then_some(value.affinity_timeout),
            backends,
            missing_slots,
        };
        out.insert((key.scope, key.addr, key.port, key.proto), view);
    }
    Ok(out.into_values().collect())
}

/// A table in the spirit of `ipvsadm -Ln`.
pub fn render_services(views: &[FrontendView]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<8} {:<40} {:<6} {:<8} BACKENDS",
        "SCOPE", "FRONTEND", "ID", "FLAGS"
    );
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
        let flags = if v.flags.is_empty() {
            "-".to_owned()
        } else {
            v.flags.join(",")
        };
        let _ = writeln!(
            s,
            "{scope:<8} {frontend:<40} {:<6} {flags:<8}",
            v.service_id
        );
        if v.backends.is_empty() && !v.flags.contains(&"vip") {
            let _ = writeln!(s, "{:>66}", "(no backends: connects are refused)");
        }
        for b in &v.backends {
            let addr = match b.addr {
                IpAddr::V4(a) => format!("{a}:{}", b.port),
                IpAddr::V6(a) => format!("[{a}]:{}", b.port),
            };
            let local = if b.local { " local" } else { "" };
            let _ = writeln!(s, "{:>66}{addr} ({}{local})", "-> ", b.state);
        }
        for slot in &v.missing_slots {
            let _ = writeln!(s, "{:>66}slot {slot} MISSING", "-> ");
        }
    }
    s
}

#[derive(Debug, Serialize)]
pub struct AffinityView {
    /// "netns:<cookie>" on the socket path, "ip:<addr>" on the tc path.
    pub client: String,
    pub service_id: u32,
    pub backend_id: u32,
    /// The backend's address, if it still exists.
    pub backend: Option<String>,
    pub age_ms: u64,
}

pub fn read_affinity(dir: &Path) -> anyhow::Result<Vec<AffinityView>> {
    let maps = PinnedMaps::open(dir)?;
    let now = crate::affinity::monotonic_now_ns();
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
        let backend = maps
            .backends
            .get(
                &BackendId {
                    id: value.backend_id,
                },
                0,
            )
            .ok()
            .map(|b| match ip_from_bytes(&b.addr) {
                IpAddr::V4(a) => format!("{a}:{}", b.port),
                IpAddr::V6(a) => format!("[{a}]:{}", b.port),
            });
        out.push(AffinityView {
            client,
            service_id: key.service_id,
            backend_id: value.backend_id,
            backend,
            age_ms: now.saturating_sub(value.last_used_ns) / 1_000_000,
        });
    }
    out.sort_by(|a, b| (a.service_id, &a.client).cmp(&(b.service_id, &b.client)));
    Ok(out)
}

pub fn render_affinity(views: &[AffinityView]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<28} {:<8} {:<28} {:>10}",
        "CLIENT", "SERVICE", "BACKEND", "AGE"
    );
    for v in views {
        let backend = v
            .backend
            .clone()
            .unwrap_or_else(|| format!("#{} (gone)", v.backend_id));
        let age = format!("{:.1}s", v.age_ms as f64 / 1000.0);
        let _ = writeln!(
            s,
            "{:<28} {:<8} {:<28} {:>10}",
            v.client, v.service_id, backend, age
        );
    }
    let _ = writeln!(s, "{} entries", views.len());
    s
}
