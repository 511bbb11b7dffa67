"""Embeddings: a prompt's final hidden states pooled into one vector (/v1/embeddings, LLM.embed).

An embedding request runs through the engine like any other (batched, chunked, preempted, its
blocks cached); the runner hands each step's hidden rows of its prompt to `add_rows`, which keeps
only what the pooling needs: the last prompt token's row (LAST, as Qwen3-Embedding and vLLM's
default for a causal LM), the first's (CLS), the running sum of all of them (MEAN), or every row
(ALL: vLLM's per-token tasks, token_embed and token_classify). A request that pools anything but
LAST skips the prefix cache, as one asking for prompt logprobs does: a cached block's positions are
never computed. Rows a recomputation (preemption) runs again are not added twice. The request
ends with its prompt: it samples no token, as in vLLM.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedkv.config import ConfigError
from pagedkv.engine.request import EVERY_TOKEN, POOLING_TYPES, ParamError, SamplingParams

NO_LM_HEAD = "the checkpoint has no LM head, lm_head.weight"
# sentence-transformers' 1_Pooling/config.json flags, by the pooling they name
_SENTENCE_TRANSFORMERS_MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}
# the sentence-transformers modules pagedkv makes (the model itself, then after its pooling)
_MODULES = ("Transformer", "Pooling", "Dense", "Normalize")
# a Dense module's activation_function: whether it is a tanh (else none)
_DENSE_ACTIVATIONS = {
    "torch.nn.modules.activation.Tanh": True,
    "torch.nn.modules.linear.Identity": False,
}


@dataclass(frozen=True)
class Dense:
    """A sentence-transformers Dense module (LaBSE's, sentence-t5's): tanh or nothing of
    x W^T + b, of the pooled vector, before a Normalize module; float32."""

    weight: torch.Tensor  # [out, in]
    bias: torch.Tensor | None
    tanh: bool

    def __call__(self, vector: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.linear(vector, self.weight, self.bias)
        return torch.tanh(out) if self.tanh else out

    @classmethod
    def read(cls, folder: Path) -> Dense:
        """From the module's folder: config.json and model.safetensors."""
        from safetensors.torch import load_file

        config = json.loads((folder / "config.json").read_text())
        activation = config.get("activation_function", "torch.nn.modules.activation.Tanh")
        if activation not in _DENSE_ACTIVATIONS:
            raise ConfigError(
                f"{folder}: a Dense module's activation {activation!r} is not supported "
                "(Tanh, Identity)"
            )
        weights_file = folder / "model.safetensors"
        if not weights_file.is_file():
            raise ConfigError(f"{folder}: no model.safetensors (other formats are not supported)")
        weights = load_file(str(weights_file))
        bias = weights.get("linear.bias") if config.get("bias", True) else None
        weight = weights["linear.weight"].float()
        if tuple(weight.shape) != (config["out_features"], config["in_features"]):
            raise ConfigError(f"{folder}: linear.weight is not out_features x in_features")
        return cls(weight, None if bias is None else bias.float(), _DENSE_ACTIVATIONS[activation])


@dataclass(frozen=True)
class Pooler:
    """How a model's embeddings are made: the pooling, and whether to scale to unit length."""

    pooling_type: str = "LAST"
    normalize: bool = True
    dense: tuple[Dense, ...] = field(default=(), compare=False)  # after the pooling, in order

    def width(self, hidden_size: int) -> int:
        """An embedding's values: the model's hidden size, or the last Dense module's outputs."""
        return self.dense[-1].weight.shape[0] if self.dense else hidden_size

    def projection(self, hidden_size: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """What the Dense modules make of a pooled vector (None: no Dense module), checked
        against the model's hidden size."""
        if not self.dense:
            return None
        if self.dense[0].weight.shape[1] != hidden_size:
            raise ConfigError(
                f"the first Dense module takes {self.dense[0].weight.shape[1]} values, not the "
                f"model's {hidden_size}"
            )

        def project(vector: torch.Tensor) -> torch.Tensor:
            for dense in self.dense:
                vector = dense(vector)
            return vector

        return project

    def request_params(
        self,
        hidden_size: int,
        dimensions: int | None = None,
        truncate_prompt_tokens: int | None = None,
        priority: int = 0,
        task: str | None = None,
    ) -> SamplingParams:
        """A pooling request's engine parameters (max_tokens 1 reserves nothing it uses): a
        per-token task (PER_TOKEN_TASKS) keeps every prompt token's row; `dimensions` checked
        against the model's width."""
        width = self.width(hidden_size)
        if dimensions is not None and not 1 <= dimensions <= width:
            raise ParamError("dimensions", f"dimensions must be from 1 to the model's {width}")
        return SamplingParams(
            max_tokens=1,
            temperature=0.0,
            pooling=EVERY_TOKEN if task in PER_TOKEN_TASKS else self.pooling_type,
            truncate_prompt_tokens=truncate_prompt_tokens,
            priority=priority,
        )

    def overridden(self, config: dict | str | None) -> Pooler:
        """--pooler-config (vLLM's PoolerConfig) over this pooling: its pooling_type and
        normalize; any other key is refused by name."""
        if not config:
            return self
        assert isinstance(config, dict)  # (EngineConfig read the flag's JSON)
        unknown = sorted(set(config) - {"pooling_type", "normalize"})
        if unknown:
            raise ConfigError(
                f"--pooler-config: {', '.join(unknown)} not supported (pooling_type, normalize)"
            )
        kind = config.get("pooling_type", self.pooling_type)
        if not isinstance(kind, str) or kind.upper() not in POOLING_TYPES:
            raise ConfigError(
                f"--pooler-config: pooling_type must be one of {', '.join(POOLING_TYPES)}"
            )
        normalize = config.get("normalize", self.normalize)
        if not isinstance(normalize, bool):
            raise ConfigError("--pooler-config: normalize must be true or false")
        return dataclasses.replace(self, pooling_type=kind.upper(), normalize=normalize)

    @classmethod
    def of_model(cls, model: str | Path | None) -> Pooler | None:
        """The pooling a sentence-transformers folder declares (modules.json and its Pooling
        module's config; Dense modules; a Normalize module); None for a model without those
        modules (then LlamaConfig.pooling: a GGUF's metadata, an encoder's CLS; else LAST,
        normalized). A module of another kind is refused by name."""
        folder = Path(model) if model is not None else None
        if folder is None or not (folder / "modules.json").is_file():
            return None
        try:
            modules = json.loads((folder / "modules.json").read_text())
            kinds = {m["type"].rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
            unknown = sorted(set(kinds) - set(_MODULES))
            config = {}
            if "Pooling" in kinds:
                config = json.loads((folder / kinds["Pooling"] / "config.json").read_text())
            asked = [k for k, v in config.items() if k.startswith("pooling_mode_") and v is True]
            dense = tuple(
                Dense.read(folder / m.get("path", ""))
                for m in modules
                if m["type"].rsplit(".", 1)[-1] == "Dense"
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(
                f"{folder}: cannot read its sentence-transformers modules ({e})"
            ) from None
        if unknown:
            raise ConfigError(
                f"{folder}: sentence-transformers module {unknown[0]} is not supported "
                f"({', '.join(_MODULES)})"
            )
        pooling = "LAST"
        if "Pooling" in kinds:
            if len(asked) != 1 or asked[0] not in _SENTENCE_TRANSFORMERS_MODES:
                raise ConfigError(
                    f"{folder}: its Pooling module asks for {', '.join(asked) or 'no pooling'}; "
                    f"pagedkv pools one of {', '.join(POOLING_TYPES)}"
                )
            pooling = _SENTENCE_TRANSFORMERS_MODES[asked[0]]
        return cls(pooling, "Normalize" in kinds, dense)


@dataclass(frozen=True)
class PoolingParams:
    """vLLM's, for LLM.embed, LLM.classify, LLM.score and LLM.encode: the first `dimensions` values
    only (Matryoshka models); whether to scale an embedding to unit length (None: as the model's
    Pooler says); use_activation, vLLM's newer name for it, which for a classifier means the
    sigmoid or softmax of its logits (None: on); `task`, what LLM.encode and AsyncLLMEngine.encode
    make of the pooled vector (POOLING_TASKS; None: the model's own)."""

    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    task: str | None = None

    def normalizes(self, pooler: Pooler) -> bool:
        if self.normalize is not None:
            return self.normalize
        return pooler.normalize if self.use_activation is None else self.use_activation

    def only_activation(self, call: str) -> bool:
        """Whether a classifier's call (classify, score), which takes use_activation only, applies
        its activation."""
        for name in ("dimensions", "normalize"):
            if getattr(self, name) is not None:
                raise ParamError(name, f"{call} takes only use_activation of PoolingParams")
        return self.use_activation is not False


# vLLM's pooling tasks that pagedkv makes: one vector a prompt, or (PER_TOKEN_TASKS) one a prompt
# token, each that task without its "token_" made of the token's own hidden state
PER_TOKEN_TASKS = ("token_embed", "token_classify")
POOLING_TASKS = ("embed", "classify", *PER_TOKEN_TASKS)


@dataclass
class Pooled:
    """One request's pooling so far: the positions taken and their row (LAST, CLS), sum (MEAN)
    or rows (ALL)."""

    pooling_type: str
    upto: int = 0  # prompt positions [0, upto) have been seen
    vector: torch.Tensor | None = None  # float32 [hidden] ([upto, hidden] for ALL)
    # what the model's Dense modules make of the pooled vector (Pooler.projection; not for ALL,
    # as sentence-transformers projects only a text's vector)
    project: Callable[[torch.Tensor], torch.Tensor] | None = None


def add_rows(pooled: Pooled, start: int, rows: torch.Tensor, prompt_len: int) -> None:
    """A step's hidden rows for positions start.. of a prompt of `prompt_len` tokens (rows past
    the prompt, and positions seen before, are left out)."""
    first, last = max(start, pooled.upto), min(start + len(rows), prompt_len)
    if first >= last:
        return
    if pooled.pooling_type == "MEAN":
        total = rows[first - start : last - start].float().sum(0)
        pooled.vector = total if pooled.vector is None else pooled.vector + total
    elif pooled.pooling_type == EVERY_TOKEN:
        new = rows[first - start : last - start].float()
        pooled.vector = new.clone() if pooled.vector is None else torch.cat((pooled.vector, new))
    elif pooled.pooling_type == "CLS":
        if first == 0:
            pooled.vector = rows[0].float().clone()
    elif last == prompt_len:  # LAST
        pooled.vector = rows[last - 1 - start].float().clone()
    pooled.upto = last


def result(pooled: Pooled, prompt_len: int) -> torch.Tensor:
    """The pooled vector once every prompt position was seen (for ALL, a vector a position)."""
    assert pooled.vector is not None and pooled.upto == prompt_len
    vector = pooled.vector / prompt_len if pooled.pooling_type == "MEAN" else pooled.vector
    return vector if pooled.project is None else pooled.project(vector)


def embedding(vector: torch.Tensor, normalize: bool, dimensions: int | None = None) -> torch.Tensor:
    """What the client gets: the first `dimensions` values (Matryoshka models), then, if asked,
    scaled to unit length; of a vector, or of each row of a per-token task's vectors."""
    v = vector[..., :dimensions]
    return torch.nn.functional.normalize(v, dim=-1) if normalize else v
