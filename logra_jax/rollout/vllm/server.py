"""The vLLM engine process: `python -m logra_jax.rollout.vllm.server --connect HOST:PORT --secret-stdin`, run with
the vLLM venv's interpreter by `logra_jax.rollout.vllm.engine.VLLMEngine` (no JAX here).

An engine process of logra_jax.rollout.process, as our JAX worker is: it proves the run secret to the trainer,
builds `vllm.LLM` on the model folder the hello names (weights then come by snapshot), and serves one request at a
time: sync (payload bytes → TorchMasters → changed tensors reloaded into vLLM), generate (token-id prompts →
Rollout arrays), probe, fetch, shutdown.
Needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (tensors are handed to the worker extension in process).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from logra_jax.rollout import process
from logra_jax.rollout.process import Reply, run_engine
from logra_jax.rollout.vllm.extension import TorchMasters, hf_tensors
from logra_jax.rollout.vllm.settings import VLLMSettings
from logra_jax.rollout.wire import Channel, unpack

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Server:
    """vLLM plus the float32 masters it is rebuilt from."""

    def __init__(self, hello: dict[str, Any]):
        from vllm import LLM  # imported here: a second of start-up only where vLLM runs

        settings = VLLMSettings(**hello["vllm"])
        self.dtype = _TORCH_DTYPES[settings.dtype]
        self.table = hello["table"]
        self.llm = LLM(model=hello["model_dir"], dtype=settings.dtype, tensor_parallel_size=settings.tensor_parallel,
                       gpu_memory_utilization=settings.memory_fraction, max_num_seqs=settings.max_seqs,
                       max_model_len=hello["max_model_len"],
                       enforce_eager=True, seed=0, logprobs_mode="processed_logprobs", skip_tokenizer_init=True,
                       worker_extension_cls="logra_jax.rollout.vllm.extension.LograWorkerExtension")
        self.masters = TorchMasters(hello["shapes"])

    def sync(self, body: memoryview) -> dict[str, Any]:
        """Apply a payload to the masters, then reload the changed tensors into vLLM; the reply's seconds hold
        the masters' phases (check, apply) and "reload" (checkpoint tensors built and loaded by vLLM)."""
        reply, changed = self.masters.receive(body)
        if changed:
            start = time.perf_counter()
            tensors = [(name, t.to(self.dtype)) for p in changed if p in self.table
                       for name, t in hf_tensors(self.table, p, self.masters.params[p])]
            self.llm.collective_rpc("logra_reload", args=(tensors,))
            reply["seconds"]["reload"] = time.perf_counter() - start
        return reply

    def generate(self, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from vllm import SamplingParams, TokensPrompt

        s = meta["sampling"]
        prompts, mask = arrays["prompts"], arrays["prompt_mask"]
        n, new = int(s["num_samples"]), int(s["max_new_tokens"])
        greedy = s["temperature"] == 0
        # vLLM seeds sample j of a request with seed + j: requests b·n apart never share a stream. Rows end at the
        # job's eos only (stop_token_ids): ignore_eos keeps vLLM's own, from the model folder's config or
        # transformers' default for it (2 for a Llama config that names none), from ending them.
        params = [SamplingParams(n=n, temperature=float(s["temperature"]), top_k=int(s["top_k"]) or 0,
                                 top_p=1.0 if greedy else float(s["top_p"]), max_tokens=new, logprobs=0,
                                 stop_token_ids=[int(s["eos_id"])], ignore_eos=True, detokenize=False,
                                 seed=(int(meta["seed"]) * 1_000_003 + b * n) % (1 << 31))
                  for b in range(len(prompts))]
        requests = [TokensPrompt(prompt_token_ids=[int(t) for t in row[m]]) for row, m in zip(prompts, mask)]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        rows = len(prompts) * n
        tokens = np.full((rows, prompts.shape[1] + new), int(s["pad_id"]), np.int32)
        logprobs = np.zeros((rows, new), np.float32)
        lengths = np.zeros(rows, np.int32)
        finished = np.zeros(rows, bool)
        for b, out in enumerate(outputs):
            for j, completion in enumerate(sorted(out.outputs, key=lambda c: c.index)):
                r = b * n + j
                ids = list(completion.token_ids)[:new]
                tokens[r, :prompts.shape[1]] = prompts[b]
                tokens[r, prompts.shape[1]:prompts.shape[1] + len(ids)] = ids
                for t, (tok, entry) in enumerate(zip(ids, completion.logprobs or [])):
                    logprobs[r, t] = entry[tok].logprob
                lengths[r] = len(ids)
                finished[r] = bool(ids) and ids[-1] == int(s["eos_id"])
        return {"tokens": tokens, "prompt_mask": np.repeat(mask, n, axis=0),
                "response_mask": np.arange(new)[None, :] < lengths[:, None], "logprobs": logprobs,
                "lengths": lengths, "finished": finished}


def _fetch(server: Server, body: memoryview) -> Reply:
    params = server.masters.params or {}
    return {"version": server.masters.version}, {p: t.numpy() for p, t in params.items()}


_ANSWERS: Mapping[str, Callable[[Server, memoryview], Reply]] = {
    "sync": lambda server, body: (server.sync(body), {}),
    "generate": lambda server, body: ({}, server.generate(*unpack(body))),
    "probe": lambda server, body: ({}, server.masters.probe(unpack(body)[1])),
    "fetch": _fetch,
}


def serve(chan: Channel) -> None:
    """The server's loop (`logra_jax.rollout.process.serve`): vLLM built by the trainer's hello, then its requests."""
    process.serve(chan, lambda body: Server(unpack(body)[0]), _ANSWERS, label="vllm engine")


def main(argv: list[str] | None = None) -> None:
    run_engine(argv, "LoGRA vLLM rollout engine (started by VLLMEngine)", serve)


if __name__ == "__main__":
    main()
