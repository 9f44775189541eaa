"""The dashboard and the rules, proven against a real Prometheus (Debian's `prometheus`, installed by
.ci/run): it scrapes a served cluster's metrics endpoint on 127.0.0.1 while requests flow, then every
PromQL expression of deploy/monitoring is evaluated through Prometheus's HTTP API and must return
series with values. Alerting conditions are empty while healthy, so for them the quantity left of the
comparison must have values (and the whole condition must evaluate without error)."""
from __future__ import annotations

import json
import math
import re
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

from served_cluster import ServeProcess
from tools import DEPLOY, ROOT, require

MONITORING = DEPLOY / "monitoring"
RATE_INTERVAL = "1m"       # what Grafana's $__rate_interval stands for in these queries
# Repetitive code, so that the n-gram proposer finds matches and drafts; longer than the
# local-prefill threshold, so that every prompt's KV crosses from prefill to decode.
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


@pytest.fixture(scope="module")
def prometheus_over_cluster(tmp_path_factory):
    binary = require("prometheus", "prometheus")
    help_text = subprocess.run(["splitserve", "serve", "--help"], capture_output=True, text=True, check=True).stdout
    speculative = "--speculative" in help_text
    spec_args = ["--speculative", "ngram"] if speculative else []
    serve = ServeProcess("--dtype", "float32", "--transport", "nixl", "--local-prefill-max-tokens", "4", *spec_args)
    tmp = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())   # the shipped config, sped up
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(MONITORING / "prometheus-rules.yaml")]
    config["scrape_configs"][0]["static_configs"] = [{"targets": [serve.metrics_url.split("/")[2]]}]
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    base = f"http://127.0.0.1:{_free_port()}"
    prom = subprocess.Popen([binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp / 'data'}",
                             f"--web.listen-address={base[7:]}"], stdout=subprocess.DEVNULL,
                            stderr=(tmp / "prometheus.log").open("w"))
    try:
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
        with ThreadPoolExecutor(4) as pool:
            for _ in range(2):           # the same prompts twice: the second wave hits the prefix cache
                outs = list(pool.map(lambda p: client.generate(p, max_tokens=24), PROMPTS * 2))
                assert all(o.finish_reason in ("length", "stop") for o in outs)
                time.sleep(1.5)
        time.sleep(3)                    # scrapes and rule evaluations after the last request
        yield base, speculative
    finally:
        prom.terminate()
        prom.wait(30)
        assert serve.stop() == 0, serve.log[-3000:]


def test_every_dashboard_and_rule_expression_has_data(prometheus_over_cluster):
    base, speculative = prometheus_over_cluster
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
        if not speculative and "spec_" in expr:
            skipped.append(where)
            continue
        answer = _query(base, expr)
        if answer["status"] != "success":
            failures.append(f"{where}: {answer.get('error')}\n    {expr}")
        elif not any(math.isfinite(v) for v in _values(answer)):
            failures.append(f"{where}: {'no series' if not _values(answer) else 'only NaN/Inf'}\n    {expr}")
    if skipped:
        print(f"skipped {len(skipped)} speculative-decoding expressions: `splitserve serve --help` has no "
              f"--speculative, so no spec_* series exist: {skipped}")
    assert not failures, "\n".join(failures)
    assert len(exprs) - len(skipped) >= 30
