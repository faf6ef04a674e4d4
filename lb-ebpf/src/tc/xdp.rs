//! The tc path's first stage in XDP (`--acceleration`): a packet of an
//! established flow that leaves the node again (masqueraded to a backend
//! on another node, or a remote backend's reply on its way back to the
//! client) is translated and sent out in the driver, with the next hop
//! its flow's entry caches (`CtEntry::hop`, written by the tc path's FIB
//! lookup): no socket buffer is ever built for it.
//!
//! Everything else passes to the tc programs, which do what they always
//! did: a flow's setup (SYN, the handshake's ACK; a UDP flow's first
//! datagram, and its backend's first answer, which marks it answered),
//! its end (FIN, RST), a local
//! backend, fragments, ICMP errors, IP options and IPv6 extension
//! headers, a hop not cached or cached for an earlier second or route
//! epoch, and anything not ours. XDP changes nothing of what it passes, so
//! the tc path sees it as if XDP were not there; the only state both
//! write is the flow's entry, field by field as two CPUs of the tc path
//! already do (`track`).
//!
//! Checksums are updated in full: frames reach XDP with complete
//! checksums from a NIC. A veth peer's stack may send them partial
//! (checksum offload), which no XDP program can tell: the test beds turn
//! offload off on the senders (see the README).
use aya_ebpf::{
    bindings::xdp_action::{XDP_PASS, XDP_TX},
    helpers::{bpf_ktime_get_ns, bpf_redirect},
    programs::XdpContext,
};
use lb_common::{conntrack, ct_flags, ct_state, proto, stat, CtEntry};

use super::{
    config, key_of, nat_tuple, route, CsumDiff, Pkt, ETH_HLEN, ETH_P_IP, ETH_P_IPV6, L4_V4, L4_V6,
    LB_TC_PKT, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN,
};
use crate::maps::{count, port_marked, this_cpu, LB_CONNTRACK, LB_FRONTEND_PORTS};

/// A header field at `off`, bounds-checked against the frame's end.
#[inline(always)]
fn at<T: Copy>(ctx: &XdpContext, off: usize) -> Option<T> {
    let start = ctx.data();
    if start + off + core::mem::size_of::<T>() > ctx.data_end() {
        return None;
    }
    // SAFETY: within the frame (checked just above; the verifier checks
    // it too); packet bytes have no alignment.
    Some(unsafe { core::ptr::read_unaligned((start + off) as *const T) })
}

#[inline(always)]
fn put<T: Copy>(ctx: &XdpContext, off: usize, v: T) -> bool {
    let start = ctx.data();
    if start + off + core::mem::size_of::<T>() > ctx.data_end() {
        return false;
    }
    // SAFETY: as in `at`.
    unsafe { core::ptr::write_unaligned((start + off) as *mut T, v) };
    true
}

/// XDP on an external device: `XDP_TX` or `XDP_REDIRECT` for an
/// established flow's packet translated here, else `XDP_PASS`.
#[inline(always)]
pub fn serve(ctx: &XdpContext) -> u32 {
    forward(ctx).unwrap_or(XDP_PASS)
}

/// Reads the usual packet (IPv4 without options and not a fragment, IPv6
/// without extension headers; TCP or UDP) into `p`; `None` for the rest.
#[inline(always)]
fn parse(ctx: &XdpContext, p: &mut Pkt) -> Option<()> {
    match u16::from_be(at::<u16>(ctx, 12)?) {
        ETH_P_IP => {
            let h: [u8; 20] = at(ctx, ETH_HLEN)?;
            // Any fragment bit: a first fragment is recorded by the tc
            // path (`frag::record`) for its later ones.
            if h[0] != 0x45 || u16::from_be_bytes([h[6], h[7]]) & 0x3fff != 0 {
                return None;
            }
            p.proto = h[9];
            p.src = lb_common::ipv4_mapped([h[12], h[13], h[14], h[15]]);
            p.dst = lb_common::ipv4_mapped([h[16], h[17], h[18], h[19]]);
            p.v6 = false;
            p.l4 = L4_V4;
        }
        ETH_P_IPV6 => {
            p.proto = at(ctx, ETH_HLEN + 6)?;
            p.src = at(ctx, ETH_HLEN + 8)?;
            p.dst = at(ctx, ETH_HLEN + 24)?;
            p.v6 = true;
            p.l4 = L4_V6;
        }
        _ => return None,
    }
    let head: [u8; 14] = match p.proto {
        proto::TCP if p.v6 => at(ctx, L4_V6)?,
        proto::TCP => at(ctx, L4_V4)?,
        proto::UDP if p.v6 => Pkt::udp_head(at(ctx, L4_V6)?),
        proto::UDP => Pkt::udp_head(at(ctx, L4_V4)?),
        _ => return None,
    };
    p.set_l4_head(head);
    Some(())
}

/// Whether the flow of entry `e` is in a state where packet `p` changes
/// nothing but its last-seen time and acknowledgement: a TCP flow
/// established both ways, not closing, and a packet without SYN, FIN or
/// RST; a UDP flow whose backend answered, or any datagram of its client.
/// Everything else is for `track` in the tc path.
#[inline(always)]
fn steady(e: &CtEntry, p: &Pkt) -> bool {
    let reply = e.flags & ct_flags::REPLY != 0;
    if p.proto == proto::UDP {
        return !reply || e.state[ct_state::SEEN_REPLY] != 0;
    }
    p.tcp_flags & (TCP_SYN | TCP_FIN | TCP_RST) == 0
        && e.state[ct_state::SEEN_REPLY] != 0
        && e.state[ct_state::CLOSING] == 0
        && e.state[ct_state::FIN] == 0
        && e.backend_time_wait == 0
}

#[inline(always)]
fn forward(ctx: &XdpContext) -> Option<u32> {
    let p = this_cpu(&LB_TC_PKT)?;
    parse(ctx, p)?;
    let cfg = config()?;
    // As `surely_not_ours`: a frontend's port or a SNAT port (replies of
    // masqueraded flows), before the conntrack lookup.
    if !(cfg.snat_port_min..=cfg.snat_port_max).contains(&p.dport)
        && !port_marked(&LB_FRONTEND_PORTS, p.proto, p.dport)
    {
        return None;
    }
    let key = key_of(p);
    let ptr = LB_CONNTRACK.get_ptr_mut(&key)?;
    // SAFETY: valid for this run; a copy, as in `follow`.
    let e = unsafe { core::ptr::read(ptr) };
    // Only flows that leave the node again (`finish` redirects these); a
    // local backend's packets go up the stack from tc.
    if e.flags & (ct_flags::SNAT | ct_flags::REPLY) == 0 || !steady(&e, p) {
        return None;
    }
    // SAFETY: plain helper call.
    let now = unsafe { bpf_ktime_get_ns() };
    if !conntrack::live(&e, p.proto, now, cfg) {
        return None;
    }
    // The next hop the tc path cached for this direction, if it holds for
    // this second, route epoch, device and length.
    let in_ifindex = ctx.ingress_ifindex() as u32;
    let len = (ctx.data_end() - ctx.data()).saturating_sub(ETH_HLEN) as u16;
    let hop = &e.hop;
    if len > hop.len || hop.check != hop.digest(&e, route::stamp(now), in_ifindex, p.proto) {
        return None;
    }
    // Constant offsets: the verifier allows no packet offset read from map
    // memory (`p.l4`).
    let rewritten = if p.v6 {
        rewrite::<L4_V6>(ctx, p, &e)
    } else {
        rewrite::<L4_V4>(ctx, p, &e)
    };
    if !rewritten || !put(ctx, 0, hop.dmac) || !put(ctx, 6, hop.smac) {
        return None;
    }
    // SAFETY (both writes): one whole field each, as `track` writes them.
    unsafe { (*ptr).last_seen_ns = now };
    if p.proto == proto::TCP && p.tcp_flags & TCP_ACK != 0 {
        unsafe { (*ptr).ack_seq = p.ack };
    }
    count(stat::XDP_TRANSLATED);
    if hop.ifindex == in_ifindex {
        return Some(XDP_TX);
    }
    // SAFETY: plain helper call.
    Some(unsafe { bpf_redirect(hop.ifindex, 0) } as u32)
}

/// Rewrites `p` (its transport header at `L4`) to the entry's tuple with
/// both checksums, computed here in full (RFC 1624). Every store is
/// within bytes `parse` read, so none fails.
#[inline(always)]
fn rewrite<const L4: usize>(ctx: &XdpContext, p: &Pkt, e: &CtEntry) -> bool {
    let old = p.tuple();
    let new = nat_tuple(e);
    let addrs = CsumDiff(0)
        .addr(p.v6, old.src, new.src)
        .addr(p.v6, old.dst, new.dst);
    let ports = |sport: u16, dport: u16| {
        let (s, d) = (sport.to_be_bytes(), dport.to_be_bytes());
        u32::from_ne_bytes([s[0], s[1], d[0], d[1]])
    };
    let l4 = addrs.word(ports(old.sport, old.dport), ports(new.sport, new.dport));
    let csum = if p.proto == proto::TCP {
        L4 + 16
    } else {
        L4 + 6
    };
    let Some(check) = at::<u16>(ctx, csum) else {
        return false;
    };
    // UDP over IPv4 may be sent without a checksum (0), and stays so; a
    // computed 0 is sent as 0xffff.
    let new_check = match (p.proto, check) {
        (proto::UDP, 0) if !p.v6 => 0,
        (proto::UDP, _) => match l4.apply(check) {
            0 => 0xffff,
            c => c,
        },
        _ => l4.apply(check),
    };
    let l3 = if p.v6 {
        put(ctx, ETH_HLEN + 8, new.src.bytes()) && put(ctx, ETH_HLEN + 24, new.dst.bytes())
    } else {
        match at::<u16>(ctx, ETH_HLEN + 10) {
            Some(ip_check) => {
                put(ctx, ETH_HLEN + 10, addrs.apply(ip_check))
                    && put(ctx, ETH_HLEN + 12, new.src.v4())
                    && put(ctx, ETH_HLEN + 16, new.dst.v4())
            }
            None => false,
        }
    };
    let ports_bytes = {
        let (s, d) = (new.sport.to_be_bytes(), new.dport.to_be_bytes());
        [s[0], s[1], d[0], d[1]]
    };
    l3 && put(ctx, L4, ports_bytes) && put(ctx, csum, new_check)
}
