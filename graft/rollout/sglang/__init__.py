"""The SGLang engine, trainer side: `client` (the `RolloutEngine` over SGLang's native API) and
`launcher` (starts and owns an SGLang server from its own virtualenv). `server/` is not imported by
graft: it is put first on the SGLang server's PYTHONPATH and runs inside that process."""
