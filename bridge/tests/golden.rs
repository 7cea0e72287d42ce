//! Payloads encoded by msgspec with the engines' own structure definitions
//! (`testdata/engines/make_golden.py`), decoded and translated here.

#![forbid(unsafe_code)]

mod common;

use common::{Out, Recorder, golden};
use kvedge_bridge::decode::{Decoder, Event};
use kvedge_bridge::translate::Translator;
use kvedge_schema::hash::{SEED, block_seed, sequence_hashes};
use kvedge_schema::messages::{Tier, notice};

const BIG: u64 = u64::MAX - 4;

fn tokens(range: std::ops::Range<u32>) -> Vec<u32> {
    range.collect()
}

/// Decodes a file and runs it through a fresh translator (block size 16).
fn translate(name: &str) -> (Recorder, Translator, kvedge_bridge::decode::Batch) {
    let bytes = golden(name);
    let mut decoder = Decoder::new();
    let mut t = Translator::new(16, 1 << 20);
    let mut out = Recorder::default();
    let batch = decoder
        .decode(&bytes, |e| t.apply(e, &mut out))
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    (out, t, batch)
}

#[test]
fn array_layout_with_integer_hashes() {
    let bytes = golden("vllm_array_int.msgpack");
    let mut seen = Vec::new();
    let batch = Decoder::new()
        .decode(&bytes, |e| {
            seen.push(match e {
                Event::Stored(s) => format!(
                    "stored {:?} parent {:?} {} tokens {:?}",
                    s.hashes,
                    s.parent,
                    s.tokens.len(),
                    s.medium
                ),
                Event::Removed(r) => format!("removed {:?} {:?}", r.hashes, r.medium),
                other => format!("{other:?}"),
            })
        })
        .unwrap();
    assert_eq!(batch.events, 4);
    assert_eq!(batch.dp_rank, Some(0));
    assert_eq!(batch.ts, 1767225600.25);
    assert_eq!(
        seen,
        [
            format!("stored [{BIG}, 7] parent None 32 tokens Some(\"GPU\")"),
            "stored [9] parent Some(7) 16 tokens Some(\"CPU\")".to_string(),
            "removed [7] Some(\"GPU\")".to_string(),
            "Cleared".to_string(),
        ]
    );

    let (out, t, _) = translate("vllm_array_int.msgpack");
    let chain = sequence_hashes(&tokens(100..148), 16, None, None);
    assert_eq!(
        out.0,
        [
            Out::Stored(Tier::Device, chain[..2].to_vec(), SEED),
            // The CPU block's parent is engine hash 7, kvedge's chain[1].
            Out::Stored(Tier::Host, vec![chain[2]], SEED),
            Out::Removed(Tier::Device, vec![chain[1]]),
            Out::Cleared,
        ]
    );
    assert!(t.is_empty());
    assert_eq!(t.counts().0.iter().sum::<u64>(), 0);
}

#[test]
fn map_layout_with_digest_hashes_and_an_unknown_field() {
    let (out, t, batch) = translate("vllm_map_bytes.msgpack");
    assert_eq!((batch.events, batch.dp_rank), (3, None));
    let chain = sequence_hashes(&tokens(100..132), 16, None, None);
    assert_eq!(
        out.0,
        [
            Out::Stored(Tier::Device, chain.clone(), SEED),
            Out::Removed(Tier::Device, vec![chain[1]]),
            Out::Cleared,
        ]
    );
    assert_eq!(t.counts().0.iter().sum::<u64>(), 0);
}

#[test]
fn lora_name_and_cache_salt_fold_into_the_seed() {
    let (out, t, batch) = translate("vllm_lora_salt.msgpack");
    assert_eq!(batch.dp_rank, Some(1));
    // What a frontend asking with lora "adapter-a" and namespace
    // "tenant-salt" computes.
    let chain = sequence_hashes(
        &tokens(100..148),
        16,
        Some("adapter-a"),
        Some("tenant-salt"),
    );
    let seed = block_seed(Some("adapter-a"), Some("tenant-salt"));
    assert_eq!(
        out.0,
        [
            Out::Stored(Tier::Device, chain[..2].to_vec(), seed),
            Out::Stored(Tier::Disk, vec![chain[2]], seed),
        ]
    );
    assert_eq!(t.len(), 3);
}

#[test]
fn future_fields_multimodal_groups_and_unknown_events() {
    let (out, t, batch) = translate("vllm_future.msgpack");
    assert_eq!(batch.events, 4);
    // The future event's trailing fields are skipped; it is indexed.
    assert_eq!(
        out.0,
        [Out::Stored(
            Tier::Device,
            sequence_hashes(&tokens(100..132), 16, None, None),
            SEED
        )]
    );
    let c = t.counts();
    assert_eq!(c.get(notice::EXTRA_KEYS), 1, "the multimodal block");
    assert_eq!(c.get(notice::OTHER_GROUP), 1, "group 1");
    assert_eq!(c.get(notice::UNKNOWN_EVENT), 1, "BlockMovedToMars");
    assert_eq!(t.len(), 2);
}

#[test]
fn sglang_variant() {
    let (out, _, batch) = translate("sglang.msgpack");
    assert_eq!(batch.dp_rank, Some(3));
    let chain = sequence_hashes(&tokens(100..132), 16, None, None);
    assert_eq!(
        out.0,
        [
            Out::Stored(Tier::Device, chain.clone(), SEED),
            Out::Removed(Tier::Device, vec![chain[0]]),
        ]
    );
}

#[test]
fn sglang_map_layout_with_a_named_salt_host_blocks_and_a_shared_pool() {
    let (out, t, batch) = translate("sglang_map.msgpack");
    assert_eq!(batch.events, 4);
    assert_eq!(batch.dp_rank, Some(0));
    // What a frontend asking with namespace "tenant-salt" computes: the
    // salt seeds the chain once, though SGLang names it on every event.
    let chain = sequence_hashes(&tokens(100..148), 16, None, Some("tenant-salt"));
    let seed = block_seed(None, Some("tenant-salt"));
    assert_eq!(
        out.0,
        [
            Out::Stored(Tier::Device, chain[..2].to_vec(), seed),
            Out::Stored(Tier::Host, vec![chain[2]], seed),
            Out::Removed(Tier::Host, vec![chain[2]]),
        ]
    );
    // The shared pool's block favours no engine: skipped and counted.
    assert_eq!(t.counts().get(notice::UNKNOWN_MEDIUM), 1);
}

#[test]
fn a_wrong_block_size_is_counted_and_never_indexed() {
    let bytes = golden("vllm_array_int.msgpack");
    let mut t = Translator::new(32, 1 << 20);
    let mut out = Recorder::default();
    Decoder::new()
        .decode(&bytes, |e| t.apply(e, &mut out))
        .unwrap();
    assert!(!out.0.iter().any(|o| matches!(o, Out::Stored(..))));
    assert_eq!(t.counts().get(notice::BLOCK_SIZE_MISMATCH), 2);
    let first: Vec<_> = t.take_first_skips().collect();
    assert!(
        first
            .iter()
            .any(|(code, why)| *code == notice::BLOCK_SIZE_MISMATCH
                && why.contains("set `block_size: 16`")),
        "{first:?}"
    );
}

#[test]
fn kvedge_writes_both_layouts_byte_for_byte_as_msgspec() {
    use kvedge_bridge::encode::{EventOut, Layout, write_batch};
    let first = tokens(100..132);
    let second = tokens(132..148);
    let events = [
        EventOut::Stored {
            hashes: &[BIG, 7],
            parent: None,
            tokens: &first,
            block_size: 16,
            medium: "GPU",
        },
        EventOut::Stored {
            hashes: &[9],
            parent: Some(7),
            tokens: &second,
            block_size: 16,
            medium: "CPU",
        },
        EventOut::Removed {
            hashes: &[7],
            medium: "GPU",
        },
        EventOut::Cleared,
    ];
    // Positional events, as vLLM released them before mid-2026; maps
    // tagged by "type", as vLLM 0.32 writes them (every field without a
    // default present, null or not: a reader may insist on them).
    for (layout, file) in [
        (Layout::Array, "vllm_array_int.msgpack"),
        (Layout::Map, "vllm_map_int.msgpack"),
    ] {
        let mut out = Vec::new();
        write_batch(&mut out, 1767225600.25, &events, layout, Some(0));
        assert_eq!(out, golden(file), "{layout:?}");
    }
    // The map layout carries the same events.
    let mut map = Vec::new();
    write_batch(&mut map, 1.0, &events[..1], Layout::Map, None);
    let mut t = Translator::new(16, 1 << 20);
    let mut rec = Recorder::default();
    Decoder::new()
        .decode(&map, |e| t.apply(e, &mut rec))
        .unwrap();
    assert_eq!(
        rec.0,
        [Out::Stored(
            Tier::Device,
            sequence_hashes(&first, 16, None, None),
            SEED
        )]
    );
}
