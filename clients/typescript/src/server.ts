/**
 * One connection to `fusion-oci serve` (docs/protocol.md): started on demand, shared by the
 * backends given it, restarted by the next call after it dies.
 */

import { ChildProcess, spawn } from "node:child_process";
import { connect, Socket } from "node:net";
import {
  createMessageConnection,
  MessageConnection,
  ResponseError,
  SocketMessageReader,
  SocketMessageWriter,
  StreamMessageReader,
  StreamMessageWriter,
} from "vscode-jsonrpc/node";

import { SandboxError, SandboxErrorKind } from "./errors";

export const PROTOCOL_VERSION = "1.0";

/** What a gate asks (the server's `ask` request). */
export interface GateRequest {
  sandboxId: string;
  gate: "sandbox_provision" | "network_api";
  action: string;
  target: string;
  backend: string;
  reason: string;
  /** A sentence for the person deciding. */
  question: string;
}

export type GateCallback = (request: GateRequest) => boolean | Promise<boolean>;

export interface ServerOptions {
  /** argv of the server (default: ["fusion-oci", "serve"]; FUSION_OCI_SERVER, split on
   * spaces, when set). */
  serverCommand?: string[];
  /** Connect to `fusion-oci serve --socket PATH` instead of starting one. */
  socketPath?: string;
  /** Environment of the started server (default: this process's). */
  serverEnv?: NodeJS.ProcessEnv;
  /** "pipe" (default): keep the last lines for error messages; "inherit": show them. */
  serverStderr?: "pipe" | "inherit";
}

interface OutputParams {
  execId: string;
  stream: "stdout" | "stderr";
  data: string;
}

type OutputListener = (stream: "stdout" | "stderr", chunk: Buffer) => void;

/** A live connection to the server as callers see it: which server generation it is. The
 * JSON-RPC connection inside stays private, so no vscode-jsonrpc type is in our public
 * declarations (its `vscode-jsonrpc/node` does not resolve under `moduleResolution: node`). */
export interface ServerConnection {
  readonly generation: number;
}

interface Live extends ServerConnection {
  conn: MessageConnection;
  child: ChildProcess | undefined;
  socket: Socket | undefined;
  generation: number;
  exited: Promise<void>;
  /** Rejecters of the requests in flight: the server's end rejects them (server-exited). */
  pending: Set<(err: Error) => void>;
}

let generations = 0;
/** Every Live made here: what request() accepts as its connection. */
const lives = new WeakSet<ServerConnection>();

function defaultCommand(): string[] {
  const fromEnv = process.env.FUSION_OCI_SERVER;
  if (fromEnv && fromEnv.trim()) return fromEnv.trim().split(/\s+/);
  return ["fusion-oci", "serve"];
}

/** A server error (JSON-RPC) as a SandboxError with the server's kind. */
export function toSandboxError(err: unknown): Error {
  if (err instanceof SandboxError) return err;
  if (err instanceof ResponseError) {
    const data = (err.data ?? {}) as Record<string, unknown>;
    const kind = (typeof data.kind === "string" ? data.kind : "internal") as SandboxErrorKind;
    return new SandboxError(kind, typeof data.what === "string" ? data.what : err.message, {
      why: typeof data.why === "string" ? data.why : "",
      hint: typeof data.hint === "string" ? data.hint : "",
      unenforced: Array.isArray(data.unenforced) ? (data.unenforced as string[]) : [],
      code: err.code,
    });
  }
  return err instanceof Error ? err : new Error(String(err));
}

export class FusionOciServer {
  private live: Live | undefined;
  private starting: Promise<Live> | undefined;
  private readonly listeners = new Map<string, OutputListener>();
  private readonly gates = new Map<string, GateCallback>();
  private stderrTail = "";
  private busy = 0;
  private closed = false;

  constructor(readonly options: ServerOptions = {}) {}

  /** The live connection's generation: sandboxes of an older one are gone. */
  async connection(): Promise<ServerConnection> {
    return this.connect();
  }

  private async connect(): Promise<Live> {
    if (this.closed) throw new SandboxError("server-exited", "the client was closed");
    if (this.live) return this.live;
    if (!this.starting) {
      this.starting = this.start().finally(() => {
        this.starting = undefined;
      });
    }
    return this.starting;
  }

  private async start(): Promise<Live> {
    const generation = ++generations;
    let child: ChildProcess | undefined;
    let socket: Socket | undefined;
    let conn: MessageConnection;
    let exited: Promise<void>;
    if (this.options.socketPath) {
      const path = this.options.socketPath;
      socket = await new Promise<Socket>((resolve, reject) => {
        const s = connect(path);
        s.once("connect", () => resolve(s));
        s.once("error", (e) =>
          reject(new SandboxError("server-exited", `cannot connect to ${path}`, {
            why: e.message, hint: "start `fusion-oci serve --socket PATH` first",
          })));
      });
      conn = createMessageConnection(new SocketMessageReader(socket), new SocketMessageWriter(socket));
      const s = socket;
      exited = new Promise((resolve) => s.once("close", () => resolve()));
    } else {
      const [cmd, ...args] = this.options.serverCommand ?? defaultCommand();
      if (!cmd) throw new SandboxError("bad-flags", "serverCommand is empty");
      const stderr = this.options.serverStderr ?? "pipe";
      const c = spawn(cmd, args, {
        stdio: ["pipe", "pipe", stderr],
        env: this.options.serverEnv ?? process.env,
        // Its own process group: a terminal's Ctrl-C reaches the executor, which decides
        // (abort signals, or exiting, which closes the pipe and so ends the server's work).
        detached: true,
      });
      child = c;
      this.stderrTail = "";
      c.stderr?.on("data", (chunk: Buffer) => {
        this.stderrTail = (this.stderrTail + chunk.toString("utf8")).slice(-4000);
      });
      exited = new Promise((resolve) => c.once("close", () => resolve()));
      const spawnError = await new Promise<Error | undefined>((resolve) => {
        c.once("spawn", () => resolve(undefined));
        c.once("error", (e) => resolve(e));
      });
      if (spawnError) {
        throw new SandboxError("server-exited", `cannot start ${cmd}`, {
          why: spawnError.message,
          hint: "install fusion-oci (pip install fusion-oci) or pass serverCommand",
        });
      }
      c.stdin?.on("error", () => undefined); // EPIPE after the server died: reported below
      conn = createMessageConnection(
        new StreamMessageReader(c.stdout!), new StreamMessageWriter(c.stdin!));
    }
    const live: Live = { conn, child, socket, generation, exited, pending: new Set() };
    lives.add(live);
    conn.onNotification("output", (p: OutputParams) => {
      this.listeners.get(p.execId)?.(p.stream, Buffer.from(p.data, "base64"));
    });
    conn.onRequest("ask", async (p: GateRequest) => {
      const gate = this.gates.get(p.sandboxId);
      if (!gate) return { allow: false };
      try {
        return { allow: Boolean(await gate(p)) };
      } catch {
        return { allow: false };
      }
    });
    conn.listen();
    void exited.then(() => {
      if (this.live === live) this.live = undefined;
      const err = this.exitedError();
      for (const reject of live.pending) reject(err);
      live.pending.clear();
      conn.dispose();
    });
    this.live = live;
    this.idle(live);
    let hello: { protocolVersion?: string };
    try {
      hello = await this.requestOn<{ protocolVersion?: string }>(live, "initialize",
        { protocolVersion: PROTOCOL_VERSION, client: "@fusion-oci/client" });
    } catch (err) {
      this.kill(live);
      throw err;
    }
    const major = String(hello.protocolVersion ?? "").split(".")[0];
    if (major !== PROTOCOL_VERSION.split(".")[0]) {
      this.kill(live);
      throw new SandboxError("protocol-version",
        `the server speaks protocol ${hello.protocolVersion}, this client ${PROTOCOL_VERSION}`,
        { hint: "install matching versions of fusion-oci and @fusion-oci/client" });
    }
    return live;
  }

  /** The live server's generation, without starting one. */
  get generation(): number | undefined {
    return this.live?.generation;
  }

  /** A request that fails with `server-exited` when the server ends first. */
  async request<R>(method: string, params: object, on?: ServerConnection): Promise<R> {
    if (on && !lives.has(on)) throw new TypeError("not a connection of a FusionOciServer");
    return this.requestOn<R>((on as Live | undefined) ?? (await this.connect()), method, params);
  }

  private async requestOn<R>(l: Live, method: string, params: object): Promise<R> {
    this.busy++;
    this.idle(l);
    try {
      return await new Promise<R>((resolve, reject) => {
        l.pending.add(reject);
        l.conn.sendRequest<R>(method, params).then(resolve, reject)
          .finally(() => l.pending.delete(reject));
      });
    } catch (err) {
      if (!(err instanceof SandboxError) && await exitsSoon(l)) {
        // A write to (or a read from) a server that is dying: say that, not the symptom.
        throw this.exitedError();
      }
      throw toSandboxError(err);
    } finally {
      this.busy--;
      this.idle(l);
    }
  }

  private exitedError(): SandboxError {
    return new SandboxError("server-exited", "the fusion-oci server exited", {
      why: this.stderrTail.trim().split("\n").slice(-3).join(" | ") || "no message",
      hint: "the next call starts a new server",
    });
  }

  /** Fire and forget (cancel): no error when the server has gone. */
  notifyCancel(execId: string): void {
    const l = this.live;
    if (!l) return;
    l.conn.sendRequest("cancel", { execId }).catch(() => undefined);
  }

  onOutput(execId: string, listener: OutputListener): () => void {
    this.listeners.set(execId, listener);
    return () => this.listeners.delete(execId);
  }

  setGate(sandboxId: string, gate: GateCallback | undefined): void {
    if (gate) this.gates.set(sandboxId, gate);
    else this.gates.delete(sandboxId);
  }

  /** A server with nothing in flight does not keep this Node process alive. */
  private idle(l: Live): void {
    const handles = [l.child, l.child?.stdin, l.child?.stdout, l.child?.stderr, l.socket];
    for (const h of handles) {
      const ref = h as { ref?: () => void; unref?: () => void } | null | undefined;
      if (!ref) continue;
      if (this.busy > 0) ref.ref?.();
      else ref.unref?.();
    }
  }

  private kill(l: Live): void {
    if (this.live === l) this.live = undefined;
    l.conn.dispose();
    l.socket?.destroy();
    if (l.child && l.child.exitCode === null) l.child.kill("SIGTERM");
  }

  /** End the server (its sandboxes are disposed by it, as for any client that goes away). */
  async close(): Promise<void> {
    this.closed = true;
    const l = this.live;
    if (!l) return;
    this.live = undefined;
    this.busy++;
    this.idle(l); // keep this process alive until the server has cleaned up and gone
    l.conn.dispose();
    if (l.socket) {
      l.socket.end();
    } else {
      l.child?.stdin?.end();
    }
    await l.exited;
  }
}

function exitsSoon(l: Live, ms = 500): Promise<boolean> {
  return Promise.race([
    l.exited.then(() => true),
    new Promise<boolean>((resolve) => setTimeout(() => resolve(false), ms).unref()),
  ]);
}

const shared = new Map<string, FusionOciServer>();

/** One server per distinct server options, shared by every backend created with them. */
export function sharedServer(options: ServerOptions): FusionOciServer {
  const key = JSON.stringify([options.serverCommand ?? defaultCommand(), options.socketPath,
    options.serverStderr]);
  let server = shared.get(key);
  if (!server || (server as unknown as { closed: boolean }).closed) {
    server = new FusionOciServer(options);
    shared.set(key, server);
  }
  return server;
}
