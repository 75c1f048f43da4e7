// The published declarations type-check for every consumer: the package as `npm pack` makes
// it, installed into a throwaway project per moduleResolution (node10, node16 CJS and ESM,
// bundler), compiled with `tsc --noEmit`, strict and without skipLibCheck. Nothing is fetched:
// the package's own dependencies are linked in from this checkout's node_modules.
import { test } from "node:test";
import assert from "node:assert/strict";
import { execFileSync, spawnSync } from "node:child_process";
import { mkdirSync, mkdtempSync, readdirSync, rmSync, symlinkSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";

const PKG = resolve(__dirname, "..", "..");
const TSC = join(PKG, "node_modules", "typescript", "bin", "tsc");

const CONSUMER = `
import {
  createSandboxBackend, disposeExecSandboxes, exec, FusionOciServer, PROTOCOL_VERSION,
  SandboxError,
} from "@fusion-oci/client";
import type {
  ExecResult, GateRequest, SandboxBackend, SandboxBackendOptions, SandboxErrorKind,
  SandboxPolicy, SandboxRunResult, ServerConnection, ServerOptions,
} from "@fusion-oci/client";

const options: ServerOptions = { serverStderr: "pipe" };
const backendOptions: SandboxBackendOptions = { failureMode: "fail-hard" };
const policy: SandboxPolicy | undefined = undefined;
export async function use(server = new FusionOciServer(options)): Promise<number> {
  const live: ServerConnection = await server.connection();
  const backend: SandboxBackend = createSandboxBackend(backendOptions);
  const result: SandboxRunResult = await backend.run("true",
    { cwd: "/", timeoutMs: 1000, maxBuffer: 1 << 20 });
  const out: ExecResult<Buffer> = await exec("true", { encoding: "buffer" });
  const kind: SandboxErrorKind | undefined = new SandboxError("server-exited", "x").kind;
  const ask = (r: GateRequest): boolean => r.gate === "sandbox_provision";
  await disposeExecSandboxes();
  return live.generation + (result.exitCode ?? 0) + out.stdout.length + String(kind).length +
    Number(ask) + PROTOCOL_VERSION.length + Number(policy === undefined);
}
`;

const MODES: Record<string, { type?: "module"; compilerOptions: Record<string, string> }> = {
  node10: { compilerOptions: { module: "commonjs", moduleResolution: "node" } },
  node16: { compilerOptions: { module: "node16", moduleResolution: "node16" } },
  "node16-esm": { type: "module", compilerOptions: { module: "node16", moduleResolution: "node16" } },
  bundler: { compilerOptions: { module: "esnext", moduleResolution: "bundler" } },
};

function packed(into: string): string {
  // --ignore-scripts: `npm test` built dist/ just now; prepack would only build it again
  const out = execFileSync("npm", ["pack", "--ignore-scripts", "--json", "--pack-destination", into],
    { cwd: PKG, encoding: "utf8", stdio: ["ignore", "pipe", "pipe"] });
  return join(into, JSON.parse(out)[0].filename);
}

function consumer(root: string, mode: string, tarball: string): string {
  const dir = join(root, mode);
  const modules = join(dir, "node_modules");
  const client = join(modules, "@fusion-oci", "client");
  mkdirSync(client, { recursive: true });
  execFileSync("tar", ["-xzf", tarball, "-C", client, "--strip-components=1"]);
  for (const dep of readdirSync(join(PKG, "node_modules"))) {
    if (dep.startsWith(".") || dep === "typescript") continue;
    symlinkSync(join(PKG, "node_modules", dep), join(modules, dep));
  }
  const { type, compilerOptions } = MODES[mode];
  writeFileSync(join(dir, "package.json"),
    JSON.stringify({ name: `consumer-${mode}`, private: true, ...(type ? { type } : {}) }));
  writeFileSync(join(dir, "tsconfig.json"), JSON.stringify({
    compilerOptions: {
      ...compilerOptions, target: "ES2022", lib: ["ES2022"], types: ["node"], strict: true,
      noEmit: true, skipLibCheck: false,
    },
    files: ["index.ts"],
  }));
  writeFileSync(join(dir, "index.ts"), CONSUMER);
  return dir;
}

test("the packed declarations type-check under every moduleResolution", () => {
  const root = mkdtempSync(join(tmpdir(), "fusion-oci-consumers-"));
  try {
    const tarball = packed(root);
    const failures: string[] = [];
    for (const mode of Object.keys(MODES)) {
      const dir = consumer(root, mode, tarball);
      const r = spawnSync(process.execPath, [TSC, "-p", dir], { encoding: "utf8" });
      if (r.status !== 0) failures.push(`${mode}:\n${r.stdout}${r.stderr}`);
    }
    assert.deepEqual(failures, []);
  } finally {
    rmSync(root, { recursive: true, force: true });
  }
});
