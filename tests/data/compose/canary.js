// The egress canary: any request gets "canary".
require("http")
  .createServer((req, res) => res.end("canary\n"))
  .listen(8080, "0.0.0.0");
