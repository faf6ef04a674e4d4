//! Linker options for the kernel programs, for every way they are built
//! (aya-build from lb-agent's build script, `cargo xtask build-ebpf`).
fn main() {
    // bpf-linker passes `--bpf-expand-memcpy-in-order` to LLVM by default,
    // which leaves memset and memmove no inline expansion at all: every
    // zeroed padding field or overlapping copy became a call into a
    // byte-at-a-time subprogram (a hundred call sites, many on the hot
    // paths, each call returning through the SRSO thunk on such CPUs).
    // Without it LLVM stores small constant-sized blocks inline, as clang
    // does for C programs.
    println!("cargo:rustc-link-arg-bins=--disable-expand-memcpy-in-order");
}
