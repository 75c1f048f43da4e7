/**
 * exec(): a drop-in for util.promisify(child_process.exec) whose commands run in a sandbox.
 *
 *   - import { exec } from "node:child_process"; const run = promisify(exec);
 *   + import { exec as run } from "@fusion-oci/client";
 *
 * The first call for a worktree prepares a sandbox (reused by later calls with the same
 * options; `disposeExecSandboxes()` ends them, and so does this process's exit).
 */

import { randomBytes } from "node:crypto";
import { existsSync } from "node:fs";
import { dirname, join, resolve } from "node:path";

import { createSandboxBackend, SandboxBackendOptions } from "./backend";
import type { SandboxBackend, SandboxPolicy } from "./types";

export interface ExecOptions extends SandboxBackendOptions {
  /** Working directory; also the worktree unless `worktreePath` says otherwise. */
  cwd?: string | URL;
  env?: NodeJS.ProcessEnv;
  /** "buffer" resolves Buffers; any other encoding decodes with it (default utf8). */
  encoding?: BufferEncoding | "buffer" | null;
  /** Milliseconds; 0 or unset: no limit (as Node's exec). */
  timeout?: number;
  /** Most bytes of stdout and of stderr each (default 1 MiB, as Node's exec). */
  maxBuffer?: number;
  signal?: AbortSignal;
  /** Ignored: the sandbox runs every command line with `sh -c`. */
  shell?: string;
  /** Ignored (Node-only knobs kept so the options type-check unchanged). */
  killSignal?: NodeJS.Signals | number;
  windowsHide?: boolean;
  uid?: number;
  gid?: number;
  /** The task's worktree (default: the git work tree holding cwd, else cwd). */
  worktreePath?: string;
  taskId?: string;
  runId?: string;
  /** The brief's policy for the sandbox (default: the settings' policy). */
  policy?: SandboxPolicy;
  stdin?: string | Uint8Array;
  onStdout?: (chunk: Buffer) => void;
  onStderr?: (chunk: Buffer) => void;
}

export interface ExecResult<T extends string | Buffer = string> {
  stdout: T;
  stderr: T;
}

/** The error exec rejects with: the fields Node's exec error has. */
export interface ExecError extends Error {
  code?: number | string | null;
  signal?: NodeJS.Signals | null;
  killed?: boolean;
  cmd: string;
  stdout: string | Buffer;
  stderr: string | Buffer;
}

const NODE_DEFAULT_MAX_BUFFER = 1024 * 1024;
const NO_LIMIT_MS = 2 ** 31 - 1;
const processRunId = `exec-${Date.now().toString(36)}-${randomBytes(3).toString("hex")}`;
const sandboxes = new Map<string, Promise<SandboxBackend>>();

function sandboxFor(options: ExecOptions, worktree: string): Promise<SandboxBackend> {
  const { backend, failureMode, projectDir, taskPrompt, settings, serverCommand, socketPath,
    serverStderr, taskId, runId, policy } = options;
  const key = JSON.stringify({ worktree, backend, failureMode, projectDir, taskPrompt, settings,
    serverCommand, socketPath, serverStderr, taskId, runId, policy,
    gate: Boolean(options.onGate), server: Boolean(options.server) });
  let ready = sandboxes.get(key);
  if (!ready) {
    const sb = createSandboxBackend(options);
    ready = sb.prepare({
      taskId: taskId ?? "exec", runId: runId ?? processRunId, worktreePath: worktree,
      policy: policy as SandboxPolicy,
    }).then(() => sb);
    ready.catch(() => sandboxes.delete(key));
    sandboxes.set(key, ready);
  }
  return ready;
}

/** Dispose every sandbox exec() prepared. */
export async function disposeExecSandboxes(): Promise<void> {
  const all = [...sandboxes.values()];
  sandboxes.clear();
  await Promise.all(all.map(async (p) => (await p.catch(() => undefined))?.dispose()));
}

/** The top of the git work tree holding ``dir`` (a `.git` folder or file), else ``dir``. */
function workTreeOf(dir: string): string {
  for (let d = resolve(dir); ; d = dirname(d)) {
    if (existsSync(join(d, ".git"))) return d;
    if (dirname(d) === d) return dir;
  }
}

function pathOf(cwd: string | URL | undefined): string | undefined {
  if (cwd === undefined) return undefined;
  return cwd instanceof URL ? decodeURIComponent(cwd.pathname) : cwd;
}

export function exec(command: string, options?: ExecOptions & { encoding: "buffer" | null }
): Promise<ExecResult<Buffer>>;
export function exec(command: string, options?: ExecOptions): Promise<ExecResult<string>>;
export async function exec(command: string, options: ExecOptions = {}
): Promise<ExecResult<string | Buffer>> {
  const cwd = pathOf(options.cwd) ?? process.cwd();
  const worktree = options.worktreePath ?? workTreeOf(cwd);
  const maxBuffer = options.maxBuffer ?? NODE_DEFAULT_MAX_BUFFER;
  const asBuffer = options.encoding === "buffer" || options.encoding === null;
  const encoding: BufferEncoding =
    options.encoding && options.encoding !== "buffer" ? options.encoding : "utf8";
  const kept = { stdout: [] as Buffer[], stderr: [] as Buffer[], out: 0, err: 0 };
  const keep = (which: "stdout" | "stderr", chunk: Buffer) => {
    const size = which === "stdout" ? kept.out : kept.err;
    const part = chunk.subarray(0, Math.max(0, maxBuffer - size));
    kept[which].push(part);
    if (which === "stdout") kept.out += part.length; else kept.err += part.length;
  };
  const decode = (parts: Buffer[]) =>
    asBuffer ? Buffer.concat(parts) : Buffer.concat(parts).toString(encoding);
  const sandbox = await sandboxFor(options, worktree);
  const result = await sandbox.run(command, {
    cwd, timeoutMs: options.timeout && options.timeout > 0 ? options.timeout : NO_LIMIT_MS,
    maxBuffer, env: options.env, signal: options.signal, stdin: options.stdin,
    onStdout: (c) => { keep("stdout", c); options.onStdout?.(c); },
    onStderr: (c) => { keep("stderr", c); options.onStderr?.(c); },
  });
  const stdout = decode(kept.stdout);
  const stderr = decode(kept.stderr);
  if (result.reason === "exit" && result.exitCode === 0) return { stdout, stderr };
  let error: ExecError;
  if (result.reason === "max-buffer") {
    const which = kept.out >= maxBuffer ? "stdout" : "stderr";
    error = Object.assign(new RangeError(`${which} maxBuffer length exceeded`),
      { code: "ERR_CHILD_PROCESS_STDIO_MAXBUFFER", cmd: command, stdout, stderr });
  } else if (result.reason === "aborted") {
    const abort = new Error("The operation was aborted");
    abort.name = "AbortError";
    error = Object.assign(abort, { code: "ABORT_ERR", cmd: command, stdout, stderr });
  } else {
    const timedOut = result.reason === "timeout";
    error = Object.assign(new Error(`Command failed: ${command}\n${stderr.toString()}`), {
      code: result.exitCode,
      killed: timedOut,
      signal: timedOut ? "SIGTERM" as NodeJS.Signals : result.signal,
      cmd: command, stdout, stderr,
    });
  }
  throw error;
}
