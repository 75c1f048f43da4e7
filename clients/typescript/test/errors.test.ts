/** Each failure reaches the executor as a SandboxError with the CLI's kind. */

import assert from "node:assert/strict";
import { join } from "node:path";
import { after, test } from "node:test";

import {
  createSandboxBackend, FusionOciServer, GateRequest, SandboxError, SandboxErrorKind,
} from "../src";
import { NO_NET, options, scratchDir, SERVER, SERVER_ENV, worktree } from "./helpers";

const server = new FusionOciServer({ serverCommand: SERVER, serverEnv: SERVER_ENV });
after(() => server.close());

function kind(k: SandboxErrorKind) {
  return (e: unknown) => {
    assert.ok(e instanceof SandboxError, String(e));
    assert.equal(e.kind, k, e.message);
    assert.ok(e.what.length > 0);
    return true;
  };
}

const ctx = (wt = worktree()) => ({ taskId: "errs", runId: "r1", worktreePath: wt, policy: NO_NET });

test("bad-settings: a wrong settings value names the field", async () => {
  const sb = createSandboxBackend(options("native", { server, settings: { cacheMode: "sometimes" } }));
  await assert.rejects(sb.prepare(ctx()), (e: unknown) => kind("bad-settings")(e)
    && (e as SandboxError).message.includes("cacheMode"));
});

test("bad-flags: a relative worktree path, a folder that is no work tree", async () => {
  const sb = createSandboxBackend(options("native", { server }));
  await assert.rejects(sb.prepare({ ...ctx(), worktreePath: "relative/wt" }), kind("bad-flags"));
  const plain = scratchDir("fusion-oci-ts-plain-");
  await assert.rejects(sb.prepare(ctx(plain)), kind("bad-flags"));
  const unsafe = createSandboxBackend(options("native", { server, unsafeWorktree: true }));
  await unsafe.prepare(ctx(plain));
  await unsafe.dispose();
});

test("backend-unavailable with fail-hard; fallback-native runs natively and says so", async () => {
  const hard = createSandboxBackend(options("sandbox-exec", { server, failureMode: "fail-hard" }));
  await assert.rejects(hard.prepare(ctx()), kind("backend-unavailable"));
  const wt = worktree();
  const soft = createSandboxBackend(options("sandbox-exec", { server, failureMode: "fallback-native" }));
  await soft.prepare(ctx(wt));
  const res = await soft.run("echo hi", { cwd: wt, timeoutMs: 10_000, maxBuffer: 1000 });
  assert.deepEqual([res.stdout, res.backend, res.fellBack], ["hi\n", "native", true]);
  assert.equal(soft.id, "native");
  assert.equal(soft.capabilities().filesystemIsolation, "none");
  assert.ok(res.unenforced && res.unenforced.includes("filesystem isolation"));
  await soft.dispose();
});

test("ask gates go to onGate and its answers count: yes to one, no to the next", async () => {
  const asked: GateRequest[] = [];
  const sb = createSandboxBackend(options("podman", { server,
    settings: { image: "localhost/fusion-oci-test/absent:1", gates: { sandboxProvision: "ask",
      networkApi: "ask" } },
    onGate: (request) => {
      asked.push(request);
      return request.gate === "sandbox_provision";
    } }));
  await assert.rejects(sb.prepare(ctx()), (e: unknown) => kind("gate-denied")(e)
    && (e as SandboxError).what.includes("network_api"));
  assert.deepEqual(asked.map((a) => a.gate), ["sandbox_provision", "network_api"]);
  assert.equal(asked[0]!.target, "localhost/fusion-oci-test/absent:1");
  assert.equal(asked[0]!.backend, "podman");
  assert.ok(asked[0]!.question.includes("allow fusion-oci"));
});

test("without onGate an ask gate denies (nobody to ask)", async () => {
  const sb = createSandboxBackend(options("podman", { server,
    settings: { image: "localhost/fusion-oci-test/absent:1" } }));
  await assert.rejects(sb.prepare(ctx()), kind("gate-denied"));
});

test("the task prompt's **Sandbox:** line picks the backend", async () => {
  const wt = worktree();
  const sb = createSandboxBackend(options("native", { server,
    taskPrompt: "Fix the build.\n\n**Sandbox:** bubblewrap\n" }));
  await sb.prepare(ctx(wt));
  const res = await sb.run("echo x", { cwd: wt, timeoutMs: 30_000, maxBuffer: 1000 });
  assert.equal(res.backend, "bubblewrap");
  await sb.dispose();
});

test("protocol-version: a server of another major version is refused and ended", async () => {
  const sb = createSandboxBackend({
    serverCommand: [process.execPath, join(__dirname, "fixtures", "future-server.js")] });
  await assert.rejects(sb.prepare(ctx()), (e: unknown) => kind("protocol-version")(e)
    && (e as SandboxError).what.includes("2.0"));
});
