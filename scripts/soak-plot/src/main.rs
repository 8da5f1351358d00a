//! `soak-plot <samples.csv> <out.png> [title]`: draws a soak run of scripts/soak-storage.sh.
//!
//! Input: a CSV with the header `elapsed_s,phase,node,rss_bytes,journal_bytes`, one row per node
//! per sample (elapsed seconds since the run started, the phase name, the node id, the node's
//! resident set size and the bytes of its partition journals on disk). Output: a PNG with two
//! panels sharing the time axis — RSS (MiB) and journal size on disk (MiB) of every node — and a
//! vertical line with the phase name where each phase begins.

use std::collections::BTreeMap;

use anyhow::{bail, Context, Result};
use plotters::prelude::*;

/// One sample of one node.
struct Sample {
    elapsed_s: f64,
    phase: String,
    node: u32,
    rss_mib: f64,
    journal_mib: f64,
}

fn parse(text: &str) -> Result<Vec<Sample>> {
    let mut lines = text.lines();
    let header = lines.next().context("empty CSV")?;
    if header.trim() != "elapsed_s,phase,node,rss_bytes,journal_bytes" {
        bail!("unexpected CSV header {header:?}");
    }
    let mut out = Vec::new();
    for (i, line) in lines.enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let f: Vec<&str> = line.split(',').collect();
        if f.len() != 5 {
            bail!("line {}: expected 5 fields, got {line:?}", i + 2);
        }
        let mib = |s: &str| -> Result<f64> {
            Ok(s.trim()
                .parse::<f64>()
                .with_context(|| format!("line {}: {s:?}", i + 2))?
                / (1024.0 * 1024.0))
        };
        out.push(Sample {
            elapsed_s: f[0]
                .trim()
                .parse()
                .with_context(|| format!("line {}", i + 2))?,
            phase: f[1].trim().to_string(),
            node: f[2]
                .trim()
                .parse()
                .with_context(|| format!("line {}", i + 2))?,
            rss_mib: mib(f[3])?,
            journal_mib: mib(f[4])?,
        });
    }
    if out.is_empty() {
        bail!("no samples");
    }
    Ok(out)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        bail!("usage: soak-plot <samples.csv> <out.png> [title]");
    }
    let text = std::fs::read_to_string(&args[1]).with_context(|| format!("read {}", args[1]))?;
    let samples = parse(&text)?;
    let title = args.get(3).cloned().unwrap_or_else(|| "soak".to_string());

    let mut by_node: BTreeMap<u32, Vec<&Sample>> = BTreeMap::new();
    for s in &samples {
        by_node.entry(s.node).or_default().push(s);
    }
    // Where each phase begins (in order of first appearance).
    let mut phases: Vec<(f64, String)> = Vec::new();
    for s in &samples {
        if phases.last().map(|(_, p)| p != &s.phase).unwrap_or(true) {
            phases.push((s.elapsed_s, s.phase.clone()));
        }
    }
    let t_max = samples.iter().map(|s| s.elapsed_s).fold(1.0, f64::max);
    let rss_max = samples.iter().map(|s| s.rss_mib).fold(1.0, f64::max) * 1.15;
    let journal_max = samples.iter().map(|s| s.journal_mib).fold(1.0, f64::max) * 1.15;

    let root = BitMapBackend::new(&args[2], (1400, 900)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(&title, ("sans-serif", 26))?;
    let (top, bottom) = root.split_vertically(430);
    let colors = [RED, BLUE, GREEN, MAGENTA, CYAN];

    for (area, label, max, value) in [
        (
            &top,
            "RSS (MiB)",
            rss_max,
            (|s: &Sample| s.rss_mib) as fn(&Sample) -> f64,
        ),
        (
            &bottom,
            "journal on disk (MiB)",
            journal_max,
            |s: &Sample| s.journal_mib,
        ),
    ] {
        let mut chart = ChartBuilder::on(area)
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(0.0..t_max, 0.0..max)?;
        chart
            .configure_mesh()
            .x_desc("elapsed (s)")
            .y_desc(label)
            .label_style(("sans-serif", 16))
            .draw()?;
        for (i, (node, rows)) in by_node.iter().enumerate() {
            let color = colors[i % colors.len()];
            chart
                .draw_series(LineSeries::new(
                    rows.iter().map(|s| (s.elapsed_s, value(s))),
                    color.stroke_width(2),
                ))?
                .label(format!("node {node}"))
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        }
        for (i, (t, name)) in phases.iter().enumerate() {
            chart.draw_series(LineSeries::new(
                vec![(*t, 0.0), (*t, max)],
                BLACK.mix(0.4).stroke_width(1),
            ))?;
            chart.draw_series(std::iter::once(Text::new(
                name.clone(),
                // Alternate heights, so names of short phases do not overlap.
                (*t + t_max * 0.005, max * (0.95 - 0.06 * (i % 2) as f64)),
                ("sans-serif", 16),
            )))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}
