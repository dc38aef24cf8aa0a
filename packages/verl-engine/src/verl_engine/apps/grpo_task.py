"""The embedded GRPO task: ``a op b =`` arithmetic prompts with exact-match rewards, the tokenizer it reads
through (:class:`Tokens`) and the small Qwen2 configuration of the embedded model."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from verl_engine.apps.demo import CharTokenizer

__all__ = ["ArithmeticTask", "HFTokens", "Tokens", "tiny_arithmetic_hf_config", "tokens_of"]


class Tokens(Protocol):
    """What the task needs from a tokenizer (the embedded :class:`CharTokenizer` or :class:`HFTokens`)."""

    eos_id: int
    pad_id: int

    @property
    def bos_id(self) -> int | None: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class HFTokens:
    """A Hugging Face tokenizer seen through :class:`Tokens` (no special tokens added by ``encode``)."""

    def __init__(self, tokenizer: Any) -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError(
                f"the tokenizer {type(tokenizer).__name__} has no eos_token: the reward needs the response to end"
                " with EOS; set eos_token in the model directory's tokenizer_config.json"
            )
        self.tokenizer = tokenizer
        self.eos_id = int(tokenizer.eos_token_id)
        self.bos_id = None if tokenizer.bos_token_id is None else int(tokenizer.bos_token_id)
        self.pad_id = self.eos_id if tokenizer.pad_token_id is None else int(tokenizer.pad_token_id)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))


class ArithmeticTask:
    """``a op b =`` prompts with exact-match answers; a fixed held-out set never used for training."""

    def __init__(
        self,
        *,
        seed: int,
        operations: str = "+",
        max_operand: int = 20,
        eval_size: int = 64,
        tokenizer: Tokens | None = None,
    ) -> None:
        if not operations or set(operations) - set("+-*"):
            raise ValueError(f"operations must be a non-empty subset of '+-*', got {operations!r}")
        if max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {max_operand}")
        self.tokenizer: Tokens = tokenizer if tokenizer is not None else CharTokenizer()
        self.seed = seed
        self.operations = operations
        self.max_operand = max_operand
        rng = random.Random(seed * 7_919 + 1)
        self.eval_set: list[tuple[str, str]] = []
        seen: set[str] = set()
        while len(self.eval_set) < min(eval_size, self._space() // 4):
            prompt, answer = self._problem(rng)
            if prompt not in seen:
                seen.add(prompt)
                self.eval_set.append((prompt, answer))
        self._held_out = seen

    def _space(self) -> int:
        return len(self.operations) * (self.max_operand + 1) ** 2

    def _problem(self, rng: random.Random) -> tuple[str, str]:
        op = rng.choice(self.operations)
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        result = a + b if op == "+" else a - b if op == "-" else a * b
        return f"{a}{op}{b}=", str(result)

    def train_problems(self, *, step: int, count: int, stream: int = 0) -> list[tuple[str, str]]:
        """``count`` training problems of ``step`` (deterministic in seed, stream and step; no held-out one)."""
        rng = random.Random((self.seed * 1_000_003 + stream) * 1_000_033 + step)
        out: list[tuple[str, str]] = []
        while len(out) < count:
            problem = self._problem(rng)
            if problem[0] not in self._held_out:
                out.append(problem)
        return out

    def demonstrations(self, *, step: int, count: int, error_rate: float) -> list[tuple[str, str]]:
        """Warm-start examples of ``step`` from a sloppy demonstrator: a fraction ``error_rate`` of its answers
        are one too high (deterministic in seed and step; no held-out prompt).

        Imitating it gives a policy that knows the arithmetic but whose most likely answer is often wrong:
        the correct one is among its samples (pass@n > greedy accuracy), which RL with a verifiable reward
        improves, measurably on the held-out prompts.
        """
        rng = random.Random((self.seed * 1_000_003 + 7) * 1_000_033 + step)
        out = []
        for prompt, answer in self.train_problems(step=step, count=count, stream=1):
            if rng.random() < error_rate:
                answer = str(int(answer) + 1)
            out.append((prompt, answer))
        return out

    def prompt_ids(self, prompt: str) -> list[int]:
        bos = self.tokenizer.bos_id
        return [*([] if bos is None else [bos]), *self.tokenizer.encode(prompt)]

    def answer_ids(self, answer: str) -> list[int]:
        return [*self.tokenizer.encode(answer), self.tokenizer.eos_id]

    def reward(self, response: Sequence[int], answer: str) -> float:
        """1 for exactly the answer followed by EOS (compared as text: tokenizations may differ), else 0."""
        ids = list(response)
        if not ids or ids[-1] != self.tokenizer.eos_id:
            return 0.0
        return float(self.tokenizer.decode(ids[:-1]) == answer)


def tiny_arithmetic_hf_config(*, vocab_size: int, hidden_size: int = 128, layers: int = 2) -> dict[str, Any]:
    """A small Qwen2 ``config.json`` for the character vocabulary (the embedded default model)."""
    if hidden_size % 64:
        raise ValueError(f"hidden_size must be a multiple of 64 (head dim 64 or more), got {hidden_size}")
    heads = max(4, hidden_size // 64)
    return {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 4 * hidden_size,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads // 2,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "torch_dtype": "float32",
        "hidden_act": "silu",
        "initializer_range": 0.02,
    }


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def tokens_of(path: str, hf: Mapping[str, Any]) -> Tokens:
    """The tokenizer of a model directory; a directory without one (the ``sft/`` of an embedded run) must have
    the embedded character vocabulary's size, and then uses it."""
    if any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        from transformers import AutoTokenizer

        return HFTokens(AutoTokenizer.from_pretrained(path))
    chars = CharTokenizer()
    if int(hf.get("vocab_size", -1)) != chars.vocab_size:
        from verl_config import ConfigError

        raise ConfigError(
            f"actor_rollout_ref.model.path={path} has no tokenizer ({', '.join(TOKENIZER_FILES)}) and its"
            f" vocab_size {hf.get('vocab_size')} is not the embedded character vocabulary's ({chars.vocab_size}):"
            " add the model's tokenizer files to the directory"
        )
    return chars
