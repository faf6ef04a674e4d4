//! Made-up results for the report's tests: every experiment of a whole
//! run, with round figures so that each ratio is plain.
use crate::{
    nodeport::{NodePortResults, TcCost, XdpTally, FLOOR_EGRESS, FLOOR_INGRESS},
    schedulers::{AlgorithmCost, SchedulerResults, Spread, ALGORITHMS, BALANCED},
    ArmKind as A, ClusterStart, ControlPlane, Cost, Machine, Mode, NoiseFloor, Results, Run,
    Sample, Setup,
};

pub(super) fn sample(services: usize, round: usize, arm: A, mode: Mode, rate: f64) -> Sample {
    Sample {
        services,
        round,
        arm,
        mode,
        run: Run {
            rate,
            p50_us: 50.0,
            p99_us: 100.0,
            p999_us: 300.0,
            ..Default::default()
        },
    }
}

/// A connect4 cost run: ours and the empty program beside it, ns per run.
pub(super) fn cost(services: usize, round: usize, ours_ns: u64, floor_ns: u64) -> Cost {
    Cost {
        services,
        round,
        run_cnt: 1000,
        run_time_ns: 1000 * ours_ns,
        floor_run_cnt: 1000,
        floor_run_time_ns: 1000 * floor_ns,
    }
}

/// A tc program's cost run: 100 runs over 25 connections.
pub(super) fn tc_cost(services: usize, round: usize, prog: &str, ns_per_run: u64) -> TcCost {
    TcCost {
        services,
        round,
        prog: prog.into(),
        run_cnt: 100,
        run_time_ns: 100 * ns_per_run,
        conns: 25,
    }
}

/// The A/A control at a point, 21 rounds: direct at 100 and `arms` at
/// their rates in every round.
pub(super) fn noise_floor(services: usize, arms: &[(A, f64)]) -> NoiseFloor {
    NoiseFloor {
        services,
        rounds: 21,
        cc_ms: 1000,
        samples: (0..21)
            .flat_map(|round| {
                std::iter::once((A::Direct, 100.0))
                    .chain(arms.iter().copied())
                    .map(move |(arm, rate)| sample(services, round, arm, Mode::Cc, rate))
            })
            .collect(),
    }
}

/// Results with only `samples` measured, at `points`, in 3 rounds.
pub(super) fn results(points: Vec<usize>, samples: Vec<Sample>) -> Results {
    Results {
        machine: Machine {
            cpu: "a CPU".into(),
            cores: 2,
            memory: "24 GiB".into(),
            kernel: "6.18".into(),
            date: "2026-12-07 16:56 UTC".into(),
            commit: "0000000".into(),
            iptables: "iptables v1.8.9 (legacy)".into(),
            nft: "nftables v1.0.6".into(),
            srso: String::new(),
        },
        quick: false,
        points,
        rounds: 3,
        durations_ms: vec![(Mode::Cc, 2000), (Mode::Crr, 1500), (Mode::Rr, 1000)],
        target_endpoints: 4,
        filler_endpoints: 2,
        ipvs: "skipped".into(),
        setups: Vec::new(),
        samples,
        costs: Vec::new(),
        control: None,
        nodeport: None,
        noise_floors: Vec::new(),
        noise_floor: None,
        schedulers: None,
        elapsed_s: 0.0,
    }
}

/// Each arm's rate at a point, relative to direct's 10 000 a second:
/// iptables falls with the Service count, the others do not.
fn rate_of(arm: A, services: usize) -> f64 {
    let many = services >= 10_000;
    10_000.0
        * match arm {
            A::Ours => 0.97,
            A::OursXdp => 1.02,
            A::Nftables => 0.8,
            A::IptablesNft if many => 0.15,
            A::IptablesNft => 0.8,
            A::IptablesLegacy if many => 0.4,
            A::IptablesLegacy => 0.75,
            _ => 1.0,
        }
}

/// Every arm of `arms` in every mode at `points`, 3 rounds, nftables only
/// up to 10 000 Services (as when it does not load at 100 000).
fn samples_of(points: &[usize], modes: &[Mode], arms: &[A]) -> Vec<Sample> {
    let mut v = Vec::new();
    for &n in points {
        for round in 0..3 {
            for &mode in modes {
                for &arm in arms {
                    if arm == A::Nftables && n > 10_000 {
                        continue;
                    }
                    // A round's drift, the same for every arm.
                    let drift = 1.0 + 0.02 * round as f64;
                    v.push(sample(n, round, arm, mode, rate_of(arm, n) * drift));
                }
            }
        }
    }
    v
}

/// A whole run: the ClusterIP experiment at 1, 10 000 and 100 000
/// Services with its A/A control, the control plane in both modes, the
/// NodePort experiment at 1 and 10 000, and the schedulers.
pub(super) fn whole_run() -> Results {
    let points = vec![1, 10_000, 100_000];
    let mut r = results(
        points.clone(),
        samples_of(
            &points,
            &[Mode::Cc, Mode::Crr, Mode::Rr, Mode::Udp],
            &A::ALL,
        ),
    );
    r.machine.srso = "Mitigation: Safe RET".into();
    r.costs = points
        .iter()
        .flat_map(|&n| (0..3).map(move |round| cost(n, round, 700 + 10 * round as u64, 100)))
        .collect();
    r.setups = points
        .iter()
        .flat_map(|&n| {
            A::ALL.into_iter().map(move |arm| Setup {
                load_s: Some(1.0),
                rss_mib: (arm == A::Ours).then_some(30.0 + n as f64 / 1000.0),
                skipped: (arm == A::Nftables && n > 10_000)
                    .then(|| "not loaded within 240 s (killed)".into()),
                ..Setup::new(n, arm)
            })
        })
        .collect();
    r.noise_floors = points
        .iter()
        .map(|&n| {
            noise_floor(
                n,
                &[
                    (A::DirectAgain, 100.0),
                    (A::DirectBeside, 99.0),
                    (A::Ours, 97.0),
                ],
            )
        })
        .collect();
    r.control = Some(ControlPlane {
        services: 10_000,
        endpoints: 10,
        ours_ready_s: Some(8.0),
        ours_sync_ms: Some(700.0),
        ours_sync_runs_ms: vec![750.0, 700.0, 680.0],
        ours_read_translate_ms: Some(280.0),
        ours_apply_ms: Some(420.0),
        ours_frontends: Some((10_001, 10_001)),
        ours_rss_mib: Some(100.0),
        change_ms: vec![3.5, 7.6, 12.0],
        change_sync_ms: vec![9.5, 9.0, 10.0],
        change_apply_ms: vec![1.5],
        iptables_nft_s: Ok(29.5),
        iptables_legacy_s: Ok(15.8),
        nft_s: Err("not loaded within 600 s".into()),
        notes: Vec::new(),
        cluster: Some(ClusterStart {
            ready_s: Some(8.5),
            input_to_maps_ms: Some(8400.0),
            sync_ms: Some(557.0),
            read_translate_ms: Some(72.0),
            apply_ms: Some(482.0),
            lists: vec![
                ("Service".into(), 10_000, 226.0),
                ("EndpointSlice".into(), 10_000, 244.0),
            ],
            frontends: Some((10_001, 10_001)),
            rss_mib: Some(61.3),
            cpu_ms: Some(8630.0),
            minor_faults: Some(14_854),
            runs_ms: vec![8306.0, 8400.0, 9071.0],
        }),
    });
    let np_points = vec![1, 10_000];
    let tc = |costs: &[(&str, u64)]| -> Vec<TcCost> {
        np_points
            .iter()
            .flat_map(|&n| {
                (0..3).flat_map(move |round| {
                    costs
                        .iter()
                        .map(move |(prog, ns)| tc_cost(n, round, prog, *ns))
                })
            })
            .collect()
    };
    r.nodeport = Some(NodePortResults {
        points: np_points.clone(),
        rounds: 3,
        durations_ms: vec![(Mode::Cc, 2000), (Mode::Crr, 1500), (Mode::Rr, 1000)],
        node_port: 30080,
        setups: Vec::new(),
        samples: samples_of(&np_points, &[Mode::Cc, Mode::Crr, Mode::Rr], &A::NODEPORT),
        costs: tc(&[
            ("tc_ingress_eth0", 1200),
            (FLOOR_INGRESS, 100),
            ("tc_egress_eth0", 150),
            (FLOOR_EGRESS, 90),
        ]),
        rr_costs: tc(&[("tc_ingress_eth0", 400), (FLOOR_INGRESS, 100)]),
        ours_stats: vec![(1, 1_000_000, 0), (10_000, 900_000, 0)],
        xdp_tallies: np_points
            .iter()
            .flat_map(|&services| {
                [
                    (Mode::Cc, 30_000, 120_000, 0),
                    (Mode::Rr, 90_000, 0, 360_000),
                ]
                .map(|(mode, ops, tc, xdp)| XdpTally {
                    services,
                    mode,
                    ops,
                    xdp_translated: xdp,
                    tc_translated: tc,
                })
            })
            .collect(),
        notes: Vec::new(),
    });
    r.schedulers = Some(SchedulerResults {
        backends: 10,
        open: 100,
        steps: 4000,
        rounds: 3,
        spread_rounds: 3,
        costs: (0..3)
            .flat_map(|round| {
                ALGORITHMS.iter().map(move |a| AlgorithmCost {
                    algorithm: (*a).into(),
                    round,
                    run_time_ns: if *a == "random" { 600_000 } else { 750_000 },
                    run_cnt: 1000,
                })
            })
            .collect(),
        spreads: (0..3)
            .flat_map(|round| {
                BALANCED.iter().map(move |a| Spread {
                    algorithm: (*a).into(),
                    round,
                    steps: 4000,
                    mean_ratio: 1.3,
                    p99_ratio: 1.7,
                    max_ratio: 2.0,
                    errors: 0,
                    backends: Default::default(),
                })
            })
            .collect(),
        busy_per_backend: 2,
    });
    r
}
