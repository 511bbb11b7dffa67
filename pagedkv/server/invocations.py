"""SageMaker's POST /invocations, which vLLM serves beside /ping: one path for every kind of request
the model answers, told apart by its body.

vLLM tries the request types its model serves in a fixed order (chat completion, completion,
embedding, classification, rerank, score) and answers as the first one the body validates as. Here
each kind is known by the fields that mark it, taken in the same order, and the body then goes to
that kind's own endpoint: a valid body lands where vLLM sends it, and a mistake in one (a chat
body's bad temperature) is answered as its endpoint answers it, not retried as another kind.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.server.protocol import CLASSIFY_PATHS, RERANK_PATHS, SCORE_PATHS

PATH = "/invocations"


@dataclass(frozen=True)
class Kind:
    name: str
    path: str  # the endpoint that answers it
    marks: tuple[str, ...]  # body fields, any one of which marks it

    def shown(self) -> str:
        return f"{' or '.join(self.marks)} ({self.name})"


KINDS = (
    Kind("chat completion", "/v1/chat/completions", ("messages",)),
    Kind("completion", "/v1/completions", ("prompt",)),
    Kind("embedding", "/v1/embeddings", ("input", "messages")),
    Kind("classification", CLASSIFY_PATHS[0], ("input", "messages")),
    Kind("rerank", RERANK_PATHS[0], ("query",)),
    Kind("score", SCORE_PATHS[0], ("text_1", "queries", "data_1")),
)


def serves(engine, kind: Kind) -> bool:
    """Whether the engine (an LLMEngine) answers this kind at all."""
    if kind.path in ("/v1/chat/completions", "/v1/completions"):
        return bool(engine.generates)
    if not engine.pools:
        return False
    classifier = engine.classifier
    if kind.name == "embedding":
        return classifier is None
    if kind.name == "classification":
        return classifier is not None
    return classifier is None or len(classifier.labels) == 1  # (more labels score no pairs)


def pick(body: dict, engine=None) -> Kind | None:
    """The kind a body asks for: the first of KINDS that the engine serves and the body marks;
    else the first it marks, whose endpoint says why it is refused; None if it marks none. With
    no engine (the -dp router, which only routes), the first it marks."""
    marked = [k for k in KINDS if any(body.get(f) is not None for f in k.marks)]
    served = [k for k in marked if engine is not None and serves(engine, k)]
    first = served or marked
    return first[0] if first else None


def unmarked(engine) -> str:
    """The refusal of a body that marks no kind: what this engine would take."""
    kinds = [k.shown() for k in KINDS if serves(engine, k)]
    return f"{PATH} could not tell what the body asks for: give {'; '.join(kinds)}"
