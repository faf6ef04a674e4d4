//! Kernel programs of the load balancer.
//!
//! The socket programs translate at the cgroup sock_addr hooks: a connect or
//! sendmsg to a Service frontend is rewritten to a backend before the kernel
//! routes anything, so there is no per-packet NAT; recvmsg and getpeername
//! translate back so that the application only ever sees the frontend.
//! connect and sendmsg come twice: `connect4` refuses with `ECONNREFUSED`
//! (`bpf_set_retval`, Linux 6.1), `connect4_eperm` with the hook's own
//! `EPERM`, for older kernels; the agent loads one of them.
//!
//! `sock_release` forgets a closed TCP socket's peer (`LB_SOCK_PEER`).
//! `lb_sock_ops` watches those connects' outcome for outlier detection.
//! `cgroup_egress` applies `loadBalancerSourceRanges` to the sockets the
//! hooks sent to a restricted frontend, once their source is known.
//!
//! The tc programs (`tc_ingress`, `tc_egress`) serve north-south traffic on
//! the node's external devices: NodePorts, LoadBalancer IPs, externalIPs.
//! `lb_xdp`, with `--acceleration`, sends their established flows' packets
//! on from the driver (`tc::xdp`).
#![no_std]
#![feature(core_intrinsics)]
#![allow(internal_features)]
#![no_main]

mod egress;
mod lb;
mod maps;
mod outlier;
mod sock;
mod tc;

use aya_ebpf::{
    macros::{cgroup_skb, cgroup_sock, cgroup_sock_addr, classifier, sock_ops, xdp},
    programs::{
        SkBuffContext, SockAddrContext, SockContext, SockOpsContext, TcContext, XdpContext,
    },
};

#[classifier]
pub fn tc_ingress(ctx: TcContext) -> i32 {
    tc::ingress(&ctx)
}

#[classifier]
pub fn tc_egress(ctx: TcContext) -> i32 {
    tc::egress(&ctx)
}

#[xdp]
pub fn lb_xdp(ctx: XdpContext) -> u32 {
    tc::xdp::serve(&ctx)
}

#[cgroup_sock_addr(connect4)]
pub fn connect4(ctx: SockAddrContext) -> i32 {
    sock::forward::<sock::ConnRefused>(&ctx, sock::Family::V4)
}

#[cgroup_sock_addr(connect4)]
pub fn connect4_eperm(ctx: SockAddrContext) -> i32 {
    sock::forward::<sock::Eperm>(&ctx, sock::Family::V4)
}

#[cgroup_sock_addr(connect6)]
pub fn connect6(ctx: SockAddrContext) -> i32 {
    sock::forward::<sock::ConnRefused>(&ctx, sock::Family::V6)
}

#[cgroup_sock_addr(connect6)]
pub fn connect6_eperm(ctx: SockAddrContext) -> i32 {
    sock::forward::<sock::Eperm>(&ctx, sock::Family::V6)
}

#[cgroup_sock_addr(sendmsg4)]
pub fn sendmsg4(ctx: SockAddrContext) -> i32 {
    sock::forward::<sock::ConnRefused>(&ctx, sock::Family::V4)
}

#[cgroup_sock_addr(sendmsg4)]
pub fn sendmsg4_eperm(ctx: SockAddrContext) -> i32 {
    sock::forward::<sock::Eperm>(&ctx, sock::Family::V4)
}

#[cgroup_sock_addr(sendmsg6)]
pub fn sendmsg6(ctx: SockAddrContext) -> i32 {
    sock::forward::<sock::ConnRefused>(&ctx, sock::Family::V6)
}

#[cgroup_sock_addr(sendmsg6)]
pub fn sendmsg6_eperm(ctx: SockAddrContext) -> i32 {
    sock::forward::<sock::Eperm>(&ctx, sock::Family::V6)
}

#[cgroup_sock_addr(recvmsg4)]
pub fn recvmsg4(ctx: SockAddrContext) -> i32 {
    sock::reverse(&ctx, sock::Family::V4)
}

#[cgroup_sock_addr(recvmsg6)]
pub fn recvmsg6(ctx: SockAddrContext) -> i32 {
    sock::reverse(&ctx, sock::Family::V6)
}

#[cgroup_sock_addr(getpeername4)]
pub fn getpeername4(ctx: SockAddrContext) -> i32 {
    sock::reverse(&ctx, sock::Family::V4)
}

#[cgroup_sock_addr(getpeername6)]
pub fn getpeername6(ctx: SockAddrContext) -> i32 {
    sock::reverse(&ctx, sock::Family::V6)
}

#[cgroup_sock(sock_release)]
pub fn sock_release(ctx: SockContext) -> i32 {
    sock::release(&ctx)
}

/// Outlier detection: the outcome of the TCP connects `connect4` and
/// `connect6` sent to a backend (`outlier`).
#[sock_ops]
pub fn lb_sock_ops(ctx: SockOpsContext) -> u32 {
    outlier::sock_ops(&ctx)
}

#[cgroup_skb(egress)]
pub fn cgroup_egress(ctx: SkBuffContext) -> i32 {
    egress::egress(&ctx)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
