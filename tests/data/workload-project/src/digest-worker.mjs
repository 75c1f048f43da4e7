import { createHash } from "node:crypto";
import { parentPort, workerData } from "node:worker_threads";

parentPort.postMessage(createHash("sha256").update(workerData).digest("hex"));
