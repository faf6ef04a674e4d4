//! The measurement floor of a program's cost: an empty connect4 program
//! (`r0 = 1; exit`) attached beside ours for the cost run, so that what
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

impl FloorProgram {
    pub fn attach(cgroup: &Path) -> Result<FloorProgram> {
        // mov64 r0, 1; exit
        let insns: [u8; 16] = [
            0xb7, 0, 0, 0, 1, 0, 0, 0, //
            0x95, 0, 0, 0, 0, 0, 0, 0,
        ];
        let license = b"GPL\0";
        let mut attr = [0u8; 128];
        put_u32(&mut attr, 0, BPF_PROG_TYPE_CGROUP_SOCK_ADDR);
        put_u32(&mut attr, 4, 2);
        put_u64(&mut attr, 8, insns.as_ptr() as u64);
        put_u64(&mut attr, 16, license.as_ptr() as u64);
        attr[48..53].copy_from_slice(b"floor");
        put_u32(&mut attr, 68, BPF_CGROUP_INET4_CONNECT);
        let fd = bpf(BPF_PROG_LOAD, &mut attr).context("loading the empty connect4 program")?;
        // SAFETY: a fresh fd the kernel gave us.
        let prog = unsafe { OwnedFd::from_raw_fd(fd as i32) };

        let mut info = [0u8; 256];
        let mut attr = [0u8; 16];
        put_u32(&mut attr, 0, prog.as_raw_fd() as u32);
        put_u32(&mut attr, 4, info.len() as u32);
        put_u64(&mut attr, 8, info.as_mut_ptr() as u64);
        bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr).context("reading the empty program's id")?;
        let id = u32::from_ne_bytes(info[4..8].try_into().expect("4 bytes"));
        if id == 0 {
            bail!("the empty program has no id");
        }

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
