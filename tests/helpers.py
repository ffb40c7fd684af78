"""Test helpers shared across the suite (plain functions; fixtures live in conftest.py)."""

import asyncio
import gc
import json
import os
import subprocess
from pathlib import Path

import torch
from torch import Tensor

from graft.lora.adapter_io import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from graft.lora.attach import attach_lora, lora_parameters
from graft.models.loading import load_model
from graft.rl.packing import Packed
from graft.rollout.engine import EngineUnavailableError


def randomize_lora(model: torch.nn.Module, seed: int = 1, std: float = 0.05) -> None:
    """Give the adapter non-zero weights (PEFT initialises lora_B to zero, a trivial adapter)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in lora_parameters(model).values():
            param.copy_(torch.randn(param.shape, generator=generator) * std)


def trained_like_peft_model(model_dir, *, rank: int = 8, alpha: float = 16, seed: int = 1, **kwargs):
    """A fp32 tiny model with a random non-zero LoRA adapter attached."""
    model = attach_lora(load_model(model_dir), rank=rank, alpha=alpha, seed=0, **kwargs)
    randomize_lora(model, seed)
    return model


def assert_adam_weights_close(got: dict, want: dict, lr: float) -> None:
    """LoRA weights after AdamW steps of `lr` that summed the same gradients in another order (another
    layout, sharding or CPU) agree within 5% of one step. Adam divides by sqrt(v), so an element whose
    gradient is near zero turns a 1e-7 rounding difference into a step-sized one: measured 1.5e-5 at
    lr 1e-3 (packed vs padded, CI machine) and 2e-5 at lr 1e-2 (two ranks); a real bug moves elements
    by ~lr. The metrics (loss, grad norm) carry the tight check."""
    assert got.keys() == want.keys()
    atol = max(1e-5, 0.05 * lr)
    for name, weight in want.items():
        torch.testing.assert_close(got[name], weight, rtol=1e-5, atol=atol, msg=lambda m: f"{name}: {m}")


def live_group_members(pgid: int) -> list[str]:
    """`ps` lines of the non-zombie processes in process group `pgid` (independent of the launcher's check)."""
    listing = subprocess.run(["ps", "-e", "-o", "pgid=,pid=,stat=,args="], capture_output=True, text=True, check=True)
    rows = (line.split(None, 3) for line in listing.stdout.splitlines())
    return [" ".join(row) for row in rows if int(row[0]) == pgid and not row[2].startswith("Z")]


def group_process_names(pgid: int) -> dict[int, str]:
    """pid -> name (`/proc/<pid>/comm`) of the processes in group `pgid`."""
    names = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) == pgid:
                with open(f"/proc/{pid}/comm") as comm:
                    names[int(pid)] = comm.read().strip()
        except OSError:  # gone meanwhile
            pass
    return names


def hf_greedy(model: torch.nn.Module, prompts_P, max_new_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
    """Transformers greedy tokens and their raw log-probs per prompt (`eos_token_id=[]` is vLLM's ignore_eos)."""
    tokens_P, logprobs_P = [], []
    for prompt in prompts_P:
        input_ids = torch.tensor([list(prompt)])
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                 max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=[],
                                 output_logits=True, return_dict_in_generate=True)
        tokens_T = out.sequences[0, len(prompt):].tolist()
        tokens_P.append(tokens_T)
        logprobs_P.append([torch.log_softmax(logits[0], -1)[t].item() for logits, t in zip(out.logits, tokens_T)])
    return tokens_P, logprobs_P


def hf_cache_with(root, repo_id: str, model_dir) -> str:
    """A Hugging Face hub cache under `root` holding `model_dir` as repo `repo_id` (its `main` revision),
    laid out as the hub client writes it: models--org--name/{refs/main, snapshots/<commit>/files}.
    Returns the snapshot directory."""
    import shutil
    from pathlib import Path

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = Path(root) / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    shutil.copytree(model_dir, snapshot)
    return str(snapshot)


def unretrieved_task_errors(outer_coro_of) -> list[str]:
    """Runs outer_coro_of(call) where coroutine function `call` fails in the same loop pass in which
    the outer task is cancelled (a killed server fails every request at once while a sibling's
    failure cancels the rest); the "exception was never retrieved" reports the loop makes once the
    tasks are collected."""
    reports = []

    async def run():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: reports.append(context["message"]))
        gate = asyncio.Event()

        async def call():
            await gate.wait()
            raise EngineUnavailableError("POST /v1/completions: ReadError('')", address="http://e")

        outer = asyncio.ensure_future(outer_coro_of(call))
        for _ in range(3):  # the outer task starts its call and waits on it
            await asyncio.sleep(0)
        gate.set()  # the call fails in the next pass ...
        outer.cancel()  # ... the pass in which the outer task is cancelled
        await asyncio.gather(outer, return_exceptions=True)
        del outer
        gc.collect()

    asyncio.run(run())
    return reports


def is_peft_adapter(path: str | os.PathLike) -> bool:
    """True when `path` holds a PEFT LoRA adapter graft can load (config says LORA, safetensors present)."""
    path = Path(path)
    try:
        config = json.loads((path / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and config.get("peft_type") == "LORA" and (path / ADAPTER_WEIGHTS).is_file()


def unpack_completion_logprobs(values_N: Tensor, packed: Packed) -> list[Tensor]:
    """Each sequence's completion-token values, in order, from per-position values of a packed row.

    Args:
        values_N: ``[N]`` or ``[1, N]`` per-position values (log-probs of the next token, entropy...).
        packed: The layout the values were computed on.

    Returns:
        One tensor per sequence, of its completion length.
    """
    values_N = values_N.reshape(-1)
    assert values_N.numel() == packed.input_ids_N.numel(), "values do not match the packed layout"
    return list(values_N[packed.completion_mask_N].split(packed.completion_lens))


def padded_completion_logprobs(values_BT: Tensor, completion_mask_BT: Tensor) -> list[Tensor]:
    """Each row's completion-token values, in order, from per-position values of a padded batch."""
    assert values_BT.shape == completion_mask_BT.shape, "values do not match the padded layout"
    return [row_T[mask_T] for row_T, mask_T in zip(values_BT, completion_mask_BT)]


def in_flight(pool) -> dict[str, int]:
    """Requests in flight per engine address of an `EnginePool` (dropped members included), now."""
    return dict(zip(pool.addresses, pool._in_flight))


# What the `sgl_kernel` stand-in (graft/rollout/sglang/server/sgl_kernel) writes to the log when a kernel is called.
KERNEL_STUB_MARKER = "GRAFT_SGL_KERNEL_STUB_CALLED"


def kernel_stub_calls(server) -> list[str]:
    """Kernel names the `sgl_kernel` stand-in was asked to run (from the SGLang server's log): empty
    while SGLang stayed on its torch-native paths, as it must on a CPU without AMX."""
    try:
        with open(server.log_path, errors="replace") as f:
            return [line.split(KERNEL_STUB_MARKER, 1)[1].strip() for line in f if KERNEL_STUB_MARKER in line]
    except (OSError, TypeError):
        return []


def block_diagonal_mask(seq_lens: list[int], dtype: torch.dtype = torch.float32) -> Tensor:
    """Additive causal mask ``[1, 1, N, N]`` that keeps each packed sequence to itself.

    0 where query ``i`` may attend key ``j`` (same sequence, ``j <= i``), ``finfo(dtype).min``
    elsewhere — the 4-D mask HF models take as ``attention_mask`` for a packed row.
    """
    seq_id_N = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens))
    n = seq_id_N.numel()
    allowed_NN = (seq_id_N[:, None] == seq_id_N[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    mask_NN = torch.zeros(n, n, dtype=dtype).masked_fill(~allowed_NN, torch.finfo(dtype).min)
    return mask_NN[None, None]


def position_ids_from_mask(attention_mask_BT: Tensor) -> Tensor:
    """``position_ids_BT``: 0, 1, ... over each row's real tokens (padding gets 0)."""
    return (attention_mask_BT.long().cumsum(dim=-1) - 1).clamp(min=0)
