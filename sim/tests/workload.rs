//! Workloads: the Mooncake reader (token expansion, shared prefixes,
//! errors with line numbers), the synthetic generator's determinism and
//! shape, and the oracle bound.

#![forbid(unsafe_code)]

use kvedge_sim::workload::{
    Arrivals, MOONCAKE_BLOCK, SyntheticParams, TraceError, mooncake_block_tokens, oracle_hit_rate,
    read_mooncake, synthetic,
};

const TRACE: &str = r#"{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]}
{"timestamp": 250, "input_length": 1500, "output_length": 7, "hash_ids": [1, 2, 3]}

{"timestamp": 100, "input_length": 512, "output_length": 1, "hash_ids": [9]}
"#;

#[test]
fn mooncake_ids_expand_to_shared_token_prefixes() {
    let r = read_mooncake("t.jsonl", TRACE.as_bytes(), 2.0, 16).unwrap();
    // Sorted by arrival; times scaled by 2, in µs.
    let arrivals: Vec<u64> = r.iter().map(|x| x.arrival_us).collect();
    assert_eq!(arrivals, vec![0, 200_000, 500_000]);
    let (a, b) = (&r[0], &r[2]);
    assert_eq!((a.prompt_tokens(), b.prompt_tokens()), (1000, 1500));
    assert_eq!((a.output_tokens, b.output_tokens), (5, 7));
    // Equal leading ids -> equal tokens -> equal sequence hashes: a's
    // first 1000 tokens are b's first 1000, so its 62 full blocks match.
    assert_eq!(&b.tokens[..1000], &a.tokens[..]);
    assert_eq!(a.hashes.len(), 62);
    assert_eq!(&b.hashes[..62], &a.hashes[..]);
    // Different ids differ.
    let mut one = Vec::new();
    let mut nine = Vec::new();
    mooncake_block_tokens(1, &mut one);
    mooncake_block_tokens(9, &mut nine);
    assert_eq!(one.len(), MOONCAKE_BLOCK);
    assert_ne!(one, nine);
    assert_eq!(&r[1].tokens[..], &nine[..]);
}

#[test]
fn mooncake_errors_name_the_line() {
    let bad =
        "{\"timestamp\": 0, \"input_length\": 1000, \"output_length\": 5, \"hash_ids\": [1]}\n";
    match read_mooncake("t.jsonl", bad.as_bytes(), 1.0, 16) {
        Err(TraceError::Line { line, message, .. }) => {
            assert_eq!(line, 1);
            assert!(
                message.contains("1 hash_ids for input_length 1000"),
                "{message}"
            );
        }
        other => panic!("{other:?}"),
    }
    let garbage = "{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}\nnot json\n";
    assert!(matches!(
        read_mooncake("t.jsonl", garbage.as_bytes(), 1.0, 16),
        Err(TraceError::Line { line: 2, .. })
    ));
    assert!(matches!(
        read_mooncake("t.jsonl", "\n".as_bytes(), 1.0, 16),
        Err(TraceError::Empty { .. })
    ));
}

#[test]
fn synthetic_workloads_are_deterministic_per_seed() {
    let p = SyntheticParams {
        requests: 300,
        ..SyntheticParams::default()
    };
    let a = synthetic(&p);
    assert_eq!(a, synthetic(&p));
    let other = synthetic(&SyntheticParams {
        seed: 2,
        ..p.clone()
    });
    assert_ne!(a, other);
    assert_eq!(a.len(), 300);
    // Arrivals increase; the mean rate is near the asked one.
    assert!(a.windows(2).all(|w| w[0].arrival_us <= w[1].arrival_us));
    let span = a.last().unwrap().arrival_us as f64 / 1e6;
    let rate = 300.0 / span;
    assert!((8.0..18.0).contains(&rate), "{rate} req/s for 12 asked");
    // Follow-up turns extend their session's previous prompt.
    let mut follow_ups = 0;
    for (i, r) in a.iter().enumerate() {
        if let Some(prev) = a[..i].iter().rev().find(|p| p.session == r.session) {
            assert!(r.tokens.starts_with(&prev.tokens));
            follow_ups += 1;
        }
    }
    assert!(follow_ups > 100, "{follow_ups}");
    assert!(a.iter().any(|r| r.tool_result));
    let bursty = synthetic(&SyntheticParams {
        arrivals: Arrivals::Bursty,
        ..p
    });
    assert_eq!(bursty.len(), 300);
}

#[test]
fn the_oracle_counts_prefixes_seen_before() {
    let r = read_mooncake("t.jsonl", TRACE.as_bytes(), 1.0, 16).unwrap();
    // Request 1: nothing seen. Request 2 (id 9): nothing. Request 3: the
    // 62 blocks (992 tokens) of request 1.
    let expected = 992.0 / (1000.0 + 512.0 + 1500.0);
    assert!((oracle_hit_rate(&r, 16) - expected).abs() < 1e-12);
}

#[test]
fn the_bundled_mooncake_trace_reads_whole() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../testdata/mooncake/synthetic_trace.jsonl"
    );
    let file = std::fs::File::open(path).unwrap();
    let r = read_mooncake(path, std::io::BufReader::new(file), 1.0, 16).unwrap();
    assert_eq!(r.len(), 3993);
    let last = r.last().unwrap().arrival_us;
    assert!((1_000_000_000..1_100_000_000).contains(&last), "{last}");
    // Requests share prefixes: the oracle finds a hit rate to win.
    assert!(oracle_hit_rate(&r, 16) > 0.5);
}
