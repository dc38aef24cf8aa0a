"""The rollout side of an RL loop: the contract a generation engine fulfils, and the embedded one.

An RL step samples responses with the current policy, so the rollout engine must receive the trainer's weights
after every update. The contract is two calls, the ones vLLM / SGLang integrations implement too:

* ``update_weights(weights)``: an iterable of ``(hugging_face_name, tensor)`` pairs -- exactly what
  :meth:`verl_engine.engine.RLEngine.get_per_tensor_param` yields (gathered over TP / PP, one tensor or one
  bucket at a time). The engine must not keep references to the tensors after the call.
* ``generate(prompts, params)``: token-id prompts (lists of ints, no padding) -> ``params.n`` responses per
  prompt, prompt-major (the ``n`` samples of prompt 0 first), each a list of token ids ending with the EOS
  token if the model emitted one within ``params.max_new_tokens``.

:class:`HFRollout` is the embedded implementation: a Hugging Face transformers model built from the same
``config.json`` the engine was built from, generating with ``model.generate``. It runs anywhere transformers
runs (the CPU default of ``verl-engine grpo``); a user with vLLM or SGLang passes their own object with the two
methods instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["HFRollout", "RolloutEngine", "SamplingParams"]


@dataclass(frozen=True)
class SamplingParams:
    """How responses are sampled. ``temperature=0`` is greedy decoding (then ``n`` must be 1 to be useful, but
    is allowed: the samples are identical). ``seed`` makes a call reproducible (None: the global RNG)."""

    max_new_tokens: int
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_new_tokens, bool)
            or not isinstance(self.max_new_tokens, int)
            or self.max_new_tokens < 1
        ):
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n (samples per prompt) must be an int >= 1, got {self.n!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")


@runtime_checkable
class RolloutEngine(Protocol):
    """What the RL loop needs from a generation engine (see the module docstring)."""

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[int]]: ...


class HFRollout:
    """Generation with a transformers causal LM whose weights come from the trainer (``update_weights``).

    ``hf_config`` is the model's ``config.json`` content; the model is built from it (random weights until the
    first ``update_weights``, which must then name every tensor: a missing or unexpected name is an error, so
    a rollout never samples from stale or partly updated weights). With tied embeddings the trainer sends no
    ``lm_head.weight``; the model re-ties it.
    """

    def __init__(
        self,
        *,
        hf_config: Mapping[str, Any],
        eos_token_id: int,
        pad_token_id: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        import transformers

        config = transformers.AutoConfig.for_model(**dict(hf_config))
        self.model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=dtype).to(device)
        self.model.eval()
        self.device = torch.device(device)
        self.eos_token_id = int(eos_token_id)
        self.pad_token_id = int(pad_token_id)
        self.updates = 0

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        seen: set[str] = set()
        with torch.no_grad():
            for name, tensor in weights:
                target = params.get(name)
                if target is None:
                    raise KeyError(f"the rollout model has no parameter {name!r} (the trainer sent it)")
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(
                        f"{name}: the trainer sent {tuple(tensor.shape)}, the rollout model has {tuple(target.shape)}"
                    )
                target.copy_(tensor.to(device=target.device, dtype=target.dtype))
                seen.add(name)
        expected = {n for n in params if not (tied and n == "lm_head.weight")}
        missing = sorted(expected - seen)
        if missing:
            raise ValueError(
                f"update_weights did not receive {len(missing)} of the rollout model's tensors (first: {missing[:4]});"
                " the rollout would sample from stale weights"
            )
        if tied:
            self.model.tie_weights()
        self.updates += 1

    def sleep(self) -> None:
        """Free the device while the trainer works (colocation): the weights move to host memory."""
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        """Back on the device before the next weight update / generation."""
        if self.device.type == "cuda":
            self.model.to(self.device)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[int]]:
        if self.updates == 0:
            raise RuntimeError("generate before update_weights: the rollout model has no trained weights yet")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token-id lists")
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            ids[i, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
            mask[i, width - len(p) :] = 1
        greedy = params.temperature == 0.0
        kwargs: dict[str, Any] = {
            "max_new_tokens": params.max_new_tokens,
            "do_sample": not greedy,
            "num_return_sequences": params.n,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if not greedy:
            kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            if params.seed is not None:
                torch.manual_seed(params.seed)
            out = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device), **kwargs
            )
        responses = []
        for row in out[:, width:].tolist():  # prompt-major: the n samples of prompt i are rows i*n .. i*n+n-1
            # a row that emitted EOS is padded after it; a row without EOS ran to max_new_tokens unpadded
            if self.eos_token_id in row:
                row = row[: row.index(self.eos_token_id) + 1]
            responses.append(row)
        return responses
