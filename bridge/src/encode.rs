//! The engines' payload, written: a KV event batch in either layout, as
//! msgspec encodes it. The mock engine publishes with it, and the tests and
//! benches make their input with it; the golden files in
//! `testdata/engines/`, made by msgspec itself, keep it and the decoder
//! honest.

use std::convert::Infallible;

use rmp::encode::{self, ByteBuf, ValueWriteError};

/// How the events of a batch are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// `["BlockStored", field, ...]` (releases before mid-2026).
    Array,
    /// `{"type": "BlockStored", "block_hashes": ...}`.
    Map,
}

/// One event to write.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum EventOut<'a> {
    Stored {
        hashes: &'a [u64],
        parent: Option<u64>,
        /// `hashes.len() * block_size` token ids.
        tokens: &'a [u32],
        block_size: u32,
        medium: &'a str,
    },
    Removed {
        hashes: &'a [u64],
        medium: &'a str,
    },
    Cleared,
}

/// Writing into a `ByteBuf` cannot fail.
fn ok<T>(r: Result<T, ValueWriteError<Infallible>>) -> T {
    match r {
        Ok(v) => v,
        Err(
            ValueWriteError::InvalidMarkerWrite(never) | ValueWriteError::InvalidDataWrite(never),
        ) => match never {},
    }
}

fn nil(b: &mut ByteBuf) {
    match encode::write_nil(b) {
        Ok(()) => {}
        Err(never) => match never {},
    }
}

/// A collection length as msgpack takes it (payloads far below 2^32
/// elements).
fn len(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn uints(b: &mut ByteBuf, values: impl ExactSizeIterator<Item = u64>) {
    ok(encode::write_array_len(b, len(values.len())));
    for v in values {
        ok(encode::write_uint(b, v));
    }
}

fn key(b: &mut ByteBuf, layout: Layout, name: &str) {
    if layout == Layout::Map {
        ok(encode::write_str(b, name));
    }
}

/// Appends one batch `[ts, events, dp_rank]` to `out`. In either layout
/// the bytes are msgspec's for vLLM's structures (the test
/// `kvedge_writes_both_layouts_byte_for_byte_as_msgspec`).
pub fn write_batch(
    out: &mut Vec<u8>,
    ts: f64,
    events: &[EventOut<'_>],
    layout: Layout,
    dp_rank: Option<u32>,
) {
    let mut b = ByteBuf::from_vec(std::mem::take(out));
    ok(encode::write_array_len(&mut b, 3));
    ok(encode::write_f64(&mut b, ts));
    ok(encode::write_array_len(&mut b, len(events.len())));
    for e in events {
        // Positional events carry every field of vLLM's structs, absent
        // ones as nil (msgspec writes them so); maps carry the fields
        // without a default (nil when absent) and leave out the ones at
        // their default (msgspec's `omit_defaults`), as vLLM 0.32 declares
        // them.
        let (tag, fields) = match (e, layout) {
            (EventOut::Stored { .. }, Layout::Array) => ("BlockStored", 11),
            (EventOut::Stored { .. }, Layout::Map) => ("BlockStored", 7),
            (EventOut::Removed { .. }, Layout::Array) => ("BlockRemoved", 3),
            (EventOut::Removed { .. }, Layout::Map) => ("BlockRemoved", 2),
            (EventOut::Cleared, _) => ("AllBlocksCleared", 0),
        };
        match layout {
            Layout::Array => ok(encode::write_array_len(&mut b, len(fields + 1))),
            Layout::Map => ok(encode::write_map_len(&mut b, len(fields + 1))),
        };
        key(&mut b, layout, "type");
        ok(encode::write_str(&mut b, tag));
        match *e {
            EventOut::Stored {
                hashes,
                parent,
                tokens,
                block_size,
                medium,
            } => {
                key(&mut b, layout, "block_hashes");
                uints(&mut b, hashes.iter().copied());
                key(&mut b, layout, "parent_block_hash");
                match parent {
                    Some(p) => drop(ok(encode::write_uint(&mut b, p))),
                    None => nil(&mut b),
                }
                key(&mut b, layout, "token_ids");
                uints(&mut b, tokens.iter().map(|&t| u64::from(t)));
                key(&mut b, layout, "block_size");
                ok(encode::write_uint(&mut b, block_size.into()));
                key(&mut b, layout, "lora_id");
                nil(&mut b);
                key(&mut b, layout, "medium");
                ok(encode::write_str(&mut b, medium));
                key(&mut b, layout, "lora_name");
                nil(&mut b);
                if layout == Layout::Array {
                    // extra_keys, group_idx, kv_cache_spec_kind,
                    // kv_cache_spec_sliding_window
                    (0..4).for_each(|_| nil(&mut b));
                }
            }
            EventOut::Removed { hashes, medium } => {
                key(&mut b, layout, "block_hashes");
                uints(&mut b, hashes.iter().copied());
                key(&mut b, layout, "medium");
                ok(encode::write_str(&mut b, medium));
                if layout == Layout::Array {
                    nil(&mut b); // group_idx
                }
            }
            EventOut::Cleared => {}
        }
    }
    match dp_rank {
        Some(r) => drop(ok(encode::write_uint(&mut b, r.into()))),
        None => nil(&mut b),
    }
    *out = b.into_vec();
}
