//! Tokenizing a conversation once, not once per turn. Turn n of a chat is
//! rendered by the chat template into the text of turn n-1 followed by
//! what is new, and tokenizing all of it again on every turn was most of
//! the picker's decision time. This cache keeps, per model, the token ids
//! of rendered prompts up to their last special token (where the next
//! turn's text goes on) and up to the one before (where the last message
//! began: another question after the same history), bounded in bytes and
//! evicting the least recently used; a new prompt that starts with a
//! cached one tokenizes only the rest.
//!
//! Why the ids are the same as a fresh tokenization's: a tokenizer splits
//! its input at every added token before anything else (normalizing,
//! pre-tokenizing, the model), and tokenizes the pieces between them on
//! their own. A cut made just before a special added token therefore
//! changes nothing, provided the token cannot reach across the cut: one
//! that strips the whitespace on its left, matches only as a single word,
//! or is matched after normalization is never cut at. Bodies that carry
//! token ids never come here; plain-text prompts have a cache of their own
//! cuts in the same store ([`crate::text`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};

use aho_corasick::{AhoCorasick, MatchKind};
use xxhash_rust::xxh3::Xxh3;

/// Where a rendered prompt may be cut: before any special token of the
/// model's tokenizer that cannot reach across a cut.
pub struct Cuts {
    finder: AhoCorasick,
}

impl std::fmt::Debug for Cuts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cuts")
            .field("tokens", &self.finder.patterns_len())
            .finish()
    }
}

impl Cuts {
    /// The cut points of `tokenizer`, if it has any special token to cut
    /// at.
    pub fn of(tokenizer: &tokenizers::Tokenizer) -> Option<Cuts> {
        let tokens: Vec<String> = tokenizer
            .get_added_tokens_decoder()
            .into_values()
            .filter(|t| t.special && !t.lstrip && !t.single_word && !t.normalized)
            .map(|t| t.content)
            .filter(|c| !c.is_empty())
            .collect();
        if tokens.is_empty() {
            return None;
        }
        // The tokenizer's own added-token matching is leftmost-longest.
        let finder = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(&tokens)
            .ok()?;
        Some(Cuts { finder })
    }

    /// The byte offsets in `text` where a special token begins, after the
    /// start, in order, into `out`.
    fn find(&self, text: &str, out: &mut Vec<usize>) {
        out.clear();
        out.extend(
            self.finder
                .find_iter(text)
                .map(|m| m.start())
                .filter(|&s| s > 0),
        );
    }
}

/// What the cache did, since start.
#[derive(Debug, Default)]
pub struct PrefixStats {
    /// Prompts that started with a cached one.
    pub hits: AtomicU64,
    /// Prompts that did not.
    pub misses: AtomicU64,
    /// Tokens taken from the cache instead of tokenized again.
    pub tokens_reused: AtomicU64,
    /// Tokens tokenized.
    pub tokens_encoded: AtomicU64,
}

struct Entry {
    text: Box<str>,
    ids: Box<[u32]>,
    /// The fingerprint the text's cut was planned with (0: none).
    print: u64,
    used: u64,
}

impl Entry {
    fn bytes(&self) -> usize {
        self.text.len() + self.ids.len() * 4 + 64
    }
}

/// Token ids of rendered prompts up to a cut, by the hash of that text.
pub struct PrefixCache {
    entries: HashMap<u64, Entry>,
    /// Entries by last use (a counter), oldest first.
    by_use: BTreeMap<u64, u64>,
    clock: u64,
    bytes: usize,
    capacity: usize,
}

impl std::fmt::Debug for PrefixCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixCache")
            .field("entries", &self.entries.len())
            .field("bytes", &self.bytes)
            .field("capacity", &self.capacity)
            .finish()
    }
}

/// A prompt's cut points and the hash of the text before each; for plain
/// text ([`crate::text`]) also a fingerprint of how the text before each
/// was split, which a cached entry must share to be used.
#[derive(Debug, Default)]
pub struct Plan {
    pub(crate) cuts: Vec<usize>,
    pub(crate) keys: Vec<u64>,
    /// Empty, or one per cut.
    pub(crate) prints: Vec<u64>,
}

impl Plan {
    fn print(&self, i: usize) -> u64 {
        self.prints.get(i).copied().unwrap_or(0)
    }
}

impl PrefixCache {
    /// A cache of at most `capacity` bytes (text, ids and bookkeeping).
    pub fn new(capacity: usize) -> Self {
        PrefixCache {
            entries: HashMap::new(),
            by_use: BTreeMap::new(),
            clock: 0,
            bytes: 0,
            capacity,
        }
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The cut points of `text` and the hash of the text before each (one
    /// pass over the text), for [`PrefixCache::longest`] and
    /// [`PrefixCache::insert`]; done outside the lock.
    pub fn plan(cuts: &Cuts, text: &str) -> Plan {
        let mut plan = Plan::default();
        cuts.find(text, &mut plan.cuts);
        let mut h = Xxh3::new();
        let mut at = 0;
        for &c in &plan.cuts {
            h.update(&text.as_bytes()[at..c]);
            at = c;
            plan.keys.push(h.digest());
        }
        plan
    }

    /// The longest cached prefix of `text` among its planned cuts: where
    /// it ends, and its ids (copied out).
    pub fn longest(&mut self, text: &str, plan: &Plan) -> Option<(usize, Vec<u32>)> {
        for (i, (&cut, &key)) in plan.cuts.iter().zip(&plan.keys).enumerate().rev() {
            let Some(e) = self.entries.get_mut(&key) else {
                continue;
            };
            // The hash is a hint; the text (and how it was split) decides.
            if e.print != plan.print(i) || *e.text != text[..cut] {
                continue;
            }
            self.clock += 1;
            self.by_use.remove(&e.used);
            e.used = self.clock;
            self.by_use.insert(e.used, key);
            return Some((cut, e.ids.to_vec()));
        }
        None
    }

    /// Keeps the ids of `text[..cut]` (`cut` one of the plan's cuts),
    /// evicting the least recently used entries to stay within capacity.
    /// An entry larger than the whole cache is not kept.
    pub fn insert(&mut self, text: &str, plan: &Plan, cut: usize, ids: &[u32]) {
        let Some(i) = plan.cuts.iter().position(|&c| c == cut) else {
            return;
        };
        let key = plan.keys[i];
        if self.entries.contains_key(&key) {
            return;
        }
        self.clock += 1;
        let entry = Entry {
            text: text[..cut].into(),
            ids: ids.into(),
            print: plan.print(i),
            used: self.clock,
        };
        let size = entry.bytes();
        if size > self.capacity {
            return;
        }
        while self.bytes + size > self.capacity {
            let Some((_, old)) = self.by_use.pop_first() else {
                break;
            };
            if let Some(e) = self.entries.remove(&old) {
                self.bytes -= e.bytes();
            }
        }
        self.bytes += size;
        self.by_use.insert(entry.used, key);
        self.entries.insert(key, entry);
    }
}

/// The longest cached prefix of `text` among `plan`'s cuts, counted as a
/// hit or a miss: where it ends (0: none cached) and its ids.
pub(crate) fn lookup(
    cache: &std::sync::Mutex<PrefixCache>,
    stats: &PrefixStats,
    text: &str,
    plan: &Plan,
) -> (usize, Vec<u32>) {
    let found = cache.lock().ok().and_then(|mut c| c.longest(text, plan));
    match &found {
        Some((_, ids)) => {
            stats.hits.fetch_add(1, Ordering::Relaxed);
            stats
                .tokens_reused
                .fetch_add(ids.len() as u64, Ordering::Relaxed);
        }
        None => {
            stats.misses.fetch_add(1, Ordering::Relaxed);
        }
    }
    found.unwrap_or((0, Vec::new()))
}

/// The ids of `part` on its own, without the post-processor's special
/// tokens.
pub(crate) fn encode_part(
    tokenizer: &tokenizers::Tokenizer,
    part: &str,
) -> Result<Vec<u32>, String> {
    if part.is_empty() {
        return Ok(Vec::new());
    }
    tokenizer
        .encode_fast(part, false)
        .map(|e| e.get_ids().to_vec())
        .map_err(|e| e.to_string())
}

/// Tokenizes `text` (a rendered chat, without the post-processor's
/// special tokens) with `cache`: the longest cached prefix, then the rest
/// in parts ending at the last two cuts (each kept) and after them; a part
/// of plain text piece by piece with `splitter`, when the tokenizer has
/// one ([`crate::text`]).
pub fn encode_with(
    tokenizer: &tokenizers::Tokenizer,
    cuts: &Cuts,
    splitter: Option<&crate::text::Splitter>,
    cache: &std::sync::Mutex<PrefixCache>,
    stats: &PrefixStats,
    text: &str,
) -> Result<Vec<u32>, String> {
    let plan = PrefixCache::plan(cuts, text);
    let (from, mut ids) = lookup(cache, stats, text, &plan);
    let encode = |part: &str| {
        splitter
            .and_then(|s| s.encode_part(tokenizer, part))
            .unwrap_or_else(|| encode_part(tokenizer, part))
    };
    // The text is encoded in parts ending at the last two cuts, each kept:
    // the last (where the next turn goes on) and the one before (the start
    // of the last message: another question after the same history).
    let n = plan.cuts.len();
    let keep: Vec<usize> = plan.cuts[n.saturating_sub(2)..]
        .iter()
        .copied()
        .filter(|&c| c > from)
        .collect();
    let mut encoded = 0;
    let mut at = from;
    for cut in keep {
        let part = encode(&text[at..cut])?;
        encoded += part.len();
        ids.extend_from_slice(&part);
        at = cut;
        if let Ok(mut c) = cache.lock() {
            c.insert(text, &plan, cut, &ids);
        }
    }
    let tail = encode(&text[at..])?;
    encoded += tail.len();
    ids.extend_from_slice(&tail);
    stats
        .tokens_encoded
        .fetch_add(encoded as u64, Ordering::Relaxed);
    Ok(ids)
}
