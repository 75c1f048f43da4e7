/** What the tests share: the real server from this checkout, engines, images, host checks. */

import { execFileSync } from "node:child_process";
import { existsSync, mkdtempSync, readdirSync, readFileSync, rmSync } from "node:fs";
import { request } from "node:http";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";

import type { SandboxBackendId, SandboxBackendOptions, SandboxPolicy } from "../src";

export const ROOT = resolve(__dirname, "..", "..", "..", "..");

export function python(): string {
  if (process.env.FUSION_OCI_PYTHON) return process.env.FUSION_OCI_PYTHON;
  for (const venv of [join(ROOT, ".venv"), "/work/main/.venv"]) {
    if (existsSync(join(venv, "bin", "python"))) return join(venv, "bin", "python");
  }
  return "python3";
}

export const SERVER = [python(), "-m", "fusion_oci.cli.main", "serve"];
export const SERVER_ENV: NodeJS.ProcessEnv = {
  ...process.env,
  PYTHONPATH: ROOT + (process.env.PYTHONPATH ? `:${process.env.PYTHONPATH}` : ""),
};

export const BACKENDS: SandboxBackendId[] = [
  "native", "bubblewrap", "podman", "docker", "kubernetes",
];
export const NO_NET: SandboxPolicy = { allowNetwork: false, allowedPaths: [] };

const images = new Map<string, string>();

/** The node task image, built or found exactly as the Python tests do (images_fixture.py). */
export function nodeImage(engine: "podman" | "docker"): string {
  let ref = images.get(engine);
  if (!ref) {
    ref = execFileSync(python(), ["-c",
      "import sys; from tests.integration.images_fixture import ensure_node_image; " +
      `print(ensure_node_image('${engine}').ref)`],
    { cwd: ROOT, env: SERVER_ENV, encoding: "utf8", stdio: ["ignore", "pipe", "inherit"] })
      .trim().split("\n").pop()!;
    images.set(engine, ref);
  }
  return ref;
}

/** Settings that reach the engines scripts/services.sh started. */
export function engineSettings(backend: SandboxBackendId): Record<string, unknown> {
  if (backend === "podman") {
    return { podmanUrl: process.env.FUSION_OCI_PODMAN_URL, image: nodeImage("podman") };
  }
  if (backend === "docker") {
    return { dockerUrl: process.env.DOCKER_HOST, image: nodeImage("docker") };
  }
  if (backend === "kubernetes") {
    return { image: nodeImage("podman"), kubernetes: kubernetesSettings() };
  }
  return {};
}

const KUBE_NAMESPACE = "fusion-oci-contract";

/** The test cluster of scripts/cluster.sh (its env is exported by scripts/test.sh), in the
 * Python contract suite's namespace, made here when missing. */
function kubernetesSettings(): Record<string, unknown> {
  const kubeconfig = process.env.KUBECONFIG;
  const bin = process.env.FUSION_OCI_K8S_BIN;
  if (!kubeconfig || !bin) throw new Error("the cluster's env is not set: eval \"$(scripts/cluster.sh env)\"");
  try {
    execFileSync(join(bin, "kubectl"), ["get", "namespace", KUBE_NAMESPACE], { stdio: "ignore" });
  } catch {
    execFileSync(join(bin, "kubectl"), ["create", "namespace", KUBE_NAMESPACE], { stdio: "ignore" });
  }
  return {
    kubeconfig, namespace: KUBE_NAMESPACE, mode: "pods",
    seccompProfile: "fusion-oci/task.json", nodeNetworks: ["10.231.0.0/16"],
  };
}

export function options(backend: SandboxBackendId, extra: SandboxBackendOptions = {}
): SandboxBackendOptions {
  return {
    backend, serverCommand: SERVER, serverEnv: SERVER_ENV,
    settings: { ...engineSettings(backend), ...(extra.settings ?? {}) },
    ...Object.fromEntries(Object.entries(extra).filter(([k]) => k !== "settings")),
  };
}

const scratch: string[] = [];
// Every folder a test file made goes when its process does: a test run leaves nothing in /tmp.
process.on("exit", () => {
  for (const dir of scratch) rmSync(dir, { recursive: true, force: true });
});

/** A fresh temporary folder, removed when this test process exits. */
export function scratchDir(prefix: string): string {
  const dir = mkdtempSync(join(tmpdir(), prefix));
  scratch.push(dir);
  return dir;
}

/** A fresh git work tree (a plain folder is refused as a worktree). */
export function worktree(): string {
  const dir = scratchDir("fusion-oci-ts-");
  execFileSync("git", ["init", "-q", dir]);
  return dir;
}

export function marker(name: string): string {
  return `fusion-oci-ts-${name}-${process.pid}-${Date.now()}-${Math.floor(Math.random() * 1e6)}`;
}

/** Host pids whose command line has the marker (container processes are host processes). */
export function pidsWith(mark: string): number[] {
  const out: number[] = [];
  for (const entry of readdirSync("/proc")) {
    if (!/^\d+$/.test(entry) || Number(entry) === process.pid) continue;
    try {
      const cmdline = readFileSync(`/proc/${entry}/cmdline`, "utf8");
      if (cmdline.includes(mark) && !cmdline.includes("node")) out.push(Number(entry));
    } catch {
      // gone meanwhile
    }
  }
  return out;
}

export async function waitGone(mark: string, ms = 10_000): Promise<number[]> {
  const end = Date.now() + ms;
  let left = pidsWith(mark);
  while (left.length && Date.now() < end) {
    await new Promise((r) => setTimeout(r, 100));
    left = pidsWith(mark);
  }
  return left;
}

/** Containers labelled with this task id, asked of the engine's API (no CLI scraping). */
export function containersOfTask(backend: "podman" | "docker", taskId: string): Promise<string[]> {
  const url = backend === "podman" ? process.env.FUSION_OCI_PODMAN_URL : process.env.DOCKER_HOST;
  const socketPath = (url ?? "").replace(/^unix:\/\//, "");
  const filters = encodeURIComponent(JSON.stringify({ label: [`io.fusion-oci.task-id=${taskId}`] }));
  return new Promise((resolvePromise, reject) => {
    const req = request({ socketPath, path: `/containers/json?all=true&filters=${filters}` },
      (res) => {
        let body = "";
        res.on("data", (c: Buffer) => { body += c.toString(); });
        res.on("end", () => {
          try {
            resolvePromise((JSON.parse(body) as { Id: string }[]).map((c) => c.Id));
          } catch (e) {
            reject(e);
          }
        });
      });
    req.on("error", reject);
    req.end();
  });
}

export function taskId(name: string): string {
  return `ts-${name}-${Date.now().toString(36)}-${Math.floor(Math.random() * 1e6)}`;
}
