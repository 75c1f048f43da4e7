import { createHash } from "node:crypto";
import { isMainThread } from "node:worker_threads";
import { expect, it } from "vitest";
import { digestAll } from "../src/digest.js";

it("runs in a vitest worker thread", () => {
  expect(isMainThread).toBe(false);
});

it("spawns Workers that compute each digest", async () => {
  const texts = ["one", "two", "three"];
  const want = texts.map((t) => createHash("sha256").update(t).digest("hex"));
  expect(await digestAll(texts)).toEqual(want);
});
