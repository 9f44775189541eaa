"""`splitserve generate --speculative ...` decodes the same greedy tokens as without it, and a bad
lookahead value is refused by the parser."""
import json

import pytest

from cluster.launch.cli import main


def _generate(capsys, *flags):
    assert main(["generate", "--json", "--max-tokens", "24", "--num-threads", "1", *flags,
                 "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("flags", [("--speculative", "ngram", "--num-speculative-tokens", "auto"),
                                   ("--speculative", "eagle", "--num-speculative-tokens", "3")])
def test_generate_with_speculation_matches_plain(capsys, flags):
    assert _generate(capsys, *flags) == _generate(capsys)


def test_bad_lookahead_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--num-speculative-tokens", "many", "x"])
    assert "num-speculative-tokens" in capsys.readouterr().err
