//! Integration-test support for the load balancer: network-namespace pods on
//! a bridge, a child cgroup for the clients, the agent as a child process,
//! manifests, and the `lb-probe` client/server.
//!
//! Safety rules this crate keeps:
//! - traffic only between namespaces it creates; clients have no default
//!   route, so an unrewritten connect to a VIP fails with `ENETUNREACH`;
//! - the agent attaches to a child cgroup made here, never the root;
//! - every namespace, cgroup, pin directory and process is removed by a
//!   guard's drop (also on panic), or by [`cleanup::run_all`] on a signal;
//!   leftovers of a killed run are swept by the next one.
//!
//! Typical test:
//! ```no_run
//! use integration_tests::{manifests::*, probe::Spread, Env};
//! use serde_json::json;
//! integration_tests::require_root!();
//! let mut env = Env::new("doc", 3).unwrap();
//! env.manifests.write("web.yaml", &[
//!     Service::new("demo", "web").cluster_ip("10.96.0.10").port("http", 80, "TCP", json!(8080)).to_value(),
//!     env.slice("web", &[("http", 8080, "TCP")]).to_value(),
//! ]).unwrap();
//! env.start_agent().unwrap();
//! println!("{}", Spread::of(&env.tcp("10.96.0.10:80", 100)));
//! ```
pub mod agent;
pub mod apiserver;
pub mod cgroup;
pub mod cleanup;
pub mod cluster;
pub mod cmd;
pub mod manifests;
pub mod netns;
pub mod nodes;
pub mod pinned;
pub mod probe;
pub mod tcpflow;
pub mod xdp_pass;

use std::{
    net::IpAddr,
    path::PathBuf,
    sync::atomic::{AtomicU32, Ordering},
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};

pub use agent::{Agent, AgentOpts};
pub use cgroup::CgroupGuard;
pub use netns::Topology;
pub use probe::{client, Attempt, Client, Family, Proto, Spread};

/// Whether we run as root (euid 0).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Returns from the calling test, loudly, unless running as root.
#[macro_export]
macro_rules! require_root {
    () => {
        if !$crate::is_root() {
            eprintln!(
                "\n**************************************************************\n\
                 SKIPPED {}::{}: needs root (network namespaces, cgroups, eBPF)\n\
                 **************************************************************\n",
                module_path!(),
                std::thread::current().name().unwrap_or("?")
            );
            return;
        }
    };
}

/// A name unique on this machine: `lbt{pid}x{n}-{tag}`. The pid lets
/// [`cleanup::sweep_stale`] recognise leftovers of dead runs.
pub fn unique_name(tag: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    if tag.is_empty() {
        format!("lbt{}x{n}", std::process::id())
    } else {
        format!("lbt{}x{n}-{tag}", std::process::id())
    }
}

/// The workspace root (the parent of this package).
pub fn workspace_root() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.parent().map(PathBuf::from).unwrap_or(here)
}

fn find_bin(name: &str, env_var: &str, fallbacks: &[PathBuf]) -> Result<PathBuf> {
    let mut tried = Vec::new();
    if let Some(p) = std::env::var_os(env_var) {
        return Ok(PathBuf::from(p));
    }
    let mut candidates = Vec::new();
    if let Some(d) = std::env::var_os("LB_BIN_DIR") {
        candidates.push(PathBuf::from(d).join(name));
    }
    candidates.extend(fallbacks.iter().cloned());
    for c in candidates {
        if c.is_file() {
            return Ok(c);
        }
        tried.push(c.display().to_string());
    }
    bail!(
        "cannot find {name}: set {env_var} or LB_BIN_DIR, or build it \
         (`cargo xtask build` / `cargo build --release`); tried {}",
        tried.join(", ")
    )
}

/// The directory of the running executable.
fn exe_dir() -> Option<PathBuf> {
    std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(PathBuf::from))
}

/// `lb-agent`: `$LB_AGENT_BIN`, `$LB_BIN_DIR/lb-agent`, beside the running
/// executable, `<workspace>/target/release/lb-agent`.
pub fn agent_bin() -> Result<PathBuf> {
    let mut fallbacks = Vec::new();
    if let Some(dir) = exe_dir() {
        fallbacks.push(dir.join("lb-agent"));
    }
    fallbacks.push(workspace_root().join("target/release/lb-agent"));
    find_bin("lb-agent", "LB_AGENT_BIN", &fallbacks)
}

/// `lb-probe`: `$LB_PROBE_BIN`, `$LB_BIN_DIR/lb-probe`, beside the running
/// executable or one level up (a test binary in `target/*/deps`), then
/// `<workspace>/target/{release,debug}/lb-probe`.
pub fn probe_bin() -> Result<PathBuf> {
    let mut fallbacks = Vec::new();
    if let Some(dir) = exe_dir() {
        fallbacks.push(dir.join("lb-probe"));
        if let Some(up) = dir.parent() {
            fallbacks.push(up.join("lb-probe"));
        }
    }
    fallbacks.push(workspace_root().join("target/release/lb-probe"));
    fallbacks.push(workspace_root().join("target/debug/lb-probe"));
    find_bin("lb-probe", "LB_PROBE_BIN", &fallbacks)
}

/// Polls `f` every `every` until it is true or `timeout` passes; whether it
/// became true.
pub fn wait_until(timeout: Duration, every: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(every);
    }
}

/// Everything one test needs, torn down in a safe order on drop: the agent
/// (detaches its programs), then the namespaces, then the cgroup, then the
/// temporary directory (manifests, agent log).
pub struct Env {
    pub agent: Option<Agent>,
    pub topo: Topology,
    pub cgroup: CgroupGuard,
    pub manifests: manifests::Manifests,
    pub dir: tempfile::TempDir,
}

impl Env {
    /// Backends `b1..bn` answering their name on port 8080 (TCP and UDP),
    /// and a `client` host.
    pub fn new(name: &str, backends: u8) -> Result<Self> {
        Self::with_serve(name, backends, &[8080], false)
    }

    /// Like [`new`](Self::new), the backends serving on `ports`; with
    /// `with_port` they answer `NAME:PORT`.
    pub fn with_serve(name: &str, backends: u8, ports: &[u16], with_port: bool) -> Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix(&format!("{}-", unique_name(name)))
            .tempdir()
            .context("creating a temporary directory")?;
        let cgroup = CgroupGuard::create(name)?;
        let topo = Topology::pods(name, backends)?;
        topo.serve_all(ports, with_port)?;
        let manifests = manifests::Manifests::new(dir.path().join("manifests"))?;
        Ok(Self {
            agent: None,
            topo,
            cgroup,
            manifests,
            dir,
        })
    }

    /// Starts the agent on this environment's manifests and cgroup.
    pub fn start_agent(&mut self) -> Result<&Agent> {
        self.start_agent_with(AgentOpts::default())
    }

    pub fn start_agent_with(&mut self, mut opts: AgentOpts) -> Result<&Agent> {
        if opts.log_file.is_none() {
            opts.log_file = Some(self.dir.path().join("agent.log"));
        }
        let agent = Agent::start(self.manifests.path(), self.cgroup.path(), opts)?;
        Ok(self.agent.insert(agent))
    }

    /// Starts the agent in cluster mode against the API server at `url`
    /// (`--k8s-api-server`), on this environment's cgroup.
    pub fn start_cluster_agent(&mut self, url: &str, mut opts: AgentOpts) -> Result<&Agent> {
        if opts.log_file.is_none() {
            opts.log_file = Some(self.dir.path().join("agent.log"));
        }
        let agent = Agent::start_cluster(agent::Source::ApiServer(url), self.cgroup.path(), opts)?;
        Ok(self.agent.insert(agent))
    }

    /// The running agent; panics if none was started.
    pub fn agent(&self) -> &Agent {
        self.agent.as_ref().expect("start_agent was not called")
    }

    /// A client builder for this environment.
    pub fn client(&self) -> Client {
        Client::new(&self.topo, &self.cgroup)
    }

    /// `count` attempts with `proto` at `target`; panics if the probe fails to run.
    pub fn attempts(&self, proto: Proto, target: &str, count: usize) -> Vec<Attempt> {
        self.client()
            .proto(proto)
            .run(target, count)
            .unwrap_or_else(|e| panic!("{e:#}"))
    }

    pub fn tcp(&self, target: &str, count: usize) -> Vec<Attempt> {
        self.attempts(Proto::Tcp, target, count)
    }

    /// An EndpointSlice of Service `service` (namespace `demo`) with every
    /// backend of the topology ready, IPv4, with `ports` (name, port, protocol).
    pub fn slice(&self, service: &str, ports: &[(&str, u16, &str)]) -> manifests::EndpointSlice {
        self.slice_of(service, ports, |h| {
            manifests::Endpoint::ready(IpAddr::V4(h.ipv4))
        })
    }

    /// Like [`slice`](Self::slice), with one endpoint per backend made by `f`.
    pub fn slice_of(
        &self,
        service: &str,
        ports: &[(&str, u16, &str)],
        f: impl Fn(&netns::Host) -> manifests::Endpoint,
    ) -> manifests::EndpointSlice {
        let mut s = manifests::EndpointSlice::new("demo", &format!("{service}-abcde"), service);
        for (name, port, proto) in ports {
            s = s.port(name, *port, proto);
        }
        s.endpoints(self.topo.backends().map(f))
    }
}
