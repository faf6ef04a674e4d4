//! North-south translation at tc (clsact/TCX) on the node's external devices.
//!
//! `ingress`: packets arriving at the node. A packet of a known flow
//! (`LB_CONNTRACK`) is rewritten as its entry says. Otherwise, a packet to an
//! `EXTERNAL` frontend (NodePort on a node address, LoadBalancer ingress IP,
//! externalIP) starts a flow: a backend is chosen as the socket path does
//! (Maglev over the 5-tuple or random, affinity by source address), the
//! destination is rewritten to it, and for a backend on another node the
//! source is masqueraded to the node's address and a free port. Both
//! directions are recorded, so the flow keeps its backend for its life.
//! Local deliveries go up the stack; masqueraded packets and the replies of
//! remote backends are sent with `bpf_redirect_neigh` after a FIB lookup
//! (their source is a local address, which the stack would drop as martian).
//!
//! `egress`: replies of local backends leaving towards the client get their
//! frontend back as source.
//!
//! ICMP and ICMPv6 errors about a flow's replies (fragmentation needed /
//! packet too big, from the client or a router) are translated to the
//! backend, quoted header included (`icmp4_error`, `icmp::icmp6_error`).
//! Not translated, passed untouched: ICMP errors from the backend side
//! (they reach the node's own stack, which finds no socket: never
//! mis-delivered).
//!
//! In modules: `icmp` (answers sent from here: REJECT of Services without
//! endpoints, fragmentation needed / packet too big; ICMPv6 errors),
//! `frag` (IPv6 extension headers, fragments), `route` (the FIB lookup).
use aya_ebpf::{
    bindings::{bpf_fib_lookup, BPF_ANY, BPF_F_MARK_MANGLED_0, BPF_F_PSEUDO_HDR},
    btf_maps::PerCpuArray,
    helpers::{bpf_csum_diff, bpf_get_prandom_u32, bpf_ktime_get_ns},
    macros::btf_map,
    programs::TcContext,
};
use lb_common::{
    clock, ct_flags, is_ipv4_mapped, proto, scope, select, service_flags, source_range, stat, AffinityKey,
    Backend, CtEntry, CtKey, ServiceKey, ServiceValue, SourceRangeData, TcConfig,
};

use crate::{
    lb,
    maps::{count, LB_CONNTRACK, LB_SOURCE_RANGES, LB_TC_CONFIG},
};

mod frag;
mod icmp;
mod route;

/// Not ours: let the next program (or the stack) decide.
pub const TC_ACT_UNSPEC: i32 = -1;
pub const TC_ACT_OK: i32 = 0;
pub const TC_ACT_SHOT: i32 = 2;

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const TCP_FIN: u8 = 0x01;
const TCP_SYN: u8 = 0x02;
const TCP_RST: u8 = 0x04;
const TCP_ACK: u8 = 0x10;
const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;
const FIB_SUCCESS: i64 = 0;
const FIB_NO_NEIGH: i64 = 7;

/// The parts of a packet the translation needs.
struct Pkt {
    v6: bool,
    l4: usize,
    proto: u8,
    tcp_flags: u8,
    sport: u16,
    dport: u16,
    src: [u8; 16],
    dst: [u8; 16],
}

/// Reads a header field: straight from the packet when the bytes are in its
/// linear part (the usual case, and several times cheaper than a helper
/// call per field), else through `bpf_skb_load_bytes`.
#[inline(always)]
fn at<T: Copy>(ctx: &TcContext, off: usize) -> Option<T> {
    let start = ctx.data();
    if start + off + core::mem::size_of::<T>() <= ctx.data_end() {
        // SAFETY: bounds checked against data_end just above (the verifier
        // checks it too); packet bytes have no alignment.
        return Some(unsafe { core::ptr::read_unaligned((start + off) as *const T) });
    }
    ctx.load::<T>(off).ok()
}

/// The start of the transport header. Direct reads need an offset the
/// verifier can bound exactly, so the two usual places (IPv4 without
/// options, IPv6 without extension headers) are read at constant offsets
/// and only anything else goes through the helper.
#[inline(always)]
fn l4_head<T: Copy>(ctx: &TcContext, l4: usize) -> Option<T> {
    match l4 {
        L4_V4 => at(ctx, L4_V4),
        L4_V6 => at(ctx, L4_V6),
        _ => ctx.load::<T>(l4).ok(),
    }
}

const L4_V4: usize = ETH_HLEN + 20;
const L4_V6: usize = ETH_HLEN + 40;

#[inline(always)]
fn parse(ctx: &TcContext) -> Option<Pkt> {
    let ethertype = u16::from_be(at::<u16>(ctx, 12)?);
    let mut src = [0u8; 16];
    let mut dst = [0u8; 16];
    let (v6, l4, l4proto) = match ethertype {
        ETH_P_IP => {
            let vihl: u8 = at(ctx, ETH_HLEN)?;
            let ihl = (vihl & 0x0f) as usize * 4;
            if vihl >> 4 != 4 || ihl < 20 {
                return None;
            }
            // A later fragment has no ports: `frag::later` handles it.
            let frag = u16::from_be(at::<u16>(ctx, ETH_HLEN + 6)?);
            if frag & 0x1fff != 0 {
                return None;
            }
            let p: u8 = at(ctx, ETH_HLEN + 9)?;
            let s: [u8; 4] = at(ctx, ETH_HLEN + 12)?;
            let d: [u8; 4] = at(ctx, ETH_HLEN + 16)?;
            src[10] = 0xff;
            src[11] = 0xff;
            dst[10] = 0xff;
            dst[11] = 0xff;
            src[12..].copy_from_slice(&s);
            dst[12..].copy_from_slice(&d);
            (false, ETH_HLEN + ihl, p)
        }
        ETH_P_IPV6 => {
            let p: u8 = at(ctx, ETH_HLEN + 6)?;
            src = at(ctx, ETH_HLEN + 8)?;
            dst = at(ctx, ETH_HLEN + 24)?;
            let (l4, p) = frag::ipv6_l4(ctx, p)?;
            (true, l4, p)
        }
        _ => return None,
    };
    if l4proto != proto::TCP && l4proto != proto::UDP {
        return None;
    }
    // Ports and flags in one read: the first 14 bytes of TCP, 4 of UDP.
    let ports: [u8; 5] = if l4proto == proto::TCP {
        let head: [u8; 14] = l4_head(ctx, l4)?;
        [head[0], head[1], head[2], head[3], head[13]]
    } else {
        let head: [u8; 4] = l4_head(ctx, l4)?;
        [head[0], head[1], head[2], head[3], 0]
    };
    let sport = u16::from_be_bytes([ports[0], ports[1]]);
    let dport = u16::from_be_bytes([ports[2], ports[3]]);
    let tcp_flags = ports[4];
    Some(Pkt {
        v6,
        l4,
        proto: l4proto,
        tcp_flags,
        sport,
        dport,
        src,
        dst,
    })
}

#[inline(always)]
fn is_loopback(p: &Pkt) -> bool {
    if p.v6 {
        p.dst[..15].iter().all(|b| *b == 0) && p.dst[15] == 1
    } else {
        p.dst[12] == 127
    }
}

/// The agent's settings (an array element always exists; the agent writes
/// it before it attaches the programs).
#[inline(always)]
fn config() -> Option<&'static TcConfig> {
    LB_TC_CONFIG.get(0)
}

/// Room for the large values of a new flow: the BPF stack is 512 bytes.
#[repr(C)]
pub struct Scratch {
    forward: CtEntry,
    reply: CtEntry,
    reply_key: CtKey,
    fib: bpf_fib_lookup,
}

#[btf_map]
static LB_TC_SCRATCH: PerCpuArray<Scratch, 1> = PerCpuArray::new();

#[inline(always)]
fn live(e: &CtEntry, now: u64, cfg: &TcConfig, l4proto: u8) -> bool {
    let timeout_s = if l4proto == proto::TCP {
        if e.flags & ct_flags::CLOSING != 0 {
            cfg.tcp_close_timeout_s
        } else {
            cfg.tcp_timeout_s
        }
    } else {
        cfg.udp_timeout_s
    };
    clock::within(now, e.last_seen_ns, timeout_s)
}

#[inline(always)]
fn csum_off(p: &Pkt) -> usize {
    if p.proto == proto::TCP {
        p.l4 + 16
    } else {
        p.l4 + 6
    }
}

#[inline(always)]
fn l4_flags(p: &Pkt) -> u64 {
    // An IPv4 UDP checksum of 0 means "none": leave it so.
    if p.proto == proto::UDP && !p.v6 {
        BPF_F_MARK_MANGLED_0 as u64
    } else {
        0
    }
}

/// Rewrites the source (`is_src`) or destination address, checksums included.
#[inline(always)]
fn set_addr(ctx: &TcContext, p: &Pkt, is_src: bool, old: &[u8; 16], new: &[u8; 16]) -> bool {
    if old == new {
        return true;
    }
    let flags = l4_flags(p) | BPF_F_PSEUDO_HDR as u64;
    if !p.v6 {
        let o = u32::from_ne_bytes([old[12], old[13], old[14], old[15]]);
        let n = u32::from_ne_bytes([new[12], new[13], new[14], new[15]]);
        let off = ETH_HLEN + if is_src { 12 } else { 16 };
        ctx.l4_csum_replace(csum_off(p), o as u64, n as u64, flags | 4)
            .is_ok()
            && ctx
                .l3_csum_replace(ETH_HLEN + 10, o as u64, n as u64, 4)
                .is_ok()
            && ctx.store(off, &n, 0).is_ok()
    } else {
        let mut o = *old;
        let mut n = *new;
        // SAFETY: both buffers are 16 initialised bytes on this stack.
        let diff = unsafe {
            bpf_csum_diff(
                o.as_mut_ptr() as *mut u32,
                16,
                n.as_mut_ptr() as *mut u32,
                16,
                0,
            )
        };
        let off = ETH_HLEN + if is_src { 8 } else { 24 };
        ctx.l4_csum_replace(csum_off(p), 0, diff as u32 as u64, flags)
            .is_ok()
            && ctx.store(off, new, 0).is_ok()
    }
}

#[inline(always)]
fn set_port(ctx: &TcContext, p: &Pkt, is_src: bool, old: u16, new: u16) -> bool {
    if old == new {
        return true;
    }
    let (o, n) = (old.to_be(), new.to_be());
    let off = p.l4 + if is_src { 0 } else { 2 };
    ctx.l4_csum_replace(csum_off(p), o as u64, n as u64, l4_flags(p) | 2)
        .is_ok()
        && ctx.store(off, &n, 0).is_ok()
}

/// Rewrites the packet to the entry's tuple.
#[inline(always)]
fn rewrite(ctx: &TcContext, p: &Pkt, e: &CtEntry) -> bool {
    set_addr(ctx, p, true, &p.src, &e.nat_src)
        && set_addr(ctx, p, false, &p.dst, &e.nat_dst)
        && set_port(ctx, p, true, p.sport, e.nat_sport)
        && set_port(ctx, p, false, p.dport, e.nat_dport)
}

/// Sends a rewritten packet out of the device the FIB says, resolving the
/// neighbour; the stack would drop it as martian (its source is local) or
/// would not forward it back out of the device it came in.
#[inline(always)]
fn redirect(ctx: &TcContext, p: &Pkt, e: &CtEntry) -> i32 {
    let target = route::Target {
        v6: p.v6,
        proto: p.proto,
        l4: p.l4,
        src: &e.nat_src,
        dst: &e.nat_dst,
        sport: e.nat_sport,
        dport: e.nat_dport,
    };
    match route::redirect(ctx, &target) {
        route::Fib::Sent(verdict) => verdict,
        route::Fib::TooBig(mtu) => icmp::too_big(ctx, p, e, mtu),
        route::Fib::NoRoute => {
            count(stat::TC_DROP_NO_ROUTE);
            TC_ACT_SHOT
        }
    }
}

/// Refreshes this direction; a FIN marks both closing. Returns whether the
/// packet is an RST: the flow is then over for both ends, and its entries
/// go (`forget`) once this packet is translated.
#[inline(always)]
fn touch(ptr: *mut CtEntry, e: &CtEntry, p: &Pkt, now: u64) -> bool {
    if p.tcp_flags & TCP_RST != 0 {
        return true;
    }
    // SAFETY: the pointer is valid for this program run; concurrent updates
    // of the timestamp or flags only lose a refresh.
    unsafe { (*ptr).last_seen_ns = now };
    if p.tcp_flags & TCP_FIN != 0 && e.flags & ct_flags::CLOSING == 0 {
        unsafe { (*ptr).flags = e.flags | ct_flags::CLOSING };
        if let Some(other) = LB_CONNTRACK.get_ptr_mut(&CtKey::partner(e, p.proto)) {
            unsafe { (*other).flags |= ct_flags::CLOSING };
        }
    }
    false
}

/// Deletes both entries of a reset flow. Keeping them for the close timeout
/// (as after a FIN) would only hold the SNAT port and fill the map: nothing
/// valid follows an RST, and a stray late packet finds no flow (the node
/// answers it with an RST, or it starts a flow a backend resets).
#[inline(always)]
fn forget(key: &CtKey, e: &CtEntry, l4proto: u8) {
    let _ = LB_CONNTRACK.remove(&CtKey::partner(e, l4proto));
    let _ = LB_CONNTRACK.remove(key);
}

/// `loadBalancerSourceRanges`: the longest match of (frontend, source).
#[inline(always)]
fn source_allowed(p: &Pkt) -> bool {
    let key = aya_ebpf::maps::lpm_trie::Key::new(
        source_range::FRONTEND_BITS + 128,
        SourceRangeData {
            addr: p.dst,
            port: p.dport,
            proto: p.proto,
            _pad: 0,
            src: p.src,
        },
    );
    match LB_SOURCE_RANGES.get(&key) {
        None => true,
        Some(v) => *v != source_range::DENY,
    }
}

/// A backend for a new flow: the tc path hashes the 5-tuple, and its client
/// is the packet's source address.
#[inline(always)]
fn choose(p: &Pkt, svc: &ServiceValue, now: u64) -> Option<(u32, Backend)> {
    let hash = || select::tuple_hash(&p.src, &p.dst, p.sport, p.dport, p.proto);
    if svc.flags & service_flags::AFFINITY == 0 {
        return lb::choose(svc, hash);
    }
    let key = AffinityKey {
        client: p.src,
        service_id: svc.id,
        kind: lb_common::affinity_client::SOURCE_IP,
        _pad: [0; 3],
    };
    lb::with_affinity(&key, svc, now, || lb::choose(svc, hash))
}

/// Random tries for a free SNAT port before the new flow is dropped; each
/// costs one hash lookup, and only while the range is crowded.
const SNAT_TRIES: u32 = 8;

/// A source port on the masquerade address that no live flow to this
/// backend uses; 0 when every try collides.
#[inline(always)]
fn snat_port(cfg: &TcConfig, snat: &[u8; 16], b: &Backend, l4proto: u8, now: u64) -> u16 {
    let min = cfg.snat_port_min as u32;
    let span = (cfg.snat_port_max as u32).saturating_sub(min) + 1;
    let mut key = CtKey {
        src: b.addr,
        dst: *snat,
        sport: b.port,
        dport: 0,
        proto: l4proto,
        _pad: [0; 3],
    };
    for _ in 0..SNAT_TRIES {
        // SAFETY: plain helper call.
        let port = (min + unsafe { bpf_get_prandom_u32() } % span) as u16;
        if port == 0 {
            continue;
        }
        key.dport = port;
        let free = match LB_CONNTRACK.get_ptr(&key) {
            None => true,
            // SAFETY: copied out at once.
            Some(e) => !live(unsafe { &*e }, now, cfg, l4proto),
        };
        if free {
            return port;
        }
    }
    0
}

/// A packet to an EXTERNAL frontend without a flow yet.
#[inline(always)]
fn new_flow(ctx: &TcContext, p: &Pkt, key: &CtKey, now: u64, cfg: &TcConfig) -> i32 {
    let skey = ServiceKey {
        addr: p.dst,
        port: p.dport,
        proto: p.proto,
        scope: scope::EXTERNAL,
    };
    let Some(svc) = lb::lookup_service(&skey) else {
        return TC_ACT_UNSPEC;
    };
    if svc.flags & service_flags::WILDCARD != 0 {
        return TC_ACT_UNSPEC;
    }
    if !source_allowed(p) {
        count(stat::TC_DROP_SOURCE_RANGE);
        return TC_ACT_SHOT;
    }
    let chosen = choose(p, &svc, now);
    // No backend (externalTrafficPolicy Local without local endpoints):
    // dropped, as kube-proxy does.
    let Some((backend_id, b)) = chosen else {
        // No endpoint anywhere: REJECT, as kube-proxy does.
        if svc.flags & service_flags::REJECT != 0 {
            return icmp::reject(ctx, p);
        }
        count(stat::TC_DROP_NO_BACKEND);
        return TC_ACT_SHOT;
    };
    if is_ipv4_mapped(&b.addr) == p.v6 {
        count(stat::TC_DROP_FAMILY);
        return TC_ACT_SHOT;
    }
    let Some(scratch) = LB_TC_SCRATCH.get_ptr_mut(0) else {
        return TC_ACT_SHOT;
    };
    // SAFETY: this CPU's scratch element, used by this run only.
    let scratch = unsafe { &mut *scratch };
    let local = b.flags & lb_common::backend_flags::LOCAL != 0;
    let fwd = &mut scratch.forward;
    fwd.nat_dst = b.addr;
    fwd.nat_dport = b.port;
    fwd.backend_id = backend_id;
    fwd.service_id = svc.id;
    fwd._pad = [0; 3];
    fwd.last_seen_ns = now;
    if local {
        fwd.nat_src = p.src;
        fwd.nat_sport = p.sport;
        fwd.flags = ct_flags::LOCAL;
    } else {
        fwd.nat_src = if p.v6 { cfg.snat_v6 } else { cfg.snat_v4 };
        if fwd.nat_src == [0u8; 16] {
            count(stat::TC_DROP_SNAT_NO_ADDRESS);
            return TC_ACT_SHOT;
        }
        let port = snat_port(cfg, &fwd.nat_src, &b, p.proto, now);
        if port == 0 {
            count(stat::TC_DROP_SNAT_EXHAUSTED);
            return TC_ACT_SHOT;
        }
        fwd.nat_sport = port;
        fwd.flags = ct_flags::SNAT;
    }
    let rkey = &mut scratch.reply_key;
    rkey.src = b.addr;
    rkey.dst = fwd.nat_src;
    rkey.sport = b.port;
    rkey.dport = fwd.nat_sport;
    rkey.proto = p.proto;
    rkey._pad = [0; 3];
    let reply = &mut scratch.reply;
    reply.nat_src = p.dst;
    reply.nat_dst = p.src;
    reply.nat_sport = p.dport;
    reply.nat_dport = p.sport;
    reply.backend_id = backend_id;
    reply.service_id = svc.id;
    reply.flags = fwd.flags | ct_flags::REPLY;
    reply._pad = [0; 3];
    reply.last_seen_ns = now;
    if LB_CONNTRACK
        .insert(&scratch.reply_key, &scratch.reply, BPF_ANY as u64)
        .is_err()
        || LB_CONNTRACK
            .insert(key, &scratch.forward, BPF_ANY as u64)
            .is_err()
    {
        count(stat::TC_DROP_CT_FULL);
        return TC_ACT_SHOT;
    }
    finish(ctx, p, &scratch.forward, true)
}

#[inline(always)]
fn finish(ctx: &TcContext, p: &Pkt, e: &CtEntry, at_ingress: bool) -> i32 {
    if !rewrite(ctx, p, e) {
        count(stat::TC_DROP_REWRITE);
        return TC_ACT_SHOT;
    }
    count(stat::TC_TRANSLATED);
    frag::record(ctx, p, e, at_ingress);
    if at_ingress && e.flags & (ct_flags::SNAT | ct_flags::REPLY) != 0 {
        redirect(ctx, p, e)
    } else {
        TC_ACT_OK
    }
}

#[inline(always)]
fn key_of(p: &Pkt) -> CtKey {
    CtKey {
        src: p.src,
        dst: p.dst,
        sport: p.sport,
        dport: p.dport,
        proto: p.proto,
        _pad: [0; 3],
    }
}

const IPPROTO_ICMP: u8 = 1;
const ICMP_DEST_UNREACH: u8 = 3;
const ICMP_TIME_EXCEEDED: u8 = 11;
const ICMP_PARAMETERPROB: u8 = 12;

/// An IPv4 ICMP error about a reply of a translated flow (the client, or a
/// router on the way to it, answering the frontend; "fragmentation needed"
/// is the one that matters): the quoted packet is frontend -> client, the
/// flow's forward entry says where it really came from. The error goes to
/// the backend with the quoted header as the backend sent it. Anything
/// else is passed on untouched.
#[inline(always)]
fn icmp4_error(ctx: &TcContext) -> i32 {
    let Some(v) = icmp4_error_inner(ctx) else {
        return TC_ACT_UNSPEC;
    };
    v
}

#[inline(always)]
fn icmp4_error_inner(ctx: &TcContext) -> Option<i32> {
    if u16::from_be(ctx.load::<u16>(12).ok()?) != ETH_P_IP {
        return None;
    }
    let vihl: u8 = ctx.load(ETH_HLEN).ok()?;
    let ihl = (vihl & 0x0f) as usize * 4;
    let frag = u16::from_be(ctx.load::<u16>(ETH_HLEN + 6).ok()?);
    if ihl < 20 || frag & 0x3fff != 0 || ctx.load::<u8>(ETH_HLEN + 9).ok()? != IPPROTO_ICMP {
        return None;
    }
    let icmp = ETH_HLEN + ihl;
    let kind: u8 = ctx.load(icmp).ok()?;
    if kind != ICMP_DEST_UNREACH && kind != ICMP_TIME_EXCEEDED && kind != ICMP_PARAMETERPROB {
        return None;
    }
    let inner = icmp + 8;
    let ivihl: u8 = ctx.load(inner).ok()?;
    let iihl = (ivihl & 0x0f) as usize * 4;
    let iproto: u8 = ctx.load(inner + 9).ok()?;
    if iihl < 20 || (iproto != proto::TCP && iproto != proto::UDP) {
        return None;
    }
    let isrc: [u8; 4] = ctx.load(inner + 12).ok()?;
    let idst: [u8; 4] = ctx.load(inner + 16).ok()?;
    let ports = inner + iihl;
    let isport = u16::from_be(ctx.load::<u16>(ports).ok()?);
    let idport = u16::from_be(ctx.load::<u16>(ports + 2).ok()?);
    let outer_dst: [u8; 4] = ctx.load(ETH_HLEN + 16).ok()?;
    // The quoted packet left as frontend -> client: the forward key is
    // client -> frontend. The error must be addressed to the frontend.
    if outer_dst != isrc {
        return None;
    }
    let key = CtKey {
        src: lb_common::ipv4_mapped(idst),
        dst: lb_common::ipv4_mapped(isrc),
        sport: idport,
        dport: isport,
        proto: iproto,
        _pad: [0; 3],
    };
    let e = LB_CONNTRACK.get_ptr(&key)?;
    // SAFETY: valid for this run; read in place.
    let e = unsafe { &*e };
    if e.flags & ct_flags::REPLY != 0 {
        return None;
    }
    let backend = u32::from_ne_bytes([e.nat_dst[12], e.nat_dst[13], e.nat_dst[14], e.nat_dst[15]]);
    let peer = u32::from_ne_bytes([e.nat_src[12], e.nat_src[13], e.nat_src[14], e.nat_src[15]]);
    let (old_src, old_dst) = (u32::from_ne_bytes(isrc), u32::from_ne_bytes(idst));
    let icmp_csum = icmp + 2;
    let old_icsum: u16 = ctx.load(inner + 10).ok()?;
    // The quoted header: frontend -> client becomes backend -> client (or
    // node address and SNAT port); its IP checksum, then the ICMP checksum
    // over every changed quoted byte.
    let ok = ctx
        .l3_csum_replace(inner + 10, old_src as u64, backend as u64, 4)
        .is_ok()
        && ctx
            .l3_csum_replace(inner + 10, old_dst as u64, peer as u64, 4)
            .is_ok()
        && ctx.store(inner + 12, &backend, 0).is_ok()
        && ctx.store(inner + 16, &peer, 0).is_ok()
        && ctx.store(ports, &e.nat_dport.to_be(), 0).is_ok()
        && ctx.store(ports + 2, &e.nat_sport.to_be(), 0).is_ok();
    if !ok {
        count(stat::TC_DROP_REWRITE);
        return Some(TC_ACT_SHOT);
    }
    let new_icsum: u16 = ctx.load(inner + 10).ok()?;
    let ok = ctx.l4_csum_replace(icmp_csum, old_src as u64, backend as u64, 4).is_ok()
        && ctx.l4_csum_replace(icmp_csum, old_dst as u64, peer as u64, 4).is_ok()
        && ctx.l4_csum_replace(icmp_csum, old_icsum as u64, new_icsum as u64, 2).is_ok()
        && ctx.l4_csum_replace(icmp_csum, isport.to_be() as u64, e.nat_dport.to_be() as u64, 2).is_ok()
        && ctx.l4_csum_replace(icmp_csum, idport.to_be() as u64, e.nat_sport.to_be() as u64, 2).is_ok()
        // The outer destination: the backend (ICMP has no pseudo-header).
        && ctx.l3_csum_replace(ETH_HLEN + 10, old_src as u64, backend as u64, 4).is_ok()
        && ctx.store(ETH_HLEN + 16, &backend, 0).is_ok();
    if !ok {
        count(stat::TC_DROP_REWRITE);
        return Some(TC_ACT_SHOT);
    }
    count(stat::TC_TRANSLATED);
    Some(TC_ACT_OK)
}

/// tc ingress of an external device.
#[inline(always)]
pub fn ingress(ctx: &TcContext) -> i32 {
    let Some(p) = parse(ctx) else {
        if let Some(verdict) = frag::later(ctx, true) {
            return verdict;
        }
        return match icmp4_error(ctx) {
            TC_ACT_UNSPEC => icmp::icmp6_error(ctx),
            verdict => verdict,
        };
    };
    frag::mark(ctx, &p);
    // CVE-2020-8558: nothing from the wire is served on a loopback address.
    if is_loopback(&p) {
        count(stat::TC_DROP_LOOPBACK);
        return TC_ACT_SHOT;
    }
    // SAFETY: plain helper call.
    let now = unsafe { bpf_ktime_get_ns() };
    let Some(cfg) = config() else {
        return TC_ACT_UNSPEC;
    };
    let key = key_of(&p);
    if let Some(ptr) = LB_CONNTRACK.get_ptr_mut(&key) {
        // SAFETY: the entry stays valid for this run; read in place.
        let e = unsafe { &*ptr };
        // A new SYN on a closing forward entry is a new connection that
        // reuses the client port: it gets a fresh choice.
        let reopened = p.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN
            && e.flags & (ct_flags::CLOSING | ct_flags::REPLY) == ct_flags::CLOSING;
        if live(e, now, cfg, p.proto) && !reopened {
            let reset = touch(ptr, e, &p, now);
            let verdict = finish(ctx, &p, e, true);
            if reset {
                forget(&key, e, p.proto);
            }
            return verdict;
        }
        if reopened {
            // The client reused its port, so the old flow is over: its
            // reply entry would only hold the old SNAT port for the close
            // timeout.
            let _ = LB_CONNTRACK.remove(&CtKey::partner(e, p.proto));
        }
    }
    new_flow(ctx, &p, &key, now, cfg)
}

/// tc egress of an external device: replies of local backends.
#[inline(always)]
pub fn egress(ctx: &TcContext) -> i32 {
    let Some(p) = parse(ctx) else {
        return frag::later(ctx, false).unwrap_or(TC_ACT_UNSPEC);
    };
    let key = key_of(&p);
    let Some(ptr) = LB_CONNTRACK.get_ptr_mut(&key) else {
        return TC_ACT_UNSPEC;
    };
    // SAFETY: the entry stays valid for this run; read in place.
    let e = unsafe { &*ptr };
    if e.flags & ct_flags::REPLY == 0 {
        return TC_ACT_UNSPEC;
    }
    let Some(cfg) = config() else {
        return TC_ACT_UNSPEC;
    };
    // SAFETY: plain helper call.
    let now = unsafe { bpf_ktime_get_ns() };
    if !live(e, now, cfg, p.proto) {
        return TC_ACT_UNSPEC;
    }
    let reset = touch(ptr, e, &p, now);
    let verdict = finish(ctx, &p, e, false);
    if reset {
        forget(&key, e, p.proto);
    }
    verdict
}
