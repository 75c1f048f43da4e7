/** The brief's lifecycle and the run options, against the real server, on every backend. */

import assert from "node:assert/strict";
import { after, before, describe, test } from "node:test";

import { createSandboxBackend, FusionOciServer, SandboxBackend, SandboxError } from "../src";
import { BACKENDS, marker, NO_NET, options, SERVER, SERVER_ENV, taskId, waitGone, worktree
} from "./helpers";

const RUN = { timeoutMs: 120_000, maxBuffer: 10 * 1024 * 1024 };

for (const backend of BACKENDS) {
  describe(`${backend}`, () => {
    const server = new FusionOciServer({ serverCommand: SERVER, serverEnv: SERVER_ENV });
    const wt = worktree();
    let sb: SandboxBackend;

    before(async () => {
      sb = createSandboxBackend(options(backend, { server }));
      await sb.prepare({ taskId: taskId(backend), runId: "r1", worktreePath: wt, policy: NO_NET });
    });
    after(async () => {
      await sb.dispose();
      await server.close();
    });

    test("lifecycle: exit status, stdout and stderr, the extended result", async () => {
      assert.equal(sb.id, backend);
      assert.equal(sb.capabilities().supportsLinux, true);
      const ok = await sb.run("echo out; echo err >&2", { cwd: wt, ...RUN });
      assert.deepEqual([ok.stdout, ok.stderr, ok.exitCode, ok.signal], ["out\n", "err\n", 0, null]);
      assert.equal(ok.reason, "exit");
      assert.equal(ok.backend, backend);
      assert.equal(ok.fellBack, false);
      assert.equal(typeof ok.durationMs, "number");
      const three = await sb.run("exit 3", { cwd: wt, ...RUN });
      assert.equal(three.exitCode, 3);
      const killed = await sb.run("kill -9 $$", { cwd: wt, ...RUN });
      assert.deepEqual([killed.exitCode, killed.signal, killed.reason], [null, "SIGKILL", "signal"]);
    });

    test("output streams before the command ends, bytes as written", async () => {
      const seen: { chunk: Buffer; at: number }[] = [];
      const errs: Buffer[] = [];
      const start = Date.now();
      const res = await sb.run("printf 'a\\377\\n'; sleep 1.5; echo b; echo e >&2", {
        cwd: wt, ...RUN,
        onStdout: (chunk) => seen.push({ chunk, at: Date.now() }),
        onStderr: (chunk) => errs.push(chunk),
      });
      const end = Date.now();
      assert.equal(res.exitCode, 0);
      assert.deepEqual(seen[0]!.chunk, Buffer.from([0x61, 0xff, 0x0a]));
      assert.ok(seen[0]!.at < end - 1000, `first chunk at +${seen[0]!.at - start} ms of ${end - start}`);
      assert.equal(Buffer.concat(seen.map((s) => s.chunk)).toString("latin1"), "a\xff\nb\n");
      assert.equal(Buffer.concat(errs).toString(), "e\n");
    });

    test("AbortSignal ends the whole tree; reason aborted", async () => {
      const mark = marker("abort");
      const ac = new AbortController();
      const res = await sb.run(
        `echo started; setsid sh -c 'sleep 100; :' ${mark} & sh -c 'sleep 100; :' ${mark}`, {
          cwd: wt, ...RUN, signal: ac.signal, onStdout: () => ac.abort(),
        });
      assert.deepEqual([res.reason, res.exitCode, res.signal], ["aborted", null, "SIGTERM"]);
      assert.equal(res.stdout, "started\n");
      assert.deepEqual(await waitGone(mark), []);
      const again = await sb.run("echo next", { cwd: wt, ...RUN });
      assert.equal(again.stdout, "next\n");
    });

    test("timeout ends the tree", async () => {
      const mark = marker("timeout");
      const res = await sb.run(`sh -c 'sleep 100; :' ${mark}`,
        { cwd: wt, timeoutMs: 700, maxBuffer: 1000 });
      assert.equal(res.timedOut, true);
      assert.equal(res.reason, "timeout");
      assert.equal(res.exitCode, null);
      assert.deepEqual(await waitGone(mark), []);
    });

    test("maxBuffer truncates and ends the command", async () => {
      const res = await sb.run("head -c 100000 /dev/zero | tr '\\0' x; sleep 30",
        { cwd: wt, timeoutMs: 60_000, maxBuffer: 1000 });
      assert.equal(res.truncated, true);
      assert.equal(res.reason, "max-buffer");
      assert.equal(res.stdout, "x".repeat(1000));
    });

    test("stdin is fed to the command", async () => {
      const res = await sb.run("cat; echo", { cwd: wt, ...RUN, stdin: "hello" });
      assert.equal(res.stdout, "hello\n");
      const bytes = await sb.run("od -An -tx1", { cwd: wt, ...RUN, stdin: Uint8Array.from([0, 255]) });
      assert.equal(bytes.stdout.trim(), "00 ff");
      const closed = await sb.run("cat", { cwd: wt, ...RUN });
      assert.equal(closed.stdout, "");
    });

    test("concurrent runs on one server", async () => {
      const n = backend === "native" || backend === "bubblewrap" ? 20 : 6;
      const results = await Promise.all(Array.from({ length: n }, (_, i) =>
        sb.run(`sleep 0.2; echo ${i}`, { cwd: wt, ...RUN })));
      assert.deepEqual(results.map((r) => r.stdout), results.map((_, i) => `${i}\n`));
    });

    test("run after dispose is a SandboxError", async () => {
      const other = createSandboxBackend(options(backend, { server }));
      await other.prepare({ taskId: taskId(`d-${backend}`), runId: "r1", worktreePath: wt,
        policy: NO_NET });
      await other.dispose();
      await assert.rejects(other.run("true", { cwd: wt, ...RUN }),
        (e: unknown) => e instanceof SandboxError && e.kind === "setup-failed");
    });
  });
}
