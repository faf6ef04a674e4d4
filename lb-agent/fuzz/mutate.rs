//! What every fuzz target shares (`cargo xtask fuzz`, see the README's
//! tests section): its case count, its seeds (`fuzz/corpus/<target>/`,
//! real inputs checked in) and the mutations applied to them. Included
//! with `#[path]` by the unit tests and by `tests/tc_frames.rs`, so that
//! proptest stays a dev-dependency.
//!
//! A case is a seed and a few mutations: byte flips and overwrites,
//! tokens of the input's grammar inserted, cuts, truncation, splices from
//! another seed and repeats (amplification). Targets with structure add
//! their own field-aware mutations and inputs generated from scratch.
#![allow(dead_code)] // each including crate uses part of it

use std::path::Path;

use proptest::{prelude::*, sample::Index, test_runner::Config};

/// The number of cases of a fuzz target: `short`, its share of the bounded
/// run inside `cargo xtask test`, times `LB_FUZZ_SCALE`; or
/// `LB_FUZZ_CASES` for every target (both set by `cargo xtask fuzz`).
/// Failures are kept in `proptest-regressions/` beside the target's
/// source and replayed first on every run.
pub fn config(short: u32) -> Config {
    let env = |name| std::env::var(name).ok().and_then(|v| v.parse::<u32>().ok());
    let cases = env("LB_FUZZ_CASES")
        .unwrap_or_else(|| short.saturating_mul(env("LB_FUZZ_SCALE").unwrap_or(1)));
    Config {
        cases,
        // Inputs are many and cheap; a failure shrinks to a short one.
        max_shrink_iters: 4096,
        ..Config::default()
    }
}

/// One seed of a corpus: its file name and bytes.
#[derive(Clone, Debug)]
pub struct Seed {
    pub name: String,
    pub bytes: Vec<u8>,
}

/// The seeds of `target`, by file name: `fuzz/corpus/<target>/*`.
pub fn corpus(target: &str) -> Vec<Seed> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let mut seeds: Vec<Seed> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| {
            let path = entry.unwrap().path();
            Seed {
                name: path.file_name().unwrap().to_string_lossy().into_owned(),
                bytes: std::fs::read(&path).unwrap(),
            }
        })
        .collect();
    seeds.sort_by(|a, b| a.name.cmp(&b.name));
    assert!(!seeds.is_empty(), "{}: no seeds", dir.display());
    seeds
}

/// One change to an input. Positions are [`Index`]es, taken modulo the
/// input's length when applied, so that they shrink well.
#[derive(Clone, Debug)]
pub enum Mutation {
    /// XOR one byte with a bit.
    Flip(Index, u8),
    /// Overwrite one byte with a value that is often special (0, 0xff, ...).
    Set(Index, u8),
    /// Overwrite one of the target's interesting offsets (a header field).
    Field(Index, u8),
    /// Insert one of the target's tokens.
    Token(Index, Index),
    /// Remove up to this many bytes.
    Cut(Index, usize),
    /// Keep only a prefix.
    Truncate(Index),
    /// Insert a piece of another seed (at, seed, from, length).
    Splice(Index, Index, Index, usize),
    /// Repeat a piece this many times in place (at, length, times).
    Repeat(Index, usize, usize),
}

/// What a target tells the mutations about its inputs.
#[derive(Clone, Copy)]
pub struct Grammar {
    /// Fragments of the input language, inserted whole.
    pub tokens: &'static [&'static [u8]],
    /// Offsets worth overwriting (header fields); may be empty.
    pub offsets: &'static [usize],
}

/// Bytes that are often special to a parser.
const SPECIAL: [u8; 10] = [0, 1, 0x7f, 0x80, 0xff, b'\n', b'"', b':', b'{', b'['];

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<Index>(), 0u8..8).prop_map(|(at, bit)| Mutation::Flip(at, 1 << bit)),
        (
            any::<Index>(),
            prop_oneof![prop::sample::select(&SPECIAL[..]), any::<u8>()]
        )
            .prop_map(|(at, v)| Mutation::Set(at, v)),
        (any::<Index>(), any::<u8>()).prop_map(|(at, v)| Mutation::Field(at, v)),
        (any::<Index>(), any::<Index>()).prop_map(|(at, t)| Mutation::Token(at, t)),
        (any::<Index>(), 1usize..64).prop_map(|(at, n)| Mutation::Cut(at, n)),
        any::<Index>().prop_map(Mutation::Truncate),
        (any::<Index>(), any::<Index>(), any::<Index>(), 1usize..256)
            .prop_map(|(at, s, from, n)| Mutation::Splice(at, s, from, n)),
        (any::<Index>(), 1usize..64, 2usize..64).prop_map(|(at, n, k)| Mutation::Repeat(at, n, k)),
    ]
}

/// Applies `mutations` to `input` in order.
pub fn apply(input: &mut Vec<u8>, mutations: &[Mutation], grammar: Grammar, seeds: &[Seed]) {
    // A position in 0..=len (an insertion point).
    let at = |i: &Index, len: usize| i.index(len + 1);
    for m in mutations {
        let len = input.len();
        match m {
            Mutation::Flip(i, bit) if len > 0 => input[i.index(len)] ^= bit,
            Mutation::Set(i, v) if len > 0 => input[i.index(len)] = *v,
            Mutation::Field(i, v) if !grammar.offsets.is_empty() => {
                let off = grammar.offsets[i.index(grammar.offsets.len())];
                if off < len {
                    input[off] = *v;
                }
            }
            Mutation::Token(i, t) if !grammar.tokens.is_empty() => {
                let token = grammar.tokens[t.index(grammar.tokens.len())];
                let p = at(i, len);
                input.splice(p..p, token.iter().copied());
            }
            Mutation::Cut(i, n) if len > 0 => {
                let p = i.index(len);
                input.drain(p..(p + n).min(len));
            }
            Mutation::Truncate(i) => input.truncate(at(i, len)),
            Mutation::Splice(i, s, from, n) => {
                let other = &seeds[s.index(seeds.len())].bytes;
                if !other.is_empty() {
                    let from = from.index(other.len());
                    let piece = &other[from..(from + n).min(other.len())];
                    let p = at(i, len);
                    input.splice(p..p, piece.iter().copied());
                }
            }
            Mutation::Repeat(i, n, k) if len > 0 => {
                let p = i.index(len);
                let piece = input[p..(p + n).min(len)].to_vec();
                let copies = piece.repeat(k - 1);
                input.splice(p..p, copies);
            }
            _ => {}
        }
    }
}

/// A case: a seed of `seeds` (its name, for the failure message) with up
/// to `max` mutations applied.
pub fn mutated(
    seeds: Vec<Seed>,
    grammar: Grammar,
    max: usize,
) -> impl Strategy<Value = (String, Vec<u8>)> {
    (any::<Index>(), prop::collection::vec(mutation(), 0..=max)).prop_map(move |(s, ms)| {
        let seed = &seeds[s.index(seeds.len())];
        let mut bytes = seed.bytes.clone();
        apply(&mut bytes, &ms, grammar, &seeds);
        (seed.name.clone(), bytes)
    })
}

/// An input made from scratch: up to `max` tokens and random bytes.
pub fn generated(grammar: Grammar, max: usize) -> impl Strategy<Value = Vec<u8>> {
    let piece = prop_oneof![
        3 => prop::sample::select(grammar.tokens).prop_map(<[u8]>::to_vec),
        1 => prop::collection::vec(any::<u8>(), 1..8),
    ];
    prop::collection::vec(piece, 0..=max).prop_map(|pieces| pieces.concat())
}
