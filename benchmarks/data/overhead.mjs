// The container-overhead micro-workload: each phase times itself (performance.now), so an
// engine's container start never counts. Prints one JSON line: {phase: wall ms,
// phase_cpu: CPU ms}.
import { spawnSync } from "node:child_process";
import { createHash } from "node:crypto";
import { mkdirSync, readFileSync, rmSync, statSync, writeFileSync } from "node:fs";
import { join } from "node:path";

const dir = process.argv[2] ?? ".";
const only = process.argv[3];
const phases = {
  // Pure user-space CPU: no system calls in the loop.
  cpu() {
    let x = 0;
    for (let i = 0; i < 40_000_000; i++) x = (x * 31 + i) % 1_000_003;
    return x;
  },
  // Hashing through libuv/openssl: CPU with a few syscalls.
  hash() {
    const buf = Buffer.alloc(1 << 20, 7);
    const h = createHash("sha256");
    for (let i = 0; i < 200; i++) h.update(buf);
    return h.digest("hex").length;
  },
  // fork/exec: what a test runner or a build tool does for every child.
  spawn() {
    for (let i = 0; i < 100; i++) spawnSync("/bin/true");
    return 100;
  },
  // The same with a static binary from the bind-mounted worktree: no loader, no image layer.
  spawn_static() {
    const bin = process.env.OVERHEAD_STATIC;
    if (!bin) return 0;
    for (let i = 0; i < 100; i++) spawnSync(bin, ["--version"]);
    return 100;
  },
  // Many small files in the worktree: create, stat, read, remove.
  fs() {
    const root = join(dir, `.overhead-${process.pid}`);
    mkdirSync(root, { recursive: true });
    for (let i = 0; i < 2000; i++) writeFileSync(join(root, `f${i}`), "x".repeat(512));
    let n = 0;
    for (let r = 0; r < 2; r++)
      for (let i = 0; i < 2000; i++) n += statSync(join(root, `f${i}`)).size + readFileSync(join(root, `f${i}`)).length;
    rmSync(root, { recursive: true });
    return n;
  },
};
const out = {};
for (const [name, fn] of Object.entries(phases)) {
  if (only && only !== name) continue;
  const t = performance.now();
  const c = process.cpuUsage();
  fn();
  const used = process.cpuUsage(c);
  out[name] = Math.round(performance.now() - t);
  // This process's own CPU time (user + system): less bent by other load than wall time.
  out[`${name}_cpu`] = Math.round((used.user + used.system) / 1000);
}
console.log(JSON.stringify(out));
