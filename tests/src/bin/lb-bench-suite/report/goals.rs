//! The goals of issues 6, 13 and 39, judged on the results.
use std::fmt::Write as _;

use super::{
    cluster_summary, cost, floor_cost, fmt_ratio, ms, nodeport_view, noise_floor_spreads, rate,
    ratio, scheduler_costs, tc_cost, thousands, Spreads, Stat,
};
use crate::{schedulers::SchedulerResults, ArmKind, Mode, Results};

pub(super) struct Goal {
    pub(super) what: &'static str,
    pub(super) met: Option<bool>,
    pub(super) measured: String,
    pub(super) limit: String,
}

pub(super) fn goals(r: &Results) -> Vec<Goal> {
    let mut g = Vec::new();
    let pts: Vec<usize> = r
        .points
        .iter()
        .copied()
        .filter(|n| rate(r, *n, ArmKind::Ours, Mode::Cc).is_some())
        .collect();
    // 1. ≥ 0.98× direct at every point, flat. A point is judged by its
    // A/A control's rounds when there are any (the same test, three times
    // the rounds, beside a second direct arm), else by its main rounds.
    let floors: Vec<(&crate::NoiseFloor, Spreads)> = r
        .noise_floors()
        .map(|nf| (nf, noise_floor_spreads(nf)))
        .collect();
    let floor_at = |n: usize| {
        floors
            .iter()
            .find(|(nf, _)| nf.services == n)
            .and_then(|(nf, sp)| Some((*nf, sp, sp.again.as_ref()?, sp.judged()?)))
    };
    let ratios: Vec<(usize, f64)> = pts
        .iter()
        .filter_map(|n| {
            let aa = floor_at(*n).map(|(_, _, _, (_, judged))| judged.med);
            Some((
                *n,
                aa.or(ratio(r, *n, ArmKind::Ours, ArmKind::Direct, Mode::Cc).map(|s| s.med))?,
            ))
        })
        .collect();
    let worst = ratios.iter().map(|x| x.1).fold(f64::INFINITY, f64::min);
    let first = ratios.first().map(|x| x.1);
    let last = ratios.last().map(|x| x.1);
    let judged_on_aa: Vec<usize> = pts
        .iter()
        .copied()
        .filter(|n| floor_at(*n).is_some())
        .collect();
    let judged_name = judged_on_aa
        .first()
        .and_then(|n| floor_at(*n))
        .map_or("lb (ours) ÷ direct", |(_, _, _, (name, _))| name);
    let aa_text = (!judged_on_aa.is_empty()).then(|| {
        let per_point = judged_on_aa
            .iter()
            .filter_map(|n| {
                let (nf, sp, aa, (name, judged)) = floor_at(*n)?;
                let mut text = format!(
                    "{}: direct (again) ÷ direct {:.3} ({:.3}–{:.3}), {name} {:.3} ({:.3}–{:.3})",
                    thousands(nf.services),
                    aa.med,
                    aa.interval.0,
                    aa.interval.1,
                    judged.med,
                    judged.interval.0,
                    judged.interval.1,
                );
                if sp.ours_beside.is_some() {
                    if let Some(ours) = &sp.ours {
                        let _ = write!(
                            text,
                            ", lb (ours) ÷ direct {:.3} ({:.3}–{:.3})",
                            ours.med, ours.interval.0, ours.interval.1
                        );
                    }
                }
                let _ = write!(
                    text,
                    "; the main rounds gave lb (ours) ÷ direct {}",
                    fmt_ratio(ratio(
                        r,
                        nf.services,
                        ArmKind::Ours,
                        ArmKind::Direct,
                        Mode::Cc
                    ))
                    .0,
                );
                Some(text)
            })
            .collect::<Vec<_>>()
            .join("; ");
        format!(
            " ({judged_name}: medians of the A/A control's rounds at {}). A/A control, median \
             and 90 % interval of the median: {per_point}",
            judged_on_aa
                .iter()
                .map(|n| thousands(*n))
                .collect::<Vec<_>>()
                .join(", ")
        )
    });
    let aa_limit = (!judged_on_aa.is_empty()).then(|| {
        let verdicts = judged_on_aa
            .iter()
            .filter_map(|n| {
                let (nf, _, aa, (name, judged)) = floor_at(*n)?;
                let verdict = if judged.interval.0 >= 0.98 {
                    "all above 0.98: met beyond this noise"
                } else if judged.interval.1 < 0.98 {
                    "all below 0.98: missed beyond this noise"
                } else {
                    "0.98 lies inside: these rounds cannot tell met from missed"
                };
                Some(format!(
                    "at {}, two identical direct arms stand {:.3}–{:.3} apart in one round \
                     (quartiles {:.3}–{:.3}) and the median of their ratio, 1 in truth, is \
                     known to {:.3}–{:.3}; that of {name} to {:.3}–{:.3}, {verdict}",
                    thousands(nf.services),
                    aa.min,
                    aa.max,
                    aa.quartiles.0,
                    aa.quartiles.1,
                    aa.interval.0,
                    aa.interval.1,
                    judged.interval.0,
                    judged.interval.1,
                ))
            })
            .collect::<Vec<_>>()
            .join("; ");
        format!(
            " The A/A control ({} rounds a point): {verdicts}.",
            floors[0].0.rounds
        )
    });
    g.push(Goal {
        what: "ClusterIP connect rate ≥ 0.98× direct at every scale point, flat from 1 to the largest",
        met: (!ratios.is_empty()).then_some(worst >= 0.98),
        measured: format!(
            "{}{} ; largest/smallest point {}",
            ratios
                .iter()
                .map(|(n, x)| format!("{}: {x:.3}", thousands(*n)))
                .collect::<Vec<_>>()
                .join(", "),
            aa_text.unwrap_or_default(),
            match (first, last) {
                (Some(a), Some(b)) => format!("{:.3}", b / a),
                _ => "–".into(),
            }
        ),
        limit: format!(
            "What a connection of the lb arm runs: connect4 (~200 ns a run under \
             BPF_ENABLE_STATS, ~40 ns of it the statistics' own clock reads: see the program \
             cost) and sock_release (65–75 ns, likewise), 250–300 ns together, 1.3–1.6 % of the \
             ~19 µs connect+close cycle of this experiment: by their run time alone a ratio of \
             ~0.985. The A/A control measures the whole connection, and with direct from \
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
             is not attached while no frontend has loadBalancerSourceRanges (782f9e5).{} The \
             curve is flat: nothing on the socket path depends on the number of Services.",
            aa_limit.unwrap_or_else(|| " The rest is noise: the rr control, where no load \
                 balancer is involved, scatters as much (a shared 2-core VM)."
                .into())
        ),
    });
    // 2. ≥ 5× iptables at 10 000.
    for base in [ArmKind::IptablesNft, ArmKind::IptablesLegacy] {
        let n = 10_000;
        let s = ratio(r, n, ArmKind::Ours, base, Mode::Cc);
        g.push(Goal {
            what: if base == ArmKind::IptablesNft {
                "≥ 5× iptables (nft backend) at 10 000 Services"
            } else {
                "≥ 5× iptables (legacy backend) at 10 000 Services"
            },
            met: s.map(|s| s.med >= 5.0),
            measured: s.map_or("not measured at 10 000".into(), |s| {
                format!("{:.2}× (min–max {:.2}–{:.2})", s.med, s.min, s.max)
            }),
            limit: "iptables walks KUBE-SERVICES linearly for the first packet of each connection; the gap grows with the Service count and with where the target sits in the chain (last, here).".into(),
        });
    }
    // 3. ≥ 1.2× nftables at every scale.
    let nft: Vec<(usize, Stat)> = pts
        .iter()
        .filter_map(|n| {
            Some((
                *n,
                ratio(r, *n, ArmKind::Ours, ArmKind::Nftables, Mode::Cc)?,
            ))
        })
        .collect();
    g.push(Goal {
        what: "≥ 1.2× nftables at every scale",
        met: (!nft.is_empty()).then(|| nft.iter().all(|(_, s)| s.med >= 1.2)),
        measured: nft
            .iter()
            .map(|(n, s)| format!("{}: {:.2}×", thousands(*n), s.med))
            .collect::<Vec<_>>()
            .join(", "),
        limit: "nftables looks the Service up in a hash-backed verdict map, so it is flat too; its cost is conntrack and NAT on the first packet, per connection. With one client connection at a time on one core, that cost is a fraction of a connect+close, which bounds the ratio.".into(),
    });
    // 4. Program cost.
    let costs: Vec<(usize, Stat)> = pts
        .iter()
        .filter_map(|n| Some((*n, cost(r, *n)?)))
        .collect();
    g.push(Goal {
        what: "connect4 program cost ≤ 300 ns per run (issue 13; issue 6 asked < 200 ns)",
        met: (!costs.is_empty()).then(|| costs.iter().all(|(_, s)| s.med <= 300.0)),
        measured: costs
            .iter()
            .map(|(n, s)| {
                let floor = floor_cost(r, *n)
                    .map_or(String::new(), |f| format!(" (an empty program: {:.0} ns)", f.med));
                format!("{}: {:.0} ns{floor}", thousands(*n), s.med)
            })
            .collect::<Vec<_>>()
            .join(", "),
        limit: "run_time_ns / run_cnt of connect4 under BPF_ENABLE_STATS (its own clock reads included: the empty program beside it shows how much). Figures differ by machine: the same code (bf476a6) measured 664 ns at 1 Service on the machine of the BENCHMARKS.md at 43884bf and 1792 ns on a later one whose kernel returns from every call through the SRSO safe-return thunk, where each helper and map call costs more. Issue 13 took out the two costliest steps, each measured against the build before it on that later machine (lb-bench-suite --points 1 --rounds 5, medians): the reverse view's preallocated hash insert, ~0.7 µs (1792 → 1095 ns when LB_SOCK_PEER became an array of slots by socket cookie, written with plain stores after an inlined lookup); the backend's hash lookup (1095 → 1008 ns when LB_BACKENDS became an array indexed by id). Each remaining step, from builds that leave out only that step (same runs): the reverse view's array write 100–170 ns (without any record: 926 ns), bpf_get_prandom_u32 60–130 ns; the rest is the frontend and slot hash lookups (a call each that hashes the key and walks a bucket), the socket cookie helper and the context's loads and stores, each a likely cache miss after the ~20 µs of kernel work between two connects on this shared 2-core VM; the round-to-round spread is 10–20%. Since then the random choice is a step of a per-CPU SplitMix64 sequence (select::draw, no helper call on 6.18): 895 and 1112 → 811 and 912 ns in two pairs of alternated runs (lb-bench-suite --points 1 --rounds 3). Then LB_SLOTS became an array too (each backend set a range from ServiceValue::slot_base, published by the value as before; the slot lookup inlined instead of a hash call): 585 and 568 → 486 and 462 ns in two alternated pairs. What is left, from a build that records no reverse view (no socket cookie, no LB_SOCK_PEER write), alternated with the full one: 333 and 375 ns against 446 and 468 ns, so getpeername's record costs ~90–110 ns (the cookie helper, a call into its own subprogram, four slot probes and the write); the empty program ~70 ns; the rest, ~260–300 ns, is the frontend's hash lookup (the one map helper call left on the path), the random draw, the slot and backend array reads, the counters and the context's loads and stores. (Those two figures predate the next change.) Then the object stopped calling memset and memmove: bpf-linker's default --bpf-expand-memcpy-in-order leaves LLVM no inline expansion for either, so every zeroed padding field and IPv4-mapped prefix (one on every connect's key) was a call into a byte-at-a-time subprogram, 111 call sites in all; built without that flag (lb-ebpf/build.rs): 527 and 553 → 474 and 434 ns in two alternated pairs. On that machine (an AMD EPYC whose kernel has the SRSO safe-return thunk: BENCHMARKS.md up to dc4b6b0, 312–394 ns with today's connect4) 300 ns was not reached without giving up the frontend that getpeername returns for every TCP socket; on an Intel Xeon without that mitigation (the header says which this run had) the same code measures ~200–230 ns, so the goal's verdict depends on the machine.".into(),
    });
    if let Some(cp) = &r.control {
        let scale = format!("{} × {}", thousands(cp.services), cp.endpoints);
        let cl = cp.cluster.as_ref();
        g.push(Goal {
            what: "10 000 × 10 programmed in ≤ 250 ms from empty, input to maps, in both modes (issue 13)",
            met: both_within(cp, cp.ours_sync_ms, cl.and_then(|c| c.input_to_maps_ms), 250.0),
            measured: format!(
                "{scale}: manifests: first sync {} ms = reading + translating the manifests {} ms + map writes {} ms (the median of {} starts from empty maps: {}); agent start to /readyz {} s. Cluster mode (list/watch fixture, pages of 500): {}",
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
            limit: "Judged on the whole first sync (input to maps, as iptables-restore and nft -f are timed from their input). Reading: ~11 MB of JSON decoded per object on both cores, EndpointSlices straight into a compact form of what translation reads; then every Service translated. Map writes: ~220 000 elements (backends, slots, frontends, VIP markers): the ~200 000 backends and slots are stores through a mapping of their arrays (BPF_F_MMAPABLE), the frontends and VIP markers go in BPF_MAP_UPDATE_BATCH calls; the rest is building the plan (ids, sets, per-backend use counts). In cluster mode the lists come first: 40 pages of 500 objects, one page of each kind at a time (kube-rs asks for the next page once it has decoded the last), served by the fixture on the same two cores while the agent creates its maps and loads the programs; the lists, not the sync, are most of the figure, and a real API server would serve them from another machine. On this 2-core VM that start is CPU-bound (perf, the whole machine, 20 ms bins: no idle time until the lists end): the agent's main thread creates the maps (~100 ms of kernel time: ~1.8 million preallocated LRU elements at the default sizes) and verifies the programs (~50 ms), while the runtime's two workers decode the pages (~170 ms of CPU, a fifth of it first touches of fresh memory, before the allocator change below); the sync then runs mostly on one core (translation on both, ~25 ms; the election, the plan and the map writes on one). Issue 13 measured: the fixture had cloned every object for each page (lists 2.0 s and 3.3 s, input to maps 3.5 s, before it kept them behind Arc), then still copied each page's objects and the kind's whole map per page (input to maps 956 and 1142 → 463–702 ms once it wrote pages from the stored objects), then wrote each object's text anew for every list (now once, when the object is stored, as kube-apiserver's watch cache encodes an object once for all its readers: 20 pages of 500 EndpointSlices alone 110 → 27 ms; input to maps, eight alternated pairs of the two fixtures: median 450 → 414 ms, lists 217/279 → 180/243 ms); asking for each list's next page as soon as a page's metadata names its continue token (one page ahead, a service under the kube client) was tried and dropped: no gain here, where the CPU is the limit (thirteen alternated pairs with and without it: medians 403 against 414 ms, then 328 against 344 ms), and ~7 % with a 10 ms delay per request in the fixture (input to maps ~517 → ~480 ms), as one page ahead hides only the agent's decoding of a page, never the server's time; the manifests' label indexes went from SipHash to FxHash (read + translate 155–196 → 148–169 ms, four runs each); backends and slots written through a mapping instead of batch calls (map writes, six alternated pairs: median ~125 → ~80 ms); a first definition of a label stored at once instead of through the duplicate election, and manifests decoded without serde_path_to_error unless they fail (read + translate ~235 → ~174 ms, then parsing ~100 → ~80 ms); glibc's allocator set to map apart only blocks of 4 MiB or more and to keep up to 16 MiB free at the heap's top (it mapped every block of 128 KiB or more afresh and trimmed at 128 KiB, so each ~275 KiB list page and each large vector of the sync faulted its pages in anew): minor page faults of the agent until ready ~30 500 → ~14 700, input to maps in cluster mode (lb-bench-suite --only-ours, alternated) medians 274 → 238 ms (8 pairs) and 307 → 286 ms (7 pairs, a noisier hour), peak RSS +2.5 MiB. Since then each start (three from manifests, three in cluster mode, the median judged) waits for a quiet machine first (CPUs ≥ 90 % idle over 200 ms, at most 30 s): the earlier experiments' teardown (namespaces, rule tables, maps of 100 000 Services) finishes in the kernel's workers and would be measured with the starts (in the run of this report no start had to wait, so that was not what made the full run's starts slower than the same build's alone: cluster mode 301, 334, 349 ms here against medians of 238–307 ms in --only-ours runs of the hours around it). Boxing the watched objects' metadata (kube-rs moves each listed object several times, and the API's ObjectMeta is most of its size) was tried and dropped: six alternated runs of three starts each, input to maps and the agent's CPU time until ready both higher with the boxes (medians ~340 against ~300 ms, ~490 against ~430 ms of CPU). The goal was first met on an Intel Xeon without the SRSO mitigation (the header says which this run had) with the sync code of dc4b6b0, which measured 207 ms from manifests and 334 ms in cluster mode on the AMD EPYC with the SRSO safe-return thunk there: the machine, not a change of the agent, decided it. Agent start adds loading and verifying the programs.".into(),
        });
        let ch = Stat::of(cp.change_ms.clone());
        g.push(Goal {
            what: "one endpoint change effective in < 5 ms",
            met: (cp.services >= 10_000).then_some(()).and(ch.map(|s| s.med < 5.0)),
            measured: format!(
                "{scale}: {}; the agent's sync {}",
                ch.map_or("?".into(), |s| format!(
                    "median {:.1} ms (min–max {:.1}–{:.1})",
                    s.med, s.min, s.max
                )),
                Stat::of(cp.change_sync_ms.clone())
                    .map_or("?".into(), |s| format!("median {:.1} ms", s.med))
            ),
            limit: format!("Standalone mode keeps every manifest file parsed and re-reads only the file that changed; only the Services whose objects changed are translated again, and only their frontends are compared and written (map writes {}). Measured with --sync-debounce 0s, from just before the target's manifest is written (a temporary file, then a rename) to the first connection that lands on the new endpoint, so it includes inotify's wake-up and a client connecting in a loop; the periodic full resync still translates and compares everything, outside this path. On this machine a change lands either within ~3.5 ms or after ~15 ms, whatever the agent's sync took, so the median of seven moves with how many fall slow: four alternated runs of seven changes each (lb-bench-suite --only-ours) gave medians of 3.7 and 5.7 ms for the agent before issue 13's mapped array writes and 3.6 and 3.6 ms after.", Stat::of(cp.change_apply_ms.clone()).map_or("?".into(), |s| format!("median {:.2} ms", s.med))),
        });
        g.push(Goal {
            what: "agent peak RSS ≤ 64 MiB at 10 000 × 10, in both modes (issue 13; issue 6 asked < 100 MiB)",
            met: both_within(cp, cp.ours_rss_mib, cl.and_then(|c| c.rss_mib), 64.0),
            measured: format!(
                "{scale}: manifests {}; cluster mode {}",
                cp.ours_rss_mib
                    .map_or("?".into(), |m| format!("peak {m:.1} MiB (VmHWM)")),
                cl.and_then(|c| c.rss_mib)
                    .map_or("?".into(), |m| format!("peak {m:.1} MiB (VmHWM)"))
            ),
            limit: "The peak comes during the first sync, while the store, the translation's index and desired state and the reconciler's programmed state are all held: 43 MiB of live heap at 10 000 × 10 (heaptrack, manifests mode); the rest of VmHWM is the binary's code (~8 MiB) and the allocator's headers and free room. Issue 13 cut it step by step (manifests mode, VmHWM on one machine, alternated runs): a frontend's desired state shared between translation and reconciler, plans split without a second vector, programmed backends in a hash map written 4096 at a time, glibc's mmap threshold fixed at 128 KiB and two arenas, shared key strings (104 → 88.5 MiB); frontends planned and written 1024 at a time (→ 86.2); one backend table for the use counts and the written entries, ids in use as a bitset (→ 83.5); Services stored as what translation reads, without the API type's metadata (→ 79.4); endpoint addresses kept parsed (→ 77.6); the manifests' indexes sharing one label string per object and one string per namespace (→ 68.2); a file's items boxing their rare parts (→ 67.4). In cluster mode the watches decode EndpointSlices and Services straight into the stored forms, never the API types, and skip managedFields unread (85.5 → 69.9 MiB). Last, a Service's spec and status kept as the fields translation reads, under the API's names, enumerated values as shared text, cluster IPs parsed (lb-bench-suite --only-ours, alternated: manifests 66.5 → 62.1 MiB, cluster mode 69.7 → 60.7 MiB). For the first sync's speed, glibc's mmap threshold then went from 128 KiB to 4 MiB with a trim threshold of 16 MiB (fewer page faults; see the first-sync row): +2.5 MiB at 10 000 × 10 (cluster mode 54.8 → 57.3, manifests 56.6 → 58.7 MiB), none at 100 000 Services (314.8 → 314.6 MiB after one round; glibc's dynamic threshold, as fast, took 323.9 MiB). What is left is per object: the backend table (40 bytes an endpoint), the translation's and reconciler's records of each frontend, and the slices' endpoints.".into(),
        });
    }
    // The largest ClusterIP scale point: its Services carry 2 endpoints each.
    if let Some(large) = r
        .setups
        .iter()
        .filter(|s| s.arm == ArmKind::Ours && s.services >= 100_000)
        .find_map(|s| Some((s.services, s.rss_mib?)))
    {
        g.push(Goal {
            what: "agent peak RSS ≤ 400 MiB at 100 000 Services (issue 13)",
            met: Some(large.1 <= 400.0),
            measured: format!(
                "{}: peak {:.1} MiB (VmHWM, manifests mode, the ClusterIP experiment's scale point)",
                thousands(large.0),
                large.1
            ),
            limit: "The same per-object costs as at 10 000 × 10, on 100 000 Services of 2 endpoints each (the fillers) and the maps' capacity the scale point asks for: the store's Services and slices, the manifests' indexes, the translation's and the reconciler's records of each frontend, all held during the first sync. Read at the end of the point, so it includes the periodic full resync (every 30 s, and when the agent continues after a round), which once held every frontend twice: 371.3 MiB after loading, 413.1 MiB at the end of the point (BENCHMARKS.md at 7e0063f); since a full translation takes the state of every unchanged frontend that the reconciler already holds, a resync peaks below the first sync (100 000 × 2 from manifests, VmHWM after a resync: 406.5 → 368.3 MB).".into(),
        });
    }
    if let Some(np) = r.nodeport.as_ref() {
        g.extend(tc_cost_goals(np));
    }
    if let Some(v) = nodeport_view(r) {
        g.push(nodeport_goal(&v, r));
    }
    if let Some(sc) = &r.schedulers {
        g.push(lc_cost_goal(sc));
    }
    g
}

/// Issue 39: lc at 10 backends costs connect4 at most 100 ns more than
/// random, in the same run.
fn lc_cost_goal(sc: &SchedulerResults) -> Goal {
    let (lc, over) = scheduler_costs(sc, "lc");
    let (random, _) = scheduler_costs(sc, "random");
    let met = over.map(|o| o.med <= 100.0);
    Goal {
        what: "connect4 with lc at 10 backends ≤ random + 100 ns (issue 39)",
        met,
        measured: match (lc, random, over) {
            (Some(l), Some(r), Some(o)) => format!(
                "+{:.0} ns (rounds {:.0} to {:.0}); lc {:.0} ns, random {:.0} ns",
                o.med, o.min, o.max, l.med, r.med
            ),
            _ => "–".into(),
        },
        // The scan's bound is lb_common's `LEAST_SCAN` (64). sed runs the
        // same scan (every weight 1): the gap between the two is the noise.
        limit: format!(
            "lc reads each backend's open count (up to 64) on a connect; sed, the same scan, \
             {} over random in this run: the rounds' spread is the limit; see \
             [Schedulers](#schedulers-issue-39)",
            scheduler_costs(sc, "sed")
                .1
                .map_or("–".into(), |o| format!("{:+.0} ns", o.med))
        ),
    }
}

/// Issue 13's tc goals, judged on the NodePort experiment's per-run costs
/// net of the empty program beside ours (what `BPF_ENABLE_STATS` charges
/// any program here), the gross figures given beside them.
fn tc_cost_goals(np: &crate::nodeport::NodePortResults) -> Vec<Goal> {
    use crate::nodeport::{FLOOR_EGRESS, FLOOR_INGRESS};
    let span = |s: &Stat| format!("{:.0} ns ({:.0}–{:.0})", s.med, s.min, s.max);
    // Per point: ours, the empty program, ours net of it.
    type PerPoint = Vec<(usize, Stat, Option<Stat>, Option<Stat>)>;
    let per_point = |costs: &[crate::nodeport::TcCost], prog: &str, floor: &str| -> PerPoint {
        np.points
            .iter()
            .filter_map(|n| {
                Some((
                    *n,
                    tc_cost(costs, *n, prog)?.0,
                    tc_cost(costs, *n, floor).map(|c| c.0),
                    tc_net_cost(costs, *n, prog, floor),
                ))
            })
            .collect()
    };
    let measured = |costs: &[(usize, Stat, Option<Stat>, Option<Stat>)]| {
        costs
            .iter()
            .map(|(n, ours, floor, net)| {
                let net = net
                    .as_ref()
                    .map_or("net: no empty program measured".into(), |s| {
                        format!("net {}", span(s))
                    });
                let floor = floor
                    .as_ref()
                    .map_or(String::new(), |s| format!(", empty program {}", span(s)));
                format!("{}: {net} (ours {}{floor})", thousands(*n), span(ours))
            })
            .collect::<Vec<_>>()
            .join("; ")
    };
    // Judged net of the floor: without it, not judged.
    let within = |costs: &[(usize, Stat, Option<Stat>, Option<Stat>)], limit: f64| {
        let nets: Option<Vec<f64>> = costs.iter().map(|c| Some(c.3.as_ref()?.med)).collect();
        nets.filter(|n| !n.is_empty())
            .map(|n| n.iter().all(|m| *m <= limit))
    };
    let ingress = per_point(&np.costs, "tc_ingress_eth0", FLOOR_INGRESS);
    let egress = per_point(&np.costs, "tc_egress_eth0", FLOOR_EGRESS);
    // Beside the goal's figure: established packets alone, which are most
    // of a real node's, and the floor of any design that keeps a flow.
    let established = per_point(&np.rr_costs, "tc_ingress_eth0", FLOOR_INGRESS);
    let ingress_measured = if established.is_empty() {
        measured(&ingress)
    } else {
        format!(
            "{}. Established flows only (the rr test's request and response packets on one \
             connection, in a run of its own each round): {}",
            measured(&ingress),
            measured(&established)
        )
    };
    vec![
        Goal {
            what: "tc_ingress ≤ 350 ns per packet (issue 13)",
            met: within(&ingress, 350.0),
            measured: ingress_measured,
            limit: "run_time_ns / run_cnt of tc_ingress on n1's eth0 in the NodePort experiment's connect+close runs, all four packets of each connection (SYN, SYN-ACK, ACK, RST), with the route and neighbour work that bpf_redirect_neigh once did after the program now inside it (a resolved next hop's MACs are written by the program, which then calls bpf_redirect); net of an empty program (r0 = TCX_NEXT; exit) linked before ours on the same packets, per round. A connection's first packets write its flow (two entries into LB_CT_SYN at the SYN; both moved to LB_CONNTRACK at the client's ACK of the SYN-ACK since f3bddf9, at the SYN-ACK before), which is most of the figure; each packet's conntrack lookup misses the CPU's caches after the rest of the stack ran. Issue 13 took ten helper calls out of an established packet and the clock read out of packets that are not ours (see the NodePort section), and the memset and memmove subprogram calls out of every packet (tc_frames cost_by_packet_kind, best of four alternated runs: SYN 1944 → 1703 ns, SYN-ACK 1603 → 1433, established ACK 801 → 701, not ours 431 → 321); then each flow direction kept its next hop in its conntrack entry (CtEntry::hop, checked against the route epoch the agent moves at every rtnetlink change, and the second), so that its packets after the first skip bpf_fib_lookup (cost tests with resolved neighbours, three alternated pairs: established ACK 540–751 → 371–390 ns, RST 671–921 → 501–541 ns; in connect+close the SYN and SYN-ACK still look up, the ACK and RST do not). Conntrack tables with per-CPU LRU lists (BPF_F_NO_COMMON_LRU) were tried twice and dropped: on the SRSO machine, three alternated pairs of this experiment at 1 Service (--quick), 1911 / 2159 / 1777 ns with the common lists against 1895 / 1963 / 2096 ns with per-CPU ones, within the noise; on the Intel Xeon they cost more (both tables per-CPU: 1046 / 1028 / 1065 → 1157 / 1160 / 1136 ns; LB_CONNTRACK alone: 1032 / 1030 / 1052 → 1127 / 1085 / 1093 ns), though they remove the connect latency's p99 tail (see the NodePort section). On either machine kind the reports ran on, the remaining map operations alone exceed 350 ns per connect+close packet: 1679 / 1751 ns net on the AMD EPYC with the SRSO safe-return thunk (BENCHMARKS.md at dc4b6b0), ~1.1 µs on an Intel Xeon without it. Established packets alone (the rr figure beside: the steady state of a long flow, most of a node's packets) stay within 350 ns on that Intel Xeon; the connect+close figure is a flow's setup spread over its four packets: by difference (a quick run of this experiment at 1 Service: 1047 ns net per connect+close packet, 309 ns per established one) the SYN and its SYN-ACK cost ~1.7 µs each, the SYN choosing a backend, reserving a SNAT port and writing both entries into LB_CT_SYN, the SYN-ACK moving both into LB_CONNTRACK (two inserts, two deletes: each a cold element of a large table; since f3bddf9 the client's ACK of the SYN-ACK moves them, so that a SYN-ACK alone, which a backend sends to spoofed SYNs too, establishes nothing). The move is what keeping embryonic flows apart costs (issue 10: a SYN flood cannot evict established flows); a design without it would still write two entries at the SYN.".into(),
        },
        Goal {
            what: "tc_egress ≤ 40 ns per packet that is not ours (issue 13)",
            met: within(&egress, 40.0),
            measured: measured(&egress),
            limit: "Every packet leaving n1's eth0 in this experiment is one tc_egress passes as not ours: the backend is on n2, so a forwarded packet leaves from a SNAT port and a reply to the client from the node port, neither of them a local backend's port (LB_LOCAL_PORTS); only a local backend's reply is looked up. Judged net of the empty program (r0 = TCX_NEXT; exit) linked before ours on the same packets, per round: that program does nothing, and what BPF_ENABLE_STATS charges it (its two clock reads, the call) is more than 40 ns on this machine, so no program would meet the goal gross. What is left is the program's entry, the packet's first bytes and one read of LB_LOCAL_PORTS. That read was most of it while the map held an element per port (65 536 × 4 bytes: a source port's element, a new one at every SNAT port, was mostly a cache miss): three alternated pairs of this experiment at 1 Service (--quick) gave 142 / 122 / 123 ns gross, and 87 / 84 / 96 ns once the map held a bit per port (PortBits: 8 KiB a protocol, which stay cached), the same as a build that skips the read (85 / 90 / 93 ns); the empty program beside them 58–75 ns.".into(),
        },
    ]
}

/// Whether a control-plane goal is met in both modes (manifests, cluster):
/// judged at 10 000 Services only, and only with both measured.
fn both_within(
    cp: &crate::ControlPlane,
    manifests: Option<f64>,
    cluster: Option<f64>,
    limit: f64,
) -> Option<bool> {
    (cp.services >= 10_000)
        .then_some(())
        .and(manifests.zip(cluster))
        .map(|(m, c)| m <= limit && c <= limit)
}

/// Not one of the goals (those are about ClusterIP): whether ours
/// beats every rule-based arm through the NodePort, per round.
fn nodeport_goal(v: &Results, r: &Results) -> Goal {
    let others = [
        ArmKind::IptablesNft,
        ArmKind::IptablesLegacy,
        ArmKind::Nftables,
    ];
    let mut parts = Vec::new();
    let mut worst = f64::INFINITY;
    for mode in [Mode::Cc, Mode::Crr] {
        for &n in &v.points {
            let mut cells = Vec::new();
            for o in others {
                if let Some(s) = ratio(v, n, ArmKind::Ours, o, mode) {
                    worst = worst.min(s.med);
                    cells.push(format!("{:.2}× {}", s.med, o.label()));
                }
            }
            if !cells.is_empty() {
                parts.push(format!(
                    "{} {}: {}",
                    mode.as_str(),
                    thousands(n),
                    cells.join(", ")
                ));
            }
        }
    }
    Goal {
        what: "NodePort (tc path; not an issue goal): ours faster than iptables (nft, legacy) and nftables at every NodePort scale point, connect+close and TCP_CRR",
        met: worst.is_finite().then_some(worst > 1.0),
        measured: parts.join(" ; "),
        limit: {
            let dropped: u64 = r
                .nodeport
                .as_ref()
                .map_or(0, |np| np.ours_stats.iter().map(|s| s.2).sum());
            let mut l = String::from(
                "Ratios of our rate to each arm's in the same round (median). Every arm forwards \
                 twice (n1, n2); the rule-based arms add conntrack and NAT on n1 for a flow's first \
                 packet and a conntrack lookup on every packet, ours a conntrack-map lookup and \
                 rewrite in tc_ingress plus a pass through tc_egress.",
            );
            if dropped > 0 {
                l.push_str(&format!(
                    " Ours dropped {dropped} new flows for want of a free SNAT port (each a 1 s \
                     stall). See the NodePort section."
                ));
            } else {
                l.push_str(" See the NodePort section.");
            }
            l
        },
    }
}

/// Ours net of the empty program beside it: per round, `prog`'s ns per run
/// less `floor`'s on the same packets.
fn tc_net_cost(
    costs: &[crate::nodeport::TcCost],
    services: usize,
    prog: &str,
    floor: &str,
) -> Option<Stat> {
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

    /// The connect-rate goal judges a point on its A/A control's rounds
    /// when it has them (ours ÷ direct of those rounds), else on its main
    /// rounds, and fails on the worst point.
    #[test]
    fn connect_rate_is_judged_per_point_on_its_a_a_control() {
        use crate::{ArmKind as A, Machine, NoiseFloor, Results, Run, Sample};
        let sample = |services, round, arm, rate| Sample {
            services,
            round,
            arm,
            mode: Mode::Cc,
            run: Run {
                rate,
                ..Default::default()
            },
        };
        // Main rounds: ours at 0.90 of direct at both points.
        let mut samples = Vec::new();
        for n in [1, 1000] {
            for round in 0..3 {
                samples.push(sample(n, round, A::Direct, 100.0));
                samples.push(sample(n, round, A::Ours, 90.0));
            }
        }
        // An A/A control: ours at `ours` of direct in every round.
        let floor = |services, ours: f64| NoiseFloor {
            services,
            rounds: 21,
            cc_ms: 1000,
            samples: (0..21)
                .flat_map(|round| {
                    [
                        sample(services, round, A::Direct, 100.0),
                        sample(services, round, A::DirectAgain, 100.0),
                        sample(services, round, A::Ours, ours),
                    ]
                })
                .collect(),
        };
        let mut r = Results {
            machine: Machine {
                cpu: String::new(),
                cores: 2,
                memory: String::new(),
                kernel: String::new(),
                date: String::new(),
                commit: String::new(),
                iptables: String::new(),
                nft: String::new(),
                srso: String::new(),
            },
            quick: false,
            points: vec![1, 1000],
            rounds: 3,
            durations_ms: Vec::new(),
            target_endpoints: 4,
            filler_endpoints: 2,
            ipvs: String::new(),
            setups: Vec::new(),
            samples,
            costs: Vec::new(),
            control: None,
            nodeport: None,
            noise_floors: vec![floor(1, 99.0)],
            noise_floor: None,
            schedulers: None,
            elapsed_s: 0.0,
        };
        let rate_goal = |r: &Results| goals(r).swap_remove(0);
        let measured = |at_1000: &str| format!("1: 0.990, {}: {at_1000}", thousands(1000));
        let g = rate_goal(&r);
        assert!(g.measured.starts_with(&measured("0.900")), "{}", g.measured);
        assert_eq!(
            g.met,
            Some(false),
            "1 000 has only its main rounds, at 0.90"
        );
        assert!(
            g.limit.contains("all above 0.98: met beyond"),
            "{}",
            g.limit
        );
        r.noise_floors.push(floor(1000, 99.0));
        let g = rate_goal(&r);
        assert!(g.measured.starts_with(&measured("0.990")), "{}", g.measured);
        assert_eq!(g.met, Some(true));
        r.noise_floors[0] = floor(1, 97.0);
        let g = rate_goal(&r);
        assert_eq!(g.met, Some(false), "the worst point decides");
        assert!(
            g.limit.contains("all below 0.98: missed beyond"),
            "{}",
            g.limit
        );
        // With direct from ours' namespaces in the control, the goal is
        // judged on ours ÷ that (0.96 / 0.97 here), not on ours ÷ the
        // direct arm (0.96), which is still shown.
        let with_beside = |services, beside: f64, ours: f64| {
            let mut nf = floor(services, ours);
            nf.samples
                .extend((0..21).map(|round| sample(services, round, A::DirectBeside, beside)));
            nf
        };
        r.noise_floors = vec![with_beside(1, 97.0, 96.0), with_beside(1000, 97.0, 96.0)];
        let g = rate_goal(&r);
        assert!(g.measured.starts_with(&measured("0.990")), "{}", g.measured);
        assert!(
            g.measured
                .contains("lb (ours) ÷ direct (ours' namespaces) 0.990")
                && g.measured.contains("lb (ours) ÷ direct 0.960"),
            "{}",
            g.measured
        );
        assert_eq!(g.met, Some(true));
        r.noise_floors[1] = with_beside(1000, 99.0, 96.0);
        assert_eq!(rate_goal(&r).met, Some(false), "0.96 / 0.99 at 1 000");
        let rows = noise_floor_spreads(&r.noise_floors[1]).rows().len();
        assert_eq!(rows, 5, "the beside ratios are in the A/A table");
        assert_eq!(noise_floor_spreads(&floor(1, 99.0)).rows().len(), 3);
        // Results saved before the control ran at every point.
        r.noise_floors.clear();
        r.noise_floor = Some(floor(1, 99.0));
        assert!(rate_goal(&r).measured.starts_with(&measured("0.900")));
    }

    /// The tc goals are judged on ours less the empty program of the same
    /// round; a round without the empty program is left out, and without
    /// any the goal is not judged.
    #[test]
    fn tc_costs_are_judged_net_of_the_empty_program() {
        use crate::nodeport::{NodePortResults, TcCost, FLOOR_EGRESS, FLOOR_INGRESS};
        let cost = |round, prog: &str, ns_per_run: u64| TcCost {
            services: 1,
            round,
            prog: prog.into(),
            run_cnt: 100,
            run_time_ns: 100 * ns_per_run,
            conns: 25,
        };
        let mut np = NodePortResults {
            points: vec![1],
            rounds: 3,
            durations_ms: Vec::new(),
            node_port: 30080,
            setups: Vec::new(),
            samples: Vec::new(),
            costs: vec![
                cost(0, "tc_egress_eth0", 100),
                cost(0, FLOOR_EGRESS, 60),
                cost(1, "tc_egress_eth0", 90),
                cost(1, FLOOR_EGRESS, 40),
                cost(2, "tc_egress_eth0", 80),
            ],
            rr_costs: Vec::new(),
            ours_stats: Vec::new(),
            notes: Vec::new(),
        };
        let net = tc_net_cost(&np.costs, 1, "tc_egress_eth0", FLOOR_EGRESS).unwrap();
        assert_eq!((net.min, net.med, net.max, net.n), (40.0, 45.0, 50.0, 2));
        let egress = |np: &NodePortResults| tc_cost_goals(np).pop().unwrap();
        assert_eq!(egress(&np).met, Some(false), "a median of 45 ns");
        np.costs[3].run_time_ns = 100 * 60;
        assert_eq!(egress(&np).met, Some(true));
        np.costs.retain(|c| c.prog != FLOOR_EGRESS);
        assert_eq!(egress(&np).met, None, "not judged without the floor");
        // tc_ingress is judged on the connect+close runs; the rr runs'
        // established packets are shown beside, not judged.
        let ingress = |np: &NodePortResults| tc_cost_goals(np).swap_remove(0);
        np.costs = vec![cost(0, "tc_ingress_eth0", 1000), cost(0, FLOOR_INGRESS, 50)];
        assert_eq!(ingress(&np).met, Some(false));
        assert!(!ingress(&np).measured.contains("Established"));
        np.rr_costs = vec![cost(0, "tc_ingress_eth0", 300), cost(0, FLOOR_INGRESS, 50)];
        let g = ingress(&np);
        assert_eq!(g.met, Some(false), "{}", g.measured);
        assert!(g.measured.contains("1: net 950 ns"), "{}", g.measured);
        assert!(
            g.measured.contains("Established flows only") && g.measured.contains("1: net 250 ns"),
            "{}",
            g.measured
        );
    }
}
