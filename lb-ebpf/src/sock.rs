//! Socket-layer translation at the cgroup sock_addr hooks.
//!
//! `forward` (connect, sendmsg): frontend -> backend, remembering the pair per
//! socket: by its cookie for TCP (`LB_SOCK_PEER`, until `release`), in `LB_REV_SOCK`
//! for UDP, whose flow to the frontend keeps its backend (`LB_DGRAM_FLOWS`)
//! for every datagram. `reverse` (recvmsg, getpeername): backend -> frontend,
//! from that memory. Addresses are handled as the 16-byte form of
//! `lb-common` (IPv4 mapped), so both families share one path.
use aya_ebpf::{
    bindings::{bpf_sock_addr, BPF_ANY},
    helpers::{
        bpf_get_netns_cookie, bpf_get_prandom_u32, bpf_get_smp_processor_id, bpf_get_socket_cookie,
        bpf_ktime_get_ns, bpf_set_retval,
    },
    programs::{SockAddrContext, SockContext},
    EbpfContext,
};
use lb_common::{
    algorithm, ipv4_mapped, is_ipv4_mapped, proto, scope, select, service_flags, sock_backend,
    source_check, stat, AffinityKey, Backend, DatagramFlowKey, ReverseSockKey, ReverseSockValue,
    ServiceKey, ServiceValue, SockPeer, SockPeerEntry, SOCK_PEER_PROBES,
};

use crate::{
    lb::{self, Frontend, HashOf},
    maps::{
        count, guarded_ranges, sock_peer_slots, this_cpu, LB_REV_SOCK, LB_SOCK_BACKEND,
        LB_SOCK_CHECK, LB_SOCK_DRAW, LB_SOCK_PEER,
    },
};

/// Let the syscall proceed (with whatever address the program left).
const PROCEED: i32 = 1;
/// Fail the syscall: with `EPERM`, unless `bpf_set_retval` set another error.
const REJECT: i32 = 0;
const ECONNREFUSED: i32 = 111;

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

/// The destination as the hook sees it, in `lb-common`'s 16-byte form.
struct SockAddr {
    addr: [u8; 16],
    port: u16,
}

#[inline(always)]
fn raw(ctx: &SockAddrContext) -> *mut bpf_sock_addr {
    ctx.sock_addr
}

#[inline(always)]
fn read_addr(ctx: &SockAddrContext, family: Family) -> SockAddr {
    let sa = raw(ctx);
    // SAFETY: the context pointer is valid for the program's whole run; the
    // verifier allows 4-byte reads of these fields, which volatile keeps.
    unsafe {
        let port = u16::from_be(core::ptr::read_volatile(&(*sa).user_port) as u16);
        let addr = match family {
            Family::V4 => ipv4_mapped(core::ptr::read_volatile(&(*sa).user_ip4).to_ne_bytes()),
            Family::V6 => {
                let mut words = [0u32; 4];
                let mut i = 0;
                while i < 4 {
                    words[i] = core::ptr::read_volatile(&(*sa).user_ip6[i]);
                    i += 1;
                }
                // SAFETY: [u32; 4] and [u8; 16] have the same size and the
                // words are already in network order.
                core::mem::transmute::<[u32; 4], [u8; 16]>(words)
            }
        };
        SockAddr { addr, port }
    }
}

/// Writes `addr:port` into the context. `false` when the address cannot be
/// expressed in the socket's family (an IPv6 backend for an IPv4 socket).
#[inline(always)]
fn write_addr(ctx: &SockAddrContext, family: Family, addr: &[u8; 16], port: u16) -> bool {
    let sa = raw(ctx);
    match family {
        Family::V4 => {
            if !is_ipv4_mapped(addr) {
                return false;
            }
            let ip = u32::from_ne_bytes([addr[12], addr[13], addr[14], addr[15]]);
            // SAFETY: 4-byte stores to user_ip4/user_port are what the
            // verifier allows for these hooks.
            unsafe {
                core::ptr::write_volatile(&mut (*sa).user_ip4, ip);
                core::ptr::write_volatile(&mut (*sa).user_port, port.to_be() as u32);
            }
        }
        Family::V6 => {
            // SAFETY: as above, 4-byte stores to each user_ip6 word.
            let words = unsafe { core::mem::transmute::<[u8; 16], [u32; 4]>(*addr) };
            unsafe {
                let mut i = 0;
                while i < 4 {
                    core::ptr::write_volatile(&mut (*sa).user_ip6[i], words[i]);
                    i += 1;
                }
                core::ptr::write_volatile(&mut (*sa).user_port, port.to_be() as u32);
            }
        }
    }
    true
}

#[inline(always)]
fn protocol(ctx: &SockAddrContext) -> u8 {
    // SAFETY: valid context; `protocol` is readable in every sock_addr hook.
    let p = unsafe { core::ptr::read_volatile(&(*raw(ctx)).protocol) };
    p as u8
}

/// How `forward` fails a connect or sendmsg that must not go through.
///
/// The object carries one program per hook and way; the agent loads those
/// its kernel verifies (`lb-agent check` says which).
pub trait Refusal {
    fn refuse(ctx: &SockAddrContext) -> i32;
}

/// `ECONNREFUSED`, as kube-proxy's REJECT rules answer: needs
/// `bpf_set_retval` in sock_addr hooks (Linux 6.1).
pub struct ConnRefused;

impl Refusal for ConnRefused {
    #[inline(always)]
    fn refuse(_ctx: &SockAddrContext) -> i32 {
        count(stat::REFUSED);
        // SAFETY: plain helper call; only the return code of the syscall changes.
        unsafe { bpf_set_retval(-ECONNREFUSED) };
        REJECT
    }
}

/// The hook's own rejection, `EPERM`, for kernels without
/// `bpf_set_retval` there. The program has no call to it at all, so
/// that older verifiers accept it.
pub struct Eperm;

impl Refusal for Eperm {
    #[inline(always)]
    fn refuse(_ctx: &SockAddrContext) -> i32 {
        count(stat::REFUSED);
        REJECT
    }
}

/// The socket path's hashes of a new flow (`lb::FlowHashes`): the flow
/// is the socket (see `lb_common::select::flow_hash`), its client the
/// pod's netns, its destination the frontend; each salted with this
/// node's secret but the destination's, which every node hashes alike.
#[derive(Clone, Copy)]
struct SockHashes<'a> {
    ctx: &'a SockAddrContext,
    service_id: u32,
    dst: &'a SockAddr,
}

impl lb::FlowHashes for SockHashes<'_> {
    #[inline(always)]
    fn hash(&self, of: HashOf) -> u32 {
        let secret = this_cpu(&LB_SOCK_DRAW).map_or(0, |d| d.secret);
        // SAFETY: plain helper calls on the program's own context.
        let netns = unsafe { bpf_get_netns_cookie(self.ctx.as_ptr()) };
        match of {
            HashOf::Flow => {
                // SAFETY: as above.
                let sock = unsafe { bpf_get_socket_cookie(self.ctx.as_ptr()) };
                select::flow_hash(sock, netns, self.service_id, secret)
            }
            HashOf::Client => select::netns_hash(netns, secret),
            HashOf::Destination => select::destination_hash(&self.dst.addr, self.dst.port),
        }
    }
}

/// A backend for a new flow, by the frontend's scheduler; the client of
/// sessionAffinity is the pod's netns.
#[inline(always)]
fn choose(ctx: &SockAddrContext, svc: &ServiceValue, dst: &SockAddr) -> Option<(u32, Backend)> {
    let hashes = SockHashes {
        ctx,
        service_id: svc.id,
        dst,
    };
    if svc.flags & service_flags::AFFINITY == 0 {
        return lb::choose::<true>(svc, hashes, random);
    }
    // SAFETY: plain helper calls on the program's own context.
    let (netns, now) = unsafe { (bpf_get_netns_cookie(ctx.as_ptr()), bpf_ktime_get_ns()) };
    let key = AffinityKey::for_netns(netns, svc.affinity_id);
    lb::with_affinity(&key, svc, now, lb::backend_by_id, || {
        lb::choose::<true>(svc, hashes, random)
    })
}

/// A uniformly random number for a socket's choice (`select::draw`): no
/// helper call on the kernels that inline the per-CPU array lookup and the
/// CPU number (6.10 and later).
#[inline(always)]
fn random() -> u32 {
    match this_cpu(&LB_SOCK_DRAW) {
        // SAFETY: plain helper call (inlined by the verifier).
        Some(d) => select::draw(&mut d.state, unsafe { bpf_get_smp_processor_id() }),
        // SAFETY: plain helper call.
        None => unsafe { bpf_get_prandom_u32() },
    }
}

/// A backend for a UDP socket's datagram to `frontend`: the one of its flow
/// (`lb::with_datagram_flow`), so that an unconnected socket's datagrams
/// do not each go elsewhere; `connect` keeps it too, as one source port's
/// datagrams keep one conntrack entry under kube-proxy, connected or not.
/// sessionAffinity decides alone: its entry keeps the pod, and so each of
/// its sockets, on one backend already.
#[inline(always)]
fn choose_for_datagram(
    ctx: &SockAddrContext,
    svc: &ServiceValue,
    frontend: &SockAddr,
) -> Option<(u32, Backend)> {
    if svc.flags & service_flags::AFFINITY != 0 {
        return choose(ctx, svc, frontend);
    }
    // SAFETY: plain helper calls on the program's own context.
    let (cookie, now) = unsafe { (bpf_get_socket_cookie(ctx.as_ptr()), bpf_ktime_get_ns()) };
    let key = DatagramFlowKey {
        cookie,
        addr: frontend.addr,
        port: frontend.port,
        proto: proto::UDP,
        _pad: [0; 5],
    };
    // Without affinity (decided above): `choose`'s affinity path is not
    // in this closure, which keeps the chain of calls through it short.
    let hashes = SockHashes {
        ctx,
        service_id: svc.id,
        dst: frontend,
    };
    lb::with_datagram_flow(&key, svc, now, || lb::choose::<true>(svc, hashes, random))
}

/// connect and sendmsg: rewrite a frontend to one of its backends.
#[inline(always)]
pub fn forward<R: Refusal>(ctx: &SockAddrContext, family: Family) -> i32 {
    let proto = protocol(ctx);
    if proto != proto::TCP && proto != proto::UDP {
        return PROCEED;
    }
    let dst = read_addr(ctx, family);
    let key = ServiceKey {
        addr: dst.addr,
        port: dst.port,
        proto,
        scope: scope::INTERNAL,
    };
    let svc = match lb::lookup_frontend(&key, true) {
        Frontend::Served(svc) => svc,
        // A live VIP on a port it does not serve: refuse, as kube-proxy does.
        Frontend::PortNotServed => return R::refuse(ctx),
        Frontend::NotOurs => return unallocated::<R>(ctx, &dst.addr),
    };
    let chosen = if proto == proto::TCP {
        choose(ctx, &svc, &dst)
    } else {
        choose_for_datagram(ctx, &svc, &dst)
    };
    let Some((id, backend)) = chosen else {
        if svc.active > 0 || svc.terminating > 0 {
            // The agent publishes whole sets, so this means the maps were
            // edited by hand or are full; say so instead of refusing quietly.
            aya_log_ebpf::debug!(
                ctx,
                "service {} (set {}) has backends but none resolved",
                svc.id,
                svc.backend_set
            );
        }
        return R::refuse(ctx);
    };
    if !write_addr(ctx, family, &backend.addr, backend.port) {
        return R::refuse(ctx);
    }
    if svc.flags & service_flags::SOURCE_RANGES != 0 && !mark_for_source_check(ctx) {
        return R::refuse(ctx);
    }
    if proto == proto::TCP {
        // SAFETY: plain helper call on the program's own context.
        let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
        // Counted while the socket is open, for the schedulers that count;
        // its connect watched by outlier detection (`outlier::sock_ops`).
        // Without a branch: one path into `remember_peer` (see
        // `algorithm::counts_bit`).
        let counted = algorithm::counts_bit(svc.algorithm()) * sock_backend::COUNTED;
        let watched = (svc.flags & service_flags::OUTLIER_DETECT != 0) as u32;
        let mark = id & sock_backend::ID | counted | watched * sock_backend::WATCHED;
        remember_peer(cookie, &dst, &backend, mark);
    } else {
        remember_datagram_peer(ctx, &dst, &backend, svc.id);
    }
    count(stat::TRANSLATED);
    PROCEED
}

/// A destination no Service holds: refused at once if it is in the
/// guarded Service CIDRs (an unallocated ClusterIP, which kube-proxy's
/// `cluster-ips-check` drops), so that it never leaves the node; else
/// none of ours. Without guarded CIDRs the check is not in the program
/// (`guarded_ranges`).
#[inline(always)]
fn unallocated<R: Refusal>(ctx: &SockAddrContext, addr: &[u8; 16]) -> i32 {
    match guarded_ranges() {
        Some(ranges) if ranges.contains(addr) => {
            count(stat::SOCK_REFUSED_UNALLOCATED);
            R::refuse(ctx)
        }
        _ => PROCEED,
    }
}

/// The source of a connect is chosen by the kernel after this hook, so
/// `loadBalancerSourceRanges` are checked on the socket's packets
/// (`egress`); this marks the socket for it. Without the mark the ranges
/// could not be enforced, so `false` (no memory for it) refuses.
#[inline(always)]
fn mark_for_source_check(ctx: &SockAddrContext) -> bool {
    // SAFETY: the helper takes the context's own socket.
    let check = unsafe { LB_SOCK_CHECK.get_or_insert_ptr_mut(ctx, None) };
    if check.is_null() {
        return false;
    }
    // SAFETY: non-null storage of this socket. A reconnect (to this or
    // another frontend) is checked afresh.
    unsafe { (*check).verdict = source_check::PENDING };
    true
}

/// A TCP socket's one peer, until `release` forgets it: in its own slot
/// of `LB_SOCK_PEER` if it has one (a second connect of the socket
/// overwrites the first's peer), else in the first free one of its slots.
/// A socket thus holds at most one slot. `mark` (`sock_backend`: the
/// backend's id and flags) goes to `LB_SOCK_BACKEND` beside the slot: a
/// `COUNTED` socket counts among its backend's open connections until
/// release or its next connect, and a `WATCHED` one has its connect
/// watched by outlier detection; a socket whose peer cannot be recorded
/// is neither, since nothing would take the count back or find the
/// backend.
///
/// A function of its own (not inlined): its probing and digest spill on
/// its own stack frame, beside the hook's deepest chain of calls, which
/// they would push past 512 bytes as the verifiers of 5.10 and 6.1 count.
#[inline(never)]
fn remember_peer(cookie: u64, frontend: &SockAddr, backend: &Backend, mark: u32) {
    let Some((index, entry)) = PeerSlots::of(cookie).and_then(|s| s.own_or_free(cookie)) else {
        // Every slot held by an open socket: only the reverse view is
        // lost, never the connection.
        count(stat::SOCK_PEER_LOST);
        return;
    };
    let own = held_by(entry) == cookie;
    // SAFETY: a valid element; the socket lock keeps this socket's other
    // syscalls out, and another socket only writes a free slot. A write
    // racing another socket's for the same free slot leaves an entry
    // whose check fails, never a wrong peer. The digest is taken from the
    // element as written: a copy on the stack would not fit beside the
    // hook's own frames.
    unsafe {
        let peer = &mut (*entry).peer;
        peer.backend_addr = backend.addr;
        peer.frontend_addr = frontend.addr;
        peer.backend_port = backend.port;
        peer.frontend_port = frontend.port;
        (*entry).check = SockPeerEntry::digest(cookie, peer);
        core::ptr::write_volatile(&mut (*entry).cookie, cookie);
    }
    if let Some(was) = LB_SOCK_BACKEND.get_ptr_mut(index) {
        // SAFETY: the element beside the socket's slot, which only the
        // socket holding the slot writes.
        unsafe {
            let earlier = core::ptr::read_volatile(was);
            if own && earlier & sock_backend::COUNTED != 0 {
                // This socket's earlier connect (one that failed).
                lb::close_counted(earlier & sock_backend::ID);
            }
            core::ptr::write_volatile(was, mark);
        }
        if mark & sock_backend::COUNTED != 0 {
            lb::open_counted(mark & sock_backend::ID);
        }
    }
}

/// The `LB_SOCK_PEER` slots a socket may hold: `SOCK_PEER_PROBES` in a
/// row from `cookie % slots`, wrapping. Cookies are handed out in
/// increasing order (per CPU, in batches), so the sockets open at once
/// mostly take distinct slots.
#[derive(Clone, Copy)]
struct PeerSlots {
    first: u32,
    slots: u32,
}

impl PeerSlots {
    /// `None` only for an array of no slots.
    #[inline(always)]
    fn of(cookie: u64) -> Option<Self> {
        let slots = sock_peer_slots();
        let first = cookie.checked_rem(slots as u64)? as u32;
        Some(Self { first, slots })
    }

    /// The `i`th slot and its index, `None` past the array (a table of
    /// fewer slots than `SOCK_PEER_PROBES`).
    #[inline(always)]
    fn entry(self, i: u32) -> Option<(u32, *mut SockPeerEntry)> {
        if i >= self.slots {
            return None;
        }
        let at = self.first + i;
        let at = if at >= self.slots {
            at - self.slots
        } else {
            at
        };
        Some((at, LB_SOCK_PEER.get_ptr_mut(at)?))
    }

    /// The slot holding `cookie`.
    #[inline(always)]
    fn own(self, cookie: u64) -> Option<(u32, *mut SockPeerEntry)> {
        let mut i = 0;
        while i < SOCK_PEER_PROBES {
            let (index, entry) = self.entry(i)?;
            if held_by(entry) == cookie {
                return Some((index, entry));
            }
            i += 1;
        }
        None
    }

    /// The slot holding `cookie`, else the first free one.
    #[inline(always)]
    fn own_or_free(self, cookie: u64) -> Option<(u32, *mut SockPeerEntry)> {
        let mut free = None;
        let mut i = 0;
        while i < SOCK_PEER_PROBES {
            let Some((index, entry)) = self.entry(i) else {
                break;
            };
            let held = held_by(entry);
            if held == cookie {
                return Some((index, entry));
            }
            if held == 0 && free.is_none() {
                free = Some((index, entry));
            }
            i += 1;
        }
        free
    }
}

/// The backend a TCP socket's connect chose, if outlier detection watches
/// it (`sock_backend::WATCHED`), and still names that backend: its id,
/// and the frontend the socket asked for (the key of its `LB_SERVICES`
/// entry).
#[inline(always)]
pub fn watched_backend(cookie: u64) -> Option<(u32, ServiceKey)> {
    let (index, entry) = PeerSlots::of(cookie)?.own(cookie)?;
    // SAFETY: the element beside the socket's own slot, read once.
    let mark = unsafe { core::ptr::read_volatile(LB_SOCK_BACKEND.get_ptr(index)?) };
    if mark & sock_backend::WATCHED == 0 {
        return None;
    }
    let id = mark & sock_backend::ID;
    // SAFETY: the socket's own slot, read in place.
    let (backend_addr, backend_port, addr, port) = unsafe {
        let p = &(*entry).peer;
        (
            p.backend_addr,
            p.backend_port,
            p.frontend_addr,
            p.frontend_port,
        )
    };
    if !lb::backend_is_or_was(id, &backend_addr, backend_port) {
        return None;
    }
    Some((
        id,
        ServiceKey {
            addr,
            port,
            proto: proto::TCP,
            scope: scope::INTERNAL,
        },
    ))
}

/// The cookie of the socket holding `entry`, 0 if it is free.
#[inline(always)]
fn held_by(entry: *mut SockPeerEntry) -> u64 {
    // SAFETY: a valid element of `LB_SOCK_PEER`, read once.
    unsafe { core::ptr::read_volatile(&(*entry).cookie) }
}

/// `sock_release`: a closed TCP socket's slot is freed, so that
/// `LB_SOCK_PEER` holds only open sockets. Other sockets have none.
#[inline(always)]
pub fn release(ctx: &SockContext) -> i32 {
    // SAFETY: `protocol` is readable in every cgroup sock program.
    let proto = unsafe { core::ptr::read_volatile(&(*ctx.sock).protocol) };
    if proto == proto::TCP as u32 {
        // SAFETY: plain helper call on the program's own context.
        let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
        if let Some((index, entry)) = PeerSlots::of(cookie).and_then(|s| s.own(cookie)) {
            uncount(index, entry);
            // SAFETY: a valid element; only this socket writes a slot that
            // holds its cookie.
            unsafe { core::ptr::write_volatile(&mut (*entry).cookie, 0) };
        }
    }
    PROCEED
}

/// Takes back the open connection the socket holding slot `index`
/// (`entry`) counted, if any, unless its backend's id names another
/// backend now: the agent keeps a deleted backend's id while connections
/// counted for it are open (its element is then free), and zeroes an
/// id's counts before another backend takes it.
#[inline(always)]
fn uncount(index: u32, entry: *mut SockPeerEntry) {
    let Some(counted) = LB_SOCK_BACKEND.get_ptr_mut(index) else {
        return;
    };
    // SAFETY: the element beside the socket's own slot, which only this
    // socket writes while it holds the slot.
    let mark = unsafe { core::ptr::read_volatile(counted) };
    if mark & sock_backend::COUNTED == 0 {
        return;
    }
    let id = mark & sock_backend::ID;
    // SAFETY: as above.
    unsafe { core::ptr::write_volatile(counted, 0) };
    // SAFETY: a valid element of the socket's own slot, read in place.
    let (addr, port) = unsafe { ((*entry).peer.backend_addr, (*entry).peer.backend_port) };
    if lb::backend_is_or_was(id, &addr, port) {
        lb::close_counted(id);
    }
}

/// A UDP socket may address many frontends: one entry per (socket, backend).
#[inline(always)]
fn remember_datagram_peer(
    ctx: &SockAddrContext,
    frontend: &SockAddr,
    backend: &Backend,
    service_id: u32,
) {
    // SAFETY: plain helper call on the program's own context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let key = ReverseSockKey {
        cookie,
        addr: backend.addr,
        port: backend.port,
        _pad: [0; 6],
    };
    let value = ReverseSockValue {
        addr: frontend.addr,
        port: frontend.port,
        _pad: 0,
        service_id,
    };
    // A full LRU map evicts the oldest entry; failure only loses the reverse
    // view of this socket, never the connection, so it is not fatal.
    let _ = LB_REV_SOCK.insert(&key, &value, BPF_ANY as u64);
}

/// recvmsg and getpeername: show the frontend the socket addressed.
#[inline(always)]
pub fn reverse(ctx: &SockAddrContext, family: Family) -> i32 {
    let src = read_addr(ctx, family);
    let frontend = if protocol(ctx) == proto::TCP {
        tcp_frontend(ctx, &src)
    } else {
        datagram_frontend(ctx, &src)
    };
    if let Some((addr, port)) = frontend {
        if write_addr(ctx, family, &addr, port) {
            count(stat::REVERSED);
        }
    }
    PROCEED
}

#[inline(always)]
fn tcp_frontend(ctx: &SockAddrContext, src: &SockAddr) -> Option<([u8; 16], u16)> {
    // SAFETY: plain helper call on the program's own context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    let peer = tcp_peer(cookie)?;
    // Only the peer we connected it to: a socket connected directly (or
    // reconnected past us) keeps its real peer.
    (peer.backend_addr == src.addr && peer.backend_port == src.port)
        .then_some((peer.frontend_addr, peer.frontend_port))
}

/// What the TCP socket `cookie` was connected to, from `LB_SOCK_PEER`.
#[inline(always)]
pub fn tcp_peer(cookie: u64) -> Option<SockPeer> {
    let (_, entry) = PeerSlots::of(cookie)?.own(cookie)?;
    // SAFETY: a valid element, copied out; `peer_of` rejects an entry torn
    // by two writers (or taken by another socket since `own`).
    unsafe { core::ptr::read(entry) }.peer_of(cookie)
}

#[inline(always)]
fn datagram_frontend(ctx: &SockAddrContext, src: &SockAddr) -> Option<([u8; 16], u16)> {
    // SAFETY: plain helper call on the program's own context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    frontend_of_datagram_peer(cookie, src.addr, src.port)
}

/// The frontend a UDP socket (`cookie`) addressed when its datagrams went
/// to `backend:port`, from `LB_REV_SOCK`.
#[inline(always)]
pub fn frontend_of_datagram_peer(
    cookie: u64,
    backend: [u8; 16],
    port: u16,
) -> Option<([u8; 16], u16)> {
    let key = ReverseSockKey {
        cookie,
        addr: backend,
        port,
        _pad: [0; 6],
    };
    let rev = LB_REV_SOCK.get_ptr(&key)?;
    // SAFETY: copied out at once.
    let rev = unsafe { core::ptr::read(rev) };
    Some((rev.addr, rev.port))
}
