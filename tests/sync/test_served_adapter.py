"""`graft verify` against the real vLLM server: passes on the adapter served as it is, fails in one
line naming the gap and the likely cause on a server holding something else under that name (a
crafted adapter file reproduces each way of failing to deliver: nothing applied, scaling applied
twice, one module missing), and refuses bad input with exit 2 before any request."""

import asyncio
import shutil

import pytest
import safetensors.torch

from graft.cli import main
from graft.lora.adapter_io import ADAPTER_WEIGHTS, save_adapter
from graft.rollout.vllm.client import VllmClient
from tests.helpers import trained_like_peft_model


@pytest.fixture(scope="module")
def adapter_dir(base_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("verify") / "adapter"
    save_adapter(trained_like_peft_model(base_dir, rank=8, seed=1), path)
    return path


def _variant(adapter_dir, out, edit):
    """A copy of the adapter with `edit(key, tensor) -> tensor` applied to each tensor."""
    shutil.copytree(adapter_dir, out)
    tensors = safetensors.torch.load_file(out / ADAPTER_WEIGHTS)
    safetensors.torch.save_file({k: edit(k, t) for k, t in tensors.items()}, out / ADAPTER_WEIGHTS)
    return out


def _verify(server, base_dir, adapter, name, *extra):
    return main(["verify", "--url", server.url, "--base", str(base_dir), "--adapter", str(adapter), "--name", name,
                 *extra])


def _unload_all(server):
    async def unload():
        async with VllmClient(server.url) as client:
            for name in await client.list_adapters():
                await client.unload_adapter(name)
    asyncio.run(unload())


@pytest.mark.vllm
def test_verify_passes_on_the_adapter_served_as_it_is(vllm_server, base_dir, adapter_dir, capsys):
    try:
        assert _verify(vllm_server, base_dir, adapter_dir, "mine", "--load") == 0
        out = capsys.readouterr().out.strip().splitlines()
        assert len(out) == 1 and "serves adapter 'mine' exactly" in out[0]
    finally:
        _unload_all(vllm_server)


@pytest.mark.vllm
@pytest.mark.parametrize(("served", "cause"), [
    ("nothing applied", "answers with the base model"),
    ("scaled twice", "applies the adapter's scaling twice"),
    ("no up_proj", "without its up_proj LoRA"),
])
def test_verify_fails_in_one_line_naming_the_gap_and_the_likely_cause(vllm_server, base_dir, adapter_dir, tmp_path,
                                                                       capsys, served, cause):
    edits = {"nothing applied": lambda k, t: t * 0 if "lora_B" in k else t,
             "scaled twice": lambda k, t: t * 2 if "lora_B" in k else t,
             "no up_proj": lambda k, t: t * 0 if "up_proj.lora_B" in k else t}
    wrong = _variant(adapter_dir, tmp_path / "served", edits[served])
    try:
        async def load():
            async with VllmClient(vllm_server.url) as client:
                await client.load_adapter("theirs", str(wrong))
        asyncio.run(load())
        assert _verify(vllm_server, base_dir, adapter_dir, "theirs") == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "does not serve this adapter as 'theirs': largest log-prob gap" in err[0]
        assert cause in err[0], err[0]
    finally:
        _unload_all(vllm_server)


def test_verify_refuses_bad_input_with_exit_2_before_any_request(base_dir, adapter_dir, tmp_path, capsys):
    nowhere = "http://127.0.0.1:9"
    assert main(["verify", "--url", nowhere, "--base", str(base_dir), "--adapter", str(tmp_path), "--name", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("graft: error: ") and "not a PEFT adapter directory" in err[0]
    assert main(["verify", "--url", nowhere, "--base", str(base_dir), "--adapter", str(adapter_dir), "--name", "x",
                 "--api-key-env", "GRAFT_TEST_UNSET_KEY"]) == 2
    assert "GRAFT_TEST_UNSET_KEY" in capsys.readouterr().err
    args = ["verify", "--url", nowhere, "--base", str(base_dir), "--adapter", str(adapter_dir), "--name", "x"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("graft: error: ") and "127.0.0.1:9" in err[0]
