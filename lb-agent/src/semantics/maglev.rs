//! Maglev lookup tables (Eisenbud et al., NSDI 2016), as Cilium builds them.
//!
//! Each backend gets a permutation of the table positions from two hashes of
//! its address; backends take turns claiming their next preferred free
//! position. Removing one of N backends moves only about 1/N of the positions,
//! which is what keeps most flows where they are.
//!
//! The hashes must be the same on every node and across agent versions (the
//! tc path relies on every node choosing alike), hence xxh64 with fixed
//! seeds rather than std's unspecified hasher.
use xxhash_rust::xxh64::xxh64;

/// Table sizes the agent accepts: primes below 65536 (the length is stored
/// in a u16), as Cilium offers.
pub const TABLE_SIZES: [u16; 9] = [251, 509, 1021, 2039, 4093, 8191, 16381, 32749, 65521];
pub const DEFAULT_TABLE_SIZE: u16 = 16381;

const SEED_OFFSET: u64 = 0x6c62_2d6d_6167_6c76; // "lb-maglv"
const SEED_SKIP: u64 = 0x6c62_2d73_6b69_7021; // "lb-skip!"

/// The backends' indexes sorted by identity, and each one's permutation of
/// the `m` positions in that order: (offset, skip). Sorting makes the
/// result independent of input order, so every node builds the same table
/// from the same endpoints.
fn permutations(backends: &[String], m: u64) -> (Vec<usize>, Vec<(u64, u64)>) {
    let mut order: Vec<usize> = (0..backends.len()).collect();
    order.sort_by(|&a, &b| backends[a].cmp(&backends[b]));
    let perms = order
        .iter()
        .map(|&i| {
            let name = backends[i].as_bytes();
            let offset = xxh64(name, SEED_OFFSET) % m;
            let skip = xxh64(name, SEED_SKIP) % (m - 1) + 1;
            (offset, skip)
        })
        .collect();
    (order, perms)
}

/// Builds the table: for each of `size` positions, the index into `backends`
/// of the backend that owns it. `backends` are stable identities (the
/// agent uses "addr:port"); their order does not matter. Empty input gives an
/// empty table.
pub fn build(backends: &[String], size: u16) -> Vec<u32> {
    let m = size as u64;
    if backends.is_empty() || m == 0 {
        return Vec::new();
    }
    let (order, perms) = permutations(backends, m);
    // Each backend's next preferred position, `offset + j * skip` mod m for
    // its j-th turn, kept by addition: the walk past taken positions is
    // M ln M steps in all, and a division per step cost most of a sync of
    // many Maglev Services.
    let (m, size) = (m as u32, size as usize);
    let mut next: Vec<u32> = perms.iter().map(|&(offset, _)| offset as u32).collect();
    let step = |pos: u32, skip: u32| {
        let p = pos + skip;
        if p >= m {
            p - m
        } else {
            p
        }
    };
    let mut table = vec![u32::MAX; size];
    let mut filled = 0usize;
    'fill: loop {
        for (k, &(_, skip)) in perms.iter().enumerate() {
            let skip = skip as u32;
            let mut pos = next[k];
            while table[pos as usize] != u32::MAX {
                pos = step(pos, skip);
            }
            table[pos as usize] = order[k] as u32;
            next[k] = step(pos, skip);
            filled += 1;
            if filled == size {
                break 'fill;
            }
        }
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: usize) -> Vec<String> {
        (0..n)
            .map(|i| format!("10.244.{}.{}:8080", i / 200, i % 200 + 1))
            .collect()
    }

    /// How many positions of `before` (the table over `all`) point to
    /// another backend in the table built without backend `removed`.
    fn moved_without(all: &[String], before: &[u32], removed: usize) -> usize {
        let rest: Vec<String> = all
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != removed)
            .map(|(_, s)| s.clone())
            .collect();
        let after = build(&rest, DEFAULT_TABLE_SIZE);
        before
            .iter()
            .zip(&after)
            .filter(|(b, a)| all[**b as usize] != rest[**a as usize])
            .count()
    }

    fn shares(table: &[u32], n: usize) -> Vec<f64> {
        let mut counts = vec![0usize; n];
        for &b in table {
            counts[b as usize] += 1;
        }
        counts
            .iter()
            .map(|&c| c as f64 / table.len() as f64)
            .collect()
    }

    /// The table's walk as the paper writes it, a modulo per probe: `build`
    /// must give exactly this (every node and agent version builds alike).
    fn textbook(backends: &[String], size: u16) -> Vec<u32> {
        let m = size as u64;
        let (order, perms) = permutations(backends, m);
        let mut next = vec![0u64; order.len()];
        let mut table = vec![u32::MAX; size as usize];
        let mut filled = 0;
        'fill: loop {
            for (k, &(offset, skip)) in perms.iter().enumerate() {
                let mut pos = (offset + next[k] * skip) % m;
                while table[pos as usize] != u32::MAX {
                    next[k] += 1;
                    pos = (offset + next[k] * skip) % m;
                }
                table[pos as usize] = order[k] as u32;
                next[k] += 1;
                filled += 1;
                if filled == size as usize {
                    break 'fill;
                }
            }
        }
        table
    }

    #[test]
    fn same_table_as_the_textbook_walk() {
        for (n, size) in [
            (1, 251),
            (3, 251),
            (3, DEFAULT_TABLE_SIZE),
            (10, 1021),
            (100, 65521),
        ] {
            let all = names(n);
            assert_eq!(build(&all, size), textbook(&all, size), "n={n} M={size}");
        }
    }

    #[test]
    fn every_position_is_owned_and_sizes_are_prime() {
        for size in TABLE_SIZES {
            let size = size as u32;
            assert!((2..size)
                .take_while(|d| d * d <= size)
                .all(|d| !size.is_multiple_of(d)));
        }
        let t = build(&names(5), 251);
        assert_eq!(t.len(), 251);
        assert!(t.iter().all(|&b| b < 5));
        assert!(build(&[], 251).is_empty());
    }

    #[test]
    fn order_of_input_does_not_matter() {
        let a = names(7);
        let mut b = a.clone();
        b.reverse();
        let ta: Vec<&String> = build(&a, 1021).iter().map(|&i| &a[i as usize]).collect();
        let tb: Vec<&String> = build(&b, 1021).iter().map(|&i| &b[i as usize]).collect();
        assert_eq!(ta, tb);
    }

    /// Property: every backend's share stays close to 1/N.
    #[test]
    fn shares_stay_near_one_over_n() {
        for n in [2, 3, 5, 10, 33, 100] {
            let t = build(&names(n), DEFAULT_TABLE_SIZE);
            let fair = 1.0 / n as f64;
            for (i, s) in shares(&t, n).iter().enumerate() {
                assert!(
                    (s - fair).abs() <= fair * 0.25,
                    "n={n}: backend {i} has {s:.4}, fair {fair:.4}"
                );
            }
        }
    }

    /// The numbers quoted for issue 4: N=10 at the default table size,
    /// printed (`cargo test -p lb-agent maglev -- --nocapture`).
    #[test]
    fn measurement_n10_default_size() {
        let n = 10;
        let all = names(n);
        let before = build(&all, DEFAULT_TABLE_SIZE);
        let moved = moved_without(&all, &before, 0);
        let owned = before.iter().filter(|&&b| b == 0).count();
        let fraction = moved as f64 / DEFAULT_TABLE_SIZE as f64;
        let s = shares(&before, n);
        let (min, max) = s
            .iter()
            .fold((f64::MAX, 0f64), |(lo, hi), &x| (lo.min(x), hi.max(x)));
        println!(
            "maglev N={n} M={DEFAULT_TABLE_SIZE}: removing one backend remaps {moved} positions \
             ({:.2}%; it owned {owned}, {:.2}%; ideal 10%); shares {:.2}%..{:.2}% (fair 10%)",
            fraction * 100.0,
            owned as f64 * 100.0 / DEFAULT_TABLE_SIZE as f64,
            min * 100.0,
            max * 100.0
        );
        assert!((0.09..=0.12).contains(&fraction), "{fraction}");
        assert!(min > 0.09 && max < 0.11, "{min} {max}");
    }

    /// Property: removing one of N backends remaps about 1/N of the positions
    /// (those it owned, plus a small amount of churn).
    #[test]
    fn removing_one_backend_remaps_about_one_nth() {
        for n in [3, 5, 10, 50] {
            let all = names(n);
            let before = build(&all, DEFAULT_TABLE_SIZE);
            for removed in [0, n / 2, n - 1] {
                let fraction =
                    moved_without(&all, &before, removed) as f64 / DEFAULT_TABLE_SIZE as f64;
                let ideal = 1.0 / n as f64;
                assert!(
                    fraction >= ideal * 0.9 && fraction <= ideal * 1.6,
                    "n={n} removed={removed}: remapped {fraction:.4}, ideal {ideal:.4}"
                );
            }
        }
    }
}
