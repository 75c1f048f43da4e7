/** Failures the client reports, each with the server's machine-readable kind. */

export type SandboxErrorKind =
  | "bad-settings"
  | "bad-flags"
  | "backend-unavailable"
  | "policy-unenforceable"
  | "gate-denied"
  | "engine-error"
  | "setup-failed"
  /** The sandbox's exec agent died: the run failed; dispose and prepare again. */
  | "agent-lost"
  | "timeout"
  | "bad-request"
  | "internal"
  /** The server process ended (or could not start); the next call starts a new one. */
  | "server-exited"
  /** The server speaks another major protocol version. */
  | "protocol-version";

export interface SandboxErrorInit {
  why?: string;
  hint?: string;
  unenforced?: string[];
  code?: number;
}

export class SandboxError extends Error {
  readonly kind: SandboxErrorKind;
  readonly what: string;
  readonly why: string;
  readonly hint: string;
  readonly unenforced: string[];
  /** The JSON-RPC error code, when the error came from the server. */
  readonly rpcCode: number | undefined;

  constructor(kind: SandboxErrorKind, what: string, init: SandboxErrorInit = {}) {
    const why = init.why ?? "";
    const hint = init.hint ?? "";
    super(what + (why ? `: ${why}` : "") + (hint ? `\nhint: ${hint}` : ""));
    this.name = "SandboxError";
    this.kind = kind;
    this.what = what;
    this.why = why;
    this.hint = hint;
    this.unenforced = init.unenforced ?? [];
    this.rpcCode = init.code;
  }
}
