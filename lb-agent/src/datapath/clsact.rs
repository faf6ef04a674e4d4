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

/// The id of the program our filter (priority [`FILTER_PRIORITY`], handle
/// [`FILTER_HANDLE`]) runs on `dev`'s clsact `direction`, as the kernel
/// dumps it (`tc filter show dev DEV ingress`); `None` without it (no
/// filter, no clsact qdisc). An error for a device that is not there.
pub fn filter_program(dev: &str, direction: TcAttachType) -> std::io::Result<Option<u32>> {
    use netlink_sys::{protocols::NETLINK_ROUTE, Socket};
    let ifindex = super::devices::ifindex(dev).ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::NotFound, format!("no device {dev}"))
    })?;
    let mut socket = Socket::new(NETLINK_ROUTE)?;
    socket.bind_auto()?;
    socket.send(&dump_request(ifindex, direction), 0)?;
    let mut found = None;
    let mut buf: Vec<u8> = Vec::with_capacity(64 << 10);
    loop {
        buf.clear();
        socket.recv(&mut buf, 0)?;
        match parse_dump(&buf) {
            Dump::More(id) => found = found.or(id),
            Dump::Done(id) => return Ok(found.or(id)),
            Dump::Error(errno) => {
                return match errno {
                    // No clsact qdisc: no filter of ours.
                    libc::EINVAL | libc::ENOENT => Ok(None),
                    e => Err(std::io::Error::from_raw_os_error(e)),
                };
            }
        }
    }
}

const NLMSG_HDR: usize = 16;
const TCMSG: usize = 20;
/// `TCA_KIND`, `TCA_OPTIONS` and, inside the latter, cls_bpf's `TCA_BPF_ID`.
const TCA_KIND: u16 = 1;
const TCA_OPTIONS: u16 = 2;
const TCA_BPF_ID: u16 = 11;
const NLA_TYPE_MASK: u16 = 0x3fff;

/// `RTM_GETTFILTER` dumping `ifindex`'s clsact filters of `direction`.
fn dump_request(ifindex: u32, direction: TcAttachType) -> Vec<u8> {
    let parent: u32 = match direction {
        TcAttachType::Egress => 0xFFFF_FFF3,
        _ => 0xFFFF_FFF2,
    };
    let mut m = Vec::with_capacity(NLMSG_HDR + TCMSG);
    m.extend_from_slice(&((NLMSG_HDR + TCMSG) as u32).to_ne_bytes());
    m.extend_from_slice(&libc::RTM_GETTFILTER.to_ne_bytes());
    m.extend_from_slice(&((libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16).to_ne_bytes());
    m.extend_from_slice(&1u32.to_ne_bytes()); // sequence
    m.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel's
    m.extend_from_slice(&[libc::AF_UNSPEC as u8, 0, 0, 0]);
    m.extend_from_slice(&(ifindex as i32).to_ne_bytes());
    m.extend_from_slice(&0u32.to_ne_bytes()); // handle
    m.extend_from_slice(&parent.to_ne_bytes());
    m.extend_from_slice(&0u32.to_ne_bytes()); // info: priority, protocol
    m
}

/// One datagram of a filter dump: our filter's program id if it holds it,
/// and whether the dump goes on.
#[derive(Debug, PartialEq, Eq)]
enum Dump {
    More(Option<u32>),
    Done(Option<u32>),
    Error(i32),
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// The attributes in `b`: (type, payload).
fn attributes(mut b: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        let len = u16_at(b, 0)? as usize;
        let kind = u16_at(b, 2)? & NLA_TYPE_MASK;
        let payload = b.get(4..len)?;
        b = b.get(len.next_multiple_of(4)..).unwrap_or(&[]);
        Some((kind, payload))
    })
}

fn parse_dump(mut b: &[u8]) -> Dump {
    let mut found = None;
    while b.len() >= NLMSG_HDR {
        let (Some(len), Some(kind)) = (u32_at(b, 0), u16_at(b, 4)) else {
            break;
        };
        let len = len as usize;
        let Some(msg) = b.get(NLMSG_HDR..len) else {
            break;
        };
        match kind as i32 {
            libc::NLMSG_DONE => return Dump::Done(found),
            libc::NLMSG_ERROR => {
                let errno = u32_at(msg, 0).map_or(0, |e| -(e as i32));
                return if errno == 0 {
                    Dump::Done(found)
                } else {
                    Dump::Error(errno)
                };
            }
            k if k == libc::RTM_NEWTFILTER as i32 && msg.len() >= TCMSG => {
                let handle = u32_at(msg, 8).unwrap_or(0);
                let priority = (u32_at(msg, 16).unwrap_or(0) >> 16) as u16;
                let mut bpf = false;
                let mut id = None;
                for (t, payload) in attributes(&msg[TCMSG..]) {
                    match t {
                        TCA_KIND => bpf = payload.starts_with(b"bpf\0"),
                        TCA_OPTIONS => {
                            id = attributes(payload)
                                .find(|(t, _)| *t == TCA_BPF_ID)
                                .and_then(|(_, p)| u32_at(p, 0));
                        }
                        _ => {}
                    }
                }
                if bpf && handle == FILTER_HANDLE && priority == FILTER_PRIORITY {
                    found = found.or(id);
                }
            }
            _ => {}
        }
        b = b.get(len.next_multiple_of(4)..).unwrap_or(&[]);
    }
    Dump::More(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A netlink message of `kind` around `body`.
    fn message(kind: u16, body: &[u8]) -> Vec<u8> {
        let mut m = Vec::new();
        m.extend_from_slice(&((NLMSG_HDR + body.len()) as u32).to_ne_bytes());
        m.extend_from_slice(&kind.to_ne_bytes());
        m.extend_from_slice(&[0; 10]);
        m.extend_from_slice(body);
        while m.len() % 4 != 0 {
            m.push(0);
        }
        m
    }

    fn attribute(kind: u16, payload: &[u8]) -> Vec<u8> {
        let mut a = Vec::new();
        a.extend_from_slice(&((4 + payload.len()) as u16).to_ne_bytes());
        a.extend_from_slice(&kind.to_ne_bytes());
        a.extend_from_slice(payload);
        while a.len() % 4 != 0 {
            a.push(0);
        }
        a
    }

    /// A filter as the kernel dumps it: cls_bpf (`kind`) at `priority` and
    /// `handle`, running program `id`.
    fn filter(kind: &[u8], priority: u16, handle: u32, id: u32) -> Vec<u8> {
        let mut body = vec![0u8; 4];
        body.extend_from_slice(&7i32.to_ne_bytes());
        body.extend_from_slice(&handle.to_ne_bytes());
        body.extend_from_slice(&0xFFFF_FFF2u32.to_ne_bytes());
        body.extend_from_slice(&(((priority as u32) << 16) | 0x0300).to_ne_bytes());
        body.extend(attribute(TCA_KIND, kind));
        let mut options = attribute(7, b"tc_ingress\0");
        options.extend(attribute(TCA_BPF_ID, &id.to_ne_bytes()));
        body.extend(attribute(TCA_OPTIONS | 0x8000, &options));
        message(libc::RTM_NEWTFILTER, &body)
    }

    #[test]
    fn our_filter_is_found_by_priority_handle_and_kind() {
        let mut dump = filter(b"bpf\0", 1, 0, 0);
        dump.extend(filter(b"bpf\0", 2, FILTER_HANDLE, 41));
        dump.extend(filter(b"u32\0", FILTER_PRIORITY, FILTER_HANDLE, 42));
        assert_eq!(parse_dump(&dump), Dump::More(None));
        dump.extend(filter(b"bpf\0", FILTER_PRIORITY, FILTER_HANDLE, 43));
        assert_eq!(parse_dump(&dump), Dump::More(Some(43)));
        dump.extend(message(libc::NLMSG_DONE as u16, &[0; 4]));
        assert_eq!(parse_dump(&dump), Dump::Done(Some(43)));
        let error = message(libc::NLMSG_ERROR as u16, &(-libc::EINVAL).to_ne_bytes());
        assert_eq!(parse_dump(&error), Dump::Error(libc::EINVAL));
        // Cut short: what is whole is read.
        assert_eq!(parse_dump(&dump[..dump.len() - 4]), Dump::More(Some(43)));
    }
}
