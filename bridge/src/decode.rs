//! The engines' KV event payload: one msgspec-msgpack `KVEventBatch` per
//! ZeroMQ message, decoded without allocating after warm-up. Both layouts
//! the engines have shipped are read:
//!
//! - the batch as an array `[ts, events, dp_rank]` or as a map with those
//!   keys (`data_parallel_rank` in vLLM, `attn_dp_rank` in SGLang);
//! - each event as a positional array `["BlockStored", field, ...]` or as a
//!   map `{"type": "BlockStored", "block_hashes": ..., ...}`.
//!
//! Fields this decoder does not know, trailing positions and map keys, are
//! skipped, so a newer engine that adds fields keeps working. An event whose
//! known field has an unexpected type is reported as [`Event::Invalid`] and
//! the rest of the batch still decodes; only a payload that is not msgpack
//! at all (truncated, nested too deep) fails as a whole.

use crate::msgpack::{DecodeError, Head, Reader};

/// The batch's own fields.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Batch {
    /// The engine's timestamp (seconds since the epoch).
    pub ts: f64,
    /// Events in the batch.
    pub events: usize,
    /// The data-parallel (vLLM) or attention-DP (SGLang) rank, when sent.
    pub dp_rank: Option<i64>,
}

/// Per-block extra hash keys, summarised: what kvedge can fold into its own
/// hashes (a LoRA name, a cache salt on the first block) and whether there
/// is anything else (multimodal identifiers), which it cannot.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Extra<'a> {
    /// Strings among the first block's keys, in order (up to three).
    pub first: [Option<&'a str>; 3],
    /// The first block has more keys, or keys that are not strings.
    pub first_more: bool,
    /// The one string the later blocks carry (their LoRA name), if any.
    pub later: Option<&'a str>,
    /// Later blocks carry another string, or keys that are not strings.
    pub later_more: bool,
}

/// Blocks became resident.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stored<'a> {
    /// The engine's hashes of the blocks, in chain order.
    pub hashes: &'a [u64],
    /// The engine's hash of the block before the first, if any.
    pub parent: Option<u64>,
    /// The blocks' token ids (`hashes.len() * block_size` of them).
    pub tokens: &'a [u32],
    pub block_size: Option<i64>,
    /// Deprecated numeric LoRA id (kvedge hashes LoRA by name).
    pub lora_id: Option<i64>,
    /// "GPU", "CPU" (SGLang: "CPU_PINNED"), "DISK"/"STORAGE", or absent
    /// (GPU).
    pub medium: Option<&'a str>,
    pub lora_name: Option<&'a str>,
    pub extra: Extra<'a>,
    /// SGLang's salt of the request that stored the blocks, by name (vLLM
    /// puts its salt among the first block's extra keys instead).
    pub cache_salt: Option<&'a str>,
    /// The KV cache group (hybrid models publish one per group).
    pub group_idx: Option<i64>,
}

/// Blocks were evicted.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Removed<'a> {
    pub hashes: &'a [u64],
    pub medium: Option<&'a str>,
    pub group_idx: Option<i64>,
}

/// One event of a batch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Event<'a> {
    Stored(Stored<'a>),
    Removed(Removed<'a>),
    /// `AllBlocksCleared`: every block of the engine is gone.
    Cleared,
    /// An event type this decoder does not know (its tag).
    Unknown(&'a str),
    /// A known event whose fields do not have the expected types.
    Invalid {
        tag: &'a str,
        field: &'static str,
        problem: DecodeError,
    },
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Field {
    BlockHashes,
    Parent,
    TokenIds,
    BlockSize,
    LoraId,
    Medium,
    LoraName,
    ExtraKeys,
    GroupIdx,
    CacheSalt,
    Other,
}

impl Field {
    fn by_name(name: &[u8]) -> Field {
        match name {
            b"block_hashes" => Field::BlockHashes,
            b"parent_block_hash" => Field::Parent,
            b"token_ids" => Field::TokenIds,
            b"block_size" => Field::BlockSize,
            b"lora_id" => Field::LoraId,
            b"medium" => Field::Medium,
            b"lora_name" => Field::LoraName,
            b"extra_keys" => Field::ExtraKeys,
            b"group_idx" => Field::GroupIdx,
            b"cache_salt" => Field::CacheSalt,
            _ => Field::Other,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Field::BlockHashes => "block_hashes",
            Field::Parent => "parent_block_hash",
            Field::TokenIds => "token_ids",
            Field::BlockSize => "block_size",
            Field::LoraId => "lora_id",
            Field::Medium => "medium",
            Field::LoraName => "lora_name",
            Field::ExtraKeys => "extra_keys",
            Field::GroupIdx => "group_idx",
            Field::CacheSalt => "cache_salt",
            Field::Other => "other",
        }
    }
}

/// Positional fields of `BlockStored` (later positions are skipped).
const STORED: [Field; 9] = [
    Field::BlockHashes,
    Field::Parent,
    Field::TokenIds,
    Field::BlockSize,
    Field::LoraId,
    Field::Medium,
    Field::LoraName,
    Field::ExtraKeys,
    Field::GroupIdx,
];
/// Positional fields of `BlockRemoved`.
const REMOVED: [Field; 3] = [Field::BlockHashes, Field::Medium, Field::GroupIdx];

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Tag {
    Stored,
    Removed,
    Cleared,
    Unknown,
}

impl Tag {
    fn of(name: &[u8]) -> Tag {
        match name {
            b"BlockStored" => Tag::Stored,
            b"BlockRemoved" => Tag::Removed,
            b"AllBlocksCleared" => Tag::Cleared,
            _ => Tag::Unknown,
        }
    }

    fn positions(self) -> &'static [Field] {
        match self {
            Tag::Stored => &STORED,
            Tag::Removed => &REMOVED,
            Tag::Cleared | Tag::Unknown => &[],
        }
    }
}

/// The fields of one event as read so far (borrowing the payload; hashes
/// and tokens go to the decoder's scratch).
#[derive(Default)]
struct Fields<'a> {
    parent: Option<u64>,
    block_size: Option<i64>,
    lora_id: Option<i64>,
    medium: Option<&'a str>,
    lora_name: Option<&'a str>,
    extra: Extra<'a>,
    group_idx: Option<i64>,
    cache_salt: Option<&'a str>,
    bad: Option<(&'static str, DecodeError)>,
}

fn mismatch(expected: &'static str, head: &Head<'_>) -> DecodeError {
    DecodeError::Type {
        expected,
        found: head.name(),
    }
}

/// Decodes batches; reuse one per feed so its scratch stays warm.
#[derive(Debug, Default)]
pub struct Decoder {
    hashes: Vec<u64>,
    tokens: Vec<u32>,
}

impl Decoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Decodes `payload`, calling `visit` for each event in order. Events
    /// before a structural error have been visited when it is returned.
    pub fn decode(
        &mut self,
        payload: &[u8],
        mut visit: impl FnMut(&Event<'_>),
    ) -> Result<Batch, DecodeError> {
        let mut r = Reader::new(payload);
        let mut batch = Batch::default();
        match r.head()? {
            Head::Array(n) => {
                if n < 2 {
                    return Err(DecodeError::Type {
                        expected: "a batch [ts, events, ...]",
                        found: "a shorter array",
                    });
                }
                batch.ts = self.ts(&mut r)?;
                batch.events = self.events(&mut r, &mut visit)?;
                if n >= 3 {
                    batch.dp_rank = Self::dp_rank(&mut r)?;
                }
                for _ in 3..n {
                    r.skip()?;
                }
            }
            Head::Map(n) => {
                for _ in 0..n {
                    match r.head()? {
                        Head::Str(b"ts") => batch.ts = self.ts(&mut r)?,
                        Head::Str(b"events") => batch.events = self.events(&mut r, &mut visit)?,
                        Head::Str(b"data_parallel_rank" | b"attn_dp_rank") => {
                            batch.dp_rank = Self::dp_rank(&mut r)?;
                        }
                        _ => r.skip()?,
                    }
                }
            }
            other => return Err(mismatch("a batch (array or map)", &other)),
        }
        match r.remaining() {
            0 => Ok(batch),
            n => Err(DecodeError::Trailing(n)),
        }
    }

    /// The batch's rank: informational, so a value of another type is
    /// read past, not an error.
    fn dp_rank(r: &mut Reader<'_>) -> Result<Option<i64>, DecodeError> {
        let head = r.head()?;
        r.skip_rest(head)?;
        Ok(head.as_int())
    }

    fn ts(&mut self, r: &mut Reader<'_>) -> Result<f64, DecodeError> {
        match r.head()? {
            Head::Float(f) => Ok(f),
            Head::Uint(v) => Ok(v as f64),
            Head::Int(v) => Ok(v as f64),
            other => Err(mismatch("a timestamp", &other)),
        }
    }

    fn events<'p>(
        &mut self,
        r: &mut Reader<'p>,
        visit: &mut impl FnMut(&Event<'_>),
    ) -> Result<usize, DecodeError> {
        let n = r.array("a list of events")?;
        for _ in 0..n {
            self.event(r, visit)?;
        }
        Ok(n)
    }

    fn event<'p>(
        &mut self,
        r: &mut Reader<'p>,
        visit: &mut impl FnMut(&Event<'_>),
    ) -> Result<(), DecodeError> {
        self.hashes.clear();
        self.tokens.clear();
        let mut f = Fields::default();
        let tag_name: &'p [u8];
        match r.head()? {
            Head::Array(0) => return Err(DecodeError::Range("an empty event")),
            Head::Array(n) => {
                tag_name = match r.head()? {
                    Head::Str(s) => s,
                    other => return Err(mismatch("an event tag", &other)),
                };
                let positions = Tag::of(tag_name).positions();
                for i in 1..n {
                    match positions.get(i - 1) {
                        Some(&field) => self.field(r, field, &mut f)?,
                        None => r.skip()?,
                    }
                }
            }
            Head::Map(n) => {
                let mut tag = None;
                for _ in 0..n {
                    let key = match r.head()? {
                        Head::Str(s) => s,
                        other => {
                            r.skip_rest(other)?;
                            r.skip()?;
                            continue;
                        }
                    };
                    if key == b"type" {
                        match r.head()? {
                            Head::Str(s) => tag = Some(s),
                            other => return Err(mismatch("an event tag", &other)),
                        }
                    } else {
                        self.field(r, Field::by_name(key), &mut f)?;
                    }
                }
                tag_name = tag.ok_or(DecodeError::Type {
                    expected: "an event with a `type`",
                    found: "a map without one",
                })?;
            }
            other => return Err(mismatch("an event (array or map)", &other)),
        }
        let tag = std::str::from_utf8(tag_name).map_err(|_| DecodeError::Utf8)?;
        let event = match (Tag::of(tag_name), f.bad) {
            (Tag::Unknown, _) => Event::Unknown(tag),
            (_, Some((field, problem))) => Event::Invalid {
                tag,
                field,
                problem,
            },
            (Tag::Stored, None) => Event::Stored(Stored {
                hashes: &self.hashes,
                parent: f.parent,
                tokens: &self.tokens,
                block_size: f.block_size,
                lora_id: f.lora_id,
                medium: f.medium,
                lora_name: f.lora_name,
                extra: f.extra,
                group_idx: f.group_idx,
                cache_salt: f.cache_salt,
            }),
            (Tag::Removed, None) => Event::Removed(Removed {
                hashes: &self.hashes,
                medium: f.medium,
                group_idx: f.group_idx,
            }),
            (Tag::Cleared, None) => Event::Cleared,
        };
        visit(&event);
        Ok(())
    }

    /// Reads one field's value into `f` (or the scratch); a value of the
    /// wrong type is skipped and recorded in `f.bad`.
    fn field<'p>(
        &mut self,
        r: &mut Reader<'p>,
        field: Field,
        f: &mut Fields<'p>,
    ) -> Result<(), DecodeError> {
        let head = r.head()?;
        let bad = |f: &mut Fields<'p>, expected: &'static str, head: &Head<'_>| {
            f.bad
                .get_or_insert((field.name(), mismatch(expected, head)));
        };
        match field {
            Field::BlockHashes => match head {
                Head::Array(n) => {
                    self.hashes.reserve(n);
                    for _ in 0..n {
                        let h = r.head()?;
                        match h.as_hash() {
                            Some(v) => self.hashes.push(v),
                            None => {
                                bad(f, "a block hash (integer or bytes)", &h);
                                r.skip_rest(h)?;
                            }
                        }
                    }
                }
                other => {
                    bad(f, "a list of block hashes", &other);
                    r.skip_rest(other)?;
                }
            },
            Field::Parent => match head {
                Head::Nil => f.parent = None,
                h => match h.as_hash() {
                    Some(v) => f.parent = Some(v),
                    None => {
                        bad(f, "a parent hash or nil", &h);
                        r.skip_rest(h)?;
                    }
                },
            },
            Field::TokenIds => match head {
                Head::Array(n) => {
                    self.tokens.reserve(n);
                    for _ in 0..n {
                        let t = r.head()?;
                        match t.as_int().and_then(|v| u32::try_from(v).ok()) {
                            Some(v) => self.tokens.push(v),
                            None => {
                                bad(f, "a token id (0..2^32)", &t);
                                r.skip_rest(t)?;
                            }
                        }
                    }
                }
                Head::Nil => {}
                other => {
                    bad(f, "a list of token ids", &other);
                    r.skip_rest(other)?;
                }
            },
            Field::BlockSize | Field::LoraId | Field::GroupIdx => {
                let slot = match field {
                    Field::BlockSize => &mut f.block_size,
                    Field::LoraId => &mut f.lora_id,
                    _ => &mut f.group_idx,
                };
                match head {
                    Head::Nil => *slot = None,
                    h => match h.as_int() {
                        Some(v) => *slot = Some(v),
                        None => {
                            bad(f, "an integer or nil", &h);
                            r.skip_rest(h)?;
                        }
                    },
                }
            }
            Field::Medium | Field::LoraName | Field::CacheSalt => {
                let value = match head {
                    Head::Nil => None,
                    Head::Str(s) => match std::str::from_utf8(s) {
                        Ok(s) => Some(s),
                        Err(_) => {
                            f.bad.get_or_insert((field.name(), DecodeError::Utf8));
                            None
                        }
                    },
                    other => {
                        bad(f, "a string or nil", &other);
                        r.skip_rest(other)?;
                        None
                    }
                };
                match field {
                    Field::Medium => f.medium = value,
                    Field::LoraName => f.lora_name = value,
                    _ => f.cache_salt = value,
                }
            }
            Field::ExtraKeys => match head {
                Head::Nil => {}
                Head::Array(blocks) => {
                    for block in 0..blocks {
                        Self::block_keys(r, block == 0, &mut f.extra)?;
                    }
                }
                other => {
                    bad(f, "a list of per-block keys", &other);
                    r.skip_rest(other)?;
                }
            },
            Field::Other => r.skip_rest(head)?,
        }
        Ok(())
    }

    /// One block's extra keys: nil, or a tuple of keys.
    fn block_keys<'p>(
        r: &mut Reader<'p>,
        first: bool,
        extra: &mut Extra<'p>,
    ) -> Result<(), DecodeError> {
        let n = match r.head()? {
            Head::Nil => return Ok(()),
            Head::Array(n) => n,
            other => {
                r.skip_rest(other)?;
                if first {
                    extra.first_more = true;
                } else {
                    extra.later_more = true;
                }
                return Ok(());
            }
        };
        let mut kept = 0;
        for _ in 0..n {
            let key = r.head()?;
            let text = match key {
                Head::Str(s) => std::str::from_utf8(s).ok(),
                _ => None,
            };
            r.skip_rest(key)?;
            match (first, text) {
                (true, Some(s)) if kept < extra.first.len() => {
                    extra.first[kept] = Some(s);
                    kept += 1;
                }
                (true, _) => extra.first_more = true,
                (false, Some(s)) if extra.later.is_none_or(|l| l == s) => extra.later = Some(s),
                (false, _) => extra.later_more = true,
            }
        }
        Ok(())
    }
}
