//! Helpers for the cluster-mode, restart, affinity and Maglev tests: JSON
//! edits of the manifest builders' objects (labels, annotations,
//! sessionAffinity, endpoint conditions), `/metrics` parsing, polling with
//! real connections, and long-running `lb-probe` children.
use std::{
    collections::BTreeMap,
    io::{BufRead as _, BufReader, Write as _},
    process::{Child, ChildStdin, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context as _, Result};
use serde_json::{json, Value};

use crate::{
    cmd,
    manifests::{Endpoint, EndpointSlice},
    probe::Attempt,
    Env, Spread,
};

/// An EndpointSlice `name` of `service` (namespace `demo`) with `ports`
/// (name, port, protocol) and the ready IPv4 endpoints of `hosts`.
pub fn ready_slice(
    env: &Env,
    service: &str,
    name: &str,
    ports: &[(&str, u16, &str)],
    hosts: &[impl AsRef<str>],
) -> Value {
    let mut s = EndpointSlice::new("demo", name, service);
    for (n, p, proto) in ports {
        s = s.port(n, *p, proto);
    }
    s.endpoints(
        hosts
            .iter()
            .map(|h| Endpoint::ready(env.topo.host(h.as_ref()).ipv4.into())),
    )
    .to_value()
}

/// Adds `metadata.labels[key] = value` to an object.
pub fn with_label(mut obj: Value, key: &str, value: &str) -> Value {
    obj["metadata"]["labels"][key] = json!(value);
    obj
}

/// Adds `metadata.annotations[key] = value` to an object.
pub fn with_annotation(mut obj: Value, key: &str, value: &str) -> Value {
    obj["metadata"]["annotations"][key] = json!(value);
    obj
}

/// `sessionAffinity: ClientIP` with `timeoutSeconds` on a Service.
pub fn with_client_ip_affinity(mut svc: Value, timeout_seconds: u32) -> Value {
    svc["spec"]["sessionAffinity"] = json!("ClientIP");
    svc["spec"]["sessionAffinityConfig"] = json!({"clientIP": {"timeoutSeconds": timeout_seconds}});
    svc
}

/// The Maglev annotation `lb-agent.dev/lb-algorithm: maglev`.
pub fn with_maglev(svc: Value) -> Value {
    with_annotation(svc, "lb-agent.dev/lb-algorithm", "maglev")
}

/// Sets the conditions of every endpoint of a slice whose address is in
/// `addrs`.
pub fn with_conditions(
    mut slice: Value,
    addrs: &[std::net::IpAddr],
    ready: bool,
    serving: bool,
    terminating: bool,
) -> Value {
    if let Some(eps) = slice["endpoints"].as_array_mut() {
        for ep in eps {
            let hit = ep["addresses"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .any(|a| addrs.iter().any(|x| x.to_string() == a));
            if hit {
                ep["conditions"] =
                    json!({"ready": ready, "serving": serving, "terminating": terminating});
            }
        }
    }
    slice
}

/// The value of the Prometheus sample `name` (with its labels as written,
/// e.g. `lb_watch_restarts_total{kind="Service"}`) in `text`.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (n, v) = l.rsplit_once(' ')?;
        (n == name).then(|| v.parse().ok()).flatten()
    })
}

/// The sum of every sample whose name (before any `{`) is `family`.
pub fn metric_sum(text: &str, family: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (n, v) = l.rsplit_once(' ')?;
            let base = n.split('{').next()?;
            (base == family).then(|| v.parse::<f64>().ok()).flatten()
        })
        .sum()
}

/// The backend addresses (`IP:PORT`, active and terminating) of the
/// frontend `addr`:`port` (any protocol when `protocol` is None, else
/// `"TCP"`/`"UDP"`), as `lb-agent inspect services --json` shows them; None
/// if there is no such frontend.
pub fn frontend_backends(
    agent: &crate::Agent,
    addr: &str,
    port: u16,
    protocol: Option<&str>,
) -> Result<Option<Vec<String>>> {
    let v = agent.inspect_services()?;
    let Some(list) = v.as_array() else {
        bail!("inspect services: not a list: {v}");
    };
    let found = list.iter().find(|f| {
        f["addr"].as_str() == Some(addr)
            && f["port"].as_u64() == Some(port as u64)
            && protocol.is_none_or(|p| {
                f["protocol"]
                    .as_str()
                    .is_some_and(|x| x.eq_ignore_ascii_case(p))
            })
    });
    Ok(found.map(|f| {
        f["backends"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|b| format!("{}:{}", b["addr"].as_str().unwrap_or("?"), b["port"]))
            .collect()
    }))
}

/// Polls with batches of `batch` TCP attempts at `target` until `done`
/// holds for a batch; how long that took, or the last spread on timeout.
pub fn poll_tcp(
    env: &Env,
    target: &str,
    batch: usize,
    timeout: Duration,
    done: impl Fn(&Spread) -> bool,
) -> std::result::Result<Duration, Spread> {
    let t = Instant::now();
    loop {
        let s = Spread::of(&env.tcp(target, batch));
        if done(&s) {
            return Ok(t.elapsed());
        }
        if t.elapsed() > timeout {
            return Err(s);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Starts `lb-probe client` from the environment's client host with
/// `count` attempts at `target` paced `interval_us` apart; the thread
/// returns its attempts.
pub fn paced_client(
    env: &Env,
    proto: crate::Proto,
    target: &str,
    count: usize,
    interval_us: u64,
) -> Result<std::thread::JoinHandle<Vec<Attempt>>> {
    let mut c = env.client().proto(proto).command(target, count)?;
    c.args(["--interval-us", &interval_us.to_string()]);
    let line = cmd::display(&c);
    let child = cmd::die_with_parent(&mut c, libc::SIGKILL)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot run `{line}`"))?;
    Ok(std::thread::spawn(move || {
        let out = child.wait_with_output().expect("client output");
        assert!(out.status.success(), "{line}: {}", out.status);
        crate::probe::parse_attempts(&String::from_utf8_lossy(&out.stdout)).expect("client lines")
    }))
}

/// A child `lb-probe` whose JSON output lines arrive on a channel; killed
/// on drop.
pub struct ProbeChild {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    line: String,
}

impl ProbeChild {
    /// Spawns `lb-probe ARGS...` with stdin and stdout piped.
    pub fn spawn(args: &[String]) -> Result<Self> {
        let mut c = std::process::Command::new(crate::probe_bin()?);
        c.args(args);
        let (mut child, line) = cmd::spawn_piped(&mut c, Stdio::piped(), Stdio::inherit())?;
        let stdout = child.stdout.take().expect("piped");
        let stdin = child.stdin.take();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        Ok(Self {
            child,
            stdin,
            lines,
            line,
        })
    }

    /// The next output line, waiting up to `timeout`.
    pub fn next_line(&self, timeout: Duration) -> Result<String> {
        self.lines
            .recv_timeout(timeout)
            .map_err(|e| anyhow!("`{}`: no output line within {timeout:?} ({e})", self.line))
    }

    /// The next line parsed as an [`Attempt`].
    pub fn next_attempt(&self, timeout: Duration) -> Result<Attempt> {
        let l = self.next_line(timeout)?;
        serde_json::from_str(&l).with_context(|| format!("bad line {l:?}"))
    }

    /// Reads attempts until the first failed one that is not a lost reply;
    /// returns it with the attempts before it. A reply missing within the
    /// probe's interval (`recv` `ETIMEDOUT`, common on a loaded machine) says
    /// nothing about the socket, which the probe keeps: such attempts are
    /// passed over, counted towards `limit`. Fails after `limit` attempts
    /// without such an error.
    pub fn until_error(&self, limit: usize) -> Result<(Attempt, Vec<Attempt>)> {
        let mut before = Vec::new();
        while before.len() < limit {
            let a = self.next_attempt(Duration::from_secs(5))?;
            if !a.ok && !a.is_lost_reply() {
                return Ok((a, before));
            }
            before.push(a);
        }
        bail!("no failed attempt among {limit}: {before:?}")
    }

    /// Writes one line to the child's stdin.
    pub fn send_line(&mut self, text: &str) -> Result<()> {
        let Some(stdin) = self.stdin.as_mut() else {
            bail!("stdin closed");
        };
        writeln!(stdin, "{text}")?;
        stdin.flush()?;
        Ok(())
    }
}

impl Drop for ProbeChild {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `lb-probe hold-tcp --read-name`: connections to a target from the
/// environment's client host, held until [`HeldTcp::close`] (or drop).
pub struct HeldTcp {
    probe: ProbeChild,
    /// Each connection's `getpeername`, or its error.
    pub peers: Vec<Result<String, String>>,
    /// Each connection's backend, by the name it wrote (`None` for a
    /// connection that failed or wrote nothing).
    pub backends: Vec<Option<String>>,
}

impl HeldTcp {
    /// Opens `sockets` connections to `target`, one after another, from
    /// the environment's client host (in its cgroup).
    pub fn open(env: &Env, target: &str, sockets: usize) -> Result<Self> {
        Self::open_from(
            Some(env.cgroup.path()),
            env.topo.client_netns(),
            target,
            sockets,
        )
    }

    /// [`open`](Self::open) from network namespace `netns`, in `cgroup`
    /// if any (an external client: none).
    pub fn open_from(
        cgroup: Option<&std::path::Path>,
        netns: &str,
        target: &str,
        sockets: usize,
    ) -> Result<Self> {
        let mut args: Vec<String> = vec!["hold-tcp".into()];
        if let Some(cg) = cgroup {
            args.extend(["--cgroup".into(), cg.display().to_string()]);
        }
        args.extend(
            [
                "--netns",
                netns,
                "--target",
                target,
                "--read-name",
                "--sockets",
            ]
            .map(String::from),
        );
        args.push(sockets.to_string());
        let probe = ProbeChild::spawn(&args)?;
        let line = probe.next_line(Duration::from_secs(60))?;
        let v: serde_json::Value =
            serde_json::from_str(&line).with_context(|| format!("hold-tcp: {line:?}"))?;
        let sockets = v["sockets"]
            .as_array()
            .ok_or_else(|| anyhow!("hold-tcp: {line}"))?;
        let peers = sockets
            .iter()
            .map(|s| match s["peer"].as_str() {
                Some(p) => Ok(p.to_string()),
                None => Err(s["error"].to_string()),
            })
            .collect();
        let backends = sockets
            .iter()
            .map(|s| s["backend"].as_str().map(str::to_string))
            .collect();
        Ok(Self {
            probe,
            peers,
            backends,
        })
    }

    /// How many of the connections reached each backend.
    pub fn per_backend(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for b in self.backends.iter().flatten() {
            *m.entry(b.clone()).or_default() += 1;
        }
        m
    }

    /// Closes the connections to backend `name`; how many.
    pub fn close_to(&mut self, name: &str) -> Result<usize> {
        self.probe.send_line(&format!("close-to {name}"))?;
        self.closed()
    }

    /// Closes every connection; how many.
    pub fn close(mut self) -> Result<usize> {
        self.probe.send_line("close")?;
        self.closed()
    }

    fn closed(&mut self) -> Result<usize> {
        let line = self.probe.next_line(Duration::from_secs(30))?;
        let v: serde_json::Value =
            serde_json::from_str(&line).with_context(|| format!("hold-tcp: {line:?}"))?;
        v["closed"]
            .as_u64()
            .map(|n| n as usize)
            .ok_or_else(|| anyhow!("hold-tcp: {line}"))
    }
}

/// `lb-probe MODE --cgroup CG --netns CLIENT --target TARGET` from the
/// environment's client host, then `extra` arguments.
fn client_probe(
    env: &Env,
    mode: &str,
    target: &str,
    extra: &[(&str, String)],
) -> Result<ProbeChild> {
    let mut args: Vec<String> = vec![
        mode.into(),
        "--cgroup".into(),
        env.cgroup.path().display().to_string(),
        "--netns".into(),
        env.topo.client_netns().into(),
        "--target".into(),
        target.into(),
    ];
    for (k, v) in extra {
        args.push(k.to_string());
        args.push(v.clone());
    }
    ProbeChild::spawn(&args)
}

/// `lb-probe hold-udp` from the environment's client host.
pub fn hold_udp(env: &Env, target: &str, interval_ms: u64, duration_ms: u64) -> Result<ProbeChild> {
    client_probe(
        env,
        "hold-udp",
        target,
        &[
            ("--interval-ms", interval_ms.to_string()),
            ("--duration-ms", duration_ms.to_string()),
        ],
    )
}

/// `lb-probe flows` with `sockets` UDP sockets from the client host.
pub fn flows(env: &Env, target: &str, sockets: usize) -> Result<Flows> {
    let p = client_probe(env, "flows", target, &[("--sockets", sockets.to_string())])?;
    Ok(Flows(p))
}

/// A running `lb-probe flows`.
pub struct Flows(pub ProbeChild);

impl Flows {
    /// One round: for each socket, the backend that answered (None: no answer).
    pub fn round(&mut self) -> Result<Vec<Option<String>>> {
        self.0.send_line("go")?;
        let l = self.0.next_line(Duration::from_secs(30))?;
        let v: Value = serde_json::from_str(&l).with_context(|| format!("bad line {l:?}"))?;
        Ok(v["backends"]
            .as_array()
            .ok_or_else(|| anyhow!("no backends in {l}"))?
            .iter()
            .map(|b| b.as_str().map(str::to_string))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_metrics() {
        let text = "# HELP x y\nlb_frontends_programmed 3\n\
                    lb_watch_restarts_total{kind=\"Service\"} 2\n\
                    lb_watch_restarts_total{kind=\"Node\"} 1\n";
        assert_eq!(metric(text, "lb_frontends_programmed"), Some(3.0));
        assert_eq!(
            metric(text, "lb_watch_restarts_total{kind=\"Service\"}"),
            Some(2.0)
        );
        assert_eq!(metric_sum(text, "lb_watch_restarts_total"), 3.0);
        assert_eq!(metric(text, "nope"), None);
    }

    #[test]
    fn conditions_and_labels() {
        let s = crate::manifests::EndpointSlice::new("demo", "web-1", "web")
            .port("http", 8080, "TCP")
            .endpoint(crate::manifests::Endpoint::ready(
                "10.244.1.1".parse().unwrap(),
            ))
            .endpoint(crate::manifests::Endpoint::ready(
                "10.244.1.2".parse().unwrap(),
            ))
            .to_value();
        let s = with_conditions(s, &["10.244.1.2".parse().unwrap()], false, true, true);
        assert_eq!(s["endpoints"][0]["conditions"]["ready"], true);
        assert_eq!(s["endpoints"][1]["conditions"]["terminating"], true);
        let v = with_maglev(with_label(json!({"metadata": {}}), "a", "b"));
        assert_eq!(v["metadata"]["labels"]["a"], "b");
        assert_eq!(
            v["metadata"]["annotations"]["lb-agent.dev/lb-algorithm"],
            "maglev"
        );
    }
}
