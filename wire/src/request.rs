//! What a frontend asks, whatever the encoding: one [`Request`] enum that a
//! binary frame and a JSON line both decode into, borrowing from the bytes
//! they arrived in (a binary select's ids, tags and headers are read in
//! place, so decoding allocates nothing), and that a client encodes from.

use std::collections::BTreeMap;

pub use kvedge_schema::messages::Role;

/// One request to a daemon.
// A select is most requests, decoded on the stack and borrowed from its
// frame: boxing it to shrink the rare variants would allocate per select.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Copy, Debug)]
pub enum Request<'a> {
    /// Which worker should serve this prompt?
    Select(Select<'a>),
    /// The request's prefill is done: its prefill tokens leave the
    /// worker's projected load.
    PrefillDone { request_id: u64 },
    /// The request finished: its reservation is released.
    Finish { request_id: u64 },
    /// The request was never served (its dispatch failed before a
    /// response stream): its reservation is released and its session's
    /// binding goes back to what it was before its select.
    Abort { request_id: u64 },
    /// Move this connection's requests onto shared-memory rings (binary
    /// protocol only).
    AttachRings,
    /// The registered workers.
    Workers,
    /// The daemon's counters.
    Stats,
    /// The Prometheus / OpenMetrics text.
    Metrics,
    /// Load the configuration file again.
    Reload,
    /// The most recent selections, newest first.
    Decisions,
}

impl Request<'_> {
    /// The op's name in JSON (`"op"`).
    pub const fn op_name(&self) -> &'static str {
        match self {
            Request::Select(_) => "select",
            Request::PrefillDone { .. } => "prefill_done",
            Request::Finish { .. } => "finish",
            Request::Abort { .. } => "abort",
            Request::AttachRings => "attach_rings",
            Request::Workers => "workers",
            Request::Stats => "stats",
            Request::Metrics => "metrics",
            Request::Reload => "reload",
            Request::Decisions => "decisions",
        }
    }
}

/// A select: the prompt (as token ids or as sequence hashes) and the
/// context rules and policies may look at.
#[derive(Clone, Copy, Debug)]
pub struct Select<'a> {
    pub model: &'a str,
    pub role: Role,
    pub ids: Ids<'a>,
    /// Prompt length in tokens; `None`: derived from the ids (the token
    /// count, or the hash count times the model's block size).
    pub prompt_tokens: Option<u32>,
    pub session: Option<&'a str>,
    /// LoRA adapter whose blocks the token ids hash into (JSON only).
    pub lora: Option<&'a str>,
    /// The prompt's text, for the rules' `regex` classifier.
    pub text: Option<&'a str>,
    /// Answer without reserving the worker or rebinding the session.
    pub dry_run: bool,
    /// Include how the choice was made (JSON only).
    pub explain: bool,
    pub priority: i32,
    pub tenant: Option<&'a str>,
    /// `type-degree` tags for the rule language, at most [`MAX_TAGS`].
    pub tags: Strs<'a>,
    /// Ingress headers, (name, value).
    pub headers: Pairs<'a>,
    /// Pick only among workers whose endpoint is one of these (`host:port`
    /// or the whole endpoint URL); empty: no restriction. A gateway's
    /// subset hint.
    pub subset: Strs<'a>,
    /// The ids are hashes of the prompt's text chunks, not of its KV
    /// blocks (a frontend without the model's tokenizer): the router
    /// matches them against where earlier approximate selects went and
    /// remembers this pick, instead of consulting the engines' events.
    pub approximate: bool,
    /// What started this turn of the session (with `session` only).
    pub trigger: Trigger,
    /// The session this one was forked from (with `session` only).
    pub parent_session: Option<&'a str>,
    /// This is the session's last turn: its binding ends once the turn is
    /// placed (with `session` only).
    pub session_final: bool,
    /// Serve the request on exactly this worker (the explicit request
    /// target): no policy runs; the target must be an available worker of
    /// the model and role.
    pub target: Option<Target>,
    /// The engines' taints this request tolerates: `key` (any value) or
    /// `key=value`, at most [`MAX_TOLERATIONS`].
    pub tolerations: Strs<'a>,
}

/// Most tolerations a select may carry.
pub const MAX_TOLERATIONS: usize = 32;

/// What started a session's turn: the policies' `input_trigger`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Trigger {
    /// A user's message (the default).
    #[default]
    User,
    /// A tool's result coming back to the model.
    Tool,
    /// Anything else (a timer, another agent).
    Other,
}

impl Trigger {
    /// The name in JSON: `user`, `tool`, `other`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Trigger::User => "user",
            Trigger::Tool => "tool",
            Trigger::Other => "other",
        }
    }

    /// Parses a name written by [`Trigger::as_str`].
    pub fn parse(name: &str) -> Option<Trigger> {
        [Trigger::User, Trigger::Tool, Trigger::Other]
            .into_iter()
            .find(|t| t.as_str() == name)
    }

    /// The code in a binary frame.
    pub const fn code(self) -> u8 {
        self as u8
    }

    pub fn from_code(code: u8) -> Option<Trigger> {
        [Trigger::User, Trigger::Tool, Trigger::Other]
            .get(usize::from(code))
            .copied()
    }
}

/// An explicit request target: one worker rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Target {
    pub worker_id: u64,
    pub dp_rank: u32,
}

/// Most tags a select may carry.
pub const MAX_TAGS: usize = 32;
/// Most endpoints a select's subset may name.
pub const MAX_SUBSET: usize = 1024;

impl<'a> Select<'a> {
    /// A select of `ids` for `model` in `role`, everything else unset.
    pub fn new(model: &'a str, role: Role, ids: Ids<'a>) -> Self {
        Select {
            model,
            role,
            ids,
            prompt_tokens: None,
            session: None,
            lora: None,
            text: None,
            dry_run: false,
            explain: false,
            priority: 0,
            tenant: None,
            tags: Strs::EMPTY,
            headers: Pairs::EMPTY,
            subset: Strs::EMPTY,
            approximate: false,
            trigger: Trigger::User,
            parent_session: None,
            session_final: false,
            target: None,
            tolerations: Strs::EMPTY,
        }
    }

    /// Whether any session metadata beyond the id (a trigger other than a
    /// user's message, a parent, the last turn) or a target is set (the
    /// binary protocol then sends the routing block).
    pub fn has_routing(&self) -> bool {
        self.trigger != Trigger::User
            || self.parent_session.is_some()
            || self.session_final
            || self.target.is_some()
            || !self.tolerations.is_empty()
    }

    /// Session metadata needs a session to belong to.
    pub fn check_session_metadata(&self) -> Result<(), &'static str> {
        let metadata =
            self.trigger != Trigger::User || self.parent_session.is_some() || self.session_final;
        if metadata && self.session.is_none_or(str::is_empty) {
            return Err(
                "`trigger`, `parent_session` and `final` describe a session: give `session` too",
            );
        }
        Ok(())
    }

    /// Whether any of priority, tenant, tags and headers is set (the
    /// binary protocol then sends the context block).
    pub fn has_context(&self) -> bool {
        self.priority != 0
            || self.tenant.is_some_and(|t| !t.is_empty())
            || !self.tags.is_empty()
            || !self.headers.is_empty()
    }
}

/// The prompt of a select.
#[derive(Clone, Copy, Debug)]
pub enum Ids<'a> {
    /// Token ids; the daemon hashes them with the model's block size.
    Tokens(Words<'a, u32>),
    /// Sequence hashes of the prompt's full blocks, in order.
    Hashes(Words<'a, u64>),
}

impl<'a> Ids<'a> {
    pub fn tokens(t: &'a [u32]) -> Self {
        Ids::Tokens(Words::Slice(t))
    }

    pub fn hashes(h: &'a [u64]) -> Self {
        Ids::Hashes(Words::Slice(h))
    }

    /// How many ids.
    pub fn len(&self) -> usize {
        match self {
            Ids::Tokens(w) => w.len(),
            Ids::Hashes(w) => w.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A fixed-width integer of an id list (plain old data, so that a list of
/// them is written to a frame as one copy on a little-endian machine).
pub trait Word: bytemuck::Pod + std::fmt::Debug {
    const WIDTH: usize;
    fn from_le(bytes: &[u8]) -> Self;
    fn put_le(self, out: &mut Vec<u8>);
}

// Inline: these run once per id, from the crate that decodes a request.
impl Word for u32 {
    const WIDTH: usize = 4;
    #[inline]
    fn from_le(b: &[u8]) -> Self {
        u32::from_le_bytes(b.try_into().expect("4 bytes"))
    }
    #[inline]
    fn put_le(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
}

impl Word for u64 {
    const WIDTH: usize = 8;
    #[inline]
    fn from_le(b: &[u8]) -> Self {
        u64::from_le_bytes(b.try_into().expect("8 bytes"))
    }
    #[inline]
    fn put_le(self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.to_le_bytes());
    }
}

/// A list of integers: a slice, or the little-endian bytes of a frame read
/// in place (a whole number of words, checked by the decoder).
#[derive(Clone, Copy, Debug)]
pub enum Words<'a, T> {
    Slice(&'a [T]),
    Le(&'a [u8]),
}

impl<'a, T: Word> Words<'a, T> {
    pub fn len(&self) -> usize {
        match self {
            Words::Slice(s) => s.len(),
            Words::Le(b) => b.len() / T::WIDTH,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends the values to `out` (a copy for a slice, a decode for
    /// frame bytes).
    #[inline]
    pub fn extend_into(&self, out: &mut Vec<T>) {
        match *self {
            Words::Slice(s) => out.extend_from_slice(s),
            Words::Le(b) => out.extend(b.chunks_exact(T::WIDTH).map(T::from_le)),
        }
    }

    /// The values, in order.
    pub fn iter(&self) -> impl Iterator<Item = T> + 'a {
        let (slice, bytes): (&'a [T], &'a [u8]) = match *self {
            Words::Slice(s) => (s, &[]),
            Words::Le(b) => (&[], b),
        };
        slice
            .iter()
            .copied()
            .chain(bytes.chunks_exact(T::WIDTH).map(T::from_le))
    }
}

/// A list of strings: a slice, owned strings, or the length-prefixed
/// strings of a frame read in place (validated by the decoder).
#[derive(Clone, Copy, Debug)]
pub struct Strs<'a>(StrsRepr<'a>);

#[derive(Clone, Copy, Debug)]
enum StrsRepr<'a> {
    Slice(&'a [&'a str]),
    Strings(&'a [String]),
    Frame { count: u16, bytes: &'a [u8] },
}

impl<'a> Strs<'a> {
    pub const EMPTY: Strs<'static> = Strs(StrsRepr::Slice(&[]));

    pub fn new(s: &'a [&'a str]) -> Self {
        Strs(StrsRepr::Slice(s))
    }

    pub fn strings(s: &'a [String]) -> Self {
        Strs(StrsRepr::Strings(s))
    }

    /// `count` strings as a frame carries them (`len: u16`, bytes), each
    /// already checked to be whole and UTF-8.
    pub(crate) fn frame(count: u16, bytes: &'a [u8]) -> Self {
        Strs(StrsRepr::Frame { count, bytes })
    }

    pub fn len(&self) -> usize {
        match self.0 {
            StrsRepr::Slice(s) => s.len(),
            StrsRepr::Strings(s) => s.len(),
            StrsRepr::Frame { count, .. } => usize::from(count),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The strings, in order.
    pub fn iter(&self) -> impl Iterator<Item = &'a str> + 'a {
        let (slice, strings, mut frame): (&'a [&'a str], &'a [String], FrameStrs<'a>) = match self.0
        {
            StrsRepr::Slice(s) => (s, &[], FrameStrs::EMPTY),
            StrsRepr::Strings(s) => (&[], s, FrameStrs::EMPTY),
            StrsRepr::Frame { count, bytes } => (&[], &[], FrameStrs { left: count, bytes }),
        };
        slice
            .iter()
            .copied()
            .chain(strings.iter().map(String::as_str))
            .chain(std::iter::from_fn(move || frame.next()))
    }
}

/// (name, value) pairs: a slice, a map, or a frame's length-prefixed
/// pairs read in place (validated by the decoder).
#[derive(Clone, Copy, Debug)]
pub struct Pairs<'a>(PairsRepr<'a>);

#[derive(Clone, Copy, Debug)]
enum PairsRepr<'a> {
    Slice(&'a [(&'a str, &'a str)]),
    Map(&'a BTreeMap<String, String>),
    Frame { count: u16, bytes: &'a [u8] },
}

impl<'a> Pairs<'a> {
    pub const EMPTY: Pairs<'static> = Pairs(PairsRepr::Slice(&[]));

    pub fn new(p: &'a [(&'a str, &'a str)]) -> Self {
        Pairs(PairsRepr::Slice(p))
    }

    pub fn map(m: &'a BTreeMap<String, String>) -> Self {
        Pairs(PairsRepr::Map(m))
    }

    pub(crate) fn frame(count: u16, bytes: &'a [u8]) -> Self {
        Pairs(PairsRepr::Frame { count, bytes })
    }

    pub fn len(&self) -> usize {
        match self.0 {
            PairsRepr::Slice(p) => p.len(),
            PairsRepr::Map(m) => m.len(),
            PairsRepr::Frame { count, .. } => usize::from(count),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The pairs, in order.
    pub fn iter(&self) -> impl Iterator<Item = (&'a str, &'a str)> + 'a {
        static NO_MAP: BTreeMap<String, String> = BTreeMap::new();
        let (slice, map, mut frame): (&'a [(&'a str, &'a str)], &'a BTreeMap<_, _>, _) =
            match self.0 {
                PairsRepr::Slice(p) => (p, &NO_MAP, FrameStrs::EMPTY),
                PairsRepr::Map(m) => (&[][..], m, FrameStrs::EMPTY),
                PairsRepr::Frame { count, bytes } => {
                    (&[][..], &NO_MAP, FrameStrs { left: count, bytes })
                }
            };
        slice
            .iter()
            .copied()
            .chain(map.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .chain(std::iter::from_fn(move || frame.next_pair()))
    }
}

/// Reads validated length-prefixed strings of a frame.
#[derive(Clone, Copy, Debug)]
struct FrameStrs<'a> {
    left: u16,
    bytes: &'a [u8],
}

impl<'a> FrameStrs<'a> {
    const EMPTY: FrameStrs<'static> = FrameStrs {
        left: 0,
        bytes: &[],
    };

    fn take(&mut self) -> &'a str {
        let n = usize::from(u16::from_le_bytes([self.bytes[0], self.bytes[1]]));
        let s = std::str::from_utf8(&self.bytes[2..2 + n]).expect("validated by the decoder");
        self.bytes = &self.bytes[2 + n..];
        s
    }

    fn next(&mut self) -> Option<&'a str> {
        (self.left > 0).then(|| {
            self.left -= 1;
            self.take()
        })
    }

    fn next_pair(&mut self) -> Option<(&'a str, &'a str)> {
        (self.left > 0).then(|| {
            self.left -= 1;
            (self.take(), self.take())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_read_the_same_from_every_representation() {
        let bytes: Vec<u8> = [7u32, 8, 9].iter().flat_map(|v| v.to_le_bytes()).collect();
        let words: Words<'_, u32> = Words::Le(&bytes);
        assert_eq!(words.iter().collect::<Vec<_>>(), [7, 8, 9]);
        assert_eq!(words.len(), 3);
        let frame = [2, 0, b'h', b'i', 1, 0, b'x'];
        let tags = Strs::frame(2, &frame);
        assert_eq!(tags.iter().collect::<Vec<_>>(), ["hi", "x"]);
        let owned = ["hi".to_owned(), "x".to_owned()];
        assert_eq!(
            Strs::strings(&owned).iter().collect::<Vec<_>>(),
            tags.iter().collect::<Vec<_>>()
        );
        let pairs = Pairs::frame(1, &frame[..7]);
        assert_eq!(pairs.iter().collect::<Vec<_>>(), [("hi", "x")]);
        let map: BTreeMap<String, String> = [("hi".to_owned(), "x".to_owned())].into();
        assert_eq!(Pairs::map(&map).iter().collect::<Vec<_>>(), [("hi", "x")]);
        assert_eq!(Pairs::EMPTY.iter().count(), 0);
    }
}
