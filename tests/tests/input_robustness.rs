//! Input that cannot be read, or is too much to read: an error reading the
//! manifests keeps what was last read (it never means "deleted"), and the
//! rest of the sync goes on.
mod common;

use std::time::Duration;

use common::*;
use integration_tests::{require_root, wait_until, Env};

/// Waits until the agent's log, from `offset` on, shows `what` and then a
/// finished sync (the sync that found it programmed what it had).
fn wait_logged(env: &Env, offset: usize, what: &str) {
    let agent = env.agent();
    let seen = wait_until(Duration::from_secs(10), Duration::from_millis(50), || {
        let log = agent.log_since(offset);
        log.find(what)
            .is_some_and(|at| log[at..].contains(" synced "))
    });
    assert!(seen, "no `{what}` then a sync in the log:\n{}", agent.log());
}

/// A manifest that cannot be read, then a manifests directory that cannot
/// be listed (as with EMFILE at the open-file limit): the Services stay
/// served and the error names the path. Before, both were taken as "the
/// file is gone" and every Service they held was removed.
#[test]
fn read_errors_keep_the_last_good_services() {
    require_root!();
    let env = web_env("unread", 2);
    assert_all_ok("before", &env.tcp("10.96.0.10:80", 10));
    let dir = env.manifests.path().to_owned();
    let file = dir.join("web.yaml");
    let text = std::fs::read_to_string(&file).unwrap();

    // A symlink loop where the file was: it cannot even be stat'ed.
    let offset = env.agent().log().len();
    std::fs::remove_file(&file).unwrap();
    std::os::unix::fs::symlink("web.yaml", &file).unwrap();
    wait_logged(&env, offset, &format!("{}: cannot read", file.display()));
    assert_all_ok(
        "while web.yaml cannot be read",
        &env.tcp("10.96.0.10:80", 10),
    );
    std::fs::remove_file(&file).unwrap();
    env.manifests.write_raw("web.yaml", &text).unwrap();

    // The directory's path is a file for a while; a file created in the
    // (watched, renamed) directory wakes a sync that cannot list it.
    let offset = env.agent().log().len();
    let away = dir.with_extension("away");
    std::fs::rename(&dir, &away).unwrap();
    std::fs::write(&dir, "not a directory").unwrap();
    std::fs::write(away.join("wake.txt"), "").unwrap();
    wait_logged(
        &env,
        offset,
        &format!("{}: cannot read the manifests directory", dir.display()),
    );
    let during = env.tcp("10.96.0.10:80", 10);
    std::fs::remove_file(&dir).unwrap();
    std::fs::rename(&away, &dir).unwrap();
    assert_all_ok("while the directory cannot be listed", &during);

    // Readable again: a change is programmed as usual.
    env.manifests
        .write("api.yaml", &one_pod_http("api", "10.96.0.40", 1))
        .unwrap();
    let served = wait_until(Duration::from_secs(5), Duration::from_millis(50), || {
        env.tcp("10.96.0.40:80", 2)
            .iter()
            .all(|a| a.error.is_none())
    });
    assert!(served, "a Service added after the errors is not served");
    assert_all_ok("after", &env.tcp("10.96.0.10:80", 10));
}

/// "Max open files" of process `pid`: (soft, hard).
fn open_file_limits(pid: u32) -> (String, String) {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    let mut fields = line["Max open files".len()..].split_whitespace();
    let soft = fields.next().unwrap().to_owned();
    (soft, fields.next().unwrap().to_owned())
}

/// Started with a soft open-file limit of 256 (1 024 is a common default),
/// the agent raises it to the hard limit and logs it: descriptors run out
/// far later. Before, it kept the limit it was given.
#[test]
fn the_agent_raises_its_open_file_limit() {
    require_root!();
    let mut env = Env::new("nofile", 1).unwrap();
    env.manifests.write("web.yaml", &web(&env)).unwrap();
    env.start_agent_with(integration_tests::AgentOpts {
        open_files_soft_limit: Some(256),
        ..Default::default()
    })
    .unwrap();
    let agent = env.agent();
    let (soft, hard) = open_file_limits(agent.pid());
    assert_ne!(soft, "256", "the agent kept the soft limit it was given");
    assert_eq!(soft, hard, "the soft open-file limit is not the hard one");
    let log = agent.log();
    assert!(
        log.contains("open-file limit raised") && log.contains("from=256"),
        "not logged:\n{log}"
    );
    assert_all_ok("served", &env.tcp("10.96.0.10:80", 5));
}
