// The terminal of a running interactive job (templates/portal/_terminal.html):
// xterm.js over /ws/interactive/<job>/terminal/ (portal/terminal/consumers.py).
// The terminal's id is kept in this tab's sessionStorage: a reload or a lost
// connection (a web process restarting) attaches to the same shell again, and
// the portal replays what it showed. Another tab gets a terminal of its own.
(function () {
  "use strict";
  const box = document.getElementById("job-terminal");
  if (!box || typeof Terminal === "undefined") return;
  const jobId = box.dataset.job;
  const key = "gpulab-terminal-" + jobId;
  const status = document.getElementById("terminal-status");
  const newButton = document.getElementById("terminal-new");
  const term = new Terminal({ cursorBlink: true, scrollback: 5000, fontSize: 14 });
  const fit = new FitAddon.FitAddon();
  term.loadAddon(fit);
  term.open(document.getElementById("terminal-screen"));
  fit.fit();
  // For tests and the curious: the page's terminal.
  window.gpulabTerminal = term;

  let ws = null;
  let terminalId = sessionStorage.getItem(key);
  let ended = false;
  let retries = 0;

  function setStatus(text) {
    status.textContent = text;
    box.dataset.state = text;
  }

  function send(message) {
    if (ws && ws.readyState === WebSocket.OPEN && terminalId) {
      ws.send(JSON.stringify(message));
    }
  }

  function connect() {
    const scheme = location.protocol === "https:" ? "wss" : "ws";
    ws = new WebSocket(scheme + "://" + location.host + "/ws/interactive/" + jobId + "/terminal/");
    const socket = ws;
    socket.onopen = function () {
      const hello = { type: "open", cols: term.cols, rows: term.rows };
      if (terminalId) hello.terminal = terminalId;
      socket.send(JSON.stringify(hello));
    };
    socket.onmessage = function (event) {
      const m = JSON.parse(event.data);
      if (m.type === "opened") {
        terminalId = m.terminal;
        sessionStorage.setItem(key, terminalId);
        retries = 0;
        setStatus("connected");
        term.focus();
      } else if (m.type === "output") {
        if (m.replay) term.reset();
        term.write(m.data);
      } else if (m.type === "exit") {
        ended = true;
        sessionStorage.removeItem(key);
        terminalId = null;
        let text = "terminal ended";
        if (m.code !== null && m.code !== undefined) text += " (exit status " + m.code + ")";
        if (m.message) text += ": " + m.message;
        term.write("\r\n\x1b[2m[" + text + "]\x1b[0m\r\n");
        setStatus("ended");
        newButton.hidden = false;
      } else if (m.type === "error") {
        console.warn("terminal:", m.message);
      }
    };
    socket.onclose = function (event) {
      if (socket !== ws) return;
      if (ended) return;
      if (event.code === 4404 || event.code === 4409) {
        setStatus("not available");
        return;
      }
      setStatus("reconnecting…");
      const delay = Math.min(5000, 250 * Math.pow(2, retries++));
      setTimeout(connect, delay);
    };
  }

  term.onData(function (data) { send({ type: "input", data: data }); });
  term.onResize(function (size) { send({ type: "resize", cols: size.cols, rows: size.rows }); });
  window.addEventListener("resize", function () { fit.fit(); });
  newButton.addEventListener("click", function () {
    newButton.hidden = true;
    ended = false;
    term.reset();
    setStatus("connecting…");
    connect();
  });
  connect();
})();
