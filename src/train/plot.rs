//! PNG line plots of per-step curves (reward, mismatch), drawn without text: plotters'
//! bitmap backend has no font without a font stack, so axes carry unlabelled ticks and the
//! legend (each series' colour, [`series_color`]) is written beside the image by the caller.

use std::path::Path;

use plotters::prelude::*;

use super::TrainError;

const TICKS: usize = 5;

/// The colour of series `i` (as `#rrggbb`), for a legend written next to the image.
pub fn series_color(i: usize) -> String {
    let c = Palette99::pick(i).to_rgba();
    format!("#{:02x}{:02x}{:02x}", c.0, c.1, c.2)
}

/// Draws every series against its index (the step) on axes from 0 to the largest value
/// (x 10%), with `TICKS` evenly spaced ticks on each axis, and writes a PNG.
pub fn curves_png(
    path: &Path,
    size: (u32, u32),
    series: &[(&str, Vec<f64>)],
) -> Result<(), TrainError> {
    let io = |reason: String| TrainError::Io {
        path: path.display().to_string(),
        reason,
    };
    let (w, h) = size;
    if w < 64 || h < 64 {
        return Err(io(format!("plot size {w}x{h}: at least 64x64")));
    }
    let n = series.iter().map(|s| s.1.len()).max().unwrap_or(1).max(2);
    let y_max = series
        .iter()
        .flat_map(|s| s.1.iter().copied())
        .filter(|v| v.is_finite())
        .fold(0.0, f64::max);
    let y_max = if y_max > 0.0 { y_max * 1.1 } else { 1e-6 };
    let mut rgb = vec![0u8; (w * h * 3) as usize];
    {
        let draw = |e: &dyn std::fmt::Display| io(format!("drawing: {e}"));
        let root = BitMapBackend::with_buffer(&mut rgb, (w, h)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| draw(&e))?;
        let area = root.margin(16, 16, 16, 16);
        let mut chart = ChartBuilder::on(&area)
            .build_cartesian_2d(0.0..(n - 1) as f64, 0.0..y_max)
            .map_err(|e| draw(&e))?;
        let (x_end, y_end) = ((n - 1) as f64, y_max);
        let grey = RGBColor(220, 220, 220);
        for k in 0..=TICKS {
            let (x, y) = (
                x_end * k as f64 / TICKS as f64,
                y_end * k as f64 / TICKS as f64,
            );
            chart
                .draw_series(std::iter::once(PathElement::new(
                    vec![(0.0, y), (x_end, y)],
                    grey,
                )))
                .map_err(|e| draw(&e))?;
            chart
                .draw_series(std::iter::once(PathElement::new(
                    vec![(x, 0.0), (x, y_end * 0.02)],
                    BLACK,
                )))
                .map_err(|e| draw(&e))?;
        }
        chart
            .draw_series(std::iter::once(PathElement::new(
                vec![(0.0, y_end), (0.0, 0.0), (x_end, 0.0)],
                BLACK.stroke_width(2),
            )))
            .map_err(|e| draw(&e))?;
        for (i, (_, ys)) in series.iter().enumerate() {
            chart
                .draw_series(LineSeries::new(
                    ys.iter()
                        .enumerate()
                        .filter(|(_, y)| y.is_finite())
                        .map(|(x, y)| (x as f64, *y)),
                    Palette99::pick(i).to_rgba().stroke_width(2),
                ))
                .map_err(|e| draw(&e))?;
        }
        root.present().map_err(|e| draw(&e))?;
    }
    let file = std::fs::File::create(path).map_err(|e| io(e.to_string()))?;
    let mut enc = png::Encoder::new(std::io::BufWriter::new(file), w, h);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    enc.write_header()
        .and_then(|mut wr| wr.write_image_data(&rgb))
        .map_err(|e| io(format!("PNG: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The file decodes as a PNG of the asked size, its background is white and each series
    /// leaves pixels of its own colour.
    #[test]
    fn writes_a_png_with_each_series_colour() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.png");
        let series = vec![
            ("a", (0..20).map(|i| i as f64 / 20.0).collect::<Vec<_>>()),
            ("b", (0..20).map(|i| 1.0 - i as f64 / 20.0).collect()),
        ];
        curves_png(&path, (320, 200), &series).unwrap();
        let dec = png::Decoder::new(std::fs::File::open(&path).unwrap());
        let mut reader = dec.read_info().unwrap();
        let mut buf = vec![0; reader.output_buffer_size()];
        let info = reader.next_frame(&mut buf).unwrap();
        assert_eq!((info.width, info.height), (320, 200));
        assert_eq!(info.color_type, png::ColorType::Rgb);
        let px: Vec<[u8; 3]> = buf[..info.buffer_size()]
            .chunks_exact(3)
            .map(|c| [c[0], c[1], c[2]])
            .collect();
        assert_eq!(px[0], [255, 255, 255]);
        for i in 0..2 {
            let c = Palette99::pick(i).to_rgba();
            assert!(
                px.contains(&[c.0, c.1, c.2]),
                "series {i} drawn in {}",
                series_color(i)
            );
        }
    }
}
