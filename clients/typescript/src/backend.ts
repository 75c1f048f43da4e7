/** createSandboxBackend: the brief's SandboxBackend over `fusion-oci serve`. */

import { randomBytes } from "node:crypto";

import { SandboxError } from "./errors";
import { FusionOciServer, GateCallback, ServerOptions, sharedServer } from "./server";
import type {
  SandboxBackend,
  SandboxBackendId,
  SandboxCapabilities,
  SandboxFailureMode,
  SandboxPrepareContext,
  SandboxRunOptions,
  SandboxRunResult,
} from "./types";

export interface SandboxBackendOptions extends ServerOptions {
  /** The backend asked for; the settings files and a task prompt's `**Sandbox:** X` line
   * apply as in the CLI (default: what the settings say, else native). */
  backend?: SandboxBackendId;
  failureMode?: SandboxFailureMode;
  /** Where .fusion/settings.yaml is read (default: found from the worktree, as the CLI). */
  projectDir?: string;
  /** The task prompt (its `**Sandbox:** X` line overrides the backend). */
  taskPrompt?: string;
  /** Inline settings (the `sandbox:` mapping of the settings file), above the files. */
  settings?: Record<string, unknown>;
  /** Answers gates configured `ask` (image build/pull); without it they deny. */
  onGate?: GateCallback;
  /** The server to use (default: one shared per serverCommand/socketPath). */
  server?: FusionOciServer;
  /** Environment the policy's envAllowlist draws from (default: process.env). */
  env?: NodeJS.ProcessEnv;
  /** Accept a worktree that is not the top of a git work tree (or is / or $HOME). */
  unsafeWorktree?: boolean;
}

const CAPABILITIES: Record<SandboxBackendId, SandboxCapabilities> = {
  native: caps("none", "none", "basic", false, true, true, false),
  "sandbox-exec": caps("basic", "coarse", "basic", false, true, false, false),
  bubblewrap: caps("strong", "coarse", "advanced", true, false, true, false),
  docker: caps("strong", "coarse", "advanced", true, true, true, true),
  podman: caps("strong", "coarse", "advanced", true, true, true, true),
  custom: caps("none", "none", "none", true, false, false, false),
  oci: caps("strong", "coarse", "advanced", true, false, true, false),
  landlock: caps("strong", "coarse", "basic", false, false, true, false),
  kubernetes: caps("strong", "coarse", "advanced", true, true, true, false),
};

function caps(fs: SandboxCapabilities["filesystemIsolation"],
  net: SandboxCapabilities["networkPolicy"], res: SandboxCapabilities["resourceLimits"],
  requiresInstall: boolean, supportsMac: boolean, supportsLinux: boolean,
  supportsWindows: boolean): SandboxCapabilities {
  return { filesystemIsolation: fs, networkPolicy: net, resourceLimits: res, requiresInstall,
    supportsMac, supportsLinux, supportsWindows };
}

interface PrepareResult {
  sandboxId: string;
  backend: string;
  fellBack: boolean;
  unenforced: string[];
  capabilities: SandboxCapabilities;
}

interface WireResult extends Omit<SandboxRunResult, "signal"> {
  signal: string | null;
}

function stringEnv(env: NodeJS.ProcessEnv | undefined): Record<string, string> | undefined {
  if (!env) return undefined;
  const out: Record<string, string> = {};
  for (const [k, v] of Object.entries(env)) if (v !== undefined) out[k] = v;
  return out;
}

class ServedBackend implements SandboxBackend {
  /** The backend asked for; after prepare, the one that runs (a task prompt's override, a
   * fallback to native). */
  id: SandboxBackendId;
  private caps: SandboxCapabilities;
  private ctx: SandboxPrepareContext | undefined;
  private sandbox: { id: string; generation: number } | undefined;
  private readonly server: FusionOciServer;
  /** What prepare resolved: the runtime, fallback and unenforced parts. */
  prepared: PrepareResult | undefined;

  constructor(private readonly options: SandboxBackendOptions) {
    this.id = options.backend ?? "native";
    this.caps = CAPABILITIES[this.id];
    this.server = options.server ?? sharedServer(options);
  }

  capabilities(): SandboxCapabilities {
    return { ...this.caps };
  }

  async prepare(ctx: SandboxPrepareContext): Promise<void> {
    if (this.sandbox) await this.dispose();
    this.ctx = ctx;
    await this.open(ctx);
  }

  private async open(ctx: SandboxPrepareContext): Promise<{ id: string; generation: number }> {
    const o = this.options;
    const live = await this.server.connection();
    // Our name for the sandbox, so that an `ask` during prepare finds its onGate.
    const sandboxId = `sb-${randomBytes(8).toString("hex")}`;
    this.server.setGate(sandboxId, o.onGate);
    let result: PrepareResult;
    try {
      result = await this.server.request<PrepareResult>("prepare", {
      sandboxId,
      context: { taskId: ctx.taskId, runId: ctx.runId, worktreePath: ctx.worktreePath,
        policy: ctx.policy, unsafeWorktree: o.unsafeWorktree ?? false },
      projectDir: o.projectDir, taskPrompt: o.taskPrompt, settings: o.settings ?? {},
      backend: o.backend, failureMode: o.failureMode, ask: Boolean(o.onGate),
      env: stringEnv(o.env ?? process.env),
      }, live);
    } catch (err) {
      this.server.setGate(sandboxId, undefined);
      throw err;
    }
    this.prepared = result;
    this.caps = result.capabilities;
    if (result.backend in CAPABILITIES) this.id = result.backend as SandboxBackendId;
    this.sandbox = { id: result.sandboxId, generation: live.generation };
    return this.sandbox;
  }

  /** The sandbox on the live server; prepared again when the server was restarted. */
  private async current(): Promise<string> {
    if (!this.ctx) {
      throw new SandboxError("setup-failed", "sandbox was not prepared",
        { why: "run() came before prepare()", hint: "call prepare(ctx) first" });
    }
    const live = await this.server.connection();
    if (this.sandbox && this.sandbox.generation === live.generation) return this.sandbox.id;
    return (await this.open(this.ctx)).id;
  }

  async run(command: string, opts: SandboxRunOptions): Promise<SandboxRunResult> {
    if (opts.signal?.aborted) return aborted(this.prepared);
    const sandboxId = await this.current();
    const execId = randomBytes(8).toString("hex");
    const off = this.server.onOutput(execId, (stream, chunk) => {
      (stream === "stdout" ? opts.onStdout : opts.onStderr)?.(chunk);
    });
    const onAbort = () => this.server.notifyCancel(execId);
    opts.signal?.addEventListener("abort", onAbort, { once: true });
    const stdin = opts.stdin === undefined ? undefined
      : Buffer.from(typeof opts.stdin === "string" ? Buffer.from(opts.stdin, "utf8")
        : opts.stdin).toString("base64");
    try {
      const wire = await this.server.request<WireResult>("run", {
        sandboxId, execId, command,
        options: {
          cwd: opts.cwd, timeoutMs: opts.timeoutMs, maxBuffer: opts.maxBuffer,
          env: stringEnv(opts.env), stdin,
          stream: Boolean(opts.onStdout || opts.onStderr),
        },
      });
      return { ...wire, signal: wire.signal as NodeJS.Signals | null };
    } finally {
      off();
      opts.signal?.removeEventListener("abort", onAbort);
    }
  }

  async dispose(): Promise<void> {
    const sandbox = this.sandbox;
    this.sandbox = undefined;
    this.ctx = undefined;
    if (!sandbox) return;
    this.server.setGate(sandbox.id, undefined);
    // A sandbox of a server that has gone went with it: never start a server to dispose.
    if (this.server.generation !== sandbox.generation) return;
    await this.server.request("dispose", { sandboxId: sandbox.id });
  }
}

function aborted(prepared: PrepareResult | undefined): SandboxRunResult {
  return { stdout: "", stderr: "", exitCode: null, signal: "SIGTERM", timedOut: false,
    truncated: false, reason: "aborted", durationMs: 0, backend: prepared?.backend,
    fellBack: prepared?.fellBack ?? false, unenforced: prepared?.unenforced ?? [] };
}

/** A SandboxBackend whose commands run through `fusion-oci serve`. */
export function createSandboxBackend(options: SandboxBackendOptions = {}): SandboxBackend {
  return new ServedBackend(options);
}
