/**
 * The brief's section 4 types, exactly, widened only by optional fields.
 */

export type SandboxBackendId =
  | "native"
  | "sandbox-exec"
  | "bubblewrap"
  | "docker"
  | "podman"
  | "custom"
  // Widened: the backends fusion-oci adds to the brief's list (an OCI runtime CLI on the
  // bundle, and Landlock where user namespaces are forbidden). The id after prepare() is the
  // backend that really runs, so it can be one of these.
  | "oci"
  | "landlock"
  // A pod on the team's Kubernetes cluster (the same contract, another machine).
  | "kubernetes";

export type SandboxFailureMode = "fail-hard" | "fallback-native";

export interface SandboxPolicy {
  allowNetwork: boolean;
  allowedPaths: string[]; // absolute host paths mounted/readable in sandbox
  writablePaths?: string[];
  envAllowlist?: string[];
  cpuLimit?: { maxCores?: number; maxMs?: number };
  memoryLimitMb?: number;
  /** fusion-oci: explicit network mode (default: egress when allowNetwork, else none).
   * "filtered": outbound only through the task's egress proxy, to the built-in git/npm
   * profile's hosts and allowedDomains, never deniedDomains. */
  network?: "none" | "egress" | "filtered" | "host";
  /** fusion-oci: hosts a "filtered" network reaches besides the built-in git/npm profile's:
   * "example.com", "*.example.com", an address or CIDR range, each optionally ":port". */
  allowedDomains?: string[];
  /** fusion-oci: hosts a "filtered" network never reaches, whatever allows them (deny wins). */
  deniedDomains?: string[];
  /** fusion-oci: most processes/threads at once. */
  pidsLimit?: number;
  /** fusion-oci: size cap of the private /tmp and HOME, MiB. */
  tmpSizeMb?: number;
  /** fusion-oci: largest file the command may write, MiB. */
  fileSizeLimitMb?: number;
}

/** Why a command ended: its own exit, a signal, or which limit (or an abort) ended it. */
export type SandboxEndReason =
  | "exit" | "signal" | "timeout" | "max-buffer" | "oom" | "pids" | "cpu-time" | "aborted";

export interface SandboxRunOptions {
  cwd: string;
  timeoutMs: number;
  maxBuffer: number;
  env?: NodeJS.ProcessEnv;
  /** fusion-oci: each stdout chunk while the command runs, bytes as written. */
  onStdout?: (chunk: Buffer) => void;
  /** fusion-oci: each stderr chunk while the command runs, bytes as written. */
  onStderr?: (chunk: Buffer) => void;
  /** fusion-oci: aborting ends the command's whole tree; the result's reason is "aborted". */
  signal?: AbortSignal;
  /** fusion-oci: fed to the command's stdin (default: stdin closed). */
  stdin?: string | Uint8Array;
}

export interface SandboxPrepareContext {
  taskId: string;
  runId: string;
  worktreePath: string;
  policy: SandboxPolicy;
}

export interface SandboxRunResult {
  stdout: string;
  stderr: string;
  exitCode: number | null;
  signal: NodeJS.Signals | null;
  /** fusion-oci: the timeout ended it. */
  timedOut?: boolean;
  /** fusion-oci: output went past maxBuffer (and the command was ended). */
  truncated?: boolean;
  /** fusion-oci: why it ended. */
  reason?: SandboxEndReason;
  durationMs?: number;
  /** fusion-oci: the runtime that ran it (after any fallback or task-prompt override). */
  backend?: string;
  /** fusion-oci: the configured backend was unavailable and it ran natively. */
  fellBack?: boolean;
  /** fusion-oci: policy parts not enforced for this run. */
  unenforced?: string[];
}

export interface SandboxCapabilities {
  filesystemIsolation: "none" | "basic" | "strong";
  networkPolicy: "none" | "coarse" | "fine";
  resourceLimits: "none" | "basic" | "advanced";
  requiresInstall: boolean;
  supportsMac: boolean;
  supportsLinux: boolean;
  supportsWindows: boolean;
}

export interface SandboxBackend {
  id: SandboxBackendId;
  capabilities(): SandboxCapabilities;
  prepare(ctx: SandboxPrepareContext): Promise<void>;
  run(command: string, opts: SandboxRunOptions): Promise<SandboxRunResult>;
  dispose(): Promise<void>;
}
