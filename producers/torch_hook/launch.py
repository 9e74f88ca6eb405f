"""Run a training script with the Flare hook installed first (the no-code-change way).

    FLARE_AGENT=1 torchrun --nproc-per-node 8 -m producers.torch_hook.launch train.py ...
    python -m producers.torch_hook.launch -m my_pkg.train ...

The hook is installed unless FLARE_AGENT=0, then the script (or `-m module`) runs as
`__main__` with its own arguments, exactly as python would run it.
"""

from __future__ import annotations

import os
import runpy
import sys

from producers.torch_hook.hook import HookSettings, install


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        raise SystemExit("usage: python -m producers.torch_hook.launch SCRIPT|-m MODULE [ARGS]")
    settings = HookSettings.from_env()
    if "FLARE_AGENT" not in os.environ or settings.agent:
        install(settings)
    if args[0] == "-m" and len(args) > 1:
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
