//! The FIB lookup before a translated packet is sent, and what it can say:
//! sent, too big for the next hop (the MTU of the route or device, checked
//! against the packet's length, or its segments' when it is a GSO packet),
//! or no route. With the next hop's MAC known, the program writes both MACs
//! and the packet leaves with `bpf_redirect`; otherwise `bpf_redirect_neigh`
//! resolves the neighbour (and repeats the route lookup) after the program.
//! A flow keeps the answer in its entry (`CtEntry::hop`, see `NextHop`)
//! and its later packets skip the lookup while it holds.
use aya_ebpf::{
    bindings::bpf_fib_lookup,
    helpers::{bpf_fib_lookup as fib_lookup, bpf_redirect, bpf_redirect_neigh},
    programs::TcContext,
    EbpfContext,
};
use lb_common::{proto, CtEntry, NextHop};

use super::{put, Words, AF_INET, AF_INET6, ETH_HLEN, FIB_NO_NEIGH, FIB_SUCCESS, LB_TC_SCRATCH};
use crate::maps::{this_cpu, LB_ROUTE_EPOCH};

const FIB_FRAG_NEEDED: i64 = 8;

pub enum Fib {
    /// The verdict of `bpf_redirect` or `bpf_redirect_neigh`.
    Sent(i32),
    /// Too big for the next hop, whose MTU this is.
    TooBig(u16),
    NoRoute,
}

/// Where a translated packet goes.
pub struct Target {
    pub v6: bool,
    pub proto: u8,
    pub l4: usize,
    pub src: Words,
    pub dst: Words,
    pub sport: u16,
    pub dport: u16,
}

/// The IP length the next hop must carry: the packet's, or for a GSO
/// packet one segment's (headers plus `gso_size`).
#[inline(always)]
fn wire_len(ctx: &TcContext, t: &Target) -> u16 {
    // SAFETY: the context pointer is valid for the program's run.
    let gso = unsafe { (*ctx.skb.skb).gso_size };
    if gso == 0 {
        return (ctx.len() as usize).saturating_sub(ETH_HLEN) as u16;
    }
    let l4_len = if t.proto == proto::TCP {
        ctx.load::<u8>(t.l4 + 12)
            .map_or(20, |d| (d >> 4) as usize * 4)
    } else {
        8
    };
    (t.l4 - ETH_HLEN + l4_len + gso as usize) as u16
}

/// A flow's entry, for its cached next hop: `entry` as read at the start
/// of the run, `ptr` the map element to write a new hop to.
pub struct Flow<'a> {
    pub entry: &'a CtEntry,
    pub ptr: *mut CtEntry,
    pub now: u64,
}

/// What a cached hop is good for: the route epoch and the second.
#[inline(always)]
pub(super) fn stamp(now: u64) -> [u32; 2] {
    [
        LB_ROUTE_EPOCH.get(0).copied().unwrap_or(0),
        (now >> 30) as u32,
    ]
}

#[inline(always)]
pub fn redirect(ctx: &TcContext, t: &Target, flow: Option<&Flow>) -> Fib {
    let len = wire_len(ctx, t);
    // SAFETY: the context pointer is valid for the program's run.
    let in_ifindex = unsafe { (*ctx.skb.skb).ifindex };
    let stamp = flow.map(|f| stamp(f.now));
    if let (Some(f), Some(stamp)) = (flow, stamp) {
        let hop = &f.entry.hop;
        if len <= hop.len
            && hop.check == hop.digest(f.entry, stamp, in_ifindex, t.proto)
            && put(ctx, 0, &hop.dmac)
            && put(ctx, 6, &hop.smac)
        {
            // SAFETY: plain helper call; the packet leaves by that device.
            return Fib::Sent(unsafe { bpf_redirect(hop.ifindex, 0) } as i32);
        }
    }
    let Some(scratch) = this_cpu(&LB_TC_SCRATCH) else {
        return Fib::NoRoute;
    };
    let fib = &mut scratch.fib;
    // SAFETY: an all-zero bpf_fib_lookup is a valid request to fill in.
    *fib = unsafe { core::mem::zeroed() };
    fib.family = if t.v6 { AF_INET6 } else { AF_INET };
    fib.l4_protocol = t.proto;
    fib.sport = t.sport.to_be();
    fib.dport = t.dport.to_be();
    // A length makes the lookup check it against the route's MTU (a
    // lowered route MTU included), not only the device's.
    fib.__bindgen_anon_1.tot_len = len;
    fib.ifindex = in_ifindex;
    if t.v6 {
        fib.__bindgen_anon_3.ipv6_src = t.src.0;
        fib.__bindgen_anon_4.ipv6_dst = t.dst.0;
    } else {
        fib.__bindgen_anon_3.ipv4_src = t.src.v4();
        fib.__bindgen_anon_4.ipv4_dst = t.dst.v4();
    }
    // SAFETY: helper call with a valid context and a buffer of the size passed.
    let rc = unsafe {
        fib_lookup(
            ctx.as_ptr(),
            fib as *mut bpf_fib_lookup,
            core::mem::size_of::<bpf_fib_lookup>() as i32,
            0,
        )
    };
    match rc {
        // The next hop's MAC and the device's, from the lookup (map memory,
        // as the helper takes it): the Ethernet header is complete.
        FIB_SUCCESS if put(ctx, 0, &fib.dmac) && put(ctx, 6, &fib.smac) => {
            if let (Some(f), Some(stamp)) = (flow, stamp) {
                let mut hop = NextHop {
                    ifindex: fib.ifindex,
                    dmac: fib.dmac,
                    smac: fib.smac,
                    // Packets up to this length take the route: a longer
                    // one looks it up again (and may be too big).
                    len,
                    _pad: 0,
                    check: 0,
                };
                // The digest of this flow's tuple as read at the start of
                // the run, not of the element's: if the element has been
                // reused by another flow since, the hop fails its check.
                hop.check = hop.digest(f.entry, stamp, in_ifindex, t.proto);
                // SAFETY: a valid element for this run; a torn write
                // fails the check, as said on `NextHop`.
                unsafe { (*f.ptr).hop = hop };
            }
            // SAFETY: plain helper call; the packet leaves by that device.
            Fib::Sent(unsafe { bpf_redirect(fib.ifindex, 0) } as i32)
        }
        // SAFETY: plain helper call; a NULL neighbour makes it look up the
        // next hop and write the MACs itself.
        FIB_SUCCESS | FIB_NO_NEIGH => {
            Fib::Sent(
                unsafe { bpf_redirect_neigh(fib.ifindex, core::ptr::null_mut(), 0, 0) } as i32,
            )
        }
        // SAFETY: the lookup wrote the MTU into the union.
        FIB_FRAG_NEEDED => Fib::TooBig(unsafe { fib.__bindgen_anon_1.mtu_result }),
        _ => Fib::NoRoute,
    }
}
