//! What this kernel supports, probed the way `bpftool feature probe` and
//! Cilium do: by asking the kernel for the thing itself, in a throwaway
//! way, not by reading its version.
use std::{
    io,
    os::fd::{FromRawFd as _, OwnedFd},
};

/// `BPF_PROG_LOAD`, `BPF_LINK_CREATE` (uapi `enum bpf_cmd`).
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_LINK_CREATE: libc::c_long = 28;
/// uapi `BPF_PROG_TYPE_SCHED_CLS`.
const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
/// uapi `BPF_TCX_INGRESS` (Linux 6.6).
const BPF_TCX_INGRESS: u32 = 46;

/// The leading fields of `bpf_attr` for `BPF_PROG_LOAD`.
#[repr(C)]
#[derive(Default)]
struct ProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
}

/// The leading fields of `bpf_attr` for `BPF_LINK_CREATE` (its `tcx`
/// member: relative_fd, expected_revision), padded to 8 bytes.
#[repr(C)]
#[derive(Default)]
struct LinkCreateAttr {
    prog_fd: u32,
    target_ifindex: u32,
    attach_type: u32,
    flags: u32,
    relative_fd: u32,
    _pad: u32,
    expected_revision: u64,
}

fn bpf<T>(cmd: libc::c_long, attr: &T) -> io::Result<OwnedFd> {
    // SAFETY: `attr` is a `bpf_attr` prefix of the size we pass; the kernel
    // reads no further and zero-fills the rest.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *const T,
            std::mem::size_of::<T>() as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a new file descriptor the kernel just returned, owned here.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Whether this kernel has TCX links (`BPF_LINK_CREATE` with
/// `BPF_TCX_INGRESS`, Linux 6.6). Probed as cilium/ebpf's `haveTCX` does:
/// a two-instruction classifier linked to an interface index no device
/// has, so nothing is ever attached: a kernel with TCX says "no such
/// device" (`ENODEV`), one without says `EINVAL`. `Err` if the probe
/// itself could not run (no permission to load a program, say).
pub fn probe_tcx() -> io::Result<bool> {
    // r0 = 0 (TC_ACT_OK); exit.
    let insns: [u64; 2] = [0xb7, 0x95];
    let license = c"GPL";
    let prog = bpf(
        BPF_PROG_LOAD,
        &ProgLoadAttr {
            prog_type: BPF_PROG_TYPE_SCHED_CLS,
            insn_cnt: insns.len() as u32,
            insns: insns.as_ptr() as u64,
            license: license.as_ptr() as u64,
            ..Default::default()
        },
    )?;
    let link = bpf(
        BPF_LINK_CREATE,
        &LinkCreateAttr {
            prog_fd: std::os::fd::AsRawFd::as_raw_fd(&prog) as u32,
            target_ifindex: u32::MAX,
            attach_type: BPF_TCX_INGRESS,
            ..Default::default()
        },
    );
    match link {
        Err(e) if e.raw_os_error() == Some(libc::ENODEV) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
        Err(e) => Err(e),
        // Attached to a device with that index after all: still a yes,
        // and the link goes with its file descriptor.
        Ok(_link) => Ok(true),
    }
}

/// Whether the tc programs can attach through TCX links: the probe, or
/// where it cannot run, the kernel version (TCX came with 6.6).
pub fn tcx_supported() -> bool {
    probe_tcx().unwrap_or_else(|e| {
        let by_version = kernel_has_tcx();
        tracing::warn!("probing for TCX links: {e}; going by the kernel version: {by_version}");
        by_version
    })
}

/// TCX came with Linux 6.6.
fn kernel_has_tcx() -> bool {
    use aya::util::KernelVersion;
    KernelVersion::current().is_ok_and(|v| v >= KernelVersion::new(6, 6, 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The probe agrees with the kernel version on a kernel that has
    /// neither backports nor a TCX-less build: this one, where it runs.
    #[test]
    fn the_tcx_probe_answers_and_agrees_with_the_kernel_version() {
        // SAFETY: no arguments, no side effects.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: loading a program needs root");
            return;
        }
        let probed = probe_tcx().expect("the probe runs as root");
        assert_eq!(probed, kernel_has_tcx());
    }
}
