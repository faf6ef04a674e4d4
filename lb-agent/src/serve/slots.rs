//! Connection slots of the agent's HTTP servers (the health address, the
//! metrics address, the health-check node ports): who gets one. The
//! health address and the node ports are open to the network, so that a
//! client that opens connections and leaves them idle (or sends its
//! request a byte at a time) must not be able to take the slots that load
//! balancers' and the kubelet's probes need.
//!
//! Two rules, both decided when a connection is accepted:
//! - one source holds at most `per_source` connections at once; its next
//!   ones are closed at once, whatever the others hold;
//! - all sources together hold at most `total`; at the total a newcomer
//!   gets a slot by closing the oldest connection of the source that holds
//!   the most, unless that would leave the newcomer holding as many as it
//!   (then the newcomer is refused). So a flood from one address, or from
//!   many, can never shut out an address that holds fewer than they do.
//!
//! Bounds: `total` open connections per [`Gate`] (plus, for an instant,
//! the ones just evicted while their task closes them), and the table's
//! memory is O(`total`): one entry per open connection and per source
//! holding one.
use std::{
    collections::{BTreeSet, HashMap},
    fmt,
    net::{IpAddr, Ipv6Addr, SocketAddr},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use tokio::sync::oneshot;

/// What a connection is counted against: its IPv4 address, or the /64 of
/// its IPv6 one (a host is usually given a whole /64 and may pick any
/// address in it, so counting single IPv6 addresses would count nothing).
/// IPv4-mapped IPv6 addresses (a dual-stack listener's) count as IPv4.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Source(IpAddr);

impl Source {
    pub fn of(ip: IpAddr) -> Self {
        match ip.to_canonical() {
            IpAddr::V4(a) => Source(IpAddr::V4(a)),
            IpAddr::V6(a) => {
                let s = a.segments();
                Source(IpAddr::V6(Ipv6Addr::new(
                    s[0], s[1], s[2], s[3], 0, 0, 0, 0,
                )))
            }
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            IpAddr::V4(a) => write!(f, "{a}"),
            IpAddr::V6(a) => write!(f, "{a}/64"),
        }
    }
}

/// What [`Table::admit`] decided for a new connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// A slot, numbered `id`; `evicted` is the connection that was closed
    /// to make room (no longer counted).
    Admitted {
        id: u64,
        evicted: Option<(Source, u64)>,
    },
    /// The source holds `per_source` already.
    SourceFull,
    /// The total is reached, and no source holds more than one beyond what
    /// this one would.
    Full,
}

/// The accounting of [`Gate`], without sockets or clocks.
#[derive(Debug)]
pub struct Table {
    per_source: usize,
    total: usize,
    next_id: u64,
    /// The connections of each source holding some, oldest (lowest) first.
    held: HashMap<Source, BTreeSet<u64>>,
    /// (count, source) of every source holding some: the largest last.
    by_count: BTreeSet<(usize, Source)>,
    open: usize,
}

impl Table {
    /// `per_source` and `total` of at least 1 (less is taken as 1).
    pub fn new(per_source: usize, total: usize) -> Self {
        Table {
            per_source: per_source.max(1),
            total: total.max(1),
            next_id: 0,
            held: HashMap::new(),
            by_count: BTreeSet::new(),
            open: 0,
        }
    }

    /// Connections counted now.
    pub fn open(&self) -> usize {
        self.open
    }

    /// Connections `source` holds now.
    pub fn held_by(&self, source: Source) -> usize {
        self.held.get(&source).map_or(0, BTreeSet::len)
    }

    /// The source holding the most, and how many (ties: the highest
    /// source).
    pub fn largest(&self) -> Option<(Source, usize)> {
        self.by_count.last().map(|&(n, s)| (s, n))
    }

    /// A new connection from `source`.
    pub fn admit(&mut self, source: Source) -> Decision {
        let held = self.held_by(source);
        if held >= self.per_source {
            return Decision::SourceFull;
        }
        let mut evicted = None;
        if self.open >= self.total {
            match self.largest() {
                // Closing one of theirs must leave them holding at least as
                // many as the newcomer then holds, or slots would only
                // change hands back and forth.
                Some((victim, n)) if n > held + 1 => {
                    let id = *self.held[&victim]
                        .first()
                        .expect("a counted source holds some");
                    self.remove(victim, id);
                    evicted = Some((victim, id));
                }
                _ => return Decision::Full,
            }
        }
        let id = self.next_id;
        self.next_id += 1;
        self.set(source, |ids| {
            ids.insert(id);
        });
        self.open += 1;
        Decision::Admitted { id, evicted }
    }

    /// Connection `id` of `source` ended; `false` if it was not counted
    /// (evicted already).
    pub fn release(&mut self, source: Source, id: u64) -> bool {
        self.remove(source, id)
    }

    fn remove(&mut self, source: Source, id: u64) -> bool {
        let mut found = false;
        self.set(source, |ids| found = ids.remove(&id));
        if found {
            self.open -= 1;
        }
        found
    }

    /// Changes `source`'s set, keeping `by_count` in step and dropping
    /// empty entries.
    fn set(&mut self, source: Source, f: impl FnOnce(&mut BTreeSet<u64>)) {
        let ids = self.held.entry(source).or_default();
        let before = ids.len();
        f(ids);
        let after = ids.len();
        if after == 0 {
            self.held.remove(&source);
        }
        if before != after {
            if before > 0 {
                self.by_count.remove(&(before, source));
            }
            if after > 0 {
                self.by_count.insert((after, source));
            }
        }
    }
}

/// How often refusals are logged at most (an attacker's would flood it).
const LOG_EVERY: Duration = Duration::from_secs(10);

struct GateState {
    table: Table,
    /// Dropping a connection's sender tells its task to close it.
    evict: HashMap<u64, oneshot::Sender<()>>,
    /// Refused or evicted since the last log line.
    refused: u64,
    evicted: u64,
    last_log: Option<Instant>,
}

/// The slots of one server (or of a group of listeners sharing them).
#[derive(Clone)]
pub struct Gate {
    what: &'static str,
    state: Arc<Mutex<GateState>>,
}

/// A connection's slot: released when dropped. [`closed`](Self::closed)
/// resolves when the slot is taken for a newcomer.
pub struct Ticket {
    state: Arc<Mutex<GateState>>,
    source: Source,
    id: u64,
    evicted: oneshot::Receiver<()>,
}

impl Ticket {
    /// Resolves once this connection must close (evicted for a source that
    /// holds fewer).
    pub async fn evicted(&mut self) {
        let _ = (&mut self.evicted).await;
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.table.release(self.source, self.id);
        st.evict.remove(&self.id);
    }
}

impl Gate {
    /// Slots for `what` (the server's name, for the log).
    pub fn new(what: &'static str, per_source: usize, total: usize) -> Self {
        Gate {
            what,
            state: Arc::new(Mutex::new(GateState {
                table: Table::new(per_source, total),
                evict: HashMap::new(),
                refused: 0,
                evicted: 0,
                last_log: None,
            })),
        }
    }

    /// A slot for a connection from `peer`, or `None`: close it at once.
    pub fn admit(&self, peer: IpAddr) -> Option<Ticket> {
        let source = Source::of(peer);
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let decision = st.table.admit(source);
        let ticket = match decision {
            Decision::Admitted { id, evicted } => {
                if let Some((_, victim)) = evicted {
                    st.evict.remove(&victim);
                    st.evicted += 1;
                }
                let (tx, rx) = oneshot::channel();
                st.evict.insert(id, tx);
                Some(Ticket {
                    state: self.state.clone(),
                    source,
                    id,
                    evicted: rx,
                })
            }
            Decision::SourceFull | Decision::Full => {
                st.refused += 1;
                None
            }
        };
        if (st.refused > 0 || st.evicted > 0)
            && st.last_log.is_none_or(|t| t.elapsed() >= LOG_EVERY)
        {
            let largest = st.table.largest();
            tracing::warn!(
                refused = st.refused,
                evicted = st.evicted,
                open = st.table.open(),
                largest_source = %largest.map_or(String::new(), |(s, _)| s.to_string()),
                largest_holds = largest.map_or(0, |(_, n)| n),
                "{} server: connections refused or closed to keep room for every source (per-source or total limit)",
                self.what
            );
            st.refused = 0;
            st.evicted = 0;
            st.last_log = Some(Instant::now());
        }
        ticket
    }
}

/// The accept queue's length asked for (the kernel caps it at
/// `net.core.somaxconn`, 4096 by default): a flood's connections are
/// accepted and closed quickly, but while they wait, a probe's SYN that
/// finds the queue full is dropped and retried only after a second.
const BACKLOG: u32 = 4096;

/// A listener on `addr`, with [`BACKLOG`].
pub fn listen(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    // As std's and tokio's `bind`: a restarted agent rebinds its port
    // while the old connections are in TIME_WAIT.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(BACKLOG)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4(last: u8) -> Source {
        Source::of(IpAddr::from([10, 0, 0, last]))
    }

    #[test]
    fn sources_are_ipv4_addresses_and_ipv6_64s() {
        let cases: [(&str, &str); 5] = [
            ("10.0.0.1", "10.0.0.1"),
            ("::ffff:10.0.0.1", "10.0.0.1"),
            ("2001:db8:1:2:3:4:5:6", "2001:db8:1:2::/64"),
            ("2001:db8:1:2:ffff::1", "2001:db8:1:2::/64"),
            ("2001:db8:1:3::1", "2001:db8:1:3::/64"),
        ];
        for (ip, want) in cases {
            let ip: IpAddr = ip.parse().unwrap();
            assert_eq!(Source::of(ip).to_string(), want, "{ip}");
        }
    }

    /// One step of a table test: a connection from `source` (`Some`), or
    /// the release of the `n`th admitted connection (`None`, `n`).
    #[derive(Clone, Copy)]
    enum Step {
        Open(u8),
        Close(usize),
    }
    use Step::{Close, Open};

    /// What a step should give: admitted (and the source whose oldest
    /// connection was evicted), refused as `SourceFull`, `Full`; for a
    /// close, whether it was still counted.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Want {
        Yes,
        Evicting(u8),
        SourceFull,
        Full,
        Released(bool),
    }

    #[test]
    fn per_source_and_total_accounting() {
        // (name, per_source, total, steps and what each gives, then the
        // counts per source at the end)
        type Case = (
            &'static str,
            usize,
            usize,
            Vec<(Step, Want)>,
            Vec<(u8, usize)>,
        );
        let cases: Vec<Case> = vec![
            (
                "a source at its limit is refused, others are not",
                2,
                10,
                vec![
                    (Open(1), Want::Yes),
                    (Open(1), Want::Yes),
                    (Open(1), Want::SourceFull),
                    (Open(2), Want::Yes),
                ],
                vec![(1, 2), (2, 1)],
            ),
            (
                "a closed connection gives its source a slot again",
                1,
                10,
                vec![
                    (Open(1), Want::Yes),
                    (Open(1), Want::SourceFull),
                    (Close(0), Want::Released(true)),
                    (Open(1), Want::Yes),
                ],
                vec![(1, 1)],
            ),
            (
                "at the total, a newcomer takes the oldest slot of the largest",
                4,
                4,
                vec![
                    (Open(1), Want::Yes),
                    (Open(1), Want::Yes),
                    (Open(1), Want::Yes),
                    (Open(2), Want::Yes),
                    (Open(3), Want::Evicting(1)),
                    // 1 holds 2, 3 would hold 2: no more churn.
                    (Open(3), Want::Full),
                    (Open(2), Want::Full),
                    // The evicted one's own end is not counted again.
                    (Close(0), Want::Released(false)),
                    (Close(1), Want::Released(true)),
                    (Open(3), Want::Yes),
                ],
                vec![(1, 1), (2, 1), (3, 2)],
            ),
            (
                "the largest holder is refused at the total",
                8,
                3,
                vec![
                    (Open(1), Want::Yes),
                    (Open(1), Want::Yes),
                    (Open(2), Want::Yes),
                    (Open(1), Want::Full),
                    (Open(3), Want::Evicting(1)),
                    (Open(4), Want::Full),
                ],
                vec![(1, 1), (2, 1), (3, 1)],
            ),
            (
                "a flood from many sources leaves room for one more",
                2,
                6,
                vec![
                    (Open(1), Want::Yes),
                    (Open(1), Want::Yes),
                    (Open(2), Want::Yes),
                    (Open(2), Want::Yes),
                    (Open(3), Want::Yes),
                    (Open(3), Want::Yes),
                    (Open(4), Want::Evicting(3)),
                    (Open(5), Want::Evicting(2)),
                    (Open(6), Want::Evicting(1)),
                    (Open(7), Want::Full),
                ],
                vec![(1, 1), (2, 1), (3, 1), (4, 1), (5, 1), (6, 1)],
            ),
            (
                "limits of 0 are taken as 1",
                0,
                0,
                vec![
                    (Open(1), Want::Yes),
                    (Open(1), Want::SourceFull),
                    (Open(2), Want::Full),
                ],
                vec![(1, 1)],
            ),
        ];
        for (name, per_source, total, steps, end) in cases {
            let mut t = Table::new(per_source, total);
            let mut admitted: Vec<(Source, u64)> = Vec::new();
            let mut gone = std::collections::HashSet::new();
            for (i, (step, want)) in steps.into_iter().enumerate() {
                let got = match step {
                    Open(s) => match t.admit(v4(s)) {
                        Decision::Admitted { id, evicted } => {
                            admitted.push((v4(s), id));
                            match evicted {
                                None => Want::Yes,
                                Some((victim, vid)) => {
                                    let oldest = admitted
                                        .iter()
                                        .filter(|(src, id)| *src == victim && !gone.contains(id))
                                        .map(|&(_, id)| id)
                                        .min();
                                    assert_eq!(
                                        oldest,
                                        Some(vid),
                                        "{name}: step {i}: not the oldest evicted"
                                    );
                                    gone.insert(vid);
                                    let IpAddr::V4(a) = victim.0 else {
                                        unreachable!()
                                    };
                                    Want::Evicting(a.octets()[3])
                                }
                            }
                        }
                        Decision::SourceFull => Want::SourceFull,
                        Decision::Full => Want::Full,
                    },
                    Close(n) => {
                        let (s, id) = admitted[n];
                        gone.insert(id);
                        Want::Released(t.release(s, id))
                    }
                };
                assert_eq!(got, want, "{name}: step {i}");
                assert!(t.open() <= total.max(1), "{name}: step {i}: over the total");
            }
            let sum: usize = end.iter().map(|&(_, n)| n).sum();
            assert_eq!(t.open(), sum, "{name}: open at the end");
            for (s, n) in end {
                assert_eq!(t.held_by(v4(s)), n, "{name}: source {s} at the end");
            }
        }
    }

    /// Random opens and closes: the counts always agree with each other
    /// and stay within the limits.
    #[test]
    fn counts_stay_consistent() {
        let mut t = Table::new(3, 7);
        let mut live: Vec<(Source, u64)> = Vec::new();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if x.is_multiple_of(3) && !live.is_empty() {
                let (s, id) = live.swap_remove((x as usize / 3) % live.len());
                t.release(s, id);
            } else {
                let s = v4((x % 5) as u8);
                if let Decision::Admitted { id, evicted } = t.admit(s) {
                    if let Some(e) = evicted {
                        live.retain(|l| *l != e);
                    }
                    live.push((s, id));
                }
            }
            assert_eq!(t.open(), live.len());
            assert!(t.open() <= 7);
            let by_source: usize = t.held.values().map(BTreeSet::len).sum();
            assert_eq!(by_source, t.open());
            assert_eq!(t.by_count.len(), t.held.len());
            assert!(t.held.values().all(|ids| (1..=3).contains(&ids.len())));
        }
    }
}
