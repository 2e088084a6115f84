"""Multirun sweeps over overrides, in Hydra's sweep grammar (what `validate -m` runs).

In: override strings, some of them sweeps (`parallel.ep=1,2`, `optim.lr=range(1,3)`,
`x=choice(a,b)`, parsed by Hydra's override parser). Out: one override list per job, the
cartesian product of the sweeps in the order given (like Hydra's basic sweeper).
"""

from __future__ import annotations

import itertools
from typing import Sequence

from .validate import ConfigError


def sweep_jobs(overrides: Sequence[str]) -> list[list[str]]:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except OverrideParseException as e:
        raise ConfigError(f"cannot parse {e.override!r}: {str(e).splitlines()[0]}") from None
    axes = []
    for o in parsed:
        if o.is_sweep_override():
            axes.append([f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()])
        else:
            axes.append([o.input_line])
    return [list(job) for job in itertools.product(*axes)]
