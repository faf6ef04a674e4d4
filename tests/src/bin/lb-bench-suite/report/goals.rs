//! The goals of issues 6, 13, 39 and 42, judged on the results: a line each in
//! the goals table, and a note each with every figure behind the verdict,
//! why, and the history of the figure.
use std::fmt::Write as _;

use super::{
    anchor, cluster_summary, cost, floor_cost, fmt_ratio, ms, nodeport_view, noise_floor_spreads,
    rate, ratio, scheduler_costs, span_of, tc_cost, thousands, Spreads, Stat,
};
use crate::{
    nodeport::{NodePortResults, TcCost, FLOOR_EGRESS, FLOOR_INGRESS},
    schedulers::SchedulerResults,
    ArmKind, ControlPlane, Mode, Results,
};

/// What the goals table says of a goal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    Met,
    /// A median below the goal, by less than the rounds can resolve (the
    /// goal inside the interval of the median), and none below beyond it.
    MetWithinNoise,
    Missed,
    NotMeasured,
}

impl Verdict {
    fn of(met: Option<bool>) -> Self {
        match met {
            Some(true) => Verdict::Met,
            Some(false) => Verdict::Missed,
            None => Verdict::NotMeasured,
        }
    }

    pub(super) fn label(self) -> &'static str {
        match self {
            Verdict::Met => "**met**",
            Verdict::MetWithinNoise => "**met within noise**",
            Verdict::Missed => "**missed**",
            Verdict::NotMeasured => "not measured",
        }
    }
}

pub(super) struct Goal {
    /// The goal, in a line.
    pub(super) what: &'static str,
    pub(super) verdict: Verdict,
    /// The figure the verdict rests on, short.
    pub(super) figure: String,
    /// What limits it, in a few words.
    pub(super) reason: String,
    /// The title of its note, which the row links to: goals about one
    /// figure share one.
    pub(super) note: &'static str,
    /// Every figure behind the verdict (markdown: a table or a sentence).
    pub(super) measured: String,
    /// Why, and the history of the figure.
    pub(super) explanation: String,
}

/// A note's heading, which its goals' rows link to.
pub(super) fn note_heading(title: &str) -> String {
    format!("Note: {title}")
}

/// The goals table: a line a goal, its note linked.
pub(super) fn goals_table(o: &mut String, goals: &[Goal]) {
    o.push_str("| goal | verdict | figure | what limits it, in short | |\n|---|---|---|---|---|\n");
    for g in goals {
        let _ = writeln!(
            o,
            "| {} | {} | {} | {} | [notes](#{}) |",
            g.what,
            g.verdict.label(),
            g.figure,
            g.reason,
            anchor(&note_heading(g.note))
        );
    }
    o.push('\n');
}

/// The notes: one a title, each goal under it with its verdict and
/// figures, then the explanation (once where goals share it).
pub(super) fn notes(o: &mut String, goals: &[Goal]) {
    o.push_str(
        "## Notes on the goals\n\n\
         Each goal's figures as measured in this run, then why they are what they are and how they \
         got there (the history cites the commits and reports it comes from).\n\n",
    );
    let mut titles: Vec<&str> = Vec::new();
    for g in goals {
        if !titles.contains(&g.note) {
            titles.push(g.note);
        }
    }
    for title in titles {
        let _ = writeln!(o, "### {}\n", note_heading(title));
        let mine: Vec<&Goal> = goals.iter().filter(|g| g.note == title).collect();
        for g in &mine {
            let _ = writeln!(
                o,
                "**{}**: {}.\n\n{}\n",
                g.what,
                g.verdict.label(),
                g.measured.trim_end()
            );
        }
        let mut told: Vec<&str> = Vec::new();
        for g in &mine {
            if !told.contains(&g.explanation.as_str()) {
                told.push(&g.explanation);
                let _ = writeln!(o, "{}\n", g.explanation);
            }
        }
    }
}

/// The scale points with ours' connect+close measured.
fn points_with_ours(r: &Results) -> Vec<usize> {
    r.points
        .iter()
        .copied()
        .filter(|n| rate(r, *n, ArmKind::Ours, Mode::Cc).is_some())
        .collect()
}

pub(super) fn goals(r: &Results) -> Vec<Goal> {
    let pts = points_with_ours(r);
    let mut g = vec![connect_rate_goal(r, &pts)];
    g.extend(iptables_goals(r));
    g.push(nftables_goal(r, &pts));
    g.push(connect4_goal(r, &pts));
    if let Some(cp) = &r.control {
        g.push(first_sync_goal(cp));
        g.push(endpoint_change_goal(cp));
        g.push(rss_goal(cp));
    }
    if let Some(goal) = large_rss_goal(r) {
        g.push(goal);
    }
    if let Some(np) = r.nodeport.as_ref() {
        g.extend(tc_cost_goals(np, r));
    }
    if let Some(v) = nodeport_view(r) {
        g.push(nodeport_goal(&v, r, Mode::Cc));
        g.push(nodeport_goal(&v, r, Mode::Crr));
        g.extend(xdp_goals(&v, r));
    }
    if let Some(sc) = &r.schedulers {
        g.push(lc_cost_goal(sc));
    }
    g
}

/// One scale point's connect rate, ours ÷ direct, as the goal judges it.
#[derive(Clone, Copy, Debug)]
struct PointRatio {
    services: usize,
    median: f64,
    /// The 90 % interval of the median, where the A/A control ran.
    interval: Option<(f64, f64)>,
}

impl PointRatio {
    /// Below `limit` beyond what the rounds resolve: its whole interval,
    /// or without one its median.
    fn below(&self, limit: f64) -> bool {
        match self.interval {
            Some((_, hi)) => hi < limit,
            None => self.median < limit,
        }
    }

    /// This point alone, in a few words.
    fn verdict(&self, limit: f64) -> &'static str {
        match self.interval {
            Some((lo, _)) if lo >= limit => "above, beyond the noise",
            Some(_) if self.below(limit) => "below, beyond the noise",
            Some(_) if self.median >= limit => "median above, inside the noise",
            Some(_) => "median below, inside the noise",
            None if self.median >= limit => "above (main rounds only)",
            None => "below (main rounds only)",
        }
    }
}

/// "≥ `limit` at every point": missed where a point lies below beyond the
/// noise; met where every median reaches the limit; else met within noise
/// (issue 13, decided: the limit inside the interval of every median below
/// it, and no interval wholly below).
fn at_every_point(points: &[PointRatio], limit: f64) -> Verdict {
    if points.is_empty() {
        Verdict::NotMeasured
    } else if points.iter().any(|p| p.below(limit)) {
        Verdict::Missed
    } else if points.iter().all(|p| p.median >= limit) {
        Verdict::Met
    } else {
        Verdict::MetWithinNoise
    }
}

/// `x` to three decimals, or to as many more as it takes not to read as
/// `limit` when it is not.
fn fmt_beside(x: f64, limit: f64) -> String {
    (3..=6)
        .map(|d| format!("{x:.d$}"))
        .find(|s| x == limit || s.parse::<f64>().is_ok_and(|v| v != limit))
        .unwrap_or_else(|| format!("{x}"))
}

/// connect4's share of ours' connect+close cycle at a point: its run time
/// per connect (net of the empty program beside it where that was
/// measured) over the cycle, the reciprocal of ours' connect+close rate in
/// the main rounds. Returns (ns per run, cycle in µs, share).
fn connect4_share(r: &Results, services: usize) -> Option<(f64, f64, f64)> {
    let ours = cost(r, services)?.med;
    let net = floor_cost(r, services).map_or(ours, |f| ours - f.med);
    let cycle_ns = 1e9 / rate(r, services, ArmKind::Ours, Mode::Cc)?.med;
    Some((net, cycle_ns / 1e3, net / cycle_ns))
}

/// Issue 6, judged as issue 13 decided: ours ÷ direct ≥ 0.98 at every
/// point, each point judged on its A/A control's rounds where it has them
/// (three times the rounds, beside a second direct arm), else on its main
/// rounds.
fn connect_rate_goal(r: &Results, pts: &[usize]) -> Goal {
    const LIMIT: f64 = 0.98;
    let floors: Vec<(&crate::NoiseFloor, Spreads)> = r
        .noise_floors()
        .map(|nf| (nf, noise_floor_spreads(nf)))
        .collect();
    let spreads_at = |n: usize| {
        floors
            .iter()
            .find(|(nf, _)| nf.services == n)
            .map(|(_, sp)| sp)
    };
    let judged_at = |n: usize| spreads_at(n).and_then(Spreads::judged);
    let points: Vec<PointRatio> = pts
        .iter()
        .filter_map(|&n| match judged_at(n) {
            Some((_, s)) => Some(PointRatio {
                services: n,
                median: s.med,
                interval: Some(s.interval),
            }),
            None => Some(PointRatio {
                services: n,
                median: ratio(r, n, ArmKind::Ours, ArmKind::Direct, Mode::Cc)?.med,
                interval: None,
            }),
        })
        .collect();
    let verdict = at_every_point(&points, LIMIT);
    // The point that decides: one below beyond the noise, else the lowest.
    let lowest = |ps: &mut dyn Iterator<Item = &PointRatio>| {
        ps.min_by(|a, b| a.median.total_cmp(&b.median)).copied()
    };
    let deciding = lowest(&mut points.iter().filter(|p| p.below(LIMIT)))
        .or_else(|| lowest(&mut points.iter()));
    let figure = deciding.map_or("not measured in this run".into(), |p| {
        let at = thousands(p.services);
        match p.interval {
            Some((lo, hi)) => format!(
                "{} at {at} (interval {}–{})",
                fmt_beside(p.median, LIMIT),
                fmt_beside(lo, LIMIT),
                fmt_beside(hi, LIMIT)
            ),
            None => format!("{} at {at} (main rounds)", fmt_beside(p.median, LIMIT)),
        }
    });
    let shares: Vec<(usize, (f64, f64, f64))> = pts
        .iter()
        .filter_map(|&n| Some((n, connect4_share(r, n)?)))
        .collect();
    let share_values: Vec<f64> = shares.iter().map(|(_, s)| s.2).collect();
    let share_span = span_of(&share_values, |x| format!("{:.1}", x * 100.0));
    let reason = match &share_span {
        Some(s) => format!(
            "our programs: connect4 {s} % of a connect+close cycle; sock_release not measured in \
             this run"
        ),
        None => "our programs' share of a connect+close cycle: not measured in this run".into(),
    };
    // The note: a row a point.
    let judged_name = pts
        .iter()
        .find_map(|n| judged_at(*n))
        .map_or("lb (ours) ÷ direct", |(name, _)| name);
    let mut measured = format!(
        "Judged on {judged_name} in the A/A control's rounds where a point has them, else on lb \
         (ours) ÷ direct in the main rounds; the A/A control's whole table is in \
         [its section](#{}).\n\n\
         | Services | judged ratio | 90 % interval of the median | this point | direct (again) ÷ \
         direct, interval | main rounds: lb (ours) ÷ direct | connect4, ns per run (net) | cycle, \
         µs | connect4's share |\n\
         |---:|---:|---:|---|---:|---:|---:|---:|---:|\n",
        anchor(super::AA_HEADING)
    );
    for p in &points {
        let n = p.services;
        let again = spreads_at(n)
            .and_then(|sp| sp.again.as_ref())
            .map_or("–".into(), |a| {
                format!("{:.3} ({:.3}–{:.3})", a.med, a.interval.0, a.interval.1)
            });
        let share = shares.iter().find(|(m, _)| *m == n).map(|(_, s)| *s);
        let _ = writeln!(
            measured,
            "| {} | {} | {} | {} | {again} | {} | {} | {} | {} |",
            thousands(n),
            fmt_beside(p.median, LIMIT),
            p.interval.map_or("–".into(), |(lo, hi)| format!(
                "{}–{}",
                fmt_beside(lo, LIMIT),
                fmt_beside(hi, LIMIT)
            )),
            p.verdict(LIMIT),
            fmt_ratio(ratio(r, n, ArmKind::Ours, ArmKind::Direct, Mode::Cc)).0,
            share.map_or("–".into(), |s| format!("{:.0}", s.0)),
            share.map_or("–".into(), |s| format!("{:.1}", s.1)),
            share.map_or("–".into(), |s| format!("{:.2} %", s.2 * 100.0)),
        );
    }
    let flat = match (points.first(), points.last()) {
        (Some(a), Some(b)) if points.len() > 1 => {
            format!(" (largest ÷ smallest point: {:.3})", b.median / a.median)
        }
        _ => String::new(),
    };
    let by_run_time = share_span.as_ref().map_or(
        "connect4's run time was not measured in this run".into(),
        |s| {
            let hi = share_values.iter().copied().fold(0.0, f64::max);
            format!(
                "connect4's run time per connect, net of the empty program beside it, is {s} % of \
                 ours' connect+close cycle in this run (the table above), so by that alone ours \
                 would stand at {:.3} of direct or above",
                1.0 - hi
            )
        },
    );
    let noise = if floors.is_empty() {
        " The rest is noise: the rr control, where no load balancer is involved, scatters as \
         much (a shared 2-core VM)."
    } else {
        ""
    };
    let explanation = format!(
        "Judged per point on the A/A control's rounds where the point has them: met within noise \
         when 0.98 lies inside the 90 % interval of a median below it and no point's interval \
         lies wholly below 0.98 (issue 13 decided so: 0.975–0.979 with 0.98 inside every point's \
         interval is at this machine's noise floor). What a connection of the lb arm runs: \
         connect4 and sock_release; {by_run_time}; sock_release's run time is not measured by this \
         benchmark (63–79 ns a run under BPF_ENABLE_STATS where it was measured apart, below). \
         The A/A control measures the whole connection, and with direct from \
             ours' own namespaces beside it (since 045cc2f) it puts ours lower, ~0.96–0.975 in \
             the first run that had it: a connection through our programs costs the connect \
             path more than their run time, ~0.5–0.7 µs, and where the rest goes was not found \
             (the profile below shows no other kernel symbol standing out; the programs' map \
             and context reads take cache lines the rest of the connect then misses, which \
             run time does not count, is the likeliest). \
             Measured apart from this run (Intel Xeon, SRSO not affected; a client and a server \
             namespace on one veth pair, 25 rounds of 2 s, arms shuffled each round, with an \
             A/A arm: direct again ÷ direct 0.999): the cgroup hooks themselves, empty \
             connect4 and sock_release programs on the client's cgroup, 1.002× the client \
             outside it, below what the rounds resolve; the agent's programs on a ClusterIP \
             instead, 0.981× on that topology's ~15 µs cycle (connect4 196–219 ns, \
             sock_release 63–79 ns per run over nine cost runs). Neither LB_SOCK_PEER's size \
             (16 384 against 262 144 slots: connect4 187–212 against 196–209 ns) nor the \
             hook dispatch is where the time goes; a CPU profile of the client's core \
             (perf record -C 0 -g) splits it between the program's own instructions, the \
             reverse view's slot probe and stores, the frontend's hash walk (jhash and \
             lookup_nulls_elem_raw) and the socket cookie, none of them dominant. \
             cgroup_egress, which once also ran on every packet the client sent (~50 ns each), \
             is not attached while no frontend has loadBalancerSourceRanges (782f9e5).{noise} The curve is flat: nothing on the socket path depends on the number of \
         Services{flat}."
    );
    Goal {
        what: "ClusterIP connect rate ≥ 0.98× direct at every scale point, flat",
        verdict,
        figure,
        reason,
        note: "ClusterIP connect rate",
        measured,
        explanation,
    }
}

/// Issue 6: ≥ 5× either iptables backend at 10 000 Services.
fn iptables_goals(r: &Results) -> Vec<Goal> {
    let n = 10_000;
    [ArmKind::IptablesNft, ArmKind::IptablesLegacy]
        .into_iter()
        .map(|base| {
            let s = ratio(r, n, ArmKind::Ours, base, Mode::Cc);
            let figure = s.map_or("not measured at 10 000".into(), |s| {
                format!("{:.2}× (min–max {:.2}–{:.2})", s.med, s.min, s.max)
            });
            Goal {
                what: if base == ArmKind::IptablesNft {
                    "≥ 5× iptables (nft backend) at 10 000 Services"
                } else {
                    "≥ 5× iptables (legacy backend) at 10 000 Services"
                },
                verdict: Verdict::of(s.map(|s| s.med >= 5.0)),
                measured: format!(
                    "lb (ours) ÷ {} in the same round at {}, connect+close: {figure}.",
                    base.label(),
                    thousands(n)
                ),
                figure,
                reason: "iptables' linear KUBE-SERVICES walk, first packet only".into(),
                note: "Against iptables",
                explanation: "iptables walks KUBE-SERVICES linearly for the first packet of each connection; the gap grows with the Service count and with where the target sits in the chain (last, here).".into(),
            }
        })
        .collect()
}

/// Issue 6: ≥ 1.2× nftables at every point.
fn nftables_goal(r: &Results, pts: &[usize]) -> Goal {
    let nft: Vec<(usize, Stat)> = pts
        .iter()
        .filter_map(|n| {
            Some((
                *n,
                ratio(r, *n, ArmKind::Ours, ArmKind::Nftables, Mode::Cc)?,
            ))
        })
        .collect();
    let figure = nft
        .iter()
        .map(|(n, s)| format!("{}: {:.2}×", thousands(*n), s.med))
        .collect::<Vec<_>>()
        .join(", ");
    Goal {
        what: "≥ 1.2× nftables at every scale",
        verdict: Verdict::of((!nft.is_empty()).then(|| nft.iter().all(|(_, s)| s.med >= 1.2))),
        measured: format!(
            "lb (ours) ÷ nftables in the same round, connect+close, medians: {}.",
            ratios_measured(&nft)
        ),
        figure,
        reason: "nftables' conntrack and NAT, a fraction of a connect+close".into(),
        note: "Against nftables",
        explanation: "nftables looks the Service up in a hash-backed verdict map, so it is flat too; its cost is conntrack and NAT on the first packet, per connection. With one client connection at a time on one core, that cost is a fraction of a connect+close, which bounds the ratio.".into(),
    }
}

/// What makes a program's helper and map calls cost what they do on this
/// machine, in a few words; `otherwise` where the kernel has no SRSO
/// safe-return thunk.
fn call_cost_reason(r: &Results, otherwise: &str) -> String {
    if r.machine.srso.contains("Safe RET") {
        "every helper and map call through SRSO's safe-return thunk".into()
    } else {
        otherwise.into()
    }
}

/// Issue 13 (issue 6 asked < 200 ns): connect4 ≤ 300 ns a run.
fn connect4_goal(r: &Results, pts: &[usize]) -> Goal {
    let costs: Vec<(usize, Stat)> = pts
        .iter()
        .filter_map(|n| Some((*n, cost(r, *n)?)))
        .collect();
    let floors: Vec<f64> = pts
        .iter()
        .filter_map(|n| Some(floor_cost(r, *n)?.med))
        .collect();
    let ns = |x: f64| format!("{x:.0}");
    let medians: Vec<f64> = costs.iter().map(|(_, s)| s.med).collect();
    let figure = match (span_of(&medians, ns), span_of(&floors, ns)) {
        (Some(c), Some(f)) => format!("{c} ns (an empty program: {f} ns)"),
        (Some(c), None) => format!("{c} ns"),
        (None, _) => "not measured in this run".into(),
    };
    Goal {
        what: "connect4 ≤ 300 ns per run (issue 13; issue 6 asked < 200 ns)",
        verdict: Verdict::of((!costs.is_empty()).then(|| costs.iter().all(|(_, s)| s.med <= 300.0))),
        figure,
        reason: call_cost_reason(r, "the frontend lookup, the draw and getpeername's record"),
        note: "connect4's cost",
        measured: format!(
            "Medians over the cost runs: {}.",
            costs
                .iter()
                .map(|(n, s)| {
                    let floor = floor_cost(r, *n).map_or(String::new(), |f| {
                        format!(" (an empty program: {:.0} ns)", f.med)
                    });
                    format!(
                        "{}: {:.0} ns, min–max {:.0}–{:.0}{floor}",
                        thousands(*n),
                        s.med,
                        s.min,
                        s.max
                    )
                })
                .collect::<Vec<_>>()
                .join("; ")
        ),
        explanation: "run_time_ns / run_cnt of connect4 under BPF_ENABLE_STATS (its own clock reads included: the empty program beside it shows how much). Figures differ by machine: the same code (bf476a6) measured 664 ns at 1 Service on the machine of the BENCHMARKS.md at 43884bf and 1792 ns on a later one whose kernel returns from every call through the SRSO safe-return thunk, where each helper and map call costs more. Issue 13 took out the two costliest steps, each measured against the build before it on that later machine (lb-bench-suite --points 1 --rounds 5, medians): the reverse view's preallocated hash insert, ~0.7 µs (1792 → 1095 ns when LB_SOCK_PEER became an array of slots by socket cookie, written with plain stores after an inlined lookup); the backend's hash lookup (1095 → 1008 ns when LB_BACKENDS became an array indexed by id). Each remaining step, from builds that leave out only that step (same runs): the reverse view's array write 100–170 ns (without any record: 926 ns), bpf_get_prandom_u32 60–130 ns; the rest is the frontend and slot hash lookups (a call each that hashes the key and walks a bucket), the socket cookie helper and the context's loads and stores, each a likely cache miss after the ~20 µs of kernel work between two connects on this shared 2-core VM; the round-to-round spread is 10–20%. Since then the random choice is a step of a per-CPU SplitMix64 sequence (select::draw, no helper call on 6.18): 895 and 1112 → 811 and 912 ns in two pairs of alternated runs (lb-bench-suite --points 1 --rounds 3). Then LB_SLOTS became an array too (each backend set a range from ServiceValue::slot_base, published by the value as before; the slot lookup inlined instead of a hash call): 585 and 568 → 486 and 462 ns in two alternated pairs. What is left, from a build that records no reverse view (no socket cookie, no LB_SOCK_PEER write), alternated with the full one: 333 and 375 ns against 446 and 468 ns, so getpeername's record costs ~90–110 ns (the cookie helper, a call into its own subprogram, four slot probes and the write); the empty program ~70 ns; the rest, ~260–300 ns, is the frontend's hash lookup (the one map helper call left on the path), the random draw, the slot and backend array reads, the counters and the context's loads and stores. (Those two figures predate the next change.) Then the object stopped calling memset and memmove: bpf-linker's default --bpf-expand-memcpy-in-order leaves LLVM no inline expansion for either, so every zeroed padding field and IPv4-mapped prefix (one on every connect's key) was a call into a byte-at-a-time subprogram, 111 call sites in all; built without that flag (lb-ebpf/build.rs): 527 and 553 → 474 and 434 ns in two alternated pairs. On that machine (an AMD EPYC whose kernel has the SRSO safe-return thunk: BENCHMARKS.md up to dc4b6b0, 312–394 ns with today's connect4) 300 ns was not reached without giving up the frontend that getpeername returns for every TCP socket; on an Intel Xeon without that mitigation (the header says which this run had) the same code measures ~200–230 ns, so the goal's verdict depends on the machine.".into(),
    }
}

/// Issue 13: 10 000 × 10 programmed in ≤ 250 ms, input to maps, in both
/// modes.
fn first_sync_goal(cp: &ControlPlane) -> Goal {
    let scale = format!("{} × {}", thousands(cp.services), cp.endpoints);
    let cl = cp.cluster.as_ref();
    let cluster_ms = cl.and_then(|c| c.input_to_maps_ms);
    let reason = match (cp.ours_apply_ms, cp.ours_sync_ms) {
        (Some(apply), Some(sync)) => format!("manifests: map writes {apply:.0} of {sync:.0} ms"),
        _ => "manifests: parts not measured".into(),
    };
    // Cluster mode's figure spans the lists and the sync; where they are
    // a small part of it, the rest is what to look at.
    let cluster_parts = cl.and_then(|c| {
        let lists = c
            .lists
            .iter()
            .map(|l| l.2)
            .fold(None, |m: Option<f64>, t| Some(m.map_or(t, |m| m.max(t))))?;
        Some(format!(
            "; cluster: lists (≤ {lists:.0} ms) and sync ({} ms) of {} ms",
            ms(c.sync_ms),
            ms(c.input_to_maps_ms)
        ))
    });
    Goal {
        what: "10 000 × 10 programmed in ≤ 250 ms from empty, input to maps, both modes (issue 13)",
        verdict: Verdict::of(both_within(cp, cp.ours_sync_ms, cluster_ms, 250.0)),
        figure: format!(
            "manifests {} ms, cluster mode {} ms",
            ms(cp.ours_sync_ms),
            ms(cluster_ms)
        ),
        reason: reason + &cluster_parts.unwrap_or_default(),
        note: "First sync",
        measured: format!(
            "{scale}: manifests: first sync {} ms = reading + translating the manifests {} ms + \
             map writes {} ms (the median of {} starts from empty maps: {}); agent start to \
             /readyz {} s. Cluster mode (list/watch fixture, pages of 500): {}.",
            ms(cp.ours_sync_ms),
            ms(cp.ours_read_translate_ms),
            ms(cp.ours_apply_ms),
            cp.ours_sync_runs_ms.len(),
            cp.ours_sync_runs_ms
                .iter()
                .map(|t| format!("{t:.0}"))
                .collect::<Vec<_>>()
                .join(", "),
            cp.ours_ready_s.map_or("?".into(), |s| format!("{s:.2}")),
            cl.map_or("not measured".into(), cluster_summary)
        ),
        explanation: "Judged on the whole first sync (input to maps, as iptables-restore and nft -f are timed from their input). Reading: ~11 MB of JSON decoded per object on both cores, EndpointSlices straight into a compact form of what translation reads; then every Service translated. Map writes: ~220 000 elements (backends, slots, frontends, VIP markers): the ~200 000 backends and slots are stores through a mapping of their arrays (BPF_F_MMAPABLE), the frontends and VIP markers go in BPF_MAP_UPDATE_BATCH calls; the rest is building the plan (ids, sets, per-backend use counts). In cluster mode the lists come first: 40 pages of 500 objects, one page of each kind at a time (kube-rs asks for the next page once it has decoded the last), served by the fixture on the same two cores while the agent creates its maps and loads the programs; the lists, not the sync, are most of the figure, and a real API server would serve them from another machine. On this 2-core VM that start is CPU-bound (perf, the whole machine, 20 ms bins: no idle time until the lists end): the agent's main thread creates the maps (~100 ms of kernel time: ~1.8 million preallocated LRU elements at the default sizes) and verifies the programs (~50 ms), while the runtime's two workers decode the pages (~170 ms of CPU, a fifth of it first touches of fresh memory, before the allocator change below); the sync then runs mostly on one core (translation on both, ~25 ms; the election, the plan and the map writes on one). Issue 13 measured: the fixture had cloned every object for each page (lists 2.0 s and 3.3 s, input to maps 3.5 s, before it kept them behind Arc), then still copied each page's objects and the kind's whole map per page (input to maps 956 and 1142 → 463–702 ms once it wrote pages from the stored objects), then wrote each object's text anew for every list (now once, when the object is stored, as kube-apiserver's watch cache encodes an object once for all its readers: 20 pages of 500 EndpointSlices alone 110 → 27 ms; input to maps, eight alternated pairs of the two fixtures: median 450 → 414 ms, lists 217/279 → 180/243 ms); asking for each list's next page as soon as a page's metadata names its continue token (one page ahead, a service under the kube client) was tried and dropped: no gain here, where the CPU is the limit (thirteen alternated pairs with and without it: medians 403 against 414 ms, then 328 against 344 ms), and ~7 % with a 10 ms delay per request in the fixture (input to maps ~517 → ~480 ms), as one page ahead hides only the agent's decoding of a page, never the server's time; the manifests' label indexes went from SipHash to FxHash (read + translate 155–196 → 148–169 ms, four runs each); backends and slots written through a mapping instead of batch calls (map writes, six alternated pairs: median ~125 → ~80 ms); a first definition of a label stored at once instead of through the duplicate election, and manifests decoded without serde_path_to_error unless they fail (read + translate ~235 → ~174 ms, then parsing ~100 → ~80 ms); glibc's allocator set to map apart only blocks of 4 MiB or more and to keep up to 16 MiB free at the heap's top (it mapped every block of 128 KiB or more afresh and trimmed at 128 KiB, so each ~275 KiB list page and each large vector of the sync faulted its pages in anew): minor page faults of the agent until ready ~30 500 → ~14 700, input to maps in cluster mode (lb-bench-suite --only-ours, alternated) medians 274 → 238 ms (8 pairs) and 307 → 286 ms (7 pairs, a noisier hour), peak RSS +2.5 MiB. Since then each start (three from manifests, three in cluster mode, the median judged) waits for a quiet machine first (CPUs ≥ 90 % idle over 200 ms, at most 30 s): the earlier experiments' teardown (namespaces, rule tables, maps of 100 000 Services) finishes in the kernel's workers and would be measured with the starts (in the run of BENCHMARKS.md at dc4b6b0 no start had to wait, so that was not what made that full run's starts slower than the same build's alone: cluster mode 301, 334, 349 ms there against medians of 238–307 ms in --only-ours runs of the hours around it). Boxing the watched objects' metadata (kube-rs moves each listed object several times, and the API's ObjectMeta is most of its size) was tried and dropped: six alternated runs of three starts each, input to maps and the agent's CPU time until ready both higher with the boxes (medians ~340 against ~300 ms, ~490 against ~430 ms of CPU). The goal was first met on an Intel Xeon without the SRSO mitigation (the header says which this run had) with the sync code of dc4b6b0, which measured 207 ms from manifests and 334 ms in cluster mode on the AMD EPYC with the SRSO safe-return thunk there: the machine, not a change of the agent, decided it. Agent start adds loading and verifying the programs.".into(),
    }
}

/// One endpoint change effective in < 5 ms.
fn endpoint_change_goal(cp: &ControlPlane) -> Goal {
    let change = Stat::of(cp.change_ms.clone());
    let sync = Stat::of(cp.change_sync_ms.clone());
    Goal {
        what: "one endpoint change effective in < 5 ms",
        verdict: Verdict::of(
            (cp.services >= 10_000)
                .then_some(())
                .and(change.map(|s| s.med < 5.0)),
        ),
        figure: change.map_or("not measured in this run".into(), |s| {
            format!("median {:.1} ms (min–max {:.1}–{:.1})", s.med, s.min, s.max)
        }),
        reason: sync.map_or("the agent's sync: not measured".into(), |s| {
            format!("the agent's sync alone: median {:.1} ms", s.med)
        }),
        note: "Endpoint change",
        measured: format!(
            "{} × {}: {} changes, {}; the agent's sync {}.",
            thousands(cp.services),
            cp.endpoints,
            cp.change_ms.len(),
            change.map_or("?".into(), |s| format!(
                "median {:.1} ms (min–max {:.1}–{:.1})",
                s.med, s.min, s.max
            )),
            sync.map_or("?".into(), |s| format!("median {:.1} ms", s.med))
        ),
        explanation: format!(
            "Standalone mode keeps every manifest file parsed and re-reads only the file that changed; only the Services whose objects changed are translated again, and only their frontends are compared and written (map writes {}). Measured with --sync-debounce 0s, from just before the target's manifest is written (a temporary file, then a rename) to the first connection that lands on the new endpoint, so it includes inotify's wake-up and a client connecting in a loop; the periodic full resync still translates and compares everything, outside this path. On this machine a change lands either within ~3.5 ms or after ~15 ms, whatever the agent's sync took, so the median of seven moves with how many fall slow: four alternated runs of seven changes each (lb-bench-suite --only-ours) gave medians of 3.7 and 5.7 ms for the agent before issue 13's mapped array writes and 3.6 and 3.6 ms after.",
            Stat::of(cp.change_apply_ms.clone())
                .map_or("?".into(), |s| format!("median {:.2} ms", s.med))
        ),
    }
}

/// Issue 13 (issue 6 asked < 100 MiB): ≤ 64 MiB at 10 000 × 10 in both
/// modes.
fn rss_goal(cp: &ControlPlane) -> Goal {
    let cluster = cp.cluster.as_ref().and_then(|c| c.rss_mib);
    let mib = |m: Option<f64>| m.map_or("?".into(), |m| format!("{m:.1} MiB"));
    Goal {
        what: "agent peak RSS ≤ 64 MiB at 10 000 × 10, both modes (issue 13; issue 6: < 100 MiB)",
        verdict: Verdict::of(both_within(cp, cp.ours_rss_mib, cluster, 64.0)),
        figure: format!(
            "manifests {}, cluster mode {}",
            mib(cp.ours_rss_mib),
            mib(cluster)
        ),
        reason: "the first sync holds the store, the index and both states".into(),
        note: "Agent memory",
        measured: format!(
            "{} × {}: manifests peak {} (VmHWM); cluster mode peak {} (VmHWM).",
            thousands(cp.services),
            cp.endpoints,
            mib(cp.ours_rss_mib),
            mib(cluster)
        ),
        explanation: "The peak comes during the first sync, while the store, the translation's index and desired state and the reconciler's programmed state are all held: 43 MiB of live heap at 10 000 × 10 (heaptrack, manifests mode); the rest of VmHWM is the binary's code (~8 MiB) and the allocator's headers and free room. Issue 13 cut it step by step (manifests mode, VmHWM on one machine, alternated runs): a frontend's desired state shared between translation and reconciler, plans split without a second vector, programmed backends in a hash map written 4096 at a time, glibc's mmap threshold fixed at 128 KiB and two arenas, shared key strings (104 → 88.5 MiB); frontends planned and written 1024 at a time (→ 86.2); one backend table for the use counts and the written entries, ids in use as a bitset (→ 83.5); Services stored as what translation reads, without the API type's metadata (→ 79.4); endpoint addresses kept parsed (→ 77.6); the manifests' indexes sharing one label string per object and one string per namespace (→ 68.2); a file's items boxing their rare parts (→ 67.4). In cluster mode the watches decode EndpointSlices and Services straight into the stored forms, never the API types, and skip managedFields unread (85.5 → 69.9 MiB). Last, a Service's spec and status kept as the fields translation reads, under the API's names, enumerated values as shared text, cluster IPs parsed (lb-bench-suite --only-ours, alternated: manifests 66.5 → 62.1 MiB, cluster mode 69.7 → 60.7 MiB). For the first sync's speed, glibc's mmap threshold then went from 128 KiB to 4 MiB with a trim threshold of 16 MiB (fewer page faults; see the first-sync row): +2.5 MiB at 10 000 × 10 (cluster mode 54.8 → 57.3, manifests 56.6 → 58.7 MiB), none at 100 000 Services (314.8 → 314.6 MiB after one round; glibc's dynamic threshold, as fast, took 323.9 MiB). What is left is per object: the backend table (40 bytes an endpoint), the translation's and reconciler's records of each frontend, and the slices' endpoints.".into(),
    }
}

/// Issue 13: ≤ 400 MiB at the ClusterIP experiment's 100 000 Services.
fn large_rss_goal(r: &Results) -> Option<Goal> {
    let (services, mib) = r
        .setups
        .iter()
        .filter(|s| s.arm == ArmKind::Ours && s.services >= 100_000)
        .find_map(|s| Some((s.services, s.rss_mib?)))?;
    Some(Goal {
        what: "agent peak RSS ≤ 400 MiB at 100 000 Services (issue 13)",
        verdict: Verdict::of(Some(mib <= 400.0)),
        figure: format!("{mib:.1} MiB"),
        reason: "per-object records, all held during the first sync".into(),
        note: "Agent memory",
        measured: format!(
            "{}: peak {mib:.1} MiB (VmHWM, manifests mode, the ClusterIP experiment's scale point).",
            thousands(services)
        ),
        explanation: "The same per-object costs as at 10 000 × 10, on 100 000 Services of 2 endpoints each (the fillers) and the maps' capacity the scale point asks for: the store's Services and slices, the manifests' indexes, the translation's and the reconciler's records of each frontend, all held during the first sync. Read at the end of the point, so it includes the periodic full resync (every 30 s, and when the agent continues after a round), which once held every frontend twice: 371.3 MiB after loading, 413.1 MiB at the end of the point (BENCHMARKS.md at 7e0063f); since a full translation takes the state of every unchanged frontend that the reconciler already holds, a resync peaks below the first sync (100 000 × 2 from manifests, VmHWM after a resync: 406.5 → 368.3 MB).".into(),
    })
}

/// Issue 39: lc at 10 backends costs connect4 at most 100 ns more than
/// random, in the same run.
fn lc_cost_goal(sc: &SchedulerResults) -> Goal {
    let (lc, over) = scheduler_costs(sc, "lc");
    let (random, _) = scheduler_costs(sc, "random");
    // sed runs the same scan as lc (every weight 1): the gap between the
    // two is the rounds' noise.
    let sed = scheduler_costs(sc, "sed")
        .1
        .map_or("–".into(), |o| format!("{:+.0} ns", o.med));
    Goal {
        what: "connect4 with lc at 10 backends ≤ random + 100 ns (issue 39)",
        verdict: Verdict::of(over.map(|o| o.med <= 100.0)),
        figure: over.map_or("not measured in this run".into(), |o| {
            format!("{:+.0} ns (rounds {:+.0} to {:+.0})", o.med, o.min, o.max)
        }),
        reason: format!("sed, the same scan: {sed}; the rounds' spread"),
        note: "lc's cost",
        measured: match (lc, random, over) {
            (Some(l), Some(r), Some(o)) => format!(
                "+{:.0} ns over random in the same round (rounds {:.0} to {:.0}); lc {:.0} ns, \
                 random {:.0} ns a run (medians).",
                o.med, o.min, o.max, l.med, r.med
            ),
            _ => "Not measured in this run.".into(),
        },
        // The scan's bound is lb_common's `LEAST_SCAN` (64).
        explanation: format!(
            "lc reads each backend's open count (up to 64) on a connect; sed, the same scan, \
             {sed} over random in this run: the rounds' spread is the limit; see \
             [Schedulers](#{}).",
            anchor(super::SCHEDULERS_HEADING)
        ),
    }
}

/// A tc program's cost at one point: ours, the empty program beside it,
/// and ours net of it.
struct TcPoint {
    services: usize,
    ours: Stat,
    floor: Option<Stat>,
    net: Option<Stat>,
}

fn tc_points(np: &NodePortResults, costs: &[TcCost], prog: &str, floor: &str) -> Vec<TcPoint> {
    np.points
        .iter()
        .filter_map(|&n| {
            Some(TcPoint {
                services: n,
                ours: tc_cost(costs, n, prog)?.0,
                floor: tc_cost(costs, n, floor).map(|c| c.0),
                net: tc_net_cost(costs, n, prog, floor),
            })
        })
        .collect()
}

/// Every point's figures, for a note.
fn tc_measured(points: &[TcPoint]) -> String {
    let span = |s: &Stat| format!("{:.0} ns ({:.0}–{:.0})", s.med, s.min, s.max);
    points
        .iter()
        .map(|p| {
            let net = p
                .net
                .as_ref()
                .map_or("net: no empty program measured".into(), |s| {
                    format!("net {}", span(s))
                });
            let floor = p
                .floor
                .as_ref()
                .map_or(String::new(), |s| format!(", empty program {}", span(s)));
            format!(
                "{}: {net} (ours {}{floor})",
                thousands(p.services),
                span(&p.ours)
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// The net medians, short: "1: 81 ns, 10 000: 90 ns net".
fn tc_figure(points: &[TcPoint]) -> String {
    let nets: Vec<String> = points
        .iter()
        .filter_map(|p| Some(format!("{}: {:.0} ns", thousands(p.services), p.net?.med)))
        .collect();
    if nets.is_empty() {
        "not measured in this run".into()
    } else {
        format!("{} net", nets.join(", "))
    }
}

/// Judged net of the floor: without it, not judged.
fn tc_within(points: &[TcPoint], limit: f64) -> Verdict {
    let nets: Option<Vec<f64>> = points.iter().map(|p| Some(p.net?.med)).collect();
    Verdict::of(
        nets.filter(|n| !n.is_empty())
            .map(|n| n.iter().all(|m| *m <= limit)),
    )
}

/// Issue 13's tc goals, judged on the NodePort experiment's per-run costs
/// net of the empty program beside ours (what `BPF_ENABLE_STATS` charges
/// any program here). tc_ingress is judged per established packet (issue
/// 13 decided so); a flow's setup is judged by the NodePort connect+close
/// rate, and its per-packet cost is in the note.
fn tc_cost_goals(np: &NodePortResults, r: &Results) -> Vec<Goal> {
    let setup = tc_points(np, &np.costs, "tc_ingress_eth0", FLOOR_INGRESS);
    let established = tc_points(np, &np.rr_costs, "tc_ingress_eth0", FLOOR_INGRESS);
    let egress = tc_points(np, &np.costs, "tc_egress_eth0", FLOOR_EGRESS);
    let established_measured = if established.is_empty() {
        "not measured in this run".into()
    } else {
        tc_measured(&established)
    };
    vec![
        Goal {
            what: "tc_ingress ≤ 350 ns per established packet (issue 13)",
            verdict: tc_within(&established, 350.0),
            figure: tc_figure(&established),
            reason: call_cost_reason(r, "a conntrack lookup that misses the caches"),
            note: "tc_ingress",
            measured: format!(
                "Per packet of an established flow (judged; the rr test's request and response \
                 packets on one connection, in a run of its own each round): \
                 {established_measured}. Per packet of a connect+close connection (a flow's \
                 setup, judged by the NodePort connect+close rate: [its note](#{})): {}.",
                anchor(&note_heading(NODEPORT_NOTE)),
                tc_measured(&setup)
            ),
            explanation: "Judged per established packet, the steady state of a long flow and most of a \
                 node's packets; a flow's setup is judged by the connect+close rate against \
                 nftables and direct (issue 13 decided both). run_time_ns / run_cnt of tc_ingress on n1's eth0 in the NodePort experiment's connect+close runs, all four packets of each connection (SYN, SYN-ACK, ACK, RST), with the route and neighbour work that bpf_redirect_neigh once did after the program now inside it (a resolved next hop's MACs are written by the program, which then calls bpf_redirect); net of an empty program (r0 = TCX_NEXT; exit) linked before ours on the same packets, per round. A connection's first packets write its flow (two entries into LB_CT_SYN at the SYN; both moved to LB_CONNTRACK at the client's ACK of the SYN-ACK since f3bddf9, at the SYN-ACK before), which is most of the figure; each packet's conntrack lookup misses the CPU's caches after the rest of the stack ran. Issue 13 took ten helper calls out of an established packet and the clock read out of packets that are not ours (see the NodePort section), and the memset and memmove subprogram calls out of every packet (tc_frames cost_by_packet_kind, best of four alternated runs: SYN 1944 → 1703 ns, SYN-ACK 1603 → 1433, established ACK 801 → 701, not ours 431 → 321); then each flow direction kept its next hop in its conntrack entry (CtEntry::hop, checked against the route epoch the agent moves at every rtnetlink change, and the second), so that its packets after the first skip bpf_fib_lookup (cost tests with resolved neighbours, three alternated pairs: established ACK 540–751 → 371–390 ns, RST 671–921 → 501–541 ns; in connect+close the SYN and SYN-ACK still look up, the ACK and RST do not). Conntrack tables with per-CPU LRU lists (BPF_F_NO_COMMON_LRU) were tried twice and dropped: on the SRSO machine, three alternated pairs of this experiment at 1 Service (--quick), 1911 / 2159 / 1777 ns with the common lists against 1895 / 1963 / 2096 ns with per-CPU ones, within the noise; on the Intel Xeon they cost more (both tables per-CPU: 1046 / 1028 / 1065 → 1157 / 1160 / 1136 ns; LB_CONNTRACK alone: 1032 / 1030 / 1052 → 1127 / 1085 / 1093 ns), though they remove the connect latency's p99 tail (see the NodePort section). On either machine kind the reports ran on, the remaining map operations alone exceed 350 ns per connect+close packet: 1679 / 1751 ns net on the AMD EPYC with the SRSO safe-return thunk (BENCHMARKS.md at dc4b6b0), ~1.1 µs on an Intel Xeon without it. Established packets alone (the rr figure beside: the steady state of a long flow, most of a node's packets) stay within 350 ns on that Intel Xeon; the connect+close figure is a flow's setup spread over its four packets: by difference (a quick run of this experiment at 1 Service: 1047 ns net per connect+close packet, 309 ns per established one) the SYN and its SYN-ACK cost ~1.7 µs each, the SYN choosing a backend, reserving a SNAT port and writing both entries into LB_CT_SYN, the SYN-ACK moving both into LB_CONNTRACK (two inserts, two deletes: each a cold element of a large table; since f3bddf9 the client's ACK of the SYN-ACK moves them, so that a SYN-ACK alone, which a backend sends to spoofed SYNs too, establishes nothing). The move is what keeping embryonic flows apart costs (issue 10: a SYN flood cannot evict established flows); a design without it would still write two entries at the SYN."
                .into(),
        },
        Goal {
            what: "tc_egress ≤ 40 ns per packet that is not ours (issue 13)",
            verdict: tc_within(&egress, 40.0),
            figure: tc_figure(&egress),
            reason: "its entry, the packet's first bytes, one port-bit read".into(),
            note: "tc_egress",
            measured: format!("Per packet, connect+close runs: {}.", tc_measured(&egress)),
            explanation: "Every packet leaving n1's eth0 in this experiment is one tc_egress passes as not ours: the backend is on n2, so a forwarded packet leaves from a SNAT port and a reply to the client from the node port, neither of them a local backend's port (LB_LOCAL_PORTS); only a local backend's reply is looked up. Judged net of the empty program (r0 = TCX_NEXT; exit) linked before ours on the same packets, per round: that program does nothing, and what BPF_ENABLE_STATS charges it (its two clock reads, the call) is more than 40 ns on this machine, so no program would meet the goal gross. What is left is the program's entry, the packet's first bytes and one read of LB_LOCAL_PORTS. That read was most of it while the map held an element per port (65 536 × 4 bytes: a source port's element, a new one at every SNAT port, was mostly a cache miss): three alternated pairs of this experiment at 1 Service (--quick) gave 142 / 122 / 123 ns gross, and 87 / 84 / 96 ns once the map held a bit per port (PortBits: 8 KiB a protocol, which stay cached), the same as a build that skips the read (85 / 90 / 93 ns); the empty program beside them 58–75 ns.".into(),
        },
    ]
}

/// Whether a control-plane goal is met in both modes (manifests, cluster):
/// judged at 10 000 Services only, and only with both measured.
fn both_within(
    cp: &ControlPlane,
    manifests: Option<f64>,
    cluster: Option<f64>,
    limit: f64,
) -> Option<bool> {
    (cp.services >= 10_000)
        .then_some(())
        .and(manifests.zip(cluster))
        .map(|(m, c)| m <= limit && c <= limit)
}

/// The NodePort rows' shared note.
const NODEPORT_NOTE: &str = "NodePort against the rule-based arms";

/// Not one of the goals as first written (those are about
/// ClusterIP): whether ours beats every rule-based arm through the
/// NodePort in `mode`, per round. Connect+close judges a flow's setup
/// through the tc path (issue 13 decided so).
fn nodeport_goal(v: &Results, r: &Results, mode: Mode) -> Goal {
    let others = [
        ArmKind::IptablesNft,
        ArmKind::IptablesLegacy,
        ArmKind::Nftables,
    ];
    let mut parts = Vec::new();
    let mut worst: Option<(f64, ArmKind, usize)> = None;
    for &n in &v.points {
        let mut cells = Vec::new();
        for o in others {
            if let Some(s) = ratio(v, n, ArmKind::Ours, o, mode) {
                if worst.is_none_or(|w| s.med < w.0) {
                    worst = Some((s.med, o, n));
                }
                cells.push(format!("{:.2}× {}", s.med, o.label()));
            }
        }
        if let Some(d) = ratio(v, n, ArmKind::Ours, ArmKind::Direct, mode) {
            cells.push(format!("{:.3}× direct", d.med));
        }
        if !cells.is_empty() {
            parts.push(format!("{}: {}", thousands(n), cells.join(", ")));
        }
    }
    let direct: Vec<f64> = v
        .points
        .iter()
        .filter_map(|&n| Some(ratio(v, n, ArmKind::Ours, ArmKind::Direct, mode)?.med))
        .collect();
    let figure = match worst {
        Some((x, arm, n)) => format!("worst {x:.2}× {} at {}", arm.label(), thousands(n)),
        None => "not measured in this run".into(),
    } + &span_of(&direct, |x| format!("{x:.2}"))
        .map_or(String::new(), |d| format!("; {d}× direct"));
    let dropped: u64 = r
        .nodeport
        .as_ref()
        .map_or(0, |np| np.ours_stats.iter().map(|s| s.2).sum());
    let mut explanation = String::from(
        "Ratios of our rate to each arm's in the same round (median). Every arm forwards \
         twice (n1, n2); the rule-based arms add conntrack and NAT on n1 for a flow's first \
         packet and a conntrack lookup on every packet, ours a conntrack-map lookup and \
         rewrite in tc_ingress plus a pass through tc_egress. Connect+close judges a flow's \
         setup through the tc path (its SYN, SYN-ACK, ACK and RST through tc_ingress; their \
         cost per packet is in the tc_ingress note); issue 13 decided so.",
    );
    if dropped > 0 {
        let _ = write!(
            explanation,
            " Ours dropped {dropped} new flows for want of a free SNAT port (each a 1 s stall)."
        );
    }
    let _ = write!(
        explanation,
        " See [the NodePort section](#{}).",
        anchor(super::NODEPORT_HEADING)
    );
    let (what, name) = match mode {
        Mode::Crr => (
            "NodePort TCP_CRR: ours faster than iptables and nftables at every point (no issue goal)",
            "TCP_CRR",
        ),
        _ => (
            "NodePort connect+close (a flow's setup): ours faster than iptables and nftables at every point",
            "connect+close",
        ),
    };
    Goal {
        what,
        verdict: Verdict::of(worst.map(|w| w.0 > 1.0)),
        figure,
        reason: "per-flow state in every arm: ours in tc, theirs in conntrack".into(),
        note: NODEPORT_NOTE,
        measured: format!("{name}, lb (ours) ÷ each arm: {}.", parts.join("; ")),
        explanation,
    }
}

/// The XDP rows' shared note.
const XDP_NOTE: &str = "NodePort with XDP (issue 42)";

/// `arm` ÷ `base` in `mode` at each point of `v` where both ran.
fn ratios_at(v: &Results, arm: ArmKind, base: ArmKind, mode: Mode) -> Vec<(usize, Stat)> {
    v.points
        .iter()
        .filter_map(|&n| Some((n, ratio(v, n, arm, base, mode)?)))
        .collect()
}

/// The lowest median of `ratios`, as "0.98× direct at 1 000".
fn lowest(ratios: &[(usize, Stat)], base: ArmKind) -> Option<(f64, String)> {
    ratios
        .iter()
        .min_by(|a, b| a.1.med.total_cmp(&b.1.med))
        .map(|(n, s)| {
            (
                s.med,
                format!("{:.2}× {} at {}", s.med, base.label(), thousands(*n)),
            )
        })
}

/// `ratios` per point, medians with their min–max over rounds.
fn ratios_measured(ratios: &[(usize, Stat)]) -> String {
    if ratios.is_empty() {
        return "not measured".into();
    }
    ratios
        .iter()
        .map(|(n, s)| {
            format!(
                "{}: {:.3} (min–max {:.3}–{:.3})",
                thousands(*n),
                s.med,
                s.min,
                s.max
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Issue 42's goals for the XDP stage, judged on the NodePort experiment's
/// XDP arm at every point, on the medians over rounds: connect+close with
/// acceleration on ≥ 1.0× direct and ≥ 1.3× nftables; an established
/// request/response ≥ 1.0× direct.
fn xdp_goals(v: &Results, r: &Results) -> Vec<Goal> {
    let xdp = ArmKind::OursXdp;
    let cc_direct = ratios_at(v, xdp, ArmKind::Direct, Mode::Cc);
    let cc_nft = ratios_at(v, xdp, ArmKind::Nftables, Mode::Cc);
    let rr_direct = ratios_at(v, xdp, ArmKind::Direct, Mode::Rr);
    let all_at_least = |ratios: &[(usize, Stat)], limit: f64| {
        (!ratios.is_empty()).then(|| ratios.iter().all(|(_, s)| s.med >= limit))
    };
    let tallies: Vec<String> = r
        .nodeport
        .as_ref()
        .map(|np| {
            np.xdp_tallies
                .iter()
                .filter(|t| t.ops > 0)
                .map(|t| {
                    format!(
                        "{} at {}: {:.2} packets a {} in XDP, {:.2} in tc",
                        t.mode.as_str(),
                        thousands(t.services),
                        t.xdp_translated as f64 / t.ops as f64,
                        if t.mode == Mode::Cc {
                            "connection"
                        } else {
                            "transaction"
                        },
                        t.tc_translated as f64 / t.ops as f64
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    let tallies = if tallies.is_empty() {
        "Packets translated in XDP: not counted in this run.".to_string()
    } else {
        format!(
            "Packets translated by lb (ours, XDP), over its runs of the rounds: {}.",
            tallies.join("; ")
        )
    };
    let tc_rr = ratios_at(v, ArmKind::Ours, ArmKind::Direct, Mode::Rr);
    let tc_cc = ratios_at(v, ArmKind::Ours, ArmKind::Direct, Mode::Cc);
    let xdp_over_tc = |mode| ratios_at(v, xdp, ArmKind::Ours, mode);
    let explanation = format!(
        "lb (ours, XDP) is lb (ours) with `--acceleration=native`: lb_xdp on n1's eth0 \
         translates a flow's established packets that leave n1 again, from the next hop tc \
         cached in the flow's entry, and sends them back out with XDP_TX, before the kernel \
         builds a socket buffer or routes them; direct's n1 forwards every packet through the \
         whole stack, so on established packets the XDP arm can pass direct. A flow's setup \
         (SYN, SYN-ACK, the client's ACK of it, which moves the flow into LB_CONNTRACK), its \
         FIN and RST still go through tc: every packet of a connect+close connection (SYN, \
         SYN-ACK, ACK, RST) is one of them, so none is translated in XDP (the tally: 0 \
         packets a connection) and lb_xdp only adds its pass to tc on each; the connect+close \
         goal is out of the XDP stage's reach as it stands, and rests on the tc path's setup \
         cost. Request/response on one connection is established packets only: the request \
         and the response each cross n1 once through XDP (2 packets a transaction). Every NodePort arm runs on the test bed XDP \
         needs (a pass XDP program on the switch ports, checksum offload off on the senders, \
         GSO off on the switch ports), so the ratios compare like with like. See [the NodePort \
         section](#{}).",
        anchor(super::NODEPORT_HEADING)
    );
    let cc_figure = match (
        lowest(&cc_direct, ArmKind::Direct),
        lowest(&cc_nft, ArmKind::Nftables),
    ) {
        (None, None) => "not measured in this run".into(),
        (d, n) => [d, n]
            .into_iter()
            .flatten()
            .map(|(_, s)| s)
            .collect::<Vec<_>>()
            .join("; "),
    };
    let cc_verdict = match (all_at_least(&cc_direct, 1.0), all_at_least(&cc_nft, 1.3)) {
        (Some(d), Some(n)) => Verdict::of(Some(d && n)),
        (Some(false), None) | (None, Some(false)) => Verdict::Missed,
        _ => Verdict::NotMeasured,
    };
    let rr_figure =
        lowest(&rr_direct, ArmKind::Direct).map_or("not measured in this run".into(), |(_, s)| s);
    vec![
        Goal {
            what: "NodePort connect+close with acceleration on ≥ 1.0× direct and ≥ 1.3× nftables (issue 42)",
            verdict: cc_verdict,
            figure: cc_figure,
            reason: "every connect+close packet is setup or close: tc, not XDP".into(),
            note: XDP_NOTE,
            measured: format!(
                "Connect+close, at every point, medians over rounds. lb (ours, XDP) ÷ direct: {}. \
                 lb (ours, XDP) ÷ nftables: {}. Beside them, lb (ours) ÷ direct: {}; lb (ours, \
                 XDP) ÷ lb (ours): {}. {tallies}",
                ratios_measured(&cc_direct),
                ratios_measured(&cc_nft),
                ratios_measured(&tc_cc),
                ratios_measured(&xdp_over_tc(Mode::Cc)),
            ),
            explanation: explanation.clone(),
        },
        Goal {
            what: "Established request/response through the NodePort ≥ 1.0× direct (issue 42)",
            verdict: Verdict::of(all_at_least(&rr_direct, 1.0)),
            figure: rr_figure,
            reason: "established packets in XDP, no socket buffer at n1".into(),
            note: XDP_NOTE,
            measured: format!(
                "Request/response on one connection, at every point, medians over rounds. lb \
                 (ours, XDP) ÷ direct: {}. Beside it, lb (ours) ÷ direct: {}; lb (ours, XDP) ÷ lb \
                 (ours): {}. {tallies}",
                ratios_measured(&rr_direct),
                ratios_measured(&tc_rr),
                ratios_measured(&xdp_over_tc(Mode::Rr)),
            ),
            explanation,
        },
    ]
}

/// Ours net of the empty program beside it: per round, `prog`'s ns per run
/// less `floor`'s on the same packets.
fn tc_net_cost(costs: &[TcCost], services: usize, prog: &str, floor: &str) -> Option<Stat> {
    let per_run = |name: &str, round: usize| {
        costs
            .iter()
            .find(|c| c.services == services && c.round == round && c.prog == name && c.run_cnt > 0)
            .map(|c| c.run_time_ns as f64 / c.run_cnt as f64)
    };
    let rounds: Vec<usize> = costs
        .iter()
        .filter(|c| c.services == services && c.prog == prog)
        .map(|c| c.round)
        .collect();
    Stat::of(
        rounds
            .into_iter()
            .filter_map(|round| Some(per_run(prog, round)? - per_run(floor, round)?))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::fixture;
    use crate::ArmKind as A;

    /// Issue 13's decision, point by point: met within noise when every
    /// median below 0.98 has 0.98 inside its interval, missed when any
    /// interval lies wholly below, met when every median reaches it.
    #[test]
    fn met_within_noise_needs_the_limit_inside_every_low_interval() {
        let aa = |median, lo, hi| PointRatio {
            services: 1,
            median,
            interval: Some((lo, hi)),
        };
        let main_rounds = |median| PointRatio {
            services: 1,
            median,
            interval: None,
        };
        let cases: &[(&str, Vec<PointRatio>, Verdict)] = &[
            ("nothing measured", vec![], Verdict::NotMeasured),
            (
                "every interval above",
                vec![aa(0.99, 0.985, 1.0), aa(1.01, 0.99, 1.03)],
                Verdict::Met,
            ),
            (
                "every median above, 0.98 inside an interval",
                vec![aa(0.985, 0.95, 1.01), aa(0.99, 0.985, 1.0)],
                Verdict::Met,
            ),
            (
                "the decided case: 0.975–0.979, 0.98 inside every interval",
                vec![
                    aa(0.979, 0.95, 1.01),
                    aa(0.977, 0.95, 1.0),
                    aa(0.977, 0.96, 0.99),
                    aa(0.975, 0.95, 1.01),
                ],
                Verdict::MetWithinNoise,
            ),
            (
                "one point's interval ends at 0.98 exactly: still inside",
                vec![aa(0.96, 0.93, 0.98), aa(0.99, 0.98, 1.0)],
                Verdict::MetWithinNoise,
            ),
            (
                "one point's interval wholly below",
                vec![aa(0.975, 0.95, 1.01), aa(0.958, 0.918, 0.9797)],
                Verdict::Missed,
            ),
            (
                "a point without a control, its median below",
                vec![aa(0.99, 0.985, 1.0), main_rounds(0.979)],
                Verdict::Missed,
            ),
            (
                "a point without a control, its median above",
                vec![aa(0.975, 0.95, 1.01), main_rounds(0.99)],
                Verdict::MetWithinNoise,
            ),
        ];
        for (what, points, want) in cases {
            assert_eq!(at_every_point(points, 0.98), *want, "{what}");
        }
    }

    #[test]
    fn a_figure_beside_the_limit_never_reads_as_the_limit() {
        assert_eq!(fmt_beside(0.97996, 0.98), "0.97996");
        assert_eq!(fmt_beside(0.98004, 0.98), "0.98004");
        assert_eq!(fmt_beside(0.98, 0.98), "0.980");
        assert_eq!(fmt_beside(0.9512, 0.98), "0.951");
    }

    /// The connect-rate goal judges a point on its A/A control's rounds
    /// when it has them (ours ÷ direct from ours' namespaces where
    /// measured), else on its main rounds.
    #[test]
    fn connect_rate_is_judged_per_point_on_its_a_a_control() {
        // Main rounds: ours at 0.90 of direct at both points.
        let mut samples = Vec::new();
        for n in [1, 1000] {
            for round in 0..3 {
                samples.push(fixture::sample(n, round, A::Direct, Mode::Cc, 100.0));
                samples.push(fixture::sample(n, round, A::Ours, Mode::Cc, 90.0));
            }
        }
        let floor = |n, ours| fixture::noise_floor(n, &[(A::DirectAgain, 100.0), (A::Ours, ours)]);
        let mut r = fixture::results(vec![1, 1000], samples);
        r.noise_floors = vec![floor(1, 99.0)];
        let rate_goal = |r: &Results| goals(r).swap_remove(0);
        let g = rate_goal(&r);
        assert_eq!(g.verdict, Verdict::Missed, "1 000 has only its main rounds");
        let at_1000 = format!("0.900 at {} (main rounds)", thousands(1000));
        assert_eq!(g.figure, at_1000);
        r.noise_floors.push(floor(1000, 99.0));
        assert_eq!(rate_goal(&r).verdict, Verdict::Met);
        r.noise_floors[0] = floor(1, 97.0);
        let g = rate_goal(&r);
        assert_eq!(g.verdict, Verdict::Missed, "the worst point decides");
        assert!(
            g.measured.contains("below, beyond the noise"),
            "{}",
            g.measured
        );
        // With direct from ours' namespaces in the control, the goal is
        // judged on ours ÷ that (0.96 / 0.97), not on ours ÷ the direct arm.
        let beside = |n, beside, ours| {
            fixture::noise_floor(
                n,
                &[
                    (A::DirectAgain, 100.0),
                    (A::DirectBeside, beside),
                    (A::Ours, ours),
                ],
            )
        };
        r.noise_floors = vec![beside(1, 97.0, 96.0), beside(1000, 97.0, 96.0)];
        let g = rate_goal(&r);
        assert!(g
            .measured
            .starts_with("Judged on lb (ours) ÷ direct (ours' namespaces)"));
        assert_eq!(g.verdict, Verdict::Met);
        r.noise_floors[1] = beside(1000, 99.0, 96.0);
        assert_eq!(
            rate_goal(&r).verdict,
            Verdict::Missed,
            "0.96 / 0.99 at 1 000"
        );
        assert_eq!(noise_floor_spreads(&r.noise_floors[1]).rows().len(), 5);
        assert_eq!(noise_floor_spreads(&floor(1, 99.0)).rows().len(), 3);
        // Results saved before the control ran at every point.
        r.noise_floors.clear();
        r.noise_floor = Some(floor(1, 99.0));
        assert_eq!(rate_goal(&r).figure, at_1000);
    }

    /// Beside the connect-rate verdict: connect4's run time, net of the
    /// empty program, over ours' connect+close cycle.
    #[test]
    fn the_programs_share_of_a_cycle_is_connect4_net_over_the_cycle() {
        let samples = (0..3)
            .flat_map(|round| {
                [
                    fixture::sample(1, round, A::Direct, Mode::Cc, 10_000.0),
                    fixture::sample(1, round, A::Ours, Mode::Cc, 10_000.0),
                ]
            })
            .collect();
        let mut r = fixture::results(vec![1], samples);
        let g = goals(&r).swap_remove(0);
        assert!(
            g.reason.contains("not measured in this run"),
            "{}",
            g.reason
        );
        r.costs = (0..3)
            .map(|round| fixture::cost(1, round, 1100, 100))
            .collect();
        // 1000 ns net of a 100 µs cycle.
        assert_eq!(connect4_share(&r, 1), Some((1000.0, 100.0, 0.01)));
        let g = goals(&r).swap_remove(0);
        assert!(
            g.reason.starts_with("our programs: connect4 1.0 % of a"),
            "{}",
            g.reason
        );
        assert!(
            g.reason.contains("sock_release not measured"),
            "{}",
            g.reason
        );
    }

    /// Issue 42's rows: the XDP arm's connect+close against direct (1.0)
    /// and nftables (1.3), its request/response against direct (1.0), at
    /// every point; not measured without the arm.
    #[test]
    fn xdp_goals_judge_the_xdp_arm_against_direct_and_nftables() {
        let r = fixture::whole_run();
        let xdp_goals_of = |r: &Results| xdp_goals(&nodeport_view(r).unwrap(), r);
        // The fixture: XDP at 1.02× direct, nftables at 0.8 (1.275×).
        let [cc, rr] = <[Goal; 2]>::try_from(xdp_goals_of(&r)).ok().unwrap();
        assert_eq!(cc.verdict, Verdict::Missed, "1.275× nftables");
        assert_eq!(cc.figure, "1.02× direct at 1; 1.27× nftables at 1");
        assert_eq!(rr.verdict, Verdict::Met);
        assert_eq!(rr.figure, "1.02× direct at 1");
        assert!(
            rr.measured
                .contains("rr at 1: 4.00 packets a transaction in XDP, 0.00 in tc"),
            "{}",
            rr.measured
        );
        assert!(goals(&r).iter().any(|g| g.what == cc.what));
        // Faster in connect+close: 1.1× direct, 1.375× nftables.
        let mut faster = r.clone();
        let np = faster.nodeport.as_mut().unwrap();
        for s in np.samples.iter_mut() {
            if s.arm == A::OursXdp && s.mode == Mode::Cc {
                s.run.rate *= 1.1 / 1.02;
            }
        }
        assert_eq!(xdp_goals_of(&faster)[0].verdict, Verdict::Met);
        // Below direct in request/response at one point only: missed.
        let mut slower = r.clone();
        let np = slower.nodeport.as_mut().unwrap();
        for s in np.samples.iter_mut() {
            if s.arm == A::OursXdp && s.mode == Mode::Rr && s.services == 10_000 {
                s.run.rate *= 0.9;
            }
        }
        let rr = xdp_goals_of(&slower).swap_remove(1);
        assert_eq!(rr.verdict, Verdict::Missed);
        assert_eq!(rr.figure, format!("0.92× direct at {}", thousands(10_000)));
        // Without the XDP arm (results of an earlier run).
        let mut without = r.clone();
        let np = without.nodeport.as_mut().unwrap();
        np.samples.retain(|s| s.arm != A::OursXdp);
        np.xdp_tallies.clear();
        for g in xdp_goals_of(&without) {
            assert_eq!(g.verdict, Verdict::NotMeasured, "{}", g.what);
            assert_eq!(g.figure, "not measured in this run");
        }
    }

    /// The tc goals are judged on ours less the empty program of the same
    /// round; a round without the empty program is left out, and without
    /// any the goal is not judged. tc_ingress is judged on established
    /// packets (the rr runs), the connect+close figure only shown.
    #[test]
    fn tc_costs_are_judged_net_of_the_empty_program() {
        let cost = |round, prog: &str, ns| fixture::tc_cost(1, round, prog, ns);
        let r = fixture::results(vec![1], Vec::new());
        let mut np = fixture::whole_run().nodeport.unwrap();
        np.points = vec![1];
        np.costs = vec![
            cost(0, "tc_egress_eth0", 100),
            cost(0, FLOOR_EGRESS, 60),
            cost(1, "tc_egress_eth0", 90),
            cost(1, FLOOR_EGRESS, 40),
            cost(2, "tc_egress_eth0", 80),
        ];
        np.rr_costs.clear();
        let net = tc_net_cost(&np.costs, 1, "tc_egress_eth0", FLOOR_EGRESS).unwrap();
        assert_eq!((net.min, net.med, net.max, net.n), (40.0, 45.0, 50.0, 2));
        let egress = |np: &NodePortResults| tc_cost_goals(np, &r).pop().unwrap();
        assert_eq!(egress(&np).verdict, Verdict::Missed, "a median of 45 ns");
        np.costs[3].run_time_ns = 100 * 60;
        assert_eq!(egress(&np).verdict, Verdict::Met);
        np.costs.retain(|c| c.prog != FLOOR_EGRESS);
        assert_eq!(egress(&np).verdict, Verdict::NotMeasured, "no floor");
        let ingress = |np: &NodePortResults| tc_cost_goals(np, &r).swap_remove(0);
        np.costs = vec![cost(0, "tc_ingress_eth0", 1000), cost(0, FLOOR_INGRESS, 50)];
        let g = ingress(&np);
        assert_eq!(g.verdict, Verdict::NotMeasured, "no established packets");
        assert!(g.measured.contains("1: net 950 ns"), "{}", g.measured);
        np.rr_costs = vec![cost(0, "tc_ingress_eth0", 300), cost(0, FLOOR_INGRESS, 50)];
        let g = ingress(&np);
        assert_eq!(g.verdict, Verdict::Met, "250 ns net per established packet");
        assert_eq!(g.figure, "1: 250 ns net");
        np.rr_costs[0].run_time_ns = 100 * 500;
        assert_eq!(ingress(&np).verdict, Verdict::Missed);
    }
}
