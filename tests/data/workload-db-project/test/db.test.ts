// The kind of test a real project runs after its unit tests: a table made, written and read
// through the `pg` driver, on the database DATABASE_URL names (a host PostgreSQL granted to
// the sandbox by policy.hostServices, reached at the same 127.0.0.1 port inside).
import pg from "pg";
import { afterAll, beforeAll, describe, expect, it } from "vitest";

const url = process.env.DATABASE_URL ?? "postgres://postgres@127.0.0.1:5432/postgres";
const table = `items_${process.pid}`;
let client: pg.Client;

beforeAll(async () => {
  client = new pg.Client({ connectionString: url, connectionTimeoutMillis: 10_000 });
  await client.connect();
  await client.query(`create temporary table ${table} (id serial primary key, name text not null)`);
});

afterAll(async () => {
  await client?.end();
});

describe("the database", () => {
  it("answers a query", async () => {
    const { rows } = await client.query("select 40 + 2 as answer");
    expect(rows[0].answer).toBe(42);
  });

  it("keeps what a test writes", async () => {
    await client.query(`insert into ${table} (name) select 'n' || g from generate_series(1, 500) g`);
    const { rows } = await client.query(`select count(*)::int as n from ${table}`);
    expect(rows[0].n).toBe(500);
  });

  it("serves several connections at once (a pool, as an app's tests use one)", async () => {
    const pool = new pg.Pool({ connectionString: url, max: 4 });
    try {
      const answers = await Promise.all(
        [1, 2, 3, 4].map((n) => pool.query("select $1::int * 2 as v", [n])),
      );
      expect(answers.map((a) => a.rows[0].v)).toEqual([2, 4, 6, 8]);
    } finally {
      await pool.end();
    }
  });
});
