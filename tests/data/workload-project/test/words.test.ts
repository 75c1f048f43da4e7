import { describe, expect, it } from "vitest";
import { wordCounts } from "../src/words.js";

describe("wordCounts", () => {
  it("counts words, most frequent first", () => {
    expect(wordCounts("b a b, A c!")).toEqual([["a", 2], ["b", 2], ["c", 1]]);
  });
  it("keeps letters outside ASCII", () => {
    expect(wordCounts("Été été")).toEqual([["été", 2]]);
  });
});
