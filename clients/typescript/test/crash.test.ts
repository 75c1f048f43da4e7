/** Nothing is left when the client is killed mid-run; a dying server rejects with server-exited
 * and the next call starts a new one. */

import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { existsSync, statSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";

import { createSandboxBackend, FusionOciServer, SandboxError } from "../src";
import {
  BACKENDS, containersOfTask, marker, NO_NET, options, pidsWith, scratchDir, SERVER, SERVER_ENV,
  taskId, waitGone, worktree,
} from "./helpers";

for (const backend of BACKENDS) {
  test(`${backend}: the client killed mid-run leaves no process or container`, async () => {
    const mark = marker(`victim-${backend}`);
    const task = taskId(`victim-${backend}`);
    const wt = worktree();
    const victim = spawn(process.execPath, [join(__dirname, "fixtures", "victim.js"), backend,
      mark, task, wt], { stdio: ["ignore", "pipe", "inherit"], env: process.env });
    await new Promise<void>((resolve, reject) => {
      victim.stdout.on("data", (c: Buffer) => { if (c.toString().includes("running")) resolve(); });
      victim.once("exit", (code) => reject(new Error(`victim exited early (${code})`)));
    });
    // "running" is printed as the command starts: its two shells may take a moment to exist
    // on a loaded machine.
    const started = Date.now() + 10_000;
    while (pidsWith(mark).length < 2 && Date.now() < started) {
      await new Promise((r) => setTimeout(r, 50));
    }
    assert.ok(pidsWith(mark).length >= 2, "the command's processes are running");
    if (backend === "podman" || backend === "docker") {
      assert.equal((await containersOfTask(backend, task)).length, 1);
    }
    victim.kill("SIGKILL");
    assert.deepEqual(await waitGone(mark, 20_000), []);
    if (backend === "podman" || backend === "docker") {
      const end = Date.now() + 20_000;
      let left = await containersOfTask(backend, task);
      while (left.length && Date.now() < end) {
        await new Promise((r) => setTimeout(r, 200));
        left = await containersOfTask(backend, task);
      }
      assert.deepEqual(left, []);
    }
  });
}

test("a server that dies rejects pending calls with server-exited; the next call starts one",
  async () => {
    const server = new FusionOciServer({ serverCommand: SERVER, serverEnv: SERVER_ENV });
    const wt = worktree();
    const sb = createSandboxBackend(options("native", { server }));
    await sb.prepare({ taskId: taskId("died"), runId: "r1", worktreePath: wt, policy: NO_NET });
    const first = await sb.run("echo $PPID", { cwd: wt, timeoutMs: 10_000, maxBuffer: 1000 });
    assert.equal(first.exitCode, 0);
    const mark = marker("died");
    // The command kills the server itself: the command's parent is its keeper, the keeper's
    // the sandbox's exec agent, the agent's the server.
    const pending = sb.run(`sh -c 'sleep 100; :' ${mark} & sleep 0.3; ` +
      "kill -9 $(ps -o ppid= -p $(ps -o ppid= -p $PPID))",
    { cwd: wt, timeoutMs: 60_000, maxBuffer: 1000 });
    await assert.rejects(pending, (e: unknown) =>
      e instanceof SandboxError && e.kind === "server-exited");
    assert.deepEqual(await waitGone(mark), [], "the agent ends the tree of a dead server");
    const again = await sb.run("echo back", { cwd: wt, timeoutMs: 10_000, maxBuffer: 1000 });
    assert.equal(again.stdout, "back\n");
    await sb.dispose();
    await server.close();
  });

test("a server that cannot start is server-exited", async () => {
  const sb = createSandboxBackend({ serverCommand: ["/nonexistent/fusion-oci", "serve"] });
  await assert.rejects(sb.prepare({ taskId: "t", runId: "r", worktreePath: worktree(),
    policy: NO_NET }), (e: unknown) => e instanceof SandboxError && e.kind === "server-exited");
  const dies = createSandboxBackend({ serverCommand: ["sh", "-c", "echo broken >&2; exit 3"] });
  await assert.rejects(dies.prepare({ taskId: "t", runId: "r", worktreePath: worktree(),
    policy: NO_NET }), (e: unknown) => e instanceof SandboxError && e.kind === "server-exited"
    && e.why.includes("broken"));
});

test("a server on a unix socket: clients connect, and one going away disposes only its own",
  async () => {
    const dir = scratchDir("fusion-oci-sock-");
    const path = join(dir, "serve.sock");
    const served = spawn(SERVER[0]!, [...SERVER.slice(1), "--socket", path],
      { env: SERVER_ENV, stdio: ["ignore", "ignore", "pipe"] });
    await new Promise<void>((resolve) => served.stderr.on("data", (c: Buffer) => {
      if (c.toString().includes("listening")) resolve();
    }));
    try {
      assert.equal(statSync(path).mode & 0o777, 0o600);
      const wt = worktree();
      const a = createSandboxBackend(options("native", { socketPath: path }));
      await a.prepare({ taskId: taskId("sock"), runId: "r1", worktreePath: wt, policy: NO_NET });
      const mark = marker("sock");
      const client = new FusionOciServer({ socketPath: path });
      const b = createSandboxBackend(options("native", { server: client }));
      await b.prepare({ taskId: taskId("sock-b"), runId: "r1", worktreePath: wt, policy: NO_NET });
      const pending = b.run(`echo up; sh -c 'sleep 100; :' ${mark}`,
        { cwd: wt, timeoutMs: 60_000, maxBuffer: 1000, onStdout: () => void client.close() });
      await assert.rejects(pending, (e: unknown) => e instanceof SandboxError
        && e.kind === "server-exited");
      assert.deepEqual(await waitGone(mark), [], "the closed connection's tree is ended");
      const res = await a.run("echo still", { cwd: wt, timeoutMs: 10_000, maxBuffer: 1000 });
      assert.equal(res.stdout, "still\n");
      await a.dispose();
    } finally {
      served.kill("SIGTERM");
      await new Promise((r) => served.once("exit", r));
    }
    assert.equal(existsSync(path), false, "the socket is removed on SIGTERM");
  });
