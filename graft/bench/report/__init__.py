"""`graft bench report`: the docs' result tables. `results.py` keeps each bench's latest result in
docs/results/; `runs.py` and `parts.py` turn them into tables (whole runs; parts of a step), built of
`markdown.py`'s pieces; `render.py` finds the docs' blocks and renders them (with the config
reference, through `graft.config.docs_blocks`)."""
