"""Several models on the command line and in the YAML (cluster/launch/model_specs.py), and the
skill classifier and model registry the router routes `model: "auto"` with (router/skills.py,
router/served_models.py): plain policy code, no cluster."""
from __future__ import annotations

import pytest

from cluster.launch.cli import load
from cluster.launch.cluster_config import ModelSpec
from cluster.launch.settings import SettingError
from router.served_models import ModelEntry, ServedModels, UnknownModel
from router.skills import SkillClassifier, SkillRoute, load_skill_routes


def test_repeated_model_flags_make_the_models(tmp_path):
    cfg = load(["serve", "--model", "stdlib-coder", "--model", str(tmp_path), "--served-model-name", "coder",
                "--served-model-name", "other"], check_machine=False).config
    assert cfg.engine.model.name == "stdlib-coder" and cfg.served_model_name == "coder"
    assert cfg.models == (ModelSpec(str(tmp_path), "other"),)
    with pytest.raises(SettingError, match="same order"):
        load(["serve", "--model", "stdlib-coder", "--model", str(tmp_path), "--served-model-name", "x"],
             check_machine=False)


def test_yaml_models_list(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("decode: 2\nmodels:\n  - {model: stdlib-coder, served_model_name: coder, dtype: float32}\n"
                    f"  - model: {tmp_path}\n    prefill: 2\n")
    cfg = load(["serve", "--config", str(path)], check_machine=False).config
    assert cfg.engine.model.name == "stdlib-coder" and cfg.engine.dtype == "float32" and cfg.num_decode == 2
    assert cfg.models == (ModelSpec(str(tmp_path), num_prefill=2),)
    path.write_text("models:\n  - {model: stdlib-coder, workers: 3}\n")
    with pytest.raises(SettingError, match="unknown key"):
        load(["serve", "--config", str(path)], check_machine=False)


def _entry(name: str, chat: bool) -> ModelEntry:
    return ModelEntry(name, service=None, http=None, chat=chat)


def test_auto_picks_by_skill_among_able_models():
    routes = [SkillRoute("coder", ("completing Python code",), ("def f(x):\n    return x\n", "import os\n")),
              SkillRoute("chatter", ("answering questions",), ("What is the tallest mountain?", "Hello, how are you?"))]
    models = ServedModels([_entry("chatter", True), _entry("coder", False)], SkillClassifier(routes))
    assert models.route("def add(a, b):\n", chat=False).name == "coder"
    assert models.route("What is the capital of France?", chat=False).name == "chatter"
    assert models.route("def add(a, b):\n", chat=True).name == "chatter"     # only chatter has a template
    assert models.find("").name == "chatter" and models.find("coder").name == "coder"
    with pytest.raises(UnknownModel, match="'chatter', 'coder'"):
        models.find("nope")
    with pytest.raises(UnknownModel):
        ServedModels([_entry("a", True), _entry("b", True)]).route("x", chat=False)   # no routes: no "auto"


def test_bad_skill_routes_refused_at_load(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("routes: []\n")
    with pytest.raises(SettingError, match="--skill-routes.*routes"):
        load(["serve", "--skill-routes", str(path)], check_machine=False)


def test_skill_routes_file(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("routes:\n  - model: a\n    skills: [x]\n    examples: [y]\n")
    assert load_skill_routes(path) == (SkillRoute("a", ("x",), ("y",)),)
    path.write_text("routes:\n  - skills: [x]\n")
    with pytest.raises(ValueError, match="routes\\[0\\]"):
        load_skill_routes(path)
