"""The vLLM engine, trainer side: `client` (the `RolloutEngine` over vLLM's HTTP API) and `launcher`
(starts and owns a vLLM server process). The modules in `server/` run inside that server process."""
