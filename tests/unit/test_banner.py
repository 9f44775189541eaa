"""The start-up banner says what is served and how to reach it (cluster/launch/banner.py)."""
import json
import re
import shlex

from cluster.launch.banner import Endpoints, banner
from cluster.launch.cli import load
from cluster.worker_messages import WorkerStats

ALL = Endpoints(grpc="127.0.0.1:50051", http="http://127.0.0.1:8000", metrics="http://127.0.0.1:9400/metrics")


def _banner(*argv, at=ALL, name="coder", chat=True, workers=(), max_model_len=None) -> list[str]:
    cfg = load(["serve", "--model", "stdlib-coder", *argv], check_machine=False).config
    return banner(cfg, name, "9.9.9", at, chat, workers, max_model_len)


def _curl_body(lines: list[str]) -> tuple[str, dict]:
    curl = next(line for line in lines if "try: curl" in line).split("try: ", 1)[1]
    words = shlex.split(curl)
    return words[words.index("-s") + 1], json.loads(words[words.index("-d") + 1])


def test_a_disaggregated_cluster_says_what_how_and_where():
    lines = _banner("--served-model-name", "coder", "--speculative", "ngram", "--num-speculative-tokens", "3",
                    "--transport", "tcp", "--deterministic", "--quantization", "int8")
    text = "\n".join(lines)
    assert "  weights: --quantization int8 (docs/quantization.md)" in text
    assert lines[0] == "splitserve 9.9.9: serving coder (from stdlib-coder) on 1 prefill + 1 decode workers, KV over tcp"
    assert "prompts of at most 32 tokens (or at least 90% cached on the decode worker) are prefilled on the decode " \
           "worker without a KV transfer" in text
    assert "speculative decoding: ngram, 3 tokens per step; deterministic (batch-invariant): on" in text
    assert "  gRPC: 127.0.0.1:50051 (splitserve.v1" in text
    assert "  OpenAI API: http://127.0.0.1:8000/v1 (OpenAI's defaults: temperature 1" in text
    assert "  metrics: http://127.0.0.1:9400/metrics" in text
    assert lines[-1] == '  try: splitserve generate --server 127.0.0.1:50051 "What is the capital of France?"'
    url, body = _curl_body(lines)
    assert url == "http://127.0.0.1:8000/v1/chat/completions"
    assert body["model"] == "coder" and body["messages"][0]["role"] == "user"


def test_the_local_prefill_rule_follows_its_settings():
    text = "\n".join(_banner("--local-prefill-max-tokens", "7", "--local-prefill-cached-fraction", "0.5"))
    assert "prompts of at most 7 tokens (or at least 50% cached on the decode worker)" in text
    text = "\n".join(_banner("--local-prefill-max-tokens", "0"))
    assert "prefill: on a prefill worker, KV moved to the decode worker; prompts at least 90% cached" in text
    assert "prefill:" not in "\n".join(_banner("--colocated"))


def test_a_model_without_a_chat_template_gets_a_completion_to_try():
    lines = _banner(name="stdlib-coder", chat=False)
    assert lines[0] == "splitserve 9.9.9: serving stdlib-coder on 1 prefill + 1 decode workers, KV over nixl"
    url, body = _curl_body(lines)
    assert url.endswith("/v1/completions") and body["prompt"] and body["model"] == "stdlib-coder"
    assert "speculative decoding: off (a request may ask for ngram)" in "\n".join(lines)


def test_only_the_apis_served_are_named():
    lines = _banner(at=Endpoints(grpc=None, http="http://127.0.0.1:8000", metrics=None))
    text = "\n".join(lines)
    assert "gRPC" not in text and "--server" not in text and "metrics:" not in text
    assert "try: curl" in text
    lines = _banner(at=Endpoints(grpc="127.0.0.1:1", http=None, metrics=None))
    assert not any(re.search("OpenAI|curl", line) for line in lines)


# SmolLM2-135M's pool under the CPU default: 4 GiB of 360 KiB blocks.
DEFAULT_LIMIT = "--kv-cache-memory (default 4 GiB on CPU)"


def _stats(name: str, blocks: int = 11650, limit: str = DEFAULT_LIMIT) -> WorkerStats:
    return WorkerStats(name=name, role=name.split("-")[0], incarnation="i", ready=True, blocks_total=blocks,
                       blocks_free=blocks, block_size=16, kv_bytes=blocks * 368640, kv_limit=limit)


def test_the_kv_pool_as_planned_is_said_per_role_with_what_set_it():
    lines = _banner(workers=[_stats("prefill-0"), _stats("decode-0")], max_model_len=8192)
    kv = [line for line in lines if "KV cache:" in line]
    assert kv == [f"  KV cache: {w} 4 GiB = 11,650 blocks of 16 tokens (186,400 tokens, 22 sequences of 8,192); "
                  f"set by {DEFAULT_LIMIT}" for w in ("prefill-0", "decode-0")]
    assert lines.index(kv[-1]) < next(i for i, line in enumerate(lines) if "gRPC:" in line)


def test_workers_alike_share_a_line_and_a_pool_that_differs_gets_its_own():
    small = "--memory-fraction (0.4 of the memory free at start), less than " + DEFAULT_LIMIT
    workers = [_stats("decode-0"), _stats("decode-1"), _stats("decode-2", 2000, small)]
    kv = [line for line in _banner("--decode", "3", workers=workers, max_model_len=8192) if "KV cache:" in line]
    assert kv[0].startswith("  KV cache: decode-0, decode-1 4 GiB = 11,650 blocks")
    assert kv[1] == (f"  KV cache: decode-2 703.12 MiB = 2,000 blocks of 16 tokens (32,000 tokens, 3 sequences of "
                     f"8,192); set by {small}")
    many = [_stats(f"decode-{i}") for i in range(5)]
    (line,) = [line for line in _banner("--decode", "5", workers=many) if "KV cache:" in line]
    assert line.startswith("  KV cache: decode-0 and 4 more 4 GiB = ")


def test_the_configured_max_model_len_counts_sequences_when_none_is_given():
    (line,) = [line for line in _banner("--max-model-len", "512", workers=[_stats("decode-0")]) if "KV cache" in line]
    assert "(186,400 tokens, 364 sequences of 512)" in line
    assert not [line for line in _banner() if "KV cache" in line]      # no stats: nothing claimed
