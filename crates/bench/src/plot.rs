//! One SVG figure of a run's policies, for `dprouter simulate --plot` and `dprouter bench --plot`: the TTFT
//! distribution of every policy (a CDF on a log time axis, since TTFTs span tens of milliseconds to tens of seconds),
//! each policy's cache hit rate (bars, with the oracle's where the run computed it) and how its requests spread over
//! the ranks (each rank's share, ranks sorted by share, beside the ideal 1/n).
//!
//! Drawn with `plotters`' SVG backend into a string, without fonts: text is laid out with plotters' naive width
//! estimate and written as SVG `<text>`, which the viewer renders in its own sans-serif. Colours are fixed per
//! position in the slice and shared by the three charts; a legend at the right names them.

use std::ops::Range;
use std::path::Path;

use dprouter_sim::report::percentile;
use dprouter_sim::SimOutcome;
use plotters::coord::combinators::LogCoord;
use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint};
use plotters::coord::types::RangedCoordf64;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// One policy's results to draw.
#[derive(Debug, Clone, Copy)]
pub struct PolicyPlot<'a> {
    /// The name in the legend (the table's `policy` column).
    pub name: &'a str,
    /// Its records (TTFT from [`dprouter_sim::RequestRecord::ttft`]) and requests routed per rank.
    pub outcome: &'a SimOutcome,
    /// Cached over prompt tokens, as [`dprouter_sim::Summary::hit_rate`].
    pub hit_rate: f64,
    /// The oracle's hit rate on the same requests, when the run computed it.
    pub oracle_hit_rate: Option<f64>,
}

#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("drawing the chart: {0}")]
    Draw(String),
    #[error("cannot write the chart to {path}: {source}")]
    Write { path: String, source: std::io::Error },
}

/// Figure size in pixels (the legend's width comes out of it).
const SIZE: (u32, u32) = (1400, 940);

/// Distinct colours (matplotlib's "tab10"), one per policy in order; repeats after ten.
const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// Most points one CDF line gets: larger runs are drawn at evenly spaced quantiles.
const MAX_CDF_POINTS: usize = 2000;

/// The colour of the policy at `index`.
pub fn colour(index: usize) -> RGBColor {
    PALETTE[index % PALETTE.len()]
}

/// The figure as SVG text.
pub fn render(title: &str, policies: &[PolicyPlot<'_>]) -> Result<String, PlotError> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        draw(&root, title, policies).map_err(|e| PlotError::Draw(e.to_string()))?;
        root.present().map_err(|e| PlotError::Draw(e.to_string()))?;
    }
    Ok(svg)
}

/// Renders the figure and writes it to `path`.
pub fn write(path: &Path, title: &str, policies: &[PolicyPlot<'_>]) -> Result<(), PlotError> {
    let svg = render(title, policies)?;
    std::fs::write(path, svg).map_err(|source| PlotError::Write {
        path: path.display().to_string(),
        source,
    })
}

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;

/// An axis with the ticks (bold) and grid lines (light) given. plotters' own `WithKeyPoints` loses the label
/// formatting of `f64` axes, so a chart using it could not be given a label formatter.
struct Ticked<R> {
    inner: R,
    bold: Vec<f64>,
    light: Vec<f64>,
}

impl<R: Ranged<ValueType = f64>> Ranged for Ticked<R> {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn range(&self) -> Range<f64> {
        self.inner.range()
    }

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        self.inner.map(value, limit)
    }

    fn key_points<Hint: KeyPointHint>(&self, hint: Hint) -> Vec<f64> {
        if hint.weight().allow_light_points() {
            self.light.clone()
        } else {
            self.bold.clone()
        }
    }

    fn axis_pixel_range(&self, limit: (i32, i32)) -> Range<i32> {
        self.inner.axis_pixel_range(limit)
    }
}

fn linear(range: Range<f64>, ticks: impl IntoIterator<Item = f64>) -> Ticked<RangedCoordf64> {
    Ticked {
        inner: range.into(),
        bold: ticks.into_iter().collect(),
        light: Vec::new(),
    }
}

fn logarithmic(range: Range<f64>, ticks: Vec<f64>, grid: Vec<f64>) -> Ticked<LogCoord<f64>> {
    Ticked {
        inner: range.log_scale().into(),
        bold: ticks,
        light: grid,
    }
}

/// 0, 0.1, …, 1.
fn tenths() -> impl Iterator<Item = f64> {
    (0..=10).map(|i| f64::from(i) / 10.0)
}
type DrawResult = Result<(), DrawingAreaErrorKind<std::io::Error>>;

fn draw(root: &Area<'_>, title: &str, policies: &[PolicyPlot<'_>]) -> DrawResult {
    root.fill(&WHITE)?;
    // A long title (bench's names the time scale) gets a smaller font to fit the width, at about 0.55 em per
    // character of a sans-serif font.
    let title_size = (f64::from(SIZE.0 - 40) / (0.55 * title.chars().count().max(1) as f64)).clamp(12.0, 24.0);
    let body = root.titled(title, ("sans-serif", title_size))?;
    // Names at 17 px and the statistics under them at 14 px, by plotters' estimate of text widths.
    let longest = policies.iter().map(|p| p.name.chars().count() + 3).max().unwrap_or(0);
    let legend_width = (longest as u32 * 8 + 56).clamp(340, 560);
    let (charts, legend) = body.split_horizontally(SIZE.0 - legend_width);
    let (top, bottom) = charts.split_vertically(490);
    let (hits, loads) = bottom.split_horizontally((SIZE.0 - legend_width) * 9 / 20);
    ttft_cdf(&top, policies)?;
    hit_rates(&hits, policies)?;
    load_shares(&loads, policies)?;
    legend_panel(&legend, policies)
}

/// TTFT in milliseconds, sorted.
fn ttfts_ms(outcome: &SimOutcome) -> Vec<f64> {
    let mut v: Vec<f64> = outcome.records.iter().map(|r| r.ttft() as f64 / 1000.0).collect();
    v.sort_by(f64::total_cmp);
    v
}

/// The empirical CDF of sorted `values` (each at least `floor`, for the log axis) as a step line from 0 to 1.
fn cdf_points(values: &[f64], floor: f64) -> Vec<(f64, f64)> {
    let n = values.len();
    if n == 0 {
        return Vec::new();
    }
    let at = |i: usize| values[i].max(floor);
    if 2 * n <= MAX_CDF_POINTS {
        let mut points = Vec::with_capacity(2 * n);
        for i in 0..n {
            points.push((at(i), i as f64 / n as f64));
            points.push((at(i), (i + 1) as f64 / n as f64));
        }
        return points;
    }
    let mut points = vec![(at(0), 0.0)];
    for k in 0..MAX_CDF_POINTS {
        let i = k * (n - 1) / (MAX_CDF_POINTS - 1);
        points.push((at(i), (i + 1) as f64 / n as f64));
    }
    points
}

/// The values `m` × 10^k within `lo..=hi`, for each `m` of `multiples`.
fn log_ticks(lo: f64, hi: f64, multiples: &[f64]) -> Vec<f64> {
    let mut ticks = Vec::new();
    let mut decade = 10f64.powf(lo.log10().floor());
    while decade <= hi {
        for m in multiples {
            let v = decade * m;
            if v >= lo * 0.999 && v <= hi * 1.001 {
                ticks.push(v);
            }
        }
        decade *= 10.0;
    }
    ticks
}

/// Labelled ticks of a log axis over `lo..hi`: 1, 2, 5 × 10^k, or 10^k alone over more than five decades, or
/// 1, 2, 3, 5 × 10^k and then every 1..9 × 10^k when those are too few; and the unlabelled grid lines between them.
fn log_axis_ticks(lo: f64, hi: f64) -> (Vec<f64>, Vec<f64>) {
    let all = log_ticks(lo, hi, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]);
    let mut labelled = log_ticks(lo, hi, &[1.0, 2.0, 5.0]);
    if labelled.len() > 16 {
        labelled = log_ticks(lo, hi, &[1.0]);
    } else if labelled.len() < 5 {
        labelled = log_ticks(lo, hi, &[1.0, 2.0, 3.0, 5.0]);
        if labelled.len() < 4 {
            labelled = all.clone();
        }
    }
    let grid = all.into_iter().filter(|v| !labelled.contains(v)).collect();
    (labelled, grid)
}

/// Stroke widths that keep coinciding lines visible: of each set of equal `lines`, the first drawn is the widest and
/// each later one 2 px narrower, so the set shows as nested stripes; a line equal to no other is 2 px wide.
fn stripe_widths<T: PartialEq>(lines: &[T]) -> Vec<u32> {
    (0..lines.len())
        .map(|i| 2 + 2 * lines[i + 1..].iter().filter(|l| **l == lines[i]).count() as u32)
        .collect()
}

/// A time in milliseconds as a short axis label.
fn time_label(ms: f64) -> String {
    if ms >= 1000.0 {
        format!("{} s", trim(ms / 1000.0))
    } else {
        format!("{} ms", trim(ms))
    }
}

fn trim(v: f64) -> String {
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_owned()
}

fn ttft_cdf(area: &Area<'_>, policies: &[PolicyPlot<'_>]) -> DrawResult {
    let all: Vec<Vec<f64>> = policies.iter().map(|p| ttfts_ms(p.outcome)).collect();
    let positive = all.iter().flatten().copied().filter(|&v| v > 0.0);
    let (min, max) = positive.fold((f64::INFINITY, 0.0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    // Zero TTFTs (a cost-free preset) sit at the left edge; with none positive the axis shows 0.1 to 10 ms.
    let (min, max) = if min.is_finite() { (min, max) } else { (0.1, 10.0) };
    let (lo, hi) = (min / 1.25, (max * 1.25).max(min * 2.0));
    let floor = lo;
    let (ticks, grid) = log_axis_ticks(lo, hi);
    let mut chart = ChartBuilder::on(area)
        .caption("TTFT distribution (CDF)", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d(logarithmic(lo..hi, ticks, grid), linear(0.0..1.0, tenths()))?;
    chart
        .configure_mesh()
        .x_desc(if all.iter().flatten().any(|&v| v <= 0.0) {
            "time to first token (log scale; zero at the left edge)"
        } else {
            "time to first token (log scale)"
        })
        .y_desc("fraction of requests")
        .x_label_formatter(&|v| time_label(*v))
        .y_label_formatter(&|v| format!("{v:.1}"))
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 16))
        .light_line_style(RGBColor(235, 235, 235))
        .bold_line_style(RGBColor(200, 200, 200))
        .draw()?;
    for ((i, values), width) in all.iter().enumerate().zip(stripe_widths(&all)) {
        chart.draw_series(LineSeries::new(
            cdf_points(values, floor),
            colour(i).stroke_width(width),
        ))?;
    }
    Ok(())
}

fn hit_rates(area: &Area<'_>, policies: &[PolicyPlot<'_>]) -> DrawResult {
    let n = policies.len().max(1);
    let oracles: Vec<f64> = policies.iter().filter_map(|p| p.oracle_hit_rate).collect();
    let one_oracle =
        oracles.len() == policies.len() && !oracles.is_empty() && oracles.iter().all(|o| (o - oracles[0]).abs() < 5e-4);
    let caption = if oracles.is_empty() {
        "Cache hit rate"
    } else {
        "Cache hit rate (dashed: oracle)"
    };
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d(
            linear(-0.5..n as f64 - 0.5, (0..n).map(|i| i as f64)),
            linear(0.0..1.05, tenths()),
        )?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_desc("policy (numbered as in the legend)")
        .y_desc("cached / prompt tokens")
        .x_label_formatter(&|v| format!("{}", v.round() as i64 + 1))
        .y_label_formatter(&|v| format!("{v:.1}"))
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 16))
        .bold_line_style(RGBColor(215, 215, 215))
        .draw()?;
    let half = 0.36;
    chart.draw_series(policies.iter().enumerate().map(|(i, p)| {
        let x = i as f64;
        Rectangle::new(
            [(x - half, 0.0), (x + half, p.hit_rate.clamp(0.0, 1.0))],
            colour(i).filled(),
        )
    }))?;
    // Each bar's value, inside its top when it is tall enough, else above it.
    let label = |i: usize, p: &PolicyPlot<'_>| {
        let (y, anchor, ink): (f64, VPos, &'static RGBColor) = if p.hit_rate > 0.12 {
            (p.hit_rate - 0.03, VPos::Top, &WHITE)
        } else {
            (p.hit_rate + 0.015, VPos::Bottom, &BLACK)
        };
        let style = TextStyle::from(("sans-serif", 14).into_font())
            .color(ink)
            .pos(Pos::new(HPos::Center, anchor));
        Text::new(format!("{:.3}", p.hit_rate), (i as f64, y), style)
    };
    chart.draw_series(policies.iter().enumerate().map(|(i, p)| label(i, p)))?;
    let oracle_style = ShapeStyle::from(&BLACK).stroke_width(2);
    if one_oracle {
        let o = oracles[0];
        chart.draw_series(DashedLineSeries::new(
            [(-0.5, o), (n as f64 - 0.5, o)],
            8,
            5,
            oracle_style,
        ))?;
    } else {
        for (i, p) in policies.iter().enumerate() {
            if let Some(o) = p.oracle_hit_rate {
                let x = i as f64;
                chart.draw_series(DashedLineSeries::new(
                    [(x - 0.48, o), (x + 0.48, o)],
                    6,
                    4,
                    oracle_style,
                ))?;
            }
        }
    }
    Ok(())
}

/// Each rank's share of the requests `outcome` routed, largest first.
fn shares(outcome: &SimOutcome) -> Vec<f64> {
    let total: u64 = outcome.routed_per_rank.iter().sum();
    let mut s: Vec<f64> = outcome
        .routed_per_rank
        .iter()
        .map(|&r| if total > 0 { r as f64 / total as f64 } else { 0.0 })
        .collect();
    s.sort_by(|a, b| b.total_cmp(a));
    s
}

fn load_shares(area: &Area<'_>, policies: &[PolicyPlot<'_>]) -> DrawResult {
    let all: Vec<Vec<f64>> = policies.iter().map(|p| shares(p.outcome)).collect();
    let ranks = all.iter().map(Vec::len).max().unwrap_or(0).max(1);
    let top = all.iter().flatten().copied().fold(1.0 / ranks as f64, f64::max);
    let y_max = (top * 1.08).min(1.05);
    let step = ranks.div_ceil(16);
    let mut chart = ChartBuilder::on(area)
        .caption("Load share per rank (dashed: even, 1/n)", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d(
            linear(0.5..ranks as f64 + 0.5, (1..=ranks).step_by(step).map(|r| r as f64)),
            0.0..y_max,
        )?;
    chart
        .configure_mesh()
        .x_desc("ranks, busiest first")
        .y_desc("share of routed requests")
        .x_label_formatter(&|v| format!("{}", v.round() as i64))
        .y_label_formatter(&|v| trim(*v))
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 16))
        .light_line_style(RGBColor(240, 240, 240))
        .bold_line_style(RGBColor(215, 215, 215))
        .draw()?;
    let mut evens: Vec<usize> = all.iter().map(Vec::len).filter(|&n| n > 0).collect();
    evens.dedup();
    for n in evens {
        let even = 1.0 / n as f64;
        chart.draw_series(DashedLineSeries::new(
            [(0.5, even), (ranks as f64 + 0.5, even)],
            8,
            5,
            ShapeStyle::from(&BLACK).stroke_width(2),
        ))?;
    }
    for ((i, s), width) in all.iter().enumerate().zip(stripe_widths(&all)) {
        let points: Vec<(f64, f64)> = s.iter().enumerate().map(|(r, &v)| ((r + 1) as f64, v)).collect();
        chart.draw_series(LineSeries::new(points.iter().copied(), colour(i).stroke_width(width)))?;
        chart.draw_series(
            points
                .iter()
                .map(|&p| Circle::new(p, 2 + width / 2, colour(i).filled())),
        )?;
    }
    Ok(())
}

/// Numbered colour swatches with each policy's name and, under it, its request count and TTFT p50 and p99.
fn legend_panel(area: &Area<'_>, policies: &[PolicyPlot<'_>]) -> DrawResult {
    let area = area.margin(50, 10, 10, 10);
    area.draw(&Text::new("Policies", (0, 0), ("sans-serif", 20).into_font()))?;
    let row = (((SIZE.1 - 140) as usize / policies.len().max(1)) as i32).clamp(36, 64);
    for (i, p) in policies.iter().enumerate() {
        let y = 40 + i as i32 * row;
        area.draw(&Rectangle::new([(0, y), (28, y + 16)], colour(i).filled()))?;
        area.draw(&Text::new(
            format!("{}. {}", i + 1, p.name),
            (36, y - 1),
            ("sans-serif", 17).into_font(),
        ))?;
        let ttfts = ttfts_ms(p.outcome);
        let stats = format!(
            "{} requests, p50 {}, p99 {}",
            ttfts.len(),
            time_label(percentile(&ttfts, 50.0).round()),
            time_label(percentile(&ttfts, 99.0).round()),
        );
        let grey = TextStyle::from(("sans-serif", 14).into_font()).color(&RGBColor(90, 90, 90));
        area.draw(&Text::new(stats, (36, y + 19), grey))?;
    }
    let note = 40 + policies.len() as i32 * row;
    let grey = TextStyle::from(("sans-serif", 14).into_font()).color(&RGBColor(90, 90, 90));
    area.draw(&Text::new("Lines that coincide are drawn", (0, note), grey.clone()))?;
    area.draw(&Text::new("as nested stripes.", (0, note + 18), grey))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use dprouter_sim::RequestRecord;

    use super::*;

    fn outcome(ttfts_ms: &[u64], routed: Vec<u64>) -> SimOutcome {
        let records = ttfts_ms
            .iter()
            .enumerate()
            .map(|(i, &ms)| RequestRecord {
                id: i as u64,
                group: 0,
                session: 0,
                rank: 0,
                branch: dprouter_core::Branch::Turn,
                arrival: 1_000_000 * i as u64,
                first_token: 1_000_000 * i as u64 + ms * 1000,
                finish: 1_000_000 * i as u64 + ms * 1000 + 5,
                prompt_tokens: 100,
                cached_tokens: 50,
                predicted_cached: None,
                floor: None,
            })
            .collect();
        SimOutcome {
            records,
            routed_per_rank: routed,
            ..SimOutcome::default()
        }
    }

    /// The `points` attribute of every `<polyline>` drawn in `colour`.
    fn polylines(svg: &str, colour: RGBColor) -> Vec<&str> {
        let stroke = format!("stroke=\"#{:02X}{:02X}{:02X}\"", colour.0, colour.1, colour.2);
        svg.split("<polyline")
            .skip(1)
            .map(|tag| &tag[..tag.find("/>").unwrap()])
            .filter(|tag| tag.contains(&stroke))
            .map(|tag| tag.split("points=\"").nth(1).unwrap().split('"').next().unwrap())
            .collect()
    }

    #[test]
    fn one_cdf_line_per_policy_and_every_name_in_the_legend() {
        // Five and three requests: CDF step lines of 10 and 6 points; the load lines have 4 (one per rank).
        let a = outcome(&[30, 90, 400, 2_000, 30_000], vec![2, 1, 1, 1]);
        let b = outcome(&[0, 50, 60], vec![3, 0, 0, 0]);
        let c = outcome(&[], vec![0, 0, 0, 0]);
        let policies = [
            PolicyPlot {
                name: "round_robin",
                outcome: &a,
                hit_rate: 0.5,
                oracle_hit_rate: Some(0.9),
            },
            PolicyPlot {
                name: "prefix_affinity:load=requests,epsilon=0.5",
                outcome: &b,
                hit_rate: 0.75,
                oracle_hit_rate: Some(0.9),
            },
            PolicyPlot {
                name: "http:<server>",
                outcome: &c,
                hit_rate: 0.0,
                oracle_hit_rate: None,
            },
        ];
        let svg = render("a <test> & title", &policies).unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"), "{svg}");
        for (i, steps) in [(0, 10), (1, 6)] {
            let lines = polylines(&svg, colour(i));
            let cdf: Vec<_> = lines.iter().filter(|p| p.split_whitespace().count() == steps).collect();
            assert_eq!(cdf.len(), 1, "policy {i}: {lines:?}");
        }
        // The empty policy has no CDF line: only its load line (4 points) in its colour.
        let empty = polylines(&svg, colour(2));
        assert!(empty.iter().all(|p| p.split_whitespace().count() == 4), "{empty:?}");
        let names = [
            "round_robin",
            "prefix_affinity:load=requests,epsilon=0.5",
            "http:&lt;server&gt;",
        ];
        for (i, name) in names.iter().enumerate() {
            let legend = format!(">\n{}. {name}\n</text>", i + 1);
            assert!(svg.contains(&legend), "no legend entry {legend:?}");
        }
        assert!(svg.contains("a &lt;test&gt; &amp; title"));
        assert!(svg.contains(">\nTTFT distribution (CDF)\n</text>"));
    }

    #[test]
    fn cdf_steps_reach_one_and_large_runs_are_thinned() {
        let steps = cdf_points(&[0.0, 10.0, 20.0], 1.0);
        assert_eq!(steps.first(), Some(&(1.0, 0.0)));
        assert_eq!(steps.last(), Some(&(20.0, 1.0)));
        let many: Vec<f64> = (0..100_000).map(f64::from).collect();
        let thinned = cdf_points(&many, 1.0);
        assert_eq!(thinned.len(), MAX_CDF_POINTS + 1);
        assert_eq!(thinned.last(), Some(&(99_999.0, 1.0)));
        assert!(thinned.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 <= w[1].1));
    }

    #[test]
    fn ticks_and_labels() {
        assert_eq!(
            log_axis_ticks(10.0, 1000.0).0,
            [10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0]
        );
        assert_eq!(log_axis_ticks(1.0, 14.0).0, [1.0, 2.0, 3.0, 5.0, 10.0]);
        assert_eq!(log_axis_ticks(1.5, 2.5).0, [2.0]);
        assert_eq!(log_axis_ticks(1.1, 3.5).0, [2.0, 3.0]);
        assert_eq!(log_axis_ticks(1.0, 1e9).0.len(), 10);
        assert_eq!(stripe_widths(&[1, 2, 1, 1, 3]), [6, 2, 4, 2, 2]);
        assert_eq!(time_label(20.0), "20 ms");
        assert_eq!(time_label(2500.0), "2.5 s");
    }

    #[test]
    fn an_unwritable_path_is_an_error_naming_it() {
        let err = write(Path::new("/nonexistent-dir/x.svg"), "t", &[]).unwrap_err();
        assert!(err.to_string().contains("/nonexistent-dir/x.svg"), "{err}");
    }
}
