import { wordCounts } from "./words.js";

const text = process.argv.slice(2).join(" ") || "the bundle runs and the bundle counts";
const [top] = wordCounts(text);
console.log(`bundle ok: "${top[0]}" x${top[1]}`);
