//! `RELIABILITY.md`: the method, the table of figures per phase, and each
//! phase's details (per client, the first failures, notes).
use std::{collections::BTreeMap, fmt::Write as _};

use crate::{PhaseResult, Results};

fn errors(m: &BTreeMap<String, u64>) -> String {
    if m.is_empty() {
        return "0".into();
    }
    let total: u64 = m.values().sum();
    let parts: Vec<String> = m.iter().map(|(e, n)| format!("{e} {n}")).collect();
    format!("**{total}** ({})", parts.join(", "))
}

fn count(n: u64) -> String {
    if n == 0 {
        "0".into()
    } else {
        format!("**{n}**")
    }
}

fn recovery(r: &PhaseResult) -> String {
    r.recovery_ms
        .map_or("–".into(), |ms| format!("{:.2} s", ms / 1e3))
}

const METHOD: &str = "\
## Method

One test bed for the whole run, made of network namespaces only (nothing \
leaves the machine; every client namespace lacks a default route): two \
nodes `n1`, `n2` with four pods each, one agent per node (in the node's \
namespace, its own pins and child cgroup), in cluster mode against a \
list/watch API server fixture inside that node's namespace (the two \
fixtures hold the same objects: one control plane). Service `demo/web` \
(ClusterIP `10.96.0.10`, NodePort, ports 80/TCP, 53/UDP and 90/TCP) has \
four endpoints: two pods of each node. Every pod answers with its name \
(`lb-probe serve`, and `lb-probe tcp-serve` for streams), so every answer \
says which backend it came from.

The load runs for the whole of every phase, started anew in each, so that \
each phase has its own figures:

| client | from | to |
|---|---|---|
| ClusterIP TCP | external client namespace, in node 1's agent's cgroup (socket path), route to the pods via n1 | `10.96.0.10:80`: connect, read the answer, close; every 10 ms |
| ClusterIP UDP | same | `10.96.0.10:53`: a datagram from a new unconnected socket and its answer; every 10 ms |
| ClusterIP UDP connected | same | `10.96.0.10:53`, a new connected socket each time; every 10 ms |
| NodePort TCP at n1, at n2 | a second external client (no cgroup: tc path) | `192.168.77.{1,2}:30080`, every 10 ms each; two of the four endpoints are on the other node |
| NodePort UDP at n2 | same | `192.168.77.2:30053`, every 10 ms |
| ClusterIP streams | as ClusterIP TCP | 4 echo connections to `10.96.0.10:90` held through the phase, 1000 bytes echoed on each every 200 ms |
| NodePort streams at n2 | as NodePort | 4 echo connections to `192.168.77.2:30090`, likewise |

Figures per phase: **attempted** (short attempts; streams are counted \
apart), **failed** (short attempts that got no answer, by errno: \
`ETIMEDOUT` at `recv` is a receive timeout of 2 s; a connected UDP socket that the \
agent destroyed as its backend left, `ECONNABORTED` while such a change \
was published, is by design and counted apart; so is an unconnected UDP \
datagram sent while a change takes a backend out that gets no answer or \
meets the leaving pod up to a second after the change is in the maps, \
the known limitation of tc-path UDP flows in README), **streams** and **reset** (streams \
that ended in error: `ECONNRESET`, `EPIPE`, a stall, or echoed bytes that \
differ), **misrouted** (an answer, or a stream's greeting, from a pod \
that was not in web's endpoints at any moment of the attempt: a set \
counts from its write to the API servers until both agents' maps hold \
the next one, read back with `lb-agent inspect services`; terminating \
endpoints still count as web's), **restarts** of agents, and **recovery** \
(the longest, per phase as its notes say). The goal for every phase: \
0 failed, 0 reset, 0 misrouted.

The last phase, the **instrument check**, is a negative control: it moves \
web to other pods without recording the move, then kills the server \
processes of every pod. Its misrouted, failed and reset figures must all \
be non-zero, or the run fails: zeros elsewhere mean something only if the \
same meters see these faults.
";

/// The node power loss phases side by side: each client's failures with
/// outlier detection on and off.
fn power_loss_section(s: &mut String, r: &Results) {
    let find = |detect: bool| {
        r.phases
            .iter()
            .find(|p| p.power_loss.as_ref().is_some_and(|pl| pl.detect == detect))
    };
    let (Some(on), Some(off)) = (find(true), find(false)) else {
        return;
    };
    let grace = on.power_loss.as_ref().map_or(0.0, |pl| pl.grace_s);
    let _ = writeln!(
        s,
        "## Node power loss: outlier detection on and off\n\n\
         web's two pods on n2 unreachable (links down) while the API keeps them ready for {grace:.0} s, \
         then not ready. With detection on, each TCP client may fail at most {} connects in the \
         phase (judged); off is the reference, what kube-proxy does.\n\n\
         | client | failed, on | failed, off | last failure, on | last failure, off |\n\
         |---|---|---|---:|---:|",
        crate::POWER_LOSS_LIMIT
    );
    let last = |c: Option<&crate::load::ClientFigures>| {
        c.and_then(|c| c.last_failed_s)
            .map_or("–".into(), |t| format!("{t:.1} s"))
    };
    for c in &on.load.clients {
        let o = off.load.clients.iter().find(|x| x.label == c.label);
        let _ = writeln!(
            s,
            "| {}{} | {} | {} | {} | {} |",
            c.label,
            if c.streams > 0 { " (streams)" } else { "" },
            errors(&c.failed),
            o.map_or("–".into(), |o| errors(&o.failed)),
            last(Some(c)),
            last(o)
        );
    }
    let _ = writeln!(
        s,
        "\nTCP connects fail only until each node has quarantined both lost backends (3 failed \
         connects each, a connect timing out after 1 s of silence), and once more at each \
         return from quarantine (after 10 s, then 20 s); the clients' connect timeout is 2 s. \
         UDP is not watched (README: outlier detection): datagrams to the lost pods go \
         unanswered in both runs until the pods are marked not ready. Streams already open to \
         the lost pods break in both.\n"
    );
}

pub fn render(r: &Results) -> String {
    let mut s = String::new();
    let cmd = if r.quick {
        "cargo xtask chaos --quick"
    } else {
        "cargo xtask chaos"
    };
    let _ = writeln!(s, "# Reliability under faults\n");
    let _ = writeln!(
        s,
        "Generated by `{cmd}` ({} mode: phases of {:.0} s, {:.0} s in all) on {}, \
         Linux {}, {} CPUs. Do not edit by hand: rerun the command.{}\n",
        if r.quick { "quick" } else { "full" },
        r.phase_seconds,
        r.total_seconds,
        r.date,
        r.kernel,
        r.cpus,
        if r.quick {
            " **Quick mode**: short phases, fewer faults per phase; \
             `cargo xtask chaos` runs the full one."
        } else {
            ""
        }
    );
    let failed: Vec<&str> = r
        .phases
        .iter()
        .filter(|p| !p.passed() && !p.control)
        .map(|p| p.name.as_str())
        .collect();
    let blind = r.phases.iter().any(|p| p.control && !p.passed());
    if blind {
        let _ = writeln!(
            s,
            "**Result: INVALID**: the instrument check (the last phase, a negative \
             control) did not see every fault it made, so zeros below prove nothing.\n"
        );
    }
    if failed.is_empty() && r.skipped.is_empty() {
        let power_loss = if r.phases.iter().any(|p| p.power_loss.is_some()) {
            format!(
                " in every fault phase; the node power loss with outlier detection within \
                 {} failed connects per TCP client, and 0 misrouted (the run without \
                 detection beside it is the reference)",
                crate::POWER_LOSS_LIMIT
            )
        } else {
            String::new()
        };
        let _ = writeln!(
            s,
            "**Result: every phase passed**: 0 failed, 0 reset, 0 misrouted{power_loss}. The \
             instrument check (last row, a negative control) saw the faults it made.\n"
        );
    } else {
        if !failed.is_empty() {
            let _ = writeln!(
                s,
                "**Result: FAILURES** in {} (details below).\n",
                failed.join(", ")
            );
        }
        if !r.skipped.is_empty() {
            let _ = writeln!(s, "**Not run**: {}.\n", r.skipped.join(", "));
        }
    }
    let _ = writeln!(
        s,
        "| phase | attempted | failed | streams | reset | misrouted | agent restarts | recovery |"
    );
    let _ = writeln!(s, "|---|---:|---|---:|---|---:|---:|---:|");
    for p in &r.phases {
        let _ = writeln!(
            s,
            "| {}{} | {} | {} | {} | {} | {} | {} | {} |",
            p.name,
            match (&p.error, p.control, p.passed(), &p.power_loss) {
                (Some(_), _, _, _) => " (fault failed)",
                (None, true, true, _) => " (control: non-zero expected, seen)",
                (None, true, false, _) => " (control: a fault NOT seen)",
                (None, _, true, Some(pl)) if pl.detect =>
                    " (judged: failed connects per TCP client within the limit)",
                (None, _, false, Some(pl)) if pl.detect =>
                    " (judged: a TCP client passed the limit)",
                (None, _, _, Some(_)) => " (reference: not judged)",
                _ => "",
            },
            p.load.attempted(),
            errors(&p.load.failed()),
            p.load.streams(),
            errors(&p.load.reset()),
            count(p.load.misrouted()),
            p.restarts,
            recovery(p)
        );
    }
    s.push('\n');
    power_loss_section(&mut s, r);
    s.push_str(METHOD);
    let _ = writeln!(s, "\n## Phases\n");
    for p in &r.phases {
        let _ = writeln!(s, "### {}\n", p.name);
        let _ = writeln!(s, "Fault: {}. {:.0} s.\n", p.fault, p.seconds);
        if let Some(e) = &p.error {
            let _ = writeln!(s, "**The fault itself failed**: {e}\n");
        }
        let _ = writeln!(s, "| client | attempted | failed | misrouted |");
        let _ = writeln!(s, "|---|---:|---|---:|");
        for c in &p.load.clients {
            let _ = writeln!(
                s,
                "| {} | {}{} | {} | {} |",
                c.label,
                c.attempted,
                if c.streams > 0 { " streams" } else { "" },
                errors(&c.failed),
                count(c.misrouted)
            );
        }
        s.push('\n');
        if p.load.destroyed() > 0 {
            let _ = writeln!(
                s,
                "- {} connected UDP attempts got `ECONNABORTED` while a change took a \
                 backend out: the agent destroyed their sockets as that backend left, by \
                 design (docs/kube-proxy-free.md, section 5); not counted as failed",
                p.load.destroyed()
            );
        }
        if p.load.at_removal() > 0 {
            let _ = writeln!(
                s,
                "- {} unconnected UDP datagrams sent while a backend was being removed met \
                 the leaving pod or got no answer: tc-path UDP flows are purged after the \
                 change (README, known limitations); not counted as failed or misrouted",
                p.load.at_removal()
            );
        }
        for n in &p.notes {
            let _ = writeln!(s, "- {n}");
        }
        if !p.load.examples.is_empty() {
            let _ = writeln!(
                s,
                "- first failures (seconds from the start of the phase's load):"
            );
            for e in &p.load.examples {
                let _ = writeln!(s, "  - {e}");
            }
        }
        s.push('\n');
    }
    s
}
