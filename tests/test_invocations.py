"""SageMaker's POST /invocations (pagedkv/server/invocations.py): each body answered exactly as the
endpoint its fields name would answer it, streamed where asked; mistakes answered by that
endpoint; a body that names nothing refused with what would be taken; nothing left running."""

from __future__ import annotations

import json

import httpx
import pytest
from server_process import TINY_SERVER, ServerProcess
from test_scoring import seq_cls_folder
from tiny_model import make_tiny_model

MESSAGES = [{"role": "user", "content": "Say something"}]
GREEDY = {"model": "tiny", "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("inv") / "qwen3", arch="qwen3", tie=True)


def post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def tokens(answer: dict) -> int:
    return answer["usage"]["total_tokens"]  # (prompt_tokens_details differ: the second is cached)


def rounded(values: list[float]) -> list[float]:
    """To 5 places: the second of two equal requests reads its prompt from the prefix cache, in
    another order of float additions."""
    return [round(v, 5) for v in values]


def same_answer(server: ServerProcess, path: str, body: dict, keep) -> dict:
    """The body through /invocations and through `path`: both 200, equal in what `keep` takes
    (ids and timestamps differ)."""
    via = post(server, "/invocations", body)
    direct = post(server, path, body)
    assert via.status_code == direct.status_code == 200, (via.text, direct.text)
    assert keep(via.json()) == keep(direct.json())
    return via.json()


def test_each_kind_of_body_is_answered_as_its_endpoint_answers_it(qwen3):
    with ServerProcess(qwen3, *TINY_SERVER, "--dtype", "float32") as server:
        chat = same_answer(
            server,
            "/v1/chat/completions",
            {**GREEDY, "messages": MESSAGES},
            lambda a: (a["object"], [c["message"] for c in a["choices"]], tokens(a)),
        )
        assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["content"]
        text = same_answer(
            server,
            "/v1/completions",
            {**GREEDY, "prompt": ["Once upon", "a time"]},
            lambda a: (a["object"], [(c["index"], c["text"]) for c in a["choices"]]),
        )
        assert text["object"] == "text_completion" and len(text["choices"]) == 2
        vectors = same_answer(
            server,
            "/v1/embeddings",
            {"model": "tiny", "input": ["hello", "world"], "encoding_format": "float"},
            lambda a: [rounded(d["embedding"]) for d in a["data"]],
        )
        assert len(vectors["data"]) == 2 and len(vectors["data"][0]["embedding"]) == 64
        docs = ["a cat sat", "the dog ran far", "stocks fell"]
        ranked = same_answer(
            server,
            "/rerank",
            {"model": "tiny", "query": "a pet", "documents": docs},
            lambda a: [(r["index"], round(r["relevance_score"], 5)) for r in a["results"]],
        )
        assert sorted(r["index"] for r in ranked["results"]) == [0, 1, 2]
        same_answer(
            server,
            "/score",
            {"model": "tiny", "text_1": "a pet", "text_2": docs},
            lambda a: [(d["index"], round(d["score"], 5)) for d in a["data"]],
        )

        # streamed as the chat endpoint streams
        with httpx.stream(
            "POST",
            f"{server.url}/invocations",
            json={**GREEDY, "messages": MESSAGES, "stream": True},
            timeout=60,
        ) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        streamed = "".join(
            c["delta"].get("content") or "" for e in events[:-1] for c in json.loads(e)["choices"]
        )
        assert streamed == chat["choices"][0]["message"]["content"]

        # mistakes are the named endpoint's; a body naming nothing is told what would be taken
        bad = post(server, "/invocations", {**GREEDY, "messages": MESSAGES, "temperature": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
        unknown = post(server, "/invocations", {"model": "tiny", "text": "hi"})
        assert unknown.status_code == 400, unknown.text
        message = unknown.json()["error"]["message"]
        assert message.startswith("/invocations could not tell what the body asks for")
        for kind in ("messages (chat completion)", "prompt (completion)", "query (rerank)"):
            assert kind in message, message
        assert "classification" not in message  # this model has no classifier
        other = post(server, "/invocations", {"model": "other", "prompt": "hi"})
        assert other.status_code == 404 and other.json()["error"]["param"] == "model"
        for body in ([1, 2], "text"):
            assert httpx.post(f"{server.url}/invocations", json=body, timeout=60).status_code == 400
        ignored = post(server, "/invocations", {**GREEDY, "prompt": "hi", "colour": "red"})
        assert ignored.status_code == 200
        assert ignored.headers["x-pagedkv-ignored-fields"] == "colour"

        # every body the route takes is in the OpenAPI document, and every schema it names is too
        doc = httpx.get(f"{server.url}/openapi.json", timeout=60).json()
        schemas = doc["components"]["schemas"]
        for path, ops in doc["paths"].items():
            for op in ops.values():
                body = op.get("requestBody", {}).get("content", {}).get("application/json", {})
                refs = body.get("schema", {}).get("oneOf") or [body.get("schema", {})]
                for ref in (r["$ref"].rsplit("/", 1)[1] for r in refs if "$ref" in r):
                    assert ref in schemas, (path, ref)
        inv = doc["paths"]["/invocations"]["post"]["requestBody"]["content"]["application/json"]
        assert len(inv["schema"]["oneOf"]) == 6

        server.wait_idle()
        assert server.metrics()["pagedkv:kv_cache_free_blocks"] == 512
        assert httpx.get(f"{server.url}/load", timeout=60).json() == {"server_load": 0}


def test_a_classifier_takes_inputs_and_messages_as_labels_and_refuses_text(qwen3, tmp_path):
    """A model that only classifies: `input` and vLLM's chat form (`messages`) are classified, as
    /classify would; `prompt` goes to the completions endpoint, which says why it cannot."""
    folder = seq_cls_folder(qwen3, tmp_path / "cls", num_labels=3)
    with ServerProcess(folder, *TINY_SERVER, "--dtype", "float32") as server:
        same_answer(
            server,
            "/classify",
            {"model": "tiny", "input": ["good", "bad"]},
            lambda a: [(d["label"], rounded(d["probs"])) for d in a["data"]],
        )
        labels = same_answer(
            server,
            "/classify",
            {"model": "tiny", "messages": MESSAGES},
            lambda a: [rounded(d["probs"]) for d in a["data"]],
        )
        assert labels["data"][0]["num_classes"] == 3
        text = post(server, "/invocations", {**GREEDY, "prompt": "hi"})
        assert text.status_code == 400 and "classif" in text.json()["error"]["message"], text.text
        unknown = post(server, "/invocations", {"model": "tiny"})
        assert unknown.json()["error"]["message"].endswith(
            "give input or messages (classification)"
        )
        server.wait_idle()
        assert server.metrics()["pagedkv:kv_cache_free_blocks"] == 512
