//! `kvedge top`: a live view of a running daemon, over its query socket.
//! Each refresh asks the documented ops `workers`, `stats`, `metrics` and
//! `decisions` (docs/daemon.md) and shows one row per worker (state, sync,
//! queue, running requests, KV usage, blocks indexed, hit rate, picks a
//! second, standing notices) under the daemon's totals (decisions a
//! second, decision latency, hit rate, rejects by reason), and the most
//! recent decisions with the stage and rule that made each. Rates come
//! from two samples. `--once` prints one frame as plain text (for scripts and
//! tests); otherwise the view is drawn with ratatui until `q`, Esc or
//! Ctrl-C, and the terminal is given back as it was.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use serde_json::Value;

/// What one refresh read from the daemon.
#[derive(Debug, Clone)]
pub struct Sample {
    pub at: Instant,
    pub workers: Value,
    pub stats: Value,
    /// `kvedge_selections_total` summed by outcome.
    pub outcomes: BTreeMap<String, u64>,
    /// The `decisions` op's rows, newest first.
    pub decisions: Vec<Value>,
}

impl Sample {
    /// Reads a sample with `ask` (one op's JSON reply); the first error
    /// reply is returned as its message.
    pub fn read(mut ask: impl FnMut(&str) -> Value) -> Result<Sample, String> {
        let mut get = |op: &str| {
            let v = ask(op);
            match v.get("error") {
                Some(e) => Err(format!(
                    "{}: {}",
                    e["code"].as_str().unwrap_or("error"),
                    e["message"].as_str().unwrap_or("")
                )),
                None => Ok(v),
            }
        };
        let workers = get("workers")?;
        let stats = get("stats")?;
        let metrics = get("metrics")?;
        let decisions = get("decisions")?;
        Ok(Sample {
            at: Instant::now(),
            workers,
            stats,
            outcomes: outcomes(metrics["text"].as_str().unwrap_or("")),
            decisions: decisions["decisions"]
                .as_array()
                .cloned()
                .unwrap_or_default(),
        })
    }
}

/// `kvedge_selections_total` of the exposition text, summed by outcome.
fn outcomes(text: &str) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("kvedge_selections_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let outcome = labels
            .split(',')
            .find_map(|l| l.strip_prefix("outcome=\""))
            .map(|o| o.trim_end_matches('"'));
        if let (Some(o), Ok(n)) = (outcome, value.trim().parse::<f64>()) {
            *out.entry(o.to_owned()).or_default() += n as u64;
        }
    }
    out
}

/// How rows are ordered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum SortBy {
    /// Worker id and rank.
    #[default]
    Worker,
    /// Picks a second, most first.
    Picks,
    /// Queued requests, most first.
    Queue,
    /// Hit rate, highest first.
    Hit,
    /// KV usage, fullest first.
    Kv,
}

impl SortBy {
    fn next(self) -> SortBy {
        match self {
            SortBy::Worker => SortBy::Picks,
            SortBy::Picks => SortBy::Queue,
            SortBy::Queue => SortBy::Hit,
            SortBy::Hit => SortBy::Kv,
            SortBy::Kv => SortBy::Worker,
        }
    }

    fn name(self) -> &'static str {
        match self {
            SortBy::Worker => "worker",
            SortBy::Picks => "picks/s",
            SortBy::Queue => "queue",
            SortBy::Hit => "hit",
            SortBy::Kv => "kv",
        }
    }
}

/// One worker's row.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub worker_id: u64,
    pub dp_rank: u64,
    pub model: String,
    /// `live`, `resyncing`, ... and `out` when not available for routing.
    pub state: String,
    pub in_sync: bool,
    pub queue: u64,
    pub running: u64,
    /// KV blocks in use over all, when the engine reports them.
    pub kv_usage: Option<f64>,
    pub blocks: u64,
    /// Cached over prompt blocks of its picks since it registered.
    pub hit: Option<f64>,
    pub picks_per_s: f64,
    /// The codes of its standing notices.
    pub notices: Vec<String>,
}

/// The daemon's totals.
#[derive(Debug, Clone, PartialEq)]
pub struct Totals {
    pub workers: usize,
    pub live: usize,
    pub decisions_per_s: f64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub hit: Option<f64>,
    /// Rejected selections since the daemon started, by outcome.
    pub rejects: BTreeMap<String, u64>,
}

/// One frame: the totals and the rows, filtered and sorted, and the
/// most recent decisions.
#[derive(Debug, Clone, PartialEq)]
pub struct View {
    pub totals: Totals,
    pub rows: Vec<Row>,
    pub decisions: Vec<Value>,
}

/// How many recent decisions a frame shows.
pub const DECISIONS_SHOWN: usize = 10;

fn ratio(num: u64, den: u64) -> Option<f64> {
    (den > 0).then(|| num as f64 / den as f64)
}

impl View {
    /// The frame of `cur`, its rates measured since `prev` (none without
    /// it), showing the workers whose model contains `filter`.
    pub fn new(prev: Option<&Sample>, cur: &Sample, sort: SortBy, filter: &str) -> View {
        let secs = prev
            .map(|p| cur.at.duration_since(p.at).as_secs_f64())
            .filter(|s| *s > 0.0);
        let list = |s: &Sample| s.workers["workers"].as_array().cloned().unwrap_or_default();
        let before: BTreeMap<(u64, u64), u64> = prev
            .map(|p| {
                list(p)
                    .iter()
                    .map(|w| (key(w), w["picks"].as_u64().unwrap_or(0)))
                    .collect()
            })
            .unwrap_or_default();
        let workers = list(cur);
        let (mut cached, mut prompt) = (0, 0);
        let mut rows: Vec<Row> = Vec::new();
        for w in &workers {
            let n = |k: &str| w[k].as_u64().unwrap_or(0);
            cached += n("picked_cached_blocks");
            prompt += n("picked_prompt_blocks");
            let model = w["model"].as_str().unwrap_or("").to_owned();
            if !model.contains(filter) {
                continue;
            }
            let picks_per_s = match (secs, before.get(&key(w))) {
                (Some(s), Some(&b)) => n("picks").saturating_sub(b) as f64 / s,
                _ => 0.0,
            };
            let state = w["state"].as_str().unwrap_or("");
            rows.push(Row {
                worker_id: n("worker_id"),
                dp_rank: n("dp_rank"),
                model,
                state: if w["available"] == true {
                    state.to_owned()
                } else {
                    "out".to_owned()
                },
                in_sync: state == "live",
                queue: n("waiting_requests"),
                running: n("active_requests"),
                kv_usage: ratio(n("kv_used_blocks"), n("kv_total_blocks")),
                blocks: n("device_blocks"),
                hit: ratio(n("picked_cached_blocks"), n("picked_prompt_blocks")),
                picks_per_s,
                notices: w["notices"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|x| x["active"] == true)
                    .filter_map(|x| x["code"].as_str().map(str::to_owned))
                    .collect(),
            });
        }
        let desc = |a: f64, b: f64| b.partial_cmp(&a).unwrap_or(std::cmp::Ordering::Equal);
        rows.sort_by(|a, b| {
            let order = match sort {
                SortBy::Worker => std::cmp::Ordering::Equal,
                SortBy::Picks => desc(a.picks_per_s, b.picks_per_s),
                SortBy::Queue => b.queue.cmp(&a.queue),
                SortBy::Hit => desc(a.hit.unwrap_or(-1.0), b.hit.unwrap_or(-1.0)),
                SortBy::Kv => desc(a.kv_usage.unwrap_or(-1.0), b.kv_usage.unwrap_or(-1.0)),
            };
            order.then((a.worker_id, a.dp_rank).cmp(&(b.worker_id, b.dp_rank)))
        });
        let selects = |s: &Sample| s.stats["selects"].as_u64().unwrap_or(0);
        let decisions_per_s = match (secs, prev) {
            (Some(s), Some(p)) => selects(cur).saturating_sub(selects(p)) as f64 / s,
            _ => 0.0,
        };
        let latency = &cur.stats["select_latency"];
        View {
            totals: Totals {
                workers: workers.len(),
                live: workers.iter().filter(|w| w["available"] == true).count(),
                decisions_per_s,
                p50_us: latency["p50_us"].as_f64().unwrap_or(0.0),
                p99_us: latency["p99_us"].as_f64().unwrap_or(0.0),
                hit: ratio(cached, prompt),
                rejects: cur
                    .outcomes
                    .iter()
                    .filter(|(o, n)| o.as_str() != "ok" && **n > 0)
                    .map(|(o, n)| (o.clone(), *n))
                    .collect(),
            },
            rows,
            decisions: cur
                .decisions
                .iter()
                .take(DECISIONS_SHOWN)
                .cloned()
                .collect(),
        }
    }

    /// The recent decisions' column names and cells.
    pub fn decisions_table(&self) -> (Vec<&'static str>, Vec<Vec<String>>) {
        let header = vec![
            "age",
            "outcome",
            "chosen",
            "stage",
            "by",
            "tier",
            "cached",
            "sharers",
            "candidates",
        ];
        let text = crate::human::text;
        let cells = self
            .decisions
            .iter()
            .map(|d| {
                let chosen = if !d["provider"].is_null() {
                    format!("provider {}", text(&d["provider"]))
                } else if d["worker_id"].is_null() {
                    "-".to_owned()
                } else {
                    format!("{}/{}", text(&d["worker_id"]), text(&d["dp_rank"]))
                };
                let by = if d["stage"] == "rule" {
                    text(&d["rule"])
                } else {
                    text(&d["policy"])
                };
                vec![
                    format!("{:.1} s", d["age_ms"].as_f64().unwrap_or(0.0) / 1000.0),
                    format!(
                        "{}{}",
                        text(&d["outcome"]),
                        if d["dry_run"] == true {
                            " (dry run)"
                        } else {
                            ""
                        }
                    ),
                    chosen,
                    text(&d["stage"]),
                    by,
                    text(&d["tier"]),
                    format!(
                        "{}/{}",
                        text(&d["overlap_blocks"]),
                        text(&d["prompt_blocks"])
                    ),
                    text(&d["prefix_sharers"]),
                    format!(
                        "{} ({} left)",
                        text(&d["candidates"]),
                        text(&d["survivors"])
                    ),
                ]
            })
            .collect();
        (header, cells)
    }

    /// The totals as one line.
    pub fn summary(&self) -> String {
        let t = &self.totals;
        let rejects = if t.rejects.is_empty() {
            "none".to_owned()
        } else {
            t.rejects
                .iter()
                .map(|(o, n)| format!("{o} {n}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        format!(
            "workers {} ({} live)   decisions {:.1}/s   decision p50 {:.0} µs, p99 {:.0} µs   hit {}   rejects: {}",
            t.workers,
            t.live,
            t.decisions_per_s,
            t.p50_us,
            t.p99_us,
            percent(t.hit),
            rejects
        )
    }

    /// The column names and each row's cells.
    pub fn table(&self) -> (Vec<&'static str>, Vec<Vec<String>>) {
        let header = vec![
            "worker", "model", "state", "sync", "queue", "running", "kv", "blocks", "hit",
            "picks/s", "notices",
        ];
        let cells = self
            .rows
            .iter()
            .map(|r| {
                vec![
                    format!("{}/{}", r.worker_id, r.dp_rank),
                    r.model.clone(),
                    r.state.clone(),
                    if r.in_sync { "ok" } else { "no" }.to_owned(),
                    r.queue.to_string(),
                    r.running.to_string(),
                    percent(r.kv_usage),
                    r.blocks.to_string(),
                    percent(r.hit),
                    format!("{:.1}", r.picks_per_s),
                    if r.notices.is_empty() {
                        "-".to_owned()
                    } else {
                        r.notices.join(",")
                    },
                ]
            })
            .collect();
        (header, cells)
    }

    /// The frame as plain text (`--once`).
    pub fn text(&self) -> String {
        let mut out = format!("kvedge top   {}\n", self.summary());
        let (header, cells) = self.table();
        columns(&mut out, &header, &cells);
        out.push_str("\nrecent decisions\n");
        let (header, cells) = self.decisions_table();
        columns(&mut out, &header, &cells);
        out
    }
}

/// `cells` under `header`, each column as wide as its widest cell.
fn columns(out: &mut String, header: &[&str], cells: &[Vec<String>]) {
    let widths: Vec<usize> = (0..header.len())
        .map(|i| {
            cells
                .iter()
                .map(|r| r[i].chars().count())
                .chain([header[i].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut line = |row: &[String]| {
        let mut l = String::new();
        for (i, c) in row.iter().enumerate() {
            let _ = write!(l, "{c:<w$}  ", w = widths[i]);
        }
        out.push_str(l.trim_end());
        out.push('\n');
    };
    line(&header.iter().map(|h| (*h).to_owned()).collect::<Vec<_>>());
    for r in cells {
        line(r);
    }
}

fn key(w: &Value) -> (u64, u64) {
    (
        w["worker_id"].as_u64().unwrap_or(0),
        w["dp_rank"].as_u64().unwrap_or(0),
    )
}

fn percent(x: Option<f64>) -> String {
    x.map_or("-".to_owned(), |x| format!("{:.1} %", x * 100.0))
}

/// Prints one frame: two samples `interval` apart.
pub fn once(
    mut ask: impl FnMut(&str) -> Value,
    interval: Duration,
    sort: SortBy,
    filter: &str,
) -> Result<String, String> {
    let first = Sample::read(&mut ask)?;
    std::thread::sleep(interval);
    let second = Sample::read(&mut ask)?;
    Ok(View::new(Some(&first), &second, sort, filter).text())
}

/// The live view until the user quits.
pub fn live(
    mut ask: impl FnMut(&str) -> Value,
    interval: Duration,
    mut sort: SortBy,
    mut filter: String,
) -> Result<(), String> {
    use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
    use ratatui::layout::{Constraint, Layout};
    use ratatui::style::{Modifier, Style};
    use ratatui::widgets::{Block, Borders, Cell, Paragraph, Row as TableRow, Table};

    // Fails before the terminal is touched when the daemon is not there.
    let mut prev: Option<Sample> = None;
    let mut cur = Sample::read(&mut ask)?;
    let mut terminal = ratatui::init();
    let mut editing = false;
    let mut error: Option<String> = None;
    let mut next = Instant::now() + interval;
    let outcome = loop {
        let view = View::new(prev.as_ref(), &cur, sort, &filter);
        let drawn = terminal.draw(|f| {
            let [top, table, recent, footer] = Layout::vertical([
                Constraint::Length(3),
                Constraint::Min(3),
                Constraint::Length(DECISIONS_SHOWN as u16 + 3),
                Constraint::Length(1),
            ])
            .areas(f.area());
            let summary = error
                .as_deref()
                .map_or_else(|| view.summary(), str::to_owned);
            f.render_widget(
                Paragraph::new(summary)
                    .block(Block::default().borders(Borders::ALL).title(" kvedge top ")),
                top,
            );
            let draw_table = |f: &mut ratatui::Frame<'_>,
                              (header, cells): (Vec<&'static str>, Vec<Vec<String>>),
                              title: &'static str,
                              area| {
                let widths: Vec<Constraint> = header
                    .iter()
                    .enumerate()
                    .map(|(i, h)| {
                        let w = cells
                            .iter()
                            .map(|r| r[i].chars().count())
                            .chain([h.len()])
                            .max()
                            .unwrap_or(4);
                        Constraint::Length(w as u16 + 1)
                    })
                    .collect();
                let rows = cells
                    .into_iter()
                    .map(|r| TableRow::new(r.into_iter().map(Cell::from)));
                f.render_widget(
                    Table::new(rows, widths)
                        .header(
                            TableRow::new(header.into_iter().map(Cell::from))
                                .style(Style::default().add_modifier(Modifier::BOLD)),
                        )
                        .block(Block::default().borders(Borders::ALL).title(title)),
                    area,
                );
            };
            draw_table(f, view.table(), " workers ", table);
            draw_table(f, view.decisions_table(), " recent decisions ", recent);
            let help = if editing {
                format!("model filter: {filter}_   (Enter: done, Esc: clear)")
            } else {
                format!(
                    "q quit   s sort ({})   / filter by model{}",
                    sort.name(),
                    if filter.is_empty() {
                        String::new()
                    } else {
                        format!(" ({filter})")
                    }
                )
            };
            f.render_widget(Paragraph::new(help), footer);
        });
        if let Err(e) = drawn {
            break Err(e.to_string());
        }
        let wait = next.saturating_duration_since(Instant::now());
        match event::poll(wait) {
            Ok(true) => match event::read() {
                Ok(Event::Key(k)) if k.kind == KeyEventKind::Press => {
                    let ctrl_c =
                        k.code == KeyCode::Char('c') && k.modifiers.contains(KeyModifiers::CONTROL);
                    if ctrl_c {
                        break Ok(());
                    }
                    if editing {
                        match k.code {
                            KeyCode::Enter => editing = false,
                            KeyCode::Esc => {
                                editing = false;
                                filter.clear();
                            }
                            KeyCode::Backspace => {
                                filter.pop();
                            }
                            KeyCode::Char(c) if filter.len() < 64 => filter.push(c),
                            _ => {}
                        }
                        continue;
                    }
                    match k.code {
                        KeyCode::Char('q') | KeyCode::Esc => break Ok(()),
                        KeyCode::Char('s') => sort = sort.next(),
                        KeyCode::Char('/') => editing = true,
                        _ => {}
                    }
                }
                Ok(_) => {}
                Err(e) => break Err(e.to_string()),
            },
            Ok(false) => {
                next = Instant::now() + interval;
                match Sample::read(&mut ask) {
                    Ok(s) => {
                        prev = Some(std::mem::replace(&mut cur, s));
                        error = None;
                    }
                    // Shown in place of the totals; the view goes on
                    // trying (a restarting daemon comes back).
                    Err(e) => error = Some(format!("the daemon did not answer: {e}")),
                }
            }
            Err(e) => break Err(e.to_string()),
        }
    };
    ratatui::restore();
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sample(at: Instant, picks: [u64; 2], selects: u64) -> Sample {
        let worker = |id: u64, picks: u64, waiting: u64, available: bool| {
            json!({"worker_id": id, "dp_rank": 0, "model": if id == 1 { "llama" } else { "qwen" },
                   "state": "live", "available": available, "waiting_requests": waiting,
                   "active_requests": 2, "kv_used_blocks": 25, "kv_total_blocks": 100,
                   "device_blocks": 40 * id, "picks": picks, "picked_prompt_blocks": 10 * picks,
                   "picked_cached_blocks": 8 * picks,
                   "notices": [{"code": "load_unreadable", "active": !available},
                               {"code": "replayed", "active": false}]})
        };
        Sample {
            at,
            workers: json!({"workers": [worker(1, picks[0], 0, true), worker(2, picks[1], 5, false)]}),
            stats: json!({"selects": selects, "select_latency": {"p50_us": 12.0, "p99_us": 40.0}}),
            decisions: vec![
                json!({"age_ms": 1500, "worker_id": 2, "dp_rank": 0, "provider": null,
                       "outcome": "ok", "stage": "rule", "rule": "agents", "policy": "default",
                       "tier": 0, "overlap_blocks": 3, "prompt_blocks": 4, "prefix_sharers": 5, "candidates": 2,
                       "survivors": 1, "dry_run": false}),
                json!({"age_ms": 2000, "worker_id": null, "dp_rank": null, "provider": null,
                       "outcome": "no_worker", "stage": "policy", "rule": null,
                       "policy": "default", "tier": null, "overlap_blocks": 0,
                       "prompt_blocks": 1, "candidates": 0, "survivors": 0, "dry_run": true}),
            ],
            outcomes: outcomes(
                "kvedge_selections_total{policy=\"default\",rule=\"\",outcome=\"ok\"} 9\n\
                 kvedge_selections_total{policy=\"default\",rule=\"\",outcome=\"no_worker\"} 2\n\
                 kvedge_selections_total{policy=\"x\",rule=\"r\",outcome=\"no_worker\"} 1\n\
                 kvedge_selections{foo=\"bar\"} 4\n",
            ),
        }
    }

    #[test]
    fn a_frame_shows_rates_between_two_samples_and_sorts_and_filters() {
        let t0 = Instant::now();
        let a = sample(t0, [10, 0], 100);
        let b = sample(t0 + Duration::from_secs(2), [30, 4], 124);
        let v = View::new(Some(&a), &b, SortBy::Worker, "");
        assert_eq!(v.totals.decisions_per_s, 12.0);
        assert_eq!((v.totals.workers, v.totals.live), (2, 1));
        assert_eq!(v.totals.hit, Some(0.8));
        assert_eq!(v.totals.rejects, BTreeMap::from([("no_worker".into(), 3)]));
        assert_eq!(v.rows[0].picks_per_s, 10.0);
        assert_eq!(v.rows[1].picks_per_s, 2.0);
        assert_eq!(v.rows[1].state, "out");
        assert_eq!(v.rows[1].notices, ["load_unreadable"]);
        assert!(
            v.rows[0].notices.is_empty(),
            "a notice that is over is not shown"
        );
        assert_eq!(v.rows[0].kv_usage, Some(0.25));
        // Sorted by queue, the queued worker first; filtered by model.
        let q = View::new(Some(&a), &b, SortBy::Queue, "");
        assert_eq!(q.rows[0].worker_id, 2);
        let f = View::new(Some(&a), &b, SortBy::Worker, "qwen");
        assert_eq!(f.rows.len(), 1);
        assert_eq!(
            f.totals.workers, 2,
            "totals are the daemon's, not the filter's"
        );
        let text = v.text();
        assert!(text.contains("decisions 12.0/s"), "{text}");
        assert!(text.contains("rejects: no_worker 3"), "{text}");
        let recent = text.split("recent decisions\n").nth(1).unwrap();
        let first: Vec<&str> = recent.lines().nth(1).unwrap().split_whitespace().collect();
        assert_eq!(
            first,
            [
                "1.5", "s", "ok", "2/0", "rule", "agents", "0", "3/4", "5", "2", "(1", "left)"
            ]
        );
        assert!(recent.contains("no_worker (dry run)"), "{recent}");
        let line = text.lines().find(|l| l.starts_with("2/0")).unwrap();
        let cells: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(cells[..6], ["2/0", "qwen", "out", "ok", "5", "2"], "{text}");
    }

    #[test]
    fn without_a_previous_sample_rates_are_zero() {
        let v = View::new(None, &sample(Instant::now(), [3, 3], 7), SortBy::Picks, "");
        assert_eq!(v.totals.decisions_per_s, 0.0);
        assert!(v.rows.iter().all(|r| r.picks_per_s == 0.0));
    }
}
