// clawbridge dashboard: small SVG charts (no library, nothing fetched from elsewhere).
// drawChart(svg, {series: [{name, color, points: [[x, y], ...], line}], vlines: [{x, label}],
//                 xlabel, xint, yzero, height, legend, empty}) draws axes, one polyline and one <circle class="pt">
// per point, and dashed vertical lines (policy version boundaries). Everything is SVG elements, so
// the browser tests can count the points and read the ticks.
// Readable by construction: the chart is drawn at the width it is shown at (text stays 11 px on a
// phone); ticks are "nice" numbers (1, 2, 2.5 or 5 times a power of ten, evenly spaced, one number
// of decimals per axis: 0.00 0.25 0.50, never 0.71 0.36); a flat series gets a range around its
// value (a zero line shows 0 and 1, not -0.03); each tick label is dropped rather than drawn over
// its neighbour.
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
  if (a < 0.01 || a >= 10000) return v.toExponential(1);
  return String(Math.round(v * 100) / 100);
}

// Nice ticks covering [lo, hi]: about `count` of them, `step` = 1, 2, 2.5 or 5 x 10^k (at least
// 1 when `integer`), labels with one number of decimals.
function niceTicks(lo, hi, count, integer) {
  if (!(hi > lo)) {  // a flat series: a range around its value (0 -> 0..1)
    const a = Math.abs(lo);
    if (a < 1e-12) { lo = 0; hi = 1; } else if (lo > 0) { hi = lo * 1.5; lo = 0; } else { lo = lo * 1.5; hi = 0; }
  }
  const raw = (hi - lo) / Math.max(1, count - 1);
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  let step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw * 0.999);
  if (integer) step = Math.max(1, Math.round(step));
  const first = Math.floor(lo / step + 1e-9) * step, last = Math.ceil(hi / step - 1e-9) * step;
  const ticks = [];
  for (let v = first; v <= last + step * 1e-6; v += step) ticks.push(Math.abs(v) < step * 1e-9 ? 0 : v);
  let decimals = step >= 1 ? 0 : Math.ceil(-Math.log10(step) - 1e-9);
  if (Math.abs(step * Math.pow(10, decimals) - Math.round(step * Math.pow(10, decimals))) > 1e-6) decimals += 1;
  const big = Math.max(...ticks.map(Math.abs));
  const label = (v) => (big >= 100000 || (big > 0 && big < 0.001)) ? v.toExponential(1)
    : (Math.abs(v) < step * 1e-9 ? 0 : v).toFixed(decimals);
  return {ticks, step, lo: ticks[0], hi: ticks[ticks.length - 1], labels: ticks.map(label)};
}

function drawChart(svg, spec) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const W = Math.max(240, Math.round(svg.getBoundingClientRect().width) || 640);
  const H = spec.height || 220, L = 46, R = 14, T = 24, B = 40;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.setAttribute("height", String(H));
  const pts = spec.series.flatMap((s) => s.points);
  if (pts.length === 0) {
    svg.appendChild(svgEl("text", {x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty"},
                          spec.empty || "no data yet"));
    return;
  }
  const xs = pts.map((p) => p[0]).concat((spec.vlines || []).map((v) => v.x));
  let ys = pts.map((p) => p[1]);
  if (spec.yzero) ys = ys.concat([0]);
  const yt = niceTicks(Math.min(...ys), Math.max(...ys), H < 180 ? 4 : 5, false);
  let x0 = Math.min(...xs), x1 = Math.max(...xs);
  if (x1 === x0) { x0 -= 1; x1 += 1; }
  const xt = niceTicks(x0, x1, Math.max(2, Math.min(8, Math.floor((W - L - R) / 70))), spec.xint !== false);
  const sx = (x) => L + ((x - xt.lo) / (xt.hi - xt.lo)) * (W - L - R);
  const sy = (y) => H - B - ((y - yt.lo) / (yt.hi - yt.lo)) * (H - T - B);
  const axes = svgEl("g", {class: "axes"});
  axes.appendChild(svgEl("line", {x1: L, y1: H - B, x2: W - R, y2: H - B}));
  axes.appendChild(svgEl("line", {x1: L, y1: T, x2: L, y2: H - B}));
  const ylabels = svgEl("g", {class: "yticks"});
  yt.ticks.forEach((y, i) => {
    axes.appendChild(svgEl("line", {x1: L, y1: sy(y), x2: W - R, y2: sy(y), class: y === 0 ? "grid zero" : "grid"}));
    ylabels.appendChild(svgEl("text", {x: L - 5, y: sy(y) + 4, "text-anchor": "end"}, yt.labels[i]));
  });
  const xlabels = svgEl("g", {class: "xticks"});
  let lastRight = -Infinity;
  xt.ticks.forEach((x, i) => {
    const text = xt.labels[i], half = 3.5 * text.length + 4;
    if (sx(x) - half < lastRight) return;  // never one label over another
    lastRight = sx(x) + half;
    axes.appendChild(svgEl("line", {x1: sx(x), y1: H - B, x2: sx(x), y2: H - B + 4}));
    xlabels.appendChild(svgEl("text", {x: sx(x), y: H - B + 15, "text-anchor": "middle"}, text));
  });
  axes.appendChild(ylabels);
  axes.appendChild(xlabels);
  if (spec.xlabel) axes.appendChild(svgEl("text", {x: (L + W - R) / 2, y: H - 6, "text-anchor": "middle", class: "xlabel"},
                                          spec.xlabel));
  svg.appendChild(axes);
  let lastV = -Infinity;
  for (const v of spec.vlines || []) {
    svg.appendChild(svgEl("line", {x1: sx(v.x), y1: T, x2: sx(v.x), y2: H - B, class: "vline"}));
    if (sx(v.x) - lastV < 8 + 7 * v.label.length) continue;  // labels of close versions would overlap
    lastV = sx(v.x);
    const right = sx(v.x) > W - R - 30;
    svg.appendChild(svgEl("text", {x: sx(v.x) + (right ? -3 : 3), y: T + 10, class: "vlabel",
                                   "text-anchor": right ? "end" : "start"}, v.label));
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
    lx += 24 + 6.5 * s.name.length;
  });
  if (spec.legend !== false) svg.appendChild(legend);  // a chart under a caption naming its one series needs none
}
