//! `lb-agent run`: load, attach, then keep the maps in sync until a signal.
use std::{collections::BTreeSet, path::Path, time::Duration};

use anyhow::{bail, Context as _};
use notify::{RecursiveMode, Watcher as _};
use tokio::{signal::unix::SignalKind, sync::mpsc, time::Instant};

use crate::{
    cli::RunArgs,
    datapath::{self, Datapath},
    health::{self, Readiness},
    manifest,
    model::Algorithm,
    reconcile::Reconciler,
    translate::{self, TranslateOptions},
};

/// How long a replaced backend set stays readable after the switch. A
/// program holds a `ServiceValue` for well under a microsecond; this is
/// margin, not a guess at that time.
const RETIRE_DELAY: Duration = Duration::from_millis(50);
/// A full reload even without file events, in case one was missed.
const RESYNC_PERIOD: Duration = Duration::from_secs(30);
/// How often expired affinity entries are swept; the kernel honours the
/// timeout on its own, so this only bounds the map.
const AFFINITY_SWEEP_PERIOD: Duration = Duration::from_secs(5);

fn hostname() -> anyhow::Result<String> {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .context("reading the hostname; pass --node-name")?;
    Ok(name.trim().to_owned())
}

/// Logs each distinct problem once, and when it goes away.
#[derive(Default)]
struct ProblemLog {
    seen: BTreeSet<String>,
}

impl ProblemLog {
    fn update(&mut self, now: BTreeSet<String>) {
        for p in now.difference(&self.seen) {
            tracing::warn!("skipped: {p}");
        }
        for p in self.seen.difference(&now) {
            tracing::info!("resolved: {p}");
        }
        self.seen = now;
    }
}

struct Syncer<'a> {
    dir: &'a Path,
    node_name: String,
    algorithm: Algorithm,
    datapath: Datapath,
    reconciler: Reconciler,
    problems: ProblemLog,
}

impl Syncer<'_> {
    /// Reads the directory and programs what it says. Bad objects are
    /// reported and skipped; the rest is programmed.
    fn sync(&mut self) {
        let started = Instant::now();
        let (store, mut rejections) = manifest::load_dir(self.dir);
        let node = store.node_info(&self.node_name);
        let opts = TranslateOptions {
            default_algorithm: self.algorithm,
            node_addresses: Vec::new(),
        };
        let (desired, translate_rejections) = translate::translate(&store, &node, &opts);
        rejections.extend(translate_rejections);
        let report = self.reconciler.apply(&desired, self.datapath.maps());
        for e in &report.errors {
            tracing::error!("map write failed, will retry on the next sync: {e}");
        }
        self.problems
            .update(rejections.iter().map(ToString::to_string).collect());
        // Before the old sets retire: a client must not stick to a backend
        // that just left its Service.
        if report.frontends_written + report.frontends_removed > 0 {
            self.sweep_affinity();
        }
        tracing::info!(
            frontends = desired.frontends.len(),
            written = report.frontends_written,
            removed = report.frontends_removed,
            backends_written = report.backends_written,
            rejected = rejections.len(),
            elapsed_ms = started.elapsed().as_secs_f64() * 1e3,
            "synced"
        );
    }

    fn sweep_affinity(&mut self) {
        let policies = self.reconciler.affinity_policies();
        let r = self.datapath.maps().sweep_affinity(&policies);
        if r.expired + r.no_policy + r.backend_left > 0 {
            tracing::debug!(
                entries = r.entries,
                expired = r.expired,
                service_gone = r.no_policy,
                backend_left = r.backend_left,
                "affinity entries swept"
            );
        }
    }

    fn retire(&mut self) {
        for e in self.reconciler.retire(self.datapath.maps()) {
            tracing::error!("cleanup failed, will retry: {e}");
        }
    }
}

pub async fn run(args: RunArgs) -> anyhow::Result<()> {
    let Some(dir) = args.manifests.as_deref() else {
        bail!("cluster mode is not available yet: pass --manifests DIR");
    };
    if !dir.is_dir() {
        bail!("--manifests {}: not a directory", dir.display());
    }
    let node_name = match args.node_name {
        Some(n) => n,
        None => hostname()?,
    };
    let cgroup = match args.cgroup {
        Some(c) => c,
        None => datapath::cgroup2_root()?,
    };

    let ready = Readiness::default();
    health::serve(args.health_addr, ready.clone()).await?;

    let datapath = Datapath::load(&args.bpffs, &cgroup, &args.capacity)?;
    tracing::info!(
        cgroup = %cgroup.display(),
        bpffs = %args.bpffs.display(),
        node = %node_name,
        "programs attached"
    );

    // Watch before the first read, so no change between the two is lost.
    let (tx, mut events) = mpsc::channel::<()>(1);
    let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        match res {
            Ok(e) if e.kind.is_access() => {}
            // A full channel already holds a pending wake-up.
            Ok(_) => {
                let _ = tx.try_send(());
            }
            Err(e) => tracing::warn!(error = %e, "watching the manifests directory"),
        }
    })
    .context("creating the file watcher")?;
    watcher
        .watch(dir, RecursiveMode::NonRecursive)
        .with_context(|| format!("watching {}", dir.display()))?;

    let mut syncer = Syncer {
        dir,
        node_name,
        algorithm: args.algorithm.into(),
        datapath,
        reconciler: Reconciler::new(args.maglev_table_size),
        problems: ProblemLog::default(),
    };
    syncer.sync();
    ready.set_ready();

    let mut sigterm = tokio::signal::unix::signal(SignalKind::terminate())?;
    let mut sigint = tokio::signal::unix::signal(SignalKind::interrupt())?;
    let mut retire_at: Option<Instant> = syncer.reconciler.has_retiring().then(|| Instant::now() + RETIRE_DELAY);
    let mut resync = tokio::time::interval(RESYNC_PERIOD);
    resync.tick().await;
    let mut sweep = tokio::time::interval(AFFINITY_SWEEP_PERIOD);
    sweep.tick().await;
    loop {
        let retire_sleep = async {
            match retire_at {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = sigterm.recv() => break,
            _ = sigint.recv() => break,
            Some(()) = events.recv() => {
                // Coalesce a burst of writes into one sync.
                tokio::time::sleep(args.sync_debounce).await;
                while events.try_recv().is_ok() {}
                syncer.sync();
            }
            _ = resync.tick() => syncer.sync(),
            _ = sweep.tick() => syncer.sweep_affinity(),
            _ = retire_sleep => {
                syncer.retire();
                retire_at = None;
            }
        }
        if retire_at.is_none() && syncer.reconciler.has_retiring() {
            retire_at = Some(Instant::now() + RETIRE_DELAY);
        }
    }
    tracing::info!("signal received: detaching and removing pins");
    drop(watcher);
    syncer.datapath.unload()
}
