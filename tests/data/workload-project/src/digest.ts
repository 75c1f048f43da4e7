import { Worker } from "node:worker_threads";

/** The sha256 of each text, computed off the main thread, one Worker per text. */
export function digestAll(texts: string[]): Promise<string[]> {
  const script = new URL("./digest-worker.mjs", import.meta.url);
  return Promise.all(
    texts.map(
      (text) =>
        new Promise<string>((resolve, reject) => {
          const worker = new Worker(script, { workerData: text });
          worker.once("message", (hex: string) => resolve(hex));
          worker.once("error", reject);
          worker.once("exit", (code) => {
            if (code !== 0) reject(new Error(`digest worker exited with ${code}`));
          });
        }),
    ),
  );
}
