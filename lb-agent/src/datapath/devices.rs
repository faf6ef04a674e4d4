//! The devices the tc programs are attached to: TCX links pinned in
//! `<bpffs>/links`, or before Linux 6.6 clsact filters (`clsact`); with
//! `--acceleration`, the XDP stage too (`lb_xdp`, native mode, a pinned
//! XDP link); what is attached where, for `lb-agent inspect tc`.
use std::{
    collections::{BTreeMap, BTreeSet},
    ffi::CStr,
    fs,
    path::Path,
};

use anyhow::Context as _;
use aya::{
    programs::{
        links::{FdLink, LinkOrder, PinnedLink},
        tc::TcAttachOptions,
        xdp::XdpLink,
        SchedClassifier, TcAttachType, Xdp, XdpMode,
    },
    Ebpf,
};
use serde::{Deserialize, Serialize};

use crate::datapath::{
    clsact::{
        self, attach_filter, detach_filters_except, record_filter, recorded_filters, FILTERS_DIR,
    },
    loader::pin_replacing,
    tc::{EGRESS, INGRESS},
};

/// Prefix of the pinned tc links in `<bpffs>/links`.
const PIN_PREFIX: &str = "tc_";
/// Prefix of the pinned XDP links in `<bpffs>/links`: `xdp_<device>_<ifindex>`.
/// The ifindex tells a link of a device deleted since (defunct: the
/// kernel detached it) from one of the device there now.
const XDP_PIN_PREFIX: &str = "xdp_";

fn xdp_pin_name(device: &str, ifindex: u32) -> String {
    format!("{XDP_PIN_PREFIX}{}_{ifindex}", device.replace('.', "_"))
}

/// The XDP program: the tc path's first stage (`lb-ebpf/src/tc/xdp.rs`).
pub const XDP: &str = "lb_xdp";

/// `--acceleration`: the XDP stage on the tc path's devices.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Acceleration {
    /// tc programs only.
    #[default]
    Off,
    /// XDP in the driver on every device; a device whose driver refuses
    /// lacks it (`/readyz` says so).
    Native,
    /// XDP in the driver where it takes it; elsewhere tc alone, said in
    /// the log and `lb-agent inspect tc`, not a failure.
    BestEffort,
}

impl Acceleration {
    pub fn name(self) -> &'static str {
        match self {
            Acceleration::Off => "off",
            Acceleration::Native => "native",
            Acceleration::BestEffort => "best-effort",
        }
    }

    /// What a device whose driver refused the XDP program has at its XDP
    /// hook.
    fn refused(self, why: String) -> HookState {
        match self {
            Acceleration::BestEffort => HookState::Unaccelerated(why),
            _ => HookState::Failed(why),
        }
    }
}

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

/// A hook of a device where one of our programs is attached: each device
/// the tc path serves wants [`Hook::TC`], and with `--acceleration`
/// [`Hook::Xdp`] too.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Hook {
    TcIngress,
    TcEgress,
    Xdp,
}

impl Hook {
    /// What a device of the tc path wants.
    pub const TC: [Hook; 2] = [Hook::TcIngress, Hook::TcEgress];

    /// The program attached there, which also names the hook (a metrics
    /// label, `/readyz`, `lb-agent inspect tc`).
    pub fn name(self) -> &'static str {
        match self {
            Hook::TcIngress => INGRESS,
            Hook::TcEgress => EGRESS,
            Hook::Xdp => XDP,
        }
    }

    pub fn direction(self) -> &'static str {
        match self {
            Hook::TcIngress | Hook::Xdp => "ingress",
            Hook::TcEgress => "egress",
        }
    }

    fn attach_type(self) -> TcAttachType {
        match self {
            Hook::TcIngress | Hook::Xdp => TcAttachType::Ingress,
            Hook::TcEgress => TcAttachType::Egress,
        }
    }

    pub fn from_name(name: &str) -> Option<Hook> {
        [Hook::TcIngress, Hook::TcEgress, Hook::Xdp]
            .into_iter()
            .find(|h| h.name() == name)
    }
}

/// What one hook of a device has after [`attach`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HookState {
    /// Our program was there already, left as it was.
    Kept,
    /// Attached now; `replaced`: in place of an earlier one (an earlier
    /// run's program).
    Attached { replaced: bool },
    /// Not attached: why.
    Failed(String),
    /// `--acceleration best-effort`: the driver refused XDP (why); the tc
    /// programs serve the device alone. Not a failure.
    Unaccelerated(String),
}

/// A device asked for, after [`attach`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceStatus {
    pub device: String,
    /// `None`: no such device in this network namespace.
    pub ifindex: Option<u32>,
    pub hooks: Vec<(Hook, HookState)>,
}

impl DeviceStatus {
    /// The hooks without our program, and why.
    pub fn lacking(&self) -> impl Iterator<Item = (Hook, &str)> {
        self.hooks.iter().filter_map(|(h, s)| match s {
            HookState::Failed(why) => Some((*h, why.as_str())),
            _ => None,
        })
    }

    /// The hooks our programs were attached to by this attach.
    pub fn attached_now(&self) -> impl Iterator<Item = Hook> + '_ {
        self.hooks.iter().filter_map(|(h, s)| match s {
            HookState::Attached { .. } => Some(*h),
            _ => None,
        })
    }

    /// What the device lacks, for `/readyz` and the log: `eth1 (absent):
    /// tc_ingress, tc_egress`, or each hook with its error.
    pub fn lack(&self) -> Option<String> {
        let lacking: Vec<(Hook, &str)> = self.lacking().collect();
        if lacking.is_empty() {
            return None;
        }
        let hooks = || {
            lacking
                .iter()
                .map(|(h, _)| h.name())
                .collect::<Vec<_>>()
                .join(", ")
        };
        Some(match self.ifindex {
            None => format!("{} (absent): {}", self.device, hooks()),
            Some(_) => format!(
                "{}: {}",
                self.device,
                lacking
                    .iter()
                    .map(|(h, why)| format!("{} ({why})", h.name()))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        })
    }

    /// Why this attach put programs on a device that the previous attach
    /// or check (`before`) left in another state; `None` when it attached
    /// nothing. For the one log line per device re-attached.
    pub fn reattached_because(&self, before: &DeviceStatus, mode: AttachMode) -> Option<String> {
        let attached: Vec<Hook> = self.attached_now().collect();
        if attached.is_empty() {
            return None;
        }
        let failed_before: Vec<&str> = before
            .lacking()
            .filter(|(h, _)| attached.contains(h))
            .map(|(_, why)| why)
            .collect();
        Some(match (before.ifindex, self.ifindex) {
            (Some(was), Some(now)) if was != now => {
                format!("re-created (ifindex {was} -> {now})")
            }
            (None, Some(now)) => format!("appeared (ifindex {now})"),
            _ if !failed_before.is_empty() => {
                format!("attaching failed before ({})", failed_before.join("; "))
            }
            _ => {
                let what = match mode {
                    AttachMode::Tcx => "TCX link",
                    AttachMode::Netlink => "clsact filter",
                };
                let hooks: Vec<&str> = attached.iter().map(|h| h.name()).collect();
                format!("{what} of {} missing", hooks.join(", "))
            }
        })
    }
}

/// What [`attach`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AttachReport {
    /// Every device asked for, in the order asked.
    pub devices: Vec<DeviceStatus>,
    /// Earlier attachments replaced or removed.
    pub replaced: usize,
    /// Removing what is no longer wanted failed: programs of the other
    /// mode or of devices no longer listed may still be attached.
    pub cleanup_error: Option<String>,
}

impl AttachReport {
    pub fn failing(&self) -> bool {
        self.cleanup_error.is_some() || self.devices.iter().any(|d| d.lacking().next().is_some())
    }

    /// Why the agent is not ready, naming each device and what it lacks.
    pub fn lack(&self) -> Option<String> {
        let mut parts = Vec::new();
        let devices: Vec<String> = self.devices.iter().filter_map(DeviceStatus::lack).collect();
        if !devices.is_empty() {
            parts.push(format!(
                "devices lack their programs: {}",
                devices.join("; ")
            ));
        }
        if let Some(e) = &self.cleanup_error {
            parts.push(format!("earlier attachments not removed: {e}"));
        }
        (!parts.is_empty()).then(|| parts.join("; "))
    }
}

/// The ifindex of `dev`, `None` without such a device.
pub fn ifindex(dev: &str) -> Option<u32> {
    let name = std::ffi::CString::new(dev).ok()?;
    // SAFETY: a NUL-terminated name.
    let i = unsafe { libc::if_nametoindex(name.as_ptr()) };
    (i != 0).then_some(i)
}

/// Attaches both programs to every device, as `mode` says, leaving those
/// already there (this process's program on the device as it is now),
/// replacing what an earlier run attached only once the new program is in
/// place, and detaching what is no longer wanted: the attachments of
/// devices no longer listed, and every attachment of the other mode (a
/// switch between TCX and netlink across a restart must not leave both,
/// which would translate packets twice). Called whenever the devices
/// change and at every sweep: a device deleted and created again (a new
/// ifindex), or whose link or filter went, gets its programs again. A
/// device that is absent or refuses is reported in its status, after the
/// others got their programs.
pub fn attach(
    ebpf: &mut Ebpf,
    pin_dir: &Path,
    devices: &[String],
    mode: AttachMode,
    acceleration: Acceleration,
) -> AttachReport {
    let links_dir = pin_dir.join("links");
    let filters_dir = pin_dir.join(FILTERS_DIR);
    let mut keep = BTreeSet::new();
    let mut report = AttachReport {
        devices: devices
            .iter()
            .map(|d| DeviceStatus {
                device: d.clone(),
                ifindex: ifindex(d),
                hooks: Vec::new(),
            })
            .collect(),
        ..Default::default()
    };
    for hook in Hook::TC {
        if devices.is_empty() {
            break;
        }
        let program = match tc_program(ebpf, hook) {
            Ok(p) => p,
            Err(e) => {
                let why = format!("{e:#}");
                for st in &mut report.devices {
                    st.hooks.push((hook, HookState::Failed(why.clone())));
                }
                continue;
            }
        };
        let program_id = program.info().map(|i| i.id()).ok();
        for st in &mut report.devices {
            let pin_base = pin_name(hook.name(), &st.device);
            let state = if st.ifindex.is_none() {
                HookState::Failed("device absent".into())
            } else {
                let attached = attach_hook(
                    program,
                    program_id,
                    hook,
                    &st.device,
                    mode,
                    &links_dir,
                    &filters_dir,
                );
                // The other devices still get theirs.
                attached.unwrap_or_else(|e| HookState::Failed(format!("{e:#}")))
            };
            match state {
                HookState::Failed(_) | HookState::Unaccelerated(_) => {}
                HookState::Attached { replaced } => {
                    report.replaced += usize::from(replaced);
                    keep.insert(pin_base);
                }
                HookState::Kept => {
                    keep.insert(pin_base);
                }
            }
            st.hooks.push((hook, state));
        }
    }
    // What this run attached replaces the other mode's attachment of the
    // same device and direction; only when every device has its programs
    // do the other attachments go (a device that failed keeps the earlier
    // run's, which may still serve) and those of devices no longer listed.
    let none = BTreeSet::new();
    let (keep_links, keep_filters) = match (mode, report.failing()) {
        (AttachMode::Tcx, false) => (&keep, &none),
        (AttachMode::Netlink, false) => (&none, &keep),
        (AttachMode::Tcx, true) => (
            &complement(&links_dir, &none),
            &complement(&filters_dir, &keep),
        ),
        (AttachMode::Netlink, true) => (
            &complement(&links_dir, &keep),
            &complement(&filters_dir, &none),
        ),
    };
    report.replaced += unpin_links_except(&links_dir, PIN_PREFIX, keep_links);
    match detach_filters_except(&filters_dir, keep_filters) {
        Ok((n, _)) => report.replaced += n,
        Err(e) => report.cleanup_error = Some(format!("{e:#}")),
    }
    // The XDP stage after the tc programs, which set up the flows it
    // serves; its links of devices gone, or all of them with acceleration
    // off, go.
    let keep_xdp = if acceleration == Acceleration::Off || devices.is_empty() {
        BTreeSet::new()
    } else {
        attach_xdp_all(ebpf, &links_dir, &mut report.devices, acceleration)
    };
    report.replaced += unpin_links_except(&links_dir, XDP_PIN_PREFIX, &keep_xdp);
    report
}

/// Attaches the XDP stage to every device of `statuses` (which get their
/// [`Hook::Xdp`] state); the pin names of the links now in place.
fn attach_xdp_all(
    ebpf: &mut Ebpf,
    links_dir: &Path,
    statuses: &mut [DeviceStatus],
    acceleration: Acceleration,
) -> BTreeSet<String> {
    let mut keep = BTreeSet::new();
    let program = match xdp_program(ebpf) {
        Ok(p) => p,
        Err(e) => {
            for st in statuses {
                st.hooks
                    .push((Hook::Xdp, acceleration.refused(format!("{e:#}"))));
            }
            return keep;
        }
    };
    let program_id = program.info().map(|i| i.id()).ok();
    for st in statuses {
        let state = match st.ifindex {
            None => HookState::Failed("device absent".into()),
            Some(ifindex) => attach_xdp(program, program_id, &st.device, ifindex, links_dir)
                .unwrap_or_else(|e| acceleration.refused(format!("{e:#}"))),
        };
        if let (Some(ifindex), HookState::Kept | HookState::Attached { .. }) = (st.ifindex, &state)
        {
            keep.insert(xdp_pin_name(&st.device, ifindex));
        }
        st.hooks.push((Hook::Xdp, state));
    }
    keep
}

/// The XDP program, loaded (verified) if it is not yet: only with
/// `--acceleration`, so that without it no time goes into its checks.
fn xdp_program(ebpf: &mut Ebpf) -> anyhow::Result<&mut Xdp> {
    let program: &mut Xdp = ebpf
        .program_mut(XDP)
        .with_context(|| format!("program {XDP} missing from the object"))?
        .try_into()
        .with_context(|| format!("program {XDP} is not an XDP program"))?;
    if program.fd().is_err() {
        crate::datapath::loader::verify(|| program.load())
            .with_context(|| format!("verifying program {XDP}"))?;
    }
    Ok(program)
}

/// `program` (kernel id `program_id`) in native mode on `dev`: kept if
/// our pinned link of this ifindex runs it; the program swapped in place
/// (`bpf_link_update`: the device is never without one) if the link runs
/// an earlier run's; else a new link, pinned.
fn attach_xdp(
    program: &mut Xdp,
    program_id: Option<u32>,
    dev: &str,
    ifindex: u32,
    links_dir: &Path,
) -> anyhow::Result<HookState> {
    let name = xdp_pin_name(dev, ifindex);
    let what = format!("{XDP} on {dev}");
    if let Ok(pinned) = PinnedLink::from_pin(links_dir.join(&name)) {
        let link = FdLink::from(pinned);
        let running = link.info().map(|i| i.program_id()).ok();
        if running.is_some() && running == program_id {
            return Ok(HookState::Kept);
        }
        let link = XdpLink::try_from(link).with_context(|| format!("pinned link {name}"))?;
        let id = program
            .attach_to_link(link)
            .with_context(|| format!("replacing the program of {what}"))?;
        // Still pinned: dropping this handle leaves it attached.
        drop(program.take_link(id)?);
        return Ok(HookState::Attached { replaced: true });
    }
    let id = program
        .attach_to_if_index(ifindex, XdpMode::Driver)
        .with_context(|| format!("attaching {what} (native XDP)"))?;
    let link = FdLink::try_from(program.take_link(id)?)
        .with_context(|| format!("link of {what} (XDP links need Linux 5.9)"))?;
    let replaced = pin_replacing(link, links_dir, &name, &what)?;
    Ok(HookState::Attached { replaced })
}

/// `hook`'s program, loaded (verified) if it is not yet.
fn tc_program(ebpf: &mut Ebpf, hook: Hook) -> anyhow::Result<&mut SchedClassifier> {
    let name = hook.name();
    let program: &mut SchedClassifier = ebpf
        .program_mut(name)
        .with_context(|| format!("program {name} missing from the object"))?
        .try_into()
        .with_context(|| format!("program {name} is not a classifier"))?;
    if program.fd().is_err() {
        crate::datapath::loader::verify(|| program.load())
            .with_context(|| format!("verifying program {name}"))?;
    }
    Ok(program)
}

/// Attaches `program` (kernel id `program_id`) at `hook` of `dev`, unless
/// it is there already. TCX: the kernel lists the device's programs (a
/// device created again has none, its old link is defunct); netlink: our
/// filter's program, as the kernel dumps it.
fn attach_hook(
    program: &mut SchedClassifier,
    program_id: Option<u32>,
    hook: Hook,
    dev: &str,
    mode: AttachMode,
    links_dir: &Path,
    filters_dir: &Path,
) -> anyhow::Result<HookState> {
    let pin_base = pin_name(hook.name(), dev);
    let what = format!("{} on {dev}", hook.name());
    let direction = hook.attach_type();
    match mode {
        AttachMode::Tcx => {
            if program_id.is_some_and(|id| tcx_programs(dev, hook).contains(&id)) {
                return Ok(HookState::Kept);
            }
            let link = attach_link(program, dev, direction, &what)?;
            let replaced = pin_replacing(link, links_dir, &pin_base, &what)?;
            Ok(HookState::Attached { replaced })
        }
        AttachMode::Netlink => {
            let there = clsact::filter_program(dev, hook.attach_type())
                .with_context(|| format!("listing the clsact filters of {dev}"))?;
            let state = if program_id.is_some() && there == program_id {
                HookState::Kept
            } else {
                let replaced = attach_filter(program, dev, direction)
                    .with_context(|| format!("attaching {what} (clsact filter)"))?;
                HookState::Attached { replaced }
            };
            record_filter(filters_dir, &pin_base, dev)?;
            Ok(state)
        }
    }
}

/// The ids of the programs on `dev`'s TCX `hook` (none where it cannot be
/// asked: no such device, no TCX).
fn tcx_programs(dev: &str, hook: Hook) -> Vec<u32> {
    SchedClassifier::query_tcx(dev, hook.attach_type())
        .map(|(_, programs)| programs.iter().map(|p| p.id()).collect())
        .unwrap_or_default()
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
    pub ifindex: Option<u32>,
    pub hook: Hook,
    /// "tcx", "netlink" ([`AttachMode::name`]), or "native" (XDP).
    pub mode: &'static str,
    /// The kernel's program id.
    pub program_id: Option<u32>,
}

/// What is attached in this network namespace, as the kernel says: our
/// programs on TCX for every device, and the clsact filters recorded
/// under `pin_dir` that are still there.
pub fn attachments(pin_dir: &Path) -> Vec<Attachment> {
    let mut out = Vec::new();
    for dev in device_names() {
        for hook in Hook::TC {
            let Ok((_, programs)) = SchedClassifier::query_tcx(&dev, hook.attach_type()) else {
                continue;
            };
            for p in programs {
                if p.name_as_str() == Some(hook.name()) {
                    out.push(Attachment {
                        device: dev.clone(),
                        ifindex: ifindex(&dev),
                        hook,
                        mode: AttachMode::Tcx.name(),
                        program_id: Some(p.id()),
                    });
                }
            }
        }
    }
    for (name, device, direction) in recorded_filters(&pin_dir.join(FILTERS_DIR)) {
        let hook = match direction {
            TcAttachType::Ingress => Hook::TcIngress,
            _ => Hook::TcEgress,
        };
        debug_assert!(name.starts_with(hook.name()));
        if let Ok(Some(id)) = clsact::filter_program(&device, direction) {
            out.push(Attachment {
                ifindex: ifindex(&device),
                device,
                hook,
                mode: AttachMode::Netlink.name(),
                program_id: Some(id),
            });
        }
    }
    // Our XDP links whose device is there.
    for entry in fs::read_dir(pin_dir.join("links"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(ifindex) = name
            .strip_prefix(XDP_PIN_PREFIX)
            .and_then(|rest| rest.rsplit_once('_'))
            .and_then(|(_, i)| i.parse::<u32>().ok())
        else {
            continue;
        };
        let Some(device) = device_name(ifindex) else {
            continue;
        };
        let program_id = PinnedLink::from_pin(entry.path())
            .ok()
            .and_then(|l| FdLink::from(l).info().ok())
            .map(|i| i.program_id());
        out.push(Attachment {
            device,
            ifindex: Some(ifindex),
            hook: Hook::Xdp,
            mode: "native",
            program_id,
        });
    }
    out
}

/// The name of the device of `ifindex`, if there is one.
fn device_name(ifindex: u32) -> Option<String> {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: a buffer of IF_NAMESIZE bytes, as if_indextoname wants.
    let name = unsafe { libc::if_indextoname(ifindex, buf.as_mut_ptr()) };
    if name.is_null() {
        return None;
    }
    // SAFETY: NUL-terminated by if_indextoname.
    Some(
        unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned(),
    )
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

/// Unpins the links in `links_dir` whose names start with `prefix`, but
/// those in `keep`; how many.
fn unpin_links_except(links_dir: &Path, prefix: &str, keep: &BTreeSet<String>) -> usize {
    let mut n = 0;
    if let Ok(entries) = fs::read_dir(links_dir) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(prefix) && !keep.contains(&name) {
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

/// `<bpffs>/tc_devices/<pin name>` → the status of a device the tc
/// programs are asked for, as the agent last saw it (for `lb-agent inspect
/// tc`): a symlink to its JSON, as bpffs holds no files.
pub const STATUS_DIR: &str = "tc_devices";
/// Where an agent before issue 42 recorded why it could not attach.
const OLD_UNATTACHED_PIN: &str = "tc_unattached";

/// A device's status as recorded in [`STATUS_DIR`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Recorded {
    pub device: String,
    /// [`AttachMode::name`].
    pub mode: String,
    pub ifindex: Option<u32>,
    /// Hook name → why it lacks our program (for the XDP hook under
    /// `--acceleration best-effort`, why the driver refused it).
    pub lacking: BTreeMap<String, String>,
    /// The XDP stage was asked for (`--acceleration`).
    #[serde(default)]
    pub xdp: bool,
}

impl Recorded {
    fn of(status: &DeviceStatus, mode: AttachMode) -> Self {
        let unaccelerated = status.hooks.iter().filter_map(|(h, s)| match s {
            HookState::Unaccelerated(why) => Some((
                h.name().to_owned(),
                format!("not accelerated (best-effort): {why}"),
            )),
            _ => None,
        });
        Self {
            device: status.device.clone(),
            mode: mode.name().to_owned(),
            ifindex: status.ifindex,
            lacking: status
                .lacking()
                .map(|(h, why)| (h.name().to_owned(), why.to_owned()))
                .chain(unaccelerated)
                .collect(),
            xdp: status.hooks.iter().any(|(h, _)| *h == Hook::Xdp),
        }
    }
}

/// Records each device's status, and forgets devices no longer asked for.
pub fn record_status(pin_dir: &Path, mode: AttachMode, report: &AttachReport) {
    let dir = pin_dir.join(STATUS_DIR);
    let _ = fs::remove_file(pin_dir.join(OLD_UNATTACHED_PIN));
    if let Err(e) = fs::create_dir_all(&dir) {
        return tracing::debug!("creating {}: {e}", dir.display());
    }
    let mut keep = BTreeSet::new();
    for status in &report.devices {
        let name = pin_name("dev", &status.device);
        let mut text = serde_json::to_string(&Recorded::of(status, mode)).unwrap_or_default();
        // A symlink's target holds at most PATH_MAX - 1 bytes: long
        // errors are cut (and the record is then shown without them).
        if text.len() > 4000 {
            let mut short = Recorded::of(status, mode);
            for why in short.lacking.values_mut() {
                why.truncate(200);
            }
            text = serde_json::to_string(&short).unwrap_or_default();
        }
        let path = dir.join(&name);
        if fs::read_link(&path).is_ok_and(|t| t.as_os_str() == text.as_str()) {
            keep.insert(name);
            continue;
        }
        let _ = fs::remove_file(&path);
        if let Err(e) = std::os::unix::fs::symlink(&text, &path) {
            tracing::debug!(
                "recording the status of {} in {}: {e}",
                status.device,
                path.display()
            );
        }
        keep.insert(name);
    }
    for stale in complement(&dir, &keep) {
        let _ = fs::remove_file(dir.join(stale));
    }
}

/// The devices' statuses as the agent last recorded them.
pub fn recorded_status(pin_dir: &Path) -> Vec<Recorded> {
    let mut out: Vec<Recorded> = fs::read_dir(pin_dir.join(STATUS_DIR))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| fs::read_link(e.path()).ok())
        .filter_map(|t| serde_json::from_str(&t.to_string_lossy()).ok())
        .collect();
    out.sort_by(|a, b| a.device.cmp(&b.device));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pin_names_have_no_dots() {
        assert_eq!(pin_name(INGRESS, "eth0.100"), "tc_ingress_eth0_100");
    }

    fn status(ifindex: Option<u32>, states: [HookState; 2]) -> DeviceStatus {
        DeviceStatus {
            device: "eth1".into(),
            ifindex,
            hooks: Hook::TC.into_iter().zip(states).collect(),
        }
    }

    fn failed(why: &str) -> HookState {
        HookState::Failed(why.into())
    }

    const FRESH: HookState = HookState::Attached { replaced: false };

    #[test]
    fn a_device_names_what_it_lacks() {
        let absent = status(None, [failed("device absent"), failed("device absent")]);
        assert_eq!(
            absent.lack().as_deref(),
            Some("eth1 (absent): tc_ingress, tc_egress")
        );
        let refused = status(
            Some(4),
            [
                HookState::Kept,
                failed("attaching tc_egress on eth1 (TCX): EINVAL"),
            ],
        );
        assert_eq!(
            refused.lack().as_deref(),
            Some("eth1: tc_egress (attaching tc_egress on eth1 (TCX): EINVAL)")
        );
        assert_eq!(status(Some(4), [HookState::Kept, FRESH]).lack(), None);
        let report = AttachReport {
            devices: vec![absent, refused],
            ..Default::default()
        };
        assert!(report.failing());
        assert_eq!(
            report.lack().as_deref(),
            Some(
                "devices lack their programs: eth1 (absent): tc_ingress, tc_egress; \
                 eth1: tc_egress (attaching tc_egress on eth1 (TCX): EINVAL)"
            )
        );
        assert_eq!(AttachReport::default().lack(), None);
    }

    #[test]
    fn why_a_device_got_its_programs_again() {
        let kept = status(Some(4), [HookState::Kept, HookState::Kept]);
        let absent = status(None, [failed("device absent"), failed("device absent")]);
        let both = |i| status(Some(i), [FRESH, FRESH]);
        // Nothing attached: nothing to say.
        assert_eq!(kept.reattached_because(&kept, AttachMode::Tcx), None);
        assert_eq!(
            both(9)
                .reattached_because(&kept, AttachMode::Tcx)
                .as_deref(),
            Some("re-created (ifindex 4 -> 9)")
        );
        assert_eq!(
            both(9)
                .reattached_because(&absent, AttachMode::Tcx)
                .as_deref(),
            Some("appeared (ifindex 9)")
        );
        let one = status(Some(4), [HookState::Kept, FRESH]);
        assert_eq!(
            one.reattached_because(&kept, AttachMode::Netlink)
                .as_deref(),
            Some("clsact filter of tc_egress missing")
        );
        assert_eq!(
            both(4)
                .reattached_because(&kept, AttachMode::Tcx)
                .as_deref(),
            Some("TCX link of tc_ingress, tc_egress missing")
        );
        let refused = status(Some(4), [HookState::Kept, failed("EBUSY")]);
        assert_eq!(
            one.reattached_because(&refused, AttachMode::Tcx).as_deref(),
            Some("attaching failed before (EBUSY)")
        );
    }

    #[test]
    fn recorded_status_round_trips_through_json() {
        let st = status(Some(4), [HookState::Kept, failed("it said \"no\"\n")]);
        let r = Recorded::of(&st, AttachMode::Netlink);
        let text = serde_json::to_string(&r).unwrap();
        assert!(!text.contains('\0'));
        assert_eq!(serde_json::from_str::<Recorded>(&text).unwrap(), r);
        assert_eq!(r.mode, "netlink");
        assert_eq!(
            r.lacking.into_iter().collect::<Vec<_>>(),
            vec![("tc_egress".to_owned(), "it said \"no\"\n".to_owned())]
        );
    }
}
