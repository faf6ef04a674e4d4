//! Running `lb-agent run` for a test: unique pin directory, free health
//! and metrics ports, logs in a file, readiness through `GET /readyz`,
//! SIGTERM on drop.
use std::{
    ffi::OsString,
    io::{Read as _, Seek as _, SeekFrom, Write as _},
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context as _, Result};

use crate::{
    cleanup::{self, CleanupHandle},
    cmd,
};

/// Where bpffs is mounted; pin directories go below it.
pub const BPFFS_ROOT: &str = "/sys/fs/bpf";

/// Mounts bpffs at [`BPFFS_ROOT`] unless it is mounted already (the agent
/// pins there). The mount is left in place: it is the standard one.
pub fn ensure_bpffs() -> Result<()> {
    let mounts = std::fs::read_to_string("/proc/mounts").context("reading /proc/mounts")?;
    let mounted = mounts.lines().any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.len() >= 3 && f[1] == BPFFS_ROOT && f[2] == "bpf"
    });
    if !mounted {
        eprintln!("note: mounting bpffs at {BPFFS_ROOT}");
        cmd::run(Command::new("mount").args(["-t", "bpf", "bpf", BPFFS_ROOT]))?;
    }
    Ok(())
}

/// A free TCP port on 127.0.0.1 (free when asked; good enough for tests).
pub fn free_port() -> Result<u16> {
    // The kernel may give a port it gave before once that listener is
    // closed (two picks in a row, or two tests at once): never hand out
    // the same port twice in this process, or two servers of one agent
    // (health and metrics) would share it.
    static GIVEN: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    for _ in 0..1000 {
        let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).context("binding 127.0.0.1:0")?;
        let port = l.local_addr()?.port();
        if given.insert(port) {
            return Ok(port);
        }
    }
    bail!("no port this process has not handed out already")
}

/// A plain HTTP/1.0 GET; the status code and the body.
pub fn http_get(addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(500))?;
    s.set_read_timeout(Some(Duration::from_secs(2)))?;
    s.set_write_timeout(Some(Duration::from_secs(2)))?;
    write!(
        s,
        "GET {path} HTTP/1.0\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut resp = Vec::new();
    s.read_to_end(&mut resp)?;
    let resp = String::from_utf8_lossy(&resp);
    let status_line = resp.lines().next().unwrap_or("");
    let code = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| anyhow!("bad HTTP response {status_line:?}"))?;
    let body = resp.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    Ok((code, body.to_string()))
}

/// Options of [`Agent::start`].
#[derive(Debug, Clone)]
pub struct AgentOpts {
    pub node_name: String,
    /// Default: a unique `/sys/fs/bpf/lbt{pid}x{n}-pins`.
    pub pin_dir: Option<PathBuf>,
    /// Default: `agent-{n}.log` beside the manifests directory.
    pub log_file: Option<PathBuf>,
    pub ready_timeout: Duration,
    /// More arguments for `lb-agent run`.
    pub extra_args: Vec<String>,
    /// Run the agent in this network namespace (`ip netns` name), through
    /// `nsenter --net` (not `ip netns exec`, which remounts /sys and hides
    /// the cgroups and bpffs). Its health address is then reached from
    /// inside that namespace.
    pub netns: Option<String>,
    /// Return once started, without waiting for `/readyz` (for agents
    /// that are expected not to become ready).
    pub no_ready_wait: bool,
    /// Run the agent with only these capabilities (names as in a Pod's
    /// `securityContext.capabilities.add`, e.g. `NET_ADMIN`), through
    /// `setpriv --bounding-set`, as a container runtime grants them.
    pub capabilities: Option<Vec<String>>,
    /// Start the agent with this soft open-file limit (the hard one as
    /// ours), as a login shell's `ulimit -n 1024` would.
    pub open_files_soft_limit: Option<u64>,
    /// Run the agent process itself in this cgroup v2 directory (one with
    /// a `memory.max`, as a container's limit), from before its exec: the
    /// BPF maps it creates are charged there.
    pub process_cgroup: Option<PathBuf>,
}

impl Default for AgentOpts {
    fn default() -> Self {
        Self {
            node_name: "node-1".into(),
            pin_dir: None,
            log_file: None,
            ready_timeout: default_ready_timeout(),
            extra_args: Vec::new(),
            netns: None,
            no_ready_wait: false,
            capabilities: None,
            open_files_soft_limit: None,
            process_cgroup: None,
        }
    }
}

/// How long a starting agent may take to be ready: 60 seconds, or
/// `LB_TEST_READY_TIMEOUT_S`: `cargo xtask kernels` runs the tests in VMs
/// without KVM, where verifying the programs alone takes longer than that.
/// Loading takes ~9 s of CPU on 6.18 since outlier detection (connect4,
/// connect6, sendmsg4 and sendmsg6 ~1.5 s each, lb_sock_ops 1.2 s), and a
/// cluster test starts three agents while another test starts its own on
/// the same two CPUs: 20 s was missed so.
pub fn default_ready_timeout() -> Duration {
    let secs = std::env::var("LB_TEST_READY_TIMEOUT_S")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    Duration::from_secs(secs)
}

/// Sends SIGTERM, waits up to `grace`, then SIGKILL. `None` if the child
/// had to be killed.
fn terminate(child: &mut Child, grace: Duration) -> Option<ExitStatus> {
    if let Ok(Some(st)) = child.try_wait() {
        return Some(st);
    }
    cmd::signal(child.id(), libc::SIGTERM);
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        if let Ok(Some(st)) = child.try_wait() {
            return Some(st);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

/// Where `lb-agent run` takes its objects from.
#[derive(Debug, Clone, Copy)]
pub enum Source<'a> {
    /// `--manifests DIR`
    Manifests(&'a Path),
    /// `--k8s-api-server URL`
    ApiServer(&'a str),
    /// `--kubeconfig PATH`
    Kubeconfig(&'a Path),
}

/// A plain HTTP/1.0 GET from inside network namespace `netns` (`None`:
/// this one), from a thread that enters it.
pub fn http_get_in(netns: Option<&str>, addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    let Some(ns) = netns else {
        return http_get(addr, path);
    };
    let path = path.to_owned();
    crate::netns::in_netns(ns, move || http_get(addr, &path))
        .map_err(|e| anyhow!("the HTTP thread: {e:#}"))?
}

/// `setpriv ... --`, to run what follows with only the capabilities
/// `caps` (names as in a Pod's `securityContext.capabilities.add`), as a
/// container runtime grants them.
pub fn setpriv(caps: &[String]) -> Vec<OsString> {
    let set: String = caps
        .iter()
        .map(|c| format!(",+{}", c.to_ascii_lowercase()))
        .collect();
    vec![
        "setpriv".into(),
        format!("--bounding-set=-all{set}").into(),
        "--inh-caps=-all".into(),
        "--".into(),
    ]
}

/// How the agent process is started: [`AgentOpts`]' fields of the same
/// names, kept for restarts.
#[derive(Debug, Clone, Default)]
struct Launch {
    netns: Option<String>,
    capabilities: Option<Vec<String>>,
    open_files_soft_limit: Option<u64>,
    process_cgroup: Option<PathBuf>,
}

/// Spawns `bin args...` as `launch` says (in a network namespace through
/// `nsenter`, ...), its output to `log_path` (appended to with `append`);
/// the child and its command line.
fn spawn(
    bin: &Path,
    args: &[OsString],
    log_path: &Path,
    append: bool,
    launch: &Launch,
) -> Result<(Child, String)> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .append(append)
        .truncate(!append)
        .open(log_path)
        .with_context(|| format!("creating {}", log_path.display()))?;
    // The command line: [nsenter --net=NS] [setpriv CAPS --] lb-agent ARGS.
    let mut argv: Vec<OsString> = Vec::new();
    if let Some(ns) = &launch.netns {
        argv.extend(["nsenter".into(), format!("--net=/run/netns/{ns}").into()]);
    }
    if let Some(caps) = &launch.capabilities {
        argv.extend(setpriv(caps));
    }
    argv.push(bin.into());
    let mut c = Command::new(&argv[0]);
    c.args(&argv[1..]);
    // Plain log lines in the log file.
    c.args(args).env("NO_COLOR", "1");
    let line = cmd::display(&c);
    if let Some(soft) = launch.open_files_soft_limit {
        use std::os::unix::process::CommandExt as _;
        // SAFETY: getrlimit and setrlimit are async-signal-safe.
        unsafe {
            c.pre_exec(move || {
                let mut lim = libc::rlimit {
                    rlim_cur: 0,
                    rlim_max: 0,
                };
                if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                lim.rlim_cur = soft.min(lim.rlim_max);
                if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    if let Some(cg) = &launch.process_cgroup {
        use std::os::unix::{ffi::OsStrExt as _, process::CommandExt as _};
        let procs = std::ffi::CString::new(cg.join("cgroup.procs").as_os_str().as_bytes())
            .context("a cgroup path with a NUL byte")?;
        // SAFETY: open, write and close are async-signal-safe; the path was
        // allocated before the fork.
        unsafe {
            c.pre_exec(move || {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // "0": the writing process itself.
                let n = libc::write(fd, b"0\n".as_ptr().cast(), 2);
                let err = std::io::Error::last_os_error();
                libc::close(fd);
                if n != 2 {
                    return Err(err);
                }
                Ok(())
            });
        }
    }
    let child = cmd::die_with_parent(&mut c, libc::SIGTERM)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .with_context(|| format!("cannot run `{line}`"))?;
    Ok((child, line))
}

/// A running `lb-agent run`; SIGTERM (then SIGKILL) and pin removal on drop.
pub struct Agent {
    bin: PathBuf,
    /// The arguments of `lb-agent`, for [`restart`](Self::restart).
    args: Vec<OsString>,
    pin_dir: PathBuf,
    health: SocketAddr,
    metrics: SocketAddr,
    log_path: PathBuf,
    launch: Launch,
    pid: u32,
    child: Arc<Mutex<Option<Child>>>,
    _cleanup: CleanupHandle,
}

impl Agent {
    /// Starts the agent on `manifests`, attached to the cgroup `cgroup`, and
    /// waits for `/readyz` to answer 200.
    pub fn start(manifests: &Path, cgroup: &Path, opts: AgentOpts) -> Result<Agent> {
        Self::start_from(Source::Manifests(manifests), cgroup, opts)
    }

    /// Starts the agent in cluster mode on `source` (an API server URL or a
    /// kubeconfig), attached to `cgroup`, and waits for `/readyz`.
    pub fn start_cluster(source: Source<'_>, cgroup: &Path, opts: AgentOpts) -> Result<Agent> {
        Self::start_from(source, cgroup, opts)
    }

    fn start_from(source: Source<'_>, cgroup: &Path, opts: AgentOpts) -> Result<Agent> {
        cleanup::sweep_stale();
        ensure_bpffs()?;
        let bin = crate::agent_bin()?;
        let pin_dir = opts
            .pin_dir
            .clone()
            .unwrap_or_else(|| Path::new(BPFFS_ROOT).join(crate::unique_name("pins")));
        let log_path = opts.log_file.clone().unwrap_or_else(|| {
            let dir = match source {
                Source::Manifests(m) => m.parent().unwrap_or(Path::new("/tmp")).to_path_buf(),
                _ => std::env::temp_dir(),
            };
            dir.join(format!("{}.log", crate::unique_name("agent")))
        });
        let health = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()?));
        let metrics = SocketAddr::from((Ipv4Addr::LOCALHOST, free_port()?));
        let mut args: Vec<OsString> = vec!["run".into()];
        match source {
            Source::Manifests(m) => args.extend(["--manifests".into(), m.into()]),
            Source::ApiServer(url) => args.extend(["--k8s-api-server".into(), url.into()]),
            Source::Kubeconfig(k) => args.extend(["--kubeconfig".into(), k.into()]),
        }
        args.extend(["--cgroup".into(), cgroup.into()]);
        args.extend(["--bpffs".into(), pin_dir.clone().into()]);
        args.extend(["--node-name".into(), opts.node_name.clone().into()]);
        args.extend(["--health-addr".into(), health.to_string().into()]);
        args.extend(["--metrics-bind-address".into(), metrics.to_string().into()]);
        args.extend(opts.extra_args.iter().map(OsString::from));
        let launch = Launch {
            netns: opts.netns.clone(),
            capabilities: opts.capabilities.clone(),
            open_files_soft_limit: opts.open_files_soft_limit,
            process_cgroup: opts.process_cgroup.clone(),
        };
        let (child, line) = spawn(&bin, &args, &log_path, false, &launch)?;
        let pid = child.id();
        let child = Arc::new(Mutex::new(Some(child)));
        let (c2, p2) = (child.clone(), pin_dir.clone());
        let handle = cleanup::register(format!("stop lb-agent {pid}"), move || {
            if let Some(mut ch) = c2.lock().unwrap_or_else(|e| e.into_inner()).take() {
                if terminate(&mut ch, Duration::from_secs(10)).is_none() {
                    eprintln!("warning: lb-agent {pid} ignored SIGTERM for 10 s; killed");
                }
            }
            if p2.exists() {
                let _ = std::fs::remove_dir_all(&p2);
            }
        });
        let agent = Agent {
            bin,
            args,
            pin_dir,
            health,
            metrics,
            log_path,
            launch,
            pid,
            child,
            _cleanup: handle,
        };
        if !opts.no_ready_wait {
            agent
                .wait_ready(opts.ready_timeout)
                .with_context(|| format!("`{line}`"))?;
        }
        Ok(agent)
    }

    /// Polls `/readyz` until 200.
    pub fn wait_ready(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut last;
        loop {
            if let Some(st) = self.exit_status() {
                bail!(
                    "the agent exited ({st}) before it was ready; its log:\n{}",
                    self.log()
                );
            }
            match http_get_in(self.launch.netns.as_deref(), self.health, "/readyz") {
                Ok((200, _)) => return Ok(()),
                Ok((code, body)) => last = format!("{code} {}", body.trim()),
                Err(e) => last = e.to_string(),
            }
            if Instant::now() > deadline {
                bail!(
                    "/readyz not 200 after {timeout:?} (last: {last}); the agent's log:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `Some(status)` once the process has exited.
    pub fn exit_status(&self) -> Option<ExitStatus> {
        let mut g = self.child.lock().unwrap_or_else(|e| e.into_inner());
        g.as_mut().and_then(|c| c.try_wait().ok().flatten())
    }

    pub fn is_running(&self) -> bool {
        let mut g = self.child.lock().unwrap_or_else(|e| e.into_inner());
        match g.as_mut() {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// GET `path` on the health address (`/healthz`, `/livez`, `/readyz`).
    pub fn get(&self, path: &str) -> Result<(u16, String)> {
        http_get_in(self.launch.netns.as_deref(), self.health, path)
    }

    /// GET `/metrics` on the metrics address.
    pub fn metrics(&self) -> Result<(u16, String)> {
        http_get_in(self.launch.netns.as_deref(), self.metrics, "/metrics")
    }

    /// The running child, taken (it is stopped next).
    fn take_child(&self) -> Result<Child> {
        self.child
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| anyhow!("the agent was stopped already"))
    }

    /// SIGTERM and wait (up to 10 s): the agent's exit status. Its pin
    /// directory is left as the agent left it (removed on drop).
    pub fn stop(&mut self) -> Result<ExitStatus> {
        let mut ch = self.take_child()?;
        terminate(&mut ch, Duration::from_secs(10))
            .ok_or_else(|| anyhow!("the agent ignored SIGTERM for 10 s; killed it"))
    }

    /// SIGKILL and wait: a crash. The pins stay as the agent left them.
    pub fn kill(&mut self) -> Result<ExitStatus> {
        let mut ch = self.take_child()?;
        ch.kill().context("SIGKILL")?;
        Ok(ch.wait()?)
    }

    /// Starts the agent again, after [`stop`](Self::stop) or
    /// [`kill`](Self::kill), with the same arguments: same pin directory,
    /// health address and source; its log is appended to the same file.
    /// Waits for `/readyz` up to `ready_timeout`.
    pub fn restart(&mut self, ready_timeout: Duration) -> Result<()> {
        let line = self.respawn()?;
        self.wait_ready(ready_timeout)
            .with_context(|| format!("`{line}` (restarted)"))
    }

    /// Adds arguments for the next [`restart`](Self::restart) (an upgrade
    /// with other flags, say).
    pub fn add_args(&mut self, args: &[&str]) {
        self.args.extend(args.iter().map(OsString::from));
    }

    /// Runs the next [`restart`](Self::restart) in cgroup `cgroup` (`None`:
    /// where its parent is), as [`AgentOpts::process_cgroup`].
    pub fn set_process_cgroup(&mut self, cgroup: Option<PathBuf>) {
        self.launch.process_cgroup = cgroup;
    }

    /// Drops every argument equal to `arg` for the next
    /// [`restart`](Self::restart) (a flag turned off again).
    pub fn remove_arg(&mut self, arg: &str) {
        self.args.retain(|a| a != arg);
    }

    /// Like [`restart`](Self::restart), without waiting for `/readyz`; the
    /// command line.
    pub fn respawn(&mut self) -> Result<String> {
        let mut g = self.child.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = g.as_mut() {
            if matches!(c.try_wait(), Ok(None)) {
                bail!("the agent is still running");
            }
        }
        let (child, line) = spawn(&self.bin, &self.args, &self.log_path, true, &self.launch)?;
        self.pid = child.id();
        *g = Some(child);
        Ok(line)
    }

    /// What the agent logged after the first `offset` bytes (e.g. the
    /// length of [`log`](Self::log) before a restart).
    pub fn log_since(&self, offset: usize) -> String {
        let log = self.log();
        log.get(offset..).unwrap_or("").to_string()
    }

    /// `lb-agent inspect affinity --bpffs PIN --json`, parsed.
    pub fn inspect_affinity(&self) -> Result<Vec<serde_json::Value>> {
        self.inspect_list("affinity")
    }

    /// `lb-agent inspect conntrack --bpffs PIN --json`, parsed.
    pub fn inspect_conntrack(&self) -> Result<Vec<serde_json::Value>> {
        self.inspect_list("conntrack")
    }

    /// `lb-agent inspect ports --bpffs PIN --json`, parsed.
    pub fn inspect_ports(&self) -> Result<Vec<serde_json::Value>> {
        self.inspect_list("ports")
    }

    /// `lb-agent inspect service-cidrs --bpffs PIN --json`, parsed: the
    /// guarded Service CIDRs as `LB_TC_CONFIG` holds them.
    pub fn inspect_service_cidrs(&self) -> Result<Vec<serde_json::Value>> {
        self.inspect_list("service-cidrs")
    }

    /// `lb-agent inspect datagram-flows --bpffs PIN --json`, parsed.
    pub fn inspect_datagram_flows(&self) -> Result<Vec<serde_json::Value>> {
        self.inspect_list("datagram-flows")
    }

    /// `lb-agent inspect WHAT --json --bpffs PIN`, parsed.
    fn inspect_list(&self, what: &str) -> Result<Vec<serde_json::Value>> {
        let mut c = Command::new(&self.bin);
        c.args(["inspect", what, "--json", "--bpffs"])
            .arg(&self.pin_dir);
        let out = cmd::run(&mut c)?;
        serde_json::from_str(&out).with_context(|| format!("inspect output is not JSON: {out}"))
    }

    /// `lb-agent inspect tc --json --bpffs PIN` in the agent's network
    /// namespace (where its devices are), parsed: one object per program
    /// attached to a device, and one with `reason` while the agent cannot
    /// attach them where asked.
    pub fn inspect_tc(&self) -> Result<Vec<serde_json::Value>> {
        let mut c = self.in_agent_netns();
        c.args(["inspect", "tc", "--json", "--bpffs"])
            .arg(&self.pin_dir);
        let out = cmd::run(&mut c)?;
        serde_json::from_str(&out).with_context(|| format!("inspect output is not JSON: {out}"))
    }

    /// `lb-agent cleanup --bpffs PIN`, in the agent's network namespace, as
    /// an operator runs it on the node: what it printed.
    pub fn cleanup(&self) -> Result<String> {
        let mut c = self.in_agent_netns();
        c.args(["cleanup", "--bpffs"]).arg(&self.pin_dir);
        let out = c
            .stdin(std::process::Stdio::null())
            .output()
            .context("running lb-agent cleanup")?;
        let text = String::from_utf8_lossy(&out.stderr).into_owned();
        if !out.status.success() {
            bail!("lb-agent cleanup failed ({}): {text}", out.status);
        }
        Ok(text)
    }

    /// `lb-agent ...` in the agent's network namespace (`nsenter --net`:
    /// the file systems stay the host's, bpffs and cgroups included).
    fn in_agent_netns(&self) -> Command {
        match &self.launch.netns {
            Some(ns) => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net=/run/netns/{ns}")).arg(&self.bin);
                c
            }
            None => Command::new(&self.bin),
        }
    }

    /// `lb-agent inspect services --bpffs PIN --json`, parsed.
    pub fn inspect_services(&self) -> Result<serde_json::Value> {
        let out = self.inspect_services_raw(true)?;
        serde_json::from_str(&out).with_context(|| format!("inspect output is not JSON: {out}"))
    }

    /// `lb-agent inspect services --bpffs PIN [--json]`, as printed.
    pub fn inspect_services_raw(&self, json: bool) -> Result<String> {
        let mut c = Command::new(&self.bin);
        c.args(["inspect", "services", "--bpffs"])
            .arg(&self.pin_dir);
        if json {
            c.arg("--json");
        }
        cmd::run(&mut c)
    }

    pub fn pin_dir(&self) -> &Path {
        &self.pin_dir
    }

    /// Deletes every entry of the pinned map `name` with `bpftool` (as an
    /// LRU map's evictions would); how many there were.
    pub fn clear_map(&self, name: &str) -> Result<usize> {
        let pin = self.pin_dir.join(name);
        let out = cmd::run(
            Command::new("bpftool")
                .args(["-j", "map", "dump", "pinned"])
                .arg(&pin),
        )?;
        let entries: Vec<serde_json::Value> = serde_json::from_str(&out)
            .with_context(|| format!("bpftool map dump output is not JSON: {out}"))?;
        for e in &entries {
            let key: Vec<&str> = e["key"]
                .as_array()
                .and_then(|k| k.iter().map(|b| b.as_str()?.strip_prefix("0x")).collect())
                .ok_or_else(|| anyhow!("{name}: no hex key in {e}"))?;
            cmd::run(
                Command::new("bpftool")
                    .args(["map", "delete", "pinned"])
                    .arg(&pin)
                    .args(["key", "hex"])
                    .args(&key),
            )?;
        }
        Ok(entries.len())
    }

    pub fn health_addr(&self) -> SocketAddr {
        self.health
    }

    pub fn metrics_addr(&self) -> SocketAddr {
        self.metrics
    }

    pub fn pid(&self) -> u32 {
        self.pid
    }

    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// Everything the agent logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_else(|e| format!("(no log: {e})"))
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "==== lb-agent log ({}) ====\n{}\n==== end of lb-agent log ====",
                self.log_path.display(),
                self.log()
            );
        }
    }
}

/// What an agent logs after each sync that wrote frontends, read as its
/// log grows (also across restarts, which append to the same file).
pub struct SyncLog {
    file: std::fs::File,
    pending: String,
}

impl SyncLog {
    /// Reads `agent`'s log from its current end.
    pub fn open(agent: &Agent) -> Result<Self> {
        let path = agent.log_path();
        let mut file =
            std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
        file.seek(SeekFrom::End(0))?;
        Ok(Self {
            file,
            pending: String::new(),
        })
    }

    /// Waits for the next "synced" line with `written=` more than 0.
    pub fn next_write(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            while let Some(n) = self.pending.find('\n') {
                let line: String = self.pending.drain(..=n).collect();
                let written = line
                    .split_whitespace()
                    .find_map(|w| w.strip_prefix("written="))
                    .and_then(|n| n.parse::<usize>().ok());
                if line.contains(" synced") && written.is_some_and(|n| n > 0) {
                    return Ok(());
                }
            }
            let mut more = String::new();
            self.file.read_to_string(&mut more)?;
            if more.is_empty() {
                if Instant::now() >= deadline {
                    bail!("the agent did not sync a change within {timeout:?}");
                }
                std::thread::sleep(Duration::from_micros(500));
            }
            self.pending.push_str(&more);
        }
    }
}
