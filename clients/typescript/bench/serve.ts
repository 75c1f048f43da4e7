/**
 * Per-command overhead from Node, driven by benchmarks/bench_serve.py (which prints ratios).
 *
 *   node dist/bench/serve.js CONFIG_JSON
 *
 * Prepares a sandbox per case through `fusion-oci serve`, prints "ready", then answers each
 * stdin line `serve BACKEND` (one `run("true")` through the server) or `raw BACKEND` (the
 * runtime's own tool started with execFile, the floor an executor has today) or `ping BACKEND`
 * (one request that runs nothing: the protocol's own round trip) with the
 * milliseconds it took. The driver interleaves these with its Python API samples, so the
 * noise of a shared machine falls on every column alike.
 */

import { execFile } from "node:child_process";
import { mkdtempSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createInterface } from "node:readline";
import { promisify } from "node:util";

import { createSandboxBackend, FusionOciServer, SandboxBackend, SandboxBackendId } from "../src";

const execFileP = promisify(execFile);

interface Case {
  backend: SandboxBackendId;
  settings: Record<string, unknown>;
  raw: string[];
}

interface Config {
  serverCommand: string[];
  cases: Case[];
}

async function main(): Promise<void> {
  const config = JSON.parse(process.argv[2]!) as Config;
  const server = new FusionOciServer({ serverCommand: config.serverCommand });
  const prepared = new Map<string, { sb: SandboxBackend; wt: string; raw: string[] }>();
  for (const c of config.cases) {
    const wt = mkdtempSync(join(tmpdir(), "fusion-oci-bench-"));
    await execFileP("git", ["init", "-q", wt]);
    const sb = createSandboxBackend({ backend: c.backend, settings: c.settings, server });
    await sb.prepare({ taskId: `bench-node-${c.backend}`, runId: "r", worktreePath: wt,
      policy: { allowNetwork: false, allowedPaths: [] } });
    prepared.set(c.backend, { sb, wt, raw: c.raw });
  }
  process.stdout.write("ready\n");
  for await (const line of createInterface({ input: process.stdin })) {
    const [kind, backend] = line.trim().split(/\s+/);
    const p = prepared.get(backend ?? "");
    if (!p) break;
    const start = process.hrtime.bigint();
    try {
      if (kind === "ping") {
        await server.request("initialize", { protocolVersion: "1.0" });
      } else if (kind === "serve") {
        const res = await p.sb.run("true", { cwd: p.wt, timeoutMs: 60_000, maxBuffer: 1 << 20 });
        if (res.exitCode !== 0) throw new Error(`exit ${res.exitCode}: ${res.stderr}`);
      } else {
        const [cmd, ...args] = p.raw;
        await execFileP(cmd!, args);
      }
      process.stdout.write(`${Number(process.hrtime.bigint() - start) / 1e6}\n`);
    } catch (err) {
      // A failed sample (an engine hiccup on a busy machine) is reported, not timed.
      process.stdout.write(`error ${String(err).split("\n")[0]}\n`);
    }
  }
  for (const p of prepared.values()) await p.sb.dispose();
  await server.close();
}

void main();
