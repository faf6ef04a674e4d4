//! `BENCHMARKS.md` and `docs/bench.png` from the results.
use std::{collections::BTreeMap, fmt::Write as _, fs, path::Path};

use anyhow::{Context as _, Result};

use crate::{schedulers::SchedulerResults, ArmKind, ClusterStart, Mode, Results, Setup};

#[cfg(test)]
mod fixture;
mod goals;
mod summary;

/// Headings other parts of the report link to.
const AA_HEADING: &str = "Connect+close: the A/A control";
const NODEPORT_HEADING: &str = "NodePort through the tc path";
const SCHEDULERS_HEADING: &str = "Schedulers (issue 39)";
const CONTROL_PLANE_HEADING: &str = "Control plane, from empty";

/// A table of rates per point and arm in one test, and its row in the
/// summary.
struct RateTable {
    /// The table's heading, which the summary links to.
    heading: &'static str,
    /// The path and test, as the summary names them.
    path: &'static str,
    mode: Mode,
    unit: &'static str,
    latency: bool,
}

const CLUSTER_IP_TABLES: [RateTable; 4] = [
    RateTable {
        heading: "Connect+close (connections per second)",
        path: "ClusterIP connect+close",
        mode: Mode::Cc,
        unit: "conn/s",
        latency: true,
    },
    RateTable {
        heading: "TCP_CRR (transactions per second)",
        path: "ClusterIP TCP_CRR",
        mode: Mode::Crr,
        unit: "trans/s",
        latency: true,
    },
    RateTable {
        heading: "Request/response on one connection (control)",
        path: "ClusterIP request/response, established",
        mode: Mode::Rr,
        unit: "trans/s",
        latency: false,
    },
    RateTable {
        heading: "UDP request/response through the ClusterIP",
        path: "ClusterIP UDP request/response",
        mode: Mode::Udp,
        unit: "trans/s",
        latency: false,
    },
];

const NODEPORT_TABLES: [RateTable; 3] = [
    RateTable {
        heading: "NodePort connect+close (connections per second)",
        path: "NodePort connect+close",
        mode: Mode::Cc,
        unit: "conn/s",
        latency: true,
    },
    RateTable {
        heading: "NodePort TCP_CRR (transactions per second)",
        path: "NodePort TCP_CRR",
        mode: Mode::Crr,
        unit: "trans/s",
        latency: true,
    },
    RateTable {
        heading: "NodePort request/response on one connection (control)",
        path: "NodePort request/response, established",
        mode: Mode::Rr,
        unit: "trans/s",
        latency: false,
    },
];

/// The anchor GitHub gives a heading: lower case, each space a hyphen,
/// everything but letters, digits, hyphens and underscores left out.
fn anchor(heading: &str) -> String {
    heading
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            '-' | '_' => Some(c),
            c if c.is_alphanumeric() => Some(c),
            _ => None,
        })
        .collect()
}

/// The lowest and highest of `v`, as "a", or "a–b" where they read apart.
fn span_of(v: &[f64], fmt: impl Fn(f64) -> String) -> Option<String> {
    let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if !lo.is_finite() {
        return None;
    }
    let (a, b) = (fmt(lo), fmt(hi));
    Some(if a == b { a } else { format!("{a}–{b}") })
}

/// The DejaVu font Debian's `fonts-dejavu-core` installs (`cargo xtask
/// setup` installs it); the chart is drawn without text if it is missing.
const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Median, min and max.
#[derive(Clone, Copy, Debug)]
pub struct Stat {
    pub med: f64,
    pub min: f64,
    pub max: f64,
    pub n: usize,
}

impl Stat {
    pub fn of(mut v: Vec<f64>) -> Option<Stat> {
        v.retain(|x| x.is_finite());
        if v.is_empty() {
            return None;
        }
        let med = median(&mut v);
        Some(Stat {
            med,
            min: v[0],
            max: v[v.len() - 1],
            n: v.len(),
        })
    }
}

/// Per-round values of one (services, arm, mode).
fn rounds(r: &Results, services: usize, arm: ArmKind, mode: Mode) -> BTreeMap<usize, &crate::Run> {
    rounds_of(&r.samples, services, arm, mode)
}

fn rounds_of(
    samples: &[crate::Sample],
    services: usize,
    arm: ArmKind,
    mode: Mode,
) -> BTreeMap<usize, &crate::Run> {
    samples
        .iter()
        .filter(|s| s.services == services && s.arm == arm && s.mode == mode)
        .map(|s| (s.round, &s.run))
        .collect()
}

/// `arm` ÷ `base` in the same round, over rounds.
pub fn ratio(
    r: &Results,
    services: usize,
    arm: ArmKind,
    base: ArmKind,
    mode: Mode,
) -> Option<Stat> {
    Stat::of(ratios_of(&r.samples, services, arm, base, mode))
}

/// `arm` ÷ `base` of each round in which both ran, in round order.
fn ratios_of(
    samples: &[crate::Sample],
    services: usize,
    arm: ArmKind,
    base: ArmKind,
    mode: Mode,
) -> Vec<f64> {
    let a = rounds_of(samples, services, arm, mode);
    let b = rounds_of(samples, services, base, mode);
    a.iter()
        .filter_map(|(round, run)| {
            let base = b.get(round)?;
            (base.rate > 0.0).then(|| run.rate / base.rate)
        })
        .collect()
}

/// The `q` quantile of sorted `v` (linear between neighbours).
fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let at = q * (v.len() - 1) as f64;
    let (lo, hi) = (at.floor() as usize, at.ceil() as usize);
    v[lo] + (v[hi] - v[lo]) * (at - lo as f64)
}

/// A 90 % interval for the median of `v`: the 5th and 95th percentiles of
/// the medians of 4000 resamples (a percentile bootstrap, fixed seed so
/// that a report rewritten from the same results reads the same).
fn median_interval(v: &[f64]) -> (f64, f64) {
    if v.is_empty() {
        return (f64::NAN, f64::NAN);
    }
    let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (state >> 33) as usize
    };
    let mut medians: Vec<f64> = (0..4000)
        .map(|_| {
            let mut s: Vec<f64> = (0..v.len()).map(|_| v[next() % v.len()]).collect();
            median(&mut s)
        })
        .collect();
    medians.sort_by(|a, b| a.total_cmp(b));
    (quantile(&medians, 0.05), quantile(&medians, 0.95))
}

/// One ratio of the A/A control, summarised.
struct Spread {
    med: f64,
    interval: (f64, f64),
    quartiles: (f64, f64),
    min: f64,
    max: f64,
    below: usize,
    n: usize,
}

impl Spread {
    fn of(mut v: Vec<f64>) -> Option<Self> {
        v.retain(|x| x.is_finite());
        if v.is_empty() {
            return None;
        }
        v.sort_by(|a, b| a.total_cmp(b));
        Some(Spread {
            med: quantile(&v, 0.5),
            interval: median_interval(&v),
            quartiles: (quantile(&v, 0.25), quantile(&v, 0.75)),
            min: v[0],
            max: v[v.len() - 1],
            below: v.iter().filter(|x| **x < 0.98).count(),
            n: v.len(),
        })
    }
}

/// The A/A control's ratios, each of one round's rates.
struct Spreads {
    /// direct (again) ÷ direct: what noise does to a ratio that is 1.
    again: Option<Spread>,
    /// lb (ours) ÷ direct.
    ours: Option<Spread>,
    /// lb (ours) ÷ direct (again).
    ours_again: Option<Spread>,
    /// direct (ours' namespaces) ÷ direct: two topologies set up alike.
    beside: Option<Spread>,
    /// lb (ours) ÷ direct (ours' namespaces): our programs alone.
    ours_beside: Option<Spread>,
}

impl Spreads {
    /// The table's rows; results saved before the control measured direct
    /// from ours' namespaces have the first three only.
    fn rows(&self) -> Vec<(&'static str, &Option<Spread>)> {
        let mut rows = vec![
            ("direct (again) ÷ direct", &self.again),
            ("lb (ours) ÷ direct", &self.ours),
            ("lb (ours) ÷ direct (again)", &self.ours_again),
        ];
        if self.beside.is_some() || self.ours_beside.is_some() {
            rows.push(("direct (ours' namespaces) ÷ direct", &self.beside));
            rows.push(("lb (ours) ÷ direct (ours' namespaces)", &self.ours_beside));
        }
        rows
    }

    /// The ratio the goal is judged on, and its name: ours against direct
    /// from its own namespaces where measured (no second topology in the
    /// ratio), else against the direct arm.
    fn judged(&self) -> Option<(&'static str, &Spread)> {
        match (&self.ours_beside, &self.ours) {
            (Some(s), _) => Some(("lb (ours) ÷ direct (ours' namespaces)", s)),
            (None, Some(s)) => Some(("lb (ours) ÷ direct", s)),
            (None, None) => None,
        }
    }
}

fn noise_floor_spreads(nf: &crate::NoiseFloor) -> Spreads {
    let of = |arm, base| Spread::of(ratios_of(&nf.samples, nf.services, arm, base, Mode::Cc));
    Spreads {
        again: of(ArmKind::DirectAgain, ArmKind::Direct),
        ours: of(ArmKind::Ours, ArmKind::Direct),
        ours_again: of(ArmKind::Ours, ArmKind::DirectAgain),
        beside: of(ArmKind::DirectBeside, ArmKind::Direct),
        ours_beside: of(ArmKind::Ours, ArmKind::DirectBeside),
    }
}

fn noise_floor_section(o: &mut String, r: &Results) {
    let floors: Vec<&crate::NoiseFloor> = r.noise_floors().collect();
    let Some(first) = floors.first() else {
        return;
    };
    let points = floors
        .iter()
        .map(|nf| thousands(nf.services))
        .collect::<Vec<_>>()
        .join(", ");
    let _ = write!(
        o,
        "## {AA_HEADING}\n\n\
         After the main rounds of each point ({points} Services), {} more rounds of \
         connect+close only ({} ms per arm), with the point's direct and lb (ours) arms, a \
         second direct arm (its own client and backend namespaces, the same test) and, where \
         the rows show it, direct from ours' own client namespace (outside its cgroup, to the \
         backend's addresses: ours' namespaces, bridge and server without our programs), \
         shuffled each round. Two direct arms differ in nothing, so their ratio's spread is \
         what this machine's noise does to one round's ratio; the 90 % interval is that of the \
         median over the rounds (a percentile bootstrap of the rounds), what a goal judged on \
         the median can resolve. The connect-rate goal is judged on lb (ours) ÷ direct (ours' \
         namespaces) where it was measured: two topologies set up alike differ by up to ~1 % \
         (direct (again) ÷ direct), as much as the gap the goal is about, and that ratio has \
         one topology only.\n\n\
         | Services | ratio (same round) | median | 90 % interval of the median | quartiles | \
         min–max | rounds below 0.98 |\n|---:|---|---:|---:|---:|---:|---:|\n",
        first.rounds, first.cc_ms
    );
    for nf in floors {
        for (what, sp) in noise_floor_spreads(nf).rows() {
            let n = thousands(nf.services);
            match sp {
                Some(sp) => {
                    let _ = writeln!(
                        o,
                        "| {n} | {what} | {:.3} | {:.3}–{:.3} | {:.3}–{:.3} | {:.3}–{:.3} | {} of {} |",
                        sp.med,
                        sp.interval.0,
                        sp.interval.1,
                        sp.quartiles.0,
                        sp.quartiles.1,
                        sp.min,
                        sp.max,
                        sp.below,
                        sp.n
                    );
                }
                None => {
                    let _ = writeln!(o, "| {n} | {what} | – | – | – | – | – |");
                }
            }
        }
    }
    o.push('\n');
}

pub fn rate(r: &Results, services: usize, arm: ArmKind, mode: Mode) -> Option<Stat> {
    Stat::of(
        rounds(r, services, arm, mode)
            .values()
            .map(|x| x.rate)
            .collect(),
    )
}

fn field(
    r: &Results,
    services: usize,
    arm: ArmKind,
    mode: Mode,
    f: fn(&crate::Run) -> f64,
) -> Option<Stat> {
    Stat::of(
        rounds(r, services, arm, mode)
            .values()
            .map(|x| f(x))
            .collect(),
    )
}

fn arms_present(r: &Results) -> Vec<ArmKind> {
    ArmKind::NODEPORT
        .into_iter()
        .filter(|a| r.samples.iter().any(|s| s.arm == *a))
        .collect()
}

fn fmt_rate(x: f64) -> String {
    if x >= 10_000.0 {
        format!("{:.1} k", x / 1e3)
    } else {
        format!("{x:.0}")
    }
}

fn fmt_ratio(s: Option<Stat>) -> (String, String) {
    match s {
        Some(s) => (
            format!("{:.3}", s.med),
            format!("{:.3}–{:.3}", s.min, s.max),
        ),
        None => ("–".into(), "–".into()),
    }
}

/// connect4's cost per run at `services`, from each cost run's
/// (run_time_ns, run_cnt) as `of` takes them from it.
fn per_run(r: &Results, services: usize, of: impl Fn(&crate::Cost) -> (u64, u64)) -> Option<Stat> {
    Stat::of(
        r.costs
            .iter()
            .filter(|c| c.services == services)
            .map(&of)
            .filter(|(_, cnt)| *cnt > 0)
            .map(|(ns, cnt)| ns as f64 / cnt as f64)
            .collect(),
    )
}

/// The empty program's cost beside ours (`floor`), per run.
fn floor_cost(r: &Results, services: usize) -> Option<Stat> {
    per_run(r, services, |c| (c.floor_run_time_ns, c.floor_run_cnt))
}

fn cost(r: &Results, services: usize) -> Option<Stat> {
    per_run(r, services, |c| (c.run_time_ns, c.run_cnt))
}

fn mode_table(out: &mut String, r: &Results, mode: Mode, unit: &str, latency: bool) {
    let _ = write!(
        out,
        "| Services | arm | {unit} (median) | × direct (median) | × direct (min–max) |"
    );
    if latency {
        let what = if mode == Mode::Cc {
            "connect"
        } else {
            "transaction"
        };
        let _ = write!(out, " {what} p50 µs | p99 µs | p99.9 µs |");
    }
    out.push('\n');
    out.push_str("|---:|---|---:|---:|---:|");
    if latency {
        out.push_str("---:|---:|---:|");
    }
    out.push('\n');
    for &n in &r.points {
        for arm in arms_present(r) {
            let Some(rt) = rate(r, n, arm, mode) else {
                continue;
            };
            let (med, spread) = fmt_ratio(ratio(r, n, arm, ArmKind::Direct, mode));
            let _ = write!(
                out,
                "| {} | {} | {} | {med} | {spread} |",
                thousands(n),
                arm.label(),
                fmt_rate(rt.med)
            );
            if latency {
                let p = |f: fn(&crate::Run) -> f64| {
                    field(r, n, arm, mode, f).map_or("–".into(), |s| format!("{:.1}", s.med))
                };
                let _ = write!(
                    out,
                    " {} | {} | {} |",
                    p(|x| x.p50_us),
                    p(|x| x.p99_us),
                    p(|x| x.p999_us)
                );
            }
            out.push('\n');
        }
    }
    out.push('\n');
}

fn thousands(n: usize) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push('\u{202f}');
        }
        out.push(c);
    }
    out
}

fn ms(v: Option<f64>) -> String {
    v.map_or("?".into(), |x| format!("{x:.0}"))
}

/// connect4's run time per algorithm: per round, and that round's excess
/// over random (the same round, so drift of the machine cancels).
fn scheduler_costs(sc: &SchedulerResults, alg: &str) -> (Option<Stat>, Option<Stat>) {
    let of = |a: &str, round: usize| {
        sc.costs
            .iter()
            .find(|c| c.algorithm == a && c.round == round)
            .map(|c| c.per_run())
    };
    let rounds = 0..sc.rounds;
    let own = Stat::of(rounds.clone().filter_map(|k| of(alg, k)).collect());
    let over = Stat::of(
        rounds
            .filter_map(|k| Some(of(alg, k)? - of("random", k)?))
            .collect(),
    );
    (own, over)
}

/// One figure of an algorithm's spread runs, over rounds.
fn spread_stat(
    sc: &SchedulerResults,
    alg: &str,
    figure: fn(&crate::schedulers::Spread) -> f64,
) -> Option<Stat> {
    Stat::of(
        sc.spreads
            .iter()
            .filter(|s| s.algorithm == alg)
            .map(figure)
            .collect(),
    )
}

/// The schedulers experiment: connect4's cost per algorithm and the spread
/// of long-lived connections.
fn schedulers_section(o: &mut String, r: &Results) {
    let Some(sc) = &r.schedulers else {
        return;
    };
    // Busy backends and lc beside random came in one change: results
    // without the first were measured without the second too.
    let measured_under_load = sc.busy_per_backend > 0;
    let _ = writeln!(
        o,
        "## {SCHEDULERS_HEADING}\n\n\
         One agent, one ClusterIP Service per algorithm (`lb-agent.dev/lb-algorithm`), each on the \
         same {} backend addresses; {} rounds, the algorithms in a new shuffled order each round\
         {} (the spread in the first {}).{}\n\n\
         | algorithm | connect4, ns per run (median) | min–max | over random, same round (median) |\n\
         |---|---:|---:|---:|",
        sc.backends,
        sc.rounds,
        if measured_under_load {
            ", lc and random side by side"
        } else {
            ""
        },
        sc.spread_rounds,
        if measured_under_load {
            format!(
                " {} connections are held open to each backend throughout, so that lc, sed and \
                 nq scan all {} backends on every connect, as under load.",
                sc.busy_per_backend, sc.backends
            )
        } else {
            String::new()
        }
    );
    for alg in crate::schedulers::ALGORITHMS {
        let (own, over) = scheduler_costs(sc, alg);
        let Some(own) = own else { continue };
        let over = match over {
            Some(o) if *alg != "random" => format!("{:+.0} ns", o.med),
            _ => "–".into(),
        };
        let _ = writeln!(
            o,
            "| {alg} | {:.0} | {:.0}–{:.0} | {over} |",
            own.med, own.min, own.max
        );
    }
    o.push_str(
        "\n| algorithm | largest backend ÷ mean, mean over steps | 99th percentile | worst step |\n\
         |---|---:|---:|---:|\n",
    );
    for alg in crate::schedulers::BALANCED {
        let (Some(mean), Some(p99), Some(worst)) = (
            spread_stat(sc, alg, |s| s.mean_ratio),
            spread_stat(sc, alg, |s| s.p99_ratio),
            spread_stat(sc, alg, |s| s.max_ratio),
        ) else {
            continue;
        };
        let _ = writeln!(
            o,
            "| {alg} | {:.2} | {:.2} | {:.2} |",
            mean.med, p99.med, worst.max
        );
    }
    let _ = writeln!(
        o,
        "\nSpread: `lb-bench client --mode hold` keeps {} connections open to the Service, then {} \
         times closes one chosen at random and opens another; after each open, the backend holding \
         the most open connections is divided by the mean ({}); 1.00 is perfect balance. Each \
         connection's backend is the address the server's greeting names (getpeername answers the \
         Service address). Medians over rounds; the worst step is the largest of all rounds. \
         connect4's cost comes from `BPF_ENABLE_STATS` in a connect+close run at that Service \
         alone (its own clock reads included); the difference to random is taken within a round, \
         so that drift of the machine cancels.\n",
        sc.open,
        sc.steps,
        sc.open as f64 / sc.backends.max(1) as f64
    );
}

/// Cluster mode's start, in one sentence.
fn cluster_summary(c: &ClusterStart) -> String {
    let lists: Vec<String> = c
        .lists
        .iter()
        .map(|(kind, n, t)| format!("{kind} {n} objects in {t:.0} ms"))
        .collect();
    format!(
        "watches started → every object in the maps {} ms{} (lists: {}; the first sync after them {} ms = translation {} ms + map writes {} ms); agent start to /readyz {} s{}; peak RSS {}; frontends programmed {}",
        ms(c.input_to_maps_ms),
        if c.runs_ms.len() > 1 {
            let runs: Vec<String> = c.runs_ms.iter().map(|r| format!("{r:.0}")).collect();
            format!(
                " (the median of {} starts: {})",
                c.runs_ms.len(),
                runs.join(", ")
            )
        } else {
            String::new()
        },
        if lists.is_empty() { "?".into() } else { lists.join(", ") },
        ms(c.sync_ms),
        ms(c.read_translate_ms),
        ms(c.apply_ms),
        c.ready_s.map_or("?".into(), |s| format!("{s:.2}")),
        c.cpu_ms
            .zip(c.minor_faults)
            .map_or(String::new(), |(cpu, faults)| format!(
                " (agent CPU time by then {cpu:.0} ms, {faults} minor page faults)"
            )),
        c.rss_mib.map_or("?".into(), |m| format!("{m:.1} MiB")),
        c.frontends
            .map_or("?".into(), |(got, want)| format!("{got} of {want}"))
    )
}

/// The NodePort experiment's samples and points in a `Results` of their
/// own, so that the ClusterIP tables' helpers read them.
fn nodeport_view(r: &Results) -> Option<Results> {
    let np = r.nodeport.as_ref()?;
    if np.samples.is_empty() {
        return None;
    }
    let mut v = r.clone();
    v.points = np.points.clone();
    v.samples = np.samples.clone();
    v.rounds = np.rounds;
    v.durations_ms = np.durations_ms.clone();
    v.nodeport = None;
    Some(v)
}

fn tc_cost(costs: &[crate::nodeport::TcCost], services: usize, prog: &str) -> Option<(Stat, Stat)> {
    let c: Vec<&crate::nodeport::TcCost> = costs
        .iter()
        .filter(|c| c.services == services && c.prog == prog && c.run_cnt > 0 && c.conns > 0)
        .collect();
    Some((
        Stat::of(
            c.iter()
                .map(|c| c.run_time_ns as f64 / c.run_cnt as f64)
                .collect(),
        )?,
        Stat::of(
            c.iter()
                .map(|c| c.run_cnt as f64 / c.conns as f64)
                .collect(),
        )?,
    ))
}

/// Rows of the tc programs' cost: per point and program, ns per run and
/// runs per connection (or transaction).
fn tc_cost_table(
    o: &mut String,
    np: &crate::nodeport::NodePortResults,
    costs: &[crate::nodeport::TcCost],
) {
    let mut progs: Vec<&str> = costs.iter().map(|c| c.prog.as_str()).collect();
    progs.sort();
    progs.dedup();
    for &n in &np.points {
        for prog in &progs {
            if let Some((ns, runs)) = tc_cost(costs, n, prog) {
                let _ = writeln!(
                    o,
                    "| {} | `{prog}` | {:.0} | {:.0}–{:.0} | {:.2} | {:.0} |",
                    thousands(n),
                    ns.med,
                    ns.min,
                    ns.max,
                    runs.med,
                    ns.med * runs.med
                );
            }
        }
    }
}

fn nodeport_section(o: &mut String, r: &Results) {
    let (Some(np), Some(v)) = (r.nodeport.as_ref(), nodeport_view(r)) else {
        return;
    };
    let durs: Vec<String> = np
        .durations_ms
        .iter()
        .map(|(m, ms)| format!("{} {ms} ms", m.as_str()))
        .collect();
    let pts: Vec<String> = np.points.iter().map(|n| thousands(*n)).collect();
    let _ = writeln!(
        o,
        "## {NODEPORT_HEADING}\n\n\
         ### Method\n\n\
         An external client reaches a NodePort of a node; the Service's endpoints are on another \
         node, so the entry node must DNAT and masquerade (`externalTrafficPolicy: Cluster`, the \
         default). Namespaces, one set per arm: the client (192.168.77.100, no default route) and \
         two nodes on a bridge in a switch namespace; the node under test, n1 (192.168.77.1), has \
         no pods; n2 routes to its pod namespace, which holds the {} endpoint addresses \
         10.244.2.10… and runs `lb-bench server` pinned to core 1 (the client is pinned to core 0). \
         n1 forwards with a route to n2's pod CIDR, back out of the device it received on (ICMP \
         redirects off); n2 routes replies to the client via n1, so every arm's packets cross n1 in \
         both directions. Every arm's namespaces are made ready for XDP as the XDP arm needs \
         (`Cluster::accelerate`): a pass XDP program on the nodes' switch-side veth ports (veth \
         delivers an `XDP_TX` frame to its peer promptly only when the peer runs XDP itself), \
         checksum offload off on the senders (client and pod: XDP updates checksums as complete, \
         as a NIC delivers them) and `tx off gso off` on the switch ports (no GRO-merged frame \
         reaches a node's XDP). This changes every arm's per-packet work, so all arms share it; \
         the direct arm's sanity run checks that its packets still cross n1.\n\n\
         - **direct**: the client has a route for the pod CIDR via n1 and connects to the pod \
         addresses; n1 and n2 only forward. The limit.\n\
         - **lb (ours)**: `lb-agent run` in n1 (`nsenter --net`, its own pins and child cgroup), \
         `--devices eth0`, a manifests directory with a `v1 Node` for n1, the fillers and the \
         target as a NodePort Service (node port {}) whose endpoints carry `nodeName: n2`. \
         `tc_ingress` on n1's `eth0` DNATs and SNATs a flow's first packet and records both \
         directions in `LB_CONNTRACK`; later packets and the replies are rewritten from there and \
         redirected out again; `tc_egress` runs on every packet leaving `eth0`. The agent is paused \
         (SIGSTOP) during the rounds, as in the ClusterIP experiment.\n\
         - **lb (ours, XDP)**: the same with `--acceleration=native`: `lb_xdp` on n1's `eth0` \
         translates a flow's established packets that leave n1 again (to n2, and the replies to \
         the client) from the next hop tc_ingress cached in the flow's `LB_CONNTRACK` entry and \
         sends them back out with `XDP_TX`, before the kernel builds a socket buffer; a flow's \
         setup (SYN, SYN-ACK, the ACK of it), FIN and RST still go through tc. Its packets in \
         XDP and in tc are counted from `LB_STATS` around each run (below).\n\
         - **iptables (nft)** / **iptables (legacy)**: kube-proxy's iptables-mode rules loaded into \
         n1: the ClusterIP experiment's shape plus `PREROUTING` → `KUBE-SERVICES`, walked to its \
         last rule (`-m addrtype --dst-type LOCAL -j KUBE-NODEPORTS`) → `KUBE-NODEPORTS` \
         (`-p tcp --dport {}`) → `KUBE-EXT-*` (`KUBE-MARK-MASQ`, then the Service's `KUBE-SVC-*`) → \
         `statistic` → `KUBE-SEP-*` DNAT, `KUBE-POSTROUTING` masquerading marked packets, and the \
         filter table's `INPUT`/`FORWARD` jumps with `KUBE-FORWARD` (drop `INVALID`, accept marked \
         and established).\n\
         - **nftables**: kube-proxy's nftables shape in n1 with the default `--nodeport-addresses`: \
         `nat-prerouting` → `services`: `ip daddr . meta l4proto . th dport vmap @service-ips`, \
         then `fib daddr type local ip daddr != 127.0.0.0/8 meta l4proto . th dport vmap \
         @service-nodeports` → `external-*` (mark for masquerade, `goto` the Service chain) → \
         `numgen random` → endpoint chain DNAT; `masquerading` in `nat-postrouting`; the \
         `filter-prerouting-pre-dnat`, `filter-input` and `filter-forward` checks on new \
         connections.\n\n\
         Scale points: {} Services (fewer than the ClusterIP experiment, to keep the run short), \
         the same filler ClusterIP Services as there, the target last. Because the fillers are \
         ClusterIP Services, with iptables the NodePort packet walks every filler's \
         `KUBE-SERVICES` rule before reaching `KUBE-NODEPORTS`, which holds only the target \
         (filler NodePorts would lengthen it too). Tests ({}), {} rounds, each arm once per round \
         in a shuffled order, ratios to direct per round as above. The tc programs' cost comes \
         from `BPF_ENABLE_STATS` in a separate connect+close run per round.\n",
        r.target_endpoints,
        np.node_port,
        np.node_port,
        pts.join(" and "),
        durs.join(", "),
        np.rounds
    );
    for t in &NODEPORT_TABLES {
        let _ = writeln!(o, "### {}\n", t.heading);
        mode_table(o, &v, t.mode, t.unit, t.latency);
    }
    o.push_str(
        "### Our tc programs' cost\n\n\
         Per run (one packet), and runs per connect+close connection (SYN, SYN-ACK, ACK and RST, \
         each arriving on n1's `eth0` and leaving by it again). `empty_tc_*` is an empty program (`r0 = TCX_NEXT; exit`) linked before ours on the same side of `eth0` during the same runs: the floor `BPF_ENABLE_STATS` charges any tc program here.\n\n\
         | Services | program | ns per run (median) | min–max | runs per connection | ns per connection |\n\
         |---:|---|---:|---:|---:|---:|\n",
    );
    tc_cost_table(o, np, &np.costs);
    if !np.rr_costs.is_empty() {
        o.push_str(
            "\nThe same programs in a request/response run of their own each round (one \
             connection, 64 bytes each way): packets of an established flow only, each arriving \
             on n1's `eth0` and leaving by it again; runs per transaction.\n\n\
             | Services | program | ns per run (median) | min–max | runs per transaction | ns per transaction |\n\
             |---:|---|---:|---:|---:|---:|\n",
        );
        tc_cost_table(o, np, &np.rr_costs);
    }
    if !np.xdp_tallies.is_empty() {
        o.push_str(
            "\nlb (ours, XDP): packets translated in XDP (`xdp_translated`) and in tc \
             (`tc_translated`) during its runs of the rounds, read from `LB_STATS` before and \
             after each run (the agent paused, so not through its metrics endpoint), per \
             connection or transaction.\n\n\
             | Services | test | operations | in XDP | in tc | XDP per operation | tc per operation | share in XDP |\n\
             |---:|---|---:|---:|---:|---:|---:|---:|\n",
        );
        for t in &np.xdp_tallies {
            let per = |x: u64| {
                if t.ops == 0 {
                    "–".into()
                } else {
                    format!("{:.2}", x as f64 / t.ops as f64)
                }
            };
            let all = t.xdp_translated + t.tc_translated;
            let share = if all == 0 {
                "–".into()
            } else {
                format!("{:.1} %", 100.0 * t.xdp_translated as f64 / all as f64)
            };
            let _ = writeln!(
                o,
                "| {} | {} | {} | {} | {} | {} | {} | {share} |",
                thousands(t.services),
                t.mode.as_str(),
                t.ops,
                t.xdp_translated,
                t.tc_translated,
                per(t.xdp_translated),
                per(t.tc_translated),
            );
        }
    }
    for (n, translated, failed) in &np.ours_stats {
        let _ = writeln!(
            o,
            "\nlb (ours) at {} Services, over all rounds: {translated} packets translated, **{failed} \
             new flows dropped for want of a free SNAT port** (`LB_STATS` `TC_DROP_SNAT_EXHAUSTED`).",
            thousands(*n)
        );
    }
    o.push_str(
        "\nWhere tc_ingress's time goes, per kind of packet of a masqueraded TCP flow, from \
         `BPF_PROG_TEST_RUN` on crafted frames (`cargo test --release -p lb-agent --test \
         tc_frames cost_by_packet_kind -- --ignored --nocapture`; medians on this machine, \
         small maps): the SYN ~1.6 µs (the backend choice, a SNAT port reserved with \
         `BPF_NOEXIST` after a check of `LB_CONNTRACK`, both entries written into `LB_CT_SYN`); \
         the backend's SYN-ACK ~1.4 µs (the flow moved to `LB_CONNTRACK`: two inserts, two \
         deletes; since f3bddf9 the client's ACK of it does); an established packet, either way, ~0.8 µs (one lookup, the state bytes, \
         four rewrites with their checksum helpers, the FIB lookup with the MTU check); an RST \
         ~0.9 µs (its window check reads the other direction). The SYN table (SYN-flood \
         resistance) and the RST check are what the TCP states of issue 10 added; before them \
         this benchmark measured ~0.65 µs per run.\n\n\
         The per-run figures above are about twice what those test runs suggest (~1.2 µs on \
         average), because a test run finds the maps in the CPU's caches and real traffic does \
         not. `cost_with_cold_caches` in the same file shows it (default conntrack sizes, \
         20 000 established flows; medians of two runs, one on a quiet machine and one with \
         builds running, so compare ratios): an established ACK costs 0.75–1.0 µs in \
         tc_ingress when one flow is sent again and again, 1.0–1.8 µs when every flow is taken \
         in turn (each run another bucket and entry), and 1.6–2.6 µs when 1 MiB of memory (this \
         machine's L2) is written between runs, as the rest of the stack does between two \
         packets: 2.1–2.5 times the first figure, as the per-run figure measured here is about \
         twice the test runs'. tc_egress went the same way (~150 ns, 290–360 ns, 540–580 ns; \
         ~480 ns per run here) until it decided \"not ours\" from the source port \
         (`LB_LOCAL_PORTS`) before its conntrack lookup: 240 → 171 ns, 351 → 271 ns, 540 → 351 ns \
         in one run of `cost_with_cold_caches` before and after (issue 13; docs/maps.md), and \
         later decided it from the packet's bytes before copying the packet's addresses out \
         (`surely_not_a_reply`): medians of four alternated runs of each build on the SRSO \
         machine, 240 → 136 ns (one flow), 356 → 260 ns (flows in turn), 496 → 335 ns (1 MiB \
         written between runs). Both port maps then became a bit per port (`PortBits`: \
         8 KiB a protocol instead of an element of 4 bytes per port over 256 KiB), so the \
         one read a packet that is not ours costs stays in the caches: tc_egress in this \
         experiment (three alternated pairs at 1 Service, `--quick`) 142 / 122 / 123 → \
         87 / 84 / 96 ns per run, the same as a build that skips the read. \
         Since issue 13 a masqueraded packet whose next hop is resolved also leaves with the \
         MACs the program writes and `bpf_redirect`, not `bpf_redirect_neigh`, so the route \
         and neighbour lookup after the program is gone and the two stores are in tc_ingress's \
         figure. Conntrack maps a third of the \
         default size did not change the figure (measured), since either is far larger than \
         the caches. A CPU profile of this experiment's lb arm (`perf record -a -g -e \
         cpu-clock`, the samples under tc_ingress) agrees: 28% the program's own instructions, \
         15% the FIB lookup, 15% walking hash buckets (`lookup_nulls_elem_raw`, the conntrack \
         lookups missing the cache), 14% inserting LRU entries and 6% deleting them (a SYN \
         writes two into `LB_CT_SYN`, its SYN-ACK moved both to `LB_CONNTRACK`: now the client's \
         ACK of it), 5% zeroing \
         entries, 5% the L4 checksum helper, 5% the service, slot and backend lookups, 4% \
         storing bytes, 2% reading the clock; in tc_egress 66% is the bucket walk of its one \
         conntrack lookup, a miss for most packets there (profiled before `LB_LOCAL_PORTS`). \
         What makes the tc path cheaper is therefore touching less memory per packet (fewer \
         tables per flow, tc_egress deciding \"not ours\" before any lookup), more than fewer \
         instructions, on the machine these figures come from: there, replacing the per-field \
         checksum helpers of an established packet by one difference for the addresses and \
         one for the ports, computed in the program, measured 911 → 901 ns \
         (`cost_by_packet_kind`), within the noise. On a machine whose kernel returns from \
         every call through the SRSO safe-return thunk (`/sys/devices/system/cpu/\
         vulnerabilities/spec_rstack_overflow`: \"Mitigation: Safe RET\"), every helper call \
         costs far more and the same test measures about twice the figures above; there the \
         change (a masqueraded packet's addresses, ports and IPv4 header checksum stored \
         directly, the transport checksum updated by two differences, the MACs stored \
         directly: ten helper calls fewer) took an established ACK from 1440 to 1217 ns \
         (medians of six runs of each build, alternated; their ranges 1162–1663 and \
         1112–1293 ns), and it was kept (issue 13). A packet that is not ours (no flow, no \
         frontend: the node's own traffic) no longer reads the clock, which only a flow or a \
         frontend needs: 711 → 571 ns there (medians of five alternated runs; the sixth kind \
         `cost_by_packet_kind` prints). Later such a packet was decided from its bytes and \
         `LB_FRONTEND_PORTS` (its destination port neither a frontend's nor a SNAT port) \
         before any lookup: 331–340 → 130–140 ns (three alternated runs; issue 13, \
         docs/maps.md).\n\n\
         Ours' connect p99 in the connect+close table is above the rule-based arms' (about \
         60 µs against 40 µs in the quick runs cited here) while its p50 is the lowest. By the \
         kernel's `bpf_lru_list.c`, and the experiment below that removes it: about one \
         connection in 64 waits ~20 µs more behind a move into `LB_CONNTRACK` (at a \
         client's ACK, two inserts) that found its CPU's local free list of the map empty, \
         its SYN queued on that CPU meanwhile. With the common LRU \
         lists (the kernel's default), that CPU then takes the map's global lock, flushes the \
         elements it took since the last refill into the LRU lists, rotates them, and moves 128 \
         free elements to its local list: a few hundred cache misses at once. Each connection \
         takes two new elements there, held until the close timeout; those of `LB_CT_SYN` \
         return to the local list when the flow moves and rarely need a refill. Per-CPU lists \
         (`BPF_F_NO_COMMON_LRU`) do that work a little at every insert instead: `LB_CONNTRACK` \
         with per-CPU lists, three alternated pairs of quick runs at 1 Service (`--quick \
         --no-control-plane --no-datapath --nodeport-points 1`, the agent given by \
         `LB_AGENT_BIN`): connect p99 62 / 55 / 60 → 37 / 38 / 41 µs, p50 24.7 / 24.4 / 24.7 → \
         24.8 / 25.4 / 25.6 µs, rate 32.9 / 33.7 / 33.5 → 33.4 / 32.5 / 32.5 k, tc_ingress \
         1032 / 1030 / 1052 → 1127 / 1085 / 1093 ns per run. The common lists stay: the tail \
         is the price of the lower mean, and per-CPU lists split a table's capacity evenly over \
         the possible CPUs (`/sys/devices/system/cpu/possible`), which on a VM that declares \
         more CPUs than it runs would leave established flows a fraction of `--max-conntrack` \
         and evict them early. The rule-based arms allocate conntrack entries from the slab, \
         which has no such batch.\n",
    );
    if np.ours_stats.iter().any(|s| s.2 > 0) {
        o.push_str(
            "\nWhy: a masqueraded flow takes a source port per backend address and port from \
             the SNAT range (1024–29999 with the default `ip_local_port_range`), and keeps it \
             until its flow is reset, the client reopens its port, or its `LB_CONNTRACK` entry \
             expires (`--conntrack-tcp-close-timeout`, 10 s, after a FIN or an RST); `reserve_snat` \
             tries 16 random ports, then the port of a handshake idle for 3 s, before it drops \
             the SYN, and the client retransmits only after its 1 s timeout. See docs/maps.md, SNAT ports.\n",
        );
    }
    loading_table(o, "\n### Loading (NodePort)\n\n", &np.setups);
    o.push('\n');
    for n in &np.notes {
        let _ = writeln!(o, "- {n}");
    }
    if !np.notes.is_empty() {
        o.push('\n');
    }
}

pub fn write(root: &Path, r: &Results) -> Result<()> {
    let md = markdown(r);
    fs::write(root.join("BENCHMARKS.md"), md).context("writing BENCHMARKS.md")?;
    fs::create_dir_all(root.join("docs"))?;
    chart(&root.join("docs/bench.png"), r).context("drawing docs/bench.png")?;
    Ok(())
}

fn markdown(r: &Results) -> String {
    let m = &r.machine;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "# Benchmarks\n\n\
         Regenerated by `cargo xtask bench{}` (as root). Do not edit by hand.\n",
        if r.quick { " --quick" } else { "" }
    );
    if r.quick {
        o.push_str("**This is a `--quick` run: small scale points, few rounds, short runs. Use it for development, not for claims.**\n\n");
    }
    let _ = writeln!(
        o,
        "| | |\n|---|---|\n| date | {} |\n| commit | {} |\n| CPU | {} × {} |\n| SRSO (spec_rstack_overflow) | {} |\n| memory | {} |\n| kernel | {} |\n| iptables | {} |\n| nftables | {} |\n| duration | {:.0} s |\n",
        m.date,
        m.commit,
        m.cores,
        m.cpu,
        if m.srso.is_empty() { "not recorded" } else { &m.srso },
        m.memory,
        m.kernel,
        m.iptables,
        m.nft,
        r.elapsed_s
    );
    summary::summary(&mut o, r);
    let goals = goals::goals(r);
    o.push_str("## Goals (issues 6, 13, 39 and 42)\n\n");
    goals::goals_table(&mut o, &goals);
    o.push_str(
        "**met within noise**: the median is below the goal, but the goal lies inside the 90 % \
         interval of that median and no point lies below it beyond the noise (the A/A control \
         tells). Each row's notes give every figure behind it, why it is what it is, and its \
         history.\n\n",
    );
    o.push_str("![connect+close rate against the number of Services](docs/bench.png)\n\n\
        The chart plots each arm's median per-round ratio to direct, times direct's median rate over \
        the whole run, so that drift of the machine between rounds does not show as a slope.\n\n");
    goals::notes(&mut o, &goals);
    let durs: Vec<String> = r
        .durations_ms
        .iter()
        .map(|(m, ms)| format!("{} {ms} ms", m.as_str()))
        .collect();
    let _ = writeln!(
        o,
        "## Method\n\n\
         Everything runs on this machine, in network namespaces the benchmark creates and removes. \
         Each arm has its own client namespace and one backend namespace, joined by a bridge in a \
         third namespace. The backend holds {} addresses (the target Service's endpoints) and runs \
         `lb-bench server` pinned to core 1; the client runs `lb-bench client` pinned to core 0. \
         Clients have no default route: only a route for the Service CIDR {} onto the bridge.\n\n\
         - **direct**: the client connects to the backend's address; no load balancer. The limit.\n\
         - **lb (ours)**: `lb-agent run` with a manifests directory, its socket programs attached to a \
         child cgroup the client joins. The connect is rewritten before routing: no NAT, no conntrack. \
         The agent is paused (SIGSTOP) during the rounds: the pinned programs and maps need no agent, \
         and its periodic full resync of the manifests directory would otherwise take one of the \
         two cores from whichever arm is being measured.\n\
         - **iptables (nft)** / **iptables (legacy)**: the rules kube-proxy's iptables mode writes \
         (`KUBE-SERVICES` → `KUBE-SVC-*` with `! -s 10.244.0.0/16 … -j KUBE-MARK-MASQ` and \
         `statistic --mode random --probability` → `KUBE-SEP-*` with the hairpin mark and DNAT; \
         `KUBE-POSTROUTING` masquerading marked packets; the filter table's `KUBE-SERVICES`/firewall \
         jumps), loaded into the client namespace's nat OUTPUT path with `iptables-nft-restore` and \
         `iptables-legacy-restore`. The target Service is **last** in `KUBE-SERVICES`.\n\
         - **nftables**: kube-proxy's nftables mode shape: table `ip kube-proxy`, the `service-ips` \
         verdict map (`ip daddr . meta l4proto . th dport vmap @service-ips`), per-Service chains with \
         `numgen random mod N vmap`, per-endpoint chains that DNAT, masquerade marks, the \
         `no-endpoint-services` and `firewall-ips` lookups on new connections; loaded with `nft -f`.\n\
         - **IPVS**: {}.\n\n\
         Scale points count Services: the target (TCP and UDP port 80, {} endpoints) plus fillers \
         with {} endpoints each, on addresses nothing answers. Generated rulesets and manifests are \
         cached in `target/bench-cache/`.\n\n\
         Tests, each a fixed duration ({}), one connection at a time:\n\n\
         - **connect+close** (`cc`): `connect()`, then `close()` with `SO_LINGER` 0 (RST, no \
         TIME_WAIT). Latency is the `connect()` call.\n\
         - **TCP_CRR** (`crr`): connect, 64-byte request, response, close.\n\
         - **request/response** (`rr`): 64 bytes each way on one connection: a control, the load \
         balancer is not involved after the connect.\n\
         - **UDP request/response** (`udp`): `sendto` the ClusterIP and `recvfrom` on one unconnected \
         socket (our `sendmsg4`/`recvmsg4` hooks run for every datagram; iptables/nftables NAT it \
         through one conntrack entry).\n\n\
         {} rounds; each round runs every arm in a new shuffled order, all four tests per arm. \
         Tables give the median over rounds of the rate, and the arm's rate divided by direct's \
         **from the same round** (median and min–max of that ratio). The program cost comes from \
         `BPF_ENABLE_STATS` (`run_time_ns / run_cnt` of `connect4`) in a separate connect+close run \
         per round, so that the statistics' own overhead stays out of the measured runs.\n",
        r.target_endpoints,
        crate::rules::SERVICE_CIDR,
        r.ipvs,
        r.target_endpoints,
        r.filler_endpoints,
        durs.join(", "),
        r.rounds
    );
    o.push_str(
        "### How to read it\n\n\
         A ratio of 1.000 is as fast as connecting straight to the backend. Ratios are computed per \
         round, so slow phases of the machine (this is a 2-core VM, shared) cancel out; the min–max \
         column shows how much a single round can be trusted. `rr` is the control: all arms should \
         be ~1.0 there, and the width of its spread is the noise floor. Latencies are medians over \
         rounds of each round's percentile.\n\n",
    );
    for t in &CLUSTER_IP_TABLES {
        let _ = writeln!(o, "## {}\n", t.heading);
        mode_table(&mut o, r, t.mode, t.unit, t.latency);
        if t.mode == Mode::Cc {
            noise_floor_section(&mut o, r);
        }
    }
    o.push_str("## Our program cost (connect4)\n\nThe floor is an empty connect4 program (`r0 = 1; exit`) attached to the same cgroup during the same runs: what `BPF_ENABLE_STATS` charges a program that does nothing (its clock reads and the call), on the same connects.\n\n| Services | ns per run (median) | min–max | floor: empty program, ns per run (median) | runs per measurement |\n|---:|---:|---:|---:|---:|\n");
    for &n in &r.points {
        if let Some(s) = cost(r, n) {
            let runs = r
                .costs
                .iter()
                .filter(|c| c.services == n)
                .map(|c| c.run_cnt)
                .max()
                .unwrap_or(0);
            let _ = writeln!(
                o,
                "| {} | {:.0} | {:.0}–{:.0} | {} | {} |",
                thousands(n),
                s.med,
                s.min,
                s.max,
                floor_cost(r, n).map_or("–".into(), |f| format!("{:.0}", f.med)),
                runs
            );
        }
    }
    loading_table(&mut o, "\n## Loading each scale point\n\n", &r.setups);
    o.push('\n');
    nodeport_section(&mut o, r);
    schedulers_section(&mut o, r);
    if let Some(cp) = &r.control {
        let _ = writeln!(
            o,
            "## {CONTROL_PLANE_HEADING}\n\n{} Services × {} endpoints.\n",
            thousands(cp.services),
            cp.endpoints
        );
        o.push_str("| what | time | × ours (sync) |\n|---|---:|---:|\n");
        let ours = cp.ours_sync_ms.map(|x| x / 1e3);
        let x = |t: f64| ours.map_or("–".into(), |o| format!("{:.0}×", t / o));
        if let Some(s) = cp.ours_sync_ms {
            let _ = writeln!(
                o,
                "| lb (ours): first sync: read manifests + translate + map writes | {:.0} ms | 1× |",
                s
            );
        }
        if let Some(s) = cp.ours_read_translate_ms {
            let _ = writeln!(
                o,
                "| … of which reading + translating the manifests | {s:.0} ms | |"
            );
        }
        if let Some(s) = cp.ours_apply_ms {
            let _ = writeln!(o, "| … of which map writes (batched) | {s:.0} ms | |");
        }
        if let Some(s) = cp.ours_ready_s {
            let _ = writeln!(
                o,
                "| lb (ours): agent start → /readyz (load + verify + attach, parse manifests, sync) | {:.2} s | {} |",
                s,
                x(s)
            );
        }
        for (what, v) in [
            ("iptables-nft-restore", &cp.iptables_nft_s),
            ("iptables-legacy-restore", &cp.iptables_legacy_s),
            ("nft -f", &cp.nft_s),
        ] {
            match v {
                Ok(s) => {
                    let _ = writeln!(o, "| {what} | {s:.2} s | {} |", x(*s));
                }
                Err(e) => {
                    let _ = writeln!(o, "| {what} | {} | |", e.replace('|', "\\|"));
                }
            }
        }
        o.push('\n');
        if let Some((got, want)) = cp.ours_frontends {
            let _ = writeln!(
                o,
                "Frontends programmed at /readyz (`lb_frontends_programmed`): {got} of {want}.\n"
            );
        }
        if let Some(m) = cp.ours_rss_mib {
            let _ = writeln!(
                o,
                "Agent peak RSS (VmHWM) after the changes below: {m:.1} MiB.\n"
            );
        }
        if let Some(c) = &cp.cluster {
            let _ = writeln!(
                o,
                "Cluster mode, the same objects served by the list/watch fixture (`tests/src/apiserver.rs`; the agent lists each kind in pages of 500 and watches): {}.\n",
                cluster_summary(c)
            );
        }
        if let Some(s) = Stat::of(cp.change_ms.clone()) {
            let _ = writeln!(
                o,
                "One endpoint change (the target's only endpoint moved to another address; manifest \
                 file renamed into place, `--sync-debounce 0s`) until a new connection lands on the \
                 new endpoint: median **{:.1} ms**, min–max {:.1}–{:.1} ms over {} changes; the \
                 agent's sync for it: {}.\n",
                s.med,
                s.min,
                s.max,
                s.n,
                Stat::of(cp.change_sync_ms.clone())
                    .map_or("?".into(), |s| format!("median {:.1} ms", s.med))
            );
        }
        for n in &cp.notes {
            let _ = writeln!(o, "- {n}");
        }
    }
    o
}

const COLORS: [(u8, u8, u8); 5] = [
    (90, 90, 90),
    (214, 39, 40),
    (31, 119, 180),
    (23, 190, 207),
    (44, 160, 44),
];

fn chart(path: &Path, r: &Results) -> Result<()> {
    use plotters::prelude::*;
    let have_font = match fs::read(FONT) {
        Ok(bytes) => {
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok()
        }
        Err(_) => false,
    };
    // The machine's speed drifts between rounds (it is shared), and the
    // rounds are interleaved to cancel that: plot each arm's median per-round
    // ratio to direct, scaled by direct's median rate over the whole run.
    let direct = Stat::of(
        r.samples
            .iter()
            .filter(|s| s.arm == ArmKind::Direct && s.mode == Mode::Cc)
            .map(|s| s.run.rate)
            .collect(),
    )
    .map_or(0.0, |s| s.med);
    let series: Vec<(ArmKind, Vec<(f64, f64)>)> = ArmKind::ALL
        .into_iter()
        .map(|a| {
            let pts = r
                .points
                .iter()
                .filter_map(|&n| {
                    let x = ratio(r, n, a, ArmKind::Direct, Mode::Cc)?.med;
                    Some((n as f64, x * direct))
                })
                .collect();
            (a, pts)
        })
        .filter(|(_, p): &(ArmKind, Vec<(f64, f64)>)| !p.is_empty())
        .collect();
    let ymax = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|x| x.1))
        .fold(1.0, f64::max)
        * 1.15;
    let xmax = r.points.iter().copied().max().unwrap_or(10) as f64 * 1.5;
    let root = BitMapBackend::new(path, (960, 540)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut builder = ChartBuilder::on(&root);
    builder.margin(20);
    if have_font {
        builder
            .caption(
                "connect+close rate vs. Services (median ratio to direct × direct's median)",
                ("sans-serif", 22),
            )
            .x_label_area_size(45)
            .y_label_area_size(70);
    }
    let mut chart = builder.build_cartesian_2d((0.7f64..xmax).log_scale(), 0f64..ymax)?;
    if have_font {
        chart
            .configure_mesh()
            .x_desc("Services")
            .y_desc("connections / s (normalised)")
            .x_label_formatter(&|x| format!("{}", x.round() as u64))
            .y_label_formatter(&|y| format!("{:.0}k", y / 1e3))
            .draw()?;
    } else {
        chart.configure_mesh().disable_x_mesh().draw()?;
    }
    for (i, (arm, pts)) in series.iter().enumerate() {
        let (cr, cg, cb) = COLORS[ArmKind::ALL.iter().position(|a| a == arm).unwrap_or(i) % 5];
        let color = RGBColor(cr, cg, cb);
        let s = chart.draw_series(LineSeries::new(pts.clone(), color.stroke_width(3)))?;
        if have_font {
            s.label(arm.label()).legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
            });
        }
        chart.draw_series(pts.iter().map(|p| Circle::new(*p, 4, color.filled())))?;
    }
    if have_font {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 16))
            .draw()?;
    }
    root.present()?;
    Ok(())
}

/// How long each arm took to load at each scale point.
fn loading_table(o: &mut String, heading: &str, setups: &[Setup]) {
    o.push_str(heading);
    o.push_str("| Services | arm | load time | note |\n|---:|---|---:|---|\n");
    for s in setups {
        if s.arm == ArmKind::Direct {
            continue;
        }
        let load = s.load_s.map_or("–".into(), |x| format!("{x:.2} s"));
        let mut note = s.skipped.clone().unwrap_or_default();
        if let Some(m) = s.rss_mib {
            note = format!("agent start to /readyz; peak RSS {m:.1} MiB");
        }
        let _ = writeln!(
            o,
            "| {} | {} | {load} | {note} |",
            thousands(s.services),
            s.arm.label()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rows of the first table after the line that starts with
    /// `heading`, its header and separator first.
    fn table_after<'a>(md: &'a str, heading: &str) -> Vec<&'a str> {
        md.lines()
            .skip_while(|l| !l.starts_with(heading))
            .skip(1)
            .skip_while(|l| !l.starts_with('|'))
            .take_while(|l| l.starts_with('|'))
            .collect()
    }

    fn cells(row: &str) -> Vec<&str> {
        row.strip_prefix('|')
            .and_then(|r| r.strip_suffix('|'))
            .unwrap_or(row)
            .split('|')
            .map(str::trim)
            .collect()
    }

    /// The anchor of every heading, repeats numbered as GitHub numbers
    /// them.
    fn anchors_of(md: &str) -> Vec<String> {
        let mut seen: Vec<String> = Vec::new();
        for line in md.lines() {
            let Some(text) = line
                .strip_prefix('#')
                .and_then(|t| t.trim_start_matches('#').strip_prefix(' '))
            else {
                continue;
            };
            let first = anchor(text);
            let mut a = first.clone();
            for k in 1.. {
                if !seen.contains(&a) {
                    break;
                }
                a = format!("{first}-{k}");
            }
            seen.push(a);
        }
        seen
    }

    /// Every link of `text` to a heading of the same page.
    fn links(text: &str) -> Vec<&str> {
        text.split("](#")
            .skip(1)
            .map(|rest| &rest[..rest.find(')').unwrap_or(rest.len())])
            .collect()
    }

    /// A reader takes the summary and the goals in at a glance: each row
    /// one line, each cell but the link to the notes short. The old
    /// goals table held up to a page of text in a cell.
    #[test]
    fn the_summary_and_the_goals_are_a_short_line_a_row() {
        const CELL: usize = 200;
        let md = markdown(&fixture::whole_run());
        // Every ClusterIP and NodePort table (the latter for ours and ours
        // with XDP), the control plane and the schedulers; every goal the
        // whole run judges.
        for (heading, rows_wanted) in [("## Summary", 12), ("## Goals", 16)] {
            let table = table_after(&md, heading);
            assert_eq!(
                table.len(),
                2 + rows_wanted,
                "{heading}:\n{}",
                table.join("\n")
            );
            let columns = cells(table[0]).len();
            for row in &table[2..] {
                let row_cells = cells(row);
                assert_eq!(row_cells.len(), columns, "{row}");
                for cell in row_cells.iter().filter(|c| !c.starts_with("[notes](#")) {
                    let n = cell.chars().count();
                    assert!(n <= CELL, "{heading}: a cell of {n} characters: {cell}");
                }
            }
        }
    }

    /// The XDP arm: a row in each NodePort table and a summary row per
    /// NodePort test, its packets in XDP in the NodePort section, and not
    /// in the ClusterIP tables, where it does not run.
    #[test]
    fn the_xdp_arm_has_its_rows_in_the_nodeport_tables_and_the_summary() {
        let md = markdown(&fixture::whole_run());
        let xdp = ArmKind::OursXdp.label();
        for t in &NODEPORT_TABLES {
            let rows = table_after(&md, &format!("### {}", t.heading));
            let ours: Vec<&&str> = rows.iter().filter(|r| cells(r)[1] == xdp).collect();
            assert_eq!(ours.len(), 2, "{}: a row per point", t.heading);
            assert_eq!(cells(ours[0])[3], "1.020", "{}", ours[0]);
        }
        for t in &CLUSTER_IP_TABLES {
            let rows = table_after(&md, &format!("### {}", t.heading));
            assert!(rows.iter().all(|r| cells(r)[1] != xdp), "{}", t.heading);
        }
        let summary = table_after(&md, "## Summary");
        let with_xdp: Vec<&&str> = summary
            .iter()
            .filter(|r| r.contains("*with XDP*"))
            .collect();
        assert_eq!(with_xdp.len(), NODEPORT_TABLES.len());
        // 1.02× direct, 1.275× nftables, at 10 000 Services (the same at 1:
        // no span).
        assert_eq!(cells(with_xdp[0])[3..5], ["1.02", "1.27"][..]);
        assert!(md.contains("Rows marked *with XDP*"));
        let tally = table_after(&md, "lb (ours, XDP): packets translated in XDP");
        assert_eq!(tally.len(), 2 + 4, "{}", tally.join("\n"));
        assert_eq!(cells(tally[3])[5..], ["4.00", "0.00", "100.0 %"][..]);
    }

    #[test]
    fn every_goal_links_its_note_and_every_link_names_a_heading() {
        let r = fixture::whole_run();
        let md = markdown(&r);
        let anchors = anchors_of(&md);
        for row in &table_after(&md, "## Goals")[2..] {
            let last = *cells(row).last().unwrap();
            assert!(last.starts_with("[notes](#note-"), "{row}");
        }
        let all = links(&md);
        assert!(all.len() >= 16 + 12, "{all:?}");
        for link in all {
            assert!(
                anchors.iter().any(|a| a == link),
                "#{link} names no heading"
            );
        }
        // The long texts moved to the notes, none lost.
        for g in goals::goals(&r) {
            assert!(md.contains(g.measured.trim_end()), "{}", g.what);
            assert!(md.contains(&g.explanation), "{}", g.what);
        }
    }

    #[test]
    fn anchors_are_the_ones_github_gives_headings() {
        for (heading, want) in [
            ("Schedulers (issue 39)", "schedulers-issue-39"),
            (AA_HEADING, "connectclose-the-aa-control"),
            ("Note: tc_ingress", "note-tc_ingress"),
            ("Note: connect4's cost", "note-connect4s-cost"),
            (
                "NodePort TCP_CRR (transactions per second)",
                "nodeport-tcp_crr-transactions-per-second",
            ),
        ] {
            assert_eq!(anchor(heading), want);
        }
    }

    #[test]
    fn quantiles_interpolate_between_neighbours() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(quantile(&v, 0.0), 1.0);
        assert_eq!(quantile(&v, 0.5), 2.5);
        assert_eq!(quantile(&v, 1.0), 4.0);
        assert!(quantile(&[], 0.5).is_nan());
    }

    #[test]
    fn the_median_interval_holds_the_median_and_narrows_with_more_rounds() {
        // Rounds scattered ±10 % around 1.0, as this machine's A/A ratios.
        let rounds = |n: usize| -> Vec<f64> {
            (0..n)
                .map(|i| 0.9 + 0.2 * ((i * 7919) % n) as f64 / (n - 1) as f64)
                .collect()
        };
        let few = Spread::of(rounds(5)).unwrap();
        let many = Spread::of(rounds(41)).unwrap();
        for s in [&few, &many] {
            assert!(
                s.interval.0 <= s.med && s.med <= s.interval.1,
                "{:?}",
                s.interval
            );
            assert!(s.min <= s.quartiles.0 && s.quartiles.1 <= s.max);
        }
        assert!(
            many.interval.1 - many.interval.0 < few.interval.1 - few.interval.0,
            "{:?} vs {:?}",
            many.interval,
            few.interval
        );
        // The same rounds give the same interval (a fixed seed).
        assert_eq!(Spread::of(rounds(41)).unwrap().interval, many.interval);
        assert_eq!(
            few.below,
            (0..5).filter(|i| (0.9 + 0.05 * (*i as f64)) < 0.98).count()
        );
    }
}
