"""An adapter as one safetensors blob: its tensors (PEFT names) and its PEFT config in the metadata.

The wire format of adapters that reach an engine from memory (`RolloutEngine.load_adapter_blob`;
vLLM's side: graft.rollout.vllm.server.lora_memory). Made once per version and sent as it is to every
engine of a pool; readers take the config from the header without decoding a tensor.
"""

from __future__ import annotations

import json
import struct

CONFIG_KEY = "adapter_config"  # safetensors metadata: the adapter_config.json text


class BlobError(ValueError):
    """Bytes that are not an adapter blob."""


def adapter_blob(tensors: dict, config: dict) -> bytes:
    """`tensors` (PEFT names; copied to the CPU) as one safetensors blob with the PEFT `config` in its
    metadata."""
    import safetensors.torch

    host = {key: tensor.detach().to(device="cpu") for key, tensor in tensors.items()}
    return safetensors.torch.save(host, metadata={"format": "pt", CONFIG_KEY: json.dumps(config, sort_keys=True)})


def blob_config(blob: bytes) -> dict:
    """The PEFT config stored in a blob's metadata (header only: no tensor is decoded).

    Raises:
        BlobError: not a safetensors blob, or no parsable `CONFIG_KEY` in its metadata.
    """
    try:
        (header_bytes,) = struct.unpack("<Q", blob[:8])
        metadata = json.loads(blob[8:8 + header_bytes]).get("__metadata__") or {}
        config = json.loads(metadata[CONFIG_KEY])
    except (struct.error, ValueError, KeyError, TypeError, AttributeError):
        raise BlobError(f"expected a safetensors blob whose metadata holds the PEFT config under "
                        f"{CONFIG_KEY!r}") from None
    if not isinstance(config, dict):
        raise BlobError(f"the blob's {CONFIG_KEY!r} is not a JSON object")
    return config
