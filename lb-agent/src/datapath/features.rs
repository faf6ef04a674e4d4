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
/// uapi `BPF_PROG_TYPE_SCHED_CLS`, `BPF_PROG_TYPE_CGROUP_SOCK_ADDR`.
const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
const BPF_PROG_TYPE_CGROUP_SOCK_ADDR: u32 = 18;
/// uapi `BPF_CGROUP_INET4_CONNECT`.
const BPF_CGROUP_INET4_CONNECT: u32 = 10;
/// uapi `BPF_FUNC_set_retval`.
const BPF_FUNC_SET_RETVAL: u64 = 187;
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
    prog_name: [u8; 16],
    prog_ifindex: u32,
    expected_attach_type: u32,
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

/// Whether the verifier accepts `prog` (instructions) as a connect4
/// program: `Ok(false)` when it refuses it (`EINVAL`).
fn sock_addr_program_loads(prog: &[u64]) -> io::Result<bool> {
    let license = c"GPL";
    let loaded = bpf(
        BPF_PROG_LOAD,
        &ProgLoadAttr {
            prog_type: BPF_PROG_TYPE_CGROUP_SOCK_ADDR,
            expected_attach_type: BPF_CGROUP_INET4_CONNECT,
            insn_cnt: prog.len() as u32,
            insns: prog.as_ptr() as u64,
            license: license.as_ptr() as u64,
            ..Default::default()
        },
    );
    match loaded {
        Ok(_prog) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Whether cgroup sock_addr programs may call `bpf_set_retval` (Linux
/// 6.1), which lets them refuse a connect with `ECONNREFUSED` rather than
/// the hook's own `EPERM`. Probed as `bpftool feature probe` does: a
/// connect4 program that calls it, which the verifier refuses ("unknown
/// func") where the helper is missing; the same program without the call
/// must load, or the probe says nothing (`Err`).
pub fn probe_set_retval_sock_addr() -> io::Result<bool> {
    // r0 = 1 (proceed); exit.
    let plain: [u64; 2] = [(1 << 32) | 0xb7, 0x95];
    // r1 = 0; call bpf_set_retval; r0 = 1; exit.
    let with_call: [u64; 4] = [
        0x01b7,
        (BPF_FUNC_SET_RETVAL << 32) | 0x85,
        plain[0],
        plain[1],
    ];
    if !sock_addr_program_loads(&plain)? {
        return Err(io::Error::other(
            "the kernel refuses even an empty cgroup sock_addr program",
        ));
    }
    sock_addr_program_loads(&with_call)
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

    /// As above for `bpf_set_retval` in sock_addr programs (Linux 6.1).
    #[test]
    fn the_set_retval_probe_answers_and_agrees_with_the_kernel_version() {
        // SAFETY: no arguments, no side effects.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: loading a program needs root");
            return;
        }
        let probed = probe_set_retval_sock_addr().expect("the probe runs as root");
        assert_eq!(probed, kernel_is_at_least(6, 1));
    }
}

/// What this kernel offers the datapath, as probed at start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelFeatures {
    /// `uname -r`.
    pub release: String,
    /// `bpf_set_retval` in cgroup sock_addr programs (Linux 6.1): refusals
    /// are `ECONNREFUSED`; without it, `EPERM`.
    pub set_retval_sock_addr: bool,
    /// TCX links for the tc programs (Linux 6.6).
    pub tcx: bool,
    /// Kernel BTF (`/sys/kernel/btf/vmlinux`), which aya needs to load the
    /// object's maps and programs.
    pub btf: bool,
}

impl KernelFeatures {
    /// Probes this kernel; a probe that cannot run falls back to the kernel
    /// version, with a warning.
    pub fn probe() -> Self {
        let set_retval_sock_addr = probe_set_retval_sock_addr().unwrap_or_else(|e| {
            let by_version = kernel_is_at_least(6, 1);
            tracing::warn!(
                "probing for bpf_set_retval in sock_addr programs: {e}; going by the kernel version: {by_version}"
            );
            by_version
        });
        Self {
            release: kernel_release(),
            set_retval_sock_addr,
            tcx: tcx_supported(),
            btf: std::path::Path::new("/sys/kernel/btf/vmlinux").exists(),
        }
    }

    /// Each feature by the name `lb_kernel_feature` and `lb-agent check`
    /// give it.
    pub fn by_name(&self) -> [(&'static str, bool); 3] {
        [
            ("btf", self.btf),
            ("set_retval_sock_addr", self.set_retval_sock_addr),
            ("tcx", self.tcx),
        ]
    }
}

fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|e| format!("unknown ({e})"))
}

fn kernel_is_at_least(major: u8, minor: u8) -> bool {
    use aya::util::KernelVersion;
    KernelVersion::current().is_ok_and(|v| v >= KernelVersion::new(major, minor, 0))
}
