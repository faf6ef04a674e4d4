//! The summary at the top of BENCHMARKS.md: ours against direct, nftables
//! and iptables on each path, a line each.
use std::fmt::Write as _;

use super::{
    anchor, fmt_rate, nodeport_view, rate, ratio, scheduler_costs, span_of, spread_stat, thousands,
    RateTable, CLUSTER_IP_TABLES, CONTROL_PLANE_HEADING, NODEPORT_TABLES, SCHEDULERS_HEADING,
};
use crate::{schedulers::BALANCED, ArmKind, Results};

/// The arms ours is set against, in the table's order.
const AGAINST: [ArmKind; 4] = [
    ArmKind::Direct,
    ArmKind::Nftables,
    ArmKind::IptablesNft,
    ArmKind::IptablesLegacy,
];

pub(super) fn summary(o: &mut String, r: &Results) {
    o.push_str(
        "## Summary\n\n\
         | path | Services | lb (ours) | × direct | × nftables | × iptables (nft) | × iptables (legacy) |\n\
         |---|---:|---:|---:|---:|---:|---:|\n",
    );
    for t in &CLUSTER_IP_TABLES {
        rate_row(o, r, t, ArmKind::Ours);
    }
    let nodeport = nodeport_view(r);
    if let Some(v) = &nodeport {
        for t in &NODEPORT_TABLES {
            rate_row(o, v, t, ArmKind::Ours);
        }
        for t in &NODEPORT_TABLES {
            rate_row(o, v, t, ArmKind::OursXdp);
        }
    }
    control_plane_row(o, r);
    schedulers_row(o, r);
    o.push_str(
        "\nA × cell is ours' rate divided by that arm's in the same round, the median over rounds, \
         at the row's Services: the largest point at which every arm of the experiment ran. In \
         brackets, the lowest and highest of those medians over all the experiment's points. Above \
         1, ours is the faster; against direct, 1 is the most a load balancer can reach. The \
         control-plane row divides each tool's time to load the same Services by ours' first \
         sync. –: the arm is not part of that experiment. The goals below judge the ClusterIP \
         connect rate on the A/A control's rounds, not on these.\n",
    );
    let xdp_ran = nodeport
        .as_ref()
        .is_some_and(|v| v.samples.iter().any(|s| s.arm == ArmKind::OursXdp));
    if xdp_ran {
        o.push_str(
            "\nRows marked *with XDP*: lb (ours, XDP), ours with `--acceleration=native`, in the lb \
             (ours) column, divided the same way; its XDP stage translates the established \
             packets that leave the node again, tc still a flow's setup and close. Every NodePort \
             arm ran on the test bed XDP needs (see the NodePort section).\n",
        );
    }
    o.push('\n');
}

/// How many times ours' figure is another's: two decimals, none from 10 up.
fn fmt_times(x: f64) -> String {
    if x >= 10.0 {
        format!("{x:.0}")
    } else {
        format!("{x:.2}")
    }
}

/// `subject` (ours, or ours with XDP) against each arm in one test of one
/// experiment.
fn rate_row(o: &mut String, r: &Results, t: &RateTable, subject: ArmKind) {
    let ran = |arm: ArmKind, n: usize| rate(r, n, arm, t.mode).is_some();
    let arms: Vec<ArmKind> = ArmKind::NODEPORT
        .into_iter()
        .filter(|a| r.points.iter().any(|n| ran(*a, *n)))
        .collect();
    let at = r
        .points
        .iter()
        .rev()
        .copied()
        .find(|n| arms.iter().all(|a| ran(*a, *n)))
        .or_else(|| r.points.iter().rev().copied().find(|n| ran(subject, *n)));
    let (Some(at), Some(ours)) = (at, at.and_then(|n| rate(r, n, subject, t.mode))) else {
        return;
    };
    let cells: Vec<String> = AGAINST
        .iter()
        .map(|&arm| {
            if !arms.contains(&arm) {
                return "–".into();
            }
            let medians: Vec<f64> = r
                .points
                .iter()
                .filter_map(|n| Some(ratio(r, *n, subject, arm, t.mode)?.med))
                .collect();
            let here = ratio(r, at, subject, arm, t.mode);
            match (here, span_of(&medians, fmt_times)) {
                (Some(s), Some(span)) if span.contains('–') => {
                    format!("{} ({span})", fmt_times(s.med))
                }
                (Some(s), _) => fmt_times(s.med),
                (None, _) => "not loaded".into(),
            }
        })
        .collect();
    let with = if subject == ArmKind::OursXdp {
        ", *with XDP*"
    } else {
        ""
    };
    let _ = writeln!(
        o,
        "| [{}{with}](#{}) | {} | {} {} | {} |",
        t.path,
        anchor(t.heading),
        thousands(at),
        fmt_rate(ours.med),
        t.unit,
        cells.join(" | ")
    );
}

/// Each tool's time to load the control-plane scenario over ours' first
/// sync from manifests.
fn control_plane_row(o: &mut String, r: &Results) {
    let Some((cp, ours_ms)) = r
        .control
        .as_ref()
        .and_then(|cp| Some((cp, cp.ours_sync_ms?)))
    else {
        return;
    };
    let times = |t: &Result<f64, String>| {
        t.as_ref()
            .map_or("did not load".into(), |s| fmt_times(s * 1e3 / ours_ms))
    };
    let _ = writeln!(
        o,
        "| [control plane: first sync](#{}) | {} × {} | {ours_ms:.0} ms from manifests | – | {} | {} | {} |",
        anchor(CONTROL_PLANE_HEADING),
        thousands(cp.services),
        cp.endpoints,
        times(&cp.nft_s),
        times(&cp.iptables_nft_s),
        times(&cp.iptables_legacy_s),
    );
}

/// lc's cost over random, and how evenly each algorithm spreads.
fn schedulers_row(o: &mut String, r: &Results) {
    let Some(sc) = &r.schedulers else {
        return;
    };
    let mut parts = Vec::new();
    if let Some(over) = scheduler_costs(sc, "lc").1 {
        parts.push(format!("lc's connect4 {:+.0} ns over random", over.med));
    }
    let spreads: Vec<String> = BALANCED
        .iter()
        .filter_map(|alg| {
            let mean = spread_stat(sc, alg, |s| s.mean_ratio)?;
            Some(format!("{alg} {:.2}", mean.med))
        })
        .collect();
    if !spreads.is_empty() {
        parts.push(format!("largest backend ÷ mean: {}", spreads.join(", ")));
    }
    let _ = writeln!(
        o,
        "| [schedulers](#{}) | {} backends | {} | – | – | – | – |",
        anchor(SCHEDULERS_HEADING),
        sc.backends,
        parts.join("; ")
    );
}
