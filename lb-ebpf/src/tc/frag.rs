//! IPv6 extension headers and IP fragments.
//!
//! The transport header of an IPv6 packet is found by skipping hop-by-hop,
//! routing, destination options and fragment headers (at most
//! `MAX_EXT_HEADERS`; more, or any other header, and the packet is not
//! ours).
//!
//! Fragments, as Cilium's fragment map does: only the first fragment of a
//! datagram carries the ports. At ingress every first fragment of TCP or
//! UDP is recorded in `LB_FRAGMENTS` under (source, destination, IP id,
//! protocol): first as `PASS`, then, when it was translated, with the
//! addresses it was rewritten to (`finish` records it, at ingress and
//! egress). Later fragments are rewritten the same way (IP header only:
//! the transport checksum, fixed in the first fragment, covers the whole
//! datagram) and sent where the first went; a `PASS` entry lets them go
//! untouched; no entry at ingress (first fragment never seen, or evicted)
//! drops them, counted `TC_DROP_FRAGMENT`: nobody could reassemble them.
//! Entries are not deleted: the LRU map ages them out.
use aya_ebpf::{bindings::BPF_ANY, btf_maps::PerCpuArray, macros::btf_map, programs::TcContext};
use lb_common::{ct_flags, frag_flags, proto, stat, CtEntry, FragEntry, FragKey};

use super::{
    at, route, set_ipv4_addrs, Pkt, Words, ETH_HLEN, ETH_P_IP, ETH_P_IPV6, L4_V6, TC_ACT_OK,
    TC_ACT_SHOT, TC_ACT_UNSPEC,
};
use crate::maps::{count, this_cpu, LB_FRAGMENTS};

const NH_HOP_BY_HOP: u8 = 0;
const NH_ROUTING: u8 = 43;
const NH_FRAGMENT: u8 = 44;
const NH_DEST_OPTS: u8 = 60;
const MAX_EXT_HEADERS: usize = 6;

/// A key and a value being built: the BPF stack is 512 bytes.
#[repr(C)]
pub struct Work {
    key: FragKey,
    entry: FragEntry,
}

#[btf_map]
static LB_TC_FRAG_SCRATCH: PerCpuArray<Work, 1> = PerCpuArray::new();

#[inline(always)]
fn work() -> Option<&'static mut Work> {
    this_cpu(&LB_TC_FRAG_SCRATCH)
}

/// Where an IPv6 packet's upper-layer data starts.
pub struct V6 {
    pub l4: usize,
    pub proto: u8,
    /// The fragment header's offset, 0 without one.
    pub frag_at: usize,
    /// A fragment after the first: `l4` is mid-datagram.
    pub later: bool,
}

#[inline(always)]
pub fn ipv6(ctx: &TcContext) -> Option<V6> {
    let mut nh: u8 = at(ctx, ETH_HLEN + 6)?;
    let mut off = L4_V6;
    let mut frag_at = 0;
    for _ in 0..MAX_EXT_HEADERS {
        match nh {
            NH_HOP_BY_HOP | NH_ROUTING | NH_DEST_OPTS => {
                let h: [u8; 2] = ctx.load(off).ok()?;
                nh = h[0];
                off += (h[1] as usize + 1) * 8;
            }
            NH_FRAGMENT => {
                let h: [u8; 4] = ctx.load(off).ok()?;
                nh = h[0];
                frag_at = off;
                off += 8;
                if u16::from_be_bytes([h[2], h[3]]) & 0xfff8 != 0 {
                    return Some(V6 {
                        l4: off,
                        proto: nh,
                        frag_at,
                        later: true,
                    });
                }
            }
            _ => {
                return Some(V6 {
                    l4: off,
                    proto: nh,
                    frag_at,
                    later: false,
                })
            }
        }
    }
    None
}

/// The transport header of an IPv6 packet that has one (not a later
/// fragment), and its protocol.
#[inline(always)]
pub fn ipv6_l4(ctx: &TcContext, nh: u8) -> Option<(usize, u8)> {
    if nh == proto::TCP || nh == proto::UDP {
        return Some((L4_V6, nh));
    }
    let v = ipv6(ctx)?;
    if v.later {
        return None;
    }
    Some((v.l4, v.proto))
}

/// Fills in the key of a fragment and says whether it is a later one;
/// `None` if the packet is not a fragment.
#[inline(always)]
fn key_of(ctx: &TcContext, key: &mut FragKey, v6: bool, l4: usize, l4proto: u8) -> Option<bool> {
    key.proto = l4proto;
    key._pad = [0; 3];
    if !v6 {
        let f = u16::from_be(at::<u16>(ctx, ETH_HLEN + 6)?);
        if f & 0x3fff == 0 {
            return None;
        }
        key.id = u16::from_be(at::<u16>(ctx, ETH_HLEN + 4)?) as u32;
        key.src = lb_common::ipv4_mapped(at(ctx, ETH_HLEN + 12)?);
        key.dst = lb_common::ipv4_mapped(at(ctx, ETH_HLEN + 16)?);
        return Some(f & 0x1fff != 0);
    }
    // Without extension headers there is no fragment header.
    if l4 == L4_V6 {
        return None;
    }
    let v = ipv6(ctx)?;
    if v.frag_at == 0 {
        return None;
    }
    key.id = u32::from_be(ctx.load::<u32>(v.frag_at + 4).ok()?);
    key.src = at(ctx, ETH_HLEN + 8)?;
    key.dst = at(ctx, ETH_HLEN + 24)?;
    key.proto = v.proto;
    Some(v.later)
}

/// At ingress, before anything else is decided about a first fragment:
/// later ones may pass unless it is translated.
#[inline(always)]
pub fn mark(ctx: &TcContext, p: &Pkt) {
    if !maybe_fragment(ctx, p) {
        return;
    }
    let Some(w) = work() else { return };
    if key_of(ctx, &mut w.key, p.v6, p.l4, p.proto) == Some(false) {
        let e = &mut w.entry;
        e.nat_src = [0; 16];
        e.nat_dst = [0; 16];
        e.nat_sport = 0;
        e.nat_dport = 0;
        e.flags = frag_flags::PASS;
        e._pad = [0; 3];
        let _ = LB_FRAGMENTS.insert(&w.key, &w.entry, BPF_ANY as u64);
    }
}

/// A cheap first test: IPv4 with MF set, or IPv6 with extension headers.
#[inline(always)]
fn maybe_fragment(ctx: &TcContext, p: &Pkt) -> bool {
    if p.v6 {
        return p.l4 != L4_V6;
    }
    at::<u16>(ctx, ETH_HLEN + 6).is_some_and(|f| u16::from_be(f) & 0x2000 != 0)
}

/// A first fragment was translated as `e` says: its later fragments follow.
#[inline(always)]
pub fn record(ctx: &TcContext, p: &Pkt, e: &CtEntry, at_ingress: bool) {
    if !maybe_fragment(ctx, p) {
        return;
    }
    let Some(w) = work() else { return };
    if key_of(ctx, &mut w.key, p.v6, p.l4, p.proto) == Some(false) {
        // The packet is rewritten by now: key it as its fragments arrive.
        w.key.src = p.src;
        w.key.dst = p.dst;
        let redirect = at_ingress && e.flags & (ct_flags::SNAT | ct_flags::REPLY) != 0;
        let f = &mut w.entry;
        f.nat_src = e.nat_src;
        f.nat_dst = e.nat_dst;
        f.nat_sport = e.nat_sport;
        f.nat_dport = e.nat_dport;
        f.flags = if redirect { frag_flags::REDIRECT } else { 0 };
        f._pad = [0; 3];
        let _ = LB_FRAGMENTS.insert(&w.key, &w.entry, BPF_ANY as u64);
    }
}

/// A fragment after the first, if this packet is one (else `None`).
#[inline(always)]
pub fn later(ctx: &TcContext, at_ingress: bool) -> Option<i32> {
    let ethertype = u16::from_be(at::<u16>(ctx, 12)?);
    let w = work()?;
    let key = &mut w.key;
    let (l4, is_later) = match ethertype {
        ETH_P_IP => {
            let p: u8 = at(ctx, ETH_HLEN + 9)?;
            (0, key_of(ctx, key, false, 0, p)?)
        }
        ETH_P_IPV6 => {
            let v = ipv6(ctx)?;
            (v.l4, key_of(ctx, key, true, v.l4, v.proto)?)
        }
        _ => return None,
    };
    let key: &FragKey = key;
    if !is_later || (key.proto != proto::TCP && key.proto != proto::UDP) {
        return None;
    }
    let v6 = ethertype == ETH_P_IPV6;
    let Some(e) = LB_FRAGMENTS.get_ptr(key) else {
        if !at_ingress {
            return Some(TC_ACT_UNSPEC);
        }
        count(stat::TC_DROP_FRAGMENT);
        return Some(TC_ACT_SHOT);
    };
    // SAFETY: valid for this run; read in place.
    let e = unsafe { &*e };
    if e.flags & frag_flags::PASS != 0 {
        return Some(TC_ACT_UNSPEC);
    }
    if !set_ip_addrs(ctx, v6, key, e) {
        count(stat::TC_DROP_REWRITE);
        return Some(TC_ACT_SHOT);
    }
    count(stat::TC_TRANSLATED);
    if e.flags & frag_flags::REDIRECT == 0 {
        return Some(TC_ACT_OK);
    }
    let target = route::Target {
        v6,
        proto: key.proto,
        l4: if v6 { l4 } else { ETH_HLEN + 20 },
        src: Words::from_bytes(&e.nat_src),
        dst: Words::from_bytes(&e.nat_dst),
        sport: e.nat_sport,
        dport: e.nat_dport,
    };
    Some(match route::redirect(ctx, &target, None) {
        route::Fib::Sent(v) => v,
        // Nothing to quote that the sender could match: dropped.
        route::Fib::TooBig(_) => {
            count(stat::TC_FRAG_NEEDED);
            TC_ACT_SHOT
        }
        route::Fib::NoRoute => {
            count(stat::TC_DROP_NO_ROUTE);
            TC_ACT_SHOT
        }
    })
}

/// Rewrites the IP header's addresses (IPv4: with its checksum).
#[inline(always)]
fn set_ip_addrs(ctx: &TcContext, v6: bool, key: &FragKey, e: &FragEntry) -> bool {
    if v6 {
        return ctx.store(ETH_HLEN + 8, &e.nat_src, 0).is_ok()
            && ctx.store(ETH_HLEN + 24, &e.nat_dst, 0).is_ok();
    }
    let word = |a: &[u8; 16]| u32::from_ne_bytes([a[12], a[13], a[14], a[15]]);
    let (os, od, ns, nd) = (
        word(&key.src),
        word(&key.dst),
        word(&e.nat_src),
        word(&e.nat_dst),
    );
    set_ipv4_addrs(ctx, ETH_HLEN, (os, ns), (od, nd))
}
