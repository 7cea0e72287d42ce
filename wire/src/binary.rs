//! The binary encoding: `KVE1` frames. Every frame, both ways, is
//! `len: u32 | op or status: u16 | version: u16 | payload`, little-endian,
//! where `len` counts everything after itself. The payloads are in the
//! crate's documentation. Decoding borrows from the frame and allocates
//! nothing; encoding appends to a caller's buffer.

use crate::reply::{Reply, SelectView};
use crate::request::{
    Ids, MAX_SUBSET, MAX_TAGS, MAX_TOLERATIONS, Pairs, Request, Role, Select, Strs, Target,
    Trigger, Word, Words,
};
use crate::{ErrorReply, Status};

/// First bytes of a binary connection.
pub const MAGIC: &[u8; 4] = b"KVE1";
/// Protocol version in every frame.
pub const VERSION: u16 = 1;

/// Request operations.
pub mod op {
    pub const SELECT: u16 = 1;
    pub const PREFILL_DONE: u16 = 2;
    pub const FINISH: u16 = 3;
    pub const ATTACH_RINGS: u16 = 4;
    pub const ABORT: u16 = 5;
}

/// Select flag bits.
mod flag {
    pub const DRY_RUN: u8 = 1;
    pub const TOKENS: u8 = 2;
    pub const CONTEXT: u8 = 4;
    /// A subset section follows the context (or the ids): the endpoints
    /// the pick must come from.
    pub const SUBSET: u8 = 8;
    /// The hashes are of text chunks (an approximate select); never with
    /// `TOKENS`.
    pub const APPROXIMATE: u8 = 16;
    /// The routing block follows the subset: the session's trigger,
    /// parent and last turn, and an explicit target.
    pub const ROUTING: u8 = 32;
    /// The prompt's text follows the routing block (or what precedes
    /// it): for the rules' regex classifier.
    pub const TEXT: u8 = 64;
}

/// A request a frame cannot carry, or a field too long for its length
/// prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EncodeError(pub &'static str);

impl std::fmt::Display for EncodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for EncodeError {}

/// A bounds-checked reader over a frame.
struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], &'static str> {
        if self.0.len() < n {
            return Err("frame is shorter than its fields");
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u8(&mut self) -> Result<u8, &'static str> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, &'static str> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }
    fn u32(&mut self) -> Result<u32, &'static str> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64, &'static str> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    fn str(&mut self, n: usize) -> Result<&'a str, &'static str> {
        std::str::from_utf8(self.take(n)?).map_err(|_| "a string field is not UTF-8")
    }
    /// A `len: u16`-prefixed string.
    fn short_str(&mut self) -> Result<&'a str, &'static str> {
        let n = usize::from(self.u16()?);
        self.str(n)
    }
    /// `count` length-prefixed strings (`per` of them per item), checked;
    /// returns their bytes.
    fn strs(&mut self, count: u16, per: usize) -> Result<&'a [u8], &'static str> {
        let start = self.0;
        for _ in 0..usize::from(count) * per {
            self.short_str()?;
        }
        Ok(&start[..start.len() - self.0.len()])
    }
}

fn bad(message: &'static str) -> ErrorReply<'static> {
    ErrorReply {
        status: Status::BadRequest,
        message: message.into(),
    }
}

/// Decodes one frame's body (after its length): op, version, payload.
pub fn decode_request(body: &[u8]) -> Result<Request<'_>, ErrorReply<'static>> {
    let mut c = Cursor(body);
    let op = c.u16().map_err(bad)?;
    let version = c.u16().map_err(bad)?;
    if version != VERSION {
        return Err(ErrorReply {
            status: Status::UnsupportedVersion,
            message: "unsupported protocol version".into(),
        });
    }
    let req = match op {
        op::SELECT => Request::Select(decode_select(&mut c).map_err(bad)?),
        op::PREFILL_DONE => Request::PrefillDone {
            request_id: c.u64().map_err(bad)?,
        },
        op::FINISH => Request::Finish {
            request_id: c.u64().map_err(bad)?,
        },
        op::ATTACH_RINGS => Request::AttachRings,
        op::ABORT => Request::Abort {
            request_id: c.u64().map_err(bad)?,
        },
        _ => {
            return Err(ErrorReply {
                status: Status::UnknownOp,
                message: "unknown op".into(),
            });
        }
    };
    if !c.0.is_empty() {
        return Err(bad("trailing bytes after the fields"));
    }
    Ok(req)
}

fn decode_select<'a>(c: &mut Cursor<'a>) -> Result<Select<'a>, &'static str> {
    let flags = c.u8()?;
    let role = Role::from_code(c.u8()?).ok_or("unknown role")?;
    let model = c.short_str()?;
    let session = c.short_str()?;
    let prompt_tokens = c.u32()?;
    let count = c.u32()? as usize;
    let tokens = flags & flag::TOKENS != 0;
    let width = if tokens { u32::WIDTH } else { u64::WIDTH };
    let bytes = c.take(count.checked_mul(width).ok_or("id count overflows")?)?;
    let mut s = Select::new(
        model,
        role,
        if tokens {
            Ids::Tokens(Words::Le(bytes))
        } else {
            Ids::Hashes(Words::Le(bytes))
        },
    );
    s.session = (!session.is_empty()).then_some(session);
    s.prompt_tokens = (prompt_tokens > 0).then_some(prompt_tokens);
    s.dry_run = flags & flag::DRY_RUN != 0;
    if flags & flag::APPROXIMATE != 0 {
        if tokens {
            return Err("an approximate select carries hashes, not tokens");
        }
        s.approximate = true;
    }
    if flags & flag::CONTEXT != 0 {
        s.priority = c.u32()? as i32;
        let tenant = c.short_str()?;
        s.tenant = (!tenant.is_empty()).then_some(tenant);
        let tag_count = c.u16()?;
        if usize::from(tag_count) > MAX_TAGS {
            return Err("more than 32 tags");
        }
        s.tags = Strs::frame(tag_count, c.strs(tag_count, 1)?);
        let header_count = c.u16()?;
        s.headers = Pairs::frame(header_count, c.strs(header_count, 2)?);
    }
    if flags & flag::SUBSET != 0 {
        let count = c.u16()?;
        if usize::from(count) > MAX_SUBSET {
            return Err("more than 1024 subset endpoints");
        }
        s.subset = Strs::frame(count, c.strs(count, 1)?);
    }
    if flags & flag::ROUTING != 0 {
        s.trigger = Trigger::from_code(c.u8()?).ok_or("unknown trigger")?;
        s.session_final = match c.u8()? {
            0 => false,
            1 => true,
            _ => return Err("`final` is neither 0 nor 1"),
        };
        let has_target = c.u8()?;
        let worker_id = c.u64()?;
        let dp_rank = c.u32()?;
        s.target = match has_target {
            0 => None,
            1 => Some(Target { worker_id, dp_rank }),
            _ => return Err("`has_target` is neither 0 nor 1"),
        };
        let parent = c.short_str()?;
        s.parent_session = (!parent.is_empty()).then_some(parent);
        let count = c.u16()?;
        if usize::from(count) > MAX_TOLERATIONS {
            return Err("more than 32 tolerations");
        }
        s.tolerations = Strs::frame(count, c.strs(count, 1)?);
        s.check_session_metadata()?;
    }
    if flags & flag::TEXT != 0 {
        let n = c.u32()? as usize;
        s.text = Some(c.str(n)?);
    }
    Ok(s)
}

/// Appends a frame: `len | code | version | payload`.
pub fn write_frame(out: &mut Vec<u8>, code: u16, payload: impl FnOnce(&mut Vec<u8>)) {
    let start = out.len();
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&code.to_le_bytes());
    out.extend_from_slice(&VERSION.to_le_bytes());
    payload(out);
    let len = (out.len() - start - 4) as u32;
    out[start..start + 4].copy_from_slice(&len.to_le_bytes());
}

/// Appends an error frame.
pub fn write_error(out: &mut Vec<u8>, status: Status, message: &str) {
    write_frame(out, status.code(), |o| {
        o.extend_from_slice(message.as_bytes())
    });
}

fn short(s: &str, what: &'static str) -> Result<u16, EncodeError> {
    u16::try_from(s.len()).map_err(|_| EncodeError(what))
}

fn put_short(o: &mut Vec<u8>, s: &str) {
    o.extend_from_slice(&(s.len() as u16).to_le_bytes());
    o.extend_from_slice(s.as_bytes());
}

fn put_words<T: Word>(o: &mut Vec<u8>, w: &Words<'_, T>) {
    match *w {
        // The frame's byte order is the machine's: one copy (a 2,000-id
        // prompt was 2,000 small appends).
        Words::Slice(s) if cfg!(target_endian = "little") => {
            o.extend_from_slice(bytemuck::cast_slice(s))
        }
        Words::Slice(s) => s.iter().for_each(|v| v.put_le(o)),
        Words::Le(b) => o.extend_from_slice(b),
    }
}

/// Appends `request` as a frame. Workers, stats, metrics and reload are
/// JSON only, as are a select's `lora` and `explain`.
pub fn encode_request(out: &mut Vec<u8>, request: &Request<'_>) -> Result<(), EncodeError> {
    match request {
        Request::Select(s) => encode_select(out, s),
        Request::PrefillDone { request_id } => {
            write_frame(out, op::PREFILL_DONE, |o| {
                o.extend_from_slice(&request_id.to_le_bytes())
            });
            Ok(())
        }
        Request::Finish { request_id } => {
            write_frame(out, op::FINISH, |o| {
                o.extend_from_slice(&request_id.to_le_bytes())
            });
            Ok(())
        }
        Request::Abort { request_id } => {
            write_frame(out, op::ABORT, |o| {
                o.extend_from_slice(&request_id.to_le_bytes())
            });
            Ok(())
        }
        Request::AttachRings => {
            write_frame(out, op::ATTACH_RINGS, |_| {});
            Ok(())
        }
        Request::Workers
        | Request::Stats
        | Request::Metrics
        | Request::Reload
        | Request::Decisions => Err(EncodeError(
            "workers, stats, metrics, reload and decisions are in the JSON protocol only",
        )),
    }
}

fn encode_select(out: &mut Vec<u8>, s: &Select<'_>) -> Result<(), EncodeError> {
    if s.lora.is_some() || s.explain {
        return Err(EncodeError(
            "a select's lora and explain are in the JSON protocol only",
        ));
    }
    let text_len = match s.text {
        Some(t) => Some(u32::try_from(t.len()).map_err(|_| EncodeError("the text is too long"))?),
        None => None,
    };
    let session = s.session.unwrap_or("");
    let tenant = s.tenant.unwrap_or("");
    short(s.model, "model is too long")?;
    short(session, "session is too long")?;
    short(tenant, "tenant is too long")?;
    let context = s.has_context();
    if context {
        if s.tags.len() > MAX_TAGS || s.headers.len() > usize::from(u16::MAX) {
            return Err(EncodeError("at most 32 tags and 65535 headers"));
        }
        for t in s.tags.iter() {
            short(t, "a tag is too long")?;
        }
        for (n, v) in s.headers.iter() {
            short(n, "a header name is too long")?;
            short(v, "a header value is too long")?;
        }
    }
    if s.subset.len() > MAX_SUBSET {
        return Err(EncodeError("at most 1024 subset endpoints"));
    }
    for e in s.subset.iter() {
        short(e, "a subset endpoint is too long")?;
    }
    let routing = s.has_routing();
    let parent = s.parent_session.unwrap_or("");
    short(parent, "parent session is too long")?;
    if s.tolerations.len() > MAX_TOLERATIONS {
        return Err(EncodeError("at most 32 tolerations"));
    }
    for t in s.tolerations.iter() {
        short(t, "a toleration is too long")?;
    }
    s.check_session_metadata().map_err(EncodeError)?;
    let count = u32::try_from(s.ids.len()).map_err(|_| EncodeError("the prompt is too long"))?;
    if s.approximate && matches!(s.ids, Ids::Tokens(_)) {
        return Err(EncodeError(
            "an approximate select carries hashes, not tokens",
        ));
    }
    let flags = if s.dry_run { flag::DRY_RUN } else { 0 }
        | if matches!(s.ids, Ids::Tokens(_)) {
            flag::TOKENS
        } else {
            0
        }
        | if context { flag::CONTEXT } else { 0 }
        | if s.subset.is_empty() { 0 } else { flag::SUBSET }
        | if s.approximate { flag::APPROXIMATE } else { 0 }
        | if routing { flag::ROUTING } else { 0 }
        | if text_len.is_some() { flag::TEXT } else { 0 };
    write_frame(out, op::SELECT, |o| {
        o.push(flags);
        o.push(s.role as u8);
        put_short(o, s.model);
        put_short(o, session);
        o.extend_from_slice(&s.prompt_tokens.unwrap_or(0).to_le_bytes());
        o.extend_from_slice(&count.to_le_bytes());
        match &s.ids {
            Ids::Tokens(w) => put_words(o, w),
            Ids::Hashes(w) => put_words(o, w),
        }
        if context {
            o.extend_from_slice(&s.priority.to_le_bytes());
            put_short(o, tenant);
            o.extend_from_slice(&(s.tags.len() as u16).to_le_bytes());
            s.tags.iter().for_each(|t| put_short(o, t));
            o.extend_from_slice(&(s.headers.len() as u16).to_le_bytes());
            for (n, v) in s.headers.iter() {
                put_short(o, n);
                put_short(o, v);
            }
        }
        if !s.subset.is_empty() {
            o.extend_from_slice(&(s.subset.len() as u16).to_le_bytes());
            s.subset.iter().for_each(|e| put_short(o, e));
        }
        if routing {
            let target = s.target.unwrap_or(Target {
                worker_id: 0,
                dp_rank: 0,
            });
            o.push(s.trigger.code());
            o.push(u8::from(s.session_final));
            o.push(u8::from(s.target.is_some()));
            o.extend_from_slice(&target.worker_id.to_le_bytes());
            o.extend_from_slice(&target.dp_rank.to_le_bytes());
            put_short(o, parent);
            o.extend_from_slice(&(s.tolerations.len() as u16).to_le_bytes());
            s.tolerations.iter().for_each(|t| put_short(o, t));
        }
        if let (Some(t), Some(n)) = (s.text, text_len) {
            o.extend_from_slice(&n.to_le_bytes());
            o.extend_from_slice(t.as_bytes());
        }
    });
    Ok(())
}

/// Appends `reply` as a frame. Replies only JSON requests get (workers,
/// stats, metrics, reload) are not frames; asked for one, this writes an
/// `UnknownOp` error.
pub fn encode_reply(out: &mut Vec<u8>, reply: &Reply<'_>) {
    match reply {
        Reply::Selected(s) => write_select_reply(out, &s.view()),
        Reply::Done => write_frame(out, Status::Ok.code(), |_| {}),
        Reply::RingsAttached { capacity } => write_frame(out, Status::Ok.code(), |o| {
            o.extend_from_slice(&capacity.to_le_bytes())
        }),
        Reply::Error(e) => write_error(out, e.status, &e.message),
        Reply::Workers(_)
        | Reply::Stats(_)
        | Reply::Metrics(_)
        | Reply::Reloaded { .. }
        | Reply::Decisions(_) => {
            write_error(out, Status::UnknownOp, "not an op of the binary protocol")
        }
    }
}

/// Appends a select answer.
pub fn write_select_reply(out: &mut Vec<u8>, r: &SelectView<'_>) {
    write_frame(out, Status::Ok.code(), |o| {
        o.extend_from_slice(&r.worker_id.to_le_bytes());
        o.extend_from_slice(&r.dp_rank.to_le_bytes());
        o.extend_from_slice(&r.request_id.to_le_bytes());
        o.extend_from_slice(&r.cost.to_le_bytes());
        for b in r.overlap_blocks {
            o.extend_from_slice(&b.to_le_bytes());
        }
        let named = r.provider && !r.provider_name.is_empty();
        o.push(u8::from(r.provider) | if named { 2 } else { 0 });
        put_short(o, cut(r.endpoint));
        if named {
            put_short(o, cut(r.provider_name));
        }
    });
}

/// `s` cut to what a `u16` length can say, on a character boundary.
fn cut(s: &str) -> &str {
    let mut n = s.len().min(usize::from(u16::MAX));
    while !s.is_char_boundary(n) {
        n -= 1;
    }
    &s[..n]
}

/// Decodes the payload of a select answer.
pub fn decode_select_reply(p: &[u8]) -> Result<SelectView<'_>, &'static str> {
    let mut c = Cursor(p);
    let worker_id = c.u64()?;
    let dp_rank = c.u32()?;
    let request_id = c.u64()?;
    let cost = f64::from_bits(c.u64()?);
    let overlap_blocks = [c.u32()?, c.u32()?, c.u32()?];
    let flags = c.u8()?;
    let provider = flags & 1 != 0;
    let endpoint = c.short_str()?;
    // Bit 1: the provider's name follows (decoders that predate it stop
    // at the endpoint).
    let provider_name = if flags & 2 != 0 { c.short_str()? } else { "" };
    Ok(SelectView {
        worker_id,
        dp_rank,
        request_id,
        cost,
        overlap_blocks,
        provider,
        endpoint,
        provider_name,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(r: &Request<'_>) -> Vec<u8> {
        let mut out = Vec::new();
        encode_request(&mut out, r).unwrap();
        assert_eq!(
            u32::from_le_bytes(out[..4].try_into().unwrap()) as usize,
            out.len() - 4
        );
        out.drain(..4);
        out
    }

    #[test]
    fn a_select_round_trips_with_its_context() {
        let hashes = [1u64, 2, 3];
        let tags = ["complexity-high", "lang-rust"];
        let headers = [("x-tier", "gold")];
        let mut s = Select::new("llama", Role::Prefill, Ids::hashes(&hashes));
        s.session = Some("s1");
        s.prompt_tokens = Some(40);
        s.dry_run = true;
        s.priority = -3;
        s.tenant = Some("acme");
        s.tags = Strs::new(&tags);
        s.headers = Pairs::new(&headers);
        let body = round_trip(&Request::Select(s));
        let Request::Select(d) = decode_request(&body).unwrap() else {
            panic!("not a select")
        };
        assert_eq!(
            (d.model, d.role, d.session),
            ("llama", Role::Prefill, Some("s1"))
        );
        assert_eq!(
            (d.prompt_tokens, d.dry_run, d.priority),
            (Some(40), true, -3)
        );
        assert_eq!(d.tenant, Some("acme"));
        let Ids::Hashes(h) = d.ids else {
            panic!("hashes")
        };
        assert_eq!(h.iter().collect::<Vec<_>>(), hashes);
        assert_eq!(d.tags.iter().collect::<Vec<_>>(), tags);
        assert_eq!(d.headers.iter().collect::<Vec<_>>(), headers);
        assert!(d.subset.is_empty());
    }

    #[test]
    fn the_routing_block_round_trips_and_needs_a_session() {
        let hashes = [1u64];
        let subset = ["10.0.0.1:8000"];
        for with_subset in [false, true] {
            let mut s = Select::new("llama", Role::Aggregated, Ids::hashes(&hashes));
            s.session = Some("child");
            s.trigger = Trigger::Tool;
            s.parent_session = Some("parent");
            s.session_final = true;
            s.target = Some(Target {
                worker_id: 7,
                dp_rank: 2,
            });
            s.tolerations = Strs::new(&["spot", "gpu=a10"]);
            if with_subset {
                s.subset = Strs::new(&subset);
            }
            let body = round_trip(&Request::Select(s));
            let Request::Select(d) = decode_request(&body).unwrap() else {
                panic!("not a select")
            };
            assert_eq!(
                (d.trigger, d.parent_session, d.session_final, d.target),
                (Trigger::Tool, Some("parent"), true, s.target)
            );
            assert_eq!(d.subset.len(), usize::from(with_subset));
            assert_eq!(
                d.tolerations.iter().collect::<Vec<_>>(),
                ["spot", "gpu=a10"]
            );
        }
        // A target alone needs no session; a trigger does.
        let mut s = Select::new("llama", Role::Aggregated, Ids::hashes(&hashes));
        s.target = Some(Target {
            worker_id: 1,
            dp_rank: 0,
        });
        let body = round_trip(&Request::Select(s));
        let Request::Select(d) = decode_request(&body).unwrap() else {
            panic!("not a select")
        };
        assert_eq!((d.target, d.trigger), (s.target, Trigger::User));
        s.trigger = Trigger::Tool;
        assert!(encode_request(&mut Vec::new(), &Request::Select(s)).is_err());
        // A hand-made frame with a trigger and no session, or an unknown
        // trigger, is refused with its reason.
        let mut body = round_trip(&Request::Select(Select {
            trigger: Trigger::User,
            ..s
        }));
        let at = body.len() - 2 - 2 - 4 - 8 - 3;
        body[at] = 1;
        assert!(
            decode_request(&body)
                .unwrap_err()
                .message
                .contains("session")
        );
        body[at] = 9;
        assert_eq!(
            decode_request(&body).unwrap_err().message,
            "unknown trigger"
        );
    }

    #[test]
    fn a_select_carries_its_text_after_everything_else() {
        let hashes = [1u64];
        for session in [None, Some("s")] {
            let mut s = Select::new("m", Role::Aggregated, Ids::hashes(&hashes));
            s.session = session;
            s.trigger = if session.is_some() {
                Trigger::Tool
            } else {
                Trigger::User
            };
            s.text = Some("my SSN is 123-45-6789");
            let body = round_trip(&Request::Select(s));
            let Request::Select(d) = decode_request(&body).unwrap() else {
                panic!("not a select")
            };
            assert_eq!((d.text, d.trigger), (s.text, s.trigger));
        }
        // A text longer than its frame, or not UTF-8, is refused.
        let mut s = Select::new("m", Role::Aggregated, Ids::hashes(&hashes));
        s.text = Some("abc");
        let mut body = round_trip(&Request::Select(s));
        let n = body.len();
        body[n - 1] = 0xff;
        assert_eq!(
            decode_request(&body).unwrap_err().message,
            "a string field is not UTF-8"
        );
        body.truncate(n - 1);
        assert!(decode_request(&body).is_err());
    }

    #[test]
    fn id_lists_are_written_little_endian() {
        let tokens = [0x0403_0201u32, 7];
        let hashes = [0x0807_0605_0403_0201u64];
        for (ids, bytes) in [
            (Ids::tokens(&tokens), &[1u8, 2, 3, 4, 7, 0, 0, 0][..]),
            (Ids::hashes(&hashes), &[1, 2, 3, 4, 5, 6, 7, 8][..]),
        ] {
            let body = round_trip(&Request::Select(Select::new("m", Role::Prefill, ids)));
            assert!(
                body.windows(bytes.len()).any(|w| w == bytes),
                "{bytes:?} not in {body:?}"
            );
        }
    }

    #[test]
    fn a_subset_round_trips_with_or_without_a_context() {
        let hashes = [1u64];
        let subset = ["10.0.0.1:8000", "10.0.0.2:8000"];
        for tenant in [None, Some("acme")] {
            let mut s = Select::new("llama", Role::Aggregated, Ids::hashes(&hashes));
            s.tenant = tenant;
            s.subset = Strs::new(&subset);
            let body = round_trip(&Request::Select(s));
            let Request::Select(d) = decode_request(&body).unwrap() else {
                panic!("not a select")
            };
            assert_eq!(d.tenant, tenant);
            assert_eq!(d.subset.iter().collect::<Vec<_>>(), subset);
        }
        let many: Vec<String> = (0..=MAX_SUBSET).map(|i| format!("10.0.0.{i}:1")).collect();
        let mut s = Select::new("llama", Role::Aggregated, Ids::hashes(&hashes));
        s.subset = Strs::strings(&many);
        assert!(encode_request(&mut Vec::new(), &Request::Select(s)).is_err());
    }

    #[test]
    fn a_select_reply_names_its_provider_and_older_decoders_stop_before_it() {
        let mut view = SelectView {
            worker_id: 0,
            dp_rank: 0,
            request_id: 9,
            cost: f64::NAN,
            overlap_blocks: [0; 3],
            provider: true,
            endpoint: "https://api.example.com",
            provider_name: "example",
        };
        for named in [true, false] {
            if !named {
                view.provider = false;
                view.provider_name = "";
                view.endpoint = "http://10.0.0.1:8000";
            }
            let mut out = Vec::new();
            write_select_reply(&mut out, &view);
            let d = decode_select_reply(&out[8..]).unwrap();
            assert_eq!(
                (d.provider, d.endpoint, d.provider_name),
                (view.provider, view.endpoint, view.provider_name)
            );
            // What a decoder without the name reads: the endpoint, then
            // either the end or the name it skips.
            let end = 8 + 8 + 4 + 8 + 8 + 12 + 1 + 2 + view.endpoint.len();
            assert_eq!(out.len() > end, named);
        }
    }

    #[test]
    fn an_approximate_select_round_trips_and_never_carries_tokens() {
        let hashes = [7u64, 8];
        let mut s = Select::new("llama", Role::Aggregated, Ids::hashes(&hashes));
        s.approximate = true;
        let body = round_trip(&Request::Select(s));
        assert_ne!(body[4] & flag::APPROXIMATE, 0);
        let Request::Select(d) = decode_request(&body).unwrap() else {
            panic!("not a select")
        };
        assert!(d.approximate);
        let tokens = [1u32];
        let mut s = Select::new("llama", Role::Aggregated, Ids::tokens(&tokens));
        s.approximate = true;
        assert!(encode_request(&mut Vec::new(), &Request::Select(s)).is_err());
        // A frame claiming both is refused.
        let s = Select::new("llama", Role::Aggregated, Ids::tokens(&tokens));
        let mut body = round_trip(&Request::Select(s));
        body[4] |= flag::APPROXIMATE;
        assert!(decode_request(&body).is_err());
    }

    #[test]
    fn a_plain_select_sends_no_context_and_releases_round_trip() {
        let tokens = [5u32, 6];
        let body = round_trip(&Request::Select(Select::new(
            "m",
            Role::Aggregated,
            Ids::tokens(&tokens),
        )));
        assert_eq!(body[4] & flag::CONTEXT, 0);
        let Request::Select(d) = decode_request(&body).unwrap() else {
            panic!("not a select")
        };
        let Ids::Tokens(t) = d.ids else {
            panic!("tokens")
        };
        assert_eq!(t.iter().collect::<Vec<_>>(), tokens);
        assert_eq!((d.session, d.prompt_tokens, d.tags.len()), (None, None, 0));
        let body = round_trip(&Request::Finish { request_id: 9 });
        assert!(matches!(
            decode_request(&body),
            Ok(Request::Finish { request_id: 9 })
        ));
    }

    #[test]
    fn bad_frames_get_their_status() {
        let mut body = round_trip(&Request::Finish { request_id: 9 });
        body.push(0);
        assert_eq!(
            decode_request(&body).unwrap_err().status,
            Status::BadRequest
        );
        body[2] = 9;
        assert_eq!(
            decode_request(&body).unwrap_err().status,
            Status::UnsupportedVersion
        );
        assert_eq!(
            decode_request(&[99, 0, 1, 0]).unwrap_err().status,
            Status::UnknownOp
        );
        // Role 7 does not exist.
        let mut s = round_trip(&Request::Select(Select::new(
            "m",
            Role::Decode,
            Ids::hashes(&[]),
        )));
        s[5] = 7;
        assert_eq!(decode_request(&s).unwrap_err().message, "unknown role");
    }

    #[test]
    fn json_only_requests_are_refused() {
        let mut out = Vec::new();
        assert!(encode_request(&mut out, &Request::Stats).is_err());
        let mut s = Select::new("m", Role::Aggregated, Ids::hashes(&[]));
        s.explain = true;
        assert!(encode_request(&mut out, &Request::Select(s)).is_err());
        assert!(out.is_empty());
    }
}
