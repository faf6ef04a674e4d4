//! The measurement floor of a program's cost: an empty program attached
//! beside ours for the cost run (connect4: `r0 = 1; exit` on the cgroup;
//! tc: `r0 = TCX_NEXT; exit` before ours on the device), so that what
//! `BPF_ENABLE_STATS` charges a program that does nothing (its own clock
//! reads, the call) is measured on the same connects as ours.
use std::{
    fs::File,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    path::Path,
};

use anyhow::{bail, Context as _, Result};

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_ATTACH: libc::c_long = 8;
const BPF_PROG_DETACH: libc::c_long = 9;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_PROG_TYPE_CGROUP_SOCK_ADDR: u32 = 18;
const BPF_CGROUP_INET4_CONNECT: u32 = 10;
const BPF_F_ALLOW_MULTI: u32 = 2;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_PROG_TYPE_SCHED_CLS: u32 = 3;
const BPF_TCX_INGRESS: u32 = 46;
const BPF_TCX_EGRESS: u32 = 47;
const BPF_F_BEFORE: u32 = 8;

/// An empty connect4 program attached to a cgroup; detached on drop.
pub struct FloorProgram {
    prog: OwnedFd,
    cgroup: File,
    pub id: u32,
}

fn bpf(cmd: libc::c_long, attr: &mut [u8]) -> std::io::Result<i64> {
    // SAFETY: `attr` is a zeroed bpf_attr of the size passed, filled for `cmd`.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr.as_mut_ptr() as *mut libc::c_void,
            attr.len() as libc::c_uint,
        )
    };
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn put_u32(attr: &mut [u8], at: usize, v: u32) {
    attr[at..at + 4].copy_from_slice(&v.to_ne_bytes());
}

fn put_u64(attr: &mut [u8], at: usize, v: u64) {
    attr[at..at + 8].copy_from_slice(&v.to_ne_bytes());
}

/// Loads `mov64 r0, r0_imm; exit` as a program of `prog_type` (with
/// `expected_attach_type`), and returns it with its id.
fn load_empty(
    prog_type: u32,
    expected_attach_type: u32,
    r0_imm: i32,
    what: &str,
) -> Result<(OwnedFd, u32)> {
    let imm = r0_imm.to_le_bytes();
    let insns: [u8; 16] = [
        0xb7, 0, 0, 0, imm[0], imm[1], imm[2], imm[3], //
        0x95, 0, 0, 0, 0, 0, 0, 0,
    ];
    let license = b"GPL\0";
    let mut attr = [0u8; 128];
    put_u32(&mut attr, 0, prog_type);
    put_u32(&mut attr, 4, 2);
    put_u64(&mut attr, 8, insns.as_ptr() as u64);
    put_u64(&mut attr, 16, license.as_ptr() as u64);
    attr[48..53].copy_from_slice(b"floor");
    put_u32(&mut attr, 68, expected_attach_type);
    let fd = bpf(BPF_PROG_LOAD, &mut attr).with_context(|| format!("loading the empty {what}"))?;
    // SAFETY: a fresh fd the kernel gave us.
    let prog = unsafe { OwnedFd::from_raw_fd(fd as i32) };

    let mut info = [0u8; 256];
    let mut attr = [0u8; 16];
    put_u32(&mut attr, 0, prog.as_raw_fd() as u32);
    put_u32(&mut attr, 4, info.len() as u32);
    put_u64(&mut attr, 8, info.as_mut_ptr() as u64);
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)
        .with_context(|| format!("reading the empty {what}'s id"))?;
    let id = u32::from_ne_bytes(info[4..8].try_into().expect("4 bytes"));
    if id == 0 {
        bail!("the empty {what} has no id");
    }
    Ok((prog, id))
}

impl FloorProgram {
    pub fn attach(cgroup: &Path) -> Result<FloorProgram> {
        let (prog, id) = load_empty(
            BPF_PROG_TYPE_CGROUP_SOCK_ADDR,
            BPF_CGROUP_INET4_CONNECT,
            1,
            "connect4 program",
        )?;

        let cgroup = File::open(cgroup).with_context(|| format!("opening {}", cgroup.display()))?;
        let mut attr = [0u8; 16];
        put_u32(&mut attr, 0, cgroup.as_raw_fd() as u32);
        put_u32(&mut attr, 4, prog.as_raw_fd() as u32);
        put_u32(&mut attr, 8, BPF_CGROUP_INET4_CONNECT);
        put_u32(&mut attr, 12, BPF_F_ALLOW_MULTI);
        bpf(BPF_PROG_ATTACH, &mut attr).context("attaching the empty connect4 program")?;
        Ok(FloorProgram { prog, cgroup, id })
    }
}

impl Drop for FloorProgram {
    fn drop(&mut self) {
        let mut attr = [0u8; 16];
        put_u32(&mut attr, 0, self.cgroup.as_raw_fd() as u32);
        put_u32(&mut attr, 4, self.prog.as_raw_fd() as u32);
        put_u32(&mut attr, 8, BPF_CGROUP_INET4_CONNECT);
        // The cgroup's removal at teardown detaches it too.
        let _ = bpf(BPF_PROG_DETACH, &mut attr);
    }
}

/// An empty tc program (`r0 = TCX_NEXT; exit`: the packet goes on to the
/// next program, ours) linked first on a device's ingress or egress with
/// TCX (Linux 6.6); the link goes with the value.
pub struct TcFloor {
    _link: OwnedFd,
    _prog: OwnedFd,
    pub id: u32,
}

impl TcFloor {
    /// Before every other program on `ifname` of the network namespace
    /// `netns` (a name under /run/netns), `ingress` or egress.
    pub fn attach(netns: &str, ifname: &str, ingress: bool) -> Result<TcFloor> {
        const TCX_NEXT: i32 = -1;
        let (prog, id) = load_empty(BPF_PROG_TYPE_SCHED_CLS, 0, TCX_NEXT, "tc program")?;
        let ns = File::open(Path::new("/run/netns").join(netns))
            .with_context(|| format!("opening network namespace {netns}"))?;
        let ifname = std::ffi::CString::new(ifname).context("device name")?;
        let prog_fd = prog.as_raw_fd() as u32;
        // The device is named in the namespace of the thread that links,
        // so a thread of its own enters it.
        let link = std::thread::scope(|s| {
            s.spawn(|| -> Result<OwnedFd> {
                // SAFETY: setns on this thread only, with an open namespace fd.
                if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                    return Err(std::io::Error::last_os_error())
                        .with_context(|| format!("entering network namespace {netns}"));
                }
                // SAFETY: a NUL-terminated name.
                let ifindex = unsafe { libc::if_nametoindex(ifname.as_ptr()) };
                if ifindex == 0 {
                    bail!("no device {ifname:?} in {netns}");
                }
                let mut attr = [0u8; 64];
                put_u32(&mut attr, 0, prog_fd);
                put_u32(&mut attr, 4, ifindex);
                put_u32(
                    &mut attr,
                    8,
                    if ingress {
                        BPF_TCX_INGRESS
                    } else {
                        BPF_TCX_EGRESS
                    },
                );
                put_u32(&mut attr, 12, BPF_F_BEFORE);
                let fd = bpf(BPF_LINK_CREATE, &mut attr)
                    .context("linking the empty tc program (TCX, Linux 6.6)")?;
                // SAFETY: a fresh fd the kernel gave us.
                Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
            })
            .join()
            .map_err(|_| anyhow::anyhow!("the linking thread panicked"))?
        })?;
        Ok(TcFloor {
            _link: link,
            _prog: prog,
            id,
        })
    }
}
