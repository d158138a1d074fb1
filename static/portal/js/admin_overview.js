// The admin overview's charts: utilisation (held vs used) and idle GPU-hours
// per day, from the series embedded in the page (json_script).
"use strict";
document.addEventListener("DOMContentLoaded", () => {
  const series = JSON.parse(document.getElementById("overview-series").textContent);
  const layout = (yTitle, range) => ({
    margin: { t: 10, r: 10, b: 40, l: 55 },
    barmode: "overlay",
    legend: { orientation: "h", y: 1.12 },
    xaxis: { type: "date" },
    yaxis: { title: { text: yTitle }, rangemode: "tozero", range },
  });
  const config = { displaylogo: false, responsive: true };
  Plotly.newPlot(
    "utilisation-chart",
    [
      { x: series.days, y: series.allocated, type: "bar", name: "held by jobs (%)",
        marker: { color: "#9ec5fe" } },
      { x: series.days, y: series.util, type: "scatter", mode: "lines+markers",
        name: "used: mean utilisation (%)", line: { color: "#0a58ca" },
        connectgaps: false },
    ],
    layout("% of GPU time", [0, 100]),
    config,
  );
  Plotly.newPlot(
    "idle-chart",
    [
      { x: series.days, y: series.idle, type: "bar", name: "idle GPU-hours",
        marker: { color: "#f0ad4e" } },
    ],
    layout("GPU-hours"),
    config,
  );
});
