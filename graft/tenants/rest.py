"""The Tinker API's REST listing: a user's training runs, checkpoints and sessions, as the SDK's
`RestClient` (and the `tinker` CLI) read them, and deleting a checkpoint.

A training run is a model id: a live model of the user's, or one whose states the user saved (on
disk under `<state root>/<user>/`, so a restarted service lists them too). Its checkpoints are its
saved states (`tinker://<run>/weights/<name>`, "training") and its sampler weights still served
(`tinker://<run>/sampler_weights/<name>`, "sampler"). Everything listed is the asking user's alone;
another user's run or checkpoint is as unknown as one never made.
"""

from __future__ import annotations

import re
import shutil
from datetime import UTC, datetime
from pathlib import Path

from graft.atomic import fsync_dir
from graft.tenants.checkpoint import tenant_spec
from graft.tenants.fields import Fields
from graft.tenants.futures import NotFound, RequestFailed

_RUN_DIR = re.compile(r"(session-[0-9a-f]+)_train_(\d+)")  # a model id's directory (service.state_dir)


def _when(path: Path) -> str:
    return datetime.fromtimestamp(path.stat().st_mtime, UTC).isoformat()


def _size(path: Path) -> int:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())


def page(items: list, query: Fields, default_limit: int) -> tuple[list, dict]:
    """`items[offset:offset + limit]` of the query's (strings: a URL's query) and the SDK's cursor."""
    limit = _number(query, "limit", default_limit)
    offset = _number(query, "offset", 0)
    return items[offset:offset + limit], {"offset": offset, "limit": limit, "total_count": len(items)}


def _number(query: Fields, key: str, default: int) -> int:
    text = query.text(key, str(default))
    if not text.isdigit() or int(text) > 1_000_000:
        raise RequestFailed(f"query parameter {key!r} must be a whole number up to 1000000, got {text[:20]!r}")
    return max(int(text), 1) if key == "limit" else int(text)


class Listing:
    """The REST views of one `TenantService`."""

    def __init__(self, service) -> None:
        self.service = service

    def _saved_runs(self, user: str) -> dict[str, Path]:
        root = self.service.state_root / user
        runs = {}
        for run_dir in sorted(root.iterdir()) if root.is_dir() else ():
            if match := _RUN_DIR.fullmatch(run_dir.name):
                runs[f"{match[1]}:train:{match[2]}"] = run_dir
        return runs

    def checkpoints(self, user: str, run: str) -> list[dict]:
        """`run`'s checkpoints, oldest first: saved states, then sampler weights still served."""
        run_dir = self._saved_runs(user).get(run)
        states = sorted((d for d in run_dir.iterdir() if d.is_dir() and not d.name.startswith(".")),
                        key=lambda d: d.stat().st_mtime) if run_dir is not None else []
        listed = [{"checkpoint_id": f"weights/{state.name}", "checkpoint_type": "training", "time": _when(state),
                   "tinker_path": f"tinker://{run}/weights/{state.name}", "size_bytes": _size(state)}
                  for state in states]
        now = datetime.now(UTC).isoformat()
        for path in self.service.sampling.sampler_paths(user):
            if path.startswith(f"tinker://{run}/sampler_weights/"):
                listed.append({"checkpoint_id": path.split("/", 3)[3], "checkpoint_type": "sampler", "time": now,
                               "tinker_path": path})
        return listed

    def runs(self, user: str) -> list[str]:
        live = [model.model_id for model in self.service.models.values() if model.owner == user]
        return sorted(set(live) | set(self._saved_runs(user)))

    def run(self, user: str, run: str) -> dict:
        if run not in self.runs(user):
            raise NotFound(f"unknown training run {run!r}")
        model = self.service.models.get(run)
        checkpoints = self.checkpoints(user, run)
        training = [c for c in checkpoints if c["checkpoint_type"] == "training"]
        sampler = [c for c in checkpoints if c["checkpoint_type"] == "sampler"]
        rank = model.rank if model is not None else self._saved_rank(user, run, training)
        return {"training_run_id": run, "base_model": self.service.base_model, "model_owner": user, "is_lora": True,
                "lora_rank": rank, "last_request_time": (training[-1]["time"] if training else
                                                         datetime.now(UTC).isoformat()),
                "last_checkpoint": training[-1] if training else None,
                "last_sampler_checkpoint": sampler[-1] if sampler else None}

    def _saved_rank(self, user: str, run: str, training: list[dict]) -> int | None:
        if not training:
            return None
        try:
            return tenant_spec(self.service.state_dir(user, training[-1]["tinker_path"]), "").rank
        except ValueError:
            return None

    def delete(self, user: str, run: str, checkpoint_id: str) -> None:
        """Delete `user`'s checkpoint: a saved state's directory, or a sampler path (forgotten; the
        version it names stays served until its tenant's window retires it)."""
        kind, _, name = checkpoint_id.partition("/")
        path = f"tinker://{run}/{kind}/{name}"
        if kind == "weights":
            state_dir = self.service.saved_state(user, path)
            shutil.rmtree(state_dir)
            fsync_dir(state_dir.parent)
        elif kind == "sampler_weights":
            if not self.service.sampling.forget(user, path):
                raise NotFound(f"no sampler weights at {path!r}")
        else:
            raise RequestFailed(f"checkpoint id {checkpoint_id!r}: expected weights/<name> or sampler_weights/<name>")
