import sys

import pytest

from cluster.launch.cli import load
from cluster.transfer.base import TransportUnavailable
from cluster.transfer.registry import make_transport


def test_unknown_transport_is_named():
    with pytest.raises(TransportUnavailable, match="unknown transport 'pigeon'; choose one of nixl, ucx, tcp"):
        make_transport("pigeon", "a")


def test_missing_nixl_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl._api", None)      # as if nixl were not installed
    with pytest.raises(TransportUnavailable, match=r"pip install 'splitserve\[nixl\]'"):
        make_transport("nixl", "a")


def _load(*argv):
    return load(list(argv), check_machine=False).config


def test_yaml_config_sets_serve_defaults_and_flags_win(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("prefill: 2\ndecode: 3\ntransport: tcp\nmax-tokens-limit: 100\n")
    got = _load("serve", "--config", str(cfg), "--decode", "1")
    assert (got.num_prefill, got.num_decode, got.data_plane.transport, got.max_tokens_limit) == (2, 1, "tcp", 100)


def test_yaml_config_rejects_unknown_keys(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("prefil: 2\n")
    with pytest.raises(ValueError, match="unknown option"):
        _load("serve", "--config", str(cfg))


def test_deterministic_from_yaml_and_the_command_line(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("deterministic: true\n")
    assert _load("serve", "--config", str(cfg)).engine.deterministic
    assert not _load("serve").engine.deterministic
    assert _load("generate", "--deterministic", "x").deterministic


@pytest.mark.parametrize("line,want", [("kv-checksums: off\n", False), ("kv-checksums: on\n", True), ("", True)])
def test_kv_checksums_switch_from_yaml(tmp_path, line, want):
    """YAML reads on/off as booleans; the switch takes both spellings."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(line)
    assert _load("serve", "--config", str(cfg)).data_plane.checksums is want
    assert _load("serve", "--kv-checksums", "off").data_plane.checksums is False


def test_memory_plan_and_batch_limits_from_the_command_line(tmp_path):
    cfg = _load("serve", "--memory-fraction", "0.2", "--num-kv-blocks", "100", "--max-num-seqs", "8",
                "--max-num-batched-tokens", "512").engine
    assert (cfg.cache.memory_fraction, cfg.cache.num_blocks) == (0.2, 100)
    assert (cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens) == (8, 512)
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("max-num-seqs: 4\nmemory-fraction: 0.5\n")
    cfg = _load("serve", "--config", str(yaml_file)).engine
    assert (cfg.scheduler.max_num_seqs, cfg.cache.memory_fraction, cfg.cache.num_blocks) == (4, 0.5, None)
