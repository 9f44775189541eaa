"""The dashboard and the rules, proven against a real Prometheus (Debian's `prometheus`, installed by
.ci/run): it scrapes a served cluster's metrics endpoint on 127.0.0.1 while requests flow, then every
PromQL expression of deploy/monitoring is evaluated through Prometheus's HTTP API and must return
series with values. Alerting conditions are empty while healthy, so for them the quantity left of the
comparison must have values (and the whole condition must evaluate without error). The same
Prometheus then proves what a vLLM user expects of the series: `model_name` on every one, the KV
usage ratio per worker, length histograms that count the requests sent, preemptions and queue-time
buckets per worker, admission by tenant, and no `_created` series."""
from __future__ import annotations

import json
import math
import re
import subprocess
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import yaml

from served_cluster import ServeProcess
from tools import DEPLOY, ROOT, require
from helpers import free_port

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MONITORING = DEPLOY / "monitoring"
RATE_INTERVAL = "1m"       # what Grafana's $__rate_interval stands for in these queries
# Repetitive code, so that the n-gram proposer finds matches and drafts; longer than the
# local-prefill threshold, so that every prompt's KV crosses from prefill to decode.
SERVED_NAME = "prom-coder"     # --served-model-name: every series' model_name
PER_TENANT = 4                 # --max-in-flight-per-tenant: a request of more samples is refused (too_large)
PROMPTS = ["x = 1\ny = 2\nx = 1\ny = 2\nx = 1\n", "def f(a):\n    return a\n\ndef g(a):\n    return a\n\ndef h(a):\n",
           "for i in range(3):\n    print(i)\nfor i in range(3):\n    print(i)\n", "import os\nimport sys\nimport os\n"]


def dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    return [(f"panel {p['title']!r} {t['refId']}", t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def rules() -> list[dict]:
    return [r for g in yaml.safe_load((MONITORING / "prometheus-rules.yaml").read_text())["groups"] for r in g["rules"]]


def condition_signal(expr: str) -> str:
    """`A > 0.95` -> `A`: the left side of the last top-level comparison (none inside (), [], {} or quotes)."""
    depth, quote, cut = 0, None, None
    for i, ch in enumerate(expr):
        if quote:
            quote = None if ch == quote and expr[i - 1] != "\\" else quote
        elif ch in "\"'`":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0 and ch in "<>=!" and (expr[i:i + 2] in ("==", "!=", ">=", "<=") or ch in "<>"):
            if expr[i - 1] not in "<>=!":
                cut = i
    assert cut is not None, f"no comparison in alert condition {expr!r}"
    return expr[:cut].strip()


def test_condition_signal():
    assert condition_signal('up{job="splitserve"} == 0') == 'up{job="splitserve"}'
    assert condition_signal("sum by (x) (rate(a[5m])) / b >= 0.5") == "sum by (x) (rate(a[5m])) / b"


def test_rule_files_pass_promtool():
    promtool = require("promtool", "prometheus")
    for args in (["check", "rules", "prometheus-rules.yaml"], ["test", "rules", "prometheus-rules.test.yaml"],
                 ["check", "config", "prometheus.yml"]):
        out = subprocess.run([promtool, *args], cwd=MONITORING, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, f"promtool {' '.join(args)}:\n{out.stdout}{out.stderr}"


def test_dashboard_reads_only_recorded_or_exported_series():
    recorded = {r["record"] for r in rules() if "record" in r}
    for where, expr in dashboard_exprs():
        for name in re.findall(r"splitserve:[a-z0-9_:]+", expr):
            assert name in recorded, f"{where} reads {name}, which no rule records"
        assert "$__rate_interval" in expr or "rate(" not in expr, f"{where}: rate windows use $__rate_interval"


def _query(base: str, expr: str) -> dict:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        return json.loads(urllib.request.urlopen(url, timeout=10).read())
    except urllib.error.HTTPError as exc:      # 400/422: a bad expression; the body says why
        return json.loads(exc.read())


def _values(answer: dict) -> list[float]:
    data = answer["data"]
    if data["resultType"] in ("scalar", "string"):
        return [float(data["result"][1])]
    return [float(s["value"][1]) for s in data["result"]]


@dataclass(frozen=True)
class Scraped:
    """The module's one served cluster, scraped by a real Prometheus after its requests."""
    base: str                       # Prometheus's HTTP API
    speculative: bool
    outs: tuple                     # the gRPC requests' completions
    metrics_texts: dict             # endpoint -> its exposition text (--metrics-port, the HTTP API's /metrics)


def _refused_too_large(http_url: str) -> int:
    """One completion asking for more samples than a tenant may hold: refused by admission."""
    body = json.dumps({"model": SERVED_NAME, "prompt": "x", "n": PER_TENANT + 1, "max_tokens": 1}).encode()
    req = urllib.request.Request(f"{http_url}/v1/completions", data=body, headers={"content-type": "application/json"})
    try:
        return urllib.request.urlopen(req, timeout=30).status
    except urllib.error.HTTPError as exc:
        return exc.code


def _held_until_scraped(base: str, client) -> list:
    """Long streams, one at a time, until Prometheus has scraped the decode worker's KV in use: the
    short waves can start and end between two scrapes (1 s apart), and the KV-usage checks need a
    scrape that saw blocks held. Their completions (each runs to its end: the token counts are
    compared with what the server counted)."""
    seen = 'max_over_time(splitserve_kv_cache_usage_ratio{role="decode"}[1m]) > 0'
    outs = []
    with ThreadPoolExecutor(1) as pool:
        while not outs or not _values(_query(base, seen)):
            assert len(outs) < 8, "no scrape saw the KV blocks of 8 streams in flight"
            stream = pool.submit(client.generate, PROMPTS[1], max_tokens=200, ignore_eos=True)
            while not stream.done() and not _values(_query(base, seen)):
                time.sleep(0.2)
            outs.append(stream.result())
    return outs


@pytest.fixture(scope="module")
def prometheus_over_cluster(tmp_path_factory):
    binary = require("prometheus", "prometheus")
    help_text = subprocess.run(["splitserve", "serve", "--help"], capture_output=True, text=True, check=True).stdout
    speculative = "--speculative" in help_text
    spec_args = ["--speculative", "ngram"] if speculative else []
    # Prometheus starts first, its target the metrics port given to serve: its start and its
    # scrapers' first round (every 5 s) overlap the cluster's start.
    metrics_port = free_port()
    tmp = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())   # the shipped config, sped up
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(MONITORING / "prometheus-rules.yaml")]
    config["scrape_configs"][0]["static_configs"] = [{"targets": [f"127.0.0.1:{metrics_port}"]}]
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    base = f"http://127.0.0.1:{free_port()}"
    prom = subprocess.Popen([binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
                             f"--web.listen-address={base[7:]}"], stdout=subprocess.DEVNULL,
                            stderr=(tmp / "prometheus.log").open("w"))
    serve = None
    try:
        serve = ServeProcess("--dtype", "float32", "--transport", "nixl", "--local-prefill-max-tokens", "4",
                             "--served-model-name", SERVED_NAME, "--metrics-port", str(metrics_port),
                             "--max-in-flight-per-tenant", str(PER_TENANT), *spec_args)
        assert serve.metrics_url.split("/")[2] == f"127.0.0.1:{metrics_port}", serve.metrics_url
        http_url = serve.http_url
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{base}/-/ready", timeout=2)
                break
            except OSError:
                assert prom.poll() is None and time.monotonic() < deadline, (tmp / "prometheus.log").read_text()
                time.sleep(0.3)
        # Ready is not scraping: Prometheus hands new targets to its scrapers only every 5 s. Wait for
        # real scrapes before any request, so every counter starts from a baseline sample.
        while not _values(_query(base, 'count_over_time(up{job="splitserve"}[1m])')) or \
                _values(_query(base, 'count_over_time(up{job="splitserve"}[1m])'))[0] < 2:
            assert time.monotonic() < deadline + 30, "Prometheus never scraped the cluster"
            time.sleep(0.5)
        from router.client import Client
        client = Client(serve.target)
        outs = []
        with ThreadPoolExecutor(PER_TENANT) as pool:
            for _ in range(2):           # the same prompts twice: the second wave hits the prefix cache
                outs += pool.map(lambda p: client.generate(p, max_tokens=24), PROMPTS * 2)
                assert all(o.finish_reason in ("length", "stop") for o in outs)
                time.sleep(1.5)
        outs += _held_until_scraped(base, client)
        assert _refused_too_large(http_url) == 400
        time.sleep(3)                    # scrapes and rule evaluations after the last request
        texts = {"--metrics-port": serve.metrics(),
                 "HTTP /metrics": urllib.request.urlopen(f"{http_url}/metrics", timeout=10).read().decode()}
        yield Scraped(base, speculative, tuple(outs), texts)
    finally:
        prom.terminate()
        prom.wait(30)
        if serve is not None:
            assert serve.stop() == 0, serve.log[-3000:]


def test_every_dashboard_and_rule_expression_has_data(prometheus_over_cluster):
    base, speculative = prometheus_over_cluster.base, prometheus_over_cluster.speculative
    targets = json.loads(urllib.request.urlopen(f"{base}/api/v1/targets", timeout=10).read())["data"]
    assert [t["health"] for t in targets["activeTargets"]] == ["up"], targets
    exprs = [(w, e.replace("$__rate_interval", RATE_INTERVAL)) for w, e in dashboard_exprs()]
    for r in rules():
        if "record" in r:
            exprs += [(f"rule {r['record']}", r["expr"]), (f"recorded {r['record']}", r["record"])]
        else:
            assert _query(base, r["expr"])["status"] == "success", f"alert {r['alert']}: {r['expr']}"
            exprs.append((f"alert {r['alert']} (its quantity)", condition_signal(r["expr"])))
    failures, skipped = [], []
    for where, expr in exprs:
        if (not speculative and "spec_" in expr) or "expert_tokens" in expr:   # expert_*: the served model is dense
            skipped.append(where)
            continue
        answer = _query(base, expr)
        if answer["status"] != "success":
            failures.append(f"{where}: {answer.get('error')}\n    {expr}")
        elif not any(math.isfinite(v) for v in _values(answer)):
            failures.append(f"{where}: {'no series' if not _values(answer) else 'only NaN/Inf'}\n    {expr}")
    if skipped:
        print(f"skipped {len(skipped)} expressions: speculative decoding's where `splitserve serve --help` has no "
              f"--speculative (no spec_* series), and the experts' (the served model is dense): {skipped}")
    assert not failures, "\n".join(failures)
    assert len(exprs) - len(skipped) >= 30


# --- what a vLLM user expects of the series, read back from Prometheus ----------------------------
JOB = 'job="splitserve"'
# The router's series (cluster/metrics.py), each carrying model_name (histograms by their _count).
REQUEST_SERIES = ("time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                  "e2e_request_latency_seconds_count", "request_prefill_time_seconds_count",
                  "request_decode_time_seconds_count", "request_prompt_tokens_count",
                  "request_generation_tokens_count", "generation_tokens_total", "prompt_tokens_total",
                  "requests_finished_total", "requests_refused_total", "admission_queue_depth")
WORKERS = {"prefill-0", "decode-0"}


def _series(base: str, expr: str) -> list[tuple[dict, float]]:
    answer = _query(base, expr)
    assert answer["status"] == "success", f"{expr}: {answer.get('error')}"
    return [(s["metric"], float(s["value"][1])) for s in answer["data"]["result"]]


def test_every_series_carries_the_served_model_name(prometheus_over_cluster):
    base = prometheus_over_cluster.base
    names = {m["__name__"] for m, _ in _series(base, f'count by (__name__) ({{{JOB}, model_name="{SERVED_NAME}"}})')}
    assert {f"splitserve_{n}" for n in REQUEST_SERIES} <= names, sorted(names)
    assert {"splitserve_kv_cache_usage_ratio", "splitserve_kv_transfers_total"} <= names    # workers' too
    others = _series(base, f'{{{JOB}, __name__=~"splitserve_.+", model_name!="{SERVED_NAME}"}}')
    assert not others, f"series without model_name={SERVED_NAME!r}: {others[:5]}"


def test_kv_usage_ratio_is_a_share_of_the_pool_per_worker(prometheus_over_cluster):
    base = prometheus_over_cluster.base
    ratios = _series(base, f"splitserve_kv_cache_usage_ratio{{{JOB}}}")
    assert sorted(m["worker"] for m, _ in ratios) == sorted(WORKERS)              # one series per worker
    assert all(0 <= v <= 1 for _, v in ratios), ratios
    # Over the run, within [0, 1], and the blocks held over the pool, scrape by scrape.
    peaks = _series(base, f"max_over_time(splitserve_kv_cache_usage_ratio{{{JOB}}}[5m])")
    assert all(0 <= v <= 1 for _, v in peaks) and any(v > 0 for _, v in peaks), peaks
    apart = _series(base, f"max_over_time((abs(splitserve_kv_cache_usage_ratio{{{JOB}}} - on (worker, role) "
                          f"(splitserve_kv_cache_blocks_in_use / splitserve_kv_cache_blocks)))[5m:1s])")
    assert len(apart) == len(WORKERS) and all(v < 1e-9 for _, v in apart), apart


def test_length_histograms_count_the_requests_sent(prometheus_over_cluster):
    base, outs = prometheus_over_cluster.base, prometheus_over_cluster.outs

    def one(expr: str) -> float:
        (_, value), = _series(base, expr)
        return value
    sent = len(outs)                    # the refused request never started: not counted
    assert one(f"splitserve_request_prompt_tokens_count{{{JOB}}}") == sent
    assert one(f'splitserve_request_prompt_tokens_bucket{{{JOB}, le="+Inf"}}') == sent
    assert one(f'splitserve_request_prompt_tokens_bucket{{{JOB}, le="5.0"}}') == 0     # every prompt is longer
    assert one(f"splitserve_request_generation_tokens_count{{{JOB}}}") == sent
    assert one(f"splitserve_request_generation_tokens_sum{{{JOB}}}") == sum(len(o.token_ids) for o in outs)


def test_preemptions_and_queue_time_buckets_per_worker(prometheus_over_cluster):
    base = prometheus_over_cluster.base
    preemptions = _series(base, f"splitserve_num_preemptions_total{{{JOB}}}")
    assert sorted(m["worker"] for m, _ in preemptions) == sorted(WORKERS) and all(v >= 0 for _, v in preemptions)
    buckets = _series(base, f"splitserve_request_queue_time_seconds_bucket{{{JOB}}}")
    for worker in WORKERS:
        mine = sorted(((float(m["le"]), v) for m, v in buckets if m["worker"] == worker))
        assert len(mine) > 10 and mine[-1][0] == math.inf, mine
        assert all(a[1] <= b[1] for a, b in zip(mine, mine[1:])), f"{worker}: buckets must not decrease: {mine}"
        (_, count), = _series(base, f'splitserve_request_queue_time_seconds_count{{{JOB}, worker="{worker}"}}')
        assert count == mine[-1][1], (count, mine)
    assert sum(v for m, v in buckets if m["le"] == "+Inf") > 0                  # requests were scheduled


def test_admission_is_counted_by_tenant(prometheus_over_cluster):
    base = prometheus_over_cluster.base
    depth = _series(base, f"splitserve_admission_queue_depth{{{JOB}}}")
    assert [m["tenant"] for m, _ in depth] == ["anonymous"], depth                  # no API keys
    refused = _series(base, f"splitserve_requests_refused_total{{{JOB}}}")
    assert [(m["reason"], m["tenant"], v) for m, v in refused] == [("too_large", "anonymous", 1.0)], refused


def test_no_created_series(prometheus_over_cluster):
    scraped = prometheus_over_cluster
    assert _series(scraped.base, f"count({{{JOB}}})")[0][1] > 50
    assert not _series(scraped.base, f'{{{JOB}, __name__=~".+_created"}}')
    for where, text in scraped.metrics_texts.items():
        assert "splitserve_kv_cache_usage_ratio" in text and "splitserve_request_prompt_tokens_count" in text, where
        created = re.findall(r"^\w+_created\b.*$", text, re.MULTILINE)
        assert not created, f"{where}: {created[:3]}"
