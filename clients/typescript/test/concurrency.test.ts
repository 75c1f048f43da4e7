/** One server, many sandboxes of different backends, 20 runs at once. */

import assert from "node:assert/strict";
import { test } from "node:test";

import { createSandboxBackend, FusionOciServer, SandboxBackendId } from "../src";
import { NO_NET, options, SERVER, SERVER_ENV, taskId, worktree } from "./helpers";

test("20 concurrent runs over 4 sandboxes on one server, each output its own", async () => {
  const server = new FusionOciServer({ serverCommand: SERVER, serverEnv: SERVER_ENV });
  const backends: SandboxBackendId[] = ["native", "bubblewrap", "native", "bubblewrap"];
  const sandboxes = await Promise.all(backends.map(async (backend, i) => {
    const wt = worktree();
    const sb = createSandboxBackend(options(backend, { server }));
    await sb.prepare({ taskId: taskId(`many-${i}`), runId: "r1", worktreePath: wt, policy: NO_NET });
    return { sb, wt, backend };
  }));
  try {
    const runs = Array.from({ length: 20 }, (_, n) => {
      const { sb, wt, backend } = sandboxes[n % sandboxes.length]!;
      const streamed: Buffer[] = [];
      return sb.run(`sleep 0.${n % 5}; echo ${n}; echo ${n} >&2`, {
        cwd: wt, timeoutMs: 60_000, maxBuffer: 1000, onStdout: (c) => streamed.push(c),
      }).then((res) => ({ res, streamed: Buffer.concat(streamed).toString(), n, backend }));
    });
    for (const { res, streamed, n, backend } of await Promise.all(runs)) {
      assert.deepEqual([res.exitCode, res.stdout, res.stderr, streamed, res.backend],
        [0, `${n}\n`, `${n}\n`, `${n}\n`, backend]);
    }
  } finally {
    await Promise.all(sandboxes.map(({ sb }) => sb.dispose()));
    await server.close();
  }
});
