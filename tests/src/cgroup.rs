//! A child cgroup (v2) for the clients of one test: the agent attaches its
//! socket programs there, never to the root.
use std::{
    io::ErrorKind,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};

use crate::cleanup::{self, CleanupHandle};

/// Where the cgroup v2 hierarchy is mounted, from `/proc/mounts` (fstype
/// `cgroup2`): `/sys/fs/cgroup` on a unified host, `/sys/fs/cgroup/unified`
/// on a hybrid one.
pub fn cgroup2_root() -> Result<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/mounts").context("reading /proc/mounts")?;
    for line in mounts.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() >= 3 && f[2] == "cgroup2" {
            return Ok(PathBuf::from(unescape_mount_path(f[1])));
        }
    }
    bail!("no cgroup2 file system in /proc/mounts")
}

/// `/proc/mounts` writes space, tab, newline and backslash as `\ooo`.
fn unescape_mount_path(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The pids in a cgroup's `cgroup.procs`.
pub fn procs(path: &Path) -> Vec<u32> {
    std::fs::read_to_string(path.join("cgroup.procs"))
        .map(|s| s.lines().filter_map(|l| l.trim().parse().ok()).collect())
        .unwrap_or_default()
}

/// Kills whatever is left in the cgroup (and its children) and removes it,
/// retrying while the kernel still counts dying members. Best effort.
pub fn remove_cgroup(path: &Path) {
    if let Ok(dir) = std::fs::read_dir(path) {
        for e in dir.flatten() {
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                remove_cgroup(&e.path());
            }
        }
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        // cgroup.kill (Linux 5.14+) kills every member at once.
        let _ = std::fs::write(path.join("cgroup.kill"), "1");
        for pid in procs(path) {
            crate::cmd::signal(pid, libc::SIGKILL);
        }
        match std::fs::remove_dir(path) {
            Ok(()) => return,
            Err(e) if e.kind() == ErrorKind::NotFound => return,
            Err(e) => {
                if Instant::now() > deadline {
                    eprintln!("warning: cannot remove cgroup {}: {e}", path.display());
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// A child cgroup of the cgroup v2 root, removed on drop.
pub struct CgroupGuard {
    path: PathBuf,
    _cleanup: CleanupHandle,
}

impl CgroupGuard {
    /// Creates `<cgroup2 root>/lbt{pid}x{n}-{name}`.
    pub fn create(name: &str) -> Result<Self> {
        cleanup::sweep_stale();
        let path = cgroup2_root()?.join(crate::unique_name(name));
        std::fs::create_dir(&path)
            .with_context(|| format!("creating cgroup {}", path.display()))?;
        let p = path.clone();
        let handle = cleanup::register(format!("remove cgroup {}", path.display()), move || {
            remove_cgroup(&p)
        });
        Ok(Self {
            path,
            _cleanup: handle,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The pids currently in the cgroup.
    pub fn procs(&self) -> Vec<u32> {
        procs(&self.path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unescapes_mount_paths() {
        assert_eq!(unescape_mount_path(r"/a\040b"), "/a b");
        assert_eq!(unescape_mount_path("/sys/fs/cgroup"), "/sys/fs/cgroup");
        assert_eq!(unescape_mount_path(r"/x\"), r"/x\");
    }
}
