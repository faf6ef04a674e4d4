//! The faults, one phase each, injected while the load runs: each returns
//! what it did (agent restarts, recovery times, notes) by `deadline`.
use std::{
    collections::BTreeMap,
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};
use integration_tests::{
    apiserver::Outage,
    cleanup::{self, CleanupHandle},
    cluster::metric_sum,
    cmd,
    nodes::node_v4,
};

use crate::bed::{Bed, Cond, HTTP_NODEPORT};

/// What a fault did.
#[derive(Debug, Default)]
pub struct Events {
    pub restarts: u64,
    /// Per occurrence: from the fault (or its end) until the agents served
    /// the current state again.
    pub recoveries: Vec<Duration>,
    pub notes: Vec<String>,
    /// The node power loss phases: what was lost, and whether outlier
    /// detection was on.
    pub power_loss: Option<crate::PowerLoss>,
}

/// The phases, in run order: (name, what is injected, the fault).
pub type Fault = fn(&mut Bed, Instant, bool) -> Result<Events>;

pub const PHASES: &[(&str, &str, Fault)] = &[
    ("baseline", "none (the load alone)", baseline),
    (
        "agent SIGKILL loop",
        "each agent SIGKILLed and restarted in turn, again and again",
        sigkill_loop,
    ),
    (
        "rolling replacement",
        "every endpoint of web replaced one by one: new one ready, old one \
         terminating, then removed",
        rolling,
    ),
    (
        "Service churn",
        "ClusterIP Services created, changed and deleted, 5 a second",
        churn,
    ),
    (
        "SIGTERM upgrade",
        "each agent stopped with SIGTERM and started with other map sizes \
         (--max-services 4096 / default) in turn",
        upgrade,
    ),
    (
        "API server faults",
        "both API servers refuse connections for a while, then watch \
         connections cut, then watches expired with 410 (relist); a change \
         of web after each",
        api_faults,
    ),
    (
        "maps past capacity",
        "agents restarted with --max-services 64, then more Services created \
         than fit",
        capacity,
    ),
    (
        "SYN flood",
        "spoofed SYNs at n2's NodePort from an attacker namespace (bounded)",
        syn_flood,
    ),
    (
        "memory limit",
        "agents restarted in a memory cgroup of 640 MiB (the DaemonSet's \
         limit), under Service churn",
        memory_limit,
    ),
    (
        "node power loss",
        "n2's pods of web unreachable (their links down at the node, nothing \
         answers for them) while the API keeps them ready for the node monitor's \
         grace period, 40 s (quick: 6 s), then marks them not ready; outlier \
         detection on (the default)",
        power_loss_detected,
    ),
    (
        "node power loss without outlier detection",
        "the same with web annotated `lb-agent.dev/outlier-detection: \"off\"`: \
         what kube-proxy and every proxy without detection do",
        power_loss_undetected,
    ),
];

fn baseline(_: &mut Bed, deadline: Instant, _: bool) -> Result<Events> {
    std::thread::sleep(deadline.saturating_duration_since(Instant::now()));
    Ok(Events::default())
}

/// Sleeps `d`, or less if `deadline` comes first; whether time is left.
fn pause(d: Duration, deadline: Instant) -> bool {
    let left = deadline.saturating_duration_since(Instant::now());
    std::thread::sleep(d.min(left));
    Instant::now() < deadline
}

const READY: Duration = Duration::from_secs(30);

fn sigkill_loop(bed: &mut Bed, deadline: Instant, _: bool) -> Result<Events> {
    let mut ev = Events::default();
    'outer: loop {
        for i in 0..bed.c.agents.len() {
            if !pause(Duration::from_millis(700), deadline) {
                break 'outer;
            }
            let agent = &mut bed.c.agents[i];
            let t = Instant::now();
            agent.kill()?;
            agent.restart(READY)?;
            ev.recoveries.push(t.elapsed());
            ev.restarts += 1;
        }
    }
    ev.notes
        .push("recovery: from SIGKILL until the new agent's /readyz answers 200".into());
    Ok(ev)
}

fn rolling(bed: &mut Bed, deadline: Instant, _: bool) -> Result<Events> {
    let mut ev = Events::default();
    let mut rollouts = 0;
    'outer: while Instant::now() < deadline {
        let old: Vec<String> = bed.web.keys().cloned().collect();
        let half = u8::from(old != Bed::group(1));
        for (old_pod, new_pod) in old.iter().zip(Bed::group(half)) {
            if Instant::now() >= deadline {
                break 'outer;
            }
            let mut eps = bed.web.clone();
            eps.insert(new_pod, Cond::Ready);
            ev.recoveries.push(bed.publish_web(eps)?);
            let mut eps = bed.web.clone();
            eps.insert(old_pod.clone(), Cond::Terminating);
            ev.recoveries.push(bed.publish_web(eps)?);
            pause(
                Duration::from_millis(500),
                deadline + Duration::from_secs(5),
            );
            let mut eps = bed.web.clone();
            eps.remove(old_pod);
            ev.recoveries.push(bed.publish_web(eps)?);
            pause(Duration::from_millis(300), deadline);
        }
        rollouts += 1;
    }
    ev.notes.push(format!(
        "{rollouts} rollouts begun; recovery: from a change's write to the API servers \
         until both agents' maps have it"
    ));
    Ok(ev)
}

/// Churn Services `churn-K` at `10.96.1.K`, on the pods `web` is not on.
struct Churn {
    live: Vec<u8>,
    next: u8,
    ops: u64,
}

impl Churn {
    fn new() -> Self {
        Churn {
            live: Vec::new(),
            next: 1,
            ops: 0,
        }
    }

    fn others(bed: &Bed) -> Vec<String> {
        let web: Vec<String> = bed.web.keys().cloned().collect();
        (0..2)
            .flat_map(Bed::group)
            .filter(|p| !web.contains(p))
            .collect()
    }

    /// One operation: create, change or delete, in turn, keeping at most
    /// `max` churn Services.
    fn step(&mut self, bed: &Bed, max: usize) -> Result<()> {
        let others = Self::others(bed);
        let op = self.ops % 3;
        self.ops += 1;
        if op == 0 || self.live.is_empty() {
            if self.live.len() >= max {
                let k = self.live.remove(0);
                bed.delete_service(&format!("churn-{k}"));
                return Ok(());
            }
            let k = self.next;
            self.next = self.next % 250 + 1;
            bed.plain_service(&format!("churn-{k}"), &format!("10.96.1.{k}"), &others[..1])?;
            self.live.push(k);
        } else if op == 1 {
            let k = self.live[self.ops as usize % self.live.len()];
            let n = 1 + (self.ops as usize % others.len());
            bed.plain_slice(&format!("churn-{k}"), &others[..n])?;
        } else {
            let k = self.live.remove(0);
            bed.delete_service(&format!("churn-{k}"));
        }
        Ok(())
    }

    fn clear(&mut self, bed: &Bed) {
        for k in self.live.drain(..) {
            bed.delete_service(&format!("churn-{k}"));
        }
    }
}

fn churn(bed: &mut Bed, deadline: Instant, _: bool) -> Result<Events> {
    let mut ev = Events::default();
    let mut ch = Churn::new();
    while pause(Duration::from_millis(200), deadline) {
        ch.step(bed, 20)?;
    }
    ch.clear(bed);
    // A change of web after the churn: how long until both agents have it.
    let eps = bed.web.clone();
    ev.recoveries.push(republish(bed, eps)?);
    ev.notes.push(format!(
        "{} operations; recovery: web's next change, from its write until both agents \
         have it",
        ch.ops
    ));
    Ok(ev)
}

/// Publishes `eps` with one endpoint swapped for a pod of the other half
/// and back: two changes of web; the longer sync.
fn republish(bed: &mut Bed, eps: BTreeMap<String, Cond>) -> Result<Duration> {
    let mut swapped = eps.clone();
    let first = swapped.keys().next().cloned().expect("web has endpoints");
    swapped.remove(&first);
    let spare = Churn::others(bed).into_iter().next().expect("spare pods");
    swapped.insert(spare, Cond::Ready);
    let a = bed.publish_web(swapped)?;
    let b = bed.publish_web(eps)?;
    Ok(a.max(b))
}

/// Stops (SIGTERM) agent `i`, changes its arguments with `edit`, starts it
/// again; how long it was away.
fn restart_with(
    bed: &mut Bed,
    i: usize,
    edit: impl FnOnce(&mut integration_tests::Agent),
) -> Result<Duration> {
    let agent = &mut bed.c.agents[i];
    let t = Instant::now();
    let st = agent.stop()?;
    if !st.success() {
        bail!("the agent of n{} exited with {st} on SIGTERM", i + 1);
    }
    edit(agent);
    agent.restart(READY)?;
    Ok(t.elapsed())
}

fn set_max_services(agent: &mut integration_tests::Agent, value: Option<&str>) {
    // The flag and its previous values go; other arguments never equal them.
    for a in ["--max-services", "4096", "64"] {
        agent.remove_arg(a);
    }
    if let Some(v) = value {
        agent.add_args(&["--max-services", v]);
    }
}

fn upgrade(bed: &mut Bed, deadline: Instant, _: bool) -> Result<Events> {
    let mut ev = Events::default();
    let mut small = true;
    let mut recreated = 0;
    'outer: loop {
        for i in 0..bed.c.agents.len() {
            if !pause(Duration::from_millis(700), deadline) {
                break 'outer;
            }
            let offset = bed.c.agents[i].log().len();
            let v = small.then_some("4096");
            ev.recoveries
                .push(restart_with(bed, i, |a| set_max_services(a, v))?);
            ev.restarts += 1;
            if bed.c.agents[i].log_since(offset).contains("recreated") {
                recreated += 1;
            }
        }
        small = !small;
    }
    // Leave the default size for the next phases.
    for i in 0..bed.c.agents.len() {
        restart_with(bed, i, |a| set_max_services(a, None))?;
        ev.restarts += 1;
    }
    ev.notes.push(format!(
        "{recreated} of the upgrades logged that they recreated maps of another size; \
         recovery: from SIGTERM until the new agent's /readyz answers 200"
    ));
    Ok(ev)
}

/// How long the API keeps the pods of a node that lost power ready: the
/// node monitor's grace period (40 s; 50 s since Kubernetes 1.32) before
/// the node controller marks the node, and so its pods, not ready.
fn power_loss_grace(quick: bool) -> Duration {
    if quick {
        Duration::from_secs(6)
    } else {
        Duration::from_secs(40)
    }
}

fn power_loss_detected(bed: &mut Bed, deadline: Instant, quick: bool) -> Result<Events> {
    power_loss(bed, deadline, quick, true)
}

fn power_loss_undetected(bed: &mut Bed, deadline: Instant, quick: bool) -> Result<Events> {
    bed.annotate_web(
        serde_json::json!({"lb-agent.dev/outlier-detection": "off"}),
        "off",
    )?;
    let r = power_loss(bed, deadline, quick, false);
    let back = bed.annotate_web(serde_json::json!({}), "on");
    let ev = r?;
    back?;
    Ok(ev)
}

/// web's pods on n2 lose their links; after the grace period the API marks
/// them not ready. Whatever happens, the links come back and the pods are
/// ready again at the end, for the phases after this one.
fn power_loss(bed: &mut Bed, deadline: Instant, quick: bool, detect: bool) -> Result<Events> {
    let mut ev = Events::default();
    let lost: Vec<String> = bed
        .web
        .keys()
        .filter(|p| p.starts_with("n2"))
        .cloned()
        .collect();
    let grace = power_loss_grace(quick);
    let r = (|| -> Result<()> {
        for p in &lost {
            bed.pod_link(p, false)?;
        }
        pause(grace, deadline);
        let mut eps = bed.web.clone();
        for p in &lost {
            eps.insert(p.clone(), Cond::NotReady);
        }
        ev.recoveries.push(bed.publish_web(eps)?);
        pause(deadline.saturating_duration_since(Instant::now()), deadline);
        Ok(())
    })();
    let mut restored = Ok(());
    for p in &lost {
        restored = restored.and(bed.pod_link(p, true));
    }
    let mut eps = bed.web.clone();
    for p in &lost {
        eps.insert(p.clone(), Cond::Ready);
    }
    let republished = bed.publish_web(eps);
    r?;
    restored?;
    republished?;
    ev.notes.push(format!(
        "lost: {} (links down as the load began, marked not ready {:.0} s later, links up \
         and ready again at the end); recovery: from marking them not ready until both \
         agents' maps had it",
        lost.join(", "),
        grace.as_secs_f64()
    ));
    ev.power_loss = Some(crate::PowerLoss {
        detect,
        lost,
        grace_s: grace.as_secs_f64(),
    });
    Ok(ev)
}

/// One fault of the API servers.
type ApiFault<'a> = &'a dyn Fn(&Bed) -> Result<()>;

fn api_faults(bed: &mut Bed, deadline: Instant, quick: bool) -> Result<Events> {
    let mut ev = Events::default();
    let outage = if quick {
        Duration::from_secs(2)
    } else {
        Duration::from_secs(8)
    };
    let refuse = |bed: &Bed| -> Result<()> {
        for api in &bed.apis {
            api.go_away_with(Outage::Refuse);
        }
        pause(outage, deadline + outage);
        bed.apis_come_back()
    };
    let cut = |bed: &Bed| -> Result<()> {
        bed.apis.iter().for_each(|a| a.drop_connections());
        Ok(())
    };
    let expire = |bed: &Bed| -> Result<()> {
        for api in &bed.apis {
            api.compact();
            api.expire_watches();
        }
        Ok(())
    };
    let faults: [ApiFault<'_>; 3] = [&refuse, &cut, &expire];
    let mut rounds = 0;
    'outer: while Instant::now() < deadline {
        for fault in faults {
            fault(bed)?;
            let eps = bed.web.clone();
            ev.recoveries.push(republish(bed, eps)?);
            if !pause(Duration::from_millis(500), deadline) {
                break 'outer;
            }
        }
        rounds += 1;
    }
    let relists: u64 = bed
        .apis
        .iter()
        .map(|a| a.list_count(integration_tests::apiserver::Kind::EndpointSlice))
        .sum();
    ev.notes.push(format!(
        "{rounds} rounds of outage ({outage:?}), watch cut, 410; {relists} EndpointSlice \
         lists served in all; recovery: from the end of each fault until a change of web \
         made then is in both agents' maps"
    ));
    Ok(ev)
}

fn capacity(bed: &mut Bed, deadline: Instant, _: bool) -> Result<Events> {
    let mut ev = Events::default();
    for i in 0..bed.c.agents.len() {
        ev.recoveries
            .push(restart_with(bed, i, |a| set_max_services(a, Some("64")))?);
        ev.restarts += 1;
    }
    let extra = 80u8;
    for k in 1..=extra {
        bed.plain_service(
            &format!("churn-{k}"),
            &format!("10.96.1.{k}"),
            &Churn::others(bed)[..1],
        )?;
    }
    pause(
        deadline.saturating_duration_since(Instant::now()) / 2,
        deadline,
    );
    let (_, text) = bed.c.agents[0].metrics()?;
    let unprogrammed = metric_sum(&text, "lb_frontends_unprogrammed");
    ev.notes.push(format!(
        "{extra} Services created over {} existing; n1's agent reports {unprogrammed} \
         frontends not programmed (lb_frontends_unprogrammed)",
        1
    ));
    if unprogrammed == 0.0 {
        ev.notes
            .push("NOTE: nothing was left out: the maps were not filled past capacity".into());
    }
    for k in 1..=extra {
        bed.delete_service(&format!("churn-{k}"));
    }
    pause(Duration::from_secs(2), deadline);
    for i in 0..bed.c.agents.len() {
        ev.recoveries
            .push(restart_with(bed, i, |a| set_max_services(a, None))?);
        ev.restarts += 1;
    }
    pause(deadline.saturating_duration_since(Instant::now()), deadline);
    ev.notes
        .push("recovery: SIGTERM to ready for the restarts into and out of the small maps".into());
    Ok(ev)
}

fn syn_flood(bed: &mut Bed, deadline: Instant, quick: bool) -> Result<Events> {
    let mut ev = Events::default();
    let ns = bed.c.add_external("attacker", 150)?;
    let left = deadline.saturating_duration_since(Instant::now());
    let dur = left
        .saturating_sub(Duration::from_secs(2))
        .min(Duration::from_secs(30));
    let count: u64 = if quick { 20_000 } else { 100_000 };
    let probe = integration_tests::probe_bin()?;
    let mut c = std::process::Command::new(probe);
    c.args(["syn-flood", "--netns", &ns, "--target"])
        .arg(format!("{}:{HTTP_NODEPORT}", node_v4(2)))
        .args(["--sources", "198.18.0.0/16"])
        .args(["--count", &count.to_string()])
        .args(["--duration-ms", &dur.as_millis().to_string()]);
    let out = cmd::run(&mut c)?;
    ev.notes.push(format!(
        "flood of {count} spoofed SYNs over {dur:?} from 198.18.0.0/16 at n2's NodePort: {}",
        out.trim()
    ));
    let (_, text) = bed.c.agents[1].metrics()?;
    ev.notes.push(format!(
        "n2's agent right after the flood: lb_conntrack_entries {}",
        metric_sum(&text, "lb_conntrack_entries")
    ));
    pause(deadline.saturating_duration_since(Instant::now()), deadline);
    Ok(ev)
}

/// A memory cgroup (v2 `memory.max`, or v1 `memory.limit_in_bytes` on a
/// hybrid host) for one agent, removed on drop.
pub struct MemoryCgroup {
    pub path: PathBuf,
    v2: bool,
    _cleanup: CleanupHandle,
}

/// The DaemonSet's `resources.limits.memory` (deploy/daemonset.yaml).
pub const DAEMONSET_MEMORY: u64 = 640 << 20;

impl MemoryCgroup {
    pub fn create(tag: &str, limit: u64) -> Result<Self> {
        let v2_root = integration_tests::cgroup::cgroup2_root()?;
        let v2_has_memory = std::fs::read_to_string(v2_root.join("cgroup.subtree_control"))
            .is_ok_and(|s| s.split_whitespace().any(|c| c == "memory"));
        let (root, v2) = if v2_has_memory {
            (v2_root, true)
        } else {
            (PathBuf::from("/sys/fs/cgroup/memory"), false)
        };
        let path = root.join(integration_tests::unique_name(tag));
        std::fs::create_dir(&path).with_context(|| format!("creating {}", path.display()))?;
        let p = path.clone();
        let handle = cleanup::register(format!("remove cgroup {}", path.display()), move || {
            integration_tests::cgroup::remove_cgroup(&p)
        });
        let file = if v2 {
            "memory.max"
        } else {
            "memory.limit_in_bytes"
        };
        std::fs::write(path.join(file), limit.to_string())
            .with_context(|| format!("writing {}/{file}", path.display()))?;
        Ok(MemoryCgroup {
            path,
            v2,
            _cleanup: handle,
        })
    }

    fn read(&self, file: &str) -> String {
        std::fs::read_to_string(self.path.join(file)).unwrap_or_default()
    }

    /// (peak usage in bytes, OOM kills).
    pub fn peak_and_ooms(&self) -> (u64, u64) {
        let (peak, events) = if self.v2 {
            ("memory.peak", "memory.events")
        } else {
            ("memory.max_usage_in_bytes", "memory.oom_control")
        };
        let peak = self.read(peak).trim().parse().unwrap_or(0);
        let ooms = self
            .read(events)
            .lines()
            .find_map(|l| l.strip_prefix("oom_kill "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        (peak, ooms)
    }
}

fn memory_limit(bed: &mut Bed, deadline: Instant, _: bool) -> Result<Events> {
    let mut ev = Events::default();
    for i in 0..bed.c.agents.len() {
        let cg = MemoryCgroup::create(&format!("chaos-mem-n{}", i + 1), DAEMONSET_MEMORY)?;
        let p = cg.path.clone();
        bed.memory.push(cg);
        // Other map sizes: the agent recreates LB_SERVICES there, so that
        // map is charged to the limited cgroup (maps pinned before stay
        // charged to where they were made).
        ev.recoveries.push(restart_with(bed, i, |a| {
            a.set_process_cgroup(Some(p));
            set_max_services(a, Some("4096"));
        })?);
        ev.restarts += 1;
    }
    let mut ch = Churn::new();
    while pause(Duration::from_millis(200), deadline) {
        ch.step(bed, 50)?;
    }
    ch.clear(bed);
    for (i, cg) in bed.memory.iter().enumerate() {
        let (peak, ooms) = cg.peak_and_ooms();
        ev.notes.push(format!(
            "n{}'s agent: peak {:.0} MiB of {} MiB, {ooms} OOM kills, running: {}",
            i + 1,
            peak as f64 / (1 << 20) as f64,
            DAEMONSET_MEMORY >> 20,
            bed.c.agents[i].is_running()
        ));
    }
    ev.notes.push(
        "the agents restarted into the cgroups with --max-services 4096 (LB_SERVICES \
         recreated there); recovery: SIGTERM to ready for those restarts"
            .into(),
    );
    Ok(ev)
}

/// The negative control, run last: faults the figures must show, or the
/// instruments are blind. web moves to other pods without the move being
/// recorded (its answers must count as misrouted), then every pod's
/// server processes are killed (attempts must fail, streams reset).
pub const CONTROL: (&str, &str, Fault) = (
    "instrument check",
    "negative control: web moved to other pods without recording it, then \
     every pod's servers killed; every figure must be non-zero",
    instrument_check,
);

fn instrument_check(bed: &mut Bed, deadline: Instant, _: bool) -> Result<Events> {
    let mut ev = Events::default();
    let third = deadline.saturating_duration_since(Instant::now()) / 3;
    pause(third, deadline);
    let eps: BTreeMap<String, Cond> = Churn::others(bed)
        .into_iter()
        .map(|p| (p, Cond::Ready))
        .collect();
    bed.publish_web(eps)?;
    // Forget the move: the set before it stays "current".
    bed.timeline.0.pop();
    pause(third, deadline);
    // Every pod's: the streams are on pods of the set before the move.
    let mut killed = 0;
    for pod in &bed.c.pods {
        let out = cmd::ip(&["netns", "pids", &pod.netns])?;
        for pid in out.split_whitespace().filter_map(|p| p.parse::<u32>().ok()) {
            cmd::signal(pid, libc::SIGKILL);
            killed += 1;
        }
    }
    ev.notes.push(format!(
        "web moved to {:?} unrecorded; {killed} server processes of every pod killed \
         {:.0?} before the end",
        bed.web.keys().collect::<Vec<_>>(),
        deadline.saturating_duration_since(Instant::now())
    ));
    pause(deadline.saturating_duration_since(Instant::now()), deadline);
    Ok(ev)
}
