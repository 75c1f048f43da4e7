/** exec() against util.promisify(child_process.exec): the same result and the same error. */

import assert from "node:assert/strict";
import { exec as nodeExec } from "node:child_process";
import { promisify } from "node:util";
import { after, describe, test } from "node:test";

import { disposeExecSandboxes, exec, ExecOptions } from "../src";
import { options, worktree } from "./helpers";

const nodeRun = promisify(nodeExec);

after(() => disposeExecSandboxes());

async function outcome(p: Promise<{ stdout: string; stderr: string }>): Promise<unknown> {
  try {
    return { resolved: await p };
  } catch (e) {
    const err = e as Error & Record<string, unknown>;
    const picked: Record<string, unknown> = { class: err.constructor.name, message: err.message };
    for (const key of Object.keys(err)) picked[key] = err[key];
    return { rejected: picked, keys: Object.keys(err) };
  }
}

for (const backend of ["native", "bubblewrap"] as const) {
  describe(`exec drop-in on ${backend}`, () => {
    const wt = worktree();
    const ours = (cmd: string, o: ExecOptions = {}) =>
      exec(cmd, { ...options(backend), cwd: wt, ...o });
    const theirs = (cmd: string, o: { timeout?: number; maxBuffer?: number } = {}) =>
      nodeRun(cmd, { cwd: wt, ...o });

    test("success", async () => {
      const cmd = "echo out; echo err >&2";
      assert.deepEqual(await outcome(ours(cmd)), await outcome(theirs(cmd)));
    });

    test("exit 3", async () => {
      const cmd = "echo out; echo err >&2; exit 3";
      assert.deepEqual(await outcome(ours(cmd)), await outcome(theirs(cmd)));
    });

    test("timeout", async () => {
      const cmd = "echo a; sleep 5";
      assert.deepEqual(await outcome(ours(cmd, { timeout: 600 })),
        await outcome(theirs(cmd, { timeout: 600 })));
    });

    test("maxBuffer", async () => {
      const cmd = "head -c 5000 /dev/zero | tr '\\0' y";
      assert.deepEqual(await outcome(ours(cmd, { maxBuffer: 100 })),
        await outcome(theirs(cmd, { maxBuffer: 100 })));
    });

    test("encoding buffer gives Buffers of the exact bytes", async () => {
      const got = await exec("printf '\\377'", { ...options(backend), cwd: wt, encoding: "buffer" });
      assert.deepEqual(got.stdout, Buffer.from([0xff]));
    });

    test("an AbortSignal rejects with an AbortError", async () => {
      const ac = new AbortController();
      setTimeout(() => ac.abort(), 300);
      await assert.rejects(ours("sleep 20", { signal: ac.signal }),
        (e: Error & { code?: string }) => e.name === "AbortError" && e.code === "ABORT_ERR");
    });
  });
}
