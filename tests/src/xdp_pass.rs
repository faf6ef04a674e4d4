//! An XDP program that passes every frame, for the veth peers of devices
//! the XDP stage sends frames out of with `XDP_TX`: veth schedules the
//! peer's receive of those frames only when the peer runs an XDP program
//! itself (with GRO alone they wait in its ring for the next packet sent
//! the ordinary way). Two instructions, loaded with bpf(2): no object file.
use std::{
    ffi::CString,
    os::fd::{FromRawFd as _, OwnedFd},
    path::{Path, PathBuf},
};

use anyhow::{bail, Result};

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_PROG_TYPE_XDP: u32 = 6;

/// The program, pinned at a path of its own until dropped (`ip link set
/// ... xdpdrv pinned PATH` attaches it; the devices hold it from then on).
pub struct XdpPass {
    _fd: OwnedFd,
    pin: PathBuf,
}

impl Drop for XdpPass {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.pin);
    }
}

fn bpf(cmd: libc::c_long, attr: &mut [u8; 128]) -> libc::c_long {
    // SAFETY: a zero-padded bpf_attr of the size passed, whose pointers
    // point at memory that outlives the call.
    unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), attr.len()) }
}

impl XdpPass {
    /// Loads the program and pins it at `pin` (on bpffs).
    pub fn load(pin: &Path) -> Result<Self> {
        // r0 = XDP_PASS (2); exit.
        let insns: [u64; 2] = [
            u64::from_le_bytes([0xb7, 0, 0, 0, 2, 0, 0, 0]),
            u64::from_le_bytes([0x95, 0, 0, 0, 0, 0, 0, 0]),
        ];
        let license = c"GPL";
        let mut attr = [0u8; 128];
        attr[0..4].copy_from_slice(&BPF_PROG_TYPE_XDP.to_ne_bytes());
        attr[4..8].copy_from_slice(&(insns.len() as u32).to_ne_bytes());
        attr[8..16].copy_from_slice(&(insns.as_ptr() as u64).to_ne_bytes());
        attr[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
        let fd = bpf(BPF_PROG_LOAD, &mut attr);
        if fd < 0 {
            bail!(
                "loading an XDP pass program: {}",
                std::io::Error::last_os_error()
            );
        }
        // SAFETY: a new descriptor, owned from here on.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        let _ = std::fs::remove_file(pin);
        let path = CString::new(pin.as_os_str().as_encoded_bytes())?;
        let mut attr = [0u8; 128];
        attr[0..8].copy_from_slice(&(path.as_ptr() as u64).to_ne_bytes());
        attr[8..12].copy_from_slice(&(std::os::fd::AsRawFd::as_raw_fd(&fd) as u32).to_ne_bytes());
        if bpf(BPF_OBJ_PIN, &mut attr) < 0 {
            bail!(
                "pinning it at {}: {}",
                pin.display(),
                std::io::Error::last_os_error()
            );
        }
        Ok(XdpPass {
            _fd: fd,
            pin: pin.to_path_buf(),
        })
    }

    /// Attaches it in native mode to `dev` in network namespace `netns`
    /// (through nsenter: `ip -n` mounts another /sys, without bpffs).
    pub fn attach(&self, netns: &str, dev: &str) -> Result<()> {
        let mut c = std::process::Command::new("nsenter");
        c.arg(format!("--net=/run/netns/{netns}"))
            .args(["ip", "link", "set", "dev", dev, "xdpdrv", "pinned"])
            .arg(&self.pin);
        crate::cmd::run(&mut c).map(|_| ())
    }
}
