//! Tokenizing a plain-text prompt once, not once per request that extends
//! it. Frontends that send `/v1/completions` text (a conversation kept as
//! one growing string, an agent's scratchpad) send a prompt that starts
//! with the previous one; tokenizing it whole every time was most of the
//! picker's CPU. The chat cache's cuts are special tokens, which plain
//! text does not have; its cuts are the boundaries of the tokenizer's own
//! pre-tokenization instead, kept in the same per-model cache
//! ([`crate::prefix::PrefixCache`]).
//!
//! Why the ids are the same as a fresh tokenization's. The cache is used
//! only for tokenizers whose pipeline is: no normalizer; a pre-tokenizer
//! that cuts the text into pieces with one regular expression (BERT-style
//! `Whitespace`, GPT-2's `ByteLevel` with its own expression, or a `Split`
//! then `ByteLevel`, as Llama 3, Qwen and DeepSeek have) whose expression
//! looks neither behind nor at anchors; a BPE model without dropout; a
//! post-processor that only adds fixed tokens at the ends; no truncation or
//! padding. Such a tokenizer's ids are the concatenation of each piece's
//! BPE, and the pieces of a text are what the expression's matches (and
//! the gaps between them) cut it into. So, with the pieces of the whole
//! prompt in hand (one pass of the expression):
//! - a cached prefix ending at a piece boundary is reused only if the
//!   prompt's piece boundaries before it are exactly those the cached text
//!   had (both are fingerprinted);
//! - what follows a boundary is tokenized on its own, which splits it as
//!   the whole prompt does (matching resumes at a boundary in both, and the
//!   expression never looks back);
//! - a part that ends at a cut to be kept is split again on its own and
//!   kept only if its boundaries are the prompt's.
//!
//! A prompt holding an added token's text (a special token written as
//! text) is tokenized whole, as before.
//!
//! What follows the cached prefix is not given to the tokenizer's whole
//! pipeline either, since its pieces are already in hand: each piece's ids
//! are the model's for that piece (its bytes first mapped to GPT-2's
//! characters when the pipeline ends in `ByteLevel`), which is exactly
//! what the pipeline computes for it, and a bounded memory of recent
//! pieces ([`Pieces`]) asks the model once per distinct piece. Running the
//! pipeline (its normalized strings, offsets and token strings) cost
//! about a microsecond a token; a remembered piece costs a hash lookup.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::Ordering;

use aho_corasick::AhoCorasick;
use tokenizers::Model as _;
use xxhash_rust::xxh3::Xxh3;

use crate::ascii::Expr;
use crate::prefix::{Plan, PrefixCache, PrefixStats, lookup};

/// The cut candidates are the last piece boundary at or before each
/// multiple of this many bytes.
pub const CUT_EVERY_BYTES: usize = 128;

/// GPT-2's pre-tokenizing expression, as `ByteLevel` with `use_regex`
/// applies it (tokenizers 0.22).
pub(crate) const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// `Whitespace`'s expression (tokenizers 0.22).
pub(crate) const WHITESPACE_PATTERN: &str = r"\w+|[^\w\s]+";

/// The expression, in the engine the tokenizer itself runs it with.
enum Pattern {
    /// `Whitespace` uses the `regex` crate.
    Plain(regex::Regex),
    /// `Split` and `ByteLevel` use fancy-regex.
    Fancy(fancy_regex::Regex),
}

/// The longest piece whose ids are remembered; longer ones (a run of
/// punctuation, a long number) are rare and go to the model each time.
pub const MAX_PIECE_BYTES: usize = 64;

/// The ids of recently seen pieces, in two generations: a piece is looked
/// up in the current one, then in the previous one (and moved to the
/// current); when the current one holds `capacity` bytes it becomes the
/// previous one and the oldest is dropped. So at most twice `capacity` is
/// held, and a piece in use survives every turn-over.
pub struct Pieces {
    current: HashMap<Box<str>, Box<[u32]>, foldhash::fast::RandomState>,
    previous: HashMap<Box<str>, Box<[u32]>, foldhash::fast::RandomState>,
    bytes: usize,
    capacity: usize,
}

impl std::fmt::Debug for Pieces {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pieces")
            .field("current", &self.current.len())
            .field("previous", &self.previous.len())
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl Pieces {
    /// A memory of at most twice `capacity` bytes (texts, ids and
    /// bookkeeping).
    pub fn new(capacity: usize) -> Self {
        Pieces {
            current: HashMap::default(),
            previous: HashMap::default(),
            bytes: 0,
            capacity,
        }
    }

    fn entry_bytes(piece: &str, ids: &[u32]) -> usize {
        piece.len() + 4 * ids.len() + 48
    }

    /// Appends the ids of `piece` to `out`, if remembered.
    fn extend(&mut self, piece: &str, out: &mut Vec<u32>) -> bool {
        if let Some(ids) = self.current.get(piece) {
            out.extend_from_slice(ids);
            return true;
        }
        let Some((piece, ids)) = self.previous.remove_entry(piece) else {
            return false;
        };
        out.extend_from_slice(&ids);
        self.keep(piece, ids);
        true
    }

    fn keep(&mut self, piece: Box<str>, ids: Box<[u32]>) {
        let size = Self::entry_bytes(&piece, &ids);
        if self.bytes + size > self.capacity {
            self.previous = std::mem::take(&mut self.current);
            self.bytes = 0;
        }
        self.bytes += size;
        self.current.insert(piece, ids);
    }

    /// Bytes held, over both generations.
    pub fn bytes(&self) -> usize {
        self.bytes
            + self
                .previous
                .iter()
                .map(|(p, ids)| Self::entry_bytes(p, ids))
                .sum::<usize>()
    }
}

/// How a model's tokenizer cuts plain text into pieces, when it is of the
/// shape this cache is exact for.
pub struct Splitter {
    pattern: Pattern,
    /// The same expression matched by hand on ASCII text, when it is one
    /// of those [`crate::ascii`] knows.
    fast: Option<Expr>,
    /// Whether the text between two matches is a piece too (`Split` with
    /// `Isolated` and `ByteLevel` keep it; `Whitespace` drops it).
    gaps: bool,
    /// Whether a piece's bytes are mapped to GPT-2's characters before the
    /// model sees it (`ByteLevel`).
    byte_level: bool,
    /// Finds any added token's text in a prompt, leftmost-longest as the
    /// tokenizer itself matches them.
    added: Option<AhoCorasick>,
    /// Per pattern of `added`: the token's id, if it matches as plain as
    /// it is written (no stripping of whitespace around it, no word
    /// boundaries, not matched after normalization).
    added_ids: Vec<Option<u32>>,
    /// The ids the post-processor puts before and after the text's.
    head: Vec<u32>,
    tail: Vec<u32>,
    /// Recently seen pieces' ids.
    pieces: Mutex<Pieces>,
}

impl std::fmt::Debug for Splitter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Splitter")
            .field("head", &self.head)
            .field("tail", &self.tail)
            .finish_non_exhaustive()
    }
}

/// Whether `pattern` may look behind or at an anchor (then a piece's
/// split could depend on what came before it, and it is not cached).
fn looks_around(pattern: &str) -> bool {
    let b = pattern.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'\\' => {
                if matches!(b.get(i + 1), Some(b'b' | b'B' | b'A' | b'z' | b'Z' | b'G')) {
                    return true;
                }
                i += 2;
                continue;
            }
            // `^` opening a class negates it; anywhere else it anchors.
            b'^' if i == 0 || b[i - 1] != b'[' => return true,
            b'$' => return true,
            b'(' if b.get(i + 1) == Some(&b'?') && b.get(i + 2) == Some(&b'<') => return true,
            _ => {}
        }
        i += 1;
    }
    false
}

impl Splitter {
    /// The splitter of `t`, if its pipeline is one the cache is exact for
    /// (the module's documentation lists them), remembering the ids of at
    /// most twice `piece_bytes` of pieces.
    pub fn of(t: &tokenizers::Tokenizer, piece_bytes: usize) -> Option<Splitter> {
        use tokenizers::models::ModelWrapper;
        if t.get_normalizer().is_some() || t.get_truncation().is_some() || t.get_padding().is_some()
        {
            return None;
        }
        match t.get_model() {
            ModelWrapper::BPE(bpe) if bpe.dropout.is_none() => {}
            _ => return None,
        }
        let pre = serde_json::to_value(t.get_pre_tokenizer()?).ok()?;
        let byte_level_plain = |v: &serde_json::Value| {
            v["type"] == "ByteLevel" && v["add_prefix_space"] == false && v["use_regex"] == false
        };
        let (pattern, fast, gaps, byte_level) = match pre["type"].as_str()? {
            "Whitespace" => (
                Pattern::Plain(regex::Regex::new(WHITESPACE_PATTERN).ok()?),
                Some(Expr::Whitespace),
                false,
                false,
            ),
            "ByteLevel" if pre["add_prefix_space"] == false && pre["use_regex"] == true => (
                Pattern::Fancy(fancy_regex::Regex::new(GPT2_PATTERN).ok()?),
                Some(Expr::Gpt2),
                true,
                true,
            ),
            "Sequence" => {
                let [split, byte_level] = pre["pretokenizers"].as_array()?.as_slice() else {
                    return None;
                };
                let regex = split["pattern"]["Regex"].as_str()?;
                let isolated = split["type"] == "Split"
                    && split["behavior"] == "Isolated"
                    && split["invert"] == false;
                if !isolated || !byte_level_plain(byte_level) || looks_around(regex) {
                    return None;
                }
                (
                    Pattern::Fancy(fancy_regex::Regex::new(regex).ok()?),
                    Expr::of(regex),
                    true,
                    true,
                )
            }
            _ => return None,
        };
        let (added, added_ids): (Vec<String>, Vec<Option<u32>>) = t
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, a)| !a.content.is_empty())
            .map(|(id, a)| {
                let plain = !(a.lstrip || a.rstrip || a.single_word || a.normalized);
                (a.content, plain.then_some(id))
            })
            .unzip();
        let added = if added.is_empty() {
            None
        } else {
            Some(
                AhoCorasick::builder()
                    .match_kind(aho_corasick::MatchKind::LeftmostLongest)
                    .build(&added)
                    .ok()?,
            )
        };
        // What the post-processor adds, the same around every text.
        let ends = |text: &str| -> Option<(Vec<u32>, Vec<u32>)> {
            let with = t.encode_fast(text, true).ok()?.get_ids().to_vec();
            let bare = t.encode_fast(text, false).ok()?.get_ids().to_vec();
            let at = (0..=with.len().checked_sub(bare.len())?)
                .find(|&i| with[i..i + bare.len()] == bare[..])?;
            Some((with[..at].to_vec(), with[at + bare.len()..].to_vec()))
        };
        let (head, tail) = ends("kvedge splits text: 12 pieces.")?;
        if ends("x")? != (head.clone(), tail.clone()) {
            return None;
        }
        Some(Splitter {
            pattern,
            fast,
            gaps,
            byte_level,
            added,
            added_ids,
            head,
            tail,
            pieces: Mutex::new(Pieces::new(piece_bytes)),
        })
    }

    /// The pieces of `text`, in order, as byte ranges, into `out` (empty
    /// ones left out: they have no ids); `false` if the expression failed
    /// (a backtracking limit).
    fn pieces(&self, text: &str, out: &mut Vec<(usize, usize)>) -> bool {
        out.clear();
        let mut at = 0;
        let mut push = |s: usize, e: usize| {
            if self.gaps && at < s {
                out.push((at, s));
            }
            if s < e {
                out.push((s, e));
            }
            at = e;
        };
        let by_hand = self.fast.is_some_and(|e| e.pieces(text, &mut push));
        match &self.pattern {
            _ if by_hand => {}
            Pattern::Plain(r) => r.find_iter(text).for_each(|m| push(m.start(), m.end())),
            Pattern::Fancy(r) => {
                for m in r.find_iter(text) {
                    match m {
                        Ok(m) => push(m.start(), m.end()),
                        Err(_) => return false,
                    }
                }
            }
        }
        if self.gaps && at < text.len() {
            out.push((at, text.len()));
        }
        true
    }

    /// The ids of one piece, appended to `out`: remembered, or the model's
    /// (its bytes mapped first when the pipeline is byte-level).
    fn piece_ids(
        &self,
        model: &tokenizers::ModelWrapper,
        memory: &mut Pieces,
        piece: &str,
        out: &mut Vec<u32>,
    ) -> Result<(), String> {
        if memory.extend(piece, out) {
            return Ok(());
        }
        let input: Cow<str> = if self.byte_level {
            Cow::Owned(piece.bytes().map(byte_char).collect())
        } else {
            Cow::Borrowed(piece)
        };
        let tokens = model.tokenize(&input).map_err(|e| e.to_string())?;
        let at = out.len();
        out.extend(tokens.iter().map(|t| t.id));
        if piece.len() <= MAX_PIECE_BYTES {
            memory.keep(piece.into(), out[at..].into());
        }
        Ok(())
    }

    /// The ids of a part of a rendered chat (without the post-processor's
    /// tokens), when every added token in it matches as written (no
    /// stripping of whitespace around it, no word boundaries, not matched
    /// after normalization): each such token's id, and the plain text
    /// between them piece by piece, which is what the tokenizer does (it
    /// splits at added tokens, leftmost-longest, before anything else).
    /// `None`: the caller tokenizes it.
    pub fn encode_part(
        &self,
        tokenizer: &tokenizers::Tokenizer,
        part: &str,
    ) -> Option<Result<Vec<u32>, String>> {
        let mut ids = Vec::with_capacity(part.len() / 3);
        let mut pieces = Vec::with_capacity(part.len() / 4);
        let model = tokenizer.get_model();
        let mut memory = self.memory();
        let mut matches = self.added.as_ref().map(|a| a.find_iter(part));
        let mut at = 0;
        // The plain text up to the next added token (or the end), then
        // that token's id.
        loop {
            // The next added token: where it starts and ends, and its id.
            let next = match matches.as_mut().and_then(Iterator::next) {
                Some(m) => Some((m.start(), m.end(), self.added_ids[m.pattern().as_usize()]?)),
                None => None,
            };
            let text = &part[at..next.map_or(part.len(), |(start, _, _)| start)];
            if !self.pieces(text, &mut pieces) {
                return None;
            }
            for &(s, e) in &pieces {
                if let Err(e) = self.piece_ids(model, &mut memory, &text[s..e], &mut ids) {
                    return Some(Err(e));
                }
            }
            let Some((_, end, id)) = next else {
                return Some(Ok(ids));
            };
            ids.push(id);
            at = end;
        }
    }

    /// The piece memory, also after a panic while it was held (that
    /// cannot leave wrong ids in it: an entry is inserted whole).
    fn memory(&self) -> std::sync::MutexGuard<'_, Pieces> {
        self.pieces
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether ASCII text is split by hand ([`crate::ascii`]), tens of
    /// times faster than by the expression's engine.
    pub fn by_hand(&self) -> bool {
        self.fast.is_some()
    }

    /// Bytes the piece memory holds.
    pub fn piece_bytes(&self) -> usize {
        self.memory().bytes()
    }
}

/// The characters GPT-2's byte-level alphabet writes each byte as: the
/// printable bytes (`!`..=`~`, `¡`..=`¬`, `®`..=`ÿ`) as themselves, the
/// other 68 as U+0100 onwards, in byte order.
const BYTE_CHARS: [char; 256] = {
    let mut table = ['\0'; 256];
    let mut b = 0;
    let mut others = 0;
    while b < 256 {
        let printable = matches!(b as u8, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        table[b] = if printable {
            b as u8 as char
        } else {
            others += 1;
            match char::from_u32(0x100 + others - 1) {
                Some(c) => c,
                None => panic!("U+0100..U+0143 are characters"),
            }
        };
        b += 1;
    }
    table
};

/// The character GPT-2's byte-level alphabet writes byte `b` as.
pub fn byte_char(b: u8) -> char {
    BYTE_CHARS[usize::from(b)]
}

/// The boundaries between `pieces` (of a text `len` bytes long) strictly
/// inside the text, in order: where a piece starts or ends.
fn boundaries(len: usize, pieces: &[(usize, usize)], out: &mut Vec<usize>) {
    out.clear();
    for &(s, e) in pieces {
        for p in [s, e] {
            if p > 0 && p < len && out.last() != Some(&p) {
                out.push(p);
            }
        }
    }
}

/// The cut candidates of a text with `bounds` (its piece boundaries): the
/// last boundary at or before each multiple of [`CUT_EVERY_BYTES`]; with
/// the hash of the text before each and the fingerprint of the boundaries
/// before it.
fn plan(text: &str, bounds: &[usize]) -> Plan {
    let mut plan = Plan::default();
    let mut text_hash = Xxh3::new();
    let mut bound_hash = Xxh3::new();
    let (mut hashed_text, mut hashed_bounds) = (0, 0);
    let mut next = CUT_EVERY_BYTES;
    while next < text.len() {
        // The last boundary at or before `next`.
        let i = bounds.partition_point(|&b| b <= next);
        if let Some(&cut) = i.checked_sub(1).map(|i| &bounds[i])
            && plan.cuts.last().is_none_or(|&c| c < cut)
        {
            text_hash.update(&text.as_bytes()[hashed_text..cut]);
            hashed_text = cut;
            for b in &bounds[hashed_bounds..i] {
                bound_hash.update(&(*b as u64).to_le_bytes());
            }
            hashed_bounds = i;
            plan.cuts.push(cut);
            plan.keys.push(text_hash.digest());
            plan.prints.push(bound_hash.digest() | 1);
        }
        next += CUT_EVERY_BYTES;
    }
    plan
}

/// A thread's buffers for a text's pieces and boundaries. A long prompt's
/// are hundreds of kilobytes; allocated afresh for every prompt they were
/// fresh pages, and the page faults cost more than splitting the text.
/// Buffers grown past [`SCRATCH_KEEP_BYTES`] are not kept.
#[derive(Default)]
struct Scratch {
    pieces: Vec<(usize, usize)>,
    bounds: Vec<usize>,
}

/// The most a thread keeps in each of its [`Scratch`] buffers.
const SCRATCH_KEEP_BYTES: usize = 1 << 20;

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
}

impl Scratch {
    /// This thread's buffers (empty ones if they are out already).
    fn take() -> Scratch {
        SCRATCH.with_borrow_mut(std::mem::take)
    }
}

impl Drop for Scratch {
    /// Hands the buffers back to the thread, unless they grew too large.
    fn drop(&mut self) {
        let keep = |bytes: usize| bytes <= SCRATCH_KEEP_BYTES;
        let pieces = std::mem::take(&mut self.pieces);
        let bounds = std::mem::take(&mut self.bounds);
        let _ = SCRATCH.try_with(|s| {
            if let Ok(mut s) = s.try_borrow_mut() {
                if keep(pieces.capacity() * size_of::<(usize, usize)>()) {
                    s.pieces = pieces;
                }
                if keep(bounds.capacity() * size_of::<usize>()) {
                    s.bounds = bounds;
                }
            }
        });
    }
}

/// Tokenizes plain-text `text` (special tokens added as the tokenizer adds
/// them) with `cache`; `None` when this text is not for the cache (it
/// holds an added token's text, or the expression failed): the caller
/// tokenizes it whole.
pub fn encode_with(
    tokenizer: &tokenizers::Tokenizer,
    splitter: &Splitter,
    cache: &Mutex<PrefixCache>,
    stats: &PrefixStats,
    text: &str,
) -> Option<Result<Vec<u32>, String>> {
    if splitter.added.as_ref().is_some_and(|a| a.is_match(text)) {
        return None;
    }
    let mut scratch = Scratch::take();
    let Scratch { pieces, bounds } = &mut scratch;
    // About a piece every four bytes of prose.
    pieces.reserve(text.len() / 4);
    if !splitter.pieces(text, pieces) {
        return None;
    }
    bounds.reserve(2 * pieces.len());
    boundaries(text.len(), pieces, bounds);
    let plan = plan(text, bounds);
    let (from, mut ids) = lookup(cache, stats, text, &plan);
    // The ids up to the last two cuts are kept (the next prompt goes on
    // from about the end of this one), and up to the 1st, 2nd, 4th, 8th,
    // ... cut (another text that starts the same way, such as a new
    // conversation after the same instructions, finds at least half of
    // what it shares).
    let n = plan.cuts.len();
    let mut kept = plan
        .cuts
        .iter()
        .enumerate()
        .filter(|&(i, &c)| c > from && ((i + 1).is_power_of_two() || i + 2 >= n))
        .map(|(_, &c)| c)
        .peekable();
    let reused = ids.len();
    ids.reserve(text.len().saturating_sub(from) / 3);
    let first = pieces.partition_point(|&(s, _)| s < from);
    let model = tokenizer.get_model();
    let mut memory = splitter.memory();
    for &(s, e) in &pieces[first..] {
        // A cut is a boundary: every piece before it is in `ids`.
        while let Some(cut) = kept.next_if(|&c| c <= s) {
            if let Ok(mut c) = cache.lock() {
                c.insert(text, &plan, cut, &ids);
            }
        }
        if let Err(e) = splitter.piece_ids(model, &mut memory, &text[s..e], &mut ids) {
            return Some(Err(e));
        }
    }
    drop(memory);
    for cut in kept {
        if let Ok(mut c) = cache.lock() {
            c.insert(text, &plan, cut, &ids);
        }
    }
    stats
        .tokens_encoded
        .fetch_add((ids.len() - reused) as u64, Ordering::Relaxed);
    let mut out = Vec::with_capacity(splitter.head.len() + ids.len() + splitter.tail.len());
    out.extend_from_slice(&splitter.head);
    out.extend_from_slice(&ids);
    out.extend_from_slice(&splitter.tail);
    Some(Ok(out))
}

#[cfg(test)]
mod tests {
    use tokenizers::models::TrainerWrapper;
    use tokenizers::models::bpe::{BPE, BpeTrainer};
    use tokenizers::pre_tokenizers::PreTokenizerWrapper;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::pre_tokenizers::sequence::Sequence;
    use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
    use tokenizers::processors::template::TemplateProcessing;
    use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

    use super::*;
    use crate::ascii::LLAMA3_PATTERN;
    use crate::body::Prompt;
    use crate::tokenize::{ModelSpec, Models, Tokens};

    #[test]
    fn a_threads_scratch_buffers_come_back_and_oversized_ones_are_let_go() {
        let pair = size_of::<(usize, usize)>();
        {
            let mut s = Scratch::take();
            s.pieces.reserve(1000);
            s.bounds.reserve(2000);
        }
        let s = Scratch::take();
        assert!(s.pieces.capacity() >= 1000 && s.bounds.capacity() >= 2000);
        // While they are out, another taker gets empty ones.
        let other = Scratch::take();
        assert_eq!((other.pieces.capacity(), other.bounds.capacity()), (0, 0));
        drop(other);
        drop(s);
        {
            let mut s = Scratch::take();
            s.pieces.reserve(SCRATCH_KEEP_BYTES / pair + 1);
        }
        let s = Scratch::take();
        assert!(s.pieces.capacity() < SCRATCH_KEEP_BYTES / pair);
        assert!(s.bounds.capacity() >= 2000, "the other buffer is kept");
    }

    fn docs() -> Vec<String> {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs");
        std::fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| Some(e.ok()?.path().to_string_lossy().into_owned()))
            .filter(|p| p.ends_with(".md"))
            .collect()
    }

    /// A BPE tokenizer trained on the repository's docs with `pre`, and a
    /// `<s>` added in front of every text when `bos`.
    fn trained(pre: PreTokenizerWrapper, byte_level: bool, bos: bool) -> Tokenizer {
        let mut builder = BpeTrainer::builder().vocab_size(1500).min_frequency(2);
        if byte_level {
            builder = builder.initial_alphabet(ByteLevel::alphabet().into_iter().collect());
        }
        let mut trainer: TrainerWrapper = builder.build().into();
        let mut t = Tokenizer::new(BPE::default());
        t.with_pre_tokenizer(Some(pre));
        t.train_from_files(&mut trainer, docs()).unwrap();
        if bos {
            t.add_special_tokens(&[AddedToken::from("<s>", true)]);
            let id = t.token_to_id("<s>").unwrap();
            let post = TemplateProcessing::builder()
                .try_single("<s> $A")
                .unwrap()
                .special_tokens(vec![("<s>", id)])
                .build()
                .unwrap();
            t.with_post_processor(Some(post));
        }
        t
    }

    fn shapes() -> Vec<(&'static str, Tokenizer)> {
        let whitespace = trained(
            tokenizers::pre_tokenizers::whitespace::Whitespace {}.into(),
            false,
            false,
        );
        let gpt2 = trained(ByteLevel::new(false, true, true).into(), true, false);
        let split = Split::new(
            SplitPattern::Regex(LLAMA3_PATTERN.into()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .unwrap();
        let llama3 = trained(
            Sequence::new(vec![
                split.into(),
                ByteLevel::new(false, true, false).into(),
            ])
            .into(),
            true,
            true,
        );
        vec![
            ("whitespace", whitespace),
            ("gpt2", gpt2),
            ("llama3", llama3),
        ]
    }

    fn models(t: &Tokenizer, cache_bytes: usize) -> (Models, std::path::PathBuf) {
        let path = std::env::temp_dir().join(format!(
            "kvedge-text-{}-{:x}.json",
            std::process::id(),
            t as *const Tokenizer as usize
        ));
        t.save(&path, false).unwrap();
        let spec = ModelSpec {
            engine: Default::default(),
            name: "m".into(),
            tokenizer: Some(path.clone()),
            chat_template: None,
            bos_token: String::new(),
            eos_token: String::new(),
        };
        (Models::load_with(&[spec], cache_bytes).unwrap(), path)
    }

    /// `text`'s ids from the tokenizer itself, whole.
    fn fresh(t: &Tokenizer, text: &str) -> Vec<u32> {
        t.encode_fast(text, true).unwrap().get_ids().to_vec()
    }

    fn ids(m: &Models, text: &str) -> Vec<u32> {
        match m.tokens("m", Prompt::Text(text.into()), 1 << 20).unwrap() {
            Tokens::Ids(ids) => ids,
            Tokens::Text(_) => panic!("the model has a tokenizer"),
        }
    }

    /// Pieces of text that stress the expressions: runs of spaces and
    /// newlines, digits, contractions, punctuation, accents, CJK, emoji.
    const PIECES: [&str; 16] = [
        " the routing core",
        "  ",
        "\n",
        "\n\n",
        "12345",
        " 7",
        "'s",
        "'LL",
        "...",
        "!?",
        " café",
        "中文",
        " 🙂",
        "\t",
        "User: ",
        "word",
    ];

    /// A xorshift stream, so that the texts are the same every run.
    fn next(state: &mut u64) -> usize {
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        *state as usize
    }

    #[test]
    fn every_supported_shape_gets_the_ids_of_a_fresh_tokenization_across_turns() {
        for (name, t) in shapes() {
            assert!(
                Splitter::of(&t, 1 << 20).is_some(),
                "{name} is a shape the cache serves"
            );
            let (m, path) = models(&t, 32 << 20);
            let mut state = 0x9e37_79b9_7f4a_7c15u64;
            for conversation in 0..6 {
                let mut text = format!("Conversation {conversation}.");
                for turn in 0..25 {
                    // A turn adds a few hundred bytes.
                    for _ in 0..(20 + next(&mut state) % 40) {
                        text.push_str(PIECES[next(&mut state) % PIECES.len()]);
                    }
                    assert_eq!(
                        ids(&m, &text),
                        fresh(&t, &text),
                        "{name}, conversation {conversation}, turn {turn}"
                    );
                }
                // An earlier part edited: not the cached prefix, still right.
                let edited = text.replacen("Conversation", "Chat", 1);
                assert_eq!(ids(&m, &edited), fresh(&t, &edited), "{name}, edited");
            }
            let c = m.prefix_counts();
            assert!(c.hits >= 100, "{name}: {c:?}");
            assert!(c.tokens_reused > 2 * c.tokens_encoded, "{name}: {c:?}");
            let _ = std::fs::remove_file(path);
        }
    }

    #[test]
    fn bytes_are_written_as_the_tokenizers_byte_level_alphabet_writes_them() {
        use tokenizers::PreTokenizer;
        use tokenizers::tokenizer::{OffsetReferential, OffsetType, PreTokenizedString};
        let ours: std::collections::HashSet<char> = (0..=255).map(byte_char).collect();
        let theirs: std::collections::HashSet<char> = ByteLevel::alphabet().into_iter().collect();
        assert_eq!(ours, theirs);
        // Every byte valid UTF-8 holds: ASCII, and leads and continuations
        // of two-, three- and four-byte characters.
        let mut text: String = (0u8..128).map(char::from).collect();
        text.extend([
            '\u{80}', '\u{bf}', '\u{7ff}', 'é', 'ÿ', '\u{800}', '中', '\u{ffff}',
        ]);
        text.extend(['\u{10000}', '🙂', '\u{10ffff}']);
        text.extend((0x80..0x800u32).step_by(7).filter_map(char::from_u32));
        let mut pre = PreTokenizedString::from(text.as_str());
        ByteLevel::new(false, false, false)
            .pre_tokenize(&mut pre)
            .unwrap();
        let mapped: String = pre
            .get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(s, _, _)| s)
            .collect();
        let ours: String = text.bytes().map(byte_char).collect();
        assert_eq!(ours, mapped);
    }

    #[test]
    fn pieces_remembered_or_not_give_a_fresh_tokenizations_ids_for_any_text() {
        // Characters the expressions treat differently: control characters,
        // every kind of space and line break, marks, digits of other
        // scripts, letters of several scripts, symbols, surrogate-pair
        // characters; in runs, so that long and repeated pieces occur.
        const CHARS: [&str; 32] = [
            " ", "  ", "\t", "\r", "\n", "\r\n", "\u{85}", "\u{a0}", "\u{2028}", "\u{3000}", "a",
            "Z", "ß", "é", "e\u{301}", "ж", "中", "ｱ", "٣", "7", "42", "'", "'s", "'LL", "-",
            "...", "$", "€", "🙂", "👍🏽", "\u{0}", "\u{7f}",
        ];
        for (name, t) in shapes() {
            // A memory of a few pieces, so that it turns over constantly.
            let splitter = Splitter::of(&t, 256).unwrap();
            let cache = Mutex::new(PrefixCache::new(0));
            let stats = PrefixStats::default();
            let mut state = 0x2545_f491_4f6c_dd1du64;
            for round in 0..300 {
                let mut text = String::new();
                let len = 1 + next(&mut state) % 60;
                for _ in 0..len {
                    let c = CHARS[next(&mut state) % CHARS.len()];
                    for _ in 0..(1 + next(&mut state) % 3) {
                        text.push_str(c);
                    }
                }
                let ours = encode_with(&t, &splitter, &cache, &stats, &text)
                    .expect("no added token, no backtracking limit")
                    .unwrap();
                assert_eq!(ours, fresh(&t, &text), "{name}, round {round}: {text:?}");
            }
            let turned_over = !splitter.pieces.lock().unwrap().previous.is_empty();
            assert!(turned_over, "{name}");
            assert!(splitter.piece_bytes() <= 2 * 256 + MAX_PIECE_BYTES * 5 + 48);
        }
    }

    #[test]
    fn a_text_holding_an_added_tokens_text_is_tokenized_whole() {
        let (_, t) = shapes().pop().unwrap();
        let (m, path) = models(&t, 32 << 20);
        let mut text = "word ".repeat(300);
        text.push_str("<s> more");
        assert_eq!(ids(&m, &text), fresh(&t, &text));
        text.push_str(" and more");
        assert_eq!(ids(&m, &text), fresh(&t, &text));
        assert_eq!(m.prefix_counts().hits + m.prefix_counts().misses, 0);
        let _ = std::fs::remove_file(path);
    }

    #[test]
    fn the_cache_stays_within_its_bound_and_is_still_right_after_eviction() {
        let (_, t) = shapes().swap_remove(0);
        let bound = 16 << 10;
        let (m, path) = models(&t, bound);
        let mut state = 7u64;
        let texts: Vec<String> = (0..40)
            .map(|i| {
                let mut s = format!("text {i} ");
                for _ in 0..200 {
                    s.push_str(PIECES[next(&mut state) % PIECES.len()]);
                }
                s
            })
            .collect();
        for round in 0..2 {
            for text in &texts {
                assert_eq!(ids(&m, text), fresh(&t, text), "round {round}");
                assert!(m.prefix_counts().bytes <= bound as u64);
            }
        }
        let _ = std::fs::remove_file(path);
    }

    #[test]
    fn shapes_it_cannot_prove_exact_are_left_alone() {
        assert!(looks_around(r"(?<=a)b"));
        assert!(looks_around(r"\bword"));
        assert!(looks_around(r"^start"));
        assert!(looks_around(r"end$"));
        assert!(!looks_around(LLAMA3_PATTERN));
        assert!(!looks_around(GPT2_PATTERN));
        // A lookbehind in the split expression, a prefix space, a
        // normalizer: no splitter.
        let split = Split::new(
            SplitPattern::Regex(r"(?<=\s)\w+|\s+".into()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .unwrap();
        let mut t = Tokenizer::new(BPE::default());
        t.with_pre_tokenizer(Some(PreTokenizerWrapper::from(Sequence::new(vec![
            split.into(),
            ByteLevel::new(false, true, false).into(),
        ]))));
        assert!(Splitter::of(&t, 1 << 20).is_none());
        t.with_pre_tokenizer(Some(PreTokenizerWrapper::from(ByteLevel::new(
            true, true, true,
        ))));
        assert!(Splitter::of(&t, 1 << 20).is_none());
        t.with_pre_tokenizer(Some(PreTokenizerWrapper::from(ByteLevel::new(
            false, true, true,
        ))));
        t.with_normalizer(Some(tokenizers::normalizers::unicode::NFC));
        assert!(Splitter::of(&t, 1 << 20).is_none());
    }
}
