// Small time-series plots as inline SVG, drawn here. No chart library: six sparklines of at
// most 120 points take these few lines, where a library (uPlot ~50 KB, Chart.js ~200 KB) would
// be one more vendored file to keep current, for axes, tooltips and animations we do not draw.

const SVG = "http://www.w3.org/2000/svg";
const WIDTH = 300;
const HEIGHT = 80;

/**
 * Draw `series` (arrays of numbers or null, oldest first, each `length` long at most) into
 * `svg`, on a scale from 0 to the largest value (at least `floor`). Null leaves a gap.
 * Returns the top of the scale.
 */
export function plot(svg, series, length, floor = 1) {
  const values = series.flat().filter((v) => v !== null && Number.isFinite(v));
  const top = Math.max(floor, ...values);
  svg.setAttribute("viewBox", `0 0 ${WIDTH} ${HEIGHT}`);
  svg.setAttribute("preserveAspectRatio", "none");
  const shapes = [line(0, HEIGHT - 0.5, WIDTH, HEIGHT - 0.5, "axis")];
  series.forEach((points, k) => {
    const offset = length - points.length; // the newest point sits at the right edge
    let segment = [];
    const flush = () => {
      if (segment.length > 1) shapes.push(polyline(segment, `s${k + 1}`));
      segment = [];
    };
    points.forEach((v, i) => {
      if (v === null || !Number.isFinite(v)) return flush();
      const x = ((offset + i) / Math.max(length - 1, 1)) * WIDTH;
      const y = HEIGHT - 2 - (v / top) * (HEIGHT - 6);
      segment.push(`${x.toFixed(1)},${y.toFixed(1)}`);
    });
    flush();
  });
  svg.replaceChildren(...shapes);
  return top;
}

function line(x1, y1, x2, y2, cls) {
  const node = document.createElementNS(SVG, "line");
  for (const [name, value] of Object.entries({ x1, y1, x2, y2, class: cls })) {
    node.setAttribute(name, value);
  }
  return node;
}

function polyline(points, cls) {
  const node = document.createElementNS(SVG, "polyline");
  node.setAttribute("points", points.join(" "));
  node.setAttribute("class", cls);
  return node;
}
