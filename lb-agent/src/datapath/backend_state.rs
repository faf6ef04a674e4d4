//! This node's state of each backend, `LB_BACKEND_STATE`, as the agent
//! keeps it: the tc path's flow counts (`BackendState::flows`), which
//! `tc_ingress` raises for every new flow of a counting scheduler and the
//! agent sets to the flows it finds live after each conntrack sweep. A
//! flow can end without a program seeing it (closed, expired, evicted
//! from a full table), so the count is taken from the tables themselves.
//!
//! The array is created `BPF_F_MMAPABLE` and mapped whole (16 bytes a
//! backend: 4 MiB at the default 262 144), so that each correction is an
//! atomic add on the memory the programs add to: a flow the kernel counts
//! while the agent corrects is never lost.
use std::{
    collections::HashMap,
    io,
    os::fd::{AsFd as _, AsRawFd as _},
    sync::atomic::{AtomicI32, Ordering},
};

use aya::maps::MapData;
use lb_common::BackendState;
use memmap2::{MmapMut, MmapOptions};

use crate::datapath::mapped::BPF_F_MMAPABLE;

/// The mapped `LB_BACKEND_STATE`.
pub struct BackendStates {
    mem: MmapMut,
    len: usize,
}

const STRIDE: usize = std::mem::size_of::<BackendState>();
const FLOWS: usize = std::mem::offset_of!(BackendState, flows);
const _: () = assert!(STRIDE % 8 == 0 && FLOWS % 4 == 0);

impl BackendStates {
    /// Maps `map`; `None` for an array made without `BPF_F_MMAPABLE`.
    pub fn map(map: &MapData) -> io::Result<Option<Self>> {
        let info = map.info().map_err(io::Error::other)?;
        if info.map_flags() & BPF_F_MMAPABLE == 0 {
            return Ok(None);
        }
        let len = info.max_entries() as usize;
        // SAFETY: the kernel's array memory, as long as the mapping; every
        // access below is an atomic 32-bit one at a 4-aligned offset.
        let mem = unsafe {
            MmapOptions::new()
                .len(len * STRIDE)
                .map_mut(map.fd().as_fd().as_raw_fd())?
        };
        Ok(Some(Self { mem, len }))
    }

    fn flows(&self, id: usize) -> &AtomicI32 {
        debug_assert!(id < self.len);
        // SAFETY: within the mapping, 4-aligned (the mapping is
        // page-aligned, the offset a multiple of 4); shared with the
        // kernel, which only adds to it atomically.
        unsafe { AtomicI32::from_ptr(self.mem.as_ptr().add(id * STRIDE + FLOWS) as *mut i32) }
    }

    /// Every backend's flow count now (`BackendState::flows`), by id;
    /// zeros left out.
    pub fn flow_counts(&self) -> HashMap<u32, i32> {
        (0..self.len)
            .filter_map(|id| {
                let n = self.flows(id).load(Ordering::Relaxed);
                (n != 0).then_some((id as u32, n))
            })
            .collect()
    }

    /// Brings each backend's flow count from `before` (its
    /// [`flow_counts`](Self::flow_counts) read just before the tables
    /// were) to `live` (the counted flows found in them), adding the
    /// difference: what the kernel counted since `before` stays counted.
    /// Returns how many backends were corrected.
    pub fn correct_flows(&self, before: &HashMap<u32, i32>, live: &HashMap<u32, i32>) -> usize {
        let mut corrected = 0;
        for id in before
            .keys()
            .chain(live.keys().filter(|id| !before.contains_key(*id)))
        {
            if *id as usize >= self.len {
                continue;
            }
            let delta = live.get(id).copied().unwrap_or(0) - before.get(id).copied().unwrap_or(0);
            if delta != 0 {
                self.flows(*id as usize).fetch_add(delta, Ordering::Relaxed);
                corrected += 1;
            }
        }
        corrected
    }
}
