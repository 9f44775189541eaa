"""The models one port serves, when a cluster serves several (`--model` more than once).

Each model has its own frontend stack (router, worker pool and roster, validation limits,
tokenizer, chat template, admission, metrics): its requests reach only its own workers, so prefix
caches, KV handoffs and layouts never mix models. The frontend that owns the ports holds a
`ServedModels` and hands each request to the stack of the model it names (`model: "auto"`: the one
router/skills.py picks among those that can serve the endpoint); a name no model has is a 404 /
NOT_FOUND naming the served ones.
"""
from __future__ import annotations

from dataclasses import dataclass

from router.skills import AUTO, SkillClassifier


@dataclass(frozen=True)
class ModelEntry:
    name: str               # its served name (both APIs)
    service: object         # its router/server.py InferenceService
    http: object | None     # its router/openai/http_server.py OpenAIServer (None: no HTTP API)
    chat: bool              # it has a chat template (may serve /v1/chat/completions)


class UnknownModel(LookupError):
    """A request named a model this server does not serve (or "auto" with no route to take)."""


class ServedModels:
    def __init__(self, entries: list[ModelEntry], classifier: SkillClassifier | None = None):
        """`entries`: the first is the default (a request that names no model gets it)."""
        self.entries = {e.name: e for e in entries}
        self.default = entries[0]
        self.classifier = classifier

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.entries)

    def unknown(self, name: str) -> UnknownModel:
        auto = f" or {AUTO!r} (skill routing)" if self.classifier is not None else ""
        return UnknownModel(f"the model {name!r} is not served here; served: "
                            f"{', '.join(repr(n) for n in self.names)}{auto}")

    def find(self, name: str) -> ModelEntry:
        """The entry `name` names (empty: the default); UnknownModel otherwise ("auto" included: `route` it)."""
        if not name:
            return self.default
        entry = self.entries.get(name)
        if entry is None:
            raise self.unknown(name)
        return entry

    def route(self, text: str, chat: bool) -> ModelEntry:
        """`model: "auto"`: the model whose skills fit `text`, among those able to serve the endpoint
        (a chat request only to models with a chat template). A prompt without text (token ids)
        goes to the first model able to serve it."""
        able = [e.name for e in self.entries.values() if e.chat or not chat]
        if not able:
            raise self.unknown(AUTO)
        if not text.strip() and self.classifier is not None:   # token ids, no text to read: the first able model
            return self.default if self.default.name in able else self.entries[able[0]]
        if self.classifier is None or len(able) == 1:
            if self.classifier is None:
                raise self.unknown(AUTO)
            return self.entries[able[0]]
        chosen = self.classifier.choose(text, able)
        return self.entries[chosen or able[0]]
