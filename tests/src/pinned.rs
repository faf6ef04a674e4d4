//! A pinned map of the agent, opened with the bare `bpf(2)` calls: for
//! stress tests that rewrite its values from outside the agent, faster
//! than `bpftool` (one process per update) could.
use std::{
    ffi::CString,
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    path::Path,
};

use anyhow::{Context as _, Result};

const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
/// Update only an element that exists.
pub const BPF_EXIST: u64 = 2;

/// `union bpf_attr`, as large as any command here needs (the kernel
/// accepts a larger one if the rest is zero).
#[repr(C)]
#[derive(Default)]
struct Attr {
    words: [u64; 8],
}

fn bpf(cmd: libc::c_long, attr: &mut Attr) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a zero-padded bpf_attr of the size passed; every
    // pointer in it points at memory of the map's key or value size.
    let r = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut Attr,
            std::mem::size_of::<Attr>(),
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// A map's (key, value) pairs as raw bytes.
pub type Entries = Vec<(Vec<u8>, Vec<u8>)>;

/// An open pinned map and its key and value sizes.
pub struct PinnedMap {
    fd: OwnedFd,
    pub key_size: usize,
    pub value_size: usize,
}

impl PinnedMap {
    pub fn open(path: &Path) -> Result<Self> {
        let c = CString::new(path.as_os_str().as_encoded_bytes())?;
        let mut attr = Attr::default();
        attr.words[0] = c.as_ptr() as u64;
        let fd =
            bpf(BPF_OBJ_GET, &mut attr).with_context(|| format!("opening {}", path.display()))?;
        // SAFETY: BPF_OBJ_GET returned a new descriptor that we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        // struct bpf_map_info: type, id, key_size, value_size, ...
        let mut info = [0u32; 32];
        let mut attr = Attr::default();
        attr.words[0] = fd.as_raw_fd() as u64 | ((std::mem::size_of_val(&info) as u64) << 32);
        attr.words[1] = info.as_mut_ptr() as u64;
        bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)
            .with_context(|| format!("map info of {}", path.display()))?;
        Ok(Self {
            fd,
            key_size: info[2] as usize,
            value_size: info[3] as usize,
        })
    }

    fn elem_attr(&self, key: &[u8], value: *mut u8, flags: u64) -> Attr {
        let mut attr = Attr::default();
        attr.words[0] = self.fd.as_raw_fd() as u64;
        attr.words[1] = key.as_ptr() as u64;
        attr.words[2] = value as u64;
        attr.words[3] = flags;
        attr
    }

    /// Every (key, value) of the map at one moment, as raw bytes.
    pub fn entries(&self) -> Result<Entries> {
        let mut out = Vec::new();
        let mut key: Option<Vec<u8>> = None;
        loop {
            let mut next = vec![0u8; self.key_size];
            let mut attr = Attr::default();
            attr.words[0] = self.fd.as_raw_fd() as u64;
            attr.words[1] = key.as_ref().map_or(0, |k| k.as_ptr() as u64);
            attr.words[2] = next.as_mut_ptr() as u64;
            match bpf(BPF_MAP_GET_NEXT_KEY, &mut attr) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(out),
                Err(e) => return Err(e).context("BPF_MAP_GET_NEXT_KEY"),
            }
            let mut value = vec![0u8; self.value_size];
            let mut attr = self.elem_attr(&next, value.as_mut_ptr(), 0);
            match bpf(BPF_MAP_LOOKUP_ELEM, &mut attr) {
                Ok(_) => out.push((next.clone(), value)),
                // Deleted since the key was listed.
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {}
                Err(e) => return Err(e).context("BPF_MAP_LOOKUP_ELEM"),
            }
            key = Some(next);
        }
    }

    /// `BPF_MAP_UPDATE_ELEM` of `key` with `value` under `flags`.
    pub fn update(&self, key: &[u8], value: &[u8], flags: u64) -> io::Result<()> {
        let mut attr = self.elem_attr(key, value.as_ptr() as *mut u8, flags);
        bpf(BPF_MAP_UPDATE_ELEM, &mut attr).map(drop)
    }
}
