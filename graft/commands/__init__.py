"""Each `graft` command's home: its flags (`add_command`) and what it runs (`run`), one module per
command; the work lives in the packages, imported only when the command runs, so that building the
`graft` parser imports nothing heavy. graft.cli assembles the parser and runs a command.

tiny_model  `graft tiny-model`     model       `graft model`       export   `graft export`
config      `graft config`         train       `graft train`       evaluate `graft eval`
serve       `graft serve`          verify      `graft verify`      quickstart `graft quickstart`
`graft bench` and `graft tenants` keep theirs beside their subcommands: graft.bench.commands,
graft.tenants.command.
"""
