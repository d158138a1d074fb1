// The Usage page: GPU-hours per UTC day, one stacked area per user.
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("usage-series").textContent);
  var traces = Object.keys(data.series).map(function (user) {
    return {
      x: data.days,
      y: data.series[user],
      name: user,
      type: "scatter",
      mode: "lines",
      stackgroup: "users",
      hovertemplate: "%{y:.2f} GPU-h<extra>" + user + "</extra>",
    };
  });
  var layout = {
    margin: { t: 10, r: 10, b: 40, l: 50 },
    yaxis: { title: { text: "GPU-hours" }, rangemode: "tozero" },
    // The chosen range, whatever days have GPU time (a range of one day is
    // left to Plotly, which would otherwise draw a zero-width axis).
    xaxis: data.days.length > 1
      ? { type: "date", range: [data.days[0], data.days[data.days.length - 1]] }
      : { type: "date" },
    showlegend: true,
  };
  Plotly.newPlot("usage-chart", traces, layout, { responsive: true, displaylogo: false });
})();
