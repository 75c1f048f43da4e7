// fusion-oci dashboard page: renders /api/summary and re-renders on each "summary" event of
// /api/stream. Text from the log is only ever set with textContent (never as HTML).
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const COLORS = ["#5c8dd6", "#43a047", "#8e24aa", "#f4511e", "#00897b", "#6d4c41", "#3949ab"];
  let chart = null;
  let chartKey = "";
  let bucketS = 1;  // the timeline's bucket, in seconds (the x scale's range reads it)

  function el(tag, text, cls) {
    const e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }

  // columns: [{label, get(row) -> value|Node, num?: bool}]
  function table(id, columns, rows, emptyText) {
    const t = $(id);
    t.replaceChildren();
    const head = el("tr");
    for (const c of columns) head.appendChild(el("th", c.label));
    t.appendChild(el("thead")).appendChild(head);
    const body = t.appendChild(el("tbody"));
    if (!rows.length) {
      const tr = body.appendChild(el("tr"));
      const td = tr.appendChild(el("td", emptyText || "none", "empty"));
      td.colSpan = columns.length;
      return;
    }
    for (const r of rows) {
      const tr = body.appendChild(el("tr"));
      for (const c of columns) {
        const v = c.get(r);
        const td = tr.appendChild(el("td", null, c.num ? "n" : ""));
        if (v instanceof Node) td.appendChild(v); else td.textContent = v == null ? "–" : String(v);
      }
    }
  }

  function bar(value, max, cls) {
    const span = el("span");
    const b = span.appendChild(el("span", null, "bar" + (cls ? " " + cls : "")));
    b.style.width = (max > 0 ? Math.round(120 * value / max) : 0) + "px";
    span.appendChild(document.createTextNode(value == null ? "–" : String(value)));
    return span;
  }

  function counts(obj) { return Object.entries(obj).map(([k, v]) => ({ key: k, n: v })); }
  function maxOf(rows, f) { return rows.reduce((m, r) => Math.max(m, f(r) || 0), 0); }
  function taskLink(id) {
    const a = el("a", id);
    a.href = "/task/" + encodeURIComponent(id);
    return a;
  }

  function renderTimeline(tl) {
    const box = $("timeline");
    const names = Object.keys(tl.series);
    if (!tl.times.length) {
      if (chart) { chart.destroy(); chart = null; chartKey = ""; box.uplot = null; }
      box.replaceChildren(el("p", "no runs yet", "empty"));
      $("timeline-note").textContent = "";
      return;
    }
    $("timeline-note").textContent = "runs per " + tl.bucketSeconds +
      " s, stacked by backend; the dashed line counts failing runs";
    // Stacked bars: each backend's bar reaches the running total; the tallest is drawn
    // first so the shorter ones paint over it. The legend shows each backend's own count.
    const raw = names.map((n) => tl.series[n]);
    const stacked = [];
    let acc = tl.times.map(() => 0);
    for (const r of raw) { acc = acc.map((v, i) => v + r[i]); stacked.push(acc); }
    const order = names.map((_, i) => names.length - 1 - i);
    // Each bar at the middle of its bucket; the x scale spans the buckets, in seconds (uPlot's
    // time unit). Left to uPlot, one bucket (runs within a second) got an axis of 1000 days.
    bucketS = tl.bucketSeconds;
    const mids = tl.times.map((t) => t + bucketS / 2);
    const data = [mids, ...order.map((i) => stacked[i]), tl.failing];
    const key = names.join("|");
    if (chart && key === chartKey) { chart.setData(data); return; }
    if (chart) chart.destroy();
    box.replaceChildren();
    const bars = uPlot.paths.bars({ size: [0.8, 80] });
    const series = [{}, ...order.map((i) => ({
      label: names[i], stroke: COLORS[i % COLORS.length], fill: COLORS[i % COLORS.length],
      paths: bars, points: { show: false },
      value: (u, v, si, idx) => (idx == null ? "--" : raw[i][idx]),
    })), { label: "failing", stroke: "#c62828", dash: [4, 4], width: 1.5,
           points: { show: true, size: 4 } }];
    chart = new uPlot({
      width: Math.max(320, box.clientWidth - 10), height: 220, series,
      scales: {
        // from the data, not uPlot's min/max: for one point it passes max = min + 1000 days
        x: { time: true, range: (u) => {
          const xs = u.data[0];
          return [xs[0] - bucketS / 2, xs[xs.length - 1] + bucketS / 2];
        } },
        y: { range: (u, min, max) => [0, Math.max(1, max)] },
      },
      axes: [{}, { label: "runs" }],
    }, data, box);
    box.uplot = chart;  // the page's tests read its scales (the axis range) from here
    chartKey = key;
  }

  function render(s) {
    $("log-error").hidden = !s.source.error;
    $("log-error").textContent = s.source.error ? "cannot read the log: " + s.source.error : "";
    $("n-events").textContent = s.log.events;
    $("n-runs").textContent = s.runs.total;
    $("n-failing").textContent = s.runs.failing;
    $("n-fallbacks").textContent = s.fallbacks.total;
    $("n-failures").textContent = s.failures.total;
    $("n-tasks").textContent = s.tasks.total;
    $("n-malformed").textContent = s.log.malformed;
    $("n-malformed").className = "num" + (s.log.malformed ? " bad" : "");
    const ch = s.chain;
    $("chain-status").textContent = ch.status;
    $("chain-status").className = "num " + (ch.status === "ok" ? "ok" :
      ch.status === "broken" || ch.status === "error" ? "bad" : "muted");
    $("chain-detail").textContent = ch.status === "broken"
      ? "first bad line " + ch.firstBadLine + ": " + (ch.reason || "")
      : (ch.reason || (ch.lines != null ? ch.lines + " lines verified" +
         (ch.keyed ? " (hashes and MACs)" : " (hashes only: no audit key here)") : ""));

    renderTimeline(s.timeline);

    const db = s.durations.byBackend;
    const dmax = maxOf(db, (r) => r.p95);
    table("durations-backend", [
      { label: "backend", get: (r) => r.backend },
      { label: "runs", get: (r) => r.runs, num: true },
      { label: "p50", get: (r) => bar(r.p50, dmax) },
      { label: "p95", get: (r) => bar(r.p95, dmax, "p95") },
      { label: "max", get: (r) => r.max, num: true },
    ], db, "no runs with a duration");

    const pb = s.durations.prepareByBackend;
    const pmax = maxOf(pb, (r) => r.p95);
    table("prepare-backend", [
      { label: "backend", get: (r) => r.backend },
      { label: "prepares", get: (r) => r.runs, num: true },
      { label: "p50", get: (r) => bar(r.p50, pmax) },
      { label: "p95", get: (r) => bar(r.p95, pmax, "p95") },
      { label: "max", get: (r) => r.max, num: true },
    ], pb, "no prepares with a duration");

    table("durations-command", [
      { label: "command", get: (r) => r.command },
      { label: "backend", get: (r) => r.backend },
      { label: "runs", get: (r) => r.runs, num: true },
      { label: "p50", get: (r) => r.p50, num: true },
      { label: "p95", get: (r) => r.p95, num: true },
      { label: "max", get: (r) => r.max, num: true },
    ], s.durations.byCommand);

    const er = counts(s.endReasons);
    const emax = maxOf(er, (r) => r.n);
    table("end-reasons", [
      { label: "end reason", get: (r) => r.key },
      { label: "runs", get: (r) => bar(r.n, emax) },
    ], er, "no runs");
    table("exit-codes", [
      { label: "exit code", get: (r) => r.key },
      { label: "runs", get: (r) => r.n, num: true },
    ], counts(s.failingExits.byCode), "no failing exits");

    table("limits", [
      { label: "task", get: (r) => taskLink(r.taskId) },
      { label: "limit", get: (r) => el("span", r.endReason, "bad") },
      { label: "runs", get: (r) => r.runs, num: true },
    ], s.limits.byTask, "no run ended by a limit");

    table("failing-recent", [
      { label: "time", get: (r) => r.ts },
      { label: "task", get: (r) => taskLink(r.taskId) },
      { label: "backend", get: (r) => r.backend },
      { label: "command", get: (r) => r.command },
      { label: "exit / end", get: (r) => r.endReason !== "exit" ? r.endReason : r.exitCode },
      { label: "ms", get: (r) => r.durationMs, num: true },
    ], s.failingExits.recent, "no failing runs");

    for (const key of ["fallbacks", "failures"]) {
      table(key, [
        { label: "reason", get: (r) => r.reason },
        { label: "count", get: (r) => r.count, num: true },
      ], s[key].byReason, "none");
    }
    table("unenforced", [
      { label: "policy part", get: (r) => r.key },
      { label: "events", get: (r) => r.n, num: true },
    ], counts(s.unenforced), "every part enforced");
    table("gates", [
      { label: "gate", get: (r) => r.gate },
      { label: "decision", get: (r) => el("span", r.decision, r.decision === "deny" ? "bad" : "ok") },
      { label: "decided by", get: (r) => r.decidedBy },
      { label: "count", get: (r) => r.count, num: true },
    ], s.gates.byDecision, "no gate decisions");
    $("retries").textContent = "retries: " + s.provisioning.retries;
    table("provisioning", [
      { label: "time", get: (r) => r.ts },
      { label: "action", get: (r) => r.action },
      { label: "outcome", get: (r) => r.outcome },
      { label: "ref", get: (r) => r.ref },
      { label: "digest", get: (r) => el("code", r.digest || "–") },
      { label: "ms", get: (r) => r.durationMs, num: true },
      { label: "attempt", get: (r) => r.attempt, num: true },
    ], s.provisioning.recent, "no provisioning");
    table("tasks", [
      { label: "task", get: (r) => taskLink(r.taskId) },
      { label: "events", get: (r) => r.events, num: true },
      { label: "runs", get: (r) => r.runs, num: true },
      { label: "failing", get: (r) => r.failing, num: true },
      { label: "backends", get: (r) => r.backends.join(", ") },
      { label: "last event", get: (r) => r.lastTs },
      { label: "policy hash", get: (r) => el("code", (r.policyHash || "–").slice(0, 16)) },
    ], s.tasks.recent, "no tasks");
    renderEgress(s.egress);
    renderCredentials(s.credentials);
    document.body.dataset.cursor = s.source.cursor;
  }

  // Egress (sandbox:egress events of filtered networks): per task, and the top denied hosts.
  function renderEgress(e) {
    if (!e) return;
    $("egress-note").textContent = e.allowed + " allowed, " + e.denied + " denied; " +
      e.bytesUp + " bytes up, " + e.bytesDown + " bytes down";
    const emax = maxOf(e.byTask, (r) => r.connections);
    table("egress-tasks", [
      { label: "task", get: (r) => taskLink(r.taskId) },
      { label: "connections", get: (r) => bar(r.connections, emax) },
      { label: "allowed", get: (r) => r.allowed, num: true },
      { label: "denied", get: (r) => el("span", r.denied, r.denied ? "bad" : ""), num: true },
      { label: "bytes up", get: (r) => r.bytesUp, num: true },
      { label: "bytes down", get: (r) => r.bytesDown, num: true },
      { label: "hosts", get: (r) => r.hosts, num: true },
      { label: "host services", get: (r) => r.services || 0, num: true },
      { label: "published (inbound)", get: (r) => r.inbound || 0, num: true },
    ], e.byTask, "no egress (no task with network: filtered, hostServices or publishPorts)");
    table("egress-denied", [
      { label: "host", get: (r) => el("code", r.host) },
      { label: "count", get: (r) => r.count, num: true },
      { label: "rule", get: (r) => r.rule },
    ], e.topDenied, "nothing denied");
  }

  // Brokered credentials (sandbox:credential events): swaps per task and host, and the
  // latest refusals (leak attempts, pushes outside allowedRefs). Names only, never values.
  function renderCredentials(c) {
    if (!c) return;
    $("credentials-note").textContent = c.swaps + " swapped, " + c.leakAttempts +
      " leak attempts";
    table("credential-swaps", [
      { label: "task", get: (r) => taskLink(r.taskId) },
      { label: "host", get: (r) => el("code", r.host) },
      { label: "credential", get: (r) => el("code", r.credential) },
      { label: "swaps", get: (r) => r.swaps, num: true },
    ], c.byTask, "no brokered credential used");
    table("credential-refused", [
      { label: "task", get: (r) => taskLink(r.taskId) },
      { label: "host", get: (r) => el("code", r.host || "?") },
      { label: "credential", get: (r) => el("code", r.credential) },
      { label: "what", get: (r) => el("span", r.leak ? "leak attempt" : "refused", "bad") },
      { label: "reason", get: (r) => r.reason },
    ], c.recentRefused, "nothing refused");
  }

  function connect() {
    const live = $("live");
    const es = new EventSource("/api/stream?events=0");
    es.addEventListener("summary", (m) => {
      render(JSON.parse(m.data));
      live.textContent = "live"; live.className = "badge on";
    });
    es.onerror = () => { live.textContent = "reconnecting…"; live.className = "badge off"; };
  }

  fetch("/api/summary").then((r) => r.json()).then(render).finally(connect);
})();
