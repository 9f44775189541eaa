"""Attacks on a served cluster (1 prefill + 1 decode over TCP, mutual TLS, tenants from an API key
file, a cluster secret from a file; one cluster for the module), and on Ray's control plane.

Each test is an attack that worked before [security]: a forged or replayed KV control message, a
KV connection without the secret, another tenant's Abort, probing another tenant's cached
prefix, a client without a certificate, a Ray client without the token, and a secret in a log.
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import struct
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import msgpack
import pytest
import ray

from cluster.launch.app import ClusterConfig
from cluster.config import DataPlaneConfig
from router.router import RouterConfig
from cluster.config import CacheConfig, EngineConfig
from cluster.secrets import read_api_key_file, read_secret_file
from cluster.transfer.auth import MAC_BYTES, OVERHEAD, Sealer
from cluster.transfer.base import PeerMetadata
from cluster.transfer.messages import Kind, Message
from cluster.types import SamplingParams
from cluster_harness import ClusterThread
from tiny_models import long_context_copy
from router.client import Client

pytestmark = pytest.mark.ray

KEYS = {"alpha-1": "sk-alpha-one-0123456789", "alpha-2": "sk-alpha-two-0123456789",
        "beta": "sk-beta-0123456789abcdef", "bare": "sk-bare-0123456789abcdef"}
SECRET = "cluster-secret-" + "q" * 32
PROMPT = list(range(10, 74))          # 64 tokens: 16 full blocks of 4


def _pki(tmp):
    """A CA, a server certificate for 127.0.0.1, a client certificate from the CA and a rogue one."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    import ipaddress
    now = datetime.datetime.now(datetime.timezone.utc)

    def make(name, issuer=None, issuer_key=None, ca=False, san=None):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        b = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer or subject)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        cert = b.sign(issuer_key or key, hashes.SHA256())
        return key, cert, cert.subject

    def pem(key, cert):
        return (key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()), cert.public_bytes(serialization.Encoding.PEM))
    ca_key, ca_cert, ca_name = make("test-ca", ca=True)
    server = make("127.0.0.1", ca_name, ca_key, san=[x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    client = make("client", ca_name, ca_key)
    rogue = make("rogue")
    return {"ca": pem(ca_key, ca_cert)[1], "server": pem(*server[:2]), "client": pem(*client[:2]),
            "rogue": pem(*rogue[:2])}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return _pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory, pki):
    d = tmp_path_factory.mktemp("secrets")
    keys, secret = d / "api-keys", d / "cluster-secret"
    keys.write_text("# tenants\nalpha:{alpha-1}\nalpha:{alpha-2}\nbeta:{beta}\n{bare}\n".format(**KEYS))
    secret.write_text(SECRET)
    for f in (keys, secret):
        f.chmod(0o600)
    engine = EngineConfig(model=long_context_copy(tiny_model_dir("llama"), d / "model"), dtype="float32",
                          num_threads=1, kernels="torch", cache=CacheConfig(block_size=4, num_blocks=1100))
    c = ClusterThread(ClusterConfig(engine=engine, data_plane=DataPlaneConfig(transport="tcp"), port=0,
                                    http_port=0, router=RouterConfig(local_prefill_max_tokens=4),
                                    api_keys=read_api_key_file(keys), cluster_secret=read_secret_file(secret),
                                    tls=pki["server"], tls_client_ca=pki["ca"]))
    c.engine_config = engine
    c.tmp_client_pem = d / "client.pem"
    c.tmp_home = tmp_path_factory.mktemp("home")
    yield c
    c.stop()


def _client(served, pki, key: str, cert: str | None = "client") -> Client:
    creds = grpc.ssl_channel_credentials(root_certificates=pki["ca"], private_key=pki[cert][0] if cert else None,
                                         certificate_chain=pki[cert][1] if cert else None)
    return Client(served.target, api_key=KEYS[key], credentials=creds)


def test_another_tenants_abort_is_answered_as_an_unknown_id(served, pki):
    from proto.splitserve.v1 import inference_pb2 as pb
    alpha, alpha2, beta = (_client(served, pki, k) for k in ("alpha-1", "alpha-2", "beta"))
    stream = alpha.stream(PROMPT[:20], request_id="alpha-req", max_tokens=4000, ignore_eos=True)
    first = next(stream)            # from the prefill worker
    assert first.token_ids
    next(stream)                    # from the decode worker: the request has joined its batch
    found = beta.stub.Abort(pb.AbortRequest(request_id="alpha-req"), metadata=(("authorization", f"Bearer {KEYS['beta']}"),))
    assert found.found is False
    unknown = beta.stub.Abort(pb.AbortRequest(request_id="no-such-request"),
                              metadata=(("authorization", f"Bearer {KEYS['beta']}"),))
    assert unknown.found is False                           # the same answer as for an unknown id
    assert any(s.running for s in served.stats())      # alpha's request goes on
    own = alpha2.stub.Abort(pb.AbortRequest(request_id="alpha-req"),
                            metadata=(("authorization", f"Bearer {KEYS['alpha-2']}"),))
    assert own.found is True                                # a key of the same tenant may
    reasons = [m.finish_reason for m in stream]
    assert reasons[-1] == pb.FINISH_REASON_ABORT
    served.wait_idle()


def test_the_prefix_cache_is_partitioned_per_tenant(served, pki):
    prompt = list(range(120, 184))      # no other test's: alpha's first request finds nothing cached
    cached = {}
    for key in ("alpha-1", "alpha-1", "beta", "alpha-2", "bare"):
        msgs = list(_client(served, pki, key).stream(prompt, max_tokens=2))
        cached.setdefault(key, []).append(msgs[-1].usage.cached_prompt_tokens)
    assert cached["alpha-1"][0] == 0 and cached["alpha-1"][1] > 0      # a tenant hits its own prefix
    assert cached["beta"] == [0] and cached["bare"] == [0]             # another cannot, even by timing
    assert cached["alpha-2"][0] > 0                                     # keys of one tenant share it


def _tls_context(served, pki):
    import ssl
    ctx = ssl.create_default_context(cadata=pki["ca"].decode())
    with open(served.tmp_client_pem, "wb") as f:
        f.write(pki["client"][1] + pki["client"][0])
    ctx.load_cert_chain(served.tmp_client_pem)
    return ctx


def test_a_handed_off_prompt_reports_the_prefill_workers_cache_hits(served, pki):
    """The decode worker that ends a handed-off request computed none of its prompt: its usage
    counts the prompt tokens the prefill worker served from its prefix cache, on both APIs."""
    base = list(range(250, 314))                    # 16 blocks no other test sends
    client = _client(served, pki, "beta")
    assert list(client.stream(base, max_tokens=2))[-1].usage.cached_prompt_tokens == 0
    # Its first 10 blocks, then 6 new ones: the decode worker holds too little of it to prefill it
    # there, so the prefill worker computes it (the 10 blocks from its cache) and hands it off.
    grpc_last = list(client.stream(base[:40] + list(range(320, 344)), max_tokens=2, ignore_eos=True))[-1]
    assert (grpc_last.usage.completion_tokens, grpc_last.usage.cached_prompt_tokens) == (2, 40)
    body = json.dumps({"prompt": base[:40] + list(range(350, 374)), "max_tokens": 2, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"https://127.0.0.1:{served.cluster.http_port}/v1/completions", data=body,
                                     headers={"Authorization": f"Bearer {KEYS['beta']}",
                                              "Content-Type": "application/json"})
    usage = json.loads(urllib.request.urlopen(request, context=_tls_context(served, pki), timeout=30).read())["usage"]
    assert (usage["completion_tokens"], usage["prompt_tokens_details"]["cached_tokens"]) == (2, 40)
    served.wait_idle()


def test_usage_metrics_name_tenants_never_keys(served, pki):
    _client(served, pki, "beta").generate("x", max_tokens=2)
    ctx = _tls_context(served, pki)
    url = f"https://127.0.0.1:{served.cluster.http_port}/metrics"
    with pytest.raises(urllib.error.HTTPError) as e:     # the API port's metrics name tenants: a key is needed
        urllib.request.urlopen(url, context=ctx, timeout=10)
    assert e.value.code == 401
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {KEYS['beta']}"})
    text = urllib.request.urlopen(request, context=ctx, timeout=10).read().decode()
    assert 'tenant="alpha"' in text and 'tenant="beta"' in text
    assert not any(k in text for k in KEYS.values())


def _worker_listener(served, name: str) -> tuple[str, int]:
    sealed = ray.get(served.cluster.workers[name].handle.metadata.options(concurrency_group="control").remote())
    meta = PeerMetadata.decode(sealed[OVERHEAD - MAC_BYTES:-MAC_BYTES])    # sealed, not encrypted
    payload = msgpack.unpackb(meta.payload)
    return payload["host"], payload["port"]


def _send_frame(sock, data: bytes) -> None:
    sock.sendall(struct.pack("!I", len(data)) + data)


def _notify(addr, sealer: Sealer, to: str, message: bytes) -> bool:
    """Connect as a peer sealing with `sealer`, send one notification; True when it was admitted."""
    with socket.create_connection(addr, timeout=5) as s:
        _send_frame(s, sealer.seal(b"tcp-hello", msgpack.packb({"op": "hello", "name": "prefill-0", "to": to,
                                                                 "token": ""})))
        head = s.recv(4)
        if len(head) < 4:
            return False
        s.recv(struct.unpack("!I", head)[0])
        _send_frame(s, msgpack.packb({"op": "notify", "msg": message}))
        s.recv(64)
        return True


def _refused(served, name: str) -> int:
    return next(s.kv_refused for s in served.stats() if s.name == name)


def test_forged_and_replayed_kv_messages_are_refused_and_change_nothing(served, pki, single_engine):
    reference = single_engine(served.engine_config).generate([PROMPT[5:40]], SamplingParams(max_tokens=8))[0]
    addr = _worker_listener(served, "decode-0")
    before = _refused(served, "decode-0")
    assert not _notify(addr, Sealer(b"w" * 32), "decode-0", b"x")       # the wrong secret: dropped at hello
    real = Sealer(SECRET.encode())
    ack = real.seal(b"kv-message", Message(Kind.ACK, "lease-made-up").encode())
    assert _notify(addr, real, "decode-0", ack)                         # admitted once (and meaningless)
    assert _notify(addr, real, "decode-0", ack)                         # the replay reaches the mailbox...
    forged = Sealer(b"v" * 32).seal(b"kv-message", Message(Kind.ABORT, "lease-made-up").encode())
    assert _notify(addr, real, "decode-0", forged)
    # ...which drops it: the next handoff drains the mailbox, and still decodes exactly.
    out = _client(served, pki, "alpha-1").generate(PROMPT[5:40], max_tokens=8)
    assert list(out.token_ids) == list(reference.token_ids)
    assert _refused(served, "decode-0") - before == 3                   # wrong hello, replay, forgery
    served.wait_idle()


def test_mutual_tls_refuses_a_client_without_a_certificate(served, pki):
    for cert in (None, "rogue"):
        with pytest.raises(grpc.RpcError) as e:
            _client(served, pki, "alpha-1", cert).generate("x", max_tokens=1, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    import ssl
    ctx = ssl.create_default_context(cadata=pki["ca"].decode())
    with pytest.raises((ssl.SSLError, ConnectionError, urllib.error.URLError)):
        urllib.request.urlopen(f"https://127.0.0.1:{served.cluster.http_port}/health", context=ctx, timeout=10).read()
    assert _client(served, pki, "alpha-1").generate("x", max_tokens=1).finish_reason == "length"


def test_a_ray_client_without_the_token_cannot_connect(served):
    gcs = ray.get_runtime_context().gcs_address
    probe = "import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); print('CONNECTED')"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_TOKEN")}
    env.update(RAY_AUTH_MODE="token", HOME=str(served.tmp_home))   # no ~/.ray/auth_token to fall back on
    out = subprocess.run([sys.executable, "-c", probe, gcs], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "CONNECTED" not in out.stdout
    assert "AuthenticationError" in out.stderr
    ok = subprocess.run([sys.executable, "-c", probe, gcs], env={**env, "RAY_AUTH_TOKEN": os.environ["RAY_AUTH_TOKEN"]},
                        capture_output=True, text=True, timeout=60)
    assert "CONNECTED" in ok.stdout, ok.stderr[-2000:]


def test_keys_and_secrets_appear_in_no_log_line(tmp_path):
    import tempfile
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "deploy"))
    from served_cluster import ServeProcess
    keys, secret = tmp_path / "keys", tmp_path / "secret"
    keys.write_text("alpha:{alpha-1}\n{bare}\n".format(**KEYS))
    secret.write_text(SECRET)
    ray_tmp = tempfile.mkdtemp(prefix="rs", dir="/tmp")       # this server's Ray session logs, apart
    serve = ServeProcess("--colocated", "--log-level", "DEBUG", "--api-key-file", str(keys),
                         "--cluster-secret-file", str(secret), "--dtype", "float32", "--max-tokens-limit", "16",
                         env={"RAY_TMPDIR": ray_tmp})
    try:
        assert Client(serve.target, api_key=KEYS["alpha-1"]).generate("def f():", max_tokens=4).token_ids
        with pytest.raises(grpc.RpcError):
            Client(serve.target, api_key=KEYS["beta"]).generate("x", max_tokens=2)
        with pytest.raises(grpc.RpcError):
            Client(serve.target, api_key=KEYS["alpha-1"] + "x").generate("x", max_tokens=2)
    finally:
        serve.stop()
    logs = [serve.log] + [p.read_text(errors="replace") for p in __import__("pathlib").Path(ray_tmp).rglob("*")
                          if p.is_file() and p.suffix in (".log", ".out", ".err", ".txt")]
    assert len(logs) > 3
    for text in logs:
        for value in (*KEYS.values(), SECRET):
            assert value not in text
