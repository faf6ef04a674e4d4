//! The agent's view of the two arrays it fills in bulk, `LB_SLOTS` and
//! `LB_BACKENDS`: created with `BPF_F_MMAPABLE` (Linux 5.5) and written
//! through a mapping, so that a 10 000-Service first sync's ~200 000
//! elements are stores to memory, not a copy from user space and an update
//! call per element inside `BPF_MAP_UPDATE_BATCH` (about half the map
//! writes' time, measured).
//!
//! Only a window of [`WINDOW`] bytes is mapped at a time, while it is
//! written or read: the kernel maps every page of a mapping at once, and an
//! array mapped whole (14 MiB at the default sizes) would count in the
//! agent's resident set for memory that is the kernel's either way.
//!
//! An array pinned by an earlier version without the flag cannot be mapped:
//! it is kept (recreating the service maps would drop every sessionAffinity
//! entry) and read and written with system calls, as before.
//!
//! Ordering: a backend set's elements are written before the frontend value
//! that names them, with a system call (`LB_SERVICES`) whose store in the
//! kernel releases every store this CPU made before it, ours included; the
//! fence keeps the compiler from sinking ours past it. Elements are
//! written whole, as the kernel's own update copies them: a program that
//! reads an element while it is rewritten in place (only a backend's flags
//! are) sees the same bytes either way but for those flags.
use std::{
    io,
    marker::PhantomData,
    ops::Range,
    os::fd::{AsFd as _, AsRawFd as _},
    sync::atomic::{fence, Ordering},
};

use aya::{
    maps::{Array, IterableMap as _, MapData},
    Pod,
};
use memmap2::{MmapMut, MmapOptions};

use crate::datapath::{batch, reconcile::BatchResult};

/// `BPF_F_MMAPABLE` (include/uapi/linux/bpf.h).
pub const BPF_F_MMAPABLE: u32 = 1 << 10;

/// Bytes of an array mapped at a time.
pub const WINDOW: usize = 1 << 20;

/// An array map of `V`, written through windows of a mapping when the
/// kernel allows it.
pub struct MappedArray<V: Pod> {
    map: Array<MapData, V>,
    mappable: bool,
    len: u32,
    _values: PhantomData<V>,
}

/// The kernel's element size in an array: the value rounded up to 8 bytes.
const fn stride<V>() -> usize {
    std::mem::size_of::<V>().next_multiple_of(8)
}

/// What the kernel answers for an index past the end of an array.
fn past_end() -> io::Error {
    io::Error::from_raw_os_error(libc::E2BIG)
}

/// The mapped part of an array: bytes `range` of its elements.
struct Window {
    mem: MmapMut,
    range: Range<usize>,
}

impl<V: Pod> MappedArray<V> {
    /// Writes and reads `map` through a mapping if it was created with
    /// `BPF_F_MMAPABLE`, else with system calls.
    pub fn new(map: Array<MapData, V>) -> io::Result<Self> {
        let info = map.map().info().map_err(io::Error::other)?;
        Ok(Self {
            map,
            mappable: info.map_flags() & BPF_F_MMAPABLE != 0,
            len: info.max_entries(),
            _values: PhantomData,
        })
    }

    /// Whether the elements are written as memory (else with system calls).
    pub fn is_mapped(&self) -> bool {
        self.mappable
    }

    /// The window holding element `index`: the one given if it does, else
    /// a new one from the element's page, of at most [`WINDOW`] bytes and
    /// none past the page of element `last` (the last one the caller will
    /// want, if it comes after): the kernel maps every page of a window
    /// when it is made, and a sync's chunk of writes spans far less.
    fn window<'w>(
        &self,
        held: &'w mut Option<Window>,
        index: u32,
        last: u32,
    ) -> io::Result<&'w mut Window> {
        let at = index as usize * stride::<V>();
        let element = at..at + std::mem::size_of::<V>();
        if !held
            .as_ref()
            .is_some_and(|w| w.range.start <= element.start && element.end <= w.range.end)
        {
            let page = page_size();
            // The kernel maps the elements from offset 0, page-aligned;
            // the last page may be partly past the last element.
            let total = (self.len as usize * stride::<V>()).next_multiple_of(page);
            let start = at / page * page;
            let wanted = last.max(index) as usize * stride::<V>() + std::mem::size_of::<V>();
            let end = wanted
                .min(start + WINDOW)
                .max(element.end)
                .next_multiple_of(page)
                .min(total);
            *held = None;
            // SAFETY: the map's own memory, which the kernel keeps while it
            // is mapped; only this agent writes these maps (the programs
            // read them), and every access is inside `range`.
            let mem = unsafe {
                MmapOptions::new()
                    .offset(start as u64)
                    .len(end - start)
                    .map_mut(self.map.map().fd().as_fd().as_raw_fd())?
            };
            *held = Some(Window {
                mem,
                range: start..end,
            });
        }
        Ok(held.as_mut().expect("a window"))
    }

    /// Element `index`, through `held` or a window up to element `last`.
    fn read(&self, held: &mut Option<Window>, index: u32, last: u32) -> io::Result<V> {
        if index >= self.len {
            return Err(past_end());
        }
        let w = self.window(held, index, last)?;
        let at = index as usize * stride::<V>() - w.range.start;
        // SAFETY: inside the window, aligned (page-aligned window, 8-byte
        // stride); any bytes are a valid `V` (`Pod`).
        Ok(unsafe { w.mem.as_ptr().add(at).cast::<V>().read_volatile() })
    }

    /// One element, with a system call: mapping a window costs several
    /// times as much (the agent reads only with `visit`; `inspect` reads
    /// element by element, in no order).
    pub fn get(&self, index: u32) -> io::Result<V> {
        if index >= self.len {
            return Err(past_end());
        }
        self.map.get(&index, 0).map_err(io::Error::other)
    }

    pub fn set(&mut self, index: u32, value: V) -> io::Result<()> {
        self.set_all(&[(index, value)]).map_err(|(_, e)| e)
    }

    /// Writes `items` in order; on failure, how many were written before
    /// the one that failed (an index past the end, as the kernel refuses).
    pub fn set_all(&mut self, items: &[(u32, V)]) -> BatchResult {
        if !self.mappable {
            let (indexes, values): (Vec<u32>, Vec<V>) = items.iter().copied().unzip();
            return batch::update(self.map.map().fd().as_fd(), &indexes, &values)
                .map_err(|e| (e.done, e.error));
        }
        let last = items
            .iter()
            .map(|(i, _)| *i)
            .filter(|i| *i < self.len)
            .max();
        let last = last.unwrap_or(0);
        let mut held = None;
        let result = items
            .iter()
            .enumerate()
            .try_for_each(|(done, &(index, value))| {
                if index >= self.len {
                    return Err((done, past_end()));
                }
                let w = self.window(&mut held, index, last).map_err(|e| (done, e))?;
                let at = index as usize * stride::<V>() - w.range.start;
                // SAFETY: as in `read`.
                unsafe { w.mem.as_mut_ptr().add(at).cast::<V>().write_volatile(value) };
                Ok(())
            });
        fence(Ordering::Release);
        result
    }

    /// Hands every element to `f` with its index, in index order.
    pub fn visit(&self, mut f: impl FnMut(u32, V)) -> io::Result<()>
    where
        V: Default,
    {
        if !self.mappable {
            return batch::visit_array(self.map.map().fd().as_fd(), self.len, f);
        }
        let mut held = None;
        for index in 0..self.len {
            f(index, self.read(&mut held, index, self.len - 1)?);
        }
        Ok(())
    }
}

fn page_size() -> usize {
    // SAFETY: trivial libc call.
    unsafe { libc::sysconf(libc::_SC_PAGESIZE) as usize }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::testing::lacks_root;
    use lb_common::Backend;

    fn array<V: Pod>(flags: u32, len: u32) -> Array<MapData, V> {
        /// `BPF_MAP_TYPE_ARRAY`.
        const ARRAY: u32 = 2;
        let obj =
            aya_obj::Map::new_from_params(ARRAY, 4, std::mem::size_of::<V>() as u32, len, flags);
        let data = MapData::create(obj, "mapped_test", None).expect("creating an array");
        Array::try_from(aya::maps::Map::Array(data)).expect("an array")
    }

    /// What a program would read: the kernel's copy through a system call.
    fn kernel_view<V: Pod>(a: &MappedArray<V>, index: u32) -> V {
        a.map.get(&index, 0).expect("lookup")
    }

    #[test]
    fn writes_through_the_mapping_are_what_the_kernel_reads() {
        if lacks_root("create BPF maps") {
            return;
        }
        let mut a = MappedArray::new(array::<u64>(BPF_F_MMAPABLE, 1000)).unwrap();
        assert!(a.is_mapped());
        a.set_all(&[(0, 7), (999, 9), (500, u64::MAX)]).unwrap();
        assert_eq!(kernel_view(&a, 0), 7);
        assert_eq!(kernel_view(&a, 999), 9);
        assert_eq!(kernel_view(&a, 500), u64::MAX);
        assert_eq!(kernel_view(&a, 1), 0);
        // And the other way: the kernel's writes are seen in the mapping.
        a.map.set(3, 33, 0).unwrap();
        assert_eq!(a.get(3).unwrap(), 33);
        let mut seen = Vec::new();
        a.visit(|i, v| {
            if v != 0 {
                seen.push((i, v))
            }
        })
        .unwrap();
        assert_eq!(seen, [(0, 7), (3, 33), (500, u64::MAX), (999, 9)]);
        // An index past the end stops the writes there, as the kernel does.
        let err = a.set_all(&[(4, 4), (1000, 1), (5, 5)]).unwrap_err();
        assert_eq!((err.0, err.1.raw_os_error()), (1, Some(libc::E2BIG)));
        assert_eq!((kernel_view(&a, 4), kernel_view(&a, 5)), (4, 0));
        assert_eq!(a.get(1000).unwrap_err().raw_os_error(), Some(libc::E2BIG));
    }

    /// Elements of 24 bytes over several windows, one across the first
    /// window's end, written in no particular order.
    #[test]
    fn elements_across_windows_are_written_whole() {
        if lacks_root("create BPF maps") {
            return;
        }
        let len = 100_000u32;
        let mut a = MappedArray::new(array::<Backend>(BPF_F_MMAPABLE, len)).unwrap();
        let across = (WINDOW / stride::<Backend>()) as u32;
        assert!(
            across as usize * 24 + 24 > WINDOW,
            "element {across} crosses the end"
        );
        let backend = |i: u32| Backend {
            port: i as u16,
            addr: [(i >> 8) as u8; 16],
            key_check: i.wrapping_mul(2_654_435_761) | 1,
            ..Default::default()
        };
        let indexes = [
            len - 1,
            0,
            across,
            across - 1,
            across + 1,
            2 * across,
            1,
            len / 2,
        ];
        let items: Vec<(u32, Backend)> = indexes.iter().map(|&i| (i, backend(i))).collect();
        a.set_all(&items).unwrap();
        for &i in &indexes {
            assert_eq!(kernel_view(&a, i), backend(i), "element {i}");
            assert_eq!(a.get(i).unwrap(), backend(i), "element {i}");
        }
        let mut seen = Vec::new();
        a.visit(|i, b| {
            if b != Backend::default() {
                assert_eq!(b, backend(i));
                seen.push(i);
            }
        })
        .unwrap();
        let mut want = indexes.to_vec();
        want.sort();
        assert_eq!(seen, want);
    }

    #[test]
    fn an_array_without_the_flag_is_written_with_system_calls() {
        if lacks_root("create BPF maps") {
            return;
        }
        let mut a = MappedArray::new(array::<u64>(0, 100)).unwrap();
        assert!(!a.is_mapped());
        a.set_all(&[(1, 11), (99, 99)]).unwrap();
        a.set(2, 22).unwrap();
        assert_eq!(
            (kernel_view(&a, 1), kernel_view(&a, 2), kernel_view(&a, 99)),
            (11, 22, 99)
        );
        assert_eq!(a.get(99).unwrap(), 99);
        let err = a.set_all(&[(3, 3), (100, 1)]).unwrap_err();
        assert_eq!(err.0, 1);
        assert_eq!(kernel_view(&a, 3), 3);
    }
}
