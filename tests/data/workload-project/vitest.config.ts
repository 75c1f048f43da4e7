import { defineConfig } from "vitest/config";

// Worker threads, as many as the machine offers: the pool that a sandbox without threads breaks.
export default defineConfig({
  test: { pool: "threads", include: ["test/**/*.test.ts"] },
});
