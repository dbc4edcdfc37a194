//! `--report DIR`'s report.html: self-contained (inline SVG drawn by plotters, no scripts, no
//! network), the one-line diagnosis at the top, per-layer rel-L2 and cosine by module kind (log
//! scale), a layer × module heat map with the first divergence outlined, the logit statistics and
//! every compared module; and findings.jsonl, one compared module per line.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use plotters::prelude::*;

use crate::compare::{Comparison, ModuleRow, Status};

/// The module kinds drawn as lines (the rest are in the heat map and the table).
const LINE_KINDS: [&str; 7] = [
    "input_layernorm",
    "self_attn.kv_b_proj",
    "self_attn",
    "post_attention_layernorm",
    "mlp",
    "mlp.experts",
    "(layer output)",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// `model.layers.3.self_attn.o_proj` → (3, `self_attn.o_proj`); the layer's own output is
/// `(layer output)`.
fn kind_of(r: &ModuleRow) -> Option<(usize, String)> {
    let l = r.layer?;
    let prefix = format!("model.layers.{l}");
    let rest = r.name.strip_prefix(&prefix)?;
    let kind = rest.strip_prefix('.').unwrap_or("");
    Some((
        l,
        if kind.is_empty() {
            "(layer output)".to_string()
        } else {
            kind.to_string()
        },
    ))
}

/// (kind → layer → (rel-L2, cosine)) of the compared, non-auxiliary float modules.
type Grid = BTreeMap<String, BTreeMap<usize, (f64, Option<f64>)>>;

fn grid(c: &Comparison) -> Grid {
    let mut g: Grid = BTreeMap::new();
    for r in c.modules.iter().filter(|r| !r.aux) {
        if let (Some((l, kind)), Some(x)) = (kind_of(r), r.rel_l2) {
            g.entry(kind).or_default().insert(l, (x, r.cosine));
        }
    }
    g
}

const COLORS: [RGBColor; 7] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(23, 190, 207),
];

/// One line per module kind over the layers; `cosine` picks 1 − cosine instead of rel-L2 (both on
/// a log scale). A dashed red line marks the first divergence's layer.
fn line_plot(g: &Grid, layers: usize, first: Option<usize>, cosine: bool) -> String {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (760, 340)).into_drawing_area();
        let _ = root.fill(&WHITE);
        let floor = 1e-9;
        let value = |(x, cos): &(f64, Option<f64>)| -> Option<f64> {
            let v = if cosine { 1.0 - (*cos)? } else { *x };
            Some(v.max(floor))
        };
        let top = g
            .values()
            .flat_map(|m| m.values().filter_map(value))
            .fold(1e-6f64, f64::max)
            * 3.0;
        let caption = if cosine {
            "1 − cosine per layer"
        } else {
            "rel-L2 per layer"
        };
        let chart = ChartBuilder::on(&root)
            .caption(caption, ("sans-serif", 18))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(60)
            .build_cartesian_2d(
                -0.5f64..(layers.max(1) as f64 - 0.5),
                (floor..top).log_scale(),
            );
        let Ok(mut chart) = chart else {
            return svg_error();
        };
        let _ = chart
            .configure_mesh()
            .x_desc("layer")
            .x_labels(layers.clamp(2, 20))
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| format!("{y:.0e}"))
            .draw();
        if let Some(l) = first {
            let _ = chart.draw_series(LineSeries::new(
                [(l as f64, floor), (l as f64, top)],
                RED.stroke_width(2),
            ));
        }
        for (i, kind) in LINE_KINDS.iter().enumerate() {
            let Some(m) = g.get(*kind) else { continue };
            let color = COLORS[i % COLORS.len()];
            let pts: Vec<(f64, f64)> = m
                .iter()
                .filter_map(|(&l, v)| value(v).map(|y| (l as f64, y)))
                .collect();
            if let Ok(s) = chart.draw_series(LineSeries::new(pts.clone(), color.stroke_width(2))) {
                s.label(*kind).legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 14, y)], color.stroke_width(2))
                });
            }
            let _ = chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled())));
        }
        let _ = chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw();
        let _ = root.present();
    }
    svg
}

fn svg_error() -> String {
    "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"760\" height=\"40\"><text x=\"10\" y=\"25\">plot unavailable</text></svg>".into()
}

/// log10 rel-L2 of every (layer, kind) as a coloured cell; the first divergence outlined.
fn heat_map(g: &Grid, layers: usize, first: Option<(usize, &str)>) -> String {
    let (cell_w, cell_h, left, top) = (44usize, 16usize, 250usize, 24usize);
    let kinds: Vec<&String> = g.keys().collect();
    let (w, h) = (
        left + cell_w * layers.max(1) + 10,
        top + cell_h * kinds.len() + 30,
    );
    let mut s = format!(
        "<svg id=\"heat-map\" xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"11\">"
    );
    for l in 0..layers {
        let _ = write!(
            s,
            "<text x=\"{}\" y=\"16\" text-anchor=\"middle\">layer {l}</text>",
            left + l * cell_w + cell_w / 2
        );
    }
    for (row, kind) in kinds.iter().enumerate() {
        let y = top + row * cell_h;
        let _ = write!(
            s,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>",
            left - 6,
            y + cell_h - 4,
            esc(kind)
        );
        for (&l, &(x, _)) in &g[*kind] {
            // −9 (blue) … 0 and above (red).
            let t = ((x.max(1e-12).log10() + 9.0) / 9.0).clamp(0.0, 1.0);
            let (r, gr, b) = (
                (40.0 + 215.0 * t) as u8,
                (90.0 + 80.0 * (1.0 - (2.0 * t - 1.0).abs())) as u8,
                (220.0 * (1.0 - t)) as u8,
            );
            let outlined = first.is_some_and(|(fl, fk)| fl == l && fk == kind.as_str());
            let _ = write!(
                s,
                "<rect x=\"{}\" y=\"{y}\" width=\"{}\" height=\"{}\" fill=\"rgb({r},{gr},{b})\"{}><title>{} layer {l}: rel-L2 {x:.3e}</title></rect>",
                left + l * cell_w,
                cell_w - 1,
                cell_h - 1,
                if outlined {
                    format!(
                        " id=\"first-divergence\" data-layer=\"{l}\" stroke=\"black\" stroke-width=\"3\""
                    )
                } else {
                    String::new()
                },
                esc(kind)
            );
        }
    }
    s.push_str("</svg>");
    s
}

/// The self-contained HTML report of a comparison.
pub fn comparison_html(title: &str, c: &Comparison) -> String {
    let g = grid(c);
    let layers = c
        .modules
        .iter()
        .filter_map(|r| r.layer)
        .max()
        .map_or(0, |l| l + 1);
    let first = c.first_divergence.as_ref();
    let first_layer = first.and_then(|f| f.layer);
    let first_kind = first.and_then(|f| {
        c.modules
            .iter()
            .find(|r| r.name == f.module)
            .and_then(kind_of)
    });
    let verdict = super::forward::verdict_word(c);
    let diagnosis = match first {
        Some(f) => {
            let mut d = format!(
                "{verdict}: first divergence at {}{} — {}",
                f.module,
                f.layer.map_or(String::new(), |l| format!(" (layer {l})")),
                f.reading
            );
            if let Some(sig) = &f.signature {
                let _ = write!(d, " {}", super::reading::signature_line(sig));
            }
            d
        }
        None => format!("{verdict}: no module beyond tolerance"),
    };
    let mut h = String::new();
    let _ = write!(
        h,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>glmcheck: {t}</title>\
         <style>body{{font-family:sans-serif;margin:24px;max-width:1100px}}\
         .diag{{font-size:18px;padding:12px;border-left:6px solid {c};background:#f6f6f6}}\
         table{{border-collapse:collapse;font-size:12px}}td,th{{border:1px solid #ccc;padding:2px 6px}}\
         .DIVERGED{{background:#fdd}}</style></head><body>\n\
         <h1>glmcheck: {t}</h1>\n<p class=\"diag\" id=\"diagnosis\">{d}</p>\n\
         <p>{cand} against {refr}; tolerances: {tol}</p>\n",
        t = esc(title),
        c = if first.is_some() { "#c00" } else { "#080" },
        d = esc(&diagnosis),
        cand = esc(&c.candidate),
        refr = esc(&c.reference),
        tol = esc(&c.tolerances.basis.to_string()),
    );
    let _ = write!(
        h,
        "<h2>Per layer</h2>\n<div id=\"rel-l2-plot\">{}</div>\n<div id=\"cosine-plot\">{}</div>\n\
         <h2>Layer × module (log10 rel-L2; the first divergence outlined)</h2>\n{}\n",
        line_plot(&g, layers, first_layer, false),
        line_plot(&g, layers, first_layer, true),
        heat_map(
            &g,
            layers,
            first_kind.as_ref().map(|(l, k)| (*l, k.as_str()))
        )
    );
    if let Some(l) = &c.logits {
        let k = &l.kld_stats;
        let _ = write!(
            h,
            "<h2>Logits</h2>\n<table id=\"logits\"><tr><th>positions</th><th>KL mean ± err</th><th>max</th>\
             <th>99.9 %</th><th>99 %</th><th>median</th><th>same top</th></tr>\
             <tr><td>{}</td><td>{:.3e} ± {:.1e}</td><td>{:.3e}</td><td>{:.3e}</td><td>{:.3e}</td><td>{:.3e}</td><td>{:.1} %</td></tr></table>\n",
            l.positions,
            k.kl_mean,
            k.kl_mean_err,
            k.kl_max,
            k.kl_p999,
            k.kl_p99,
            k.kl_median,
            100.0 * k.same_top
        );
    }
    h.push_str("<h2>Modules</h2>\n<table id=\"modules\"><tr><th>module</th><th>status</th><th>rel-L2</th><th>cosine</th></tr>\n");
    for r in c.modules.iter().filter(|r| !r.aux) {
        let _ = writeln!(
            h,
            "<tr class=\"{s}\"><td>{n}</td><td>{s}</td><td>{x}</td><td>{cos}</td></tr>",
            s = r.status.name(),
            n = esc(&r.name),
            x = r.rel_l2.map_or("-".into(), |x| format!("{x:.3e}")),
            cos = r.cosine.map_or("-".into(), |x| format!("{x:.6}")),
        );
    }
    h.push_str("</table>\n</body></html>\n");
    h
}

/// findings.jsonl: one compared module per line (`{"module", "layer", "status", "rel_l2",
/// "cosine", "max_abs", "first_divergence"}`).
pub fn findings_jsonl(c: &Comparison) -> String {
    let first = c.first_divergence.as_ref().map(|f| f.module.as_str());
    jsonl(c.modules.iter().map(|r| {
        serde_json::json!({
            "module": r.name,
            "layer": r.layer,
            "status": r.status.name(),
            "diverged": r.status == Status::Diverged,
            "rel_l2": r.rel_l2,
            "cosine": r.cosine,
            "max_abs": r.max_abs,
            "aux": r.aux,
            "first_divergence": first == Some(r.name.as_str()),
        })
    }))
}

/// A report without per-layer activations (gate, bisect, shards --against): the one-line
/// diagnosis and a table of (what, result, why).
pub fn table_html(title: &str, diagnosis: &str, rows: &[(String, String, String)]) -> String {
    let mut h = format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>glmcheck: {t}</title>\
         <style>body{{font-family:sans-serif;margin:24px;max-width:1100px}}\
         .diag{{font-size:18px;padding:12px;border-left:6px solid #555;background:#f6f6f6}}\
         table{{border-collapse:collapse;font-size:12px}}td,th{{border:1px solid #ccc;padding:2px 6px}}\
         .FAIL{{background:#fdd}}</style></head><body>\n<h1>glmcheck: {t}</h1>\n\
         <p class=\"diag\" id=\"diagnosis\">{d}</p>\n<table id=\"findings\"><tr><th>what</th><th>result</th><th>why</th></tr>\n",
        t = esc(title),
        d = esc(diagnosis)
    );
    for (what, result, why) in rows {
        let _ = writeln!(
            h,
            "<tr class=\"{r}\"><td>{w}</td><td>{r}</td><td>{y}</td></tr>",
            w = esc(what),
            r = esc(result),
            y = esc(why)
        );
    }
    h.push_str("</table>\n</body></html>\n");
    h
}

/// One JSON value per line.
pub fn jsonl(values: impl IntoIterator<Item = serde_json::Value>) -> String {
    values.into_iter().fold(String::new(), |mut out, v| {
        out.push_str(&v.to_string());
        out.push('\n');
        out
    })
}
