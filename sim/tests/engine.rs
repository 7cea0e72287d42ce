//! The engine model against hand-computed cases: step arithmetic and TTFT,
//! prefix hits, eviction order, the host tier, and what gets published.

#![forbid(unsafe_code)]

use kvedge_schema::messages::Tier;
use kvedge_sim::engine::{
    Completion, EngineModel, EngineParams, EngineRequest, KvEvent, Outputs, SubmitError,
};

/// Block size 4; 1 ms per prefill token; 100 µs per step; 1 µs per decode
/// context token; no host tier.
fn params(device_blocks: u32, host_blocks: u32) -> EngineParams {
    EngineParams {
        block_size: 4,
        device_blocks,
        host_blocks,
        max_batch_tokens: 8,
        max_running: 4,
        prefill_tokens_per_s: 1_000.0,
        step_base_us: 100.0,
        decode_us_per_context_token: 1.0,
        host_load_tokens_per_s: 4_000.0,
    }
}

fn req(id: u64, tokens: &[u32], output: u32) -> EngineRequest {
    EngineRequest {
        id,
        hashes: kvedge_schema::hash::sequence_hashes(tokens, 4, None, None),
        prompt_tokens: tokens.len() as u32,
        output_tokens: output,
    }
}

/// Runs the engine until idle, collecting everything.
fn run(e: &mut EngineModel, from: u64, out: &mut Outputs) -> u64 {
    let mut now = from;
    while let Some(t) = e.advance(now, out) {
        now = t;
    }
    now
}

/// Asked to, the engine reports every later output token at the end of
/// the decode step that made it, the last just before `Finished`.
#[test]
fn each_output_token_is_reported_when_asked_for() {
    let mut e = EngineModel::new(params(16, 0));
    e.report_tokens(true);
    let mut out = Outputs::default();
    let prompt: Vec<u32> = (0..10).collect();
    e.submit(req(1, &prompt, 3), 0).unwrap();
    run(&mut e, 0, &mut out);
    assert_eq!(
        out.completions,
        vec![
            Completion::FirstToken {
                id: 1,
                at_us: 10_200,
                cached_tokens: 0
            },
            Completion::Token {
                id: 1,
                at_us: 10_311
            },
            Completion::Token {
                id: 1,
                at_us: 10_423
            },
            Completion::Finished {
                id: 1,
                at_us: 10_423
            },
        ]
    );
}

#[test]
fn step_arithmetic_gives_ttft_and_finish() {
    let mut e = EngineModel::new(params(16, 0));
    let mut out = Outputs::default();
    let prompt: Vec<u32> = (0..10).collect();
    let r = req(1, &prompt, 3);
    let h = r.hashes.clone();
    e.submit(r, 0).unwrap();
    let end = run(&mut e, 0, &mut out);
    // Step 1 (0 -> 8,100): 8 prefill tokens; blocks 0 and 1 complete.
    // Step 2 (-> 10,200): the last 2 tokens; the first token comes out.
    // Step 3 (-> 10,311): decode over 11 context tokens.
    // Step 4 (-> 10,423): decode over 12; the third token: finished.
    assert_eq!(
        out.completions,
        vec![
            Completion::FirstToken {
                id: 1,
                at_us: 10_200,
                cached_tokens: 0
            },
            Completion::Finished {
                id: 1,
                at_us: 10_423
            },
        ]
    );
    assert_eq!(end, 10_423);
    assert_eq!(e.steps(), 4);
    assert_eq!(
        out.events,
        vec![KvEvent::Stored {
            tier: Tier::Device,
            parent: None,
            hashes: h.clone()
        }]
    );
    let loads: Vec<u64> = out.loads.iter().map(|l| l.timestamp_ns / 1000).collect();
    assert_eq!(loads, vec![8_100, 10_200, 10_311, 10_423]);
    assert_eq!(out.loads[0].active_prefill_tokens, 2);
    assert_eq!(out.loads[3].active_requests, 0);

    // The same prompt later: both full blocks hit (8 tokens); 2 remain.
    out.clear();
    e.submit(req(2, &prompt, 1), 20_000).unwrap();
    run(&mut e, 20_000, &mut out);
    assert_eq!(
        out.completions[0],
        Completion::FirstToken {
            id: 2,
            at_us: 20_000 + 100 + 2_000,
            cached_tokens: 8
        }
    );
    assert!(out.events.is_empty(), "nothing new to publish");
}

#[test]
fn a_fully_cached_prompt_still_computes_its_last_token() {
    let mut e = EngineModel::new(params(16, 0));
    let mut out = Outputs::default();
    let prompt: Vec<u32> = (0..8).collect(); // exactly two blocks
    e.submit(req(1, &prompt, 1), 0).unwrap();
    run(&mut e, 0, &mut out);
    out.clear();
    e.submit(req(2, &prompt, 1), 50_000).unwrap();
    run(&mut e, 50_000, &mut out);
    // (8 - 1) / 4 = 1 block may be reused; 4 tokens are computed.
    assert_eq!(
        out.completions[0],
        Completion::FirstToken {
            id: 2,
            at_us: 50_000 + 100 + 4_000,
            cached_tokens: 4
        }
    );
}

#[test]
fn eviction_takes_the_least_recently_used_block_tail_first() {
    // 4 blocks. A holds a0 a1 (+1 decode block while running).
    let mut e = EngineModel::new(params(4, 0));
    let mut out = Outputs::default();
    let a: Vec<u32> = (0..8).collect();
    let ra = req(1, &a, 1);
    let ha = ra.hashes.clone();
    e.submit(ra, 0).unwrap();
    let t = run(&mut e, 0, &mut out);
    // A finished: its blocks return tail first, so a1 is older than a0 in
    // the LRU and goes first. C needs 3 blocks: 2 free, then a1.
    out.clear();
    let c: Vec<u32> = (100..108).collect();
    e.submit(req(2, &c, 1), t).unwrap();
    run(&mut e, t, &mut out);
    assert_eq!(
        out.events[0],
        KvEvent::Removed {
            tier: Tier::Device,
            hashes: vec![ha[1]]
        }
    );
    let mut cached: Vec<u64> = e.device_hashes().collect();
    cached.sort_unstable();
    let mut expect = vec![ha[0]];
    expect.extend(kvedge_schema::hash::sequence_hashes(&c, 4, None, None));
    expect.sort_unstable();
    assert_eq!(cached, expect);
    // A's prompt again: a0 still hits (4 cached tokens), a1 does not.
    out.clear();
    e.submit(req(3, &a, 1), 1_000_000).unwrap();
    run(&mut e, 1_000_000, &mut out);
    assert!(matches!(
        out.completions[0],
        Completion::FirstToken {
            cached_tokens: 4,
            ..
        }
    ));
}

#[test]
fn identical_concurrent_prompts_publish_their_blocks_once() {
    let mut e = EngineModel::new(params(16, 0));
    let mut out = Outputs::default();
    let p: Vec<u32> = vec![0, 1, 2, 3, 9]; // 5 tokens: 1 full block
    e.submit(req(1, &p, 1), 0).unwrap();
    e.submit(req(2, &p, 1), 0).unwrap();
    run(&mut e, 0, &mut out);
    let stored: usize = out
        .events
        .iter()
        .map(|e| match e {
            KvEvent::Stored { hashes, .. } => hashes.len(),
            KvEvent::Removed { .. } => 0,
        })
        .sum();
    assert_eq!(stored, 1);
    // Both ran in the first step (budget 8 = 5 + 3), so neither hit.
    let hits: Vec<u32> = out
        .completions
        .iter()
        .filter_map(|c| match c {
            Completion::FirstToken { cached_tokens, .. } => Some(*cached_tokens),
            Completion::Token { .. } | Completion::Finished { .. } => None,
        })
        .collect();
    assert_eq!(hits, vec![0, 0]);
}

#[test]
fn a_stored_event_names_the_block_right_before_its_first() {
    // Each Stored event's parent is the block right before its first hash,
    // and its hashes are a chain, so a consumer hashing from the parent (as
    // kvedge's bridge does) gets every block's prefix right.
    let mut e = EngineModel::new(params(16, 0));
    let mut out = Outputs::default();
    // Both start in the first step (A 5 tokens, B 3 of the budget 8); A
    // completes the shared block first, B then skips it and caches its
    // second block, whose parent is that shared block.
    let a: Vec<u32> = vec![0, 1, 2, 3, 9];
    let b: Vec<u32> = (0..13).collect();
    let (ra, rb) = (req(1, &a, 1), req(2, &b, 1));
    let mut before = std::collections::HashMap::new();
    for hashes in [&ra.hashes, &rb.hashes] {
        for (k, &h) in hashes.iter().enumerate() {
            before.insert(h, k.checked_sub(1).map(|p| hashes[p]));
        }
    }
    e.submit(ra, 0).unwrap();
    e.submit(rb, 0).unwrap();
    run(&mut e, 0, &mut out);
    let mut published = 0;
    for ev in &out.events {
        if let KvEvent::Stored { parent, hashes, .. } = ev {
            let mut expect = *parent;
            for &h in hashes {
                assert_eq!(before[&h], expect, "{:?}", out.events);
                expect = Some(h);
            }
            published += hashes.len();
        }
    }
    // The shared block once and B's two others.
    assert_eq!(published, 3, "{:?}", out.events);
}

#[test]
fn the_host_tier_takes_evicted_blocks_and_serves_hits() {
    let mut e = EngineModel::new(params(4, 8));
    let mut out = Outputs::default();
    let a: Vec<u32> = (0..9).collect(); // a0 a1 + 1 token
    let ha = req(1, &a, 1).hashes;
    e.submit(req(1, &a, 1), 0).unwrap();
    let t = run(&mut e, 0, &mut out);
    out.clear();
    let c: Vec<u32> = (100..108).collect();
    e.submit(req(2, &c, 1), t).unwrap();
    let t = run(&mut e, t, &mut out);
    // a1's device block was evicted (and the unhashed tail was free):
    // Removed from the device, Stored on the host.
    assert_eq!(
        &out.events[..2],
        &[
            KvEvent::Removed {
                tier: Tier::Device,
                hashes: vec![ha[1]]
            },
            KvEvent::Stored {
                tier: Tier::Host,
                parent: None,
                hashes: vec![ha[1]]
            },
        ]
    );
    assert_eq!(e.host_hashes().collect::<Vec<_>>(), vec![ha[1]]);
    // A again: a0 from the device, a1 from the host: 8 cached tokens; the
    // step pays 4 host tokens at 4,000/s (1 ms) and 1 prefill token (1 ms).
    out.clear();
    e.submit(req(3, &a, 1), t + 10).unwrap();
    run(&mut e, t + 10, &mut out);
    let first = out
        .completions
        .iter()
        .find(|c| matches!(c, Completion::FirstToken { .. }))
        .unwrap();
    assert_eq!(
        *first,
        Completion::FirstToken {
            id: 3,
            at_us: t + 10 + 100 + 1_000 + 1_000,
            cached_tokens: 8
        }
    );
}

#[test]
fn bad_requests_are_refused_and_change_nothing() {
    let mut e = EngineModel::new(params(4, 0));
    let long: Vec<u32> = (0..40).collect();
    assert!(matches!(
        e.submit(req(1, &long, 1), 0),
        Err(SubmitError::TooLong { .. })
    ));
    let mut bad = req(2, &[1, 2, 3, 4, 5], 1);
    bad.hashes.clear();
    assert!(matches!(e.submit(bad, 0), Err(SubmitError::BadHashes(..))));
    assert!(matches!(
        e.submit(req(3, &[], 1), 0),
        Err(SubmitError::EmptyPrompt(3))
    ));
    e.submit(req(4, &[1, 2], 1), 0).unwrap();
    assert_eq!(
        e.submit(req(4, &[1, 2], 1), 0),
        Err(SubmitError::Duplicate(4))
    );
    assert!(!e.is_idle());
    let mut out = Outputs::default();
    run(&mut e, 0, &mut out);
    assert!(e.is_idle());
    assert_eq!(out.completions.len(), 2);
}
