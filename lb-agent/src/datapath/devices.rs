//! The devices the tc programs are attached to: TCX links pinned in
//! `<bpffs>/links`, or before Linux 6.6 clsact filters (`clsact`); what is
//! attached where, for `lb-agent inspect tc`.
use std::{collections::BTreeSet, ffi::CStr, fs, path::Path};

use anyhow::Context as _;
use aya::{
    programs::{
        links::{FdLink, LinkOrder, PinnedLink},
        tc::TcAttachOptions,
        SchedClassifier, TcAttachType,
    },
    Ebpf,
};

use crate::datapath::{
    clsact::{attach_filter, detach_filters_except, record_filter, recorded_filters, FILTERS_DIR},
    loader::pin_replacing,
    tc::{EGRESS, INGRESS},
};

/// Prefix of the pinned tc links in `<bpffs>/links`.
const PIN_PREFIX: &str = "tc_";

fn pin_name(direction: &str, device: &str) -> String {
    // bpffs refuses dots in names.
    format!("{direction}_{}", device.replace('.', "_"))
}

/// How the tc programs are attached to a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttachMode {
    /// TCX links (Linux 6.6), pinned in `<bpffs>/links`.
    Tcx,
    /// Filters of a clsact qdisc, through netlink (before 6.6), recorded
    /// in `<bpffs>/tc_filters`.
    Netlink,
}

impl AttachMode {
    pub fn name(self) -> &'static str {
        match self {
            AttachMode::Tcx => "tcx",
            AttachMode::Netlink => "netlink",
        }
    }
}

/// `<bpffs>/tc_unattached` → why the tc programs are not attached to a
/// device they are asked for, while that lasts (for `lb-agent inspect
/// tc`).
pub const UNATTACHED_PIN: &str = "tc_unattached";

/// Attaches both programs to every device, as `mode` says, replacing what
/// an earlier run attached only once the new program is in place, and
/// detaching what is no longer wanted: the attachments of devices no longer
/// listed, and every attachment of the other mode (a switch between TCX
/// and netlink across a restart must not leave both, which would translate
/// packets twice). Returns how many earlier attachments were replaced or
/// removed; an error names every device that failed, after the others got
/// their programs.
pub fn attach(
    ebpf: &mut Ebpf,
    pin_dir: &Path,
    devices: &[String],
    mode: AttachMode,
) -> anyhow::Result<usize> {
    let links_dir = pin_dir.join("links");
    let filters_dir = pin_dir.join(FILTERS_DIR);
    let mut keep = BTreeSet::new();
    let mut replaced = 0;
    let mut failed = Vec::new();
    for (name, direction) in [
        (INGRESS, TcAttachType::Ingress),
        (EGRESS, TcAttachType::Egress),
    ] {
        let program: &mut SchedClassifier = ebpf
            .program_mut(name)
            .with_context(|| format!("program {name} missing from the object"))?
            .try_into()
            .with_context(|| format!("program {name} is not a classifier"))?;
        if devices.is_empty() {
            continue;
        }
        if program.fd().is_err() {
            crate::datapath::loader::verify(|| program.load())
                .with_context(|| format!("verifying program {name}"))?;
        }
        let program_id = program.info().map(|i| i.id()).ok();
        for dev in devices {
            let pin_base = pin_name(name, dev);
            let what = format!("{name} on {dev}");
            let attached = match mode {
                // Attached by an earlier attempt of this process (a retry
                // after another device failed): the kernel refuses the
                // same program twice on a device.
                AttachMode::Tcx
                    if program_id.is_some()
                        && pinned_program(&links_dir.join(&pin_base)) == program_id =>
                {
                    Ok(false)
                }
                AttachMode::Tcx => attach_link(program, dev, direction, &what)
                    .and_then(|link| pin_replacing(link, &links_dir, &pin_base, &what)),
                AttachMode::Netlink => attach_filter(program, dev, direction)
                    .with_context(|| format!("attaching {what} (clsact filter)"))
                    .and_then(|was_there| {
                        record_filter(&filters_dir, &pin_base, dev)?;
                        Ok(was_there)
                    }),
            };
            match attached {
                Ok(was_there) => {
                    replaced += usize::from(was_there);
                    keep.insert(pin_base);
                }
                // The other devices still get theirs.
                Err(e) => failed.push(format!("{e:#}")),
            }
        }
    }
    // What this run attached replaces the other mode's attachment of the
    // same device and direction; only when every device has its programs
    // do the other attachments go (a device that failed keeps the earlier
    // run's, which may still serve) and those of devices no longer listed.
    let none = BTreeSet::new();
    let (keep_links, keep_filters) = match (mode, failed.is_empty()) {
        (AttachMode::Tcx, true) => (&keep, &none),
        (AttachMode::Netlink, true) => (&none, &keep),
        (AttachMode::Tcx, false) => (
            &complement(&links_dir, &none),
            &complement(&filters_dir, &keep),
        ),
        (AttachMode::Netlink, false) => (
            &complement(&links_dir, &keep),
            &complement(&filters_dir, &none),
        ),
    };
    replaced += unpin_links_except(&links_dir, keep_links);
    replaced += detach_filters_except(&filters_dir, keep_filters)?.0;
    if !failed.is_empty() {
        anyhow::bail!("{}", failed.join("; "));
    }
    Ok(replaced)
}

/// The names in `dir` other than `these`.
fn complement(dir: &Path, these: &BTreeSet<String>) -> BTreeSet<String> {
    fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !these.contains(n))
        .collect()
}

/// The id of the program the link pinned at `pin` runs.
fn pinned_program(pin: &Path) -> Option<u32> {
    let link = FdLink::from(PinnedLink::from_pin(pin).ok()?);
    link.info().ok().map(|i| i.program_id())
}

/// A TCX link of `program` on `dev`, placed after the links already there.
fn attach_link(
    program: &mut SchedClassifier,
    dev: &str,
    direction: TcAttachType,
    what: &str,
) -> anyhow::Result<FdLink> {
    let id = program
        .attach_with_options(
            dev,
            direction,
            TcAttachOptions::TcxOrder(LinkOrder::default()),
        )
        .with_context(|| format!("attaching {what} (TCX)"))?;
    FdLink::try_from(program.take_link(id)?).with_context(|| format!("link of {what}"))
}

/// One tc program attached to a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attachment {
    pub device: String,
    pub direction: &'static str,
    pub mode: AttachMode,
    pub program: String,
    /// The kernel's program id (TCX links, which the kernel lists).
    pub program_id: Option<u32>,
}

/// What is attached in this network namespace: our programs on TCX, as the
/// kernel lists them for every device, and the clsact filters recorded
/// under `pin_dir`.
pub fn attachments(pin_dir: &Path) -> Vec<Attachment> {
    let mut out = Vec::new();
    for dev in device_names() {
        for (direction, attach) in [
            ("ingress", TcAttachType::Ingress),
            ("egress", TcAttachType::Egress),
        ] {
            let Ok((_, programs)) = SchedClassifier::query_tcx(&dev, attach) else {
                continue;
            };
            for p in programs {
                let name = p.name_as_str().unwrap_or_default();
                if name == INGRESS || name == EGRESS {
                    out.push(Attachment {
                        device: dev.clone(),
                        direction,
                        mode: AttachMode::Tcx,
                        program: name.to_owned(),
                        program_id: Some(p.id()),
                    });
                }
            }
        }
    }
    for (name, device, direction) in recorded_filters(&pin_dir.join(FILTERS_DIR)) {
        let (program, direction) = match direction {
            TcAttachType::Ingress => (INGRESS, "ingress"),
            _ => (EGRESS, "egress"),
        };
        debug_assert!(name.starts_with(program));
        out.push(Attachment {
            device,
            direction,
            mode: AttachMode::Netlink,
            program: program.to_owned(),
            program_id: None,
        });
    }
    out
}

/// Every network device of this network namespace (if_nameindex).
fn device_names() -> Vec<String> {
    let mut out = Vec::new();
    // SAFETY: if_nameindex returns an array ended by a zero entry, freed
    // below.
    let head = unsafe { libc::if_nameindex() };
    if head.is_null() {
        return out;
    }
    let mut cur = head;
    // SAFETY: elements of the array until its terminator.
    while unsafe { (*cur).if_index } != 0 {
        let name = unsafe { CStr::from_ptr((*cur).if_name) };
        out.push(name.to_string_lossy().into_owned());
        cur = unsafe { cur.add(1) };
    }
    // SAFETY: the array from if_nameindex, freed once.
    unsafe { libc::if_freenameindex(head) };
    out
}

/// Unpins the TCX links in `links_dir` not in `keep`; how many.
fn unpin_links_except(links_dir: &Path, keep: &BTreeSet<String>) -> usize {
    let mut n = 0;
    if let Ok(entries) = fs::read_dir(links_dir) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(PIN_PREFIX) && !keep.contains(&name) {
                if let Ok(link) = PinnedLink::from_pin(entry.path()) {
                    drop(link.unpin());
                } else {
                    let _ = fs::remove_file(entry.path());
                }
                n += 1;
            }
        }
    }
    n
}

/// Records (`Some`) or clears why the tc programs are not attached.
pub fn record_unattached(pin_dir: &Path, reason: Option<&str>) {
    let path = pin_dir.join(UNATTACHED_PIN);
    let _ = fs::remove_file(&path);
    if let Some(reason) = reason {
        // A symlink's target holds at most PATH_MAX - 1 bytes.
        let mut end = reason.len().min(4000);
        while !reason.is_char_boundary(end) {
            end -= 1;
        }
        if let Err(e) = std::os::unix::fs::symlink(&reason[..end], &path) {
            tracing::debug!("recording the tc attach failure in {}: {e}", path.display());
        }
    }
}

/// Why the tc programs are not attached, as the agent last recorded it.
pub fn unattached(pin_dir: &Path) -> Option<String> {
    fs::read_link(pin_dir.join(UNATTACHED_PIN))
        .ok()
        .map(|p| p.to_string_lossy().into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pin_names_have_no_dots() {
        assert_eq!(pin_name(INGRESS, "eth0.100"), "tc_ingress_eth0_100");
    }
}
