"""The torch.distributed hook: one call in a training script makes the rank report to Flare.

    from producers import torch_hook
    hook = torch_hook.install()        # or install_from_env(): only if FLARE_AGENT=1

This package's surface is the hook's user API (`producers.torch_hook.hook`), so a training
script names one thing; the parts live in their own modules: the op log (`buffer`), the
wrappers (`patch`), the named host stalls (`stalls`), group naming (`groups`), the socket to
the node agent (`client`, `wire`) and the no-code-change launcher (`launch`). Importing it
does not import torch.
"""

from producers.torch_hook.hook import (
    FlareHook,
    HookSettings,
    active,
    install,
    install_from_env,
    phase,
    stall,
    step,
    uninstall,
)

__all__ = ["FlareHook", "HookSettings", "active", "install", "install_from_env", "phase",
           "stall", "step", "uninstall"]
