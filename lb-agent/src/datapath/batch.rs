//! Batched map writes: `BPF_MAP_UPDATE_BATCH` / `BPF_MAP_DELETE_BATCH`
//! (Linux 5.6+ for hash maps), which aya 0.14 does not wrap; and reading a
//! whole array with `BPF_MAP_LOOKUP_BATCH`.
//!
//! One `bpf(2)` call writes many elements, instead of one call each. When
//! the kernel does not know the command or the map type does not support it
//! (`EINVAL`, `ENOTSUPP`, `EOPNOTSUPP`), the same elements are written one
//! by one with `BPF_MAP_UPDATE_ELEM` / `BPF_MAP_DELETE_ELEM`, and the wrapper
//! remembers not to try the batch command again.
//!
//! Order: the kernel processes a batch in array order and stops at the first
//! failing element, reporting how many it completed in `count`; so a batch
//! is exactly as ordered as the per-element loop it replaces.
use std::{
    io, mem,
    os::fd::{AsRawFd as _, BorrowedFd},
    sync::atomic::{AtomicBool, Ordering},
};

/// `enum bpf_cmd` numbers (include/uapi/linux/bpf.h).
const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;
const BPF_MAP_DELETE_BATCH: libc::c_long = 27;
/// The kernel-internal "not supported" errno that leaks to userspace.
const ENOTSUPP: i32 = 524;

/// Elements per `bpf(2)` call: bounds the time one call holds the CPU and
/// the kernel's temporary buffers.
pub const CHUNK: usize = 8192;

/// The batch member of `union bpf_attr`.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// The element member of `union bpf_attr`.
#[repr(C)]
#[derive(Default)]
struct ElemAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

/// Set once the kernel refused a batch command: later calls go straight to
/// the per-element path.
static BATCH_UNSUPPORTED: AtomicBool = AtomicBool::new(false);

/// Whether batch commands are in use (not yet refused by the kernel).
pub fn batch_supported() -> bool {
    !BATCH_UNSUPPORTED.load(Ordering::Relaxed)
}

#[cfg(test)]
thread_local! {
    /// Tests: `elem_flags` bits to pass in batch commands, to make the kernel
    /// refuse them with EINVAL.
    static INJECT_FLAGS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

fn batch_flags() -> u64 {
    #[cfg(test)]
    return INJECT_FLAGS.with(|f| f.get());
    #[cfg(not(test))]
    0
}

fn sys_bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<()> {
    // SAFETY: `attr` is a live, fully initialised prefix of `union bpf_attr`
    // of the size passed; the kernel zero-extends shorter attrs.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut T as *mut libc::c_void,
            mem::size_of::<T>() as libc::c_uint,
        )
    };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// How many elements a failed batch command completed. The kernel writes
/// `count` back only once it started on the elements; an early refusal
/// (bad flags, unknown command) leaves our input count in place.
fn processed(attr: &BatchAttr, asked: usize) -> usize {
    let n = attr.count as usize;
    if n >= asked {
        0
    } else {
        n
    }
}

fn unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINVAL) | Some(ENOTSUPP) | Some(libc::EOPNOTSUPP)
    )
}

/// A failed batch write: elements before `done` were written, element
/// `done` failed with `error`, later ones were not attempted.
#[derive(Debug)]
pub struct BatchError {
    pub done: usize,
    pub error: io::Error,
}

impl std::fmt::Display for BatchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "element {}: {}", self.done, self.error)
    }
}

impl std::error::Error for BatchError {}

/// Writes `keys[i] → values[i]` (BPF_ANY) into the map, in order. Plain-old
/// data only: `K` and `V` must be the map's exact key and value layouts.
pub fn update<K: Copy, V: Copy>(
    map: BorrowedFd<'_>,
    keys: &[K],
    values: &[V],
) -> Result<(), BatchError> {
    assert_eq!(keys.len(), values.len(), "one value per key");
    chunked(BPF_MAP_UPDATE_BATCH, map, keys, Some(values), |k, v| {
        update_each(map, k, v.unwrap_or_default())
    })
}

/// Deletes `keys` from the map, in order. A missing key fails the batch with
/// `ENOENT` at that element, as `BPF_MAP_DELETE_ELEM` would.
pub fn delete<K: Copy>(map: BorrowedFd<'_>, keys: &[K]) -> Result<(), BatchError> {
    chunked::<K, ()>(BPF_MAP_DELETE_BATCH, map, keys, None, |k, _| {
        delete_each(map, k)
    })
}

/// `cmd` over `keys` (and `values`, for updates) in chunks of [`CHUNK`]; a
/// chunk the kernel refuses as unsupported goes through `each`, one element
/// at a time, and so do all later ones.
fn chunked<K: Copy, V: Copy>(
    cmd: libc::c_long,
    map: BorrowedFd<'_>,
    keys: &[K],
    values: Option<&[V]>,
    each: impl Fn(&[K], Option<&[V]>) -> Result<(), BatchError>,
) -> Result<(), BatchError> {
    let mut done = 0;
    while done < keys.len() {
        let end = (done + CHUNK).min(keys.len());
        let (k, v) = (&keys[done..end], values.map(|v| &v[done..end]));
        if batch_supported() {
            let mut attr = BatchAttr {
                keys: k.as_ptr() as u64,
                values: v.map_or(0, |v| v.as_ptr() as u64),
                count: k.len() as u32,
                map_fd: map.as_raw_fd() as u32,
                elem_flags: batch_flags(),
                ..Default::default()
            };
            match sys_bpf(cmd, &mut attr) {
                Ok(()) => {
                    done = end;
                    continue;
                }
                Err(e) if processed(&attr, k.len()) == 0 && unsupported(&e) => {
                    BATCH_UNSUPPORTED.store(true, Ordering::Relaxed);
                }
                Err(error) => {
                    return Err(BatchError {
                        done: done + processed(&attr, k.len()),
                        error,
                    })
                }
            }
        }
        each(k, v).map_err(|e| BatchError {
            done: done + e.done,
            error: e.error,
        })?;
        done = end;
    }
    Ok(())
}

/// Every element of an array map of `len` elements of `V`, in index
/// order: [`CHUNK`] at a time with `BPF_MAP_LOOKUP_BATCH`, or one by one
/// where the kernel refuses it.
pub fn lookup_array<V: Copy + Default>(map: BorrowedFd<'_>, len: u32) -> io::Result<Vec<V>> {
    let mut values = Vec::with_capacity(len as usize);
    visit_array(map, len, |_, v| values.push(v))?;
    Ok(values)
}

/// Hands every element of an array map of `len` elements of `V` to `f`
/// with its index, in index order, as [`lookup_array`] reads them; only a
/// chunk is held at a time (`LB_BACKENDS` at its default size is 7 MiB).
pub fn visit_array<V: Copy + Default>(
    map: BorrowedFd<'_>,
    len: u32,
    mut f: impl FnMut(u32, V),
) -> io::Result<()> {
    let len = len as usize;
    let mut values = vec![V::default(); CHUNK.min(len)];
    let mut keys = vec![0u32; CHUNK.min(len)];
    let mut done = 0;
    // The last index read, where the next call goes on.
    let (mut after, mut last) = (0u32, 0u32);
    while done < len && batch_supported() {
        let count = CHUNK.min(len - done);
        let mut attr = BatchAttr {
            in_batch: if done == 0 {
                0
            } else {
                &after as *const u32 as u64
            },
            out_batch: &mut last as *mut u32 as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: count as u32,
            map_fd: map.as_raw_fd() as u32,
            ..Default::default()
        };
        let at_end = match sys_bpf(BPF_MAP_LOOKUP_BATCH, &mut attr) {
            Ok(()) => false,
            // The end of the map: `count` says how many this call read.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => true,
            Err(e) if done == 0 && unsupported(&e) => {
                BATCH_UNSUPPORTED.store(true, Ordering::Relaxed);
                break;
            }
            Err(e) => return Err(e),
        };
        let read = (attr.count as usize).min(count);
        for (i, (key, value)) in keys[..read].iter().zip(&values[..read]).enumerate() {
            if *key as usize != done + i {
                return Err(io::Error::other(format!(
                    "read element {key} of an array where {} was due",
                    done + i
                )));
            }
            f(*key, *value);
        }
        done += read;
        after = last;
        if at_end {
            break;
        }
    }
    if done < len && !batch_supported() {
        for index in done as u32..len as u32 {
            let mut value = V::default();
            let mut attr = ElemAttr {
                map_fd: map.as_raw_fd() as u32,
                key: &index as *const u32 as u64,
                value: &mut value as *mut V as u64,
                ..Default::default()
            };
            sys_bpf(BPF_MAP_LOOKUP_ELEM, &mut attr)?;
            f(index, value);
        }
        done = len;
    }
    if done < len {
        return Err(io::Error::other(format!(
            "read {done} of {len} elements of an array"
        )));
    }
    Ok(())
}

/// The per-element fallback of [`update`].
pub fn update_each<K: Copy, V: Copy>(
    map: BorrowedFd<'_>,
    keys: &[K],
    values: &[V],
) -> Result<(), BatchError> {
    each_elem(BPF_MAP_UPDATE_ELEM, map, keys, |i| {
        values[i..].as_ptr() as u64
    })
}

/// The per-element fallback of [`delete`].
pub fn delete_each<K: Copy>(map: BorrowedFd<'_>, keys: &[K]) -> Result<(), BatchError> {
    each_elem(BPF_MAP_DELETE_ELEM, map, keys, |_| 0)
}

fn each_elem<K: Copy>(
    cmd: libc::c_long,
    map: BorrowedFd<'_>,
    keys: &[K],
    value: impl Fn(usize) -> u64,
) -> Result<(), BatchError> {
    for (i, k) in keys.iter().enumerate() {
        let mut attr = ElemAttr {
            map_fd: map.as_raw_fd() as u32,
            key: k as *const K as u64,
            value: value(i),
            ..Default::default()
        };
        sys_bpf(cmd, &mut attr).map_err(|error| BatchError { done: i, error })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::base::testing::lacks_root;
    use std::os::fd::{AsFd as _, FromRawFd as _, OwnedFd};

    use super::*;

    /// A BPF hash (or array) map of `u32 → u64` made with BPF_MAP_CREATE.
    fn create_map(map_type: u32, max_entries: u32) -> OwnedFd {
        #[repr(C)]
        #[derive(Default)]
        struct CreateAttr {
            map_type: u32,
            key_size: u32,
            value_size: u32,
            max_entries: u32,
            map_flags: u32,
        }
        let mut attr = CreateAttr {
            map_type,
            key_size: 4,
            value_size: 8,
            max_entries,
            ..Default::default()
        };
        // SAFETY: as in sys_bpf; BPF_MAP_CREATE (0) returns a new fd.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                0 as libc::c_long,
                &mut attr as *mut CreateAttr as *mut libc::c_void,
                mem::size_of::<CreateAttr>() as libc::c_uint,
            )
        };
        assert!(fd >= 0, "BPF_MAP_CREATE: {}", io::Error::last_os_error());
        // SAFETY: a fresh fd we own.
        unsafe { OwnedFd::from_raw_fd(fd as i32) }
    }

    fn lookup(map: BorrowedFd<'_>, key: u32) -> Option<u64> {
        let mut value = 0u64;
        let mut attr = ElemAttr {
            map_fd: map.as_raw_fd() as u32,
            key: &key as *const u32 as u64,
            value: &mut value as *mut u64 as u64,
            ..Default::default()
        };
        // BPF_MAP_LOOKUP_ELEM = 1
        sys_bpf(1, &mut attr).ok().map(|()| value)
    }

    #[test]
    fn batch_update_and_delete_on_a_real_hash_map() {
        if lacks_root("create BPF maps") {
            return;
        }
        // More than one chunk, so the chunking is exercised too.
        let n = CHUNK as u32 * 2 + 17;
        let map = create_map(1, n); // BPF_MAP_TYPE_HASH
        let keys: Vec<u32> = (0..n).collect();
        let values: Vec<u64> = keys.iter().map(|k| u64::from(*k) * 3 + 1).collect();
        update(map.as_fd(), &keys, &values).unwrap();
        for k in [0, 1, CHUNK as u32, n - 1] {
            assert_eq!(lookup(map.as_fd(), k), Some(u64::from(k) * 3 + 1));
        }
        // Overwrite in place.
        update(map.as_fd(), &keys[..10], &[7u64; 10]).unwrap();
        assert_eq!(lookup(map.as_fd(), 9), Some(7));
        delete(map.as_fd(), &keys[..n as usize - 1]).unwrap();
        assert_eq!(lookup(map.as_fd(), 0), None);
        assert_eq!(lookup(map.as_fd(), n - 1), Some(u64::from(n - 1) * 3 + 1));
        // A full map: the batch stops at the first element that does not fit
        // and says how far it got.
        let more: Vec<u32> = (n..n + 5).collect();
        update(map.as_fd(), &more, &[0u64; 5]).unwrap();
        // 6 entries now: n - 6 more fit.
        let overflow: Vec<u32> = (0..n).map(|k| k + 10 * n).collect();
        let err = update(map.as_fd(), &overflow, &vec![0u64; n as usize]).unwrap_err();
        assert_eq!(err.error.raw_os_error(), Some(libc::E2BIG), "{err}");
        assert_eq!(err.done, n as usize - 6);
        // Deleting a missing key fails at that element.
        let err = delete(map.as_fd(), &[n + 1, 12345678]).unwrap_err();
        assert_eq!(
            (err.done, err.error.raw_os_error()),
            (1, Some(libc::ENOENT))
        );
        assert_eq!(lookup(map.as_fd(), n + 1), None);
    }

    #[test]
    fn whole_arrays_are_read_back() {
        if lacks_root("create BPF maps") {
            return;
        }
        for n in [1, 7, CHUNK as u32, CHUNK as u32 * 2 + 3] {
            let map = create_map(2, n); // BPF_MAP_TYPE_ARRAY
            let keys: Vec<u32> = (0..n).collect();
            let values: Vec<u64> = keys.iter().map(|k| u64::from(*k) * 5 + 2).collect();
            update(map.as_fd(), &keys, &values).unwrap();
            assert_eq!(lookup_array::<u64>(map.as_fd(), n).unwrap(), values, "{n}");
        }
        // One by one, as where the kernel refuses batches.
        let map = create_map(2, 10);
        let values: Vec<u64> = (0..10).map(|v| v + 40).collect();
        update(map.as_fd(), &(0..10).collect::<Vec<u32>>(), &values).unwrap();
        BATCH_UNSUPPORTED.store(true, Ordering::Relaxed);
        let read = lookup_array::<u64>(map.as_fd(), 10);
        BATCH_UNSUPPORTED.store(false, Ordering::Relaxed);
        assert_eq!(read.unwrap(), values);
    }

    #[test]
    fn per_element_fallback_matches() {
        if lacks_root("create BPF maps") {
            return;
        }
        let map = create_map(1, 64);
        let keys: Vec<u32> = (0..40).collect();
        let values: Vec<u64> = keys.iter().map(|k| u64::from(*k) + 100).collect();
        update_each(map.as_fd(), &keys, &values).unwrap();
        assert_eq!(lookup(map.as_fd(), 39), Some(139));
        let err = update_each(
            map.as_fd(),
            &(0..40).map(|k| k + 1000).collect::<Vec<_>>(),
            &values,
        )
        .unwrap_err();
        assert_eq!(
            (err.done, err.error.raw_os_error()),
            (24, Some(libc::E2BIG))
        );
        delete_each(map.as_fd(), &keys).unwrap();
        assert_eq!(lookup(map.as_fd(), 0), None);
        let err = delete_each(map.as_fd(), &[1000, 5]).unwrap_err();
        assert_eq!(
            (err.done, err.error.raw_os_error()),
            (1, Some(libc::ENOENT))
        );
    }

    #[test]
    fn refused_batch_falls_back_per_element() {
        if lacks_root("create BPF maps") {
            return;
        }
        assert!(unsupported(&io::Error::from_raw_os_error(ENOTSUPP)));
        assert!(unsupported(&io::Error::from_raw_os_error(libc::EOPNOTSUPP)));
        assert!(!unsupported(&io::Error::from_raw_os_error(libc::E2BIG)));
        let map = create_map(1, 64);
        let keys: Vec<u32> = (0..50).collect();
        let values: Vec<u64> = keys.iter().map(|k| u64::from(*k) + 1).collect();
        // Unknown flags: the kernel answers EINVAL before any element, as an
        // old kernel does for an unknown command.
        INJECT_FLAGS.with(|f| f.set(1 << 40));
        let r = update(map.as_fd(), &keys, &values);
        let refused = !batch_supported();
        let d = delete(map.as_fd(), &keys[..10]);
        INJECT_FLAGS.with(|f| f.set(0));
        BATCH_UNSUPPORTED.store(false, Ordering::Relaxed);
        r.unwrap();
        d.unwrap();
        assert!(refused, "the refusal was not remembered");
        assert_eq!(lookup(map.as_fd(), 9), None);
        assert_eq!(lookup(map.as_fd(), 49), Some(50));
    }
}
