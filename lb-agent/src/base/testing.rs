//! Helpers of the crate's unit tests.

/// Whether this process lacks root; if so, says which test is skipped and
/// why, loudly, so a skipped run is never mistaken for a pass.
pub fn lacks_root(to_do: &str) -> bool {
    // SAFETY: trivial libc call.
    let root = unsafe { libc::geteuid() } == 0;
    if !root {
        eprintln!("SKIPPED: needs root to {to_do}");
    }
    !root
}
