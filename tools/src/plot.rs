//! The PNG charts of `kvedge sim --plot DIR`: prefix hit rate per policy
//! (with the oracle bound), TTFT percentiles per policy, and each policy's
//! active requests per worker over time. Drawn with plotters' bitmap
//! backend and a bundled font, so no system library is needed.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;
use plotters::style::FontStyle;

use crate::sim::Run;

const FONT_BYTES: &[u8] = include_bytes!("../assets/DejaVuSansMono.ttf");
const FONT: &str = "sans-serif";

fn register_font() -> Result<(), String> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        plotters::style::register_font(FONT, FontStyle::Normal, FONT_BYTES)
            .map_err(|_| "the bundled font is invalid".to_owned())
    })
    .clone()
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// Writes `hit_rate.png`, `ttft.png` and `load-POLICY.png` for every run
/// into `dir` (created if missing); returns the files written.
pub fn write_charts(dir: &Path, runs: &[Run], oracle: f64) -> Result<Vec<PathBuf>, String> {
    register_font()?;
    std::fs::create_dir_all(dir).map_err(err)?;
    let mut files = Vec::new();
    let names: Vec<String> = runs.iter().map(|r| r.summary.policy.clone()).collect();

    let path = dir.join("hit_rate.png");
    let hits: Vec<[f64; 1]> = runs.iter().map(|r| [r.summary.hit_rate * 100.0]).collect();
    bars(
        &path,
        "Prefix-cache hit rate (cached / prompt tokens)",
        "hit %",
        &names,
        &hits,
        &["hit rate"],
        Some(("oracle", oracle * 100.0)),
        Axis::Linear,
    )?;
    files.push(path);

    let path = dir.join("ttft.png");
    let ttft: Vec<[f64; 3]> = runs
        .iter()
        .map(|r| {
            [
                r.summary.ttft_ms_p50,
                r.summary.ttft_ms_p90,
                r.summary.ttft_ms_p99,
            ]
        })
        .collect();
    // A log axis: TTFT spans orders of magnitude between policies (and
    // between p50 and p99), and a linear one hides the small bars.
    bars(
        &path,
        "Time to first token (log scale)",
        "ms",
        &names,
        &ttft,
        &["p50", "p90", "p99"],
        None,
        Axis::Log,
    )?;
    files.push(path);

    for r in runs {
        let safe: String = r
            .summary
            .policy
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let path = dir.join(format!("load-{safe}.png"));
        load_over_time(&path, &r.summary.policy, &r.load_samples)?;
        files.push(path);
    }
    Ok(files)
}

const SERIES: [RGBColor; 4] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
];

/// The value axis of a bar chart.
#[derive(Clone, Copy)]
enum Axis {
    Linear,
    Log,
}

/// Horizontal bars: one group per name, one bar per series.
#[allow(clippy::too_many_arguments)]
fn bars<const N: usize>(
    path: &Path,
    title: &str,
    unit: &str,
    names: &[String],
    values: &[[f64; N]],
    series: &[&str; N],
    marker: Option<(&str, f64)>,
    axis: Axis,
) -> Result<(), String> {
    let finite = || values.iter().flatten().copied().filter(|v| v.is_finite());
    let max = finite()
        .chain(marker.map(|m| m.1))
        .fold(0.0f64, f64::max)
        .max(1e-9);
    match axis {
        Axis::Linear => draw_bars(
            path,
            title,
            unit,
            names,
            values,
            series,
            marker,
            0.0,
            0f64..max * 1.1,
        ),
        Axis::Log => {
            // From a power of ten below the smallest positive value.
            let min = finite().filter(|v| *v > 0.0).fold(f64::INFINITY, f64::min);
            let base = if min.is_finite() {
                10f64.powf(min.log10().floor())
            } else {
                1.0
            };
            // To the next power of ten, so the last decade is labelled.
            let max = 10f64.powf((max * 1.05).log10().ceil()).max(base * 10.0);
            draw_bars(
                path,
                title,
                unit,
                names,
                values,
                series,
                marker,
                base,
                (base..max).log_scale(),
            )
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn draw_bars<const N: usize, X>(
    path: &Path,
    title: &str,
    unit: &str,
    names: &[String],
    values: &[[f64; N]],
    series: &[&str; N],
    marker: Option<(&str, f64)>,
    base: f64,
    x_range: X,
) -> Result<(), String>
where
    X: AsRangedCoord<Value = f64>,
    X::CoordDescType: ValueFormatter<f64>,
{
    let height = 120 + 36 * names.len() as u32 * N.max(1) as u32 / 2 + 40 * names.len() as u32;
    let root = BitMapBackend::new(path, (1000, height)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let n = names.len().max(1);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, (FONT, 22))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(220)
        .build_cartesian_2d(x_range, 0f64..n as f64)
        .map_err(err)?;
    let label = |y: &f64| -> String {
        let i = y.floor() as usize;
        if (y - i as f64 - 0.5).abs() < 1e-6 && i < names.len() {
            // Top to bottom in the order given.
            names[names.len() - 1 - i].clone()
        } else {
            String::new()
        }
    };
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(2 * n + 1)
        .y_label_formatter(&label)
        .x_labels(8)
        .x_label_formatter(&|v: &f64| format!("{v:.0}"))
        .max_light_lines(1)
        .x_desc(unit)
        .label_style((FONT, 14))
        .draw()
        .map_err(err)?;
    let band = 0.8 / N as f64;
    for (s, name) in series.iter().enumerate() {
        let color = SERIES[s % SERIES.len()];
        chart
            .draw_series(values.iter().enumerate().map(|(i, v)| {
                let row = (names.len() - 1 - i) as f64;
                let top = row + 0.9 - band * s as f64;
                let x = if v[s].is_finite() {
                    v[s].max(base)
                } else {
                    base
                };
                Rectangle::new([(base, top - band), (x, top)], color.filled())
            }))
            .map_err(err)?
            .label(*name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    if let Some((name, x)) = marker {
        chart
            .draw_series(LineSeries::new(
                [(x, 0.0), (x, n as f64)],
                BLACK.stroke_width(2),
            ))
            .map_err(err)?
            .label(format!("{name} {x:.1}"))
            .legend(|(x, y)| PathElement::new([(x, y), (x + 12, y)], BLACK.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .label_font((FONT, 14))
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

/// Active (running + queued) requests of every worker over time.
fn load_over_time(path: &Path, policy: &str, samples: &[Vec<u32>]) -> Result<(), String> {
    let root = BitMapBackend::new(path, (1000, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let len = samples.iter().map(Vec::len).max().unwrap_or(0).max(2);
    let max = samples.iter().flatten().copied().max().unwrap_or(0).max(1);
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("{policy}: active requests per worker"), (FONT, 22))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..(len - 1) as f64, 0f64..f64::from(max) * 1.1)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("simulated seconds")
        .y_desc("requests")
        .label_style((FONT, 14))
        .draw()
        .map_err(err)?;
    for (w, s) in samples.iter().enumerate() {
        let color = Palette99::pick(w).to_rgba();
        chart
            .draw_series(LineSeries::new(
                s.iter().enumerate().map(|(t, &a)| (t as f64, f64::from(a))),
                color.stroke_width(1),
            ))
            .map_err(err)?
            .label(format!("worker {}", w + 1))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 12, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .label_font((FONT, 12))
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

/// A chart of cumulative distributions: for each named series of samples
/// (milliseconds), the share of samples at or below each value, on a log
/// time axis. The gateway shoot-out draws each router's TTFT with it.
pub fn write_cdf(path: &Path, title: &str, series: &[(String, Vec<f64>)]) -> Result<(), String> {
    register_font()?;
    let positive = || {
        series
            .iter()
            .flat_map(|(_, s)| s.iter().copied())
            .filter(|v| v.is_finite() && *v > 0.0)
    };
    let lo = positive().fold(f64::INFINITY, f64::min);
    let hi = positive().fold(0.0, f64::max);
    if !lo.is_finite() || hi <= 0.0 {
        return Err("no samples to draw".into());
    }
    let root = BitMapBackend::new(path, (1000, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, (FONT, 22))
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((lo * 0.9..hi * 1.1).log_scale(), 0f64..1.0)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("ms (log scale)")
        .y_desc("share of requests")
        .x_labels(8)
        .x_label_formatter(&|v| format!("{v:.0}"))
        .label_style((FONT, 14))
        .draw()
        .map_err(err)?;
    for (i, (name, samples)) in series.iter().enumerate() {
        let mut sorted: Vec<f64> = samples
            .iter()
            .copied()
            .filter(|v| v.is_finite() && *v > 0.0)
            .collect();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len().max(1) as f64;
        let color = SERIES.get(i).copied().unwrap_or(BLACK);
        chart
            .draw_series(LineSeries::new(
                sorted
                    .iter()
                    .enumerate()
                    .map(|(k, &v)| (v, (k + 1) as f64 / n)),
                color.stroke_width(2),
            ))
            .map_err(err)?
            .label(name.clone())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 12, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .label_font((FONT, 14))
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}
