// clawbridge dashboard: small SVG charts (no library, nothing fetched from elsewhere).
// drawChart(svg, {series: [{name, color, points: [[x, y], ...], line}], vlines: [{x, label}],
//                 xlabel, ylabel}) draws axes, one polyline and one <circle class="pt"> per point,
// and dashed vertical lines (policy version boundaries). Everything is SVG elements, so the
// browser tests can count the points.
"use strict";
const SVGNS = "http://www.w3.org/2000/svg";

function svgEl(name, attrs, text) {
  const el = document.createElementNS(SVGNS, name);
  for (const [k, v] of Object.entries(attrs || {})) el.setAttribute(k, String(v));
  if (text !== undefined) el.textContent = text;
  return el;
}

function fmt(v) {
  if (!isFinite(v)) return "";
  const a = Math.abs(v);
  if (a < 1e-9) return "0";
  if (a !== 0 && (a < 0.01 || a >= 10000)) return v.toExponential(1);
  return String(Math.round(v * 100) / 100);
}

function drawChart(svg, spec) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const W = 640, H = 230, L = 48, R = 12, T = 24, B = 30;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  const pts = spec.series.flatMap((s) => s.points);
  if (pts.length === 0) {
    svg.appendChild(svgEl("text", {x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty"},
                          spec.empty || "no data yet"));
    return;
  }
  let xs = pts.map((p) => p[0]).concat((spec.vlines || []).map((v) => v.x));
  let ys = pts.map((p) => p[1]);
  let x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (spec.yzero) { y0 = Math.min(y0, 0); y1 = Math.max(y1, 0); }
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  if (y1 === y0) { y0 -= 1; y1 += 1; }
  const pad = (y1 - y0) * 0.08; y0 -= pad; y1 += pad;
  const sx = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R);
  const sy = (y) => H - B - ((y - y0) / (y1 - y0)) * (H - T - B);
  const axes = svgEl("g", {class: "axes"});
  axes.appendChild(svgEl("line", {x1: L, y1: H - B, x2: W - R, y2: H - B}));
  axes.appendChild(svgEl("line", {x1: L, y1: T, x2: L, y2: H - B}));
  for (const y of [y0 + pad, (y0 + y1) / 2, y1 - pad]) {
    axes.appendChild(svgEl("text", {x: L - 4, y: sy(y) + 4, "text-anchor": "end"}, fmt(y)));
    axes.appendChild(svgEl("line", {x1: L, y1: sy(y), x2: W - R, y2: sy(y), class: "grid"}));
  }
  axes.appendChild(svgEl("text", {x: L, y: H - 8, "text-anchor": "start"}, fmt(x0)));
  axes.appendChild(svgEl("text", {x: W - R, y: H - 8, "text-anchor": "end"}, fmt(x1)));
  if (spec.xlabel) axes.appendChild(svgEl("text", {x: (L + W - R) / 2, y: H - 8, "text-anchor": "middle"}, spec.xlabel));
  svg.appendChild(axes);
  for (const v of spec.vlines || []) {
    svg.appendChild(svgEl("line", {x1: sx(v.x), y1: T, x2: sx(v.x), y2: H - B, class: "vline"}));
    svg.appendChild(svgEl("text", {x: sx(v.x) + (sx(v.x) > W - R - 30 ? -3 : 3), y: T + 10, class: "vlabel",
                                   "text-anchor": sx(v.x) > W - R - 30 ? "end" : "start"}, v.label));
  }
  const legend = svgEl("g", {class: "legend"});
  let lx = L;
  spec.series.forEach((s) => {
    if (s.points.length === 0) return;
    const g = svgEl("g", {class: "series", "data-series": s.name});
    if (s.line && s.points.length > 1) {
      g.appendChild(svgEl("polyline", {
        points: s.points.map((p) => `${sx(p[0])},${sy(p[1])}`).join(" "), stroke: s.color, fill: "none",
      }));
    }
    for (const p of s.points) {
      const c = svgEl("circle", {cx: sx(p[0]), cy: sy(p[1]), r: 3, fill: s.color, class: "pt"});
      c.appendChild(svgEl("title", {}, `${s.name}: ${fmt(p[1])} at ${fmt(p[0])}`));
      g.appendChild(c);
    }
    svg.appendChild(g);
    legend.appendChild(svgEl("rect", {x: lx, y: 4, width: 8, height: 8, fill: s.color}));
    legend.appendChild(svgEl("text", {x: lx + 12, y: 12}, s.name));
    lx += 24 + 6 * s.name.length;
  });
  svg.appendChild(legend);
}
