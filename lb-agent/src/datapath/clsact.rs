//! The tc programs as filters of a clsact qdisc, attached through netlink
//! (kernels before 6.6, or `--tc-attach netlink`): our priority and handle,
//! the record of each filter in `<bpffs>/tc_filters`, and their removal.
use std::{collections::BTreeSet, fs, path::Path};

use anyhow::Context as _;
use aya::programs::{
    links::Link as _,
    tc::{self, NlOptions, SchedClassifierLink, TcAttachOptions, TcHandle},
    ProgramError, SchedClassifier, TcAttachType,
};

use crate::datapath::tc::{EGRESS, INGRESS};

/// Our clsact filters' priority and handle, the same on every device and
/// in both directions (ingress and egress are separate lists). Fixed, so
/// that a restarted agent finds its predecessor's filter and replaces it
/// in place, and so that cleanup removes exactly ours: `tc filter show dev
/// DEV ingress` shows them as `pref 1 bpf ... handle 0x4c42 tc_ingress`.
pub const FILTER_PRIORITY: u16 = 1;
pub const FILTER_HANDLE: u32 = 0x4c42;
/// Where the clsact filters are recorded: `<pin name>` → device, a
/// symlink (bpffs holds no files, and refuses dots in names).
pub const FILTERS_DIR: &str = "tc_filters";
/// The filter of `program` at our priority and handle on `dev`, replacing
/// the one there in place (cls_bpf swaps the program under RCU: the device
/// is never without one), else created, with the clsact qdisc if the device
/// has none. Whether one was replaced.
pub(super) fn attach_filter(
    program: &mut SchedClassifier,
    dev: &str,
    direction: TcAttachType,
) -> anyhow::Result<bool> {
    let ours = SchedClassifierLink::attached(
        dev,
        direction,
        FILTER_PRIORITY,
        TcHandle::from(FILTER_HANDLE),
        None,
    )?;
    // Without NLM_F_CREATE: changes the filter at that handle, or fails
    // with ENOENT if there is none.
    let (id, replaced) = match program.attach_to_link(ours) {
        Ok(id) => (id, true),
        Err(e) if errno(&e) == Some(libc::ENOENT) || errno(&e) == Some(libc::EINVAL) => {
            match tc::qdisc_add_clsact(dev) {
                Ok(()) => tracing::info!(device = dev, "clsact qdisc added"),
                Err(tc::TcError::NetlinkError(e)) if e.raw_os_error() == Some(libc::EEXIST) => {}
                Err(e) => return Err(e).context("adding the clsact qdisc"),
            }
            let id = program.attach_with_options(
                dev,
                direction,
                TcAttachOptions::Netlink(NlOptions {
                    priority: FILTER_PRIORITY,
                    handle: TcHandle::from(FILTER_HANDLE),
                    classid: None,
                }),
            )?;
            (id, false)
        }
        Err(e) => return Err(e.into()),
    };
    // The filter outlives this process, as a pinned link does: aya would
    // detach it when the link is dropped.
    std::mem::forget(program.take_link(id)?);
    Ok(replaced)
}

/// The OS error behind a netlink failure.
fn errno(e: &ProgramError) -> Option<i32> {
    match e {
        ProgramError::TcError(tc::TcError::NetlinkError(n)) | ProgramError::NetlinkError(n) => {
            n.raw_os_error()
        }
        ProgramError::TcError(tc::TcError::IoError(e)) => e.raw_os_error(),
        _ => None,
    }
}

pub(super) fn record_filter(dir: &Path, pin_base: &str, dev: &str) -> anyhow::Result<()> {
    fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = dir.join(pin_base);
    if fs::read_link(&path).is_ok_and(|d| d.as_os_str() == dev) {
        return Ok(());
    }
    let _ = fs::remove_file(&path);
    std::os::unix::fs::symlink(dev, &path)
        .with_context(|| format!("recording the filter of {dev} in {}", path.display()))
}

/// The clsact filters recorded in `dir`: (record name, device, direction).
pub fn recorded_filters(dir: &Path) -> Vec<(String, String, TcAttachType)> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Ok(dev) = fs::read_link(entry.path()) else {
            continue;
        };
        let direction = if name.starts_with(INGRESS) {
            TcAttachType::Ingress
        } else if name.starts_with(EGRESS) {
            TcAttachType::Egress
        } else {
            continue;
        };
        out.push((name, dev.to_string_lossy().into_owned(), direction));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Detaches the recorded filters not in `keep` (by our priority and
/// handle: never another user's filter, and the qdisc stays, as others may
/// use it) and forgets them: (how many were detached, the devices not
/// found in this network namespace). A device that is gone took its
/// filters with it.
pub(super) fn detach_filters_except(
    dir: &Path,
    keep: &BTreeSet<String>,
) -> anyhow::Result<(usize, BTreeSet<String>)> {
    let (mut n, mut missing) = (0, BTreeSet::new());
    for (name, dev, direction) in recorded_filters(dir) {
        if keep.contains(&name) {
            continue;
        }
        match SchedClassifierLink::attached(
            &dev,
            direction,
            FILTER_PRIORITY,
            TcHandle::from(FILTER_HANDLE),
            None,
        ) {
            Ok(link) => match link.detach() {
                Ok(()) => n += 1,
                Err(e) if errno(&e) == Some(libc::ENOENT) => {}
                Err(e) => {
                    return Err(e).with_context(|| format!("detaching the filter {name} of {dev}"))
                }
            },
            Err(_) => {
                missing.insert(dev);
            }
        }
        fs::remove_file(dir.join(&name))
            .with_context(|| format!("removing {}", dir.join(&name).display()))?;
    }
    Ok((n, missing))
}

/// Detaches every clsact filter recorded under `pin_dir`, as `lb-agent
/// cleanup` does: (how many, the devices not found in this network
/// namespace, whose filters, if any, are left).
pub fn detach_filters(pin_dir: &Path) -> anyhow::Result<(usize, BTreeSet<String>)> {
    detach_filters_except(&pin_dir.join(FILTERS_DIR), &BTreeSet::new())
}
