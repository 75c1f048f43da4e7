// The task view: the server rendered the task's events; new ones arrive on /api/stream.
"use strict";
(function () {
  const t = document.getElementById("task-events");
  const live = document.getElementById("live");
  const body = t.tBodies[0];
  let last = Number(t.dataset.cursor || 0);
  const cell = (tr, v) => { tr.appendChild(document.createElement("td")).textContent = v == null ? "" : String(v); };
  const q = "task=" + encodeURIComponent(t.dataset.task) + "&summary=0&since=" + last;
  const es = new EventSource("/api/stream?" + q);
  es.addEventListener("audit", (m) => {
    const e = JSON.parse(m.data);
    if (e.line <= last) return;
    last = e.line;
    const tr = body.appendChild(document.createElement("tr"));
    tr.dataset.line = e.line;
    tr.className = "new";
    const end = e.endReason && e.endReason !== "exit" ? e.endReason : e.exitCode;
    for (const v of [e.line, e.ts, e.type.replace("sandbox:", ""), e.runId, e.backend,
                     e.command, end, e.durationMs, e.reason || (e.unenforced || []).join(", ")]) {
      cell(tr, v);
    }
    if (e.policyHash) {
      document.getElementById("policy-hash").textContent = e.policyHash;
      document.getElementById("policy-summary").textContent = e.policySummary || "–";
    }
    const none = document.getElementById("no-events");
    if (none) none.remove();
  });
  es.addEventListener("reset", () => window.location.reload());
  es.onopen = () => { live.textContent = "live"; live.className = "badge on"; };
  es.onerror = () => { live.textContent = "reconnecting…"; live.className = "badge off"; };
})();
