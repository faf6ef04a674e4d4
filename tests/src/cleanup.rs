//! Teardown that happens exactly once: when its guard is dropped (also while
//! a test unwinds from a panic), or earlier through [`run_all`] (the demo's
//! Ctrl-C handler), whichever comes first.
//!
//! Every guard of this crate (topology, cgroup, agent) registers a closure
//! that owns what it needs to undo its work; the guard keeps a
//! [`CleanupHandle`] whose drop runs the closure if nobody ran it before.
//!
//! [`sweep_stale`] removes what a killed earlier run left behind: every name
//! this crate makes starts with `lbt{pid}x`, and a resource whose pid is no
//! longer alive is an orphan.
use std::{
    path::Path,
    sync::{
        atomic::{AtomicU64, Ordering},
        Mutex, Once, RwLock,
    },
};

type Action = Box<dyn FnOnce() + Send + 'static>;

struct Entry {
    id: u64,
    what: String,
    action: Action,
}

static REGISTRY: Mutex<Vec<Entry>> = Mutex::new(Vec::new());
static NEXT_ID: AtomicU64 = AtomicU64::new(1);
/// Held shared while one action runs, exclusively by [`run_all`]: a signal
/// handler's `run_all` waits for a teardown in progress on another thread
/// and blocks the others until it is done, so the process does not exit
/// (from the handler or from `main`) halfway through a teardown.
static RUNNING: RwLock<()> = RwLock::new(());

fn registry() -> std::sync::MutexGuard<'static, Vec<Entry>> {
    REGISTRY.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs its registered action when dropped, unless it already ran.
#[must_use = "dropping the handle runs the cleanup at once"]
pub struct CleanupHandle {
    id: u64,
}

impl CleanupHandle {
    /// Runs the action now (idempotent).
    pub fn run(&self) {
        run_one(self.id);
    }
}

impl Drop for CleanupHandle {
    fn drop(&mut self) {
        run_one(self.id);
    }
}

/// Registers `action` (described by `what`, for messages).
pub fn register(what: impl Into<String>, action: impl FnOnce() + Send + 'static) -> CleanupHandle {
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    registry().push(Entry {
        id,
        what: what.into(),
        action: Box::new(action),
    });
    CleanupHandle { id }
}

fn run_one(id: u64) {
    let _running = RUNNING.read().unwrap_or_else(|e| e.into_inner());
    let entry = {
        let mut reg = registry();
        reg.iter().position(|e| e.id == id).map(|i| reg.remove(i))
    };
    if let Some(entry) = entry {
        (entry.action)();
    }
}

/// On Ctrl-C (and SIGTERM): `first()`, `message` on stderr, every pending
/// action ([`run_all`]), then exit 130.
pub fn teardown_on_ctrl_c(
    message: &'static str,
    first: impl Fn() + Send + 'static,
) -> Result<(), ctrlc::Error> {
    ctrlc::set_handler(move || {
        first();
        eprintln!("{message}");
        run_all();
        std::process::exit(130);
    })
}

/// Runs every pending action, newest first (the reverse of creation, so an
/// agent is stopped before its cgroup goes). For a signal handler.
pub fn run_all() {
    let _running = RUNNING.write().unwrap_or_else(|e| e.into_inner());
    loop {
        let entry = registry().pop();
        match entry {
            Some(entry) => {
                eprintln!("cleanup: {}", entry.what);
                (entry.action)();
            }
            None => break,
        }
    }
}

/// The pid that a name made by [`crate::unique_name`] embeds.
fn owner_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix("lbt")?;
    let end = rest.find('x')?;
    rest[..end].parse().ok()
}

fn orphaned(name: &str) -> bool {
    match owner_pid(name) {
        Some(pid) => pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists(),
        None => false,
    }
}

/// Removes network namespaces, cgroups and bpffs directories made by a run of
/// this crate whose process is gone (killed before its guards ran). Runs once
/// per process; errors are reported, never fatal.
pub fn sweep_stale() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        kill_stale_processes();
        if let Ok(out) = crate::cmd::run(std::process::Command::new("ip").args(["netns", "list"])) {
            for line in out.lines() {
                let name = line.split_whitespace().next().unwrap_or("");
                if orphaned(name) {
                    eprintln!("sweeping stale network namespace {name}");
                    crate::netns::delete_netns(name);
                }
            }
        }
        if let Ok(root) = crate::cgroup::cgroup2_root() {
            if let Ok(dir) = std::fs::read_dir(&root) {
                for e in dir.flatten() {
                    let name = e.file_name().to_string_lossy().into_owned();
                    if orphaned(&name) {
                        eprintln!("sweeping stale cgroup {}", e.path().display());
                        crate::cgroup::remove_cgroup(&e.path());
                    }
                }
            }
        }
        // Temporary directories (manifests, agent logs) of `Env`.
        if let Ok(dir) = std::fs::read_dir(std::env::temp_dir()) {
            for e in dir.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if orphaned(&name) && e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
        if let Ok(dir) = std::fs::read_dir(crate::agent::BPFFS_ROOT) {
            for e in dir.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                if orphaned(&name) {
                    eprintln!("sweeping stale bpffs directory {}", e.path().display());
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
    });
}

/// Whether an argument names a resource of a dead run (a path component or
/// a whole argument that is one of our names).
fn names_orphan(arg: &str) -> bool {
    arg.split(['/', '=', ' ']).any(orphaned)
}

/// Kills processes whose command line names a resource of a dead run: an
/// agent (`--bpffs /sys/fs/bpf/lbt…`), a server or client (`--netns lbt…`).
fn kill_stale_processes() {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return;
    };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if args.iter().any(|a| names_orphan(a)) {
            eprintln!("sweeping stale process {pid}: {}", args.join(" ").trim());
            crate::cmd::signal(pid, libc::SIGKILL);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_pid_parses_our_names() {
        assert_eq!(owner_pid("lbt1234x7-c"), Some(1234));
        assert_eq!(owner_pid("lbtx7"), None);
        assert_eq!(owner_pid("lb-demo"), None);
        assert_eq!(owner_pid("other"), None);
        // pid 0 never names a live process here.
        assert!(names_orphan("/sys/fs/bpf/lbt0x3-pins"));
        assert!(names_orphan("lbt0x1-tcp-client"));
        assert!(!names_orphan(&format!("lbt{}x1-a", std::process::id())));
        assert!(!names_orphan("--netns"));
    }

    #[test]
    fn actions_run_once() {
        use std::sync::{atomic::AtomicUsize, Arc};
        let n = Arc::new(AtomicUsize::new(0));
        let n2 = n.clone();
        let h = register("count", move || {
            n2.fetch_add(1, Ordering::SeqCst);
        });
        h.run();
        h.run();
        drop(h);
        assert_eq!(n.load(Ordering::SeqCst), 1);
    }
}
