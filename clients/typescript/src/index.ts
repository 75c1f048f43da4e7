/**
 * @fusion-oci/client: the brief's SandboxBackend for Node executors, backed by
 * `fusion-oci serve` (docs/protocol.md), and exec(), a drop-in for promisify(exec).
 */

export type {
  SandboxBackend,
  SandboxBackendId,
  SandboxCapabilities,
  SandboxEndReason,
  SandboxFailureMode,
  SandboxPolicy,
  SandboxPrepareContext,
  SandboxRunOptions,
  SandboxRunResult,
} from "./types";
export { SandboxError } from "./errors";
export type { SandboxErrorKind } from "./errors";
export { createSandboxBackend } from "./backend";
export type { SandboxBackendOptions } from "./backend";
export { FusionOciServer, PROTOCOL_VERSION } from "./server";
export type { GateCallback, GateRequest, ServerConnection, ServerOptions } from "./server";
export { disposeExecSandboxes, exec } from "./exec";
export type { ExecError, ExecOptions, ExecResult } from "./exec";
