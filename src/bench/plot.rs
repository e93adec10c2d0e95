//! Draws a finished run as one SVG: the CDFs of TTFT and E2E latency, and output token
//! throughput per second over the run, the three pictures that show a tail or a stall.

use std::path::Path;

use plotters::prelude::*;

use super::report::BenchReport;
use super::BenchError;

/// (x, fraction of requests at or below x) for sorted x.
pub fn cdf(values_ms: &[f64]) -> Vec<(f64, f64)> {
    let mut v: Vec<f64> = values_ms.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len() as f64;
    v.into_iter()
        .enumerate()
        .map(|(i, x)| (x, (i + 1) as f64 / n))
        .collect()
}

pub fn write_svg(report: &BenchReport, path: &Path) -> Result<(), BenchError> {
    draw(report, path).map_err(|reason| BenchError::Plot {
        path: path.to_path_buf(),
        reason,
    })
}

fn draw(report: &BenchReport, path: &Path) -> Result<(), String> {
    let ok: Vec<_> = report.requests.iter().filter(|r| r.success).collect();
    let ttft = cdf(&ok.iter().map(|r| r.ttft_s * 1000.0).collect::<Vec<_>>());
    let e2e = cdf(&ok.iter().map(|r| r.e2e_s * 1000.0).collect::<Vec<_>>());
    let tput: Vec<(f64, f64)> = report
        .summary
        .output_tokens_per_second
        .iter()
        .enumerate()
        // Each bucket as a flat step over its second, so a one-second run still shows.
        .flat_map(|(i, v)| [(i as f64, *v), (i as f64 + 1.0, *v)])
        .collect();

    let root = SVGBackend::new(path, (1200, 400)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let panels = root.split_evenly((1, 3));
    cdf_panel(&panels[0], "TTFT CDF", "TTFT (ms)", &ttft, &BLUE)?;
    cdf_panel(
        &panels[1],
        "E2E latency CDF",
        "E2E latency (ms)",
        &e2e,
        &RED,
    )?;

    let x_max = report.summary.output_tokens_per_second.len().max(1) as f64;
    let y_max = tput.iter().map(|p| p.1).fold(1.0, f64::max) * 1.1;
    let mut chart = ChartBuilder::on(&panels[2])
        .caption("Output throughput", ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(55)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("time since first request (s)")
        .y_desc("output tok/s")
        .draw()
        .map_err(|e| e.to_string())?;
    chart
        .draw_series(LineSeries::new(tput, &GREEN))
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())?;
    Ok(())
}

fn cdf_panel(
    area: &DrawingArea<SVGBackend, plotters::coord::Shift>,
    caption: &str,
    x_desc: &str,
    points: &[(f64, f64)],
    color: &RGBColor,
) -> Result<(), String> {
    let x_max = points.last().map(|p| p.0).unwrap_or(1.0).max(1e-3) * 1.05;
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 18))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(45)
        .build_cartesian_2d(0.0..x_max, 0.0..1.0)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc("fraction of requests")
        .draw()
        .map_err(|e| e.to_string())?;
    // A CDF is a staircase: step up at each sample.
    let mut steps = Vec::with_capacity(points.len() * 2 + 1);
    steps.push((0.0, 0.0));
    let mut prev = 0.0;
    for &(x, y) in points {
        steps.push((x, prev));
        steps.push((x, y));
        prev = y;
    }
    chart
        .draw_series(LineSeries::new(steps, color))
        .map_err(|e| e.to_string())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cdf_is_sorted_and_ends_at_one() {
        assert_eq!(
            cdf(&[3.0, 1.0, 2.0, 4.0]),
            vec![(1.0, 0.25), (2.0, 0.5), (3.0, 0.75), (4.0, 1.0)]
        );
        assert!(cdf(&[]).is_empty());
    }
}
