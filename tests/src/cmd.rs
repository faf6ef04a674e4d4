//! Running commands, failing with the whole command line and its stderr.
use std::process::Command;

use anyhow::{bail, Context as _, Result};

/// The command line as a shell would show it.
pub fn display(cmd: &Command) -> String {
    let mut parts = vec![quote(&cmd.get_program().to_string_lossy())];
    parts.extend(cmd.get_args().map(|a| quote(&a.to_string_lossy())));
    parts.join(" ")
}

fn quote(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./:=@,+%[]".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// Runs `cmd` to completion; its stdout on success, an error naming the
/// command line, the exit status and stderr otherwise.
pub fn run(cmd: &mut Command) -> Result<String> {
    let line = display(cmd);
    let out = cmd
        .stdin(std::process::Stdio::null())
        .output()
        .with_context(|| format!("cannot run `{line}`"))?;
    if !out.status.success() {
        bail!(
            "`{line}` failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim(),
            if out.stdout.is_empty() {
                String::new()
            } else {
                format!("\nstdout: {}", String::from_utf8_lossy(&out.stdout).trim())
            }
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `ip ARGS...`
pub fn ip(args: &[&str]) -> Result<String> {
    run(Command::new("ip").args(args))
}

/// `ip netns exec NETNS ARGS...`
pub fn netns_exec(netns: &str, args: &[&str]) -> Result<String> {
    run(Command::new("ip").args(["netns", "exec", netns]).args(args))
}

/// Sends `sig` to `pid`, ignoring a process that is already gone.
pub fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// Makes the child receive `sig` when the thread that spawned it goes away
/// (`PR_SET_PDEATHSIG`), so that a test process killed before its guards ran
/// takes its agent and servers with it. Spawn from a thread that outlives
/// the child (a test's own thread does).
pub fn die_with_parent(cmd: &mut Command, sig: libc::c_int) -> &mut Command {
    use std::os::unix::process::CommandExt as _;
    // SAFETY: getpid is async-signal-safe.
    let parent = unsafe { libc::getpid() };
    // SAFETY: only async-signal-safe calls (prctl, getppid, _exit) between
    // fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, sig as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The parent died before the prctl: nobody is left to signal us.
            if libc::getppid() != parent {
                libc::_exit(1);
            }
            Ok(())
        })
    }
}

/// Spawns `cmd`, killed with SIGKILL when this process dies, with `stdin`,
/// stdout piped and `stderr`; the child and its command line.
pub fn spawn_piped(
    cmd: &mut Command,
    stdin: std::process::Stdio,
    stderr: std::process::Stdio,
) -> Result<(std::process::Child, String)> {
    let line = display(cmd);
    let child = die_with_parent(cmd, libc::SIGKILL)
        .stdin(stdin)
        .stdout(std::process::Stdio::piped())
        .stderr(stderr)
        .spawn()
        .with_context(|| format!("cannot run `{line}`"))?;
    Ok((child, line))
}
