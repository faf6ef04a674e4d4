//! `lb-agent check`: what this kernel supports and what `run` will do with
//! it, changing nothing. The features are probed as `run` probes them; the
//! programs are verified by this kernel with throwaway maps, nothing
//! attached or pinned. Fails when `run` could not start here, so that a
//! DaemonSet's init container stops a node it cannot serve.
use std::{fmt::Write as _, path::PathBuf};

use anyhow::bail;

use crate::{
    cli::CheckArgs,
    datapath::{
        features::KernelFeatures,
        loader::{self, ProgramCheck, Refusal},
        tc,
    },
};

/// Everything `check` found.
pub struct CheckReport {
    pub kernel: KernelFeatures,
    pub refusal: Refusal,
    /// The cgroup v2 root, where the socket programs attach by default.
    pub cgroup2: Option<PathBuf>,
    /// Each program as the verifier took it; `Err` when the object's maps
    /// did not load, so no program could be tried.
    pub programs: Result<Vec<ProgramCheck>, String>,
}

impl CheckReport {
    pub fn gather(args: &CheckArgs) -> Self {
        let kernel = KernelFeatures::probe();
        let refusal = args.refusal.resolve(&kernel);
        Self {
            cgroup2: loader::cgroup2_root().ok(),
            programs: loader::verify_programs(
                refusal,
                &[tc::INGRESS, tc::EGRESS, crate::datapath::devices::XDP],
            )
            .map_err(|e| format!("{e:#}")),
            kernel,
            refusal,
        }
    }

    /// What `run` needs and this kernel lacks; empty when it can start.
    pub fn missing(&self) -> Vec<String> {
        let mut missing = Vec::new();
        if !self.kernel.btf {
            missing.push("kernel BTF (/sys/kernel/btf/vmlinux, CONFIG_DEBUG_INFO_BTF)".to_owned());
        }
        if self.cgroup2.is_none() {
            missing.push("a mounted cgroup v2 filesystem".to_owned());
        }
        match &self.programs {
            Err(e) => missing.push(format!("the object's maps: {e}")),
            Ok(programs) => missing.extend(
                programs
                    .iter()
                    .filter(|p| p.required && p.rejected.is_some())
                    .map(|p| format!("program {} (rejected by the verifier)", p.name)),
            ),
        }
        missing
    }

    /// The tc programs, when this kernel's verifier rejected one.
    fn tc_rejected(&self) -> bool {
        self.programs
            .as_ref()
            .is_ok_and(|ps| ps.iter().any(|p| !p.required && p.rejected.is_some()))
    }

    /// The report; with `verifier_logs`, the verifier's whole log of each
    /// rejected program too.
    pub fn render(&self, verifier_logs: bool) -> String {
        let k = &self.kernel;
        let yes = |b: bool| if b { "yes" } else { "no" };
        let mut out = String::new();
        let _ = writeln!(out, "kernel {}", k.release);
        let _ = writeln!(out, "\nfeatures (probed):");
        let _ = writeln!(out, "  btf                   {}", yes(k.btf));
        let _ = writeln!(
            out,
            "  set_retval_sock_addr  {}  (bpf_set_retval in sock_addr programs, Linux 6.1)",
            yes(k.set_retval_sock_addr)
        );
        let _ = writeln!(
            out,
            "  tcx                   {}  (TCX links for tc programs, Linux 6.6)",
            yes(k.tcx)
        );
        let cgroup = self
            .cgroup2
            .as_ref()
            .map_or("not mounted".to_owned(), |p| p.display().to_string());
        let _ = writeln!(out, "  cgroup2               {cgroup}");
        let _ = writeln!(
            out,
            "\nprograms (verified by this kernel, nothing attached):"
        );
        match &self.programs {
            Err(e) => {
                let _ = writeln!(out, "  none tried: {e}");
            }
            Ok(programs) => {
                for p in programs {
                    let verdict = match &p.rejected {
                        None => "ok".to_owned(),
                        Some(why) => format!("REJECTED: {why}"),
                    };
                    let _ = writeln!(out, "  {:<16} {verdict}", p.name);
                }
                for p in programs
                    .iter()
                    .filter(|p| verifier_logs && !p.log.is_empty())
                {
                    let _ = writeln!(out, "\nverifier log of {}:\n{}", p.name, p.log.trim_end());
                }
            }
        }
        let _ = writeln!(out, "\nthe agent will:");
        let why = match (self.refusal, k.set_retval_sock_addr) {
            (Refusal::Econnrefused, _) => "as under kube-proxy",
            (Refusal::Eperm, true) => "as asked by --refusal eperm",
            (Refusal::Eperm, false) => "the hook's own error: ECONNREFUSED needs Linux 6.1",
        };
        let _ = writeln!(
            out,
            "  refuse connects and datagrams to Services without endpoints with {} ({why})",
            self.refusal
        );
        let tc = if self.tc_rejected() {
            "not serve NodePorts, LoadBalancer IPs and externalIPs from outside: the verifier rejects the tc programs"
        } else if k.tcx {
            "serve NodePorts, LoadBalancer IPs and externalIPs through tc programs on TCX links"
        } else {
            "serve NodePorts, LoadBalancer IPs and externalIPs through tc programs on clsact filters (no TCX links before Linux 6.6)"
        };
        let _ = writeln!(out, "  {tc}");
        let missing = self.missing();
        if missing.is_empty() {
            let _ = writeln!(out, "\nresult: lb-agent run can start on this kernel");
        } else {
            let _ = writeln!(out, "\nresult: lb-agent run cannot start here; missing:");
            for m in &missing {
                let _ = writeln!(out, "  {m}");
            }
        }
        out
    }
}

pub fn check(args: &CheckArgs) -> anyhow::Result<()> {
    let report = CheckReport::gather(args);
    print!("{}", report.render(args.verifier_logs));
    let missing = report.missing();
    if !missing.is_empty() {
        bail!(
            "this kernel lacks what lb-agent run needs: {}",
            missing.join("; ")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(set_retval: bool, refusal: Refusal, programs: &[(&str, bool, bool)]) -> CheckReport {
        CheckReport {
            kernel: KernelFeatures {
                release: "test".into(),
                set_retval_sock_addr: set_retval,
                tcx: false,
                btf: true,
            },
            refusal,
            cgroup2: Some("/sys/fs/cgroup".into()),
            programs: Ok(programs
                .iter()
                .map(|&(name, required, rejected)| ProgramCheck {
                    name: name.into(),
                    required,
                    rejected: rejected.then(|| "Invalid argument: invalid func unknown#187".into()),
                    log: String::new(),
                })
                .collect()),
        }
    }

    /// Programs as (name, required, rejected), and the reasons expected.
    type VerdictCase<'a> = (&'a [(&'a str, bool, bool)], Vec<&'a str>);

    /// Only what `run` needs makes the check fail: a rejected tc program
    /// is said, a rejected socket program is missing.
    #[test]
    fn required_programs_decide_the_verdict() {
        let cases: [VerdictCase; 3] = [
            (
                &[
                    ("connect4_eperm", true, false),
                    ("tc_ingress", false, false),
                ],
                vec![],
            ),
            (
                &[("connect4_eperm", true, false), ("tc_ingress", false, true)],
                vec![],
            ),
            (
                &[("connect4", true, true), ("tc_ingress", false, false)],
                vec!["program connect4 (rejected by the verifier)"],
            ),
        ];
        for (programs, want) in cases {
            let r = report(false, Refusal::Eperm, programs);
            assert_eq!(r.missing(), want, "{programs:?}");
        }
        let r = report(false, Refusal::Eperm, &[("tc_ingress", false, true)]);
        assert!(r
            .render(false)
            .contains("the verifier rejects the tc programs"));
    }

    #[test]
    fn the_refusal_and_its_reason_are_said() {
        let cases = [
            (
                true,
                Refusal::Econnrefused,
                "with ECONNREFUSED (as under kube-proxy)",
            ),
            (
                true,
                Refusal::Eperm,
                "with EPERM (as asked by --refusal eperm)",
            ),
            (
                false,
                Refusal::Eperm,
                "with EPERM (the hook's own error: ECONNREFUSED needs Linux 6.1)",
            ),
        ];
        for (set_retval, refusal, want) in cases {
            let text = report(set_retval, refusal, &[]).render(false);
            assert!(text.contains(want), "{text}");
        }
    }

    #[test]
    fn missing_btf_and_cgroup2_fail_the_check() {
        let mut r = report(true, Refusal::Econnrefused, &[]);
        r.kernel.btf = false;
        r.cgroup2 = None;
        assert_eq!(r.missing().len(), 2);
        assert!(r.render(false).contains("cannot start here"));
    }
}
