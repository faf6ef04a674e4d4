//! `lb-demo`: the load balancer end to end, in network namespaces on this
//! machine.
//!
//! Builds four backend pods and a client pod on a bridge, writes Service
//! `demo/web` (ClusterIP 10.96.0.10, 80/TCP and 53/UDP to target port 8080)
//! with its EndpointSlice, starts `lb-agent` (pins in `/sys/fs/bpf/lb-demo`),
//! sends TCP connects and UDP queries through the ClusterIP and shows how
//! they spread, shows what the agent programmed, marks one backend unready
//! live and shows the new spread, then removes everything. Ctrl-C cleans up
//! too.
//!
//! Then the NodePort part: three "nodes" (namespaces, an agent each, pods
//! behind a bridge on two of them) and an external client; NodePorts on
//! every node, masquerade vs client IP, `externalTrafficPolicy: Local` and
//! its health-check node port, and the conntrack table.
use std::{
    net::IpAddr,
    path::{Path, PathBuf},
    process::{Command, ExitCode},
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};
use clap::Parser;
use integration_tests::{
    cleanup, cmd,
    manifests::{self, Endpoint, EndpointSlice, Manifests, Service},
    netns::Host,
    wait_until, Agent, AgentOpts, Attempt, CgroupGuard, Client, Proto, Spread, Topology,
};
use serde_json::json;

#[derive(Debug, Parser)]
#[command(
    name = "lb-demo",
    about = "Show the eBPF service load balancer at work, in network namespaces"
)]
struct Args {
    /// Where the agent pins its maps.
    #[arg(long, default_value = "/sys/fs/bpf/lb-demo")]
    bpffs: PathBuf,
    /// TCP connects per round.
    #[arg(long, default_value_t = 400)]
    tcp: usize,
    /// UDP queries per round.
    #[arg(long, default_value_t = 200)]
    udp: usize,
}

const VIP: &str = "10.96.0.10";
static INTERRUPTED: AtomicBool = AtomicBool::new(false);
const BACKENDS: u8 = 4;

fn section(title: &str) {
    use std::io::IsTerminal as _;
    if std::io::stdout().is_terminal() {
        println!("\n\x1b[1m==> {title}\x1b[0m");
    } else {
        println!("\n==> {title}");
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    if !integration_tests::is_root() {
        eprintln!("lb-demo: needs root (network namespaces, cgroups, eBPF); try `sudo -E cargo xtask demo`");
        return ExitCode::FAILURE;
    }
    if let Err(e) = cleanup::teardown_on_ctrl_c("\nlb-demo: interrupted, cleaning up", || {
        INTERRUPTED.store(true, Ordering::SeqCst);
    }) {
        eprintln!("lb-demo: warning: no Ctrl-C handler ({e}); an interrupt may leave namespaces behind until the next run");
    }
    let r = run(&args);
    // Whatever is still registered (after an error) goes now.
    cleanup::run_all();
    match r {
        Ok(()) => ExitCode::SUCCESS,
        // The handler tears down under our feet (killing a running client
        // makes `run` fail) and exits the process itself.
        Err(_) if INTERRUPTED.load(Ordering::SeqCst) => {
            std::thread::sleep(Duration::from_secs(30));
            ExitCode::from(130)
        }
        Err(e) => {
            eprintln!("lb-demo: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn slice(topo: &Topology, unready: Option<&str>) -> EndpointSlice {
    EndpointSlice::new("demo", "web-abcde", "web")
        .port("http", 8080, "TCP")
        .port("dns", 8080, "UDP")
        .endpoints(topo.backends().map(|h: &Host| {
            let ip = IpAddr::V4(h.ipv4);
            if Some(h.name.as_str()) == unready {
                Endpoint::unready(ip)
            } else {
                Endpoint::ready(ip)
            }
        }))
}

fn service() -> Service {
    Service::new("demo", "web")
        .cluster_ip(VIP)
        .port("http", 80, "TCP", json!(8080))
        .port("dns", 53, "UDP", json!(8080))
}

fn show_spread(title: &str, attempts: &[Attempt]) {
    let s = Spread::of(attempts);
    println!("{title}");
    println!("{s}");
    let peers: Vec<String> = s.peers.iter().map(|(p, n)| format!("{p} x{n}")).collect();
    println!("  the client saw its peer as: {}", peers.join(", "));
}

fn round(client: &Client, args: &Args, label: &str) -> Result<()> {
    let timed = |proto: Proto, port: u16, count: usize| -> Result<_> {
        let t = Instant::now();
        let attempts = client
            .clone()
            .proto(proto)
            .run(&format!("{VIP}:{port}"), count)?;
        Ok((attempts, t.elapsed()))
    };
    let (tcp, tcp_time) = timed(Proto::Tcp, 80, args.tcp)?;
    let (udp, udp_time) = timed(Proto::Udp, 53, args.udp)?;
    show_spread(
        &format!(
            "{} TCP connects to {VIP}:80{label} ({tcp_time:.0?}):",
            args.tcp
        ),
        &tcp,
    );
    println!();
    show_spread(
        &format!(
            "{} UDP queries to {VIP}:53{label} ({udp_time:.0?}):",
            args.udp
        ),
        &udp,
    );
    Ok(())
}

fn head(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = lines.iter().take(n).copied().collect::<Vec<_>>().join("\n");
    if lines.len() > n {
        out.push_str(&format!("\n  ... ({} more lines)", lines.len() - n));
    }
    out
}

fn indent(text: &str) -> String {
    text.lines()
        .map(|l| format!("  {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn run(args: &Args) -> Result<()> {
    section("Pod network (network namespaces on a bridge, no default route)");
    let cgroup = CgroupGuard::create("demo")?;
    let topo = Topology::pods("demo", BACKENDS)?;
    topo.serve_all(&[8080], false)?;
    println!("  {:<8} {:<26} {:<14} IPv6", "pod", "netns", "IPv4");
    for h in topo.hosts() {
        println!("  {:<8} {:<26} {:<14} {}", h.name, h.netns, h.ipv4, h.ipv6);
    }
    println!("  backends answer their name on 8080/TCP and 8080/UDP (lb-probe serve)");
    println!("  client cgroup: {}", cgroup.path().display());

    section("Manifests");
    let dir = tempfile::Builder::new().prefix("lb-demo-").tempdir()?;
    let m = Manifests::new(dir.path().join("manifests"))?;
    let docs = [service().to_value(), slice(&topo, None).to_value()];
    m.write("web.yaml", &docs)?;
    println!("  {}/web.yaml:", m.path().display());
    println!("{}", indent(&manifests::to_yaml(&docs)?));

    section("Starting lb-agent");
    if args.bpffs.exists() {
        println!("  removing {} left by an earlier run", args.bpffs.display());
        std::fs::remove_dir_all(&args.bpffs)
            .with_context(|| format!("removing {}", args.bpffs.display()))?;
    }
    let mut agent = Agent::start(
        m.path(),
        cgroup.path(),
        AgentOpts {
            pin_dir: Some(args.bpffs.clone()),
            log_file: Some(dir.path().join("agent.log")),
            node_name: "demo-node".into(),
            ..Default::default()
        },
    )?;
    println!(
        "  lb-agent pid {} ready (GET http://{}/readyz = 200), maps pinned in {}, attached to {}",
        agent.pid(),
        agent.health_addr(),
        agent.pin_dir().display(),
        cgroup.path().display()
    );

    let client = Client::new(&topo, &cgroup);
    section("Traffic through the ClusterIP");
    round(&client, args, "")?;

    section(&format!(
        "lb-agent inspect services --bpffs {}",
        args.bpffs.display()
    ));
    match agent.inspect_services_raw(false) {
        Ok(out) => println!("{}", indent(out.trim_end())),
        Err(e) => println!("  (inspect failed: {e:#})"),
    }

    let services_pin = args.bpffs.join("LB_SERVICES");
    section(&format!(
        "bpftool map dump pinned {}",
        services_pin.display()
    ));
    match cmd::run(
        Command::new("bpftool")
            .args(["map", "dump", "pinned"])
            .arg(&services_pin),
    ) {
        Ok(out) => println!("{}", indent(&head(out.trim_end(), 30))),
        Err(e) => println!("  (bpftool failed: {e:#})"),
    }

    section("Live edit: b4 becomes unready (conditions.ready: false)");
    let docs = [service().to_value(), slice(&topo, Some("b4")).to_value()];
    m.write("web.yaml", &docs)?;
    let t = Instant::now();
    let gone = wait_until(Duration::from_secs(5), Duration::from_millis(50), || {
        client
            .clone()
            .run(&format!("{VIP}:80"), 20)
            .map(|a| Spread::of(&a).count("b4") == 0)
            .unwrap_or(false)
    });
    if !gone {
        bail!(
            "b4 was still chosen 5 s after the edit; the agent's log:\n{}",
            agent.log()
        );
    }
    println!("  b4 no longer chosen after {:.0?}", t.elapsed());
    round(&client, args, " with b4 unready")?;

    section("Tearing down");
    match agent.stop() {
        Ok(st) => println!("  lb-agent stopped ({st})"),
        Err(e) => println!("  lb-agent: {e:#}"),
    }
    let pins_left = args.bpffs.exists();
    drop(agent);
    drop(topo);
    drop(cgroup);
    println!(
        "  pins {}, namespaces deleted, cgroup removed",
        if pins_left {
            "left by the agent were removed"
        } else {
            "removed by the agent"
        }
    );
    cleanup_check(&args.bpffs);
    nodeport_part()
}

/// North-south: NodePorts through the tc path on a three-node topology.
fn nodeport_part() -> Result<()> {
    use integration_tests::nodes::{node_v4, Cluster};
    section("NodePort: three nodes, pods n1p0 n1p1 on n1, n2p0 on n2, none on n3");
    let mut c = Cluster::new("demo-np", &[2, 1, 0])?;
    c.serve_all()?;
    for n in &c.nodes {
        println!("  {} eth0 {} (netns {})", n.name, node_v4(n.index), n.netns);
    }
    for p in &c.pods {
        println!("  pod {} {} on n{}", p.name, p.ipv4, p.node);
    }
    println!("  external client 192.168.77.100 (no default route)");
    let pods: Vec<_> = c.pods.to_vec();
    let refs: Vec<_> = pods.iter().collect();
    let local: Vec<_> = pods.iter().filter(|p| p.name != "n1p1").collect();
    let mut docs = c.node_objects();
    docs.extend([
        json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web", "namespace": "demo"},
            "spec": {"type": "NodePort", "clusterIP": "10.96.0.10",
                "ports": [{"name": "http", "port": 80, "targetPort": 8080, "nodePort": 30080}]}}),
        c.slice("web", &refs, false, "TCP"),
        json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "local", "namespace": "demo"},
            "spec": {"type": "LoadBalancer", "clusterIP": "10.96.0.11", "externalTrafficPolicy": "Local",
                "healthCheckNodePort": 32000,
                "ports": [{"name": "http", "port": 80, "targetPort": 8080, "nodePort": 30081}]}}),
        c.slice("local", &local, false, "TCP"),
    ]);
    c.manifests.write("cluster.yaml", &docs)?;
    println!("  Services: demo/web NodePort 30080 (Cluster), demo/local NodePort 30081 (Local, healthCheckNodePort 32000)");
    c.start_agents(&[])?;
    println!("  one lb-agent per node (nsenter --net), tc programs on each node's eth0");

    section("60 connects from the client to each node's NodePort 30080 (externalTrafficPolicy: Cluster)");
    for n in 1..=3u8 {
        let a = c.from_client("tcp", &format!("{}:30080", node_v4(n)), 60);
        let mut seen: std::collections::BTreeMap<(String, String), usize> = Default::default();
        for at in a.iter().filter(|a| a.ok) {
            *seen
                .entry((
                    at.backend.clone().unwrap_or_default(),
                    at.seen_from.clone().unwrap_or_default(),
                ))
                .or_default() += 1;
        }
        let parts: Vec<String> = seen
            .iter()
            .map(|((b, f), k)| format!("{b} x{k} (saw {f})"))
            .collect();
        println!(
            "  n{n}: {}/60 answered: {}",
            a.iter().filter(|a| a.ok).count(),
            parts.join(", ")
        );
    }
    println!("  pods on the entry node see the client; the others see the node (masquerade)");

    section("NodePort 30081 (externalTrafficPolicy: Local) and its health-check node port 32000");
    for n in 1..=3u8 {
        let a = c.from_client("tcp", &format!("{}:30081", node_v4(n)), 10);
        let ok: Vec<_> = a.iter().filter(|a| a.ok).collect();
        let hc = match c.health_check(n, 32000) {
            Ok((code, body)) => format!("{code} {}", body.trim()),
            Err(e) => format!("error: {e:#}"),
        };
        println!(
            "  n{n}: {}/10 answered{}; GET :32000 -> {hc}",
            ok.len(),
            ok.first()
                .map(|a| format!(
                    " by {} (saw {})",
                    a.backend.as_deref().unwrap_or("?"),
                    a.seen_from.as_deref().unwrap_or("?")
                ))
                .unwrap_or_else(|| " (dropped: no local endpoint)".into())
        );
    }

    section("lb-agent inspect conntrack (n1, first lines)");
    let out = cmd::run(
        Command::new(integration_tests::agent_bin()?)
            .args(["inspect", "conntrack", "--bpffs"])
            .arg(c.agents[0].pin_dir()),
    )?;
    println!("{}", indent(&head(out.trim_end(), 8)));

    section("Tearing down the nodes");
    drop(c);
    println!("  agents stopped, namespaces deleted, cgroups and pins removed");
    Ok(())
}

fn cleanup_check(pins: &Path) {
    if pins.exists() {
        println!("  warning: {} still exists", pins.display());
    }
}
