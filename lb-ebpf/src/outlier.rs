//! Outlier detection: the outcome of TCP connects counted in the chosen
//! backend's `BackendHealth`, on both paths.
//!
//! - Socket path: `sock_ops` watches the connects `sock::forward` marked
//!   (`sock_backend::WATCHED`): an RST in answer to the SYN, an ICMP error
//!   before any answer, or a SYN unanswered for a second (its first
//!   retransmission) is a failure, an established connection a success.
//! - tc path (`tc::track`): a backend's RST to a flow still in `LB_CT_SYN`,
//!   or the client's SYN sent again a second after the first with no
//!   answer, is a failure; the backend's SYN-ACK a success.
//!
//! Enough failures in a row quarantine the backend for new flows of every
//! frontend on this node (`lb::quarantined`), decided here, in the kernel,
//! before the failed connect returns to its application.
use aya_ebpf::{
    bindings::{
        BPF_SOCK_OPS_RTO_CB, BPF_SOCK_OPS_RTO_CB_FLAG, BPF_SOCK_OPS_STATE_CB,
        BPF_SOCK_OPS_STATE_CB_FLAG, BPF_SOCK_OPS_TCP_CONNECT_CB, BPF_TCP_CLOSE,
        BPF_TCP_ESTABLISHED, BPF_TCP_SYN_SENT,
    },
    btf_maps::PerCpuArray,
    helpers::generated::{bpf_get_socket_cookie, bpf_ktime_get_ns, bpf_spin_lock, bpf_spin_unlock},
    macros::btf_map,
    programs::SockOpsContext,
    EbpfContext,
};
use lb_common::{outlier, scope, service_flags, stat, BackendHealth, ServiceKey};

use crate::{
    lb::{self, Frontend},
    maps::{count, this_cpu, LB_BACKEND_HEALTH, LB_TC_CONFIG},
    sock,
};

/// A `sock_ops` program's verdict; nothing is asked of it here.
const DONE: u32 = 1;

pub fn sock_ops(ctx: &SockOpsContext) -> u32 {
    match ctx.op() {
        BPF_SOCK_OPS_TCP_CONNECT_CB => {
            if watched(ctx).is_some() {
                // The state changes and retransmission timeouts of this
                // socket from now on (until it is established).
                let _ = ctx
                    .set_cb_flags((BPF_SOCK_OPS_STATE_CB_FLAG | BPF_SOCK_OPS_RTO_CB_FLAG) as i32);
            }
        }
        BPF_SOCK_OPS_STATE_CB if ctx.arg(0) == BPF_TCP_SYN_SENT => match ctx.arg(1) {
            BPF_TCP_ESTABLISHED => {
                if let Some((id, _)) = watched(ctx) {
                    succeeded(id);
                }
                let _ = ctx.set_cb_flags(0);
            }
            // Closed in the handshake by the kernel: an application's own
            // close runs `sock_release` first, which frees the socket's
            // slot, so `failed` finds nothing to count. By an RST from
            // the backend if it sent anything (its SYN-ACK would have
            // established the connection), else by an ICMP error.
            BPF_TCP_CLOSE => failed(
                ctx,
                if segments_in(ctx) > 0 {
                    outlier::REFUSED
                } else {
                    outlier::UNREACHABLE
                },
            ),
            _ => {}
        },
        // The SYN's first retransmission: unanswered for a second. One
        // failure per connect: nothing more of this socket is watched.
        BPF_SOCK_OPS_RTO_CB if state(ctx) == BPF_TCP_SYN_SENT && ctx.arg(0) == 0 => {
            failed(ctx, outlier::TIMEOUT);
            let _ = ctx.set_cb_flags(0);
        }
        _ => {}
    }
    DONE
}

#[inline(always)]
fn state(ctx: &SockOpsContext) -> u32 {
    // SAFETY: a field of the program's own context.
    unsafe { core::ptr::read_volatile(&(*ctx.ops).state) }
}

#[inline(always)]
fn segments_in(ctx: &SockOpsContext) -> u32 {
    // SAFETY: as `state`; 0 for a socket that is not full.
    unsafe { core::ptr::read_volatile(&(*ctx.ops).segs_in) }
}

/// The watched backend of the context's socket, and its frontend.
#[inline(always)]
fn watched(ctx: &SockOpsContext) -> Option<(u32, lb_common::ServiceKey)> {
    // SAFETY: plain helper call on the program's own context.
    let cookie = unsafe { bpf_get_socket_cookie(ctx.as_ptr()) };
    sock::watched_backend(cookie)
}

/// Runs `f` on backend `id`'s health under its lock. Only loads and
/// stores of the element may happen inside (the verifier's rule).
#[inline(always)]
fn locked<T>(health: *mut BackendHealth, f: impl FnOnce(&mut BackendHealth) -> T) -> T {
    // SAFETY: a valid element of `LB_BACKEND_HEALTH`, changed only under
    // its lock (or whole by the agent, with `BPF_F_LOCK`).
    unsafe {
        let lock = (&raw mut (*health).lock).cast();
        bpf_spin_lock(lock);
        let out = f(&mut *health);
        bpf_spin_unlock(lock);
        out
    }
}

/// A connect to backend `id` was answered (the socket path: established;
/// the tc path: the backend's SYN-ACK): the series ends.
#[inline(always)]
pub fn succeeded(id: u32) {
    let Some(health) = LB_BACKEND_HEALTH.get_ptr_mut(id) else {
        return;
    };
    // SAFETY: a valid element; two words read without the lock, so that a
    // healthy backend's connects take none.
    if unsafe { (*health).in_series() } {
        locked(health, |h| h.succeeded());
    }
}

/// A watched connect of the context's socket failed (`reason`).
#[inline(always)]
fn failed(ctx: &SockOpsContext, reason: u32) {
    if let Some((id, key)) = watched(ctx) {
        connect_failed(&key, id, reason);
    }
}

/// A failed connect of the tc path, noted by `tc_ingress_flow` (where it
/// is seen) for `tc_ingress` to act on once that returns: the cap's scan
/// needs more stack than is left below `tc_ingress_flow`'s frame.
#[repr(C)]
pub struct FailedConnect {
    /// The frontend the connect came through.
    pub frontend: ServiceKey,
    pub backend_id: u32,
    /// `outlier::REFUSED` or `TIMEOUT`.
    pub reason: u32,
}

/// This CPU's noted failed connect (see `FailedConnect`): written and read
/// within one run of `tc_ingress`.
#[btf_map]
static LB_TC_FAILED_CONNECT: PerCpuArray<FailedConnect, 1> = PerCpuArray::new();

/// Notes that a connect to backend `id` through the tc path's frontend
/// `addr`:`port`/`proto` failed (`reason`), its flow `ct_flags::WATCHED`
/// (its frontend detected outliers when the flow began). False if it
/// could not be noted; else the caller's run must end in
/// `tc_failed_connect`.
#[inline(always)]
pub fn note_tc_failure(addr: &[u8; 16], port: u16, proto: u8, id: u32, reason: u32) -> bool {
    let Some(noted) = this_cpu(&LB_TC_FAILED_CONNECT) else {
        return false;
    };
    noted.frontend = ServiceKey {
        addr: *addr,
        port,
        proto,
        scope: scope::EXTERNAL,
    };
    noted.backend_id = id;
    noted.reason = reason;
    true
}

/// The failed connect `note_tc_failure` noted in this run: counted, and
/// its backend quarantined once due, within the frontend's cap, as on the
/// socket path (`connect_failed`). A global function, which the verifier
/// checks once on its own rather than along each of the tc path's many
/// paths, where the cap's scan of the frontend's backends
/// (`lb::ejection_allowed`) passed its budget; called from the small
/// frames of `tc_ingress` and `tc_egress`.
#[no_mangle]
#[inline(never)]
pub extern "C" fn tc_failed_connect() -> i32 {
    if let Some(noted) = this_cpu(&LB_TC_FAILED_CONNECT) {
        connect_failed(&noted.frontend, noted.backend_id, noted.reason);
    }
    0
}

/// A connect to backend `id` through frontend `key` failed (`reason`,
/// `outlier::REFUSED`, `TIMEOUT` or `UNREACHABLE`): counted, and the
/// backend quarantined once due, unless that would pass the frontend's
/// cap (`lb::ejection_allowed`).
#[inline(never)]
pub fn connect_failed(key: &ServiceKey, id: u32, reason: u32) {
    count_reason(reason);
    // The frontend as it is now: the Service may have turned detection
    // off since the connect.
    let Frontend::Served(svc) = lb::lookup_frontend(key, false) else {
        return;
    };
    if svc.flags & service_flags::OUTLIER_DETECT == 0 {
        return;
    }
    let Some(now) = failure_due(id) else {
        return;
    };
    let Some(config) = LB_TC_CONFIG.get(0) else {
        return;
    };
    if !lb::ejection_allowed(&svc, id, now, config.outlier_max_percent) {
        count(stat::EJECTION_CAPPED);
        return;
    }
    eject(id, reason, now);
}

#[inline(always)]
fn count_reason(reason: u32) {
    count(match reason {
        outlier::REFUSED => stat::CONNECT_REFUSED,
        outlier::TIMEOUT => stat::CONNECT_TIMED_OUT,
        _ => stat::CONNECT_UNREACHABLE,
    });
}

/// Counts a failure of backend `id`; the clock if it is due for
/// quarantine (`BackendHealth::count_failure`).
#[inline(always)]
fn failure_due(id: u32) -> Option<u64> {
    let (Some(health), Some(config)) = (LB_BACKEND_HEALTH.get_ptr_mut(id), LB_TC_CONFIG.get(0))
    else {
        return None;
    };
    // SAFETY: plain helper call.
    let now = unsafe { bpf_ktime_get_ns() };
    let threshold = config.outlier_failures;
    locked(health, |h| h.count_failure(now, threshold)).then_some(now)
}

/// Quarantines backend `id` from `now` (`BackendHealth::eject`).
#[inline(always)]
fn eject(id: u32, reason: u32, now: u64) {
    let (Some(health), Some(config)) = (LB_BACKEND_HEALTH.get_ptr_mut(id), LB_TC_CONFIG.get(0))
    else {
        return;
    };
    let (base_ns, max_ns) = (
        config.outlier_base_ms as u64 * 1_000_000,
        config.outlier_max_ms as u64 * 1_000_000,
    );
    if locked(health, |h| h.eject(now, reason, base_ns, max_ns)) {
        count(match reason {
            outlier::REFUSED => stat::EJECTED_REFUSED,
            outlier::TIMEOUT => stat::EJECTED_TIMEOUT,
            _ => stat::EJECTED_UNREACHABLE,
        });
    }
}
