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

use std::sync::Mutex;
use std::sync::atomic::Ordering;

use aho_corasick::AhoCorasick;
use xxhash_rust::xxh3::Xxh3;

use crate::prefix::{Plan, PrefixCache, PrefixStats, encode_part, lookup};

/// The cut candidates are the last piece boundary at or before each
/// multiple of this many bytes.
pub const CUT_EVERY_BYTES: usize = 128;

/// GPT-2's pre-tokenizing expression, as `ByteLevel` with `use_regex`
/// applies it (tokenizers 0.22).
const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// `Whitespace`'s expression (tokenizers 0.22).
const WHITESPACE_PATTERN: &str = r"\w+|[^\w\s]+";

/// The expression, in the engine the tokenizer itself runs it with.
enum Pattern {
    /// `Whitespace` uses the `regex` crate.
    Plain(regex::Regex),
    /// `Split` and `ByteLevel` use fancy-regex.
    Fancy(fancy_regex::Regex),
}

/// How a model's tokenizer cuts plain text into pieces, when it is of the
/// shape this cache is exact for.
pub struct Splitter {
    pattern: Pattern,
    /// Finds any added token's text in a prompt.
    added: Option<AhoCorasick>,
    /// The ids the post-processor puts before and after the text's.
    head: Vec<u32>,
    tail: Vec<u32>,
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
    /// (the module's documentation lists them).
    pub fn of(t: &tokenizers::Tokenizer) -> Option<Splitter> {
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
        let pattern = match pre["type"].as_str()? {
            "Whitespace" => Pattern::Plain(regex::Regex::new(WHITESPACE_PATTERN).ok()?),
            "ByteLevel" if pre["add_prefix_space"] == false && pre["use_regex"] == true => {
                Pattern::Fancy(fancy_regex::Regex::new(GPT2_PATTERN).ok()?)
            }
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
                Pattern::Fancy(fancy_regex::Regex::new(regex).ok()?)
            }
            _ => return None,
        };
        let added: Vec<String> = t
            .get_added_tokens_decoder()
            .into_values()
            .map(|a| a.content)
            .filter(|c| !c.is_empty())
            .collect();
        let added = if added.is_empty() {
            None
        } else {
            Some(AhoCorasick::new(&added).ok()?)
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
            added,
            head,
            tail,
        })
    }

    /// The piece boundaries of `text` strictly inside it, in order, into
    /// `out`; `false` if the expression failed (a backtracking limit).
    fn boundaries(&self, text: &str, out: &mut Vec<usize>) -> bool {
        out.clear();
        let mut push = |s: usize, e: usize| {
            for p in [s, e] {
                if p > 0 && p < text.len() && out.last() != Some(&p) {
                    out.push(p);
                }
            }
        };
        match &self.pattern {
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
        true
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
    let mut bounds = Vec::new();
    if !splitter.boundaries(text, &mut bounds) {
        return None;
    }
    let plan = plan(text, &bounds);
    let (from, mut ids) = lookup(cache, stats, text, &plan);
    let encode = |part: &str| encode_part(tokenizer, part);
    // Parts ending at the last two cuts are kept (the next prompt goes on
    // from about the end of this one), and at the 1st, 2nd, 4th, 8th, ...
    // cut (another text that starts the same way, such as a new
    // conversation after the same instructions, finds at least half of
    // what it shares); each if it splits on its own as it does in the
    // whole text.
    let n = plan.cuts.len();
    let mut encoded = 0;
    let mut at = from;
    let mut own = Vec::new();
    let kept = plan
        .cuts
        .iter()
        .enumerate()
        .filter(|&(i, &c)| c > from && ((i + 1).is_power_of_two() || i + 2 >= n))
        .map(|(_, &c)| c);
    for cut in kept {
        if !splitter.boundaries(&text[at..cut], &mut own) {
            return None;
        }
        let lo = bounds.partition_point(|&b| b <= at);
        let hi = bounds.partition_point(|&b| b < cut);
        let same =
            own.len() == hi - lo && own.iter().zip(&bounds[lo..hi]).all(|(o, b)| o + at == *b);
        if !same {
            continue;
        }
        let part = match encode(&text[at..cut]) {
            Ok(p) => p,
            Err(e) => return Some(Err(e)),
        };
        encoded += part.len();
        ids.extend_from_slice(&part);
        at = cut;
        if let Ok(mut c) = cache.lock() {
            c.insert(text, &plan, cut, &ids);
        }
    }
    let rest = match encode(&text[at..]) {
        Ok(p) => p,
        Err(e) => return Some(Err(e)),
    };
    encoded += rest.len();
    ids.extend_from_slice(&rest);
    stats
        .tokens_encoded
        .fetch_add(encoded as u64, Ordering::Relaxed);
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
    use crate::body::Prompt;
    use crate::tokenize::{ModelSpec, Models, Tokens};

    /// Llama 3's pre-tokenizing expression.
    const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

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
            SplitPattern::Regex(LLAMA3.into()),
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
        match m.tokens("m", &Prompt::Text(text.into()), 1 << 20).unwrap() {
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
                Splitter::of(&t).is_some(),
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
        assert!(!looks_around(LLAMA3));
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
        assert!(Splitter::of(&t).is_none());
        t.with_pre_tokenizer(Some(PreTokenizerWrapper::from(ByteLevel::new(
            true, true, true,
        ))));
        assert!(Splitter::of(&t).is_none());
        t.with_pre_tokenizer(Some(PreTokenizerWrapper::from(ByteLevel::new(
            false, true, true,
        ))));
        t.with_normalizer(Some(tokenizers::normalizers::unicode::NFC));
        assert!(Splitter::of(&t).is_none());
    }
}
